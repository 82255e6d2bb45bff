"""F32 products over fewer than 8 values (gemma3n's AltUp coefficients: k = 4) in ggml_vec_dot_f32's order.

With k < 8 no x86 build of ggml-cpu takes tinyBLAS (llamafile_sgemm wants k % 8 == 0 on AVX/AVX2, k % 16 on
AVX-512) or the SIMD body of ggml_vec_dot_f32 (steps of 32 or 64 values): every value goes through the scalar
leftover loop, ``sumf += x[i]*y[i]`` from 0 in float: the product rounded, then the sum (not contracted to an
fma: checked against llama.cpp 0.3.36's AltUp coefficients, bit for bit).

    mul_mat_f32_short(w float32 [rows, k], x float32 [n, k], out float32 [n, rows])
    mul_mat_f32_short_batched(w [w3, w2, rows, k], x [x3, x2, n, k], out [x3, x2, n, rows], r2, r3)

The batched form is one call for a whole batched product (gemma3n's streams times each token's coefficients:
one small product per token), where a Python loop over the batch would cost more than the arithmetic.
"""
from __future__ import annotations

import numpy as np
from numba import njit

MAX_K = 7


@njit(cache=True, nogil=True, inline="always")
def _rows(w, x, out):
    n, k = x.shape
    rows = w.shape[0]
    for i in range(n):
        for r in range(rows):
            s = np.float32(0.0)
            for l in range(k):
                s = np.float32(s + np.float32(w[r, l] * x[i, l]))
            out[i, r] = s


@njit(cache=True, nogil=True)
def mul_mat_f32_short(w, x, out):
    _rows(w, x, out)


@njit(cache=True, nogil=True)
def mul_mat_f32_short_batched(w, x, out, r2, r3):
    for i3 in range(x.shape[0]):
        for i2 in range(x.shape[1]):
            _rows(w[i3 // r3, i2 // r2], x[i3, i2], out[i3, i2])
