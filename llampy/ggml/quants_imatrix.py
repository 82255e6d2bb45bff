"""Quantization weighted by an importance matrix, as ggml's ``quantize_<type>(src, dst, nrow, n_per_row, imatrix)``
runs it when llama-quantize has an imatrix.

Several formats ignore the weights (ggml's quantize_q8_0, tq1_0, tq2_0, mxfp4, q1_0, q2_0 call their _ref
quantizer either way); Q4_0 and Q5_0 use ``quantize_row_q<n>_0_impl`` (make_qx_quants with weights
qw[j] * sqrt(sigma2 + x[j]^2)). The others' weighted searches are not written yet and say so.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .quants import quantize
from .quants_base import F32, to_f16_bytes
from .types import GGMLType

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


@njit(cache=True, parallel=True)
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


_WEIGHTED = {T.Q4_0: quantize_q4_0_weighted, T.Q5_0: quantize_q5_0_weighted}

WEIGHTED_TYPES = frozenset(_WEIGHTED) | IGNORES_IMATRIX


def quantize_weighted(x: np.ndarray, t: GGMLType, imatrix: np.ndarray) -> np.ndarray:
    """x float32 [nrows, n_per_row], imatrix float32 [n_per_row] -> the bytes ggml_quantize_chunk writes."""
    t = GGMLType(t)
    if t in IGNORES_IMATRIX:
        return quantize(x, t)
    fn = _WEIGHTED.get(t)
    if fn is None:
        raise NotImplementedError(f"quantizing to {t.name} with an importance matrix is not implemented")
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        return fn(np.asarray(x, F32), imatrix)
