"""Numba integer dot products on raw GGUF blocks, for matrix-vector products (decode).

The activations are quantized once per call to the weight's dot type — Q8_0 (Q4_0, Q5_0, Q8_0), Q8_1 (Q4_1)
or Q8_K (Q4_K, Q6_K) — exactly as ggml's quantize_row_q8_*; then each output is a sum over blocks of
(weight scale × activation scale × integer dot), with llama.cpp's per-type formula.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ...quants import quantize
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
# scaled by d_w * d_x and fused-multiply-added into eight float lanes, summed at the end by hsum_float_8
@njit(parallel=True, cache=True)
def _mv_q8_0(w, xq, xd, out, tab):
    rows = w.shape[0]
    n = xq.shape[0]
    nb = xq.shape[1] // 32
    for r in prange(rows):
        acc = np.empty(8, np.float32)
        for i in range(n):
            acc[:] = 0
            for b in range(nb):
                o = b * 34
                d = np.float32(_f16(tab, w[r, o], w[r, o + 1]) * xd[i, b])
                for l in range(8):
                    s = 0
                    for e in range(4 * l, 4 * l + 4):
                        s += np.int32(np.int8(w[r, o + 2 + e])) * np.int32(xq[i, b * 32 + e])
                    acc[l] = _fma(d, np.float32(s), acc[l])
            out[i, r] = _hsum8(acc)


@njit(parallel=True, cache=True)
def _mv_q4_0(w, xq, xd, out, tab):
    rows = w.shape[0]
    n = xq.shape[0]
    nb = xq.shape[1] // 32
    for r in prange(rows):
        for i in range(n):
            acc = np.float32(0.0)
            for b in range(nb):
                o = b * 18
                d = _f16(tab, w[r, o], w[r, o + 1])
                s = 0
                for j in range(16):
                    q = w[r, o + 2 + j]
                    s += (np.int32(q & 15) - 8) * np.int32(xq[i, b * 32 + j])
                    s += (np.int32(q >> 4) - 8) * np.int32(xq[i, b * 32 + 16 + j])
                acc += d * xd[i, b] * np.float32(s)
            out[i, r] = acc


# ggml_vec_dot_q4_1_q8_1 (AVX2): lanes as for q8_0, plus the mins: summs += m_w * s_x (fused), added after the hsum
@njit(parallel=True, cache=True)
def _mv_q4_1(w, xq, xd, xs, out, tab):
    rows = w.shape[0]
    n = xq.shape[0]
    nb = xq.shape[1] // 32
    for r in prange(rows):
        acc = np.empty(8, np.float32)
        for i in range(n):
            acc[:] = 0
            summs = np.float32(0.0)
            for b in range(nb):
                o = b * 20
                d0 = _f16(tab, w[r, o], w[r, o + 1])
                m = _f16(tab, w[r, o + 2], w[r, o + 3])
                summs = _fma(m, xs[i, b], summs)
                d = np.float32(d0 * xd[i, b])
                for l in range(8):
                    s = 0
                    for e in range(4 * l, 4 * l + 4):
                        q = w[r, o + 4 + (e % 16)]
                        qv = (q & 15) if e < 16 else (q >> 4)
                        s += np.int32(qv) * np.int32(xq[i, b * 32 + e])
                    acc[l] = _fma(d, np.float32(s), acc[l])
            out[i, r] = _hsum8(acc) + summs


@njit(parallel=True, cache=True)
def _mv_q5_0(w, xq, xd, out, tab):
    rows = w.shape[0]
    n = xq.shape[0]
    nb = xq.shape[1] // 32
    for r in prange(rows):
        for i in range(n):
            acc = np.float32(0.0)
            for b in range(nb):
                o = b * 22
                d = _f16(tab, w[r, o], w[r, o + 1])
                qh = np.uint32(w[r, o + 2]) | (np.uint32(w[r, o + 3]) << 8) | (np.uint32(w[r, o + 4]) << 16) | \
                    (np.uint32(w[r, o + 5]) << 24)
                s = 0
                for j in range(16):
                    q = w[r, o + 6 + j]
                    lo = np.int32(q & 15) | np.int32(((qh >> j) & 1) << 4)
                    hi = np.int32(q >> 4) | np.int32(((qh >> (j + 16)) & 1) << 4)
                    s += (lo - 16) * np.int32(xq[i, b * 32 + j])
                    s += (hi - 16) * np.int32(xq[i, b * 32 + 16 + j])
                acc += d * xd[i, b] * np.float32(s)
            out[i, r] = acc


@njit(cache=True)
def _scale_min(sc, o, j):
    if j < 4:
        return np.int32(sc[o + j] & 63), np.int32(sc[o + j + 4] & 63)
    s = np.int32(sc[o + j + 4] & 15) | (np.int32(sc[o + j - 4] >> 6) << 4)
    m = np.int32(sc[o + j + 4] >> 4) | (np.int32(sc[o + j] >> 6) << 4)
    return s, m


@njit(parallel=True, cache=True)
def _mv_q4_k(w, xq, xd, bsums, out, tab):
    rows = w.shape[0]
    n = xq.shape[0]
    nb = xq.shape[1] // 256
    for r in prange(rows):
        row = w[r]
        for i in range(n):
            acc = np.float32(0.0)
            for b in range(nb):
                o = b * 144
                d = _f16(tab, row[o], row[o + 1])
                dmin = _f16(tab, row[o + 2], row[o + 3])
                sumi = 0
                summ = 0
                for j2 in range(4):
                    s1, m1 = _scale_min(row, o + 4, 2 * j2)
                    s2, m2 = _scale_min(row, o + 4, 2 * j2 + 1)
                    a1 = 0
                    a2 = 0
                    base = b * 256 + j2 * 64
                    for l in range(32):
                        q = row[o + 16 + j2 * 32 + l]
                        a1 += np.int32(q & 15) * np.int32(xq[i, base + l])
                        a2 += np.int32(q >> 4) * np.int32(xq[i, base + 32 + l])
                    sumi += s1 * a1 + s2 * a2
                    g = b * 16 + j2 * 4
                    summ += m1 * (np.int32(bsums[i, g]) + np.int32(bsums[i, g + 1])) + \
                        m2 * (np.int32(bsums[i, g + 2]) + np.int32(bsums[i, g + 3]))
                acc += xd[i, b] * d * np.float32(sumi) - xd[i, b] * dmin * np.float32(summ)
            out[i, r] = acc


@njit(parallel=True, cache=True)
def _mv_q6_k(w, xq, xd, out, tab):
    rows = w.shape[0]
    n = xq.shape[0]
    nb = xq.shape[1] // 256
    for r in prange(rows):
        row = w[r]
        for i in range(n):
            acc = np.float32(0.0)
            for b in range(nb):
                o = b * 210
                d = _f16(tab, row[o + 208], row[o + 209])
                sumi = 0
                for h in range(2):
                    ql = o + h * 64
                    qh = o + 128 + h * 32
                    sc = o + 192 + h * 8
                    base = b * 256 + h * 128
                    for l in range(32):
                        isc = l // 16
                        hq = np.int32(row[qh + l])
                        q1 = (np.int32(row[ql + l] & 15) | ((hq & 3) << 4)) - 32
                        q2 = (np.int32(row[ql + 32 + l] & 15) | (((hq >> 2) & 3) << 4)) - 32
                        q3 = (np.int32(row[ql + l] >> 4) | (((hq >> 4) & 3) << 4)) - 32
                        q4 = (np.int32(row[ql + 32 + l] >> 4) | (((hq >> 6) & 3) << 4)) - 32
                        sumi += np.int32(np.int8(row[sc + isc])) * q1 * np.int32(xq[i, base + l])
                        sumi += np.int32(np.int8(row[sc + isc + 2])) * q2 * np.int32(xq[i, base + 32 + l])
                        sumi += np.int32(np.int8(row[sc + isc + 4])) * q3 * np.int32(xq[i, base + 64 + l])
                        sumi += np.int32(np.int8(row[sc + isc + 6])) * q4 * np.int32(xq[i, base + 96 + l])
                acc += d * xd[i, b] * np.float32(sumi)
            out[i, r] = acc


_Q8_0_TYPES = {T.Q8_0: _mv_q8_0, T.Q4_0: _mv_q4_0, T.Q5_0: _mv_q5_0}
_SUPPORTED = set(_Q8_0_TYPES) | {T.Q4_1, T.Q4_K, T.Q6_K}


def supports(wtype: GGMLType) -> bool:
    return wtype in _SUPPORTED


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
        if wtype == T.Q4_K:
            _mv_q4_k(w, xq, xd, bs, res, F16_TABLE)
        else:
            _mv_q6_k(w, xq, xd, res, F16_TABLE)
    elif wtype == T.Q4_1:
        xq, xd, xs = act_q8(x, T.Q8_1)
        _mv_q4_1(w, xq, xd, xs, res, F16_TABLE)
    else:
        xq, xd, _ = act_q8(x, T.Q8_0)
        _Q8_0_TYPES[wtype](w, xq, xd, res, F16_TABLE)
    out[...] = res
