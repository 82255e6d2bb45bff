"""The IQ formats (grids and non-linear values), the ternary TQ formats and the FP4 formats: vectorised
dequantize as ggml's dequantize_row_*, and quantize for IQ4_NL / IQ4_XS (as llama-quantize, imatrix or not),
TQ1_0 / TQ2_0 and MXFP4 / NVFP4 (their _ref quantizers).

Multiplications keep ggml's order (``db * grid[j] * sign``), so results are bit-identical to ggml's.
"""
from __future__ import annotations

import numpy as np
from numba import prange

from . import quants_tables as tab
from .quants_base import F32, njit, f16, nibbles, pack, roundf, safe_inv, to_blocks, to_f16_bytes
from .types import GGMLType, QK_K

T = GGMLType

KVALUES_IQ4NL_F = tab.kvalues_iq4nl.astype(F32)
KVALUES_FP4_F = tab.kvalues_fp4.astype(F32)
_BIT8 = (1 << np.arange(8)).astype(np.uint8)              # kmask_iq2xs


def _signs(sbytes: np.ndarray) -> np.ndarray:
    """sign bytes [...] -> bool [..., 8]: value j is negated where bit j is set."""
    return (sbytes[..., None] & _BIT8) != 0


def _apply(db, grid, neg):
    """db * grid[j] * (neg ? -1 : 1) in float32, ggml's order (the sign flip is exact)."""
    v = db * grid.astype(F32)
    return np.where(neg, -v, v)


# ------------------------------------------------------------------------------------------------ dequantize

def _dq_iq2_xxs(b):
    n = len(b)
    d = f16(b[:, 0:2])
    aux = np.ascontiguousarray(b[:, 2:66]).view("<u4").reshape(n, 8, 2)
    grid_idx = np.ascontiguousarray(b[:, 2:66]).reshape(n, 8, 2, 4)[:, :, 0, :]                  # [n, 8, 4]
    db = d[:, None] * (F32(0.5) + (aux[:, :, 1] >> 28).astype(F32)) * F32(0.25)                 # [n, 8]
    sidx = (aux[:, :, 1:2] >> np.array([0, 7, 14, 21], np.uint32)) & 127                       # [n, 8, 4]
    neg = _signs(tab.ksigns_iq2xs[sidx])
    return _apply(db[:, :, None, None], tab.IQ2XXS_GRID_BYTES[grid_idx], neg).reshape(n, QK_K)


def _db_pairs(d, scales):
    """IQ2_XS/IQ2_S: per 32 values two scales, d * (0.5 + nibble) * 0.25 -> [n, 8, 4] (l // 2 picks)."""
    s = np.stack([scales & 0xF, scales >> 4], axis=2).astype(F32)                              # [n, 8, 2]
    db = d[:, None, None] * (F32(0.5) + s) * F32(0.25)
    return np.repeat(db, 2, axis=2)


def _dq_iq2_xs(b):
    n = len(b)
    d = f16(b[:, 0:2])
    qs = np.ascontiguousarray(b[:, 2:66]).view("<u2").reshape(n, 8, 4)
    db = _db_pairs(d, b[:, 66:74])
    neg = _signs(tab.ksigns_iq2xs[qs >> 9])
    return _apply(db[..., None], tab.IQ2XS_GRID_BYTES[qs & 511], neg).reshape(n, QK_K)


def _dq_iq2_s(b):
    n = len(b)
    d = f16(b[:, 0:2])
    qs = b[:, 2:34].reshape(n, 8, 4).astype(np.uint16)
    signs = b[:, 34:66].reshape(n, 8, 4)
    qh = b[:, 66:74].astype(np.uint16)
    idx = qs | ((qh[:, :, None] << np.array([8, 6, 4, 2], np.uint16)) & 0x300)
    db = _db_pairs(d, b[:, 74:82])
    return _apply(db[..., None], tab.IQ2S_GRID_BYTES[idx], _signs(signs)).reshape(n, QK_K)


def _dq_iq3_xxs(b):
    n = len(b)
    d = f16(b[:, 0:2])
    qs = b[:, 2:66].reshape(n, 8, 4, 2)                                                         # ib32, l, half
    aux = np.ascontiguousarray(b[:, 66:98]).view("<u4")                                        # [n, 8]
    db = d[:, None] * (F32(0.5) + (aux >> 28).astype(F32)) * F32(0.5)
    sidx = (aux[:, :, None] >> np.array([0, 7, 14, 21], np.uint32)) & 127
    neg = _signs(tab.ksigns_iq2xs[sidx])                                                       # [n, 8, 4, 8]
    grid = tab.IQ3XXS_GRID_BYTES[qs].reshape(n, 8, 4, 8)
    return _apply(db[:, :, None, None], grid, neg).reshape(n, QK_K)


def _dq_iq3_s(b):
    n = len(b)
    d = f16(b[:, 0:2])
    qs = b[:, 2:66].reshape(n, 8, 8).astype(np.uint16)                                          # ib32, 2l + half
    qh = b[:, 66:74].astype(np.uint16)
    signs = b[:, 74:106].reshape(n, 8, 4)
    sc = b[:, 106:110]
    s = np.stack([sc & 0xF, sc >> 4], axis=2).reshape(n, 8).astype(np.int32)                 # ib32
    db = d[:, None] * (1 + 2 * s).astype(F32)
    # bit k of qh[ib32] is the 9th bit of grid index k of that group of 32
    idx = qs | (((qh[:, :, None] >> np.arange(8, dtype=np.uint16)) & 1) << 8)
    grid = tab.IQ3S_GRID_BYTES[idx].reshape(n, 8, 4, 8)
    return _apply(db[:, :, None, None], grid, _signs(signs)).reshape(n, QK_K)


def _dq_iq1_s(b):
    n = len(b)
    d = f16(b[:, 0:2])
    qs = b[:, 2:34].reshape(n, 8, 4).astype(np.uint16)
    qh = np.ascontiguousarray(b[:, 34:50]).view("<u2")                                         # [n, 8]
    dl = d[:, None] * (2 * ((qh >> 12) & 7) + 1).astype(F32)
    delta = np.where(qh & 0x8000, F32(-0.125), F32(0.125))
    idx = qs | (((qh[:, :, None] >> np.array([0, 3, 6, 9], np.uint16)) & 7) << 8)
    grid = tab.IQ1S_GRID_BYTES[idx].astype(F32)                                                 # [n, 8, 4, 8]
    return (dl[:, :, None, None] * (grid + delta[:, :, None, None])).reshape(n, QK_K)


def _dq_iq1_m(b):
    n = len(b)
    qs = b[:, 0:32].reshape(n, 8, 4).astype(np.uint16)
    qh = b[:, 32:48].reshape(n, 8, 2).astype(np.uint16)
    sc = np.ascontiguousarray(b[:, 48:56]).view("<u2")                                         # [n, 4]
    u = (sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0x00F0) | ((sc[:, 2] >> 4) & 0x0F00) | (sc[:, 3] & 0xF000)
    d = u.astype("<u2").view("<f2").astype(F32)
    s = sc[:, np.arange(8) // 2, None] >> ((6 * (np.arange(8) % 2))[:, None] + np.array([0, 3]))   # [n, 8, 2]
    dl = d[:, None, None] * (2 * (s & 7) + 1).astype(F32)
    dl = np.repeat(dl, 2, axis=2)                                                               # groups 0,1 / 2,3
    qh4 = np.stack([qh[:, :, 0], qh[:, :, 0] >> 4, qh[:, :, 1], qh[:, :, 1] >> 4], axis=2)    # [n, 8, 4]
    idx = qs | ((qh4 & 7) << 8)
    delta = np.where(qh4 & 0x08, F32(-0.125), F32(0.125))
    grid = tab.IQ1S_GRID_BYTES[idx].astype(F32)
    return (dl[..., None] * (grid + delta[..., None])).reshape(n, QK_K)


def _dq_iq4_nl(b):
    return f16(b[:, 0:2])[:, None] * KVALUES_IQ4NL_F[nibbles(b[:, 2:18])]


def _dq_iq4_xs(b):
    n = len(b)
    d = f16(b[:, 0:2])[:, None]
    scales_h = np.ascontiguousarray(b[:, 2:4]).view("<u2")[:, 0].astype(np.int32)
    ib = np.arange(8)
    ls = ((b[:, 4 + ib // 2] >> (4 * (ib % 2))) & 0xF).astype(np.int32) | (((scales_h[:, None] >> (2 * ib)) & 3) << 4)
    dl = d * (ls - 32).astype(F32)                                                              # [n, 8]
    qs = b[:, 8:136].reshape(n, 8, 16)
    q = np.concatenate([qs & 0xF, qs >> 4], axis=2)
    return (dl[:, :, None] * KVALUES_IQ4NL_F[q]).reshape(n, QK_K)


_POW3 = np.array([1, 3, 9, 27, 81], np.uint8)


def _trits(q: np.ndarray, npow: int) -> np.ndarray:
    """bytes [...] -> [npow, ...] trits - 1: the n-th is ((uint8)(q * 3^n) * 3) >> 8."""
    qn = (q[None] * _POW3[:npow].reshape((npow,) + (1,) * q.ndim)).astype(np.uint8)
    return ((qn.astype(np.uint16) * 3) >> 8).astype(np.int16) - 1


def _dq_tq1_0(b):
    n = len(b)
    d = f16(b[:, 52:54])[:, None]
    a = _trits(b[:, 0:32], 5).transpose(1, 0, 2).reshape(n, 160)                                # n-major, m
    c = _trits(b[:, 32:48], 5).transpose(1, 0, 2).reshape(n, 80)
    h = _trits(b[:, 48:52], 4).transpose(1, 0, 2).reshape(n, 16)
    return np.concatenate([a, c, h], axis=1).astype(F32) * d


def _dq_tq2_0(b):
    n = len(b)
    q = (b[:, 0:64].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
    return (q.reshape(n, QK_K).astype(np.int8) - 1).astype(F32) * f16(b[:, 64:66])[:, None]


def e8m0_to_fp32_half(e: np.ndarray) -> np.ndarray:
    """GGML_E8M0_TO_FP32_HALF: 2^(e - 128) as float32 bits."""
    e = e.astype(np.uint32)
    return np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << 23).astype(np.uint32).view(F32)


def _ue4m3_table() -> np.ndarray:
    """ggml_ue4m3_to_fp32 for all 256 bytes (exact: every value is a small power-of-two multiple)."""
    x = np.arange(256)
    exp, man = (x >> 3) & 0xF, x & 7
    raw = np.where(exp == 0, np.ldexp(man.astype(F32), -9), np.ldexp(F32(1) + man.astype(F32) / F32(8), exp - 7))
    out = (raw * 0.5).astype(F32)
    out[(x == 0) | (x == 0x7F)] = 0
    return out


UE4M3_TO_F32 = _ue4m3_table()


def _dq_mxfp4(b):
    d = e8m0_to_fp32_half(b[:, 0])[:, None]
    return KVALUES_FP4_F[nibbles(b[:, 1:17])] * d


def _dq_nvfp4(b):
    n = len(b)
    d = UE4M3_TO_F32[b[:, 0:4]][:, :, None]                                                    # [n, 4, 1]
    qs = b[:, 4:36].reshape(n, 4, 8)
    q = np.concatenate([qs & 0xF, qs >> 4], axis=2)
    return (KVALUES_FP4_F[q] * d).reshape(n, 64)


DEQUANT = {
    T.IQ2_XXS: _dq_iq2_xxs, T.IQ2_XS: _dq_iq2_xs, T.IQ2_S: _dq_iq2_s, T.IQ3_XXS: _dq_iq3_xxs, T.IQ3_S: _dq_iq3_s,
    T.IQ1_S: _dq_iq1_s, T.IQ1_M: _dq_iq1_m, T.IQ4_NL: _dq_iq4_nl, T.IQ4_XS: _dq_iq4_xs,
    T.TQ1_0: _dq_tq1_0, T.TQ2_0: _dq_tq2_0, T.MXFP4: _dq_mxfp4, T.NVFP4: _dq_nvfp4,
}


# ------------------------------------------------------------------------------------------------ IQ4 quantize

@njit(cache=True, inline="always")
def _nearest_int(v):
    return int((v + F32(12582912.0)) - F32(12582912.0))


@njit(cache=True)
def _best_index(kv, x):
    """best_index_int8: the nearest of the 16 sorted values (the lower one on ties)."""
    if x <= kv[0]:
        return 0
    if x >= kv[15]:
        return 15
    ml = 0
    mu = 15
    while mu - ml > 1:
        mav = (ml + mu) // 2
        if x < kv[mav]:
            mu = mav
        else:
            ml = mav
    return mu - 1 if x - kv[mu - 1] < kv[mu] - x else mu


@njit(cache=True)
def _sums(kv, xb, id_, L, w):
    sumqx = F32(0.0)
    sumq2 = F32(0.0)
    for j in range(xb.shape[0]):
        l = _best_index(kv, id_ * xb[j])
        if L.shape[0]:
            L[j] = l
        q = kv[l]
        sumqx += w[j] * q * xb[j]
        sumq2 += w[j] * q * q
    return sumqx, sumq2


@njit(cache=True, parallel=True, nogil=True)
def _iq4_search(b, kv, ntry, qw, nper):
    """quantize_row_iq4_nl_impl, sub-blocks of 32 within a super-block of b.shape[1]: weights x^2, or with an
    importance matrix ``qw`` (the row's, ``nper`` super-blocks a row) qw * sqrt(sigma2 + x^2), sigma2 twice the
    super-block's mean square. Returns (d [n] float32, scale codes [n, nsub] 0..63 (unused when nsub == 1),
    L [n, k])."""
    n, k = b.shape
    nsub = k // 32
    d_out = np.zeros(n, np.float32)
    ls_out = np.zeros((n, nsub), np.uint8)
    L = np.zeros((n, k), np.uint8)
    none = np.empty(0, np.uint8)
    has_w = qw.shape[0] > 0
    for i in prange(n):
        scales = np.zeros(nsub, np.float32)
        max_scale = F32(0.0)
        amax_scale = F32(0.0)
        w = np.empty(32, np.float32)
        sigma2 = F32(0.0)
        if has_w:
            for j in range(k):
                sigma2 += b[i, j] * b[i, j]
            sigma2 *= F32(2.0) / F32(k)
        qoff = (i % nper) * k
        for ib in range(nsub):
            xb = b[i, 32 * ib:32 * (ib + 1)]
            for j in range(32):
                if has_w:
                    w[j] = qw[qoff + 32 * ib + j] * np.sqrt(sigma2 + xb[j] * xb[j])
                else:
                    w[j] = xb[j] * xb[j]
            amax = F32(0.0)
            mx = F32(0.0)
            for j in range(32):
                if abs(xb[j]) > amax:
                    amax = abs(xb[j])
                    mx = xb[j]
            if amax < F32(1e-15):
                scales[ib] = F32(0.0)
                continue
            d = -mx / kv[0] if ntry > 0 else mx / kv[0]
            sumqx, sumq2 = _sums(kv, xb, F32(1.0) / d, L[i, 32 * ib:32 * (ib + 1)], w)
            d = sumqx / sumq2 if sumq2 > 0 else F32(0.0)
            best = d * sumqx
            for itry in range(-ntry, ntry + 1):
                sumqx, sumq2 = _sums(kv, xb, F32(itry + int(kv[0])) / mx, none, w)
                if sumq2 > 0 and sumqx * sumqx > best * sumq2:
                    d = sumqx / sumq2
                    best = d * sumqx
            scales[ib] = d
            if abs(d) > amax_scale:
                amax_scale = abs(d)
                max_scale = d
        if nsub > 1:
            d = -max_scale / F32(32.0)
            d_out[i] = d
            id_ = F32(1.0) / d if d != 0 else F32(0.0)
            for ib in range(nsub):
                l = max(-32, min(31, _nearest_int(id_ * scales[ib])))
                dl = d * F32(l)
                idl = F32(1.0) / dl if dl != 0 else F32(0.0)
                for j in range(32):
                    L[i, 32 * ib + j] = _best_index(kv, idl * b[i, 32 * ib + j])
                ls_out[i, ib] = l + 32
        else:
            d_out[i] = scales[0]
            if ntry > 0:
                id_ = F32(1.0) / scales[0] if scales[0] != 0 else F32(0.0)
                for j in range(k):
                    L[i, j] = _best_index(kv, id_ * b[i, j])
    return d_out, ls_out, L


def _q4_pack(L):
    """L [n, k] of 0..15 -> [n, k/2]: per 32 values, the first 16 in low nibbles, the next 16 in high."""
    q = L.reshape(len(L), -1, 2, 16)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(len(L), -1)


def _qw(imatrix, n_per_row):
    if imatrix is None:
        return np.empty(0, F32)
    qw = np.ascontiguousarray(imatrix, F32).reshape(-1)
    if qw.shape[0] != n_per_row:
        raise ValueError(f"imatrix has {qw.shape[0]} values, rows have {n_per_row}")
    return qw


def quantize_iq4_nl(x, imatrix=None):
    """quantize_iq4_nl (ntry 7): what llama-quantize writes, with or without an importance matrix [row length]."""
    b, lead = to_blocks(x, 32)
    d, _, L = _iq4_search(b, KVALUES_IQ4NL_F, 7, _qw(imatrix, x.shape[-1]), x.shape[-1] // 32)
    return pack([to_f16_bytes(d), _q4_pack(L)], lead, x.shape[-1] // 32)


def quantize_iq4_xs(x, imatrix=None):
    b, lead = to_blocks(x, QK_K)
    d, ls, L = _iq4_search(b, KVALUES_IQ4NL_F, 7, _qw(imatrix, x.shape[-1]), x.shape[-1] // QK_K)
    scales_h = ((ls >> 4).astype(np.uint16) << (2 * np.arange(8, dtype=np.uint16))).sum(axis=1).astype("<u2")
    scales_l = (ls[:, 0::2] & 0xF) | ((ls[:, 1::2] & 0xF) << 4)
    return pack([to_f16_bytes(d), scales_h, scales_l, _q4_pack(L)], lead, x.shape[-1] // QK_K)


# ------------------------------------------------------------------------------------------------ TQ, FP4 quantize

def _lroundf(v):
    return roundf(v).astype(np.int32)


def quantize_tq1_0(x):
    """quantize_row_tq1_0_ref: trits of lroundf(x / amax), 5 per byte (then 4 per byte), as ceil(q * 256 / 243)."""
    b, lead = to_blocks(x, QK_K)
    n = len(b)
    d = np.abs(b).max(axis=1)
    t = (_lroundf(b * safe_inv(d)[:, None]) + 1).astype(np.uint16)

    def enc(vals, m):                   # vals [n, npow, m] -> bytes [n, m]
        q = np.zeros((n, m), np.uint16)
        for k in range(vals.shape[1]):
            q = (q * 3 + vals[:, k]) & 0xFF
        return (((q * 256) + 242) // 243).astype(np.uint8)

    a = enc(t[:, 0:160].reshape(n, 5, 32), 32)
    c = enc(t[:, 160:240].reshape(n, 5, 16), 16)
    h = enc(np.concatenate([t[:, 240:256].reshape(n, 4, 4), np.zeros((n, 1, 4), np.uint16)], axis=1), 4)
    return pack([a, c, h, to_f16_bytes(d)], lead, x.shape[-1] // QK_K)


def quantize_tq2_0(x):
    b, lead = to_blocks(x, QK_K)
    n = len(b)
    d = np.abs(b).max(axis=1)
    t = ((_lroundf(b * safe_inv(d)[:, None]) + 1) & 3).astype(np.uint8).reshape(n, 2, 4, 32)
    qs = np.bitwise_or.reduce(t << np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1), axis=2).reshape(n, 64)
    return pack([qs, to_f16_bytes(d)], lead, x.shape[-1] // QK_K)


@njit(cache=True, nogil=True)
def _best_fp4_groups(v, d, kv, q):
    """q[i] = best_index_mxfp4(v[i], d[i // k]) for v, q flat and k = v.size // d.size: the first j with the
    smallest |kv[j] * d - x| (ggml's loop: a NaN error never wins). Per value the 16 candidates are a fixed loop
    of selects on scalars (unrolled), so the values' loop is SIMD."""
    m = d.shape[0]
    k = v.shape[0] // m
    for r in range(m):
        dd = d[r]
        for i in range(r * k, r * k + k):
            x = v[i]
            b = abs(kv[0] * dd - x)
            bj = 0
            for j in range(1, 16):
                e = abs(kv[j] * dd - x)
                lt = e < b
                b = e if lt else b
                bj = j if lt else bj
            q[i] = bj


@njit(cache=True, nogil=True)
def _absmax_groups(v, k, out):
    """out[r] = the largest |v| of values r k .. r k + k - 1 (ggml's ``if (amax < fabsf(v))``: NaN skipped)."""
    for r in range(out.shape[0]):
        a = F32(0.0)
        for i in range(r * k, r * k + k):
            x = abs(v[i])
            a = x if a < x else a
        out[r] = a


def _absmax(b, k):
    """the largest magnitude of each group of k values of b (its size a multiple of k), float32 [b.size // k]"""
    out = np.empty(b.size // k, F32)
    _absmax_groups(np.ascontiguousarray(b, F32).reshape(-1), k, out)
    return out


def _best_fp4(v, d):
    """best_index_mxfp4 for values v [..., k] sharing the scale d [...] per group of k."""
    k = v.shape[-1]
    q = np.empty(v.shape, np.uint8)
    _best_fp4_groups(np.ascontiguousarray(v, F32).reshape(-1), np.ascontiguousarray(d, F32).reshape(-1),
                     KVALUES_FP4_F, q.reshape(-1))
    return q


def quantize_mxfp4(x):
    b, lead = to_blocks(x, 32)
    amax = _absmax(b, 32)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, F32(1)))) - 2 + 127, 0)
    e = e.astype(np.int32).astype(np.uint8)
    q = _best_fp4(b, e8m0_to_fp32_half(e))
    return pack([e, q[:, :16] | (q[:, 16:] << 4)], lead, x.shape[-1] // 32)


def fp32_to_ue4m3(x: np.ndarray) -> np.ndarray:
    """ggml_fp32_to_ue4m3, vectorised."""
    x = np.minimum(np.asarray(x, F32), F32(448))
    bits = x.view(np.uint32).astype(np.int64)
    exp = ((bits >> 23) & 0xFF) - 127 + 7
    man = (bits >> 20) & 7
    sub = np.minimum((x * F32(512) + F32(0.5)).astype(np.int64), 7)
    sub = np.where(sub < 1, 0, sub)
    man_r = man + ((bits >> 19) & 1)
    exp_r = np.where(man_r > 7, exp + 1, exp)
    man_r = np.where(man_r > 7, 0, man_r)
    normal = np.where(exp_r >= 15, 0x7E, (exp_r << 3) | man_r)
    out = np.where(exp <= 0, sub, np.where(exp >= 15, 0x7E, normal))
    return np.where(x > 0, out, 0).astype(np.uint8)


def quantize_nvfp4(x):
    b, lead = to_blocks(x, 64)
    n = len(b)
    s = b.reshape(n, 4, 16)
    ue = fp32_to_ue4m3(_absmax(s, 16).reshape(n, 4) / F32(6))
    q = _best_fp4(s, UE4M3_TO_F32[ue])                                                        # [n, 4, 16]
    qs = (q[:, :, :8] | (q[:, :, 8:] << 4)).reshape(n, 32)
    return pack([ue, qs], lead, x.shape[-1] // 64)


QUANT = {T.IQ4_NL: quantize_iq4_nl, T.IQ4_XS: quantize_iq4_xs, T.TQ1_0: quantize_tq1_0, T.TQ2_0: quantize_tq2_0,
         T.MXFP4: quantize_mxfp4, T.NVFP4: quantize_nvfp4}
