"""SOFT_MAX with ggml's CPU arithmetic (ops.cpp ggml_compute_forward_soft_max_f32, vec.cpp ggml_vec_soft_max_f32,
AVX-512 build): w = x * scale (float32), w += slope * mask (fused), max, then 16 lanes at a time ggml_v_expf(w - max)
with each group's lane sum reduced as _mm512_reduce_add_ps does and added to a double; the leftover elements with
expf, also summed in double; finally every value times (float)(1.0 / sum)."""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .act import _fma, v_expf


def _soft_max_rows(x, mask, slopes, scale, out):
    """x, out: float32 (ne3, ne2, ne1, ne0); mask: float32 (m3, m2, >= ne1, ne0), or shape (1, 1, 1, 0) for none;
    slopes: float32 [ne2] (ALiBi, ones without max_bias)."""
    ne3, ne2, ne1, n = x.shape
    has_mask = mask.shape[3] > 0
    n16 = n - n % 16
    for r in prange(ne3 * ne2 * ne1):
        i3 = r // (ne2 * ne1)
        i2 = (r // ne1) % ne2
        i1 = r % ne1
        w = out[i3, i2, i1]
        for i in range(n):
            w[i] = np.float32(x[i3, i2, i1, i] * scale)
        if has_mask:
            m = mask[i3 % mask.shape[0], i2 % mask.shape[1], i1]
            sl = slopes[i2]
            for i in range(n):
                w[i] = _fma(sl, m[i], w[i])
        mx = np.float32(-np.inf)
        for i in range(n):
            if w[i] > mx:
                mx = w[i]
        total = 0.0
        lanes = np.empty(16, np.float32)   # hoisted out of the row loop by Numba's allocation hoisting
        for i0 in range(0, n16, 16):
            for l in range(16):
                lanes[l] = v_expf(np.float32(w[i0 + l] - mx))
                w[i0 + l] = lanes[l]
            for l in range(8):
                lanes[l] = lanes[l] + lanes[l + 8]
            for l in range(4):
                lanes[l] = lanes[l] + lanes[l + 4]
            for l in range(2):
                lanes[l] = lanes[l] + lanes[l + 2]
            total += np.float64(lanes[0] + lanes[1])
        for i in range(n16, n):
            e = np.float32(math.exp(np.float32(w[i] - mx)))
            w[i] = e
            total += np.float64(e)
        inv = np.float32(1.0 / total)
        for i in range(n):
            w[i] = np.float32(w[i] * inv)


soft_max_rows_par = njit(parallel=True, cache=True)(_soft_max_rows)
soft_max_rows = njit(cache=True)(_soft_max_rows)
