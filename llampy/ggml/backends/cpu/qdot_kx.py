"""Q4_K matrix products in SIMD, as llama.cpp runs them on x86 when the rows come in eights (the repacked
``ggml_gemv_q4_K_8x8_q8_K`` / ``ggml_gemm_q4_K_8x8_q8_K`` of ggml-cpu/repack.cpp): per weight row and activation
row, the integer products of a whole super-block (256 values, each sub-block times its 6-bit scale) summed
exactly, then ``acc = fma(isum, d_w * d_x, acc)`` and the same for the mins (``mins = fma(imin, dmin_w * d_x,
mins)``); result ``acc - mins``. The gemm form, which llama.cpp uses for activation rows in groups of four, fma's
once per pair of sub-blocks instead. The integer sums are vpdpbusd lanes (simd.py); the float steps are the scalar
kernel's (qdot_k.mv_q4_k_x8), so both give the same bits.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .qdot import ROW_CHUNK, prefetch_row
from .qdot_k import _scale_min
from .simd import (f8_fma, f8_hsum, f8_zero, f16_at, fma32, i8_add, i8_hsum, i8_scale2, i8_sub, i8_to_f8, i8_zero,
                   q4k_pair, q6k_group, q6k_offset)


@njit(cache=True, inline="always")
def _scales(row, o, scm):
    """The eight scales (scm[0:8]) and mins (scm[8:16]) of the super-block at byte o."""
    for j in range(8):
        scm[j], scm[8 + j] = _scale_min(row, o + 4, j)


@njit(cache=True, inline="always")
def _mins2(m_lo, m_hi, bs, i, a):
    """Sub-blocks 2j and 2j + 1 (their bsums from index a): mins times activation sums (bsums in pairs)."""
    return m_lo * (np.int32(bs[i, a]) + np.int32(bs[i, a + 1])) + m_hi * (np.int32(bs[i, a + 2]) + np.int32(bs[i, a + 3]))


@njit(cache=True, inline="always")
def _gemm_pair(row, qo, x0, x1, x2, x3, xo, s_lo, s_hi, m_lo, m_hi, bs, i, a, d0, d1, d2, d3, e0, e1, e2, e3,
               a0, a1, a2, a3, m0, m1, m2, m3):
    """One pair of sub-blocks for four activation rows (the gemm form's fma step)."""
    a0 = fma32(np.float32(i8_hsum(q4k_pair(row, qo, x0, xo, s_lo, s_hi))), d0, a0)
    a1 = fma32(np.float32(i8_hsum(q4k_pair(row, qo, x1, xo, s_lo, s_hi))), d1, a1)
    a2 = fma32(np.float32(i8_hsum(q4k_pair(row, qo, x2, xo, s_lo, s_hi))), d2, a2)
    a3 = fma32(np.float32(i8_hsum(q4k_pair(row, qo, x3, xo, s_lo, s_hi))), d3, a3)
    m0 = fma32(np.float32(_mins2(m_lo, m_hi, bs, i, a)), e0, m0)
    m1 = fma32(np.float32(_mins2(m_lo, m_hi, bs, i + 1, a)), e1, m1)
    m2 = fma32(np.float32(_mins2(m_lo, m_hi, bs, i + 2, a)), e2, m2)
    m3 = fma32(np.float32(_mins2(m_lo, m_hi, bs, i + 3, a)), e3, m3)
    return a0, a1, a2, a3, m0, m1, m2, m3


@njit(cache=True, inline="always")
def _gemv_block(row, o, xr, xo, scm):
    """The whole super-block's scaled integer sum for one activation row (gemv: one fma per super-block)."""
    v = q4k_pair(row, o + 16, xr, xo, scm[0], scm[1])
    v = i8_add(v, q4k_pair(row, o + 48, xr, xo + 64, scm[2], scm[3]))
    v = i8_add(v, q4k_pair(row, o + 80, xr, xo + 128, scm[4], scm[5]))
    v = i8_add(v, q4k_pair(row, o + 112, xr, xo + 192, scm[6], scm[7]))
    return i8_hsum(v)


@njit(parallel=True, cache=True, nogil=True)
def mv_q4_k_x8(w, xq, xd, bsums, out, tab, n_gemm):
    """Same arguments and results as qdot_k.mv_q4_k_x8 (``tab`` unused: the F16 scales convert in hardware)."""
    rows = w.shape[0]
    n = xq.shape[0]
    nb = xq.shape[1] // 256
    for c in prange((rows + ROW_CHUNK - 1) // ROW_CHUNK):
        scm = np.empty(16, np.int32)
        for r in range(c * ROW_CHUNK, min(rows, (c + 1) * ROW_CHUNK)):
            row = w[r]
            prefetch_row(w, r)
            for i in range(0, n_gemm, 4):      # gemm: four activation rows, one fma per pair of sub-blocks
                a0 = a1 = a2 = a3 = np.float32(0.0)
                m0 = m1 = m2 = m3 = np.float32(0.0)
                x0, x1, x2, x3 = xq[i], xq[i + 1], xq[i + 2], xq[i + 3]
                for b in range(nb):
                    o = b * 144
                    dw = f16_at(row, o)
                    dmw = f16_at(row, o + 2)
                    _scales(row, o, scm)
                    d0, d1, d2, d3 = dw * xd[i, b], dw * xd[i + 1, b], dw * xd[i + 2, b], dw * xd[i + 3, b]
                    e0, e1 = dmw * xd[i, b], dmw * xd[i + 1, b]
                    e2, e3 = dmw * xd[i + 2, b], dmw * xd[i + 3, b]
                    g = b * 16
                    xo = b * 256
                    a0, a1, a2, a3, m0, m1, m2, m3 = _gemm_pair(row, o + 16, x0, x1, x2, x3, xo, scm[0], scm[1],
                                                                scm[8], scm[9], bsums, i, g, d0, d1, d2, d3,
                                                                e0, e1, e2, e3, a0, a1, a2, a3, m0, m1, m2, m3)
                    a0, a1, a2, a3, m0, m1, m2, m3 = _gemm_pair(row, o + 48, x0, x1, x2, x3, xo + 64, scm[2], scm[3],
                                                                scm[10], scm[11], bsums, i, g + 4, d0, d1, d2, d3,
                                                                e0, e1, e2, e3, a0, a1, a2, a3, m0, m1, m2, m3)
                    a0, a1, a2, a3, m0, m1, m2, m3 = _gemm_pair(row, o + 80, x0, x1, x2, x3, xo + 128, scm[4], scm[5],
                                                                scm[12], scm[13], bsums, i, g + 8, d0, d1, d2, d3,
                                                                e0, e1, e2, e3, a0, a1, a2, a3, m0, m1, m2, m3)
                    a0, a1, a2, a3, m0, m1, m2, m3 = _gemm_pair(row, o + 112, x0, x1, x2, x3, xo + 192, scm[6], scm[7],
                                                                scm[14], scm[15], bsums, i, g + 12, d0, d1, d2, d3,
                                                                e0, e1, e2, e3, a0, a1, a2, a3, m0, m1, m2, m3)
                out[i, r] = np.float32(a0 - m0)
                out[i + 1, r] = np.float32(a1 - m1)
                out[i + 2, r] = np.float32(a2 - m2)
                out[i + 3, r] = np.float32(a3 - m3)
            for i in range(n_gemm, n):         # gemv: one fma per super-block
                acc = np.float32(0.0)
                accm = np.float32(0.0)
                xr = xq[i]
                for b in range(nb):
                    o = b * 144
                    _scales(row, o, scm)
                    isum = _gemv_block(row, o, xr, b * 256, scm)
                    g = b * 16
                    imin = (_mins2(scm[8], scm[9], bsums, i, g) + _mins2(scm[10], scm[11], bsums, i, g + 4) +
                            _mins2(scm[12], scm[13], bsums, i, g + 8) + _mins2(scm[14], scm[15], bsums, i, g + 12))
                    acc = fma32(np.float32(isum), np.float32(f16_at(row, o) * xd[i, b]), acc)
                    accm = fma32(np.float32(imin), np.float32(f16_at(row, o + 2) * xd[i, b]), accm)
                out[i, r] = np.float32(acc - accm)


# ggml_vec_dot_q6_K_q8_K (AVX2 form; x86 does not repack Q6_K): per super-block eight int32 lanes, lane l the
# four products of elements 4l..4l+3 of every 32-value group times the group half's scale, minus ggml's q8sclsub
# (the -32 offset through the block sums); acc = fma(d_x * d_w, lanes, acc); out = hsum_float_8(acc).
@njit(cache=True, inline="always")
def _q6k_half(row, o, h, xr, xo, sumi):
    ql = o + 64 * h
    qh = o + 128 + 32 * h
    so = o + 192 + 8 * h
    sumi = i8_add(sumi, i8_scale2(q6k_group(row, ql, qh, 0, xr, xo), np.int8(row[so]), np.int8(row[so + 1])))
    sumi = i8_add(sumi, i8_scale2(q6k_group(row, ql, qh, 1, xr, xo + 32), np.int8(row[so + 2]), np.int8(row[so + 3])))
    sumi = i8_add(sumi, i8_scale2(q6k_group(row, ql, qh, 2, xr, xo + 64), np.int8(row[so + 4]), np.int8(row[so + 5])))
    sumi = i8_add(sumi, i8_scale2(q6k_group(row, ql, qh, 3, xr, xo + 96), np.int8(row[so + 6]), np.int8(row[so + 7])))
    return sumi


@njit(parallel=True, cache=True, nogil=True)
def mv_q6_k(w, xq, xd, bsums, out, tab):
    """Same arguments and results as qdot_k.mv_q6_k (``tab`` unused)."""
    rows = w.shape[0]
    n = xq.shape[0]
    nb = xq.shape[1] // 256
    for c in prange((rows + ROW_CHUNK - 1) // ROW_CHUNK):
        for r in range(c * ROW_CHUNK, min(rows, (c + 1) * ROW_CHUNK)):
            row = w[r]
            prefetch_row(w, r)
            for i in range(n):
                xr = xq[i]
                bs = bsums[i]
                acc = f8_zero()
                for b in range(nb):
                    o = b * 210
                    d = np.float32(xd[i, b] * f16_at(row, o + 208))
                    sumi = _q6k_half(row, o, 0, xr, b * 256, i8_zero())
                    sumi = _q6k_half(row, o, 1, xr, b * 256 + 128, sumi)
                    sumi = i8_sub(sumi, q6k_offset(row, o + 192, bs, b * 16))
                    acc = f8_fma(d, i8_to_f8(sumi), acc)
                out[i, r] = f8_hsum(acc)
