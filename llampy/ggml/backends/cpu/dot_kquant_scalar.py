"""Numba integer dot products on raw GGUF blocks of the k-quants (Q4_K, Q5_K, Q6_K) against Q8_K activations.

Activations come from ``act_quant`` in split form: xq int8 [n, k], xd float32 [n, k/256] (Q8_K keeps d as
float32), bsums int16 [n, k/16]. Each kernel follows the float order of llama.cpp's x86 build
(ggml-cpu/arch/x86/quants.c AVX2 ``ggml_vec_dot_*_q8_K``; for Q4_K with rows % 8 == 0 the repacked
``ggml_gemv/gemm_q4_K_8x8_q8_K`` of ggml-cpu/repack.cpp, which llama.cpp uses then). Integer sums are exact in any
order.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .act import _fma
from .dot_q32 import _f16, prefetch_row


@njit(cache=True, inline="always")
def _hsum8(acc):
    """ggml's hsum_float_8: ((a4 + a0) + (a6 + a2)) + ((a5 + a1) + (a7 + a3))."""
    return ((acc[4] + acc[0]) + (acc[6] + acc[2])) + ((acc[5] + acc[1]) + (acc[7] + acc[3]))


@njit(cache=True)
def _scale_min(sc, o, j):
    if j < 4:
        return np.int32(sc[o + j] & 63), np.int32(sc[o + j + 4] & 63)
    s = np.int32(sc[o + j + 4] & 15) | (np.int32(sc[o + j - 4] >> 6) << 4)
    m = np.int32(sc[o + j + 4] >> 4) | (np.int32(sc[o + j] >> 6) << 4)
    return s, m


# ggml_vec_dot_q4_K_q8_K (AVX2): eight int32 lanes of scaled sums per super-block, fma'd with d = d_x * d_w; the
# mins through four lanes (pairs of 32-element sub-blocks) fma'd with -d_x * dmin_w; summed as the intrinsics do
@njit(parallel=True, cache=True)
def mv_q4_k(w, xq, xd, bsums, out, tab):
    rows = w.shape[0]
    n = xq.shape[0]
    nb = xq.shape[1] // 256
    for r in prange(rows):
        row = w[r]
        prefetch_row(w, r)
        acc = np.empty(8, np.float32)
        accm = np.empty(4, np.float32)
        lane = np.empty(8, np.int32)
        sc = np.empty(8, np.int32)
        mn = np.empty(8, np.int32)
        for i in range(n):
            acc[:] = 0
            accm[:] = 0
            for b in range(nb):
                o = b * 144
                d = np.float32(xd[i, b] * _f16(tab, row, o))
                dmin = np.float32(-xd[i, b] * _f16(tab, row, o + 2))
                for j in range(8):
                    sc[j], mn[j] = _scale_min(row, o + 4, j)
                for k in range(4):
                    g = b * 16 + 4 * k
                    p = mn[2 * k] * (np.int32(bsums[i, g]) + np.int32(bsums[i, g + 1])) + \
                        mn[2 * k + 1] * (np.int32(bsums[i, g + 2]) + np.int32(bsums[i, g + 3]))
                    accm[k] = _fma(dmin, np.float32(p), accm[k])
                lane[:] = 0
                for j2 in range(4):
                    base = b * 256 + j2 * 64
                    for l in range(8):
                        sl = 0
                        sh = 0
                        for e in range(4 * l, 4 * l + 4):
                            q = row[o + 16 + j2 * 32 + e]
                            sl += np.int32(q & 15) * np.int32(xq[i, base + e])
                            sh += np.int32(q >> 4) * np.int32(xq[i, base + 32 + e])
                        lane[l] += sc[2 * j2] * sl + sc[2 * j2 + 1] * sh
                for l in range(8):
                    acc[l] = _fma(d, np.float32(lane[l]), acc[l])
            m0 = np.float32(accm[0] + accm[2])
            m1 = np.float32(accm[1] + accm[3])
            out[i, r] = _hsum8(acc) + np.float32(m0 + m1)


# ggml_gemv/gemm_q4_K_8x8_q8_K (AVX2, the repacked layout llama.cpp uses when rows % 8 == 0): per row, exact
# integer sums per super-block, then acc = fma(sum, d_w * d_x, acc) and the same for the mins; out = acc - mins
# The batched form (ggml_gemm_*, activation rows in groups of four) fma's once per pair of sub-blocks instead.
@njit(parallel=True, cache=True)
def mv_q4_k_x8(w, xq, xd, bsums, out, tab, n_gemm):
    rows = w.shape[0]
    n = xq.shape[0]
    nb = xq.shape[1] // 256
    for r in prange(rows):
        row = w[r]
        prefetch_row(w, r)
        for i in range(n):
            acc = np.float32(0.0)
            accm = np.float32(0.0)
            for b in range(nb):
                o = b * 144
                isum = 0
                imin = 0
                dw = _f16(tab, row, o)
                dmw = _f16(tab, row, o + 2)
                for j in range(8):
                    scj, mnj = _scale_min(row, o + 4, j)
                    base = b * 256 + j * 32
                    qo = o + 16 + (j // 2) * 32
                    t = 0
                    for e in range(32):
                        q = row[qo + e]
                        qv = (q & 15) if j % 2 == 0 else (q >> 4)
                        t += np.int32(qv) * np.int32(xq[i, base + e])
                    isum += scj * t
                    imin += mnj * (np.int32(bsums[i, b * 16 + 2 * j]) + np.int32(bsums[i, b * 16 + 2 * j + 1]))
                    if i < n_gemm and j % 2 == 1:
                        acc = _fma(np.float32(isum), np.float32(dw * xd[i, b]), acc)
                        accm = _fma(np.float32(imin), np.float32(dmw * xd[i, b]), accm)
                        isum = 0
                        imin = 0
                if i >= n_gemm:
                    acc = _fma(np.float32(isum), np.float32(dw * xd[i, b]), acc)
                    accm = _fma(np.float32(imin), np.float32(dmw * xd[i, b]), accm)
            out[i, r] = np.float32(acc - accm)


# ggml_vec_dot_q6_K_q8_K (AVX2): unsigned 6-bit values in eight lanes, the -32 offset subtracted per lane through
# the block sums (lane l: 16-element groups 2l and 2l+1), fma'd with d = d_x * d_w
@njit(parallel=True, cache=True)
def mv_q6_k(w, xq, xd, bsums, out, tab):
    rows = w.shape[0]
    n = xq.shape[0]
    nb = xq.shape[1] // 256
    for r in prange(rows):
        row = w[r]
        prefetch_row(w, r)
        acc = np.empty(8, np.float32)
        lane = np.empty(8, np.int32)
        for i in range(n):
            acc[:] = 0
            for b in range(nb):
                o = b * 210
                d = np.float32(xd[i, b] * _f16(tab, row, o + 208))
                lane[:] = 0
                for h in range(2):
                    ql = o + h * 64
                    qh = o + 128 + h * 32
                    for g in range(4):
                        base = b * 256 + h * 128 + g * 32
                        for l in range(8):
                            s = 0
                            for e in range(4 * l, 4 * l + 4):
                                hb = np.int32(row[qh + e])
                                if g == 0:
                                    q = np.int32(row[ql + e] & 15) | ((hb & 3) << 4)
                                elif g == 1:
                                    q = np.int32(row[ql + 32 + e] & 15) | (((hb >> 2) & 3) << 4)
                                elif g == 2:
                                    q = np.int32(row[ql + e] >> 4) | (((hb >> 4) & 3) << 4)
                                else:
                                    q = np.int32(row[ql + 32 + e] >> 4) | (((hb >> 6) & 3) << 4)
                                s += q * np.int32(xq[i, base + e])
                            scl = np.int32(np.int8(row[o + 192 + 8 * h + 2 * g + (1 if l >= 4 else 0)]))
                            lane[l] += scl * s
                for l in range(8):
                    g0 = b * 16 + 2 * l
                    sub = (np.int32(bsums[i, g0]) * np.int32(np.int8(row[o + 192 + 2 * l])) +
                           np.int32(bsums[i, g0 + 1]) * np.int32(np.int8(row[o + 192 + 2 * l + 1]))) << 5
                    acc[l] = _fma(d, np.float32(lane[l] - sub), acc[l])
            out[i, r] = _hsum8(acc)


# ggml_vec_dot_q5_K_q8_K (AVX2): lane l = sum over the eight 32-element sub-blocks of scale * (the products of
# elements 4l..4l+3); acc = fma(d, lane, acc) per super-block; the mins: summs = fma(dmin, sum(m_j * bsum_j), summs)
# with dmin = -d_x * dmin_w; out = hsum8(acc) + summs. (llama.cpp repacks Q5_K when rows % 8 == 0 in newer builds;
# that form's float order is not mirrored here.)
@njit(parallel=True, cache=True)
def mv_q5_k(w, xq, xd, bsums, out, tab):
    rows = w.shape[0]
    n = xq.shape[0]
    nb = xq.shape[1] // 256
    for r in prange(rows):
        row = w[r]
        prefetch_row(w, r)
        acc = np.empty(8, np.float32)
        lane = np.empty(8, np.int64)
        sc = np.empty(8, np.int32)
        mn = np.empty(8, np.int32)
        for i in range(n):
            acc[:] = 0
            summs = np.float32(0.0)
            for b in range(nb):
                o = b * 176
                d = np.float32(xd[i, b] * _f16(tab, row, o))
                dmin = np.float32(-xd[i, b] * _f16(tab, row, o + 2))
                for j in range(8):
                    sc[j], mn[j] = _scale_min(row, o + 4, j)
                msum = 0
                for j in range(8):
                    msum += mn[j] * (np.int32(bsums[i, b * 16 + 2 * j]) + np.int32(bsums[i, b * 16 + 2 * j + 1]))
                summs = _fma(dmin, np.float32(msum), summs)
                lane[:] = 0
                for j in range(8):
                    base = b * 256 + j * 32
                    qo = o + 48 + (j // 2) * 32
                    sh = 4 * (j % 2)
                    for l in range(8):
                        s = 0
                        for e in range(4 * l, 4 * l + 4):
                            q = (np.int32(row[qo + e]) >> sh) & 15
                            q |= ((np.int32(row[o + 16 + e]) >> j) & 1) << 4
                            s += q * np.int32(xq[i, base + e])
                        lane[l] += sc[j] * s
                for l in range(8):
                    acc[l] = _fma(d, np.float32(lane[l]), acc[l])
            out[i, r] = _hsum8(acc) + summs


# ------------------------------------------------------------------------------------------ tile dequantization
# For the BLAS path: float32 [rows, k] tiles with ggml's dequantize_row_q{4,5,6}_K values.

@njit(cache=True, nogil=True)
def dq_k(w, kind, out, tab):
    """kind: 4 Q4_K, 5 Q5_K, 6 Q6_K."""
    rows, k = out.shape
    nb = k // 256
    for r in range(rows):
        row = w[r]
        for b in range(nb):
            xo = b * 256
            if kind == 6:
                o = b * 210
                d = _f16(tab, row, o + 208)
                for h in range(2):
                    ql = o + h * 64
                    qh = o + 128 + h * 32
                    sc = o + 192 + h * 8
                    y = xo + h * 128
                    for l in range(32):
                        hb = np.int32(row[qh + l])
                        s = l // 16
                        q1 = (np.int32(row[ql + l] & 15) | ((hb & 3) << 4)) - 32
                        q2 = (np.int32(row[ql + 32 + l] & 15) | (((hb >> 2) & 3) << 4)) - 32
                        q3 = (np.int32(row[ql + l] >> 4) | (((hb >> 4) & 3) << 4)) - 32
                        q4 = (np.int32(row[ql + 32 + l] >> 4) | (((hb >> 6) & 3) << 4)) - 32
                        out[r, y + l] = np.float32(d * np.float32(np.int8(row[sc + s]))) * np.float32(q1)
                        out[r, y + 32 + l] = np.float32(d * np.float32(np.int8(row[sc + s + 2]))) * np.float32(q2)
                        out[r, y + 64 + l] = np.float32(d * np.float32(np.int8(row[sc + s + 4]))) * np.float32(q3)
                        out[r, y + 96 + l] = np.float32(d * np.float32(np.int8(row[sc + s + 6]))) * np.float32(q4)
            else:
                o = b * (144 if kind == 4 else 176)
                qs = o + (16 if kind == 4 else 48)
                d = _f16(tab, row, o)
                dmin = _f16(tab, row, o + 2)
                for j in range(8):
                    s, m = _scale_min(row, o + 4, j)
                    d1 = np.float32(d * np.float32(s))
                    m1 = np.float32(dmin * np.float32(m))
                    qo = qs + (j // 2) * 32
                    sh = 4 * (j % 2)
                    for e in range(32):
                        q = (np.int32(row[qo + e]) >> sh) & 15
                        if kind == 5:
                            q |= ((np.int32(row[o + 16 + e]) >> j) & 1) << 4
                        out[r, xo + j * 32 + e] = d1 * np.float32(q) - m1
