"""Numba integer dot products on raw GGUF blocks, for matrix-vector products (decode).

The activations are quantized once per call to the weight's dot type — Q8_0 (Q4_0, Q5_0, Q8_0), Q8_1 (Q4_1)
or Q8_K (Q4_K, Q6_K) — exactly as ggml's quantize_row_q8_*; then each output is a sum over blocks of
(weight scale × activation scale × integer dot), with llama.cpp's per-type formula.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ...quants import quantize_act as quantize
from ...types import GGMLType

T = GGMLType

# fp16 bits -> float32, as a table (256 KiB): the scales are read with one lookup
F16_TABLE = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)


@njit(cache=True, fastmath=False)
def _f16(tab, b0, b1):
    return tab[np.uint16(b0) | (np.uint16(b1) << np.uint16(8))]


# ------------------------------------------------------------------------------------------ dot kernels
@njit(cache=True, inline="always")
def _fma(a, b, c):
    """float32 fused multiply-add: the exact product and sum, rounded once (through float64)."""
    return np.float32(np.float64(a) * np.float64(b) + np.float64(c))


@njit(cache=True, inline="always")
def _hsum8(acc):
    """ggml's hsum_float_8: ((a4 + a0) + (a6 + a2)) + ((a5 + a1) + (a7 + a3))."""
    return ((acc[4] + acc[0]) + (acc[6] + acc[2])) + ((acc[5] + acc[1]) + (acc[7] + acc[3]))


# ggml_vec_dot_q8_0_q8_0 as compiled for AVX2/AVX-512: per block, eight int32 lanes of four products each,
# scaled by d_w * d_x and fused-multiply-added into eight float lanes, summed at the end by hsum_float_8.
# fastmath "contract" lets LLVM emit the same fused multiply-adds (acc = d * s + acc) that ggml's code uses.
ROW_CHUNK = 16


@njit(parallel=True, cache=True, fastmath={"contract"})
def _mv_q8_0(w, xq, xd, out, tab):
    rows = w.shape[0]
    n = xq.shape[0]
    nb = xq.shape[1] // 32
    for c in prange((rows + ROW_CHUNK - 1) // ROW_CHUNK):
        lane = np.empty(8, np.int32)
        acc = np.empty(8, np.float32)
        for r in range(c * ROW_CHUNK, min(rows, (c + 1) * ROW_CHUNK)):
            wr = w[r]
            for i in range(n):
                xr = xq[i]
                acc[:] = 0
                for b in range(nb):
                    o = b * 34 + 2
                    xo = b * 32
                    for l in range(8):
                        e = 4 * l
                        lane[l] = (np.int32(np.int8(wr[o + e])) * np.int32(xr[xo + e])
                                   + np.int32(np.int8(wr[o + e + 1])) * np.int32(xr[xo + e + 1])
                                   + np.int32(np.int8(wr[o + e + 2])) * np.int32(xr[xo + e + 2])
                                   + np.int32(np.int8(wr[o + e + 3])) * np.int32(xr[xo + e + 3]))
                    d = np.float32(tab[np.int32(wr[o - 2]) | (np.int32(wr[o - 1]) << 8)] * xd[i, b])
                    for l in range(8):
                        acc[l] = d * np.float32(lane[l]) + acc[l]
                out[i, r] = _hsum8(acc)


# ggml_vec_dot_q4_0_q8_0 (AVX2): lanes as for q8_0 over the nibbles minus 8
@njit(parallel=True, cache=True, fastmath={"contract"})
def _mv_q4_0(w, xq, xd, out, tab):
    rows = w.shape[0]
    n = xq.shape[0]
    nb = xq.shape[1] // 32
    for c in prange((rows + ROW_CHUNK - 1) // ROW_CHUNK):
        lane = np.empty(8, np.int32)
        acc = np.empty(8, np.float32)
        for r in range(c * ROW_CHUNK, min(rows, (c + 1) * ROW_CHUNK)):
            wr = w[r]
            for i in range(n):
                xr = xq[i]
                acc[:] = 0
                for b in range(nb):
                    o = b * 18 + 2
                    xo = b * 32
                    for l in range(8):
                        s_ = 0
                        for e in range(4 * l, 4 * l + 4):
                            q = np.int32(wr[o + (e % 16)])
                            v = ((q & 15) if e < 16 else (q >> 4)) - 8
                            s_ += v * np.int32(xr[xo + e])
                        lane[l] = s_
                    d = np.float32(tab[np.int32(wr[o - 2]) | (np.int32(wr[o - 1]) << 8)] * xd[i, b])
                    for l in range(8):
                        acc[l] = d * np.float32(lane[l]) + acc[l]
                out[i, r] = _hsum8(acc)


# ggml_vec_dot_q4_1_q8_1 (AVX2): lanes as for q8_0, plus the mins: summs = m_w * s_x + summs (fused), added
# after the hsum
@njit(parallel=True, cache=True, fastmath={"contract"})
def _mv_q4_1(w, xq, xd, xs, out, tab):
    rows = w.shape[0]
    n = xq.shape[0]
    nb = xq.shape[1] // 32
    for c in prange((rows + ROW_CHUNK - 1) // ROW_CHUNK):
        lane = np.empty(8, np.int32)
        acc = np.empty(8, np.float32)
        for r in range(c * ROW_CHUNK, min(rows, (c + 1) * ROW_CHUNK)):
            wr = w[r]
            for i in range(n):
                xr = xq[i]
                acc[:] = 0
                summs = np.float32(0.0)
                for b in range(nb):
                    o = b * 20 + 4
                    xo = b * 32
                    for l in range(4):
                        e = 4 * l
                        q0 = np.int32(wr[o + e])
                        q1 = np.int32(wr[o + e + 1])
                        q2 = np.int32(wr[o + e + 2])
                        q3 = np.int32(wr[o + e + 3])
                        lane[l] = ((q0 & 15) * np.int32(xr[xo + e]) + (q1 & 15) * np.int32(xr[xo + e + 1])
                                   + (q2 & 15) * np.int32(xr[xo + e + 2]) + (q3 & 15) * np.int32(xr[xo + e + 3]))
                        lane[l + 4] = ((q0 >> 4) * np.int32(xr[xo + 16 + e]) + (q1 >> 4) * np.int32(xr[xo + 17 + e])
                                       + (q2 >> 4) * np.int32(xr[xo + 18 + e]) + (q3 >> 4) * np.int32(xr[xo + 19 + e]))
                    d0 = tab[np.int32(wr[o - 4]) | (np.int32(wr[o - 3]) << 8)]
                    m = tab[np.int32(wr[o - 2]) | (np.int32(wr[o - 1]) << 8)]
                    summs = m * xs[i, b] + summs
                    d = np.float32(d0 * xd[i, b])
                    for l in range(8):
                        acc[l] = d * np.float32(lane[l]) + acc[l]
                out[i, r] = _hsum8(acc) + summs


# ggml_vec_dot_q5_0_q8_0 (AVX2): the q8_0 lane structure over the signed 5-bit values
@njit(parallel=True, cache=True)
def _mv_q5_0(w, xq, xd, out, tab):
    rows = w.shape[0]
    n = xq.shape[0]
    nb = xq.shape[1] // 32
    for r in prange(rows):
        acc = np.empty(8, np.float32)
        for i in range(n):
            acc[:] = 0
            for b in range(nb):
                o = b * 22
                d = np.float32(_f16(tab, w[r, o], w[r, o + 1]) * xd[i, b])
                qh = np.uint32(w[r, o + 2]) | (np.uint32(w[r, o + 3]) << 8) | (np.uint32(w[r, o + 4]) << 16) | \
                    (np.uint32(w[r, o + 5]) << 24)
                for l in range(8):
                    s = 0
                    for e in range(4 * l, 4 * l + 4):
                        q = w[r, o + 6 + (e % 16)]
                        lo = np.int32(q & 15) if e < 16 else np.int32(q >> 4)
                        v = (lo | np.int32(((qh >> e) & 1) << 4)) - 16
                        s += v * np.int32(xq[i, b * 32 + e])
                    acc[l] = _fma(d, np.float32(s), acc[l])
            out[i, r] = _hsum8(acc)


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
def _mv_q4_k(w, xq, xd, bsums, out, tab):
    rows = w.shape[0]
    n = xq.shape[0]
    nb = xq.shape[1] // 256
    for r in prange(rows):
        row = w[r]
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
                d = np.float32(xd[i, b] * _f16(tab, row[o], row[o + 1]))
                dmin = np.float32(-xd[i, b] * _f16(tab, row[o + 2], row[o + 3]))
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
def _mv_q4_k_x8(w, xq, xd, bsums, out, tab, n_gemm):
    rows = w.shape[0]
    n = xq.shape[0]
    nb = xq.shape[1] // 256
    for r in prange(rows):
        row = w[r]
        for i in range(n):
            acc = np.float32(0.0)
            accm = np.float32(0.0)
            for b in range(nb):
                o = b * 144
                isum = 0
                imin = 0
                dw = _f16(tab, row[o], row[o + 1])
                dmw = _f16(tab, row[o + 2], row[o + 3])
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
def _mv_q6_k(w, xq, xd, bsums, out, tab):
    rows = w.shape[0]
    n = xq.shape[0]
    nb = xq.shape[1] // 256
    for r in prange(rows):
        row = w[r]
        acc = np.empty(8, np.float32)
        lane = np.empty(8, np.int32)
        for i in range(n):
            acc[:] = 0
            for b in range(nb):
                o = b * 210
                d = np.float32(xd[i, b] * _f16(tab, row[o + 208], row[o + 209]))
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


_Q8_0_TYPES = {T.Q8_0: _mv_q8_0, T.Q4_0: _mv_q4_0, T.Q5_0: _mv_q5_0}
_SUPPORTED = set(_Q8_0_TYPES) | {T.Q4_1, T.Q4_K, T.Q6_K}


def supports(wtype: GGMLType) -> bool:
    return wtype in _SUPPORTED


@njit(cache=True, inline="always")
def _r16(x):
    """float32 rounded to the nearest F16 value, returned as float32."""
    if abs(x) < np.float32(6.103515625e-05):
        return np.float32(np.rint(np.float64(x) * 16777216.0) / 16777216.0)
    if abs(x) >= np.float32(65520.0):
        return np.float32(np.inf) if x > 0 else np.float32(-np.inf)
    t = x * np.float32(8193.0)
    return t - (t - x)


@njit(cache=True)
def _act_q8_x86(x, xq, xd, xs):
    """ggml's x86 quantize_row_q8_0 / q8_1: d = amax/127, id = 127/amax, round half to even; s = d * sum(q)."""
    n, k = x.shape
    for i in range(n):
        for b in range(k // 32):
            o = b * 32
            amax = np.float32(0.0)
            for j in range(32):
                v = abs(x[i, o + j])
                if v > amax:
                    amax = v
            d = amax / np.float32(127.0)
            idv = np.float32(127.0) / amax if amax != 0 else np.float32(0.0)
            tot = 0
            for j in range(32):
                q = np.int32(np.rint(x[i, o + j] * idv))
                xq[i, o + j] = q
                tot += q
            xd[i, b] = _r16(d)
            xs[i, b] = _r16(np.float32(d * np.float32(tot)))


def act_q8(x: np.ndarray, vdt: GGMLType):
    """Activations quantized as ggml's quantize_row_q8_{0,1,K}: (xq int8 [n, k], xd float32 scales, extra)
    where extra is Q8_1's s per block or Q8_K's bsums."""
    n, k = x.shape
    if vdt == T.Q8_K:
        b = quantize(x, T.Q8_K).reshape(n, k // 256, 292)
        xd = np.ascontiguousarray(b[:, :, 0:4]).view(np.float32).reshape(n, -1)
        xq = np.ascontiguousarray(b[:, :, 4:260]).view(np.int8).reshape(n, k)
        bs = np.ascontiguousarray(b[:, :, 260:292]).view(np.int16).reshape(n, -1)
        return xq, xd, bs
    if vdt in (T.Q8_0, T.Q8_1):
        xq = np.empty((n, k), np.int8)
        xd = np.empty((n, k // 32), np.float32)
        xs = np.empty((n, k // 32), np.float32)
        _act_q8_x86(np.ascontiguousarray(x, dtype=np.float32), xq, xd, xs)
        return xq, xd, (xs if vdt == T.Q8_1 else None)
    size = 36 if vdt == T.Q8_1 else 34
    b = quantize(x, vdt).reshape(n, k // 32, size)
    xd = np.ascontiguousarray(b[:, :, 0:2]).view(np.float16).astype(np.float32).reshape(n, -1)
    extra = None
    if vdt == T.Q8_1:
        extra = np.ascontiguousarray(b[:, :, 2:4]).view(np.float16).astype(np.float32).reshape(n, -1)
    xq = np.ascontiguousarray(b[:, :, size - 32:]).view(np.int8).reshape(n, k)
    return xq, xd, extra


def mul_mat(w: np.ndarray, wtype: GGMLType, x: np.ndarray, out: np.ndarray) -> None:
    if not w.flags.c_contiguous:
        w = np.ascontiguousarray(w)
    x = np.ascontiguousarray(x, dtype=np.float32)
    n = x.shape[0]
    res = np.empty((n, w.shape[0]), np.float32)
    if wtype in (T.Q4_K, T.Q6_K):
        xq, xd, bs = act_q8(x, T.Q8_K)
        if wtype == T.Q4_K and w.shape[0] % 8 == 0:
            _mv_q4_k_x8(w, xq, xd, bs, res, F16_TABLE, n - n % 4 if n >= 4 else 0)
        elif wtype == T.Q4_K:
            _mv_q4_k(w, xq, xd, bs, res, F16_TABLE)
        else:
            _mv_q6_k(w, xq, xd, bs, res, F16_TABLE)
    elif wtype == T.Q4_1:
        xq, xd, xs = act_q8(x, T.Q8_1)
        _mv_q4_1(w, xq, xd, xs, res, F16_TABLE)
    else:
        xq, xd, _ = act_q8(x, T.Q8_0)
        _Q8_0_TYPES[wtype](w, xq, xd, res, F16_TABLE)
    out[...] = res
