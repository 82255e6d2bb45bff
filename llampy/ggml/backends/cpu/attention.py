"""FLASH_ATTN_EXT on the CPU, with the numerics of ggml's CPU kernels:

- few queries (decode, small batches: ggml's ``one_chunk`` path, n_q < 64): Q rounded to F16, Q·K in float32 over
  F16 K, online softmax, and with F16 V the output accumulator itself kept in F16 (rounded after every scale and
  every multiply-add), in Numba; Q·K summed in the order of the host build's register width (``_kq``);
- many queries (ggml's tiled path, n_q >= 64, F16/F32 K and V): its float order, in attention_tiled.py;
- other K/V types on the few-query path (F32, quantized): float32 products, BLAS's (numpy's OpenBLAS called from a Numba kernel,
  ``_attend_tiles``, or through numpy where that cannot be reached), per KV head and chunk of queries, each
  multiplying only the cells its mask leaves visible.
"""
from __future__ import annotations

import math
import threading

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from .numpy_ops import alibi_slopes
from .dot_q32 import F16_TABLE
from .blas import sgemm
from .softmax import expf
from .simd import (F16_VEC_LANES, fma32, round_f16, v16_add, v16_exp_shifted, v16_fma, v16_hmax, v16_find_ne, v16_load,
                   v16_max, v16_reduce, v16_reduce_x8, v16_round_f16, v16_scale, v16_splat, v16_store, v16_zero)
from .dot_blocks import K_BF16, _fdot, f32x8_ld
from .simd import f32x8_fma, f32x8_load, f32x8_scale, f32x8_store
from ...blocks import bf16_from_bits, f16_from_bits

Q_TILE = 64
KQ_STEP = 4 * F16_VEC_LANES     # ggml_vec_dot_f16's step: four accumulators of the host's register width


@njit(cache=True, nogil=True, inline="always")
def _kq(qr, kr, d):
    """ggml_vec_dot_f16 of a query row (float32 array of F16 values) and a K row (F16 bits) as the host's build
    runs it. AVX-512: four sixteen-lane accumulators over each 64 values, reduced (a0 + a2) + (a1 + a3) and then
    as _mm512_reduce_add_ps. AVX/AVX2: four eight-lane accumulators over each 32 values, here two sixteen-lane
    ones holding a0|a1 and a2|a3 (the same lanes, so the same sums), reduced as GGML_F32x8_REDUCE. The values past
    the last full step: float32 products added one by one in double, as ggml's leftover loop."""
    dvec = d - d % KQ_STEP
    if F16_VEC_LANES == 16:
        s0 = s1 = s2 = s3 = v16_zero()
        for j in range(0, dvec, 64):
            s0 = v16_fma(v16_load(qr, j), v16_load(kr, j), s0)
            s1 = v16_fma(v16_load(qr, j + 16), v16_load(kr, j + 16), s1)
            s2 = v16_fma(v16_load(qr, j + 32), v16_load(kr, j + 32), s2)
            s3 = v16_fma(v16_load(qr, j + 48), v16_load(kr, j + 48), s3)
        r = v16_reduce(v16_add(v16_add(s0, s2), v16_add(s1, s3)))
    else:
        s0 = s1 = v16_zero()
        for j in range(0, dvec, 32):
            s0 = v16_fma(v16_load(qr, j), v16_load(kr, j), s0)
            s1 = v16_fma(v16_load(qr, j + 16), v16_load(kr, j + 16), s1)
        r = v16_reduce_x8(v16_add(s0, s1))
    if dvec == d:
        return r
    sf = np.float64(r)
    for j in range(dvec, d):
        sf += np.float64(qr[j] * f16_from_bits(np.int32(kr[j])))
    return np.float32(sf)


@njit(cache=True, nogil=True, inline="always")
def _add_sink(acc, S, M, s):
    """ggml's attention sink after the cells: one more logit s with no value joins the row's softmax (the
    accumulator is float32 by then: no F16 rounding); returns the new sum."""
    if s > M:
        ms = expf(np.float32(M - s))
        for j in range(acc.shape[0]):
            acc[j] = acc[j] * ms
        return fma32(S, ms, np.float32(1.0))
    return fma32(S, np.float32(1.0), expf(np.float32(s - M)))


def _mask_value(x, tab):
    """A mask entry as float32: F16 bits (uint16) through the table, a float as it is."""


@overload(_mask_value, inline="always")
def _mask_value_impl(x, tab):
    if isinstance(x, types.Integer):
        return lambda x, tab: tab[x]
    return lambda x, tab: np.float32(x)


# A mask word (8 bytes) whose every entry hides its cell: four F16 -inf, or two float32 -inf
_HIDDEN_WORD = {2: np.uint64(0xFC00FC00FC00FC00), 4: np.uint64(0xFF800000FF800000)}


def _visible(mask, n_q, tab):
    """The cells each mask row leaves visible, in cell order: rows (m3, m2, i1 < n_q) flattened; idx[r, :cnt[r]]
    the cells, val[r, :cnt[r]] their mask values. mask: float32, or F16 bits (uint16) read through ``tab``. A
    decode batch of several sequences sees a few cells in each row; walking only those keeps the kernel's cost
    independent of the masked ones.
    First, where each row's visible cells lie: its entries read as 64-bit words (``_spans``), a test per word
    without stores that LLVM vectorizes; then only that span is read again to list them. A server's decode step has
    each query's few cells in its own stream of the cache, among n_kv = the whole cache (16384 cells at 32 slots x
    512: listing every entry of every row cost ~1 ms per layer there, the span scan ~0.08 ms, one thread; too
    little to pay for a parallel region's wake-ups)."""
    n_kv = mask.shape[3]
    per = 8 // mask.itemsize
    words = None
    if mask.itemsize in _HIDDEN_WORD and n_kv % per == 0 and mask.strides[3] == mask.itemsize:
        try:
            words = mask.view(np.uint64)
        except ValueError:      # a layout numpy cannot reinterpret: every row's span is all of it
            words = None
    if words is not None:
        lo, hi = _spans(words, n_q, _HIDDEN_WORD[mask.itemsize], per)
    else:
        n_rows = mask.shape[0] * mask.shape[1] * n_q
        lo, hi = np.zeros(n_rows, np.int64), np.full(n_rows, n_kv, np.int64)
    return _visible_in(mask, n_q, tab, lo, hi)


@njit(cache=True, nogil=True)
def _spans(words, n_q, hidden, per):
    """[lo, hi): the span of each mask row (``_visible``'s order) outside which every entry is -inf, from its
    entries as 64-bit words (``per`` entries each), tested four words at a time."""
    m3, m2, n_w = words.shape[0], words.shape[1], words.shape[3]
    n_rows = m3 * m2 * n_q
    lo = np.zeros(n_rows, np.int64)
    hi = np.zeros(n_rows, np.int64)
    n4 = n_w - n_w % 4
    for r in range(n_rows):
        row = words[r // (m2 * n_q), (r // n_q) % m2, r % n_q]
        first, last = n_w, 0
        for j0 in range(0, n4, 4):
            h = (row[j0] ^ hidden) | (row[j0 + 1] ^ hidden) | (row[j0 + 2] ^ hidden) | (row[j0 + 3] ^ hidden)
            if h != 0:
                first = min(first, j0)
                last = j0 + 4
        for j in range(n4, n_w):
            if row[j] != hidden:
                first = min(first, j)
                last = j + 1
        if first < last:
            lo[r], hi[r] = first * per, last * per
    return lo, hi


@njit(cache=True, nogil=True)
def _visible_in(mask, n_q, tab, lo, hi):
    """``_visible``'s lists, each row read over its span [lo, hi) only."""
    m3, m2 = mask.shape[0], mask.shape[1]
    n_rows = m3 * m2 * n_q
    width = max(1, (hi - lo).max()) if n_rows else 1
    idx = np.empty((n_rows, width), np.int32)
    val = np.empty((n_rows, width), np.float32)
    cnt = np.zeros(n_rows, np.int32)
    for r in range(n_rows):
        row = mask[r // (m2 * n_q), (r // n_q) % m2, r % n_q]
        c = 0
        for ic in range(lo[r], hi[r]):
            x = _mask_value(row[ic], tab)
            if x != -np.inf:
                idx[r, c] = ic
                val[r, c] = x
                c += 1
        cnt[r] = c
    return idx, val, cnt


def visible_cells(mask, n_q, n_kv):
    """What ``_fa_vec16_kernel`` reads of a mask: (idx, val, cnt, m3, m2, n_qm), ``_visible``'s lists of the first
    n_q rows (every one of n_kv cells where the mask is empty). Layers that share a mask can share these."""
    if mask.shape[3] == 0:
        return _all_visible(n_kv) + (1, 1, 1)
    return _visible(mask, n_q, F16_TABLE) + (mask.shape[0], mask.shape[1], n_q)


def _fa_vec16(q, k, v, mask, out, scale, softcap, slopes, sinks=None, k_bf16=False, v_bf16=False, visible=None):
    """ggml's one_chunk flash attention over F16 or BF16 K and V (see ``_fa_vec16_kernel``). q (ne3, n_head, n_q, d)
    f32; k (ke3, n_head_kv, n_kv, d), v (ve3, n_head_kv, n_kv, dv) F16 bits (uint16), or BF16 bits where k_bf16 /
    v_bf16; out (ne3, n_q, n_head, dv) f32. mask: float32, or F16 bits as uint16, (m3, m2, >= n_q, n_kv); an empty
    last axis for none. sinks: float32 (n_head,) or None. visible: ``visible_cells`` of this mask, if known."""
    sinks = _NO_SINKS if sinks is None else sinks
    if k_bf16:      # ggml's q_to_vec_dot for a BF16 K: each value rounded to BF16 (ggml_cpu_fp32_to_bf16)
        from .act_quant import round_half
        from ...types import GGMLType
        q = round_half(q, GGMLType.BF16)
    if visible is None:
        visible = visible_cells(mask, q.shape[2], k.shape[2])
    idx, val, cnt, m3, m2, n_qm = visible
    if k_bf16 or v_bf16:
        _fa_vec_bf16_kernel(q, k, v, idx, val, cnt, m3, m2, n_qm, out, scale, softcap, slopes, sinks, k_bf16, v_bf16)
    else:
        _fa_vec16_kernel(q, k, v, idx, val, cnt, m3, m2, n_qm, out, scale, softcap, slopes, sinks)


_NO_SINKS = np.zeros(0, np.float32)


def _all_visible(n_kv):
    return (np.arange(n_kv, dtype=np.int32)[None, :], np.zeros((1, n_kv), np.float32),
            np.array([n_kv], np.int32))


@njit(parallel=True, cache=True, nogil=True)
def _fa_vec16_kernel(q, k, v, idx, val, cnt, m3, m2, n_qm, out, scale, softcap, slopes, sinks):
    """``_fa_row`` for every query row, F16 K and V (the types constant: the per-cell branches compiled away)."""
    for it in prange(q.shape[0] * q.shape[1] * q.shape[2]):
        _fa_row(q, k, v, idx, val, cnt, m3, m2, n_qm, out, scale, softcap, slopes, sinks, False, False, it)


@njit(parallel=True, cache=True, nogil=True)
def _fa_vec_bf16_kernel(q, k, v, idx, val, cnt, m3, m2, n_qm, out, scale, softcap, slopes, sinks, k_bf16, v_bf16):
    """``_fa_row`` for every query row, a BF16 K or V."""
    for it in prange(q.shape[0] * q.shape[1] * q.shape[2]):
        _fa_row(q, k, v, idx, val, cnt, m3, m2, n_qm, out, scale, softcap, slopes, sinks, k_bf16, v_bf16, it)


@njit(cache=True, nogil=True, inline="always")
def _fa_row(q, k, v, idx, val, cnt, m3, m2, n_qm, out, scale, softcap, slopes, sinks, k_bf16, v_bf16, it):
    """Query row ``it`` (batch, head, query) of ggml's one_chunk flash attention for F16 or BF16 K and V. K F16: Q
    rounded to F16, per visible cell ggml_vec_dot_f16 in the host build's order (``_kq``); K BF16: Q already rounded
    to BF16 by the caller, ggml_vec_dot_bf16 in its AVX2 form (dot_blocks ``_fdot``, as llampy's BF16 products).
    Then the online softmax.
    V F16: the accumulator itself in F16, ggml_vec_scale_f16 / ggml_vec_mad_f16 (float32 multiply or fma, rounded
    to F16 per value: the same in any register width; the leftover values' scalar form is contracted to the same
    fma). V BF16 (any V but F16 in ggml): a float32 accumulator, V widened exactly (v_to_float), ggml_vec_scale_f32
    / ggml_vec_mad_f32 (a multiply, an fma per value). Only the visible cells of each query's mask row are visited
    (``_visible``), in cell order as ggml's loop meets them when it skips the -inf ones; n_qm 1 with m3 = m2 = 1:
    one row for every query (no mask)."""
    ne3, n_head, n_q, d = q.shape
    n_head_kv = k.shape[1]
    dv = v.shape[3]
    rk = n_head // n_head_kv
    i3 = it // (n_head * n_q)
    h = (it // n_q) % n_head
    i1 = it % n_q
    hk = h // rk
    r = ((i3 % m3) * m2 + h % m2) * n_qm + (i1 if n_qm > 1 else 0)
    qr = np.empty(d, np.float32)
    qrow = q[i3, h, i1]
    d16 = d - d % 16
    if k_bf16:
        qr[:] = qrow
    else:
        for j in range(0, d16, 16):
            v16_store(qr, j, v16_round_f16(v16_load(qrow, j)))
        for j in range(d16, d):
            qr[j] = round_f16(qrow[j])
    dv16 = dv - dv % 16
    dv8 = dv - dv % 8
    acc = np.zeros(dv, np.float32)
    M = np.float32(-np.inf)
    S = np.float32(0.0)
    slope = slopes[h]
    kh = k[i3 % k.shape[0], hk]
    vh = v[i3 % v.shape[0], hk]
    ridx = idx[r]
    rval = val[r]
    for t in range(cnt[r]):
        ic = ridx[t]
        mv = slope * rval[t]
        if mv == -np.inf:          # a finite mask value that the ALiBi slope took to -inf
            continue
        s = (_fdot(K_BF16, kh[ic], qr, d) if k_bf16 else _kq(qr, kh[ic], d)) * scale
        if softcap != 0.0:
            s = softcap * np.float32(math.tanh(s))
        s += mv
        ms = np.float32(1.0)
        vs = np.float32(1.0)
        vr = vh[ic]
        if s > M:
            Mold = M
            M = s
            ms = np.float32(math.exp(Mold - M))
            if v_bf16:
                for j in range(0, dv8, 8):
                    f32x8_store(acc, j, f32x8_scale(f32x8_load(acc, j), ms))
                for j in range(dv8, dv):
                    acc[j] = acc[j] * ms
            else:
                for j in range(0, dv16, 16):
                    v16_store(acc, j, v16_round_f16(v16_scale(v16_load(acc, j), ms)))
                for j in range(dv16, dv):
                    acc[j] = round_f16(acc[j] * ms)
        else:
            vs = np.float32(math.exp(s - M))
        if v_bf16:
            for j in range(0, dv8, 8):
                f32x8_store(acc, j, f32x8_fma(vs, f32x8_ld(vr, j, True), f32x8_load(acc, j)))
            for j in range(dv8, dv):
                acc[j] = fma32(bf16_from_bits(np.int32(vr[j])), vs, acc[j])
        else:
            for j in range(0, dv16, 16):
                v16_store(acc, j, v16_round_f16(v16_fma(v16_load(vr, j), vs, v16_load(acc, j))))
            for j in range(dv16, dv):
                acc[j] = round_f16(fma32(f16_from_bits(np.int32(vr[j])), vs, acc[j]))
        S = fma32(S, ms, vs)
    if sinks.shape[0] > 0:
        S = _add_sink(acc, S, M, sinks[h])
    inv = np.float32(1.0) / S if S != 0 else np.float32(0.0)
    for j in range(dv):
        out[i3, i1, h, j] = acc[j] * inv


def use_tiled(k_type, v_type, n_q: int, dv: int) -> bool:
    """ggml's choice of its tiled path: F16/F32 K and V of one type, at least Q_TILE queries (whatever dv: ggml's
    x86 build skips the dv % GGML_F32_EPR test that its other builds make)."""
    from ...types import GGMLType as T
    return k_type in (T.F16, T.F32) and k_type == v_type and n_q >= Q_TILE


def flash_attn(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None, out: np.ndarray,
               scale: float, max_bias: float, softcap: float, k_f16: bool, v_f16: bool, tiled: bool = False,
               q_dot_type=None, sinks: np.ndarray | None = None, k_bf16: bool = False, v_bf16: bool = False) -> None:
    """q (ne3, n_head, n_q, d) float32; k, v (.., n_head_kv, n_kv, d) as F16 bits (uint16) when k_f16/v_f16, BF16
    bits when k_bf16/v_bf16, else float32; mask (m3, m2, >= n_q, n_kv) float32 or None; out (ne3, n_q, n_head, dv)
    float32. ``tiled``: ggml's tiled path (float32 Q); else its one_chunk path, Q rounded through K's dot type
    ``q_dot_type``. sinks: float32 (n_head,), one more logit per head in each row's softmax, or None."""
    sinks = _NO_SINKS if sinks is None else np.ascontiguousarray(sinks, np.float32)
    n_head, n_q = q.shape[1], q.shape[2]
    slopes = alibi_slopes(n_head, max_bias, np.float32)
    sc = np.float32(scale / softcap) if softcap else np.float32(scale)
    if not tiled and (k_f16 or k_bf16) and (v_f16 or v_bf16):
        m = mask if mask is not None else np.zeros((1, 1, 1, 0), np.float32)
        res = np.empty(out.shape, np.float32)
        _fa_vec16(np.ascontiguousarray(q, dtype=np.float32), np.ascontiguousarray(k), np.ascontiguousarray(v),
                  np.ascontiguousarray(m, dtype=np.float32), res, sc, np.float32(softcap), slopes, sinks,
                  k_bf16, v_bf16)
        out[...] = res
        return
    if tiled:           # ggml's tiled kernel in its float order (attention_tiled.py)
        from .attention_tiled import flash_attn_tiled
        flash_attn_tiled(q, k, v, mask, out, scale, softcap, slopes, sinks)
        return
    # one_chunk with other K/V types (up to float32 summation order): float32 products, exact softmax per row
    if not tiled and q_dot_type is not None:
        from .act_quant import round_act
        q = round_act(np.ascontiguousarray(q.reshape(-1, q.shape[-1]), np.float32), q_dot_type).reshape(q.shape)
    kf = _f16_to_f32(k) if k_f16 else _bf16_to_f32(k) if k_bf16 else k.astype(np.float32)
    vf = _f16_to_f32(v) if v_f16 else _bf16_to_f32(v) if v_bf16 else v.astype(np.float32)
    _attend_blas(q, kf, vf, mask, out, sc, softcap, slopes, sinks)


def _bf16_to_f32(a: np.ndarray) -> np.ndarray:
    """BF16 bits (uint16) as float32: the bits shifted to the top of each value (exact)."""
    return (np.asarray(a, np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def _f16_to_f32(a: np.ndarray) -> np.ndarray:
    """F16 bits (uint16, any leading shape, rows contiguous) as float32, sixteen values per vcvtph2ps."""
    if a.strides[-1] != 2 or a.shape[-1] % 16:
        return F16_TABLE[a]
    rows = a.reshape(-1, a.shape[-1]) if a.flags.c_contiguous else np.ascontiguousarray(a).reshape(-1, a.shape[-1])
    out = np.empty(rows.shape, np.float32)
    _f16_rows(rows, out)
    return out.reshape(a.shape)


@njit(cache=True, nogil=True)
def _f16_rows(a, out):
    for r in range(a.shape[0]):
        ar, orow = a[r], out[r]
        for j in range(0, a.shape[1], 16):
            v16_store(orow, j, v16_load(ar, j))


Q_CHUNK = 128   # queries per BLAS product: a causal mask hides the rest of the cache from each chunk
SUB = 32        # queries per sub-block of a chunk: the keys past the chunk's common span are multiplied per sub-block


@njit(cache=True, nogil=True, inline="always")
def _softmax_row(row, L, sc, softcap, mrow, sl, has_mask):
    """exp(v - max(v)) over row[:L] in place, v = s * sc (softcap * tanh(s * sc) when softcap) + sl * mrow; the sum
    and the max returned (1 and -inf for a fully masked row, whose values become 0). The exponentials are ggml_v_expf in sixteen lanes."""
    L16 = L - L % 16
    if softcap != 0.0:
        for j in range(L):
            row[j] = softcap * np.float32(math.tanh(row[j] * sc))
        sc = np.float32(1.0)    # x * 1 is x
    vm = v16_splat(-np.inf)
    if has_mask:
        for j in range(0, L16, 16):
            v = v16_add(v16_scale(v16_load(row, j), sc), v16_scale(v16_load(mrow, j), sl))
            v16_store(row, j, v)
            vm = v16_max(vm, v)
        for j in range(L16, L):
            row[j] = row[j] * sc + sl * mrow[j]
    else:
        for j in range(0, L16, 16):
            v = v16_scale(v16_load(row, j), sc)
            v16_store(row, j, v)
            vm = v16_max(vm, v)
        for j in range(L16, L):
            row[j] = row[j] * sc
    mx = v16_hmax(vm)
    for j in range(L16, L):
        if row[j] > mx:
            mx = row[j]
    if mx == -np.inf:
        row[:L] = 0
        return np.float32(1.0), mx
    tot = np.float32(0.0)
    for j in range(0, L16, 16):
        e = v16_exp_shifted(v16_load(row, j), mx)
        v16_store(row, j, e)
        tot += v16_reduce(e)
    for j in range(L16, L):
        e = np.float32(math.exp(row[j] - mx))
        row[j] = e
        tot += e
    return tot, mx


@njit(cache=True, nogil=True)
def _softmax_rows(s, sc, softcap, m, h0, slopes, qc, den, mxs):
    """``_softmax_row`` over s (rows, L) in place, row r belonging to head h0 + r // qc and query r % qc: mask row
    m[(h0 + r // qc) % m.shape[0], r % qc] (none when m's last axis is empty), slope slopes[h0 + r // qc]; den[r] the
    row's sum, mxs[r] its max."""
    rows, L = s.shape
    has_mask = m.shape[2] > 0
    for r in range(rows):
        h = h0 + r // qc
        mrow = m[h % m.shape[0], r % qc] if has_mask else m[0, 0]
        den[r], mxs[r] = _softmax_row(s[r], L, sc, softcap, mrow, slopes[h], has_mask)


@njit(cache=True, nogil=True)
def _divide_into(o, den, out):
    """out[q, h, :] = o[h, q, :] / den[h * qc + q]: the softmax's normalisation and the (head, query) -> (query,
    head) transpose in one pass (were a NumPy division in place, then a strided copy)."""
    rk, qc, dv = o.shape
    for h in range(rk):
        for q in range(qc):
            d = den[h * qc + q]
            orow, dst = o[h, q], out[q, h]
            for j in range(dv):
                dst[j] = orow[j] / d


def _attend_blas(q, kf, vf, mask, out, sc, softcap, slopes, sinks):
    """Softmax attention through float32 matrix products: BLAS called from a Numba kernel (``_attend_tiles``) where
    numpy's OpenBLAS can be reached, else through numpy (``_attend_numpy``)."""
    from . import blas, matmul
    fn = blas.sgemm_address()
    if not fn or not USE_TILES:
        _attend_numpy(q, kf, vf, mask, out, sc, softcap, slopes, sinks)
        return
    nt = matmul._blas_workers()          # also keeps OpenBLAS itself on one thread
    m = mask if mask is not None else np.zeros((1, 1, 1, 0), np.float32)
    _attend_tiles(fn, q, np.ascontiguousarray(kf, np.float32), np.ascontiguousarray(vf, np.float32),
                  np.ascontiguousarray(m, np.float32), out, np.float32(sc), np.float32(softcap), slopes, nt, sinks)


USE_TILES = True    # False: the numpy path even where the Numba-called BLAS is available (tests compare the two)


@njit(cache=True, nogil=True)
def _sub_spans(mask, n_q, n_kv):
    """The span of cells [lo, hi) each sub-block of SUB queries sees (any head's mask row), per mask batch: lo, hi
    (m3, ceil(n_q / SUB)); hi = lo = 0 where every row of the sub-block is fully masked. Scans each row from both
    ends only as far as the sub-block's span so far (under a causal mask: the masked tail of each row)."""
    m3, m2 = mask.shape[0], mask.shape[1]
    nsb = (n_q + SUB - 1) // SUB
    lo = np.zeros((m3, nsb), np.int64)
    hi = np.zeros((m3, nsb), np.int64)
    for a in range(m3):
        for j in range(nsb):
            l, h = n_kv, 0
            for b in range(m2):
                for i in range(j * SUB, min(n_q, (j + 1) * SUB)):
                    row = mask[a, b, i]
                    c = 0
                    while c + 16 <= l:          # sixteen cells per compare while they are all masked
                        f = v16_find_ne(v16_load(row, c), -np.inf, False)
                        c += f
                        if f < 16:
                            break
                    while c < l and row[c] == -np.inf:
                        c += 1
                    l = c
                    c = n_kv
                    while c - 16 >= h:
                        f = v16_find_ne(v16_load(row, c - 16), -np.inf, True)
                        c -= 15 - f
                        if f >= 0:
                            break
                    while c > h and row[c - 1] == -np.inf:
                        c -= 1
                    h = c
            if h > l:
                lo[a, j], hi[a, j] = l, h
    return lo, hi


@njit(cache=True, inline="always")
def _sub_rows(j, q0, nq, rk):
    """(first row, rows) of sub-block j in the chunk of nq queries from q0, rk rows per query."""
    return (j * SUB - q0) * rk, (min(q0 + nq, (j + 1) * SUB) - j * SUB) * rk


@njit(cache=True, nogil=True)
def _scores(fn, A, ao, d, kb, sbuf, rows, lo, hmin, W, shi, j0, j1, q0, nq, rk):
    """The chunk's scores into sbuf (rows x W from cell lo): every row times cells [lo, hmin), then each sub-block's
    rows times its cells [hmin, its end). A: the chunk's query rows of d values, back to back from element ao; kb:
    K's rows; shi: each sub-block's end."""
    if hmin > lo:
        sgemm(fn, True, rows, hmin - lo, d, A, ao, d, kb, lo * d, d, np.float32(0.0), sbuf, 0, W)
    for j in range(j0, j1):
        h = max(lo, shi[j])
        if h > hmin:
            r0, nr = _sub_rows(j, q0, nq, rk)
            sgemm(fn, True, nr, h - hmin, d, A, ao + r0 * d, d, kb, hmin * d, d, np.float32(0.0),
                  sbuf, r0 * W + hmin - lo, W)


@njit(cache=True, nogil=True)
def _weighted_sums(fn, sbuf, W, vb, dv, obuf, rows, lo, hmin, shi, j0, j1, q0, nq, rk):
    """The chunk's softmax numerators times V into obuf (rows x dv), the same spans as ``_scores``."""
    if hmin > lo:
        sgemm(fn, False, rows, dv, hmin - lo, sbuf, 0, W, vb, lo * dv, dv, np.float32(0.0), obuf, 0, dv)
    else:
        obuf[:rows * dv] = 0
    for j in range(j0, j1):
        h = max(lo, shi[j])
        if h > hmin:
            r0, nr = _sub_rows(j, q0, nq, rk)
            sgemm(fn, False, nr, dv, h - hmin, sbuf, r0 * W + hmin - lo, W, vb, hmin * dv, dv, np.float32(1.0),
                  obuf, r0 * dv, dv)


@njit(parallel=True, cache=True, nogil=True)
def _attend_tiles(fn, q, kf, vf, mask, out, sc, softcap, slopes, nt, sinks):
    """Softmax attention per (batch, KV head, chunk of Q_CHUNK queries), its products BLAS calls (``blas.sgemm``)
    from this kernel. A chunk's rows are (query, head of the group), query-major; the cells every sub-block of it
    sees are one product, [lo, min hi), and each sub-block of SUB queries adds the cells past that up to its own
    end: under a causal mask the chunk's diagonal costs SUB-wide steps rather than a full square (at 512 queries
    0.85 of the chunk-wide spans' work, 6% over the visible cells). Items are dealt to the nt threads by their work,
    largest first. q (ne3, n_head, n_q, d), kf / vf (.., n_head_kv, n_kv, d) float32 contiguous, mask (m3, m2, >=
    n_q, n_kv) or an empty last axis; out (ne3, n_q, n_head, dv); sinks (n_head,) or empty: ggml's tiled
    correction after the cells."""
    ne3, n_head, n_q, d = q.shape
    n_head_kv, n_kv = kf.shape[1], kf.shape[2]
    dv = vf.shape[3]
    rk = n_head // n_head_kv
    has_mask = mask.shape[3] > 0
    if has_mask:
        slo, shi = _sub_spans(mask, n_q, n_kv)
    else:
        nsb = (n_q + SUB - 1) // SUB
        slo = np.zeros((1, nsb), np.int64)
        shi = np.full((1, nsb), n_kv, np.int64)
    m3 = slo.shape[0]
    nch = (n_q + Q_CHUNK - 1) // Q_CHUNK
    per = Q_CHUNK // SUB
    n_items = ne3 * n_head_kv * nch
    cost = np.zeros(n_items, np.int64)
    wmax = 1
    for it in range(n_items):
        a = (it // (n_head_kv * nch)) % m3
        c = it % nch
        lo, hi = n_kv, 0
        for j in range(c * per, min(slo.shape[1], (c + 1) * per)):
            cost[it] += shi[a, j] - slo[a, j] + 1
            if shi[a, j] > 0:
                lo, hi = min(lo, slo[a, j]), max(hi, shi[a, j])
        wmax = max(wmax, hi - lo)
    owner = np.zeros(n_items, np.int64)
    load = np.zeros(nt, np.int64)
    for it in np.argsort(-cost, kind="mergesort"):
        t = np.argmin(load)
        owner[it] = t
        load[t] += cost[it]
    es = q.itemsize
    direct = rk == n_head and q.strides[1] == d * es and q.strides[2] == n_head * d * es and q.strides[3] == es
    for t in prange(nt):
        rows_max = Q_CHUNK * rk
        abuf = np.empty(1 if direct else rows_max * d, np.float32)
        sbuf = np.empty(rows_max * wmax, np.float32)
        obuf = np.empty(rows_max * dv, np.float32)
        den = np.empty(rows_max, np.float32)
        mxs = np.empty(rows_max, np.float32)
        for it in range(n_items):
            if owner[it] != t:
                continue
            i3 = it // (n_head_kv * nch)
            hk = (it // nch) % n_head_kv
            c = it % nch
            a = i3 % m3
            q0 = c * Q_CHUNK
            nq = min(n_q, q0 + Q_CHUNK) - q0
            rows = nq * rk
            j0, j1 = q0 // SUB, (q0 + nq + SUB - 1) // SUB
            lo, hmin, hmax = n_kv, n_kv, 0
            for j in range(j0, j1):
                if shi[a, j] > 0:
                    lo = min(lo, slo[a, j])
                    hmax = max(hmax, shi[a, j])
            if hmax == 0:                          # every row masked: ggml's output is 0
                for i in range(q0, q0 + nq):
                    out[i3, i, hk * rk:(hk + 1) * rk, :] = 0
                continue
            for j in range(j0, j1):
                hmin = min(hmin, max(lo, shi[a, j]))
            W = hmax - lo
            kb = kf[i3 % kf.shape[0], hk].ravel()
            vb = vf[i3 % vf.shape[0], hk].ravel()
            if direct:      # the chunk's rows as they lie in q: heads side by side in each query's row
                _scores(fn, q, (i3 * q.strides[0] + q0 * q.strides[2]) // es, d, kb, sbuf, rows, lo, hmin, W,
                        shi[a], j0, j1, q0, nq, rk)
            else:
                for r in range(rows):
                    abuf[r * d:(r + 1) * d] = q[i3, hk * rk + r % rk, q0 + r // rk]
                _scores(fn, abuf, 0, d, kb, sbuf, rows, lo, hmin, W, shi[a], j0, j1, q0, nq, rk)
            for r in range(rows):
                i = q0 + r // rk
                h = hk * rk + r % rk
                L = max(lo, shi[a, i // SUB]) - lo
                mrow = mask[a, h % mask.shape[1], i, lo:] if has_mask else mask[0, 0, 0]
                den[r], mxs[r] = _softmax_row(sbuf[r * W:r * W + L], L, sc, softcap, mrow, slopes[h], has_mask)
            _weighted_sums(fn, sbuf, W, vb, dv, obuf, rows, lo, hmin, shi[a], j0, j1, q0, nq, rk)
            for r in range(rows):
                dst = out[i3, q0 + r // rk, hk * rk + r % rk]
                dd = den[r]
                if sinks.shape[0] > 0:
                    dd = _add_sink(obuf[r * dv:(r + 1) * dv], dd, mxs[r], sinks[hk * rk + r % rk])
                for e in range(dv):
                    dst[e] = obuf[r * dv + e] / dd


def _attend_numpy(q, kf, vf, mask, out, sc, softcap, slopes, sinks):
    """Softmax attention through float32 matrix products, per (batch, chunk of queries, KV head): each chunk only
    multiplies the span of cells its mask leaves visible (about half the work under a causal mask), and the
    items run on the BLAS path's threads."""
    ne3, n_head, n_q = q.shape[:3]
    n_head_kv = kf.shape[1]
    rk = n_head // n_head_kv
    items = []
    for i3 in range(ne3):
        for q0 in range(0, n_q, Q_CHUNK):
            q1 = min(n_q, q0 + Q_CHUNK)
            lo, hi = 0, kf.shape[2]
            mm = np.zeros((1, 1, 0), np.float32)
            if mask is not None:
                mm = mask[i3 % mask.shape[0], :, q0:q1, :]               # (m2, qc, n_kv)
                vis = np.flatnonzero((mm > -np.inf).any(axis=(0, 1)))
                if vis.size == 0:
                    out[i3, q0:q1] = 0
                    continue
                lo, hi = int(vis[0]), int(vis[-1]) + 1
                mm = np.ascontiguousarray(mm[:, :, lo:hi])
            for hk in range(n_head_kv):
                items.append((i3, q0, q1, hk, lo, hi, mm))

    def work(chunk):
        # one score and one output buffer per worker, reused item after item (fresh arrays of this size are
        # mmap'd, page-faulted and unmapped each time: that was a fifth of the attention's time)
        big = max((rk * (q1 - q0) * (hi - lo) for _, q0, q1, _, lo, hi, _ in chunk), default=0)
        sbuf = _thread_buffer("s", big)
        obuf = _thread_buffer("o", rk * Q_CHUNK * vf.shape[-1])
        for i3, q0, q1, hk, lo, hi, mm in chunk:
            qh = q[i3, hk * rk:(hk + 1) * rk, q0:q1]                       # (rk, qc, d)
            kk = kf[i3 % kf.shape[0], hk, lo:hi]                           # (L, d)
            vv = vf[i3 % vf.shape[0], hk, lo:hi]                           # (L, dv)
            # the group's heads stacked into one product: (rk * qc, d) x (d, L)
            qs = np.ascontiguousarray(qh).reshape(rk * (q1 - q0), qh.shape[-1])
            s = np.matmul(qs, kk.T, out=sbuf[:rk * (q1 - q0) * (hi - lo)].reshape(rk * (q1 - q0), hi - lo))
            den = np.empty(rk * (q1 - q0), np.float32)
            mxs = np.empty(rk * (q1 - q0), np.float32)
            _softmax_rows(s, sc, np.float32(softcap), mm, hk * rk, slopes, q1 - q0, den, mxs)
            o = np.matmul(s, vv, out=obuf[:s.shape[0] * vv.shape[1]].reshape(s.shape[0], vv.shape[1]))
            if sinks.shape[0] > 0:
                for r in range(o.shape[0]):
                    den[r] = _add_sink(o[r], den[r], mxs[r], sinks[hk * rk + r // (q1 - q0)])
            _divide_into(o.reshape(rk, q1 - q0, vv.shape[1]), den, out[i3, q0:q1, hk * rk:(hk + 1) * rk, :])

    from . import matmul
    nt = min(matmul._blas_workers(), len(items))
    if nt <= 1:
        work(items)
        return
    parts = _balanced(items, nt)
    futs = [matmul._POOL.submit(work, part) for part in parts[1:]]
    work(parts[0])
    for f in futs:
        f.result()


_TLS = threading.local()


def _thread_buffer(name: str, n: int) -> np.ndarray:
    """A float32 scratch buffer of at least n values, kept per thread across calls (a fresh array this size is
    mmap'd and page-faulted every time)."""
    buf = getattr(_TLS, name, None)
    if buf is None or buf.size < n:
        buf = np.empty(max(n, 1), np.float32)
        setattr(_TLS, name, buf)
    return buf


def _balanced(items, nt):
    """The items in nt lists of about equal work (rows times visible cells): largest first, each to the least
    loaded list. Under a causal mask the chunks' spans grow 1, 2, 3, 4 (x 128 cells); dealt out in turn, one of two
    threads got 6 of the 10 parts (Gemma 3: one KV head, so four items per layer)."""
    def cost(it):
        _, q0, q1, _, lo, hi, _ = it
        return (q1 - q0) * (hi - lo)
    parts = [[] for _ in range(nt)]
    load = [0] * nt
    for it in sorted(items, key=cost, reverse=True):
        j = load.index(min(load))
        parts[j].append(it)
        load[j] += cost(it)
    return parts
