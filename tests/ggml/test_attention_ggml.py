"""The decode flash attention over F16 K and V (llampy/ggml/backends/cpu/attention.py ``_fa_vec16``) and the F16
matrix-vector product (dot_blocks, ``ggml_vec_dot_f16``) against llama.cpp's own CPU kernels, called through
ctypes in the libggml-cpu of the build from the sdist (the attention as a one-node ggml graph). That build is
native to the machine running the test, so the expected float order is the host's: ggml_vec_dot_f16 in AVX-512's
sixteen lanes or AVX2's eight, which changes the bits at head sizes such as 32 and 40 (leftover values summed in
double) and 64 (different accumulators). llampy picks its order from the same host."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from llampy.ggml.backends.cpu import attention, dot_blocks
from llampy.ggml.types import GGMLType
from llampy.ggml.backends.cpu.simd import F16_VEC_LANES
from tests import llamacpp

from tests.ggml.helpers import HOST_ORDER_ONLY as pytestmark  # noqa: E402,F401  (against the host's own build)


F32, F16 = 0, 1


@pytest.fixture(scope="module")
def ggml():
    b, c = llamacpp.libggml_graph()
    P = ctypes.c_void_p
    c.ggml_vec_dot_f16.argtypes = [ctypes.c_int, P, ctypes.c_size_t, P, ctypes.c_size_t, P, ctypes.c_size_t,
                                   ctypes.c_int]
    c.ggml_vec_dot_f32.argtypes = c.ggml_vec_dot_f16.argtypes
    return b, c


@pytest.mark.parametrize("d", [32, 40, 64, 72])
def test_decode_flash_attention_gives_ggml_bits_at_the_hosts_width(ggml, d):
    rng = np.random.default_rng(d)
    n_head, n_head_kv, n_q, n_kv = 4, 2, 3, 37
    q = (rng.standard_normal((1, n_head, n_q, d)) * 2).astype(np.float32)
    k = (rng.standard_normal((1, n_head_kv, n_kv, d)) * 2).astype(np.float16).view(np.uint16)
    v = rng.standard_normal((1, n_head_kv, n_kv, d)).astype(np.float16).view(np.uint16)
    m = np.zeros((n_q, n_kv), np.float32)
    m[np.arange(n_kv)[None, :] > n_kv - n_q + np.arange(n_q)[:, None]] = -np.inf   # causal: the last n_q cells
    m[:, 3] = -np.inf
    m[1, 5] = -2.5
    m16 = m.astype(np.float16).view(np.uint16)[None, None]
    scale = float(np.float32(1.0 / np.sqrt(d)))          # an op parameter: float32
    for softcap in (0.0, 20.0):
        want = llamacpp.ggml_flash_attn(ggml, q, k, v, m16, scale, softcap=softcap)
        got = np.empty_like(want)
        attention.flash_attn(q, k, v, m[None, None], got, scale, 0.0, softcap, True, True)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (d, softcap, F16_VEC_LANES,
                                                                           np.abs(got - want).max())


def test_f16_matvec_gives_ggml_vec_dot_f16_bits_at_the_hosts_width(ggml):
    """Where tinyBLAS refuses an F16 product (one activation row), ggml runs ggml_vec_dot_f16 per pair: x rounded
    to F16, the host's lanes, the leftovers in double."""
    _, c = ggml
    rng = np.random.default_rng(7)
    for k in (40, 64, 96, 200):
        w = (rng.standard_normal((5, k)) * 3).astype(np.float16)
        x = rng.standard_normal((1, k)).astype(np.float32)
        got = np.empty((1, 5), np.float32)
        dot_blocks.mul_mat(w, GGMLType.F16, x, got)
        xh = x[0].astype(np.float16)
        want = np.empty(5, np.float32)
        for r in range(5):
            c.ggml_vec_dot_f16(k, want[r:].ctypes.data, 0, w[r].ctypes.data, 0, xh.ctypes.data, 0, 1)
        assert np.array_equal(got[0].view(np.uint32), want.view(np.uint32)), (k, F16_VEC_LANES)


def test_f32_matvec_gives_ggml_vec_dot_f32_bits_at_the_hosts_width(ggml):
    """F32 weights against one activation row (tinyBLAS refuses n < 2): ggml_vec_dot_f32 per pair, the host's
    lanes, the leftovers summed in float; through matmul's dispatch and a plan's bound call."""
    from llampy.ggml.backends.cpu import matmul
    _, c = ggml
    rng = np.random.default_rng(8)
    for k in (40, 64, 96, 200, 576):
        w = (rng.standard_normal((9, k)) * rng.choice([1e-3, 1.0, 50.0], size=(9, 1))).astype(np.float32)
        x = rng.standard_normal((1, k)).astype(np.float32)
        want = np.empty(9, np.float32)
        for r in range(9):
            c.ggml_vec_dot_f32(k, want[r:].ctypes.data, 0, w[r].ctypes.data, 0, x.ctypes.data, 0, 1)
        got = np.full((1, 9), np.nan, np.float32)
        matmul.mul_mat(w, GGMLType.F32, x, got)
        assert np.array_equal(got[0].view(np.uint32), want.view(np.uint32)), (k, F16_VEC_LANES)
        got[...] = np.nan
        matmul.bind_mul_mat(w, GGMLType.F32, x, got, lambda: None)()
        assert np.array_equal(got[0].view(np.uint32), want.view(np.uint32)), (k, F16_VEC_LANES)
