"""GATED_DELTA_NET in float32, in the order of ggml-cpu's x86 build (ops.cpp ggml_compute_forward_gated_delta_net
with one state slot, its vec.h helpers on AVX2): per sequence and head, tokens one after another; the state decays
by expf(g) (glibc's, as ggml's scalar call), each dot product over a state row runs in ggml_vec_dot_f32's layout
(32 lanes of FMAs across the row, GGML_F32_VEC_REDUCE's pairwise order, then the leftover columns one FMA each), the
rank-one update is one FMA per element (ggml_vec_mad_f32), the output is the dot with q times 1/sqrtf(S). The state
feeds every later token, so these orders decide the last bits of everything after. Sequences and heads are
independent: the threads split them."""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .simd import fma32
from .softmax import expf

STEP = 32           # GGML_F32_STEP on AVX: GGML_F32_ARR = 4 vectors of GGML_F32_EPR = 8 lanes


@njit(inline="always")
def _dot(row, x, acc):
    """ggml_vec_dot_f32(n, row, x) on AVX2: GGML_F32x8_REDUCE of the four 8-lane accumulators laid out flat is
    x0 += x2, x1 += x3, x0 += x1, the two halves of x0 added, two horizontal adds."""
    n = row.shape[0]
    n32 = n - n % STEP
    acc[:] = 0
    for i0 in range(0, n32, STEP):
        for l in range(STEP):
            acc[l] = fma32(row[i0 + l], x[i0 + l], acc[l])
    for l in range(4):
        lo = (acc[l] + acc[16 + l]) + (acc[8 + l] + acc[24 + l])
        hi = (acc[4 + l] + acc[20 + l]) + (acc[12 + l] + acc[28 + l])
        acc[l] = lo + hi
    s = (acc[0] + acc[1]) + (acc[2] + acc[3])
    for i in range(n32, n):
        s = fma32(row[i], x[i], s)
    return s


@njit(parallel=True, cache=True)
def gated_delta_net_f32(q, k, v, g, beta, state, y, out_s):
    """q, k (n_seqs_k, n_tok, H_k, S); v, y (n_seqs, n_tok, H, S); g (n_seqs, n_tok, H, 1 or S);
    beta (n_seqs, n_tok, H, 1); state, out_s (n_seqs, H, S value, S key)."""
    n_seqs, n_tok, H, S = v.shape
    rq = n_seqs // q.shape[0]
    H_k = q.shape[2]
    kda = g.shape[3] == S and S != 1
    scale = np.float32(1.0) / np.float32(np.sqrt(np.float32(S)))
    for r in prange(n_seqs * H):
        j = r // H
        h = r % H
        jq = j // rq
        hq = h % H_k
        M = out_s[j, h]
        M[:, :] = state[j, h]
        acc = np.zeros(STEP, np.float32)
        d = np.empty(S, np.float32)
        for t in range(n_tok):
            qt = q[jq, t, hq]
            kt = k[jq, t, hq]
            if kda:
                for i in range(S):
                    d[i] = expf(g[j, t, h, i])
                for a in range(S):
                    for i in range(S):
                        M[a, i] = M[a, i] * d[i]
            else:
                e = expf(g[j, t, h, 0])
                for a in range(S):
                    for i in range(S):
                        M[a, i] = M[a, i] * e
            b = beta[j, t, h, 0]
            for a in range(S):
                d[a] = (v[j, t, h, a] - _dot(M[a], kt, acc)) * b
            for a in range(S):
                da = d[a]
                for i in range(S):
                    M[a, i] = fma32(kt[i], da, M[a, i])
            for a in range(S):
                y[j, t, h, a] = _dot(M[a], qt, acc) * scale


def bind_gated_delta_net(node, dst, srcs):
    q, k, v, g, beta, state = srcs                   # NumPy order (ne3, ne2, ne1, ne0); q, k, v may be strided
    n_seqs, n_tok, H, S = v.shape
    flat = dst.reshape(-1)
    n_y = n_seqs * n_tok * H * S
    y = flat[:n_y].reshape(v.shape)
    out_s = flat[n_y:].reshape(n_seqs, H, S, S)
    return lambda: gated_delta_net_f32(q, k, v, g, beta, state, y, out_s)
