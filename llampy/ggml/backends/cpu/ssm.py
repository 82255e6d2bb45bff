"""SSM_CONV and SSM_SCAN (Mamba-1 and Mamba-2) in float32, in ggml-cpu's order of operations: the convolution's sum
in kernel order, and per token state = state * exp(dt' * A) + B * (x * dt'), y = the sum of state * C over the state
in index order, dt' = softplus(dt) as ggml computes it. Sequences and heads are independent: the threads split them.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange


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


@njit(parallel=True, cache=True)
def ssm_scan_f32(s, x, dt, A, B, C, ids, y, out_s):
    """s (n_rs, n_head, head_dim, d_state): the states ids[j] starts from; x, y (n_seqs, n_tok, n_head, head_dim);
    dt (n_seqs, n_tok, n_head); A (n_head, d_state) or (n_head, 1); B, C (n_seqs, n_tok, n_group, d_state);
    out_s (n_seqs, n_head, head_dim, d_state): the final states."""
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
            dA = np.float32(np.exp(dsp * A[h, 0]))
            for i in range(head_dim):
                x_dt = x[j, t, h, i] * dsp
                acc = np.float32(0.0)
                for k in range(d_state):
                    if per_elem:
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
