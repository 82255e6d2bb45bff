"""The Mamba-2 ssm_scan kernel (llampy/ggml/backends/cpu/ssm.py) against ggml_ssm_scan itself, called through ctypes in
llama.cpp's build from the sdist: bit for bit, with leftover states (16, 48, 160) and whole 32-lane blocks (64,
128), several sequences starting from other state rows. The kernel follows ggml's AVX2 build (the one the recurrent
fixtures were recorded with), so the test runs where the host's build is that one (no avx512f)."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from llampy.ggml.backends.cpu import simd
from llampy.ggml.backends.cpu.ssm import ssm_scan_f32
from tests import llamacpp

pytestmark = pytest.mark.skipif(simd.HOST_VEC_LANES != 8, reason="the host's ggml build runs AVX-512's 64-lane order")
P, I64 = ctypes.c_void_p, ctypes.c_int64


@pytest.fixture(scope="module")
def ggml():
    base, cpu = llamacpp.libggml_cpu(ctypes.RTLD_GLOBAL)
    base.ggml_init.argtypes, base.ggml_init.restype = [llamacpp.GGMLInitParams], P
    base.ggml_new_tensor_4d.argtypes, base.ggml_new_tensor_4d.restype = [P, ctypes.c_int, I64, I64, I64, I64], P
    base.ggml_ssm_scan.argtypes, base.ggml_ssm_scan.restype = [P] * 8 + [I64], P
    base.ggml_new_graph.argtypes, base.ggml_new_graph.restype = [P], P
    base.ggml_build_forward_expand.argtypes = [P, P]
    base.ggml_get_data.argtypes, base.ggml_get_data.restype = [P], P
    base.ggml_free.argtypes = [P]
    cpu.ggml_graph_compute_with_ctx.argtypes = [P, P, ctypes.c_int]
    return base, cpu


@pytest.mark.parametrize("n_seqs,n_tok,n_head,head_dim,d_state,n_group",
                         [(1, 1, 4, 16, 128, 1), (2, 7, 4, 16, 64, 2), (1, 5, 2, 8, 16, 1), (2, 3, 4, 8, 48, 2),
                          (1, 9, 6, 16, 160, 1)])
def test_mamba2_scan_gives_ggml_bits(ggml, n_seqs, n_tok, n_head, head_dim, d_state, n_group):
    base, cpu = ggml
    rng = np.random.default_rng(d_state + n_tok)
    f = lambda *sh, s=1.0: (rng.standard_normal(sh) * s).astype(np.float32)   # noqa: E731
    ins = [f(n_seqs + 1, n_head, head_dim, d_state), f(n_seqs, n_tok, n_head, head_dim), f(n_seqs, n_tok, n_head, s=2),
           -rng.uniform(1, 16, (n_head, 1)).astype(np.float32), f(n_seqs, n_tok, n_group, d_state),
           f(n_seqs, n_tok, n_group, d_state), np.arange(n_seqs, 0, -1, dtype=np.int32)]
    ctx = base.ggml_init(llamacpp.GGMLInitParams(1 << 26, None, False))
    ts = []
    for a in ins:
        ne = list(reversed(a.shape)) + [1] * (4 - a.ndim)
        t = base.ggml_new_tensor_4d(ctx, 26 if a.dtype == np.int32 else 0, *ne)
        ctypes.memmove(base.ggml_get_data(t), a.ctypes.data, a.nbytes)
        ts.append(t)
    r = base.ggml_ssm_scan(ctx, *ts, 1)
    gf = base.ggml_new_graph(ctx)
    base.ggml_build_forward_expand(gf, r)
    cpu.ggml_graph_compute_with_ctx(ctx, gf, 2)
    n = ins[1].size + n_seqs * n_head * head_dim * d_state
    want = np.ctypeslib.as_array(ctypes.cast(base.ggml_get_data(r), ctypes.POINTER(ctypes.c_float)), (n,)).copy()
    base.ggml_free(ctx)
    y = np.zeros_like(ins[1])
    states = np.zeros((n_seqs, n_head, head_dim, d_state), np.float32)
    ssm_scan_f32(*ins, y, states)
    got = np.concatenate([y.ravel(), states.ravel()])
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
