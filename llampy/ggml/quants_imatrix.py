"""Quantization weighted by an importance matrix, as ggml's ``quantize_<type>(src, dst, nrow, n_per_row, imatrix)``
runs it when llama-quantize has an imatrix.

Several formats ignore the weights (ggml's quantize_q8_0, tq1_0, tq2_0, mxfp4, q1_0, q2_0 call their _ref
quantizer either way); the others run their ``quantize_row_<type>_impl``: Q4_0 / Q5_0 make_qx_quants and Q4_1 /
Q5_1 make_qkx3_quants with weights qw[j] * sqrt(sigma2 + x[j]^2) (sigma2 the row's mean square); Q3_K
make_qx_quants per 16 values and again for the 16 scales; Q4_K / Q5_K make_qkx3_quants per 32 values (sigma2 twice
the super-block's mean square) and make_qp_quants for the 6-bit scales and mins; Q6_K make_qx_quants with the raw
importances; Q2_K make_qkx3_quants per 16 values and make_qp_quants for its 4-bit scales and mins; IQ4_NL / IQ4_XS
the weighted quantize_row_iq4_nl_impl; IQ1/IQ2/IQ3 their grid searches (quants_iq_search).
"""
from __future__ import annotations

import numpy as np
from numba import prange

from . import quants_iq as iq
from .quants import quantize
from .quants_iq_search import SEARCH_TYPES as _IQ_SEARCH, quantize_iq
from .quants_base import F32, njit, to_f16_bytes
from .quants_k import CHUNK, QKX_LANES, QX_STEPS, make_qkx, make_qx, q2_k_pack, q3_k_pack, q45_k_pack, q6_k_pack
from .types import GGMLType, QK_K

T = GGMLType

IGNORES_IMATRIX = frozenset({T.F32, T.F16, T.BF16, T.Q8_0, T.TQ1_0, T.TQ2_0, T.MXFP4, T.Q1_0, T.Q2_0})


@njit(cache=True, inline="always")
def _nearest_int(v):
    return int((v + F32(12582912.0)) - F32(12582912.0))


@njit(cache=True, parallel=True, nogil=True)
def _qx_rows(x, imatrix, nmax, d_out, L_out):
    """Per row: sigma2 = mean(x^2) in float (sequential, as ggml sums); per block of 32 the weighted search."""
    nrows, n = x.shape
    nb = n // 32
    for r in prange(nrows):
        row = x[r]
        sum_x2 = F32(0.0)
        for j in range(n):
            sum_x2 += row[j] * row[j]
        sigma2 = sum_x2 / F32(n)
        w = np.empty(32, np.float32)
        L = np.empty(32, np.int32)
        acc = np.empty((3, QX_STEPS), np.float32)
        for ib in range(nb):
            xb = row[ib * 32:(ib + 1) * 32]
            for j in range(32):
                w[j] = imatrix[ib * 32 + j] * np.sqrt(sigma2 + xb[j] * xb[j])
            d_out[r, ib] = make_qx(xb, w, nmax, L, acc)
            for j in range(32):
                L_out[r, ib, j] = L[j]


def _weighted_qx(x, imatrix, nmax):
    x = np.ascontiguousarray(x, F32)
    nrows, n = x.shape
    d = np.empty((nrows, n // 32), F32)
    L = np.empty((nrows, n // 32, 32), np.uint8)
    _qx_rows(x, np.ascontiguousarray(imatrix, F32), nmax, d, L)
    return to_f16_bytes(d).reshape(nrows, n // 32, 2), L


def quantize_q4_0_weighted(x, imatrix):
    d, L = _weighted_qx(x, imatrix, 8)
    qs = L[..., :16] | (L[..., 16:] << 4)
    return np.concatenate([d, qs], axis=-1).reshape(x.shape[0], -1)


def quantize_q5_0_weighted(x, imatrix):
    d, L = _weighted_qx(x, imatrix, 16)
    qs = (L[..., :16] & 0x0F) | ((L[..., 16:] & 0x0F) << 4)
    hi = ((L >> 4) & 1).astype(np.uint32)
    qh = (hi << np.arange(32, dtype=np.uint32)).sum(axis=-1, dtype=np.uint32)
    qh_b = qh.astype("<u4").view(np.uint8).reshape(qh.shape + (4,))
    return np.concatenate([d, qh_b, qs], axis=-1).reshape(x.shape[0], -1)


@njit(cache=True)
def _make_qp(x, nmax, L, qw):
    """make_qp_quants(n, nmax, x, L, quant_weights): levels 0..nmax of non-negative values; returns the scale."""
    n = x.shape[0]
    mx = F32(0.0)
    for i in range(n):
        mx = max(mx, x[i])
    if mx < F32(1e-15):
        for i in range(n):
            L[i] = 0
        return F32(0.0)
    fn = F32(nmax)
    iscale = fn / mx
    for i in range(n):
        L[i] = _nearest_int(iscale * x[i])
    scale = F32(1.0) / iscale
    best_mse = F32(0.0)
    for i in range(n):
        diff = x[i] - scale * F32(L[i])
        best_mse += qw[i] * diff * diff
    for is_ in range(-4, 5):
        if is_ == 0:
            continue
        iscale_is = (F32(0.1) * F32(is_) + fn) / mx
        scale_is = F32(1.0) / iscale_is
        mse = F32(0.0)
        for i in range(n):
            l = min(nmax, _nearest_int(iscale_is * x[i]))
            diff = x[i] - scale_is * F32(l)
            mse += qw[i] * diff * diff
        if mse < best_mse:
            best_mse = mse
            iscale = iscale_is
    sumlx = F32(0.0)
    suml2 = F32(0.0)
    for i in range(n):
        l = min(nmax, _nearest_int(iscale * x[i]))
        L[i] = l
        sumlx += qw[i] * x[i] * F32(l)
        suml2 += qw[i] * F32(l) * F32(l)
    for itry in range(5):
        n_changed = 0
        for i in range(n):
            w = qw[i]
            fl = F32(L[i])
            slx = sumlx - w * x[i] * fl
            sl2 = suml2 - w * fl * fl
            if slx > 0 and sl2 > 0:
                new_l = min(nmax, _nearest_int(x[i] * sl2 / slx))
                if new_l != L[i]:
                    fnl = F32(new_l)
                    slx += w * x[i] * fnl
                    sl2 += w * fnl * fnl
                    if slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = new_l
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    return sumlx / suml2 if suml2 > 0 else F32(0.0)


@njit(cache=True, parallel=True, nogil=True)
def _q1_rows(x, imatrix, nmax, d_out, m_out, L_out):
    """Q4_1 / Q5_1 with weights: per block of 32, make_qkx3_quants(32, nmax, .., -0.9, 0.05, 36)."""
    nrows, n = x.shape
    nb = n // 32
    for r in prange(nrows):
        row = x[r]
        sum_x2 = F32(0.0)
        for j in range(n):
            sum_x2 += row[j] * row[j]
        sigma2 = sum_x2 / F32(n)
        w = np.empty(32, np.float32)
        L = np.empty(32, np.int32)
        acc = np.empty((7, QKX_LANES), np.float32)
        for ib in range(nb):
            xb = row[ib * 32:(ib + 1) * 32]
            for j in range(32):
                w[j] = imatrix[ib * 32 + j] * np.sqrt(sigma2 + xb[j] * xb[j])
            d, the_min = make_qkx(xb, w, nmax, F32(-0.9), F32(0.05), 36, False, L, acc)
            d_out[r, ib] = d
            m_out[r, ib] = -the_min
            for j in range(32):
                L_out[r, ib, j] = L[j]


def _weighted_q1(x, imatrix, nmax):
    x = np.ascontiguousarray(x, F32)
    nrows, n = x.shape
    d = np.empty((nrows, n // 32), F32)
    m = np.empty((nrows, n // 32), F32)
    L = np.empty((nrows, n // 32, 32), np.uint8)
    _q1_rows(x, np.ascontiguousarray(imatrix, F32), nmax, d, m, L)
    sh = (nrows, n // 32, 2)
    return to_f16_bytes(d).reshape(sh), to_f16_bytes(m).reshape(sh), L


def quantize_q4_1_weighted(x, imatrix):
    d, m, L = _weighted_q1(x, imatrix, 15)
    qs = L[..., :16] | (L[..., 16:] << 4)
    return np.concatenate([d, m, qs], axis=-1).reshape(x.shape[0], -1)


def quantize_q5_1_weighted(x, imatrix):
    d, m, L = _weighted_q1(x, imatrix, 31)
    qs = (L[..., :16] & 0x0F) | ((L[..., 16:] & 0x0F) << 4)
    qh = (((L >> 4) & 1).astype(np.uint32) << np.arange(32, dtype=np.uint32)).sum(axis=-1, dtype=np.uint32)
    qh_b = qh.astype("<u4").view(np.uint8).reshape(qh.shape + (4,))
    return np.concatenate([d, m, qh_b, qs], axis=-1).reshape(x.shape[0], -1)


# The k-quants: one kernel per type over chunks of CHUNK super-blocks, ending in quants_k's *_pack (the block bytes).
# ``qw`` is the imatrix row (n_per_row values): block i of the [n, 256] blocks weighs by qw[(i % nb) * 256 ...].

@njit(cache=True, parallel=True, nogil=True)
def _q45k_rows(b, qw, nb, nmax, out):
    """quantize_row_q4_K_impl / q5_K_impl: make_qkx3_quants per 32 values (weights qw * sqrt(sigma2 + x^2), sigma2
    twice the super-block's mean square), make_qp_quants(8, 63, ..) for the scales and for the mins."""
    n = b.shape[0]
    for c in prange((n + CHUNK - 1) // CHUNK):
        w = np.empty(32, np.float32)
        sw = np.empty(8, np.float32)
        scales = np.empty(8, np.float32)
        mins = np.empty(8, np.float32)
        acc = np.empty((7, QKX_LANES), np.float32)
        Lj = np.empty(32, np.int32)
        Ls = np.empty(8, np.int32)
        Lm = np.empty(8, np.int32)
        ls = np.empty(8, np.uint8)
        lm = np.empty(8, np.uint8)
        L = np.empty(QK_K, np.uint8)
        for i in range(c * CHUNK, min(n, c * CHUNK + CHUNK)):
            x = b[i]
            q = qw[(i % nb) * QK_K:(i % nb + 1) * QK_K]
            sum_x2 = F32(0.0)
            for l in range(QK_K):
                sum_x2 += x[l] * x[l]
            sigma2 = F32(2.0) * sum_x2 / F32(QK_K)
            for j in range(8):
                for l in range(32):
                    w[l] = q[32 * j + l] * np.sqrt(sigma2 + x[32 * j + l] * x[32 * j + l])
                sumw = F32(0.0)
                for l in range(32):
                    sumw += w[l]
                sw[j] = sumw
                s, m = make_qkx(x[32 * j:32 * j + 32], w, nmax, F32(-0.9), F32(0.05), 36, False, Lj, acc)
                scales[j] = s
                mins[j] = m
                for l in range(32):
                    L[32 * j + l] = Lj[l]
            d = _make_qp(scales, 63, Ls, sw)
            dmin = _make_qp(mins, 63, Lm, sw)
            for j in range(8):
                ls[j] = min(63, Ls[j])
                lm[j] = min(63, Lm[j])
            q45_k_pack(x, ls, lm, d, dmin, L, out[i], nmax)


@njit(cache=True, parallel=True, nogil=True)
def _q6k_rows(b, qw, nb, out):
    """quantize_row_q6_K_impl: make_qx_quants(16, 32, .., the raw importances) per 16 values."""
    n = b.shape[0]
    for c in prange((n + CHUNK - 1) // CHUNK):
        Lj = np.empty(16, np.int32)
        L = np.empty(QK_K, np.int8)
        scales = np.empty(16, np.float32)
        acc = np.empty((3, QX_STEPS), np.float32)
        for i in range(c * CHUNK, min(n, c * CHUNK + CHUNK)):
            q = qw[(i % nb) * QK_K:(i % nb + 1) * QK_K]
            for j in range(16):
                scales[j] = make_qx(b[i, 16 * j:16 * (j + 1)], q[16 * j:16 * (j + 1)], 32, Lj, acc)
                for l in range(16):
                    L[16 * j + l] = Lj[l]
            q6_k_pack(b[i], scales, L, out[i])


@njit(cache=True, parallel=True, nogil=True)
def _q3k_rows(b, qw, nb, out):
    """quantize_row_q3_K_impl: per 16 values make_qx_quants(16, 4, .., weights), then the 16 scales themselves
    make_qx_quants(16, 32, scales, Ls, 1, sw)."""
    n = b.shape[0]
    for c in prange((n + CHUNK - 1) // CHUNK):
        w = np.empty(16, np.float32)
        sw = np.empty(16, np.float32)
        scales = np.empty(16, np.float32)
        Lj = np.empty(16, np.int32)
        Ls = np.empty(16, np.int32)
        ls = np.empty(16, np.uint8)
        L = np.empty(QK_K, np.int8)
        acc = np.empty((3, QX_STEPS), np.float32)
        for i in range(c * CHUNK, min(n, c * CHUNK + CHUNK)):
            x = b[i]
            q = qw[(i % nb) * QK_K:(i % nb + 1) * QK_K]
            sumx2 = F32(0.0)
            for l in range(QK_K):
                sumx2 += x[l] * x[l]
            sigma2 = F32(2.0) * sumx2 / F32(QK_K)
            for j in range(16):
                for l in range(16):
                    w[l] = q[16 * j + l] * np.sqrt(sigma2 + x[16 * j + l] * x[16 * j + l])
                sumw = F32(0.0)
                for l in range(16):
                    sumw += w[l]
                sw[j] = sumw
                scales[j] = make_qx(x[16 * j:16 * j + 16], w, 4, Lj, acc)
                for l in range(16):
                    L[16 * j + l] = Lj[l]
            d = make_qx(scales, sw, 32, Ls, acc)
            for j in range(16):
                ls[j] = Ls[j]
            q3_k_pack(x, ls, d, L, out[i])


@njit(cache=True, parallel=True, nogil=True)
def _q2k_rows(b, qw, nb, out):
    """quantize_row_q2_K_impl: make_qkx3_quants(16, 3, ..) per 16 values (sigma2 the super-block's mean square),
    make_qp_quants(16, 15, ..) for the scales and the mins."""
    n = b.shape[0]
    for c in prange((n + CHUNK - 1) // CHUNK):
        w = np.empty(16, np.float32)
        sw = np.empty(16, np.float32)
        scales = np.empty(16, np.float32)
        mins = np.empty(16, np.float32)
        acc = np.empty((7, QKX_LANES), np.float32)
        Lj = np.empty(16, np.int32)
        Ls = np.empty(16, np.int32)
        Lm = np.empty(16, np.int32)
        sc = np.empty(16, np.uint8)
        L = np.empty(QK_K, np.uint8)
        for i in range(c * CHUNK, min(n, c * CHUNK + CHUNK)):
            x = b[i]
            q = qw[(i % nb) * QK_K:(i % nb + 1) * QK_K]
            sumx2 = F32(0.0)
            for l in range(QK_K):
                sumx2 += x[l] * x[l]
            sigma2 = sumx2 / F32(QK_K)
            for j in range(16):
                for l in range(16):
                    w[l] = q[16 * j + l] * np.sqrt(sigma2 + x[16 * j + l] * x[16 * j + l])
                sumw = F32(0.0)
                for l in range(16):
                    sumw += w[l]
                sw[j] = sumw
                s_, m_ = make_qkx(x[16 * j:16 * j + 16], w, 3, F32(-0.9), F32(0.05), 36, False, Lj, acc)
                scales[j] = s_
                mins[j] = m_
                for l in range(16):
                    L[16 * j + l] = Lj[l]
            d = _make_qp(scales, 15, Ls, sw)
            dmin = _make_qp(mins, 15, Lm, sw)
            for j in range(16):
                sc[j] = (Ls[j] | (Lm[j] << 4)) & 0xFF
            q2_k_pack(x, sc, d, dmin, L, out[i])


def _weighted_k(kernel, type_size, x, imatrix, *args):
    x = np.ascontiguousarray(x, F32)
    nrows, k = x.shape
    b = x.reshape(-1, QK_K)
    out = np.empty((len(b), type_size), np.uint8)
    kernel(b, np.ascontiguousarray(imatrix, F32).reshape(k), k // QK_K, *args, out)
    return out.reshape(nrows, -1)


def quantize_q2_k_weighted(x, imatrix):
    return _weighted_k(_q2k_rows, 84, x, imatrix)


def quantize_q3_k_weighted(x, imatrix):
    return _weighted_k(_q3k_rows, 110, x, imatrix)


def quantize_q4_k_weighted(x, imatrix):
    return _weighted_k(_q45k_rows, 144, x, imatrix, 15)


def quantize_q5_k_weighted(x, imatrix):
    return _weighted_k(_q45k_rows, 176, x, imatrix, 31)


def quantize_q6_k_weighted(x, imatrix):
    return _weighted_k(_q6k_rows, 210, x, imatrix)


_WEIGHTED = {T.Q2_K: quantize_q2_k_weighted, T.Q3_K: quantize_q3_k_weighted, T.Q4_0: quantize_q4_0_weighted, T.Q5_0: quantize_q5_0_weighted, T.Q4_1: quantize_q4_1_weighted,
             T.Q5_1: quantize_q5_1_weighted, T.Q4_K: quantize_q4_k_weighted, T.Q5_K: quantize_q5_k_weighted,
             T.Q6_K: quantize_q6_k_weighted, T.IQ4_NL: iq.quantize_iq4_nl, T.IQ4_XS: iq.quantize_iq4_xs}

WEIGHTED_TYPES = frozenset(_WEIGHTED) | IGNORES_IMATRIX | _IQ_SEARCH


def quantize_weighted(x: np.ndarray, t: GGMLType, imatrix: np.ndarray) -> np.ndarray:
    """x float32 [nrows, n_per_row], imatrix float32 [n_per_row] -> the bytes ggml_quantize_chunk writes."""
    t = GGMLType(t)
    if t in IGNORES_IMATRIX:
        return quantize(x, t)
    if t in _IQ_SEARCH:
        return quantize_iq(np.asarray(x, F32), t, imatrix)
    fn = _WEIGHTED.get(t)
    if fn is None:
        raise NotImplementedError(f"quantizing to {t.name} with an importance matrix is not implemented")
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        return fn(np.asarray(x, F32), imatrix)
