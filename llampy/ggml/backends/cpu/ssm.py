"""SSM_CONV and SSM_SCAN (Mamba-1 and Mamba-2) in float32, in ggml-cpu's order of operations: the convolution's sum
in kernel order, and per token state = state * exp(dt' * A) + B * (x * dt'), y = the sum of state * C over the
state, dt' = softplus(dt) as ggml computes it. Mamba-1 sums y in index order (ggml's scalar loop). Mamba-2 runs as
ggml's x86 build compiles it, in the build's register width (simd.F16_VEC_LANES, as the other vector kernels): the
state update one FMA (state * exp(dt' A) + the rounded B * x dt': GCC contracts ggml's ``s0*dA + B*x_dt`` so on
AVX2 and AVX-512 alike), y in GGML_F32_STEP lanes (four vectors of the width: 32 lanes on AVX2, 64 on AVX-512) of
FMAs across the state, GGML_F32_VEC_REDUCE's order, then the leftover states (d_state % STEP) one FMA each;
bit-identical to ggml_ssm_scan of that build. Sequences and heads are independent: the threads split them.
"""
from __future__ import annotations

import weakref

import numpy as np
from numba import njit, prange

from ...tensor import Op
from ...types import GGMLType as T

from .act import _silu_row, _swiglu_row
from .builds import parallel_build
from .rows import _in_range, check_index
from .simd import (F16_VEC_LANES, fma32, v16_add, v16_fma, v16_load, v16_mul, v16_reduce, v16_reduce_x8, v16_scale,
                   v16_store, v16_zero)
from .numba_ops import PAR_MIN_ELEMENTS

LANES = F16_VEC_LANES   # GGML_F32_EPR of the build whose order llampy follows (8: AVX2, 16: AVX-512)
STEP = 4 * LANES        # GGML_F32_STEP: GGML_F32_ARR = 4 vectors


@njit(inline="always")
def _conv_row(sx, c, out, s, i, n_t, d_conv):
    for t in range(n_t):
        acc = np.float32(0.0)
        for k in range(d_conv):
            acc += sx[s, i, t + k] * c[i, k]
        out[s, t, i] = acc


@njit(parallel=True, cache=True)
def ssm_conv_f32(sx, c, out):
    """sx (n_s, d_inner, d_conv - 1 + n_t), c (d_inner, d_conv), out (n_s, n_t, d_inner)."""
    n_s, d_inner, _ = sx.shape
    d_conv = c.shape[1]
    n_t = out.shape[1]
    for r in prange(n_s * d_inner):
        _conv_row(sx, c, out, r // d_inner, r % d_inner, n_t, d_conv)


@njit(cache=True)
def ssm_conv_f32_one(sx, c, out):
    """``ssm_conv_f32`` on one thread, channels innermost (a token's output row written in order): for a decoded
    token, whose few thousand products cost less than a parallel region's start."""
    n_s, d_inner, _ = sx.shape
    d_conv = c.shape[1]
    for s in range(n_s):
        xs = sx[s]
        for t in range(out.shape[1]):
            o = out[s, t]
            for i in range(d_inner):
                acc = np.float32(0.0)
                for k in range(d_conv):
                    acc += xs[i, t + k] * c[i, k]
                o[i] = acc


@njit(inline="always")
def _mamba2_token(prev, st, xr, b, c, dA, dsp, yr):
    """One token of one head: st (head_dim, d_state) = the update of prev (st itself, or the starting state at the
    first token: the copy-in and the first update are one pass), xr / yr (head_dim,), b / c (d_state,).
    AVX-512 (LANES 16): ggml's four vectors x0..x3 are four 16-lane vectors, reduced x0 + x2, x1 + x3, their sum,
    then _mm512_reduce_add_ps (v16_reduce). AVX2 (LANES 8): a 32-lane block runs as two 16-lane vectors, lanes 0-15
    holding ggml's x0 and x1, lanes 16-31 x2 and x3, so their sum is x0 + x2, x1 + x3 side by side and
    v16_reduce_x8 finishes GGML_F32x8_REDUCE."""
    head_dim, d_state = st.shape
    nv = d_state - d_state % STEP
    for i in range(head_dim):
        row = st[i]
        src = prev[i]
        x_dt = xr[i] * dsp
        sumf = np.float32(0.0)
        if nv and LANES == 16:
            a0 = v16_zero()
            a1 = v16_zero()
            a2 = v16_zero()
            a3 = v16_zero()
            for k0 in range(0, nv, STEP):
                v = v16_fma(v16_load(src, k0), dA, v16_scale(v16_load(b, k0), x_dt))
                v16_store(row, k0, v)
                a0 = v16_fma(v, v16_load(c, k0), a0)
                v = v16_fma(v16_load(src, k0 + 16), dA, v16_scale(v16_load(b, k0 + 16), x_dt))
                v16_store(row, k0 + 16, v)
                a1 = v16_fma(v, v16_load(c, k0 + 16), a1)
                v = v16_fma(v16_load(src, k0 + 32), dA, v16_scale(v16_load(b, k0 + 32), x_dt))
                v16_store(row, k0 + 32, v)
                a2 = v16_fma(v, v16_load(c, k0 + 32), a2)
                v = v16_fma(v16_load(src, k0 + 48), dA, v16_scale(v16_load(b, k0 + 48), x_dt))
                v16_store(row, k0 + 48, v)
                a3 = v16_fma(v, v16_load(c, k0 + 48), a3)
            sumf = v16_reduce(v16_add(v16_add(a0, a2), v16_add(a1, a3)))
        elif nv:
            lo = v16_zero()
            hi = v16_zero()
            for k0 in range(0, nv, STEP):
                v = v16_fma(v16_load(src, k0), dA, v16_scale(v16_load(b, k0), x_dt))
                v16_store(row, k0, v)
                lo = v16_fma(v, v16_load(c, k0), lo)
                v = v16_fma(v16_load(src, k0 + 16), dA, v16_scale(v16_load(b, k0 + 16), x_dt))
                v16_store(row, k0 + 16, v)
                hi = v16_fma(v, v16_load(c, k0 + 16), hi)
            sumf = v16_reduce_x8(v16_add(lo, hi))
        for k in range(nv, d_state):
            v = fma32(src[k], dA, b[k] * x_dt)
            sumf = fma32(v, c[k], sumf)
            row[k] = v
        yr[i] = sumf


@njit(inline="always")
def _softplus(d):
    return d if d > np.float32(20.0) else np.float32(np.log(np.float32(1.0) + np.exp(d)))


@njit(inline="always")
def _scan_head(s, x, dt, A, B, C, ids, y, out_s, ods, j, h, per_group, per_elem):
    n_tok = x.shape[1]
    head_dim = x.shape[3]
    d_state = s.shape[3]
    g = h // per_group
    st = out_s[ods[j], h]
    src = s[ids[j], h]
    if not per_elem:
        for t in range(n_tok):
            dsp = _softplus(dt[j, t, h])
            dA = np.float32(np.exp(dsp * A[h, 0]))
            if t == 0:
                _mamba2_token(src, st, x[j, t, h], B[j, t, g], C[j, t, g], dA, dsp, y[j, t, h])
            else:
                _mamba2_token(st, st, x[j, t, h], B[j, t, g], C[j, t, g], dA, dsp, y[j, t, h])
        if n_tok == 0:
            st[:, :] = src
        return
    st[:, :] = src
    for t in range(n_tok):
        dsp = _softplus(dt[j, t, h])
        for i in range(head_dim):
            x_dt = x[j, t, h, i] * dsp
            acc = np.float32(0.0)
            for k in range(d_state):
                dA = np.float32(np.exp(dsp * A[h, k]))
                v = st[i, k] * dA + B[j, t, g, k] * x_dt
                acc += v * C[j, t, g, k]
                st[i, k] = v
            y[j, t, h, i] = acc


@njit(parallel=True, cache=True)
def ssm_scan_f32(s, x, dt, A, B, C, ids, y, out_s, ods):
    """s (n_rs, n_head, head_dim, d_state): the states ids[j] starts from; x, y (n_seqs, n_tok, n_head, head_dim);
    dt (n_seqs, n_tok, n_head); A (n_head, d_state) or (n_head, 1); B, C (n_seqs, n_tok, n_group, d_state), each
    row of d_state packed; out_s (n_rows, n_head, head_dim, d_state): sequence j's final state goes to its row
    ods[j] (the node's own states: out_s of n_seqs rows, ods = 0 .. n_seqs - 1; or the memory s itself, ods the
    rows the graph stores them in, ``_Scan``)."""
    n_seqs, _, n_head, _ = x.shape
    per_group = n_head // B.shape[2]
    per_elem = A.shape[1] != 1
    for r in prange(n_seqs * n_head):
        _scan_head(s, x, dt, A, B, C, ids, y, out_s, ods, r // n_head, r % n_head, per_group, per_elem)


def _ssm_gate(z, y, x, d, out):
    """SSM_GATE: out = silu(z) * (y + x * d[h]) row by row; z, y, x, out (n_s, n_t, n_head, head_dim), each row
    contiguous; d (n_head,). The skip's product and sum rounded apart (MUL then ADD), then ggml_vec_swiglu_f32 on
    the row (act._swiglu_row, its lanes from the row's start as the SWIGLU's), in place in out."""
    n_s, n_t, n_h, hd = out.shape
    n16 = hd - hd % 16
    for r in prange(n_s * n_t * n_h):
        j = r // (n_t * n_h)
        t = (r // n_h) % n_t
        h = r % n_h
        o = out[j, t, h]
        yr = y[j, t, h]
        xr = x[j, t, h]
        dh = d[h]
        for i in range(0, n16, 16):
            v16_store(o, i, v16_add(v16_load(yr, i), v16_scale(v16_load(xr, i), dh)))
        for i in range(n16, hd):
            o[i] = yr[i] + xr[i] * dh
        _swiglu_row(z[j, t, h], o, o)


ssm_gate_f32 = njit(cache=True)(_ssm_gate)
ssm_gate_f32_par = parallel_build(_ssm_gate)


def bind_ssm_gate(node, dst, srcs):
    z, y, x = srcs[:3]
    d = srcs[3].reshape(-1)
    fn = ssm_gate_f32_par if node.nelements >= PAR_MIN_ELEMENTS else ssm_gate_f32
    return lambda: fn(z, y, x, d, dst)

def bind_ssm_conv(node, dst, srcs):
    sx = srcs[0][0]
    c = srcs[1][0, 0]
    out = dst[0]
    # one decoded token per sequence: a parallel region's start costs more than the 4 x d_inner products
    fn = ssm_conv_f32_one if out.shape[1] == 1 and out.shape[0] <= 2 else ssm_conv_f32
    return lambda: fn(sx, c, out)


CONV_TOKENS = 8     # tokens per task of the prompt form of SSM_CONV_STATE


@njit(inline="always")
def _bias_silu(o, bias, silu):
    """o += bias (where it has values), then silu in place: the ADD's and SILU's kernels (act._silu_row) on o, a
    token's whole row (silu's vector steps fall where the row's do)."""
    if bias.shape[0]:
        for i in range(o.shape[0]):
            o[i] += bias[i]
    if silu:
        _silu_row(o, o)


@njit(inline="always")
def _conv_state_tokens(x, st, cT, o, t0, t1, dc1, bias, silu):
    """Outputs of tokens t0..t1 of one sequence over its new inputs x (n_t, d_inner), a token's channels side by
    side (rows of x and o read and written in order): each sums window[t + k] * c[i, k] in k order (``_conv_row``'s
    sums; cT is c transposed, (d_conv, d_inner)), the window of channel i being its d_conv - 1 inputs st[i dc1 ..]
    (channel-major) then x[:, i]; then the row's bias and silu (``_bias_silu``). Where the window lies in x alone,
    sixteen channels' sums stay in a register over the taps."""
    d_inner = o.shape[1]
    n16 = d_inner - d_inner % 16
    for t in range(t0, t1):
        ot = o[t]
        if t >= dc1:
            xt = x[t - dc1:t + 1]
            for i0 in range(0, n16, 16):
                acc = v16_zero()
                for k in range(dc1 + 1):
                    acc = v16_add(acc, v16_mul(v16_load(xt[k], i0), v16_load(cT[k], i0)))
                v16_store(ot, i0, acc)
            for i in range(n16, d_inner):
                a = np.float32(0.0)
                for k in range(dc1 + 1):
                    a += xt[k, i] * cT[k, i]
                ot[i] = a
        else:
            for i in range(d_inner):
                ot[i] = np.float32(0.0)
            for k in range(dc1 + 1):
                u = t + k
                ck = cT[k]
                if u < dc1:
                    for i in range(d_inner):
                        ot[i] += st[i * dc1 + u] * ck[i]
                else:
                    xr = x[u - dc1]
                    for i in range(d_inner):
                        ot[i] += xr[i] * ck[i]
        _bias_silu(ot, bias, silu)


@njit(inline="always")
def _conv_state_row(x, st, row, dc1):
    """The sequence's window's last d_conv - 1 inputs into ``row``, which may be ``st`` itself: called once all
    the sequence's outputs are computed."""
    n_t, d_inner = x.shape
    for m in range(dc1):
        u = n_t + m
        if u < dc1:
            for i in range(d_inner):
                row[i * dc1 + m] = st[i * dc1 + u]
        else:
            xr = x[u - dc1]
            for i in range(d_inner):
                row[i * dc1 + m] = xr[i]


@njit(inline="always")
def _conv_state_token(xs, st, c, o, row, dc1, bias, silu):
    """A decoded token of one sequence (``_conv_state_tokens`` then ``_conv_state_row`` with n_t = 1), the channels
    innermost: o (d_inner,) accumulates each tap over all channels (the same sums in k order, independent chains
    side by side), then the rows shift by one input."""
    d_inner = o.shape[0]
    for i in range(d_inner):
        o[i] = np.float32(0.0)
    for k in range(dc1):
        for i in range(d_inner):
            o[i] += st[i * dc1 + k] * c[i, k]
    for i in range(d_inner):
        o[i] += xs[i] * c[i, dc1]
    _bias_silu(o, bias, silu)
    # the row moves down one value (a channel's last slot takes the next channel's first, then x overwrites it)
    for p in range(d_inner * dc1 - 1):
        row[p] = st[p + 1]
    for i in range(d_inner):
        row[i * dc1 + dc1 - 1] = xs[i]


@njit(inline="always")
def _start_rows(r, src, dst, tmp):
    """Where each sequence's starting row is read from: -1, r itself (no sequence's target row is another's
    starting row); -2, copies in tmp (every starting row read before any is written: copy on write within the
    batch); else the position of the first index outside r (src first, then n_s + the dst's)."""
    n_rows, n_s = r.shape[0], src.shape[0]
    for j in range(n_s):
        if src[j] < 0 or src[j] >= n_rows:
            return j
        if dst[j] < 0 or dst[j] >= n_rows:
            return n_s + j
    for j in range(n_s):
        for q in range(n_s):
            if q != j and dst[j] == src[q]:
                for p in range(n_s):
                    tmp[p] = r[src[p]]
                return -2
    return -1


@njit(parallel=True, cache=True)
def ssm_conv_state_f32(x, c, r, src, dst, out, tmp, bias, silu):
    """SSM_CONV_STATE: x (n_s, n_t, d_inner) the new inputs, c (d_inner, d_conv), r (n_rows, (d_conv - 1) d_inner)
    the rolling rows, src / dst (n_s,) each sequence's row to start from and to write, out (n_s, n_t, d_inner), tmp
    (n_s, (d_conv - 1) d_inner) scratch, bias (d_inner,) or empty and silu (``_bias_silu``). The threads split
    sequences and runs of CONV_TOKENS tokens, then the rows are written. -1, or the position of a row index outside
    r (src first, then n_s + the dst's). Tokens, not channels, split the work: a block of channels walking the
    tokens read x and wrote out a few hundred bytes every 9-17 KiB, where the prefetchers do not follow (Mamba-2
    370M, pp512, one thread: 4.4 -> 3.3 ms a layer; 1.5 with the sums in registers)."""
    how = _start_rows(r, src, dst, tmp)
    if how >= 0:
        return how
    n_s, n_t, d_inner = x.shape
    dc1 = c.shape[1] - 1
    cT = np.ascontiguousarray(c.T)
    nblk = (n_t + CONV_TOKENS - 1) // CONV_TOKENS
    for q in prange(n_s * nblk):
        j = q // nblk
        t0 = (q % nblk) * CONV_TOKENS
        st = tmp[j] if how == -2 else r[src[j]]
        _conv_state_tokens(x[j], st, cT, out[j], t0, min(n_t, t0 + CONV_TOKENS), dc1, bias, silu)
    for j in range(n_s):
        _conv_state_row(x[j], tmp[j] if how == -2 else r[src[j]], r[dst[j]], dc1)
    return -1


@njit(cache=True)
def ssm_conv_state_f32_one(x, c, r, src, dst, out, tmp, bias, silu):
    """``ssm_conv_state_f32`` on one thread, for decoded tokens (a parallel region costs more than the work)."""
    how = _start_rows(r, src, dst, tmp)
    if how >= 0:
        return how
    n_s, n_t, d_inner = x.shape
    dc1 = c.shape[1] - 1
    for j in range(n_s):
        st = tmp[j] if how == -2 else r[src[j]]
        if n_t == 1:
            _conv_state_token(x[j, 0], st, c, out[j, 0], r[dst[j]], dc1, bias, silu)
        else:
            _conv_state_tokens(x[j], st, np.ascontiguousarray(c.T), out[j], 0, n_t, dc1, bias, silu)
            _conv_state_row(x[j], st, r[dst[j]], dc1)
    return -1


def bind_ssm_conv_state(node, dst, srcs):
    x = srcs[0][0]
    c = srcs[1][0, 0]
    r = srcs[2][0, 0]
    src, dst_ids = srcs[3].reshape(-1), srcs[4].reshape(-1)
    out = dst[0]
    tmp = np.empty((x.shape[0], r.shape[1]), np.float32)
    bias = srcs[5].reshape(-1) if len(srcs) > 5 else np.zeros(0, np.float32)
    silu = bool(node.op_params.get("silu"))
    fn = ssm_conv_state_f32_one if out.shape[1] == 1 and out.shape[0] <= 2 else ssm_conv_state_f32

    def run():
        bad = fn(x, c, r, src, dst_ids, out, tmp, bias, silu)
        if bad >= 0:
            which, ids = ("src", src) if bad < len(src) else ("dst", dst_ids)
            raise IndexError(f"ssm_conv_state: {which} rows {ids.tolist()} outside 0..{r.shape[0] - 1}")
    return run


def bind_ssm_scan(node, dst, srcs):
    x_t = node.src[1]
    s = srcs[0]
    x = srcs[1]
    dt = srcs[2][0]
    A = srcs[3][0, 0]
    B, C = srcs[4], srcs[5]
    ids = srcs[6].reshape(-1)
    flat = dst.reshape(-1)
    nx = x_t.nelements
    y = flat[:nx].reshape(x.shape)
    out_s = flat[nx:].reshape((x.shape[0],) + s.shape[1:])
    scan = _Scan(s, x, dt, A, B, C, ids, y, out_s)
    _SCANS[node.id] = scan
    return scan


PACK_MIN_TOKENS = 16    # tokens a sequence from which a scan reads packed copies of B and C (``_Scan``)

# the plan's bound scans by node id, for the SET_ROWS that stores their states (``bind_state_store``)
_SCANS: "weakref.WeakValueDictionary[int, _Scan]" = weakref.WeakValueDictionary()


class _Scan:
    """A bound SSM_SCAN. Alone it writes the final states into the node's own result, which the graph's SET_ROWS
    then copies into the recurrent memory (llama.cpp's build_rs); once that SET_ROWS is bound to it
    (``bind_state_store``) it writes them straight into the memory rows the SET_ROWS names, which then has nothing
    left to do: a
    decoded token of Mamba-2 370M copied 48 states of 1 MiB each, on one thread. Where a sequence's target row is
    another sequence's starting row (copy on write within the batch), the threads could overwrite a state before
    it is read: that batch runs unfused.

    A prompt's B and C are views into the convolution's rows (Mamba-2: x, B, C side by side, 9 KiB a token), which
    every head walks token by token: the scan reads them from packed copies made before each run (PACK_MIN_TOKENS
    tokens and more; Mamba-2 370M, pp512, one thread: 20.6 -> 17.5 ms a layer, the hardware prefetchers do not
    follow a stride across pages)."""

    def __init__(self, s, x, dt, A, B, C, ids, y, out_s):
        self.packs = []          # (view, its packed copy) pairs copied before each run
        if x.shape[1] >= PACK_MIN_TOKENS:
            if not B.flags.c_contiguous:
                self.packs.append((B, np.empty(B.shape, np.float32)))
                B = self.packs[-1][1]
            if not C.flags.c_contiguous:
                self.packs.append((C, np.empty(C.shape, np.float32)))
                C = self.packs[-1][1]
        self.args = (s, x, dt, A, B, C, ids, y)
        self.out_s = out_s
        self.own = np.arange(out_s.shape[0], dtype=np.int32)
        self.store = None        # the SET_ROWS' row ids, once bound to it
        self.stored = False      # the last run wrote the memory rows itself

    def __call__(self):
        s, ids = self.args[0], self.args[6]
        if len(ids) and not _in_range(ids, s.shape[0]):
            raise IndexError(f"ssm_scan: state rows {ids.tolist()} outside 0..{s.shape[0] - 1}")
        self.stored = False
        for view, packed in self.packs:
            np.copyto(packed, view)
        if self.store is not None:
            dst_ids = self.store
            check_index(dst_ids, s.shape[0], "set_rows")
            if _disjoint(ids, dst_ids):
                ssm_scan_f32(*self.args, s, dst_ids.astype(np.int32, copy=False))
                self.stored = True
                return
        ssm_scan_f32(*self.args, self.out_s, self.own)


def _disjoint(src, dst) -> bool:
    """No sequence's target row is another sequence's starting row (which it would overwrite before that sequence
    read it: copy on write, seq_cp then both decoding in one batch), and no two share a target."""
    n = len(dst)
    if n == 1:
        return True
    d, s = [int(v) for v in dst], [int(v) for v in src]
    return len(set(d)) == n and not any(s[k] == d[j] for j in range(n) for k in range(n) if k != j)


def bind_state_store(node, dst, srcs):
    """The SET_ROWS of a bound scan's final states into the memory that scan reads its states from (a Mamba-2
    layer's state store): the scan writes them there itself (``_Scan``), and this call copies only when that scan's
    batch ran unfused. None for any other SET_ROWS."""
    src_t = node.src[0]
    scan_t = src_t.view_src if src_t.view_src is not None else src_t
    scan = _SCANS.get(scan_t.id) if scan_t.op == Op.SSM_SCAN else None
    if scan is None or node.type != T.F32 or src_t.type != T.F32:
        return None
    s, out_s, src = scan.args[0], scan.out_s, srcs[0]
    # the SET_ROWS reads exactly the states' part of the scan's result and writes into the scan's own memory
    if (src.__array_interface__["data"][0] != out_s.__array_interface__["data"][0] or src.size != out_s.size
            or not src.flags.c_contiguous or not dst.flags.c_contiguous
            or dst.__array_interface__["data"][0] != s.__array_interface__["data"][0] or dst.size != s.size):
        return None
    idx = srcs[1].reshape(-1)
    if idx.shape[0] != out_s.shape[0]:
        return None
    scan.store = idx
    rows_src, rows_dst = out_s.reshape(out_s.shape[0], -1), s.reshape(s.shape[0], -1)

    def run():
        if scan.stored:
            return
        check_index(idx, rows_dst.shape[0], "set_rows")
        for j in range(idx.shape[0]):
            rows_dst[int(idx[j])] = rows_src[j]
    return run
