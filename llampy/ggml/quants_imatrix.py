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
from numba import njit, prange

from . import quants_iq as iq
from .quants import quantize
from .quants_iq_search import SEARCH_TYPES as _IQ_SEARCH, quantize_iq
from .quants_base import F32, round_f16, to_f16_bytes
from .quants_k import _requant, quantize_q6_k_from
from .types import GGMLType, QK_K

T = GGMLType

IGNORES_IMATRIX = frozenset({T.F32, T.F16, T.BF16, T.Q8_0, T.TQ1_0, T.TQ2_0, T.MXFP4, T.Q1_0, T.Q2_0})


@njit(cache=True, inline="always")
def _nearest_int(v):
    return int((v + F32(12582912.0)) - F32(12582912.0))


@njit(cache=True)
def _make_qx_weighted(x, nmax, L, qw):
    """make_qx_quants(n, nmax, x, L, rmse_type=1, qw): returns the scale; L gets levels 0..2*nmax-1."""
    n = x.shape[0]
    mx = F32(0.0)
    amax = F32(0.0)
    for i in range(n):
        ax = abs(x[i])
        if ax > amax:
            amax = ax
            mx = x[i]
    if amax < F32(1e-15):
        for i in range(n):
            L[i] = 0
        return F32(0.0)
    fn = F32(nmax)
    iscale = -fn / mx
    sumlx = F32(0.0)
    suml2 = F32(0.0)
    for i in range(n):
        l = max(-nmax, min(nmax - 1, _nearest_int(iscale * x[i])))
        L[i] = l + nmax
        w = qw[i]
        sumlx += w * x[i] * F32(l)
        suml2 += w * F32(l) * F32(l)
    scale = sumlx / suml2 if suml2 != 0 else F32(0.0)
    best = scale * sumlx
    for is_ in range(-9, 10):
        if is_ == 0:
            continue
        iscale = -(fn + F32(0.1) * F32(is_)) / mx
        sumlx = F32(0.0)
        suml2 = F32(0.0)
        for i in range(n):
            l = max(-nmax, min(nmax - 1, _nearest_int(iscale * x[i])))
            w = qw[i]
            sumlx += w * x[i] * F32(l)
            suml2 += w * F32(l) * F32(l)
        if suml2 > 0 and sumlx * sumlx > best * suml2:
            for i in range(n):
                l = max(-nmax, min(nmax - 1, _nearest_int(iscale * x[i])))
                L[i] = nmax + l
            scale = sumlx / suml2
            best = scale * sumlx
    return scale


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
        for ib in range(nb):
            xb = row[ib * 32:(ib + 1) * 32]
            for j in range(32):
                w[j] = imatrix[ib * 32 + j] * np.sqrt(sigma2 + xb[j] * xb[j])
            d_out[r, ib] = _make_qx_weighted(xb, nmax, L, w)
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
def _make_qkx3(x, w, nmax, L, Laux, rmin, rdelta, nstep):
    """make_qkx3_quants(n, nmax, x, weights, L, &the_min, Laux, rmin, rdelta, nstep, use_mad=false):
    returns (scale, the_min)."""
    n = x.shape[0]
    mn = x[0]
    mx = x[0]
    sum_w = w[0]
    sum_x = sum_w * x[0]
    for i in range(1, n):
        if x[i] < mn:
            mn = x[i]
        if x[i] > mx:
            mx = x[i]
        sum_w += w[i]
        sum_x += w[i] * x[i]
    if mn > 0:
        mn = F32(0.0)
    if mx <= mn:
        for i in range(n):
            L[i] = 0
        return F32(0.0), -mn
    fn = F32(nmax)
    iscale = fn / (mx - mn)
    scale = F32(1.0) / iscale
    best_mad = F32(0.0)
    for i in range(n):
        l = max(0, min(nmax, _nearest_int(iscale * (x[i] - mn))))
        L[i] = l
        diff = scale * F32(l) + mn - x[i]
        best_mad += w[i] * (diff * diff)
    for is_ in range(nstep + 1):
        iscale = (rmin + rdelta * F32(is_) + fn) / (mx - mn)
        sum_l = F32(0.0)
        sum_l2 = F32(0.0)
        sum_xl = F32(0.0)
        for i in range(n):
            l = max(0, min(nmax, _nearest_int(iscale * (x[i] - mn))))
            Laux[i] = l
            fl = F32(l)
            sum_l += w[i] * fl
            sum_l2 += w[i] * fl * fl
            sum_xl += w[i] * fl * x[i]
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > 0:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > 0:
                this_min = F32(0.0)
                this_scale = sum_xl / sum_l2
            mad = F32(0.0)
            for i in range(n):
                diff = this_scale * F32(Laux[i]) + this_min - x[i]
                mad += w[i] * (diff * diff)
            if mad < best_mad:
                for i in range(n):
                    L[i] = Laux[i]
                best_mad = mad
                scale = this_scale
                mn = this_min
    return scale, -mn


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
        Laux = np.empty(32, np.int32)
        for ib in range(nb):
            xb = row[ib * 32:(ib + 1) * 32]
            for j in range(32):
                w[j] = imatrix[ib * 32 + j] * np.sqrt(sigma2 + xb[j] * xb[j])
            d, the_min = _make_qkx3(xb, w, nmax, L, Laux, F32(-0.9), F32(0.05), 36)
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


@njit(cache=True, parallel=True, nogil=True)
def _q45k_blocks(b, qw, nmax, ls_out, lm_out, d_out, m_out, L_out):
    """quantize_row_q4_K_impl / q5_K_impl up to the block scales: b [n, 256], qw [n, 256] the block's importances."""
    n = b.shape[0]
    for i in prange(n):
        x = b[i]
        sum_x2 = F32(0.0)
        for l in range(QK_K):
            sum_x2 += x[l] * x[l]
        sigma2 = F32(2.0) * sum_x2 / F32(QK_K)
        w = np.empty(32, np.float32)
        sw = np.empty(8, np.float32)
        scales = np.empty(8, np.float32)
        mins = np.empty(8, np.float32)
        Laux = np.empty(32, np.int32)
        Lj = np.empty(32, np.int32)
        Ls = np.empty(8, np.int32)
        Lm = np.empty(8, np.int32)
        for j in range(8):
            for l in range(32):
                w[l] = qw[i, 32 * j + l] * np.sqrt(sigma2 + x[32 * j + l] * x[32 * j + l])
            sumw = F32(0.0)
            for l in range(32):
                sumw += w[l]
            sw[j] = sumw
            s, m = _make_qkx3(x[32 * j:32 * j + 32], w, nmax, Lj, Laux, F32(-0.9), F32(0.05), 36)
            scales[j] = s
            mins[j] = m
            for l in range(32):
                L_out[i, 32 * j + l] = Lj[l]
        d_out[i] = _make_qp(scales, 63, Ls, sw)
        m_out[i] = _make_qp(mins, 63, Lm, sw)
        for j in range(8):
            ls_out[i, j] = min(63, Ls[j])
            lm_out[i, j] = min(63, Lm[j])


def _weighted_q45k(x, imatrix, nmax):
    x = np.ascontiguousarray(x, F32)
    nrows, k = x.shape
    nb = k // QK_K
    b = x.reshape(-1, QK_K)
    qw = np.ascontiguousarray(np.broadcast_to(np.asarray(imatrix, F32).reshape(1, nb, QK_K), (nrows, nb, QK_K))
                              ).reshape(-1, QK_K)
    n = len(b)
    ls, lm = np.empty((n, 8), np.uint8), np.empty((n, 8), np.uint8)
    d, dmin = np.empty(n, F32), np.empty(n, F32)
    L = np.empty((n, QK_K), np.uint8)
    _q45k_blocks(b, qw, nmax, ls, lm, d, dmin, L)
    sc = np.empty((n, 12), np.uint8)
    sc[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    sc[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    sc[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    dq = round_f16(d)[:, None] * ls.astype(F32)
    dm = round_f16(dmin)[:, None] * lm.astype(F32)
    L = _requant(L, b, dq, dm, 0, nmax, 0).astype(np.uint8).reshape(n, 4, 2, 32)
    return b, nrows, n, d, dmin, sc, L


def quantize_q4_k_weighted(x, imatrix):
    b, nrows, n, d, dmin, sc, L = _weighted_q45k(x, imatrix, 15)
    qs = (L[:, :, 0] | (L[:, :, 1] << 4)).reshape(n, 128)
    out = np.concatenate([to_f16_bytes(d).reshape(n, 2), to_f16_bytes(dmin).reshape(n, 2), sc, qs], axis=1)
    return out.reshape(nrows, -1)


def quantize_q5_k_weighted(x, imatrix):
    b, nrows, n, d, dmin, sc, L = _weighted_q45k(x, imatrix, 31)
    qs = ((L[:, :, 0] & 0xF) | ((L[:, :, 1] & 0xF) << 4)).reshape(n, 128)
    qh = np.bitwise_or.reduce((L >> 4).reshape(n, 8, 32) << np.arange(8, dtype=np.uint8)[:, None], axis=1)
    out = np.concatenate([to_f16_bytes(d).reshape(n, 2), to_f16_bytes(dmin).reshape(n, 2), sc, qh, qs], axis=1)
    return out.reshape(nrows, -1)


@njit(cache=True, parallel=True, nogil=True)
def _q6k_search(b, qw, scales, L):
    n = b.shape[0]
    for i in prange(n):
        Lj = np.empty(16, np.int32)
        for j in range(16):
            scales[i, j] = _make_qx_weighted(b[i, 16 * j:16 * (j + 1)], 32, Lj, qw[i, 16 * j:16 * (j + 1)])
            for l in range(16):
                L[i, 16 * j + l] = Lj[l]


def quantize_q6_k_weighted(x, imatrix):
    x = np.ascontiguousarray(x, F32)
    nrows, k = x.shape
    nb = k // QK_K
    b = x.reshape(-1, QK_K)
    qw = np.ascontiguousarray(np.broadcast_to(np.asarray(imatrix, F32).reshape(1, nb, QK_K), (nrows, nb, QK_K))
                              ).reshape(-1, QK_K)
    scales = np.empty((len(b), 16), F32)
    L = np.empty((len(b), QK_K), np.int8)
    _q6k_search(b, qw, scales, L)
    return quantize_q6_k_from(b, (nrows,), k, scales, L)


@njit(cache=True, parallel=True, nogil=True)
def _q3k_blocks(b, qw, Lsc_out, d_out, L_out):
    """quantize_row_q3_K_impl up to the block scale: per 16 values make_qx_quants(16, 4, .., weights), then the 16
    scales themselves make_qx_quants(16, 32, scales, Ls, 1, sw)."""
    n = b.shape[0]
    for i in prange(n):
        x = b[i]
        sumx2 = F32(0.0)
        for l in range(QK_K):
            sumx2 += x[l] * x[l]
        sigma2 = F32(2.0) * sumx2 / F32(QK_K)
        w = np.empty(16, np.float32)
        sw = np.empty(16, np.float32)
        scales = np.empty(16, np.float32)
        Lj = np.empty(16, np.int32)
        Ls = np.empty(16, np.int32)
        for j in range(16):
            for l in range(16):
                w[l] = qw[i, 16 * j + l] * np.sqrt(sigma2 + x[16 * j + l] * x[16 * j + l])
            sumw = F32(0.0)
            for l in range(16):
                sumw += w[l]
            sw[j] = sumw
            scales[j] = _make_qx_weighted(x[16 * j:16 * j + 16], 4, Lj, w)
            for l in range(16):
                L_out[i, 16 * j + l] = Lj[l]
        d_out[i] = _make_qx_weighted(scales, 32, Ls, sw)
        for j in range(16):
            Lsc_out[i, j] = Ls[j]


def quantize_q3_k_weighted(x, imatrix):
    from .quants_k import _pack_2bit
    x = np.ascontiguousarray(x, F32)
    nrows, k = x.shape
    nb = k // QK_K
    b = x.reshape(-1, QK_K)
    qw = np.ascontiguousarray(np.broadcast_to(np.asarray(imatrix, F32).reshape(1, nb, QK_K), (nrows, nb, QK_K))
                              ).reshape(-1, QK_K)
    n = len(b)
    l = np.empty((n, 16), np.uint8)
    d = np.empty(n, F32)
    L = np.empty((n, QK_K), np.int8)
    _q3k_blocks(b, qw, l, d, L)
    sc = np.zeros((n, 12), np.uint8)
    sc[:, 0:8] = (l[:, 0:8] & 0xF) | ((l[:, 8:16] & 0xF) << 4)
    hi = (l >> 4).reshape(n, 4, 4) << (2 * np.arange(4, dtype=np.uint8)).reshape(1, 4, 1)
    sc[:, 8:12] = np.bitwise_or.reduce(hi, axis=1)
    dq = round_f16(d)[:, None] * (l.astype(np.int8) - 32).astype(F32)
    L = _requant(L, b, dq, None, -4, 3, 4)
    high = L > 3
    hmask = np.bitwise_or.reduce(high.reshape(n, 8, 32).astype(np.uint8) << np.arange(8, dtype=np.uint8)[:, None],
                                 axis=1)
    out = np.concatenate([hmask, _pack_2bit(np.where(high, L - 4, L)), sc, to_f16_bytes(d).reshape(n, 2)], axis=1)
    return out.reshape(nrows, -1)


@njit(cache=True, parallel=True, nogil=True)
def _q2k_blocks(b, qw, ls_out, lm_out, d_out, m_out, L_out):
    """quantize_row_q2_K_impl up to the block scales: make_qkx3_quants(16, 3, ..) per 16 values (sigma2 the
    super-block's mean square), make_qp_quants(16, 15, ..) for the scales and the mins."""
    n = b.shape[0]
    for i in prange(n):
        x = b[i]
        sumx2 = F32(0.0)
        for l in range(QK_K):
            sumx2 += x[l] * x[l]
        sigma2 = sumx2 / F32(QK_K)
        w = np.empty(16, np.float32)
        sw = np.empty(16, np.float32)
        scales = np.empty(16, np.float32)
        mins = np.empty(16, np.float32)
        Laux = np.empty(16, np.int32)
        Lj = np.empty(16, np.int32)
        Ls = np.empty(16, np.int32)
        Lm = np.empty(16, np.int32)
        for j in range(16):
            for l in range(16):
                w[l] = qw[i, 16 * j + l] * np.sqrt(sigma2 + x[16 * j + l] * x[16 * j + l])
            sumw = F32(0.0)
            for l in range(16):
                sumw += w[l]
            sw[j] = sumw
            s_, m_ = _make_qkx3(x[16 * j:16 * j + 16], w, 3, Lj, Laux, F32(-0.9), F32(0.05), 36)
            scales[j] = s_
            mins[j] = m_
            for l in range(16):
                L_out[i, 16 * j + l] = Lj[l]
        d_out[i] = _make_qp(scales, 15, Ls, sw)
        m_out[i] = _make_qp(mins, 15, Lm, sw)
        for j in range(16):
            ls_out[i, j] = Ls[j]
            lm_out[i, j] = Lm[j]


def quantize_q2_k_weighted(x, imatrix):
    from .quants_k import _pack_2bit
    x = np.ascontiguousarray(x, F32)
    nrows, k = x.shape
    nb = k // QK_K
    b = x.reshape(-1, QK_K)
    qw = np.ascontiguousarray(np.broadcast_to(np.asarray(imatrix, F32).reshape(1, nb, QK_K), (nrows, nb, QK_K))
                              ).reshape(-1, QK_K)
    n = len(b)
    ls, lm = np.empty((n, 16), np.uint8), np.empty((n, 16), np.uint8)
    d, dmin = np.empty(n, F32), np.empty(n, F32)
    L = np.empty((n, QK_K), np.uint8)
    _q2k_blocks(b, qw, ls, lm, d, dmin, L)
    sc = ls | (lm << 4)
    dq = round_f16(d)[:, None] * (sc & 0xF).astype(F32)
    dm = round_f16(dmin)[:, None] * (sc >> 4).astype(F32)
    L = _requant(L, b, dq, dm, 0, 3, 0)
    out = np.concatenate([sc, _pack_2bit(L), to_f16_bytes(d).reshape(n, 2), to_f16_bytes(dmin).reshape(n, 2)], axis=1)
    return out.reshape(nrows, -1)


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
