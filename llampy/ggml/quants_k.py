"""The k-quants (Q2_K..Q6_K): vectorised dequantize, and quantize as ggml's quantize_row_q*_K_ref.

The quantizers are sequential per super-block (a scale search per sub-block: make_qkx2_quants, make_q3_quants,
make_qx_quants; then the super-block scales, fp16 rounding, requantization and bit packing), so each is one Numba
kernel over blocks, in float32 and in ggml's operation order, writing the block bytes directly. The ``*_pack``
functions are the shared ends of ggml's _ref and importance-weighted _impl quantizers (quants_imatrix uses them).
"""
from __future__ import annotations

import numpy as np
from numba import prange

from .quants_base import F32, njit, f16, fp16_bits, fp16_value, to_blocks
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


QKX_LANES = 40     # make_qkx2/3_quants' at most 37 trial scales, padded to a multiple of the SIMD width


@njit(cache=True, nogil=True)
def make_qkx(x, w, nmax, rmin, rdelta, nstep, use_mad, L, acc):
    """make_qkx2_quants (and make_qkx3_quants, the same search): returns (scale, -min); L gets the levels 0..nmax.
    ``acc`` float32 [7, QKX_LANES] scratch.

    The trial scales run side by side, one SIMD lane each, every sum taken over i in ggml's order (so bit-identical
    to its sequential loops), and the trials are then taken in ggml's order. An accepted trial moves ``min``, which
    the later trials in ggml start from: those lanes are then run again from the new min. Levels are clamped as
    floats (iscale * (x - min) stays well inside +-2^22, where the rounded float is the int)."""
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
    if hi <= lo:
        for i in range(n):
            L[i] = 0
        return F32(0.0), -lo
    fn = F32(nmax)
    iscale = fn / (hi - lo)
    scale = F32(1.0) / iscale
    best = F32(0.0)
    for i in range(n):
        l = max(0, min(nmax, _nearest_int(iscale * (x[i] - lo))))
        L[i] = l
        diff = scale * F32(l) + lo - x[i]
        diff = abs(diff) if use_mad else diff * diff
        best += w[i] * diff
    if nstep < 1:
        return scale, -lo
    its = acc[0]
    sl = acc[1]
    sl2 = acc[2]
    sxl = acc[3]
    ts = acc[4]
    tm = acc[5]
    err = acc[6]
    best_is = F32(0.0)       # the accepted trial's iscale and the min it rounded against (its levels, at the end)
    best_lo = lo
    taken = False
    start = 0
    while start <= nstep:
        nl = (nstep + 1 - start + 7) // 8 * 8
        for k in range(nl):
            its[k] = (rmin + rdelta * F32(start + k) + fn) / (hi - lo) if start + k <= nstep else F32(0.0)
            sl[k] = F32(0.0)
            sl2[k] = F32(0.0)
            sxl[k] = F32(0.0)
            err[k] = F32(0.0)
        for i in range(n):
            xi = x[i]
            di = xi - lo
            wi = w[i]
            for k in range(nl):
                l = min(max((its[k] * di + F32(12582912.0)) - F32(12582912.0), F32(0.0)), fn)
                wl = wi * l
                sl[k] += wl
                sl2[k] += wl * l
                sxl[k] += wl * xi
        for k in range(nl):
            D = sum_w * sl2[k] - sl[k] * sl[k]
            this_scale = F32(0.0)
            this_min = F32(0.0)
            if D > 0:
                this_scale = (sum_w * sxl[k] - sum_x * sl[k]) / D
                this_min = (sl2[k] * sum_x - sl[k] * sxl[k]) / D
                if this_min > 0:
                    this_min = F32(0.0)
                    this_scale = sxl[k] / sl2[k]
            ts[k] = this_scale
            tm[k] = this_min
        for i in range(n):
            xi = x[i]
            di = xi - lo
            wi = w[i]
            for k in range(nl):
                l = min(max((its[k] * di + F32(12582912.0)) - F32(12582912.0), F32(0.0)), fn)
                diff = ts[k] * l + tm[k] - xi
                diff = abs(diff) if use_mad else diff * diff
                err[k] += wi * diff
        nxt = nstep + 1
        for k in range(nstep + 1 - start):
            if sum_w * sl2[k] - sl[k] * sl[k] > 0 and err[k] < best:
                best = err[k]
                scale = ts[k]
                best_is = its[k]
                best_lo = lo
                taken = True
                if tm[k] != lo:
                    lo = tm[k]
                    nxt = start + k + 1
                    break
        start = nxt
    if taken:
        for i in range(n):
            L[i] = max(0, min(nmax, _nearest_int(best_is * (x[i] - best_lo))))
    return scale, -lo


@njit(cache=True, nogil=True, error_model="numpy")      # IEEE division (x / 0 in lanes whose result is unused)
def make_q3_lanes(x, X, W, Lf, acc, L, scales):
    """make_q3_quants(16, 4, x + 16 j, L + 16 j, do_rmse) for the 16 sub-blocks j of a super-block x side by side:
    lane j holds sub-block j (X[i, j] = x[16 j + i]), so every step runs on 16 lanes (SIMD) and each lane does
    ggml's operations on its values in ggml's order (the same bits). The refinement passes run until no lane
    changes a level (at most 5): a pass that changes nothing in a lane leaves its state as it was, so the passes
    a lane runs after it stopped in ggml are no-ops. Levels are rounded and clamped as floats (exact: |v| < 2^22,
    ggml's nearest_int domain). L int8 [256] gets the levels 0..7 (0 for an all-zero sub-block), scales [16].
    Scratch: X, W, Lf float32 [16, 16], acc float32 [5, 16]."""
    sumlx = acc[0]
    suml2 = acc[1]
    amax = acc[2]
    mx = acc[3]
    isc = acc[4]
    for j in range(16):
        amax[j] = F32(0.0)
        mx[j] = F32(0.0)
        sumlx[j] = F32(0.0)
        suml2[j] = F32(0.0)
    for i in range(16):
        for j in range(16):
            v = x[16 * j + i]
            X[i, j] = v
            W[i, j] = v * v
    for i in range(16):
        for j in range(16):
            v = X[i, j]
            a = abs(v)
            gt = a > amax[j]
            mx[j] = v if gt else mx[j]
            amax[j] = a if gt else amax[j]
    for j in range(16):
        isc[j] = F32(-4.0) / mx[j]
    for i in range(16):
        for j in range(16):
            r = (isc[j] * X[i, j] + F32(12582912.0)) - F32(12582912.0)
            r = F32(-4.0) if r < F32(-4.0) else r
            r = F32(3.0) if r > F32(3.0) else r
            Lf[i, j] = r
            w = W[i, j]
            sumlx[j] += w * X[i, j] * r
            suml2[j] += w * r * r
    for _ in range(5):
        changed = 0
        for i in range(16):
            for j in range(16):
                w = W[i, j]
                v = X[i, j]
                li = Lf[i, j]
                sx = sumlx[j]
                s2 = suml2[j]
                slx = sx - w * v * li
                sl2 = s2 - w * li * li
                r = (v * sl2 / slx + F32(12582912.0)) - F32(12582912.0)
                r = F32(-4.0) if r < F32(-4.0) else r
                r = F32(3.0) if r > F32(3.0) else r
                nslx = slx + w * v * r
                nsl2 = sl2 + w * r * r
                take = (slx > 0) & (r != li) & (nsl2 > 0) & (nslx * nslx * s2 > sx * sx * nsl2)
                Lf[i, j] = r if take else li
                sumlx[j] = nslx if take else sx
                suml2[j] = nsl2 if take else s2
                changed += np.int32(take)
        if changed == 0:
            break
    for j in range(16):
        zero = amax[j] < GROUP_MAX_EPS
        scales[j] = F32(0.0) if zero or not suml2[j] > 0 else sumlx[j] / suml2[j]
        for i in range(16):
            L[16 * j + i] = 0 if zero else np.int8(Lf[i, j]) + 4


QX_STEPS = 24      # make_qx_quants' 19 trial scales, padded to a multiple of the SIMD width


@njit(cache=True, nogil=True)
def make_qx(x, w, nmax, L, acc):
    """make_qx_quants(n, nmax, x, L, rmse_type 1, qw) with the weights given (x*x for qw NULL): returns the scale;
    L gets the levels 0..2*nmax-1. ``acc`` float32 [3, QX_STEPS] scratch.

    The 19 trial scales' sums run side by side, one lane per trial (SIMD), each summed over i in ggml's order,
    so every sum is bit-identical to ggml's sequential loop; the trials are then taken in ggml's order. The
    levels are clamped as floats: iscale * x stays well inside +-2^22, where the rounded float is the int."""
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
    fn = F32(nmax)
    its = acc[0]
    sx = acc[1]
    s2 = acc[2]
    its[0] = -fn / mx
    for k in range(1, 19):
        step = k - 10 if k < 10 else k - 9                       # -9..-1, 1..9
        its[k] = -(fn + F32(0.1) * F32(step)) / mx
    for k in range(QX_STEPS):
        if k >= 19:
            its[k] = F32(0.0)
        sx[k] = F32(0.0)
        s2[k] = F32(0.0)
    lo = -fn
    hi = fn - F32(1.0)
    for i in range(n):
        xi = x[i]
        wi = w[i]
        wx = wi * xi                                             # ggml's w*x[i]*l is (w*x[i])*l
        for k in range(QX_STEPS):
            r = (its[k] * xi + F32(12582912.0)) - F32(12582912.0)
            l = min(max(r, lo), hi)
            sx[k] += wx * l
            s2[k] += wi * l * l
    scale = sx[0] / s2[0] if s2[0] != 0 else F32(0.0)
    best = scale * sx[0]
    kb = 0
    for k in range(1, 19):
        if s2[k] > 0 and sx[k] * sx[k] > best * s2[k]:
            scale = sx[k] / s2[k]
            best = scale * sx[k]
            kb = k
    for i in range(n):
        L[i] = nmax + max(-nmax, min(nmax - 1, _nearest_int(its[kb] * x[i])))
    return scale


# ------------------------------------------------------------------------------------------------ quantize
# One kernel per type: prange over chunks of CHUNK super-blocks (each chunk with its row of the scratch arrays).
# ``b`` [n, 256] float32 blocks, ``out`` [n, type_size] uint8; a block's bytes are written in its struct's order.

CHUNK = 16


@njit(cache=True, nogil=True, inline="always")
def _put_f16(o, at, v):
    """o[at:at+2] = GGML_FP32_TO_FP16(v); returns GGML_FP16_TO_FP32 of it."""
    h = fp16_bits(v)
    o[at] = h & 0xFF
    o[at + 1] = h >> 8
    return fp16_value(h)


@njit(cache=True, nogil=True, inline="always")
def _pack_2bit(L, o, at):
    """byte 32h + l holds L[128h + l + 32s] at bits 2s (Q2_K's and Q3_K's qs)."""
    for h in range(2):
        for l in range(32):
            j = 128 * h + l
            o[at + 32 * h + l] = L[j] | (L[j + 32] << 2) | (L[j + 64] << 4) | (L[j + 96] << 6)


@njit(cache=True, nogil=True)
def q2_k_pack(x, sc, d, dmin, L, o):
    """block_q2_K {scales[16], qs[64], d, dmin} from the 16 packed scale|min<<4 bytes, d, dmin and the searched
    levels (requantized where the sub-block scale is non-zero)."""
    for j in range(16):
        o[j] = sc[j]
    dq = _put_f16(o, 80, d)
    mq = _put_f16(o, 82, dmin)
    for j in range(16):
        dj = dq * F32(sc[j] & 0xF)
        if dj == 0:
            continue
        mj = mq * F32(sc[j] >> 4)
        for l in range(16):
            L[16 * j + l] = max(0, min(3, _nearest_int((x[16 * j + l] + mj) / dj)))
    _pack_2bit(L, o, 16)


@njit(cache=True, parallel=True, nogil=True)
def _q2_k_rows(b, out, sw, sacc, sL, sscales, smins, ssc):
    n = b.shape[0]
    for c in prange((n + CHUNK - 1) // CHUNK):
        w, acc, L, scales, mins, sc = sw[c], sacc[c], sL[c], sscales[c], smins[c], ssc[c]
        for i in range(c * CHUNK, min(n, c * CHUNK + CHUNK)):
            x = b[i]
            max_scale = F32(0.0)
            max_min = F32(0.0)
            for j in range(16):
                for l in range(16):
                    w[l] = abs(x[16 * j + l])
                s, m = make_qkx(x[16 * j:16 * j + 16], w, 3, F32(-0.5), F32(0.1), 15, True,
                                L[16 * j:16 * j + 16], acc)
                scales[j] = s
                mins[j] = m
                max_scale = max(max_scale, s)
                max_min = max(max_min, m)
            d = F32(0.0)
            for j in range(16):
                sc[j] = 0
            if max_scale > 0:
                iscale = F32(15.0) / max_scale
                for j in range(16):
                    sc[j] = _nearest_int(iscale * scales[j]) & 0xFF
                d = max_scale / F32(15.0)
            dmin = F32(0.0)
            if max_min > 0:
                iscale = F32(15.0) / max_min
                for j in range(16):
                    sc[j] |= (_nearest_int(iscale * mins[j]) << 4) & 0xFF
                dmin = max_min / F32(15.0)
            q2_k_pack(x, sc, d, dmin, L, out[i])


@njit(cache=True, nogil=True, error_model="numpy")      # no zero check on x / dj (dj != 0 there): SIMD
def q3_k_pack(x, ls, d, L, o):
    """block_q3_K {hmask[32], qs[64], scales[12], d} from the 16 six-bit scales (0..63, 32 is zero), d and the
    searched levels 0..7 (requantized where the sub-block scale is non-zero)."""
    for j in range(12):
        o[96 + j] = 0
    for j in range(16):
        l = ls[j]
        if j < 8:
            o[96 + j] = l & 0xF
        else:
            o[96 + j - 8] |= (l & 0xF) << 4
        o[104 + j % 4] |= (l >> 4) << (2 * (j // 4))
    dq = _put_f16(o, 108, d)
    for j in range(16):
        dj = dq * F32(np.int32(ls[j]) - 32)
        if dj == 0:
            continue
        for l in range(16):
            # nearest_int and the clamp as floats (exact inside nearest_int's domain, |v| < 2^22): SIMD
            r = (x[16 * j + l] / dj + F32(12582912.0)) - F32(12582912.0)
            L[16 * j + l] = np.int8(min(max(r, F32(-4.0)), F32(3.0)) + F32(4.0))
    # the high bit of value j goes to hmask[j % 32], bit j // 32
    for m in range(32):
        h = 0
        for s in range(8):
            v = L[32 * s + m]
            h |= (v >> 2) << s
            L[32 * s + m] = v & 3
        o[m] = h
    _pack_2bit(L, o, 32)


@njit(cache=True, parallel=True, nogil=True)
def _q3_k_rows(b, out, sL, sscales, sls, sX, sW, sLf, sacc):
    n = b.shape[0]
    for c in prange((n + CHUNK - 1) // CHUNK):
        L, scales, ls, X, W, Lf, acc = sL[c], sscales[c], sls[c], sX[c], sW[c], sLf[c], sacc[c]
        for i in range(c * CHUNK, min(n, c * CHUNK + CHUNK)):
            x = b[i]
            make_q3_lanes(x, X, W, Lf, acc, L, scales)
            max_scale = F32(0.0)
            amax = F32(0.0)
            for j in range(16):
                s = scales[j]
                if abs(s) > amax:
                    amax = abs(s)
                    max_scale = s
            d = F32(0.0)
            for j in range(16):
                ls[j] = 0
            if max_scale != 0:
                iscale = F32(-32.0) / max_scale
                for j in range(16):
                    l = np.int8(_nearest_int(iscale * scales[j]) & 0xFF)     # ggml stores it in an int8_t first
                    ls[j] = max(-32, min(31, np.int32(l))) + 32
                d = F32(1.0) / iscale
            q3_k_pack(x, ls, d, L, out[i])


@njit(cache=True, nogil=True)
def q45_k_pack(x, ls, lm, d, dmin, L, o, nmax):
    """block_q4_K {d, dmin, scales[12], qs[128]} (nmax 15) or block_q5_K {d, dmin, scales[12], qh[32], qs[128]}
    (nmax 31) from the 8 six-bit scales and mins, d, dmin and the searched levels."""
    for j in range(4):
        o[4 + j] = ls[j]
        o[8 + j] = lm[j]
    for j in range(4, 8):
        o[8 + j] = (ls[j] & 0xF) | ((lm[j] & 0xF) << 4)
        o[j] |= (ls[j] >> 4) << 6
        o[4 + j] |= (lm[j] >> 4) << 6
    dq = _put_f16(o, 0, d)
    mq = _put_f16(o, 2, dmin)
    for j in range(8):
        dj = dq * F32(ls[j])
        if dj == 0:
            continue
        mj = mq * F32(lm[j])
        for l in range(32):
            L[32 * j + l] = max(0, min(nmax, _nearest_int((x[32 * j + l] + mj) / dj)))
    if nmax == 15:
        for c in range(4):
            for l in range(32):
                o[16 + 32 * c + l] = L[64 * c + l] | (L[64 * c + 32 + l] << 4)
    else:
        # qh bit 2c for L[64c + l], bit 2c+1 for L[64c + 32 + l]
        for l in range(32):
            o[16 + l] = 0
        for c in range(4):
            for l in range(32):
                l1 = L[64 * c + l]
                l2 = L[64 * c + 32 + l]
                o[16 + l] |= ((l1 >> 4) << (2 * c)) | ((l2 >> 4) << (2 * c + 1))
                o[48 + 32 * c + l] = (l1 & 0xF) | ((l2 & 0xF) << 4)


@njit(cache=True, parallel=True, nogil=True)
def _q45_k_rows(b, out, sw, sacc, sL, sscales, smins, sls, slm, nmax, rmin, nstep):
    n = b.shape[0]
    for c in prange((n + CHUNK - 1) // CHUNK):
        w, acc, L, scales, mins, ls, lm = sw[c], sacc[c], sL[c], sscales[c], smins[c], sls[c], slm[c]
        for i in range(c * CHUNK, min(n, c * CHUNK + CHUNK)):
            x = b[i]
            max_scale = F32(0.0)
            max_min = F32(0.0)
            for j in range(8):
                xj = x[32 * j:32 * j + 32]
                sum_x2 = F32(0.0)
                for l in range(32):
                    sum_x2 += xj[l] * xj[l]
                av_x = F32(np.sqrt(sum_x2 / F32(32.0)))
                for l in range(32):
                    w[l] = av_x + abs(xj[l])
                s, m = make_qkx(xj, w, nmax, rmin, F32(0.1), nstep, False, L[32 * j:32 * j + 32], acc)
                scales[j] = s
                mins[j] = m
                max_scale = max(max_scale, s)
                max_min = max(max_min, m)
            inv_scale = F32(63.0) / max_scale if max_scale > 0 else F32(0.0)
            inv_min = F32(63.0) / max_min if max_min > 0 else F32(0.0)
            for j in range(8):
                ls[j] = min(63, _nearest_int(inv_scale * scales[j]) & 0xFF)
                lm[j] = min(63, _nearest_int(inv_min * mins[j]) & 0xFF)
            q45_k_pack(x, ls, lm, max_scale / F32(63.0), max_min / F32(63.0), L, out[i], nmax)


@njit(cache=True, nogil=True)
def q6_k_pack(x, scales, L, o):
    """block_q6_K {ql[128], qh[64], scales[16], d} from the 16 sub-block scales and the searched levels 0..63: the
    shared end of quantize_row_q6_K_ref and _impl."""
    max_scale = F32(0.0)
    max_abs = F32(0.0)
    for j in range(16):
        if abs(scales[j]) > max_abs:
            max_abs = abs(scales[j])
            max_scale = scales[j]
    if max_abs < GROUP_MAX_EPS:                          # an all-zero block
        for j in range(210):
            o[j] = 0
        return
    iscale = F32(-128.0) / max_scale
    dq = _put_f16(o, 208, F32(1.0) / iscale)
    for j in range(16):
        sc = min(127, _nearest_int(iscale * scales[j]))
        o[192 + j] = sc & 0xFF
        dj = dq * F32(sc)
        if dj == 0:
            continue
        for l in range(16):
            L[16 * j + l] = max(-32, min(31, _nearest_int(x[16 * j + l] / dj))) + 32
    # per half h: ql[64h + l] = L[l] | L[l+64] << 4, ql[64h + 32 + l] = L[l+32] | L[l+96] << 4 (low nibbles);
    # qh[32h + l] the four high bit pairs
    for h in range(2):
        for l in range(32):
            j = 128 * h + l
            q1 = L[j]
            q2 = L[j + 32]
            q3 = L[j + 64]
            q4 = L[j + 96]
            o[64 * h + l] = (q1 & 0xF) | ((q3 & 0xF) << 4)
            o[64 * h + 32 + l] = (q2 & 0xF) | ((q4 & 0xF) << 4)
            o[128 + 32 * h + l] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6)


@njit(cache=True, parallel=True, nogil=True)
def _q6_k_rows(b, out, sL, sscales, sw, sacc):
    n = b.shape[0]
    for c in prange((n + CHUNK - 1) // CHUNK):
        L, scales, w, acc = sL[c], sscales[c], sw[c], sacc[c]
        for i in range(c * CHUNK, min(n, c * CHUNK + CHUNK)):
            for j in range(16):
                xj = b[i, 16 * j:16 * j + 16]
                for l in range(16):
                    w[l] = xj[l] * xj[l]
                scales[j] = make_qx(xj, w, 32, L[16 * j:16 * j + 16], acc)
            q6_k_pack(b[i], scales, L, out[i])


# each kernel's scratch, one row per chunk of CHUNK blocks (shape after the chunk's index, dtype): made here rather
# than by np.empty in the kernels, whose cached code then rebuilds no environment of numba.np.arrayobj when it loads
# (that import, with charseq and unicode, was ~20-35 ms of a quantize run's first k-quant kernel)
_SCRATCH_Q2 = (((16,), F32), ((7, QKX_LANES), F32), ((QK_K,), np.uint8), ((16,), F32), ((16,), F32),
               ((16,), np.uint8))
_SCRATCH_Q3 = (((QK_K,), np.int8), ((16,), F32), ((16,), np.uint8), ((16, 16), F32), ((16, 16), F32),
               ((16, 16), F32), ((5, 16), F32))
_SCRATCH_Q45 = (((32,), F32), ((7, QKX_LANES), F32), ((QK_K,), np.uint8), ((8,), F32), ((8,), F32),
                ((8,), np.uint8), ((8,), np.uint8))
_SCRATCH_Q6 = (((QK_K,), np.int8), ((16,), F32), ((16,), F32), ((3, QX_STEPS), F32))


def _run(kernel, x, type_size, scratch, *args):
    b, lead = to_blocks(x, QK_K)
    out = np.empty((len(b), type_size), np.uint8)
    nch = (len(b) + CHUNK - 1) // CHUNK
    kernel(b, out, *(np.empty((nch,) + shape, dt) for shape, dt in scratch), *args)
    return out.reshape(lead + (x.shape[-1] // QK_K * type_size,))


def quantize_q2_k(x):
    return _run(_q2_k_rows, x, 84, _SCRATCH_Q2)


def quantize_q3_k(x):
    return _run(_q3_k_rows, x, 110, _SCRATCH_Q3)


def quantize_q4_k(x):
    return _run(_q45_k_rows, x, 144, _SCRATCH_Q45, 15, F32(-1.0), 20)


def quantize_q5_k(x):
    return _run(_q45_k_rows, x, 176, _SCRATCH_Q45, 31, F32(-0.5), 15)


def quantize_q6_k(x):
    return _run(_q6_k_rows, x, 210, _SCRATCH_Q6)


QUANT = {T.Q2_K: quantize_q2_k, T.Q3_K: quantize_q3_k, T.Q4_K: quantize_q4_k, T.Q5_K: quantize_q5_k,
         T.Q6_K: quantize_q6_k}
