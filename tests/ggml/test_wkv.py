"""The oracle's RWKV recurrences against ggml-cpu's scalar loops written out element by element (the CPU kernels
are held to the oracle by test_ops' cases)."""
from __future__ import annotations

import numpy as np

from llampy.ggml import ops
from llampy.ggml.backend import backend_init
from llampy.ggml.types import GGMLType as T

from .helpers import leaf, run

REF = backend_init("reference")


def _loops6(k, v, r, tf, td, state, n_seqs):
    T_, H, S = k.shape
    n_st = T_ // n_seqs
    y = np.zeros((T_, H, S))
    st = state.reshape(n_seqs, H, S, S).astype(np.float64).copy()
    for t in range(T_):
        s = st[t // n_st]
        for h in range(H):
            for i in range(S):
                for j in range(S):
                    kv = v[t, h, j] * k[t, h, i]
                    prev = s[h, i, j]
                    y[t, h, j] += (kv * tf[h, i] + prev) * r[t, h, i]
                    s[h, i, j] = prev * td[t, h, i] + kv
    return y, st


def _loops7(r, w, k, v, a, b, state, n_seqs):
    T_, H, S = k.shape
    n_st = T_ // n_seqs
    y = np.zeros((T_, H, S))
    st = state.reshape(n_seqs, H, S, S).astype(np.float64).copy()
    for t in range(T_):
        s = st[t // n_st]
        for h in range(H):
            for i in range(S):
                sa = sum(a[t, h, j] * s[h, i, j] for j in range(S))
                for j in range(S):
                    s[h, i, j] = s[h, i, j] * w[t, h, j] + v[t, h, i] * k[t, h, j] + sa * b[t, h, j]
                    y[t, h, i] += s[h, i, j] * r[t, h, j]
    return y, st


def test_reference_wkv_against_direct_loops():
    rng = np.random.default_rng(3)
    S, H, n_seqs, n_st = 4, 2, 2, 3
    shape = (n_seqs * n_st, H, S)
    f = lambda *sh: rng.standard_normal(sh).astype(np.float32)
    L = lambda x: leaf(REF, T.F32, x.shape, x)
    k, v, r, tf = f(*shape), f(*shape), f(*shape), f(H, S)
    td = rng.uniform(0.2, 1, shape).astype(np.float32)
    state = f(n_seqs, S * S * H)
    (o,) = run(REF, ops.rwkv_wkv6(L(k), L(v), L(r), L(tf), L(td), L(state)))
    y, st = _loops6(k, v, r, tf, td, state, n_seqs)
    o = o.reshape(-1)
    np.testing.assert_allclose(o[:y.size], y.reshape(-1), atol=1e-5)
    np.testing.assert_allclose(o[y.size:], st.reshape(-1), atol=1e-5)

    a, b = f(*shape) * 0.3, f(*shape) * 0.3
    (o,) = run(REF, ops.rwkv_wkv7(L(r), L(td), L(k), L(v), L(a), L(b), L(state)))
    y, st = _loops7(r, td, k, v, a, b, state, n_seqs)
    o = o.reshape(-1)
    np.testing.assert_allclose(o[:y.size], y.reshape(-1), atol=1e-5)
    np.testing.assert_allclose(o[y.size:], st.reshape(-1), atol=1e-5)
