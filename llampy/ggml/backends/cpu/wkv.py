"""RWKV_WKV6, RWKV_WKV7 and GATED_LINEAR_ATTN in float32, in the order of operations of ggml-cpu's AVX2 build (the one the fixtures
were recorded with): per sequence and head, tokens one after another, each vector FMA one rounding (fma32).
RWKV-6's output sums over the key channels in index order. RWKV-7's dot products over a head (the state row with
a, then with r) run in ggml's GGML_F32_STEP layout when the head is a multiple of 32 floats: 32 lanes (four vectors
of eight) accumulated across the head, then GGML_F32_VEC_REDUCE's pairwise order; other head sizes (where ggml's
vector loop reads past the head) sum in index order. The state feeds the next token, and with Q8_0 weights a last-
bit difference can flip an activation's rounding, so the order matters beyond float noise.
GATED_LINEAR_ATTN is element-wise FMAs with no reduction across lanes (the same bits on AVX2 and AVX-512):
new state = fma(prev, g, v * k), output += new state * (q * scale) as one FMA, in key order.
Sequences and heads are independent: the threads split them."""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .simd import fma32

STEP = 32           # GGML_F32_STEP on AVX: GGML_F32_ARR = 4 vectors of GGML_F32_EPR = 8 lanes


@njit(inline="always")
def _reduce32(acc):
    """GGML_F32x8_REDUCE of four 8-lane vectors laid out flat: x0 += x2, x1 += x3, x0 += x1, then the two halves of
    x0 added and two horizontal adds."""
    x = np.empty(8, np.float32)
    for l in range(8):
        x[l] = (acc[l] + acc[16 + l]) + (acc[8 + l] + acc[24 + l])
    t0 = np.empty(4, np.float32)
    for l in range(4):
        t0[l] = x[l] + x[4 + l]
    return (t0[0] + t0[1]) + (t0[2] + t0[3])


@njit(parallel=True, cache=True)
def wkv6_f32(k, v, r, tf, td, state, y, out_s):
    """k, v, r, td, y (n_seqs, n_tok, H, S); tf (H, S); state, out_s (n_seqs, H, S key, S value)."""
    n_seqs, n_tok, H, S = k.shape
    for q in prange(n_seqs * H):
        j = q // H
        h = q % H
        st = out_s[j, h]
        st[:, :] = state[j, h]
        for t in range(n_tok):
            for c in range(S):
                y[j, t, h, c] = np.float32(0.0)
            for i in range(S):
                k_i = k[j, t, h, i]
                r_i = r[j, t, h, i]
                tf_i = tf[h, i]
                td_i = td[j, t, h, i]
                for c in range(S):
                    kv = v[j, t, h, c] * k_i
                    prev = st[i, c]
                    y[j, t, h, c] = fma32(fma32(kv, tf_i, prev), r_i, y[j, t, h, c])
                    st[i, c] = fma32(prev, td_i, kv)


@njit(parallel=True, cache=True)
def gla_f32(k, v, q, g, state, scale, y, out_s):
    """k, v, q, g, y (n_seqs, n_tok, H, S); state, out_s (n_seqs, H, S key, S value)."""
    n_seqs, n_tok, H, S = k.shape
    for p in prange(n_seqs * H):
        j = p // H
        h = p % H
        st = out_s[j, h]
        st[:, :] = state[j, h]
        for t in range(n_tok):
            for c in range(S):
                y[j, t, h, c] = np.float32(0.0)
            for i in range(S):
                k_i = k[j, t, h, i]
                q_i = q[j, t, h, i] * scale
                g_i = g[j, t, h, i]
                for c in range(S):
                    nv = fma32(st[i, c], g_i, v[j, t, h, c] * k_i)
                    y[j, t, h, c] = fma32(nv, q_i, y[j, t, h, c])
                    st[i, c] = nv


@njit(parallel=True, cache=True)
def wkv7_f32(r, w, k, v, a, b, state, y, out_s):
    """r, w, k, v, a, b, y (n_seqs, n_tok, H, S); state, out_s (n_seqs, H, S value, S key)."""
    n_seqs, n_tok, H, S = k.shape
    lanes = S % STEP == 0
    for q in prange(n_seqs * H):
        j = q // H
        h = q % H
        st = out_s[j, h]
        st[:, :] = state[j, h]
        acc = np.zeros(STEP, np.float32)
        for t in range(n_tok):
            for i in range(S):
                v_i = v[j, t, h, i]
                if lanes:
                    acc[:] = 0
                    for c0 in range(0, S, STEP):
                        for l in range(STEP):
                            acc[l] = fma32(a[j, t, h, c0 + l], st[i, c0 + l], acc[l])
                    sa = _reduce32(acc)
                    acc[:] = 0
                    for c0 in range(0, S, STEP):
                        for l in range(STEP):
                            c = c0 + l
                            nv = fma32(st[i, c], w[j, t, h, c], v_i * k[j, t, h, c])
                            nv = fma32(sa, b[j, t, h, c], nv)
                            st[i, c] = nv
                            acc[l] = fma32(nv, r[j, t, h, c], acc[l])
                    y[j, t, h, i] = _reduce32(acc)
                else:
                    sa = np.float32(0.0)
                    for c in range(S):
                        sa += a[j, t, h, c] * st[i, c]
                    res = np.float32(0.0)
                    for c in range(S):
                        nv = st[i, c] * w[j, t, h, c] + v_i * k[j, t, h, c] + sa * b[j, t, h, c]
                        st[i, c] = nv
                        res += nv * r[j, t, h, c]
                    y[j, t, h, i] = res


def _bind(node, dst, srcs, n_in):
    S, H, n_tokens = node.src[0].ne[:3]
    n_seqs = node.src[-1].ne[1]
    shape = (n_seqs, n_tokens // n_seqs, H, S)
    ins = [srcs[i].reshape(shape) for i in n_in]
    state = srcs[-1].reshape(n_seqs, H, S, S)
    flat = dst.reshape(-1)
    y = flat[:n_tokens * H * S].reshape(shape)
    out_s = flat[n_tokens * H * S:].reshape(n_seqs, H, S, S)
    return ins, state, y, out_s


def bind_rwkv_wkv6(node, dst, srcs):
    (k, v, r, td), state, y, out_s = _bind(node, dst, srcs, (0, 1, 2, 4))
    S, H = node.src[0].ne[:2]
    tf = srcs[3].reshape(H, S)
    return lambda: wkv6_f32(k, v, r, tf, td, state, y, out_s)


def bind_rwkv_wkv7(node, dst, srcs):
    (r, w, k, v, a, b), state, y, out_s = _bind(node, dst, srcs, range(6))
    return lambda: wkv7_f32(r, w, k, v, a, b, state, y, out_s)


def bind_gated_linear_attn(node, dst, srcs):
    (k, v, q, g), state, y, out_s = _bind(node, dst, srcs, range(4))
    scale = np.float32(node.op_params["scale"])
    return lambda: gla_f32(k, v, q, g, state, scale, y, out_s)
