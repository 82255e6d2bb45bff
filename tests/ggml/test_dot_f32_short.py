"""F32 products over fewer than 8 values in ggml_vec_dot_f32's scalar order (llampy/ggml/backends/cpu/dot_f32_short.py):
each product rounded to float, then added to the running float sum, from 0 (what llama.cpp 0.3.36's gemma3n AltUp
coefficients show, bit for bit)."""
from __future__ import annotations

import numpy as np

from llampy.ggml.backends.cpu import dot_f32_short
from llampy.ggml.backends.cpu.matmul import mul_mat
from llampy.ggml.types import GGMLType


def _scalar(w, x):
    out = np.empty((x.shape[0], w.shape[0]), np.float32)
    for i in range(x.shape[0]):
        for r in range(w.shape[0]):
            s = np.float32(0.0)
            for a, b in zip(w[r], x[i]):
                s = np.float32(s + np.float32(a * b))
            out[i, r] = s
    return out


def test_short_products_sum_in_order_without_fma():
    rng = np.random.default_rng(3)
    for k in (1, 4, 7):
        w = rng.standard_normal((16, k)).astype(np.float32)
        x = rng.standard_normal((5, k)).astype(np.float32)
        out = np.empty((5, 16), np.float32)
        mul_mat(w, GGMLType.F32, x, out)
        want = _scalar(w, x)
        assert np.array_equal(out.view(np.uint32), want.view(np.uint32)), k
    # an fma-contracted or double sum differs somewhere on these (the order is what is tested)
    fused = (w.astype(np.float64) @ x.T.astype(np.float64)).T.astype(np.float32)
    assert not np.array_equal(fused, want)


def test_batched_form_is_the_per_batch_products():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((1, 3, 8, 4)).astype(np.float32)        # broadcast over x's 2 x 3 batches (r3 = 2)
    x = rng.standard_normal((2, 3, 6, 4)).astype(np.float32)
    out = np.empty((2, 3, 6, 8), np.float32)
    dot_f32_short.mul_mat_f32_short_batched(w, x, out, 1, 2)
    for i3 in range(2):
        for i2 in range(3):
            assert np.array_equal(out[i3, i2], _scalar(w[0, i2], x[i3, i2]))
