"""RWKV_WKV6 and RWKV_WKV7 in float32, in ggml-cpu's order of operations: per sequence and head, tokens one after
another; RWKV-6's output sums over the key channels in index order, RWKV-7's state row is updated and dotted with
r in key order. Sequences and heads are independent: the threads split them."""
from __future__ import annotations

import numpy as np
from numba import njit, prange


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
                    y[j, t, h, c] += (kv * tf_i + prev) * r_i
                    st[i, c] = prev * td_i + kv


@njit(parallel=True, cache=True)
def wkv7_f32(r, w, k, v, a, b, state, y, out_s):
    """r, w, k, v, a, b, y (n_seqs, n_tok, H, S); state, out_s (n_seqs, H, S value, S key)."""
    n_seqs, n_tok, H, S = k.shape
    for q in prange(n_seqs * H):
        j = q // H
        h = q % H
        st = out_s[j, h]
        st[:, :] = state[j, h]
        for t in range(n_tok):
            for i in range(S):
                v_i = v[j, t, h, i]
                sa = np.float32(0.0)
                for c in range(S):
                    sa += a[j, t, h, c] * st[i, c]
                acc = np.float32(0.0)
                for c in range(S):
                    nv = st[i, c] * w[j, t, h, c] + v_i * k[j, t, h, c] + sa * b[j, t, h, c]
                    st[i, c] = nv
                    acc += nv * r[j, t, h, c]
                y[j, t, h, i] = acc


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
