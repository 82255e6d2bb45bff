"""SOFT_MAX with ggml's CPU arithmetic (ops.cpp ggml_compute_forward_soft_max_f32, vec.cpp ggml_vec_soft_max_f32,
in the host build's width ``F16_VEC_LANES``): w = x * scale (float32), w += slope * mask (fused), max, then 16 lanes
(AVX-512) or 8 (AVX2) at a time ggml_v_expf(w - max) with each group's lane sum reduced by halving (lanes l and
l + 8, then l + 4, l + 2, l + 1: _mm512_reduce_add_ps, and the AVX2 build's extract/movehl/movehdup adds) and added
to a double; the leftover elements with expf (glibc's), also summed in double; finally every value times
(float)(1.0 / sum)."""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .act import _fma, v_expf
from .builds import parallel_build
from .simd import F16_VEC_LANES


_EXPF_T = np.array([np.float64(2.0 ** (i / 32)).view(np.uint64) - np.uint64((i << 52) // 32) for i in range(32)],
                   np.uint64)
_EXPF_C0 = float.fromhex("0x1.c6af84b912394p-5") / 32 ** 3
_EXPF_C1 = float.fromhex("0x1.ebfce50fac4f3p-3") / 32 ** 2
_EXPF_C2 = float.fromhex("0x1.62e42ff0c52d6p-1") / 32
_EXPF_INVLN2N = float.fromhex("0x1.71547652b82fep+0") * 32
_EXPF_SHIFT = float.fromhex("0x1.8p+52")


@njit(cache=True, nogil=True)
def expf(x):
    """glibc's scalar expf (>= 2.27, ARM's optimized-routines algorithm), which ggml's scalar code calls: a double
    evaluation whose float result is not always the correctly rounded one (math.exp's is)."""
    xd = np.float64(np.float32(x))
    if xd != xd:
        return np.float32(xd)
    if xd > 88.72283935546875:
        return np.float32(np.inf)
    if xd < -103.97207641601562:
        return np.float32(0.0)
    z = _EXPF_INVLN2N * xd
    kd = z + _EXPF_SHIFT
    ki = np.array([kd]).view(np.uint64)[0]
    r = z - (kd - _EXPF_SHIFT)
    t = _EXPF_T[ki % np.uint64(32)] + (ki << np.uint64(47))
    sc = np.array([t]).view(np.float64)[0]
    y = (_EXPF_C0 * r + _EXPF_C1) * (r * r) + (_EXPF_C2 * r + 1.0)
    return np.float32(y * sc)


def _soft_max_rows(x, mask, slopes, scale, out):
    """x, out: float32 (ne3, ne2, ne1, ne0); mask: float32 (m3, m2, >= ne1, ne0), or shape (1, 1, 1, 0) for none;
    slopes: float32 [ne2] (ALiBi, ones without max_bias)."""
    ne3, ne2, ne1, n = x.shape
    has_mask = mask.shape[3] > 0
    VL = F16_VEC_LANES
    nv = n - n % VL
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
        for i0 in range(0, nv, VL):
            for l in range(VL):
                lanes[l] = v_expf(np.float32(w[i0 + l] - mx))
                w[i0 + l] = lanes[l]
            if VL == 16:
                for l in range(8):
                    lanes[l] = lanes[l] + lanes[l + 8]
            for l in range(4):
                lanes[l] = lanes[l] + lanes[l + 4]
            for l in range(2):
                lanes[l] = lanes[l] + lanes[l + 2]
            total += np.float64(lanes[0] + lanes[1])
        for i in range(nv, n):
            e = expf(np.float32(w[i] - mx))
            w[i] = e
            total += np.float64(e)
        inv = np.float32(1.0 / total)
        for i in range(n):
            w[i] = np.float32(w[i] * inv)


soft_max_rows_par = parallel_build(_soft_max_rows)
soft_max_rows = njit(cache=True)(_soft_max_rows)
