"""SiLU, SwiGLU and the softmax's exponentials (llampy/ggml/backends/cpu/act.py, softmax.py) against ggml's own
``ggml_vec_silu_f32``, ``ggml_vec_swiglu_f32`` and ``ggml_vec_soft_max_f32``, called through ctypes in the libggml-cpu
of llama.cpp's build from the sdist. That build is native to the machine running the test, so the expected bits are
the host's: ggml_v_expf's AVX-512 form in sixteen lanes or its AVX2 form (rounded differently) in eight, and the
elements past the last full register through the C library's expf."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from llampy.ggml.backends.cpu.act import silu_rows, swiglu_rows
from llampy.ggml.backends.cpu.simd import F16_VEC_LANES
from llampy.ggml.backends.cpu.softmax import soft_max_rows
from tests import llamacpp

from tests.ggml.helpers import HOST_ORDER_ONLY as pytestmark  # noqa: E402,F401  (against the host's own build)


F = ctypes.c_void_p


@pytest.fixture(scope="module")
def ggml_cpu():
    lib = llamacpp.libggml_cpu()[1]
    lib.ggml_vec_silu_f32.argtypes = [ctypes.c_int, F, F]
    lib.ggml_vec_swiglu_f32.argtypes = [ctypes.c_int, F, F, F]
    lib.ggml_vec_soft_max_f32.argtypes = [ctypes.c_int, F, F, ctypes.c_float]
    lib.ggml_vec_soft_max_f32.restype = ctypes.c_double
    return lib


def _inputs(n):
    rng = np.random.default_rng(n)
    x = (rng.standard_normal((3, n)) * 5).astype(np.float32)
    x[0, :8] = [-100.0, 100.0, -200.0, 200.0, -88.5, 89.0, 0.0, -0.0]    # exp's scaled and overflowing branches
    x[1, n - 5:] = [-100.0, 100.0, -90.0, 1e-8, 3.0]                        # the same in the leftover elements
    return x


@pytest.mark.parametrize("n", [61, 200])        # 61: 48 in sixteens, 56 in eights; 200: 192 / 200
def test_silu_swiglu_softmax_give_ggml_bits_at_the_hosts_width(ggml_cpu, n):
    x = _inputs(n)
    g = np.random.default_rng(n + 1).standard_normal(x.shape).astype(np.float32)
    rows = x.shape[0]

    def ggml_rows(fn, *args):
        out = np.empty_like(x)
        for r in range(rows):
            fn(n, out[r].ctypes.data, *(a[r].ctypes.data for a in args))
        return out

    got = np.empty_like(x)
    silu_rows(x, got)
    assert np.array_equal(got.view(np.uint32), ggml_rows(ggml_cpu.ggml_vec_silu_f32, x).view(np.uint32)), F16_VEC_LANES
    swiglu_rows(x, g, got)
    want = ggml_rows(ggml_cpu.ggml_vec_swiglu_f32, x, g)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), F16_VEC_LANES

    xs = np.clip(x, -30, 30)                    # softmax logits (its max is subtracted first)
    want = np.empty_like(xs)
    for r in range(rows):
        s = ggml_cpu.ggml_vec_soft_max_f32(n, want[r].ctypes.data, xs[r].ctypes.data, float(xs[r].max()))
        want[r] *= np.float32(1.0 / s)          # ops.cpp: ggml_vec_scale_f32 by (float)(1.0 / sum)
    got = np.empty_like(xs)
    soft_max_rows(xs[None, None], np.zeros((1, 1, 1, 0), np.float32), np.ones(1, np.float32), np.float32(1.0),
                  got[None, None])
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), F16_VEC_LANES
