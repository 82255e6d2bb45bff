"""SSM_CONV and SSM_SCAN (Mamba-1 and Mamba-2) in float32, in ggml-cpu's order of operations: the convolution's sum
in kernel order, and per token state = state * exp(dt' * A) + B * (x * dt'), y = the sum of state * C over the
state, dt' = softplus(dt) as ggml computes it. Mamba-1 sums y in index order (ggml's scalar loop). Mamba-2 runs as
ggml's AVX2 build (the one the fixtures were recorded with, as wkv.py and delta.py) compiles it: the state update
one FMA (state * exp(dt' A) + the rounded B * x dt'), y as 32 lanes (four vectors of eight) of FMAs across the
state, GGML_F32_VEC_REDUCE's pairwise order, then the leftover states (d_state % 32) one FMA each; bit-identical to
ggml_ssm_scan of that build, and vector code (the index-order sum it replaced was scalar). Sequences and heads are
independent: the threads split them.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .simd import fma32, v16_add, v16_fma, v16_load, v16_reduce_x8, v16_scale, v16_store, v16_zero

STEP = 32           # GGML_F32_STEP on AVX: GGML_F32_ARR = 4 vectors of GGML_F32_EPR = 8 lanes


@njit(parallel=True, cache=True)
def ssm_conv_f32(sx, c, out):
    """sx (n_s, d_inner, d_conv - 1 + n_t), c (d_inner, d_conv), out (n_s, n_t, d_inner)."""
    n_s, d_inner, _ = sx.shape
    d_conv = c.shape[1]
    n_t = out.shape[1]
    for r in prange(n_s * d_inner):
        s = r // d_inner
        i = r % d_inner
        for t in range(n_t):
            acc = np.float32(0.0)
            for k in range(d_conv):
                acc += sx[s, i, t + k] * c[i, k]
            out[s, t, i] = acc


@njit(inline="always")
def _mamba2_token(st, xr, b, c, dA, dsp, yr):
    """One token of one head: st (head_dim, d_state) in place, xr / yr (head_dim,), b / c (d_state,). A state row's
    32-lane blocks run as two 16-lane vectors: lanes 0-15 hold ggml's vectors x0 and x1, lanes 16-31 x2 and x3, so
    their sum is x0 + x2, x1 + x3 side by side and v16_reduce_x8 finishes GGML_F32x8_REDUCE."""
    head_dim, d_state = st.shape
    n32 = d_state - d_state % STEP
    for i in range(head_dim):
        row = st[i]
        x_dt = xr[i] * dsp
        sumf = np.float32(0.0)
        if n32:
            lo = v16_zero()
            hi = v16_zero()
            for k0 in range(0, n32, STEP):
                v = v16_fma(v16_load(row, k0), dA, v16_scale(v16_load(b, k0), x_dt))
                v16_store(row, k0, v)
                lo = v16_fma(v, v16_load(c, k0), lo)
                v = v16_fma(v16_load(row, k0 + 16), dA, v16_scale(v16_load(b, k0 + 16), x_dt))
                v16_store(row, k0 + 16, v)
                hi = v16_fma(v, v16_load(c, k0 + 16), hi)
            sumf = v16_reduce_x8(v16_add(lo, hi))
        for k in range(n32, d_state):
            v = fma32(row[k], dA, b[k] * x_dt)
            sumf = fma32(v, c[k], sumf)
            row[k] = v
        yr[i] = sumf


@njit(parallel=True, cache=True)
def ssm_scan_f32(s, x, dt, A, B, C, ids, y, out_s):
    """s (n_rs, n_head, head_dim, d_state): the states ids[j] starts from; x, y (n_seqs, n_tok, n_head, head_dim);
    dt (n_seqs, n_tok, n_head); A (n_head, d_state) or (n_head, 1); B, C (n_seqs, n_tok, n_group, d_state), each
    row of d_state packed; out_s (n_seqs, n_head, head_dim, d_state): the final states."""
    n_seqs, n_tok, n_head, head_dim = x.shape
    d_state = s.shape[3]
    per_group = n_head // B.shape[2]
    per_elem = A.shape[1] != 1
    one = np.float32(1.0)
    for r in prange(n_seqs * n_head):
        j = r // n_head
        h = r % n_head
        g = h // per_group
        st = out_s[j, h]
        src = s[ids[j], h]
        for i in range(head_dim):
            for k in range(d_state):
                st[i, k] = src[i, k]
        for t in range(n_tok):
            d = dt[j, t, h]
            dsp = d if d > np.float32(20.0) else np.float32(np.log(one + np.exp(d)))
            if not per_elem:
                dA = np.float32(np.exp(dsp * A[h, 0]))
                _mamba2_token(st, x[j, t, h], B[j, t, g], C[j, t, g], dA, dsp, y[j, t, h])
                continue
            for i in range(head_dim):
                x_dt = x[j, t, h, i] * dsp
                acc = np.float32(0.0)
                for k in range(d_state):
                    dA = np.float32(np.exp(dsp * A[h, k]))
                    v = st[i, k] * dA + B[j, t, g, k] * x_dt
                    acc += v * C[j, t, g, k]
                    st[i, k] = v
                y[j, t, h, i] = acc


def bind_ssm_conv(node, dst, srcs):
    sx = srcs[0][0]
    c = srcs[1][0, 0]
    out = dst[0]
    return lambda: ssm_conv_f32(sx, c, out)


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

    def run():
        if len(ids) and (ids.min() < 0 or ids.max() >= s.shape[0]):
            raise IndexError(f"ssm_scan: state rows {ids.tolist()} outside 0..{s.shape[0] - 1}")
        ssm_scan_f32(s, x, dt, A, B, C, ids, y, out_s)
    return run
