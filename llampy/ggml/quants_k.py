"""The k-quants (Q2_K..Q6_K): vectorised dequantize, and quantize as ggml's quantize_row_q*_K_ref.

The reference quantizers search scales per sub-block (make_qkx2_quants, make_q3_quants, make_qx_quants). Those
searches are sequential per sub-block, so they run in Numba, in float32 and in ggml's operation order; the rest
(super-block scales, fp16 rounding, the final requantization and the bit packing) is vectorised NumPy.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .quants_base import F32, f16, nearest_int, pack, round_f16, to_blocks, to_f16_bytes
from .types import GGMLType, QK_K

T = GGMLType
GROUP_MAX_EPS = F32(1e-15)


# ------------------------------------------------------------------------------------------------ dequantize

def _dq_q2_k(b):
    n = len(b)
    sc = b[:, 0:16]
    d, dmin = f16(b[:, 80:82])[:, None], f16(b[:, 82:84])[:, None]
    dl = (d * (sc & 0xF).astype(F32)).reshape(n, 2, 4, 2, 1)
    ml = (dmin * (sc >> 4).astype(F32)).reshape(n, 2, 4, 2, 1)
    # value order: half h, shift s (0..3), group g (0,1), l (0..15); its byte is qs[32h + 16g + l]
    q = b[:, 16:80].reshape(n, 2, 1, 2, 16) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1, 1)
    return (dl * (q & 3).astype(F32) - ml).reshape(n, QK_K)


def _q3_k_scales(sc12: np.ndarray) -> np.ndarray:
    """12 bytes -> 16 signed 6-bit scales (ggml's kmask1/kmask2 unpacking), minus 32."""
    n = len(sc12)
    lo = np.concatenate([sc12[:, 0:8] & 0xF, sc12[:, 0:8] >> 4], axis=1)                    # scale j: nibble
    hi = (sc12[:, 8:12, None] >> np.array([0, 2, 4, 6], np.uint8)) & 3                       # [n, j%4, j//4]
    hi = hi.transpose(0, 2, 1).reshape(n, 16)
    return (lo | (hi << 4)).astype(np.int8) - 32


def _dq_q3_k(b):
    n = len(b)
    d = f16(b[:, 108:110]).reshape(n, 1, 1, 1, 1)
    scales = _q3_k_scales(b[:, 96:108]).astype(F32).reshape(n, 2, 4, 2, 1)
    q = b[:, 32:96].reshape(n, 2, 1, 2, 16) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1, 1)
    hbit = np.arange(8, dtype=np.uint8).reshape(1, 2, 4, 1, 1)                              # hmask bit 4h + s
    high = (b[:, 0:32].reshape(n, 1, 1, 2, 16) >> hbit) & 1
    v = (q & 3).astype(np.int8) - 4 * (1 - high).astype(np.int8)
    return ((d * scales) * v.astype(F32)).reshape(n, QK_K)


def scale_min_k4(sc: np.ndarray):
    """12 bytes -> 8 six-bit scales and 8 six-bit mins (get_scale_min_k4)."""
    s = np.concatenate([sc[:, 0:4] & 63, (sc[:, 8:12] & 0xF) | ((sc[:, 0:4] >> 6) << 4)], axis=1)
    m = np.concatenate([sc[:, 4:8] & 63, (sc[:, 8:12] >> 4) | ((sc[:, 4:8] >> 6) << 4)], axis=1)
    return s, m


def _dq_q4_k(b):
    n = len(b)
    d, dmin = f16(b[:, 0:2])[:, None], f16(b[:, 2:4])[:, None]
    s, m = scale_min_k4(b[:, 4:16])
    qs = b[:, 16:144].reshape(n, 4, 1, 32)
    q = np.concatenate([qs & 0xF, qs >> 4], axis=2).reshape(n, 8, 32).astype(F32)
    return ((d * s.astype(F32))[:, :, None] * q - (dmin * m.astype(F32))[:, :, None]).reshape(n, QK_K)


def _dq_q5_k(b):
    n = len(b)
    d, dmin = f16(b[:, 0:2])[:, None], f16(b[:, 2:4])[:, None]
    s, m = scale_min_k4(b[:, 4:16])
    qh = b[:, 16:48].reshape(n, 1, 32)
    qs = b[:, 48:176].reshape(n, 4, 1, 32)
    lo = np.concatenate([qs & 0xF, qs >> 4], axis=2).reshape(n, 8, 32)
    hi = ((qh >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1) << 4
    q = (lo | hi).astype(F32)
    return ((d * s.astype(F32))[:, :, None] * q - (dmin * m.astype(F32))[:, :, None]).reshape(n, QK_K)


def _dq_q6_k(b):
    n = len(b)
    ql = b[:, 0:128].reshape(n, 2, 2, 32)       # half, (l | l+32)
    qh = b[:, 128:192].reshape(n, 2, 32)
    sc = b[:, 192:208].view(np.int8).astype(F32).reshape(n, 2, 4, 2)
    d = f16(b[:, 208:210]).reshape(n, 1, 1, 1)
    # per half: y[l] (ql[l] low nibble, qh bits 0-1), y[l+32] (ql[l+32] low, bits 2-3),
    #           y[l+64] (ql[l] high, bits 4-5), y[l+96] (ql[l+32] high, bits 6-7)
    lo = np.stack([ql[:, :, 0] & 0xF, ql[:, :, 1] & 0xF, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4], axis=2)
    hi = (qh[:, :, None, :] >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
    q = (lo | (hi << 4)).astype(np.int8) - 32                                   # [n, 2, 4, 32]
    scale = np.repeat(sc, 16, axis=3)                                            # scale index l//16 + 2k
    return ((d * scale) * q.astype(F32)).reshape(n, QK_K)


DEQUANT = {T.Q2_K: _dq_q2_k, T.Q3_K: _dq_q3_k, T.Q4_K: _dq_q4_k, T.Q5_K: _dq_q5_k, T.Q6_K: _dq_q6_k}


# ------------------------------------------------------------------------------------------------ search (Numba)
# float32 throughout: every literal and int operand is wrapped in F32 so Numba never widens to float64.

@njit(cache=True, inline="always")
def _nearest_int(v):
    # ggml's trick: adding 1.5*2^23 rounds to an integer, half to even
    return int((v + F32(12582912.0)) - F32(12582912.0))


@njit(cache=True)
def _make_qkx2(x, w, nmax, rmin, rdelta, nstep, use_mad, L, Laux):
    """make_qkx2_quants: returns (scale, -min); L gets the levels 0..nmax."""
    n = x.shape[0]
    lo = x[0]
    hi = x[0]
    sum_w = w[0]
    sum_x = sum_w * x[0]
    for i in range(1, n):
        if x[i] < lo:
            lo = x[i]
        if x[i] > hi:
            hi = x[i]
        sum_w += w[i]
        sum_x += w[i] * x[i]
    if lo > 0:
        lo = F32(0.0)
    if hi == lo:
        for i in range(n):
            L[i] = 0
        return F32(0.0), -lo
    fnmax = F32(nmax)
    iscale = fnmax / (hi - lo)
    scale = F32(1.0) / iscale
    best_error = F32(0.0)
    for i in range(n):
        l = max(0, min(nmax, _nearest_int(iscale * (x[i] - lo))))
        L[i] = l
        diff = scale * F32(l) + lo - x[i]
        diff = abs(diff) if use_mad else diff * diff
        best_error += w[i] * diff
    if nstep < 1:
        return scale, -lo
    for step in range(nstep + 1):
        iscale = (rmin + rdelta * F32(step) + fnmax) / (hi - lo)
        sum_l = F32(0.0)
        sum_l2 = F32(0.0)
        sum_xl = F32(0.0)
        for i in range(n):
            l = max(0, min(nmax, _nearest_int(iscale * (x[i] - lo))))
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
            cur_error = F32(0.0)
            for i in range(n):
                diff = this_scale * F32(Laux[i]) + this_min - x[i]
                diff = abs(diff) if use_mad else diff * diff
                cur_error += w[i] * diff
            if cur_error < best_error:
                for i in range(n):
                    L[i] = Laux[i]
                best_error = cur_error
                scale = this_scale
                lo = this_min
    return scale, -lo


@njit(cache=True, parallel=True, nogil=True)
def _search_qkx2(b, sub, nmax, rmin, rdelta, nstep, use_mad, rms_weights):
    """Per sub-block of ``sub`` values: make_qkx2_quants with weights |x| (Q2_K) or rms(x) + |x| (Q4_K, Q5_K)."""
    n, k = b.shape
    nsub = k // sub
    scales = np.empty((n, nsub), np.float32)
    mins = np.empty((n, nsub), np.float32)
    L = np.empty((n, k), np.uint8)
    for i in prange(n):
        w = np.empty(sub, np.float32)
        Laux = np.empty(sub, np.uint8)
        for j in range(nsub):
            x = b[i, j * sub:(j + 1) * sub]
            av_x = F32(0.0)
            if rms_weights:
                sum_x2 = F32(0.0)
                for l in range(sub):
                    sum_x2 += x[l] * x[l]
                av_x = F32(np.sqrt(sum_x2 / F32(sub)))
            for l in range(sub):
                w[l] = av_x + abs(x[l])
            s, m = _make_qkx2(x, w, nmax, rmin, rdelta, nstep, use_mad, L[i, j * sub:(j + 1) * sub], Laux)
            scales[i, j] = s
            mins[i, j] = m
    return scales, mins, L


@njit(cache=True)
def _make_q3(x, nmax, L):
    """make_q3_quants with do_rmse: returns the scale; L gets the levels 0..2*nmax-1."""
    n = x.shape[0]
    mx = F32(0.0)
    amax = F32(0.0)
    for i in range(n):
        if abs(x[i]) > amax:
            amax = abs(x[i])
            mx = x[i]
    if amax < GROUP_MAX_EPS:
        for i in range(n):
            L[i] = 0
        return F32(0.0)
    iscale = F32(-nmax) / mx
    sumlx = F32(0.0)
    suml2 = F32(0.0)
    for i in range(n):
        l = max(-nmax, min(nmax - 1, _nearest_int(iscale * x[i])))
        L[i] = l
        w = x[i] * x[i]
        sumlx += w * x[i] * F32(l)
        suml2 += w * F32(l) * F32(l)
    for _ in range(5):
        n_changed = 0
        for i in range(n):
            w = x[i] * x[i]
            li = F32(L[i])
            slx = sumlx - w * x[i] * li
            if slx > 0:
                sl2 = suml2 - w * li * li
                new_l = max(-nmax, min(nmax - 1, _nearest_int(x[i] * sl2 / slx)))
                if new_l != L[i]:
                    slx += w * x[i] * F32(new_l)
                    sl2 += w * F32(new_l) * F32(new_l)
                    if sl2 > 0 and slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = new_l
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    for i in range(n):
        L[i] += nmax
    return sumlx / suml2 if suml2 > 0 else F32(0.0)


@njit(cache=True)
def _qx_sums(x, iscale, nmax):
    sumlx = F32(0.0)
    suml2 = F32(0.0)
    for i in range(x.shape[0]):
        l = F32(max(-nmax, min(nmax - 1, _nearest_int(iscale * x[i]))))
        w = x[i] * x[i]
        sumlx += w * x[i] * l
        suml2 += w * l * l
    return sumlx, suml2


@njit(cache=True)
def _make_qx(x, nmax, L):
    """make_qx_quants with rmse_type 1 and no importance: returns the scale; L gets the levels 0..2*nmax-1."""
    n = x.shape[0]
    mx = F32(0.0)
    amax = F32(0.0)
    for i in range(n):
        if abs(x[i]) > amax:
            amax = abs(x[i])
            mx = x[i]
    if amax < GROUP_MAX_EPS:
        for i in range(n):
            L[i] = 0
        return F32(0.0)
    iscale = F32(-nmax) / mx
    for i in range(n):
        L[i] = nmax + max(-nmax, min(nmax - 1, _nearest_int(iscale * x[i])))
    sumlx, suml2 = _qx_sums(x, iscale, nmax)
    scale = sumlx / suml2 if suml2 != 0 else F32(0.0)
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = -(F32(nmax) + F32(0.1) * F32(step)) / mx
        sumlx, suml2 = _qx_sums(x, iscale, nmax)
        if suml2 > 0 and sumlx * sumlx > best * suml2:
            for i in range(n):
                L[i] = nmax + max(-nmax, min(nmax - 1, _nearest_int(iscale * x[i])))
            scale = sumlx / suml2
            best = scale * sumlx
    return scale


@njit(cache=True, parallel=True, nogil=True)
def _search_q3(b, nmax, use_q3):
    """Per sub-block of 16: make_q3_quants (Q3_K) or make_qx_quants (Q6_K)."""
    n = b.shape[0]
    scales = np.empty((n, 16), np.float32)
    L = np.empty((n, QK_K), np.int8)
    for i in prange(n):
        for j in range(16):
            x = b[i, 16 * j:16 * (j + 1)]
            Lj = L[i, 16 * j:16 * (j + 1)]
            scales[i, j] = _make_q3(x, nmax, Lj) if use_q3 else _make_qx(x, nmax, Lj)
    return scales, L


# ------------------------------------------------------------------------------------------------ quantize

def _requant(L, x, d, dm, lo, hi, offset):
    """ggml's last pass: where the sub-block scale d is non-zero, L = clamp(nearest_int((x + dm) / d)) + offset;
    elsewhere the search's levels stay. d, dm: [n, nsub]."""
    n, nsub = d.shape
    sub = x.shape[1] // nsub
    xs = x.reshape(n, nsub, sub)
    dd = d[:, :, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        v = (xs + dm[:, :, None]) / dd if dm is not None else xs / dd
        new = np.clip(np.rint(np.where(dd != 0, v, F32(0))), lo, hi).astype(np.int32) + offset
    return np.where(dd != 0, new, L.reshape(n, nsub, sub).astype(np.int32)).reshape(n, -1)


def _pack_2bit(L):
    """L [n, 256] of 0..3 -> qs [n, 64]: byte 32h + l holds L[128h + l + 32s] at bits 2s."""
    q = L.reshape(len(L), 2, 4, 32).astype(np.uint8) << np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    return np.bitwise_or.reduce(q, axis=2).reshape(len(L), 64)


def _inv_or_zero(num, den):
    with np.errstate(divide="ignore"):
        return np.where(den > 0, F32(num) / np.where(den > 0, den, F32(1)), F32(0)).astype(F32)


def quantize_q2_k(x):
    b, lead = to_blocks(x, QK_K)
    scales, mins, L = _search_qkx2(b, 16, 3, F32(-0.5), F32(0.1), 15, True, False)
    max_scale = np.maximum(scales.max(axis=1), F32(0))
    max_min = np.maximum(mins.max(axis=1), F32(0))
    ls = nearest_int(_inv_or_zero(15, max_scale)[:, None] * scales).astype(np.uint8)
    lm = nearest_int(_inv_or_zero(15, max_min)[:, None] * mins).astype(np.uint8)
    sc = ls | (lm << 4)
    d = np.where(max_scale > 0, max_scale / F32(15), F32(0)).astype(F32)
    dmin = np.where(max_min > 0, max_min / F32(15), F32(0)).astype(F32)
    dq = round_f16(d)[:, None] * (sc & 0xF).astype(F32)
    dm = round_f16(dmin)[:, None] * (sc >> 4).astype(F32)
    L = _requant(L, b, dq, dm, 0, 3, 0)
    return pack([sc, _pack_2bit(L), to_f16_bytes(d), to_f16_bytes(dmin)], lead, x.shape[-1] // QK_K)


def quantize_q3_k(x):
    b, lead = to_blocks(x, QK_K)
    n = len(b)
    scales, L = _search_q3(b, 4, True)
    max_scale = scales[np.arange(n), np.abs(scales).argmax(axis=1)]
    has = max_scale != 0
    with np.errstate(divide="ignore"):
        iscale = np.where(has, F32(-32) / np.where(has, max_scale, F32(1)), F32(0)).astype(F32)
        d = np.where(has, F32(1) / np.where(has, iscale, F32(1)), F32(0)).astype(F32)
    l = np.where(has[:, None], np.clip(nearest_int(iscale[:, None] * scales), -32, 31) + 32, 0).astype(np.uint8)
    sc = np.zeros((n, 12), np.uint8)
    sc[:, 0:8] = (l[:, 0:8] & 0xF) | ((l[:, 8:16] & 0xF) << 4)
    hi = (l >> 4).reshape(n, 4, 4) << (2 * np.arange(4, dtype=np.uint8)).reshape(1, 4, 1)      # [n, j//4, j%4]
    sc[:, 8:12] = np.bitwise_or.reduce(hi, axis=1)
    dq = round_f16(d)[:, None] * (l.astype(np.int8) - 32).astype(F32)
    L = _requant(L, b, dq, None, -4, 3, 4)
    high = L > 3
    hmask = np.bitwise_or.reduce(high.reshape(n, 8, 32).astype(np.uint8) << np.arange(8, dtype=np.uint8)[:, None],
                                 axis=1)
    return pack([hmask, _pack_2bit(np.where(high, L - 4, L)), sc, to_f16_bytes(d)], lead, x.shape[-1] // QK_K)


def _q45_k_scales(scales, mins):
    """Shared by Q4_K and Q5_K: 6-bit scales and mins of 8 sub-blocks, packed into 12 bytes; d, dmin."""
    n = len(scales)
    max_scale = np.maximum(scales.max(axis=1), F32(0))
    max_min = np.maximum(mins.max(axis=1), F32(0))
    ls = np.minimum(63, nearest_int(_inv_or_zero(63, max_scale)[:, None] * scales).astype(np.uint8))
    lm = np.minimum(63, nearest_int(_inv_or_zero(63, max_min)[:, None] * mins).astype(np.uint8))
    sc = np.empty((n, 12), np.uint8)
    sc[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    sc[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    sc[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    d = (max_scale / F32(63)).astype(F32)
    dmin = (max_min / F32(63)).astype(F32)
    dq = round_f16(d)[:, None] * ls.astype(F32)
    dm = round_f16(dmin)[:, None] * lm.astype(F32)
    return sc, d, dmin, dq, dm


def quantize_q4_k(x):
    b, lead = to_blocks(x, QK_K)
    scales, mins, L = _search_qkx2(b, 32, 15, F32(-1.0), F32(0.1), 20, False, True)
    sc, d, dmin, dq, dm = _q45_k_scales(scales, mins)
    L = _requant(L, b, dq, dm, 0, 15, 0).astype(np.uint8).reshape(len(b), 4, 2, 32)
    qs = (L[:, :, 0] | (L[:, :, 1] << 4)).reshape(len(b), 128)
    return pack([to_f16_bytes(d), to_f16_bytes(dmin), sc, qs], lead, x.shape[-1] // QK_K)


def quantize_q5_k(x):
    b, lead = to_blocks(x, QK_K)
    n = len(b)
    scales, mins, L = _search_qkx2(b, 32, 31, F32(-0.5), F32(0.1), 15, False, True)
    sc, d, dmin, dq, dm = _q45_k_scales(scales, mins)
    L = _requant(L, b, dq, dm, 0, 31, 0).astype(np.uint8).reshape(n, 4, 2, 32)
    qs = ((L[:, :, 0] & 0xF) | ((L[:, :, 1] & 0xF) << 4)).reshape(n, 128)
    hbits = (L >> 4).reshape(n, 8, 32) << np.arange(8, dtype=np.uint8)[:, None]   # bit 2c for L[64c+j], 2c+1 for +32
    qh = np.bitwise_or.reduce(hbits, axis=1)
    return pack([to_f16_bytes(d), to_f16_bytes(dmin), sc, qh, qs], lead, x.shape[-1] // QK_K)


def quantize_q6_k(x):
    b, lead = to_blocks(x, QK_K)
    scales, L = _search_q3(b, 32, False)
    return quantize_q6_k_from(b, lead, x.shape[-1], scales, L)


def quantize_q6_k_from(b, lead, k, scales, L):
    """Q6_K's blocks from the sub-block scales and levels of a search (with or without an importance matrix)."""
    n = len(b)
    max_scale = scales[np.arange(n), np.abs(scales).argmax(axis=1)]
    zero = np.abs(max_scale) < GROUP_MAX_EPS
    with np.errstate(divide="ignore"):
        iscale = np.where(zero, F32(0), F32(-128) / np.where(zero, F32(1), max_scale)).astype(F32)
        d = np.where(zero, F32(0), F32(1) / np.where(zero, F32(1), iscale)).astype(F32)
    sc = np.minimum(127, nearest_int(iscale[:, None] * scales)).astype(np.int8)
    dq = round_f16(d)[:, None] * sc.astype(F32)
    L = _requant(L, b, dq, None, -32, 31, 32).astype(np.uint8).reshape(n, 2, 4, 32)
    ql = np.concatenate([(L[:, :, 0] & 0xF) | ((L[:, :, 2] & 0xF) << 4),
                         (L[:, :, 1] & 0xF) | ((L[:, :, 3] & 0xF) << 4)], axis=2).reshape(n, 128)
    qh = np.bitwise_or.reduce((L >> 4) << np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1), axis=2)
    out = np.concatenate([ql, qh.reshape(n, 64), sc.view(np.uint8), to_f16_bytes(d)], axis=1)
    out[zero] = 0                                        # an all-zero super-block is all zero bytes
    return out.reshape(lead + (k // QK_K * 210,))


QUANT = {T.Q2_K: quantize_q2_k, T.Q3_K: quantize_q3_k, T.Q4_K: quantize_q4_k, T.Q5_K: quantize_q5_k,
         T.Q6_K: quantize_q6_k}
