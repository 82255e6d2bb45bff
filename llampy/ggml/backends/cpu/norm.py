"""Row norms with ggml's exact arithmetic: squares rounded to float, summed in double in order, the scale in float."""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .simd import d8_add_squares, d8_lane, d8_zero


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
    """ggml_compute_forward_norm_f32 as its AVX2 build runs it: the mean a float sum over float n; the centred
    squares summed in float per 8 (ggml_vec_cvar_f32's pairwise order), each 8 added to a double, the rest in
    order."""
    rows, n = x.shape
    n8 = n - n % 8
    for r in prange(rows):
        s = 0.0
        for i in range(n):
            s += np.float64(x[r, i])
        mean = np.float32(np.float32(s) / np.float32(n))
        s2 = 0.0
        for i0 in range(0, n8, 8):
            for l in range(8):
                out[r, i0 + l] = np.float32(x[r, i0 + l] - mean)
            o = out[r]
            a0 = np.float32(np.float32(o[i0] * o[i0]) + np.float32(o[i0 + 4] * o[i0 + 4]))
            a1 = np.float32(np.float32(o[i0 + 1] * o[i0 + 1]) + np.float32(o[i0 + 5] * o[i0 + 5]))
            a2 = np.float32(np.float32(o[i0 + 2] * o[i0 + 2]) + np.float32(o[i0 + 6] * o[i0 + 6]))
            a3 = np.float32(np.float32(o[i0 + 3] * o[i0 + 3]) + np.float32(o[i0 + 7] * o[i0 + 7]))
            s2 += np.float64(np.float32(np.float32(a0 + a2) + np.float32(a1 + a3)))
        for i in range(n8, n):
            v = np.float32(x[r, i] - mean)
            out[r, i] = v
            s2 += np.float64(np.float32(v * v))
        var = np.float32(s2 / n)
        scale = np.float32(1.0) / np.float32(math.sqrt(np.float32(var + eps)))
        for i in range(n):
            out[r, i] = np.float32(out[r, i] * scale)


@njit(cache=True, inline="always")
def _rms_mul_out(xr, c, wr, ar, has_add, orow):
    """One row's output: float32(x * scale) * w, then + the residual row ar when has_add (each product and the sum
    rounded to float32, as ggml's RMS_NORM, MUL and ADD give them)."""
    if has_add:
        for i in range(xr.shape[0]):
            orow[i] = np.float32(np.float32(xr[i] * c) * wr[i]) + ar[i]
    else:
        for i in range(xr.shape[0]):
            orow[i] = np.float32(np.float32(xr[i] * c) * wr[i])


@njit(cache=True, inline="always")
def _rms_mul_row(x, w, eps, out, r, add):
    n = x.shape[1]
    s = 0.0
    for i in range(n):
        s += np.float64(np.float32(x[r, i] * x[r, i]))
    scale = _rms_scale(s, n, eps)
    _rms_mul_out(x[r], scale, w[r % w.shape[0]], add[r % add.shape[0]], add.shape[1] > 0, out[r])


@njit(cache=True, inline="always")
def _rms_scale(s, n, eps):
    mean = np.float32(s / n)
    return np.float32(1.0) / np.float32(math.sqrt(np.float32(mean + eps)))


@njit(cache=True, inline="always")
def _rms_mul_rows4(x, w, eps, out, r, add):
    """``_rms_mul_row`` for rows r..r+3 at once: each row's double sum still adds its squares one after another,
    in order, but the four sums are independent chains, so the core overlaps them (one chain waits ~4 cycles per
    addition: the sum, not the arithmetic, was the norm's cost)."""
    n = x.shape[1]
    s0 = s1 = s2 = s3 = 0.0
    x0, x1, x2, x3 = x[r], x[r + 1], x[r + 2], x[r + 3]
    for i in range(n):
        s0 += np.float64(np.float32(x0[i] * x0[i]))
        s1 += np.float64(np.float32(x1[i] * x1[i]))
        s2 += np.float64(np.float32(x2[i] * x2[i]))
        s3 += np.float64(np.float32(x3[i] * x3[i]))
    c0, c1, c2, c3 = _rms_scale(s0, n, eps), _rms_scale(s1, n, eps), _rms_scale(s2, n, eps), _rms_scale(s3, n, eps)
    for k, c in ((0, c0), (1, c1), (2, c2), (3, c3)):
        _rms_mul_out(x[r + k], c, w[(r + k) % w.shape[0]], add[(r + k) % add.shape[0]], add.shape[1] > 0, out[r + k])


@njit(cache=True, inline="always")
def _rms_mul_rows16(x, w, eps, out, r, add):
    """``_rms_mul_row`` for rows r..r+15: their double sums as the lanes of two vectors (``d8_add_squares``), each
    lane still adding its row's squares one after another, in order; the leftover columns continue each chain."""
    n = x.shape[1]
    n8 = n - n % 8
    a = d8_zero()
    b = d8_zero()
    for j in range(0, n8, 8):
        a = d8_add_squares(x, r, j, a)
        b = d8_add_squares(x, r + 8, j, b)
    for k in range(16):
        s = d8_lane(a, k) if k < 8 else d8_lane(b, k - 8)
        xr = x[r + k]
        for i in range(n8, n):
            s += np.float64(np.float32(xr[i] * xr[i]))
        _rms_mul_out(xr, _rms_scale(s, n, eps), w[(r + k) % w.shape[0]], add[(r + k) % add.shape[0]],
                     add.shape[1] > 0, out[r + k])


@njit(cache=True)
def rms_norm_mul_rows(x, w, eps, out, add):
    """rms_norm(x) * w (+ add) as ggml's ops compute it (the normalised row rounded to float32, then the product,
    then the residual sum); w [rows or 1, n] broadcast over x's rows; add [rows, n], or [1, 0] for none. Sixteen
    rows at a time (``_rms_mul_rows16``), then four, then one."""
    rows = x.shape[0]
    r16 = rows - rows % 16
    for r in range(0, r16, 16):
        _rms_mul_rows16(x, w, eps, out, r, add)
    r4 = rows - rows % 4
    for r in range(r16, r4, 4):
        _rms_mul_rows4(x, w, eps, out, r, add)
    for r in range(r4, rows):
        _rms_mul_row(x, w, eps, out, r, add)


@njit(cache=True)
def add_rms_norm_mul_rows(a, b, s, w, eps, out):
    """s = a + b, then out = rms_norm(s) * w: a residual ADD and the RMS_NORM_MUL that reads it, one call for a
    decoded token (s is still written: the next residual add reads it). The same float32 sums, then
    ``rms_norm_mul_rows``'s arithmetic: the two ops' bits."""
    for r in range(a.shape[0]):
        ar, br, sr = a[r], b[r], s[r]
        for i in range(a.shape[1]):
            sr[i] = ar[i] + br[i]
    rms_norm_mul_rows(s, w, eps, out, np.zeros((1, 0), np.float32))


@njit(parallel=True, cache=True)
def rms_norm_mul_rows_par(x, w, eps, out, add):
    rows = x.shape[0]
    r16 = rows - rows % 16
    for g in prange(r16 // 16):
        _rms_mul_rows16(x, w, eps, out, 16 * g, add)
    r4 = rows - rows % 4
    for r in range(r16, r4, 4):
        _rms_mul_rows4(x, w, eps, out, r, add)
    for r in range(r4, rows):
        _rms_mul_row(x, w, eps, out, r, add)


@njit(cache=True)
def l2_norm_rows(x, eps, out):
    """ggml_compute_forward_l2_norm_f32: the squares rounded to float, summed in double in order, the scale
    1 / max(sqrtf(float(sum)), eps) in float."""
    rows, n = x.shape
    for r in range(rows):
        s = 0.0
        for i in range(n):
            s += np.float64(np.float32(x[r, i] * x[r, i]))
        scale = np.float32(1.0) / max(np.float32(math.sqrt(np.float32(s))), eps)
        for i in range(n):
            out[r, i] = np.float32(x[r, i] * scale)
