"""Row norms with ggml's exact arithmetic: squares rounded to float, summed in double in order, the scale in float."""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange


@njit(parallel=True, cache=True)
def rms_norm_rows(x, eps, out):
    rows, n = x.shape
    for r in prange(rows):
        s = 0.0
        for i in range(n):
            s += np.float64(np.float32(x[r, i] * x[r, i]))
        mean = np.float32(s / n)
        scale = np.float32(1.0) / np.float32(math.sqrt(np.float32(mean + eps)))
        for i in range(n):
            out[r, i] = np.float32(x[r, i] * scale)


@njit(parallel=True, cache=True)
def norm_rows(x, eps, out):
    rows, n = x.shape
    for r in prange(rows):
        s = 0.0
        for i in range(n):
            s += np.float64(x[r, i])
        mean = np.float32(s / n)
        s2 = 0.0
        for i in range(n):
            v = np.float32(x[r, i] - mean)
            out[r, i] = v
            s2 += np.float64(np.float32(v * v))
        var = np.float32(s2 / n)
        scale = np.float32(1.0) / np.float32(math.sqrt(np.float32(var + eps)))
        for i in range(n):
            out[r, i] = np.float32(out[r, i] * scale)


@njit(cache=True, inline="always")
def _rms_mul_row(x, w, eps, out, r):
    n = x.shape[1]
    s = 0.0
    for i in range(n):
        s += np.float64(np.float32(x[r, i] * x[r, i]))
    mean = np.float32(s / n)
    scale = np.float32(1.0) / np.float32(math.sqrt(np.float32(mean + eps)))
    wr = w[r % w.shape[0]]
    for i in range(n):
        out[r, i] = np.float32(np.float32(x[r, i] * scale) * wr[i])


@njit(cache=True)
def rms_norm_mul_rows(x, w, eps, out):
    """rms_norm(x) * w as ggml's two ops compute it (the normalised row rounded to float32, then the product);
    w [rows or 1, n] broadcast over x's rows."""
    for r in range(x.shape[0]):
        _rms_mul_row(x, w, eps, out, r)


@njit(parallel=True, cache=True)
def rms_norm_mul_rows_par(x, w, eps, out):
    for r in prange(x.shape[0]):
        _rms_mul_row(x, w, eps, out, r)
