"""Block formats (ggml-common.h): vectorised dequantize, and quantize with ggml's reference rounding.

``dequantize(data, t)`` takes the raw bytes (uint8, last axis whole blocks) and returns float32 with the last axis
in values. ``quantize(x, t)`` is the inverse for the types llama.cpp quantizes to, plus the activation dot types
Q8_0, Q8_1 and Q8_K that the CPU matmul rounds its inputs through.
"""
from __future__ import annotations

import numpy as np

from .types import GGMLType, QK_K, TYPE_TRAITS

T = GGMLType

KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


def _f16(b: np.ndarray) -> np.ndarray:
    """uint8 [..., 2] -> float32 [...]"""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _blocks(data: np.ndarray, t: GGMLType) -> tuple[np.ndarray, tuple]:
    tt = TYPE_TRAITS[t]
    data = np.asarray(data)
    if data.dtype != np.uint8:
        data = np.ascontiguousarray(data).view(np.uint8)
    if data.ndim == 0 or data.shape[-1] % tt.type_size:
        raise ValueError(f"{t.name}: last axis of {data.shape} is not whole blocks of {tt.type_size} bytes")
    lead = data.shape[:-1]
    nb = data.shape[-1] // tt.type_size
    return data.reshape(-1, tt.type_size), lead + (nb * tt.blck_size,)


# ------------------------------------------------------------------------------------------------ dequantize

def _dq_q4_0(b):
    d = _f16(b[:, 0:2])[:, None]
    qs = b[:, 2:18]
    q = np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.int8) - 8
    return d * q


def _dq_q4_1(b):
    d = _f16(b[:, 0:2])[:, None]
    m = _f16(b[:, 2:4])[:, None]
    qs = b[:, 4:20]
    q = np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.float32)
    return d * q + m


def _q5_bits(qh_bytes, qs):
    qh = np.ascontiguousarray(qh_bytes).view("<u4")[:, 0:1]
    j = np.arange(32, dtype=np.uint32)[None, :]
    hi = ((qh >> j) & 1).astype(np.uint8) << 4
    lo = np.concatenate([qs & 0xF, qs >> 4], axis=1)
    return lo | hi


def _dq_q5_0(b):
    d = _f16(b[:, 0:2])[:, None]
    q = _q5_bits(b[:, 2:6], b[:, 6:22]).astype(np.int8) - 16
    return d * q


def _dq_q5_1(b):
    d = _f16(b[:, 0:2])[:, None]
    m = _f16(b[:, 2:4])[:, None]
    q = _q5_bits(b[:, 4:8], b[:, 8:24]).astype(np.float32)
    return d * q + m


def _dq_q8_0(b):
    d = _f16(b[:, 0:2])[:, None]
    return d * b[:, 2:34].view(np.int8)


def _dq_q8_1(b):
    d = _f16(b[:, 0:2])[:, None]
    return d * b[:, 4:36].view(np.int8)


def _dq_q8_k(b):
    d = np.ascontiguousarray(b[:, 0:4]).view("<f4")
    return d * b[:, 4:260].view(np.int8)


def _dq_q2_k(b):
    n = len(b)
    scales = b[:, 0:16]
    qs = b[:, 16:80]
    d = _f16(b[:, 80:82])[:, None]
    dmin = _f16(b[:, 82:84])[:, None]
    dl = d * (scales & 0xF)          # [n, 16]
    ml = dmin * (scales >> 4)
    # element order: half h (0,1) x shift s (0..3) x group g (0,1) x l (0..15); q byte = qs[h*32 + g*16 + l]
    q = qs.reshape(n, 2, 1, 2, 16)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1, 1)
    v = ((q >> shifts) & 3).astype(np.float32)                   # [n, 2, 4, 2, 16]
    dl = dl.reshape(n, 2, 4, 2, 1)
    ml = ml.reshape(n, 2, 4, 2, 1)
    return (dl * v - ml).reshape(n, QK_K)


def _dq_q3_k(b):
    n = len(b)
    hmask = b[:, 0:32]
    qs = b[:, 32:96]
    sc = b[:, 96:108].astype(np.uint32)
    d = _f16(b[:, 108:110])[:, None]
    # unpack 16 6-bit scales (ggml's kmask1/kmask2 dance), minus 32
    aux = np.ascontiguousarray(sc.astype(np.uint8)).view("<u4")   # [n, 3]
    a0, a1, a2 = aux[:, 0], aux[:, 1], aux[:, 2]
    km1, km2 = np.uint32(0x03030303), np.uint32(0x0f0f0f0f)
    s = np.stack([(a0 & km2) | (((a2 >> 0) & km1) << 4),
                  (a1 & km2) | (((a2 >> 2) & km1) << 4),
                  ((a0 >> 4) & km2) | (((a2 >> 4) & km1) << 4),
                  ((a1 >> 4) & km2) | (((a2 >> 6) & km1) << 4)], axis=1)
    scales = np.ascontiguousarray(s).view(np.int8).reshape(n, 16).astype(np.float32) - 32
    # element order: half h x shift j (0..3) x group g (0,1) x l (0..15); hmask bit m = h*4 + j
    q = qs.reshape(n, 2, 1, 2, 16)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1, 1)
    low = ((q >> shifts) & 3).astype(np.int8)
    hm = hmask.reshape(n, 1, 1, 2, 16)
    bits = (np.arange(8, dtype=np.uint8).reshape(1, 2, 4, 1, 1))
    high = ((hm >> bits) & 1) == 0
    v = low - 4 * high.astype(np.int8)
    return (d.reshape(n, 1, 1, 1, 1) * scales.reshape(n, 2, 4, 2, 1) * v).reshape(n, QK_K)


def _scale_min_k4(sc: np.ndarray):
    """12 bytes -> 8 six-bit scales and 8 six-bit mins (get_scale_min_k4)."""
    sc = sc.astype(np.uint8)
    s = np.empty((len(sc), 8), np.uint8)
    m = np.empty((len(sc), 8), np.uint8)
    s[:, :4] = sc[:, 0:4] & 63
    m[:, :4] = sc[:, 4:8] & 63
    s[:, 4:] = (sc[:, 8:12] & 0xF) | ((sc[:, 0:4] >> 6) << 4)
    m[:, 4:] = (sc[:, 8:12] >> 4) | ((sc[:, 4:8] >> 6) << 4)
    return s.astype(np.float32), m.astype(np.float32)


def _dq_q4_k(b):
    n = len(b)
    d = _f16(b[:, 0:2])[:, None]
    dmin = _f16(b[:, 2:4])[:, None]
    s, m = _scale_min_k4(b[:, 4:16])
    qs = b[:, 16:144].reshape(n, 4, 1, 32)
    q = np.concatenate([qs & 0xF, qs >> 4], axis=2).reshape(n, 8, 32).astype(np.float32)
    return ((d * s)[:, :, None] * q - (dmin * m)[:, :, None]).reshape(n, QK_K)


def _dq_q5_k(b):
    n = len(b)
    d = _f16(b[:, 0:2])[:, None]
    dmin = _f16(b[:, 2:4])[:, None]
    s, m = _scale_min_k4(b[:, 4:16])
    qh = b[:, 16:48].reshape(n, 1, 32)
    qs = b[:, 48:176].reshape(n, 4, 1, 32)
    lo = np.concatenate([qs & 0xF, qs >> 4], axis=2).reshape(n, 8, 32)
    hi = ((qh >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1) << 4
    q = (lo | hi).astype(np.float32)
    return ((d * s)[:, :, None] * q - (dmin * m)[:, :, None]).reshape(n, QK_K)


def _dq_q6_k(b):
    n = len(b)
    ql = b[:, 0:128].reshape(n, 2, 2, 32)       # half, (l | l+32)
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    sc = b[:, 192:208].view(np.int8).astype(np.float32).reshape(n, 2, 8)
    d = _f16(b[:, 208:210]).reshape(n, 1, 1)
    # per half: y[l] q1 (ql[l] low, qh bits 0-1), y[l+32] q2 (ql[l+32] low, bits 2-3),
    #           y[l+64] q3 (ql[l] high, bits 4-5), y[l+96] q4 (ql[l+32] high, bits 6-7)
    q1 = (ql[:, :, 0] & 0xF) | (((qh[:, :, 0] >> 0) & 3) << 4)
    q2 = (ql[:, :, 1] & 0xF) | (((qh[:, :, 0] >> 2) & 3) << 4)
    q3 = (ql[:, :, 0] >> 4) | (((qh[:, :, 0] >> 4) & 3) << 4)
    q4 = (ql[:, :, 1] >> 4) | (((qh[:, :, 0] >> 6) & 3) << 4)
    q = np.stack([q1, q2, q3, q4], axis=2).astype(np.int8) - 32          # [n, 2, 4, 32]
    # scale index within a half: is = l // 16 + 2 * k for quarter k
    scale = sc.reshape(n, 2, 4, 2)                                        # [n, half, k, l//16]
    scale = np.repeat(scale, 16, axis=3)                                  # [n, 2, 4, 32]
    return (d[:, :, :, None] * scale * q).reshape(n, QK_K)


def _dq_iq4_nl(b):
    d = _f16(b[:, 0:2])[:, None]
    qs = b[:, 2:18]
    q = np.concatenate([qs & 0xF, qs >> 4], axis=1)
    return d * KVALUES_IQ4NL[q].astype(np.float32)


def _dq_iq4_xs(b):
    n = len(b)
    d = _f16(b[:, 0:2])[:, None]
    scales_h = np.ascontiguousarray(b[:, 2:4]).view("<u2")[:, 0].astype(np.int32)
    scales_l = b[:, 4:8]
    qs = b[:, 8:136].reshape(n, 8, 16)
    ib = np.arange(8)
    ls = ((scales_l[:, ib // 2] >> (4 * (ib % 2))) & 0xF).astype(np.int32) | (((scales_h[:, None] >> (2 * ib)) & 3) << 4)
    dl = d * (ls - 32).astype(np.float32)                                 # [n, 8]
    q = np.concatenate([qs & 0xF, qs >> 4], axis=2)                       # [n, 8, 32]
    return (dl[:, :, None] * KVALUES_IQ4NL[q].astype(np.float32)).reshape(n, QK_K)


def _dq_bf16(b):
    u = np.ascontiguousarray(b).view("<u2").astype(np.uint32) << 16
    return u.view(np.float32)


_DEQUANT = {
    T.Q4_0: _dq_q4_0, T.Q4_1: _dq_q4_1, T.Q5_0: _dq_q5_0, T.Q5_1: _dq_q5_1, T.Q8_0: _dq_q8_0, T.Q8_1: _dq_q8_1,
    T.Q2_K: _dq_q2_k, T.Q3_K: _dq_q3_k, T.Q4_K: _dq_q4_k, T.Q5_K: _dq_q5_k, T.Q6_K: _dq_q6_k, T.Q8_K: _dq_q8_k,
    T.IQ4_NL: _dq_iq4_nl, T.IQ4_XS: _dq_iq4_xs,
}

DEQUANTIZE_TYPES = frozenset(_DEQUANT) | {T.F32, T.F16, T.BF16, T.F64}


def dequantize(data: np.ndarray, t: GGMLType, ne0: int | None = None) -> np.ndarray:
    t = GGMLType(t)
    data = np.asarray(data)
    if t in (T.F32, T.F16, T.F64):
        dt = TYPE_TRAITS[t].dtype
        arr = data if data.dtype == dt else np.ascontiguousarray(data).view(dt)
        return arr.astype(np.float32)
    if t == T.BF16:
        arr = data if data.dtype == np.uint16 else np.ascontiguousarray(data).view(np.uint16)
        return (arr.astype(np.uint32) << 16).view(np.float32)
    fn = _DEQUANT.get(t)
    if fn is None:
        raise NotImplementedError(f"dequantizing {t.name} is not implemented")
    blocks, shape = _blocks(data, t)
    return fn(blocks).astype(np.float32, copy=False).reshape(shape)


# ------------------------------------------------------------------------------------------------ quantize

def _to_blocks(x: np.ndarray, blck: int) -> tuple[np.ndarray, tuple]:
    x = np.asarray(x, dtype=np.float32)
    if x.shape[-1] % blck:
        raise ValueError(f"row of {x.shape[-1]} values is not a whole number of blocks of {blck}")
    return x.reshape(-1, blck), x.shape[:-1]


def _pack(parts, lead, nblocks_per_row) -> np.ndarray:
    out = np.concatenate([np.ascontiguousarray(p).view(np.uint8).reshape(len(p), -1) for p in parts], axis=1)
    return out.reshape(lead + (nblocks_per_row * out.shape[1],))


def _q8_scale(x):
    amax = np.abs(x).max(axis=1)
    d = amax / 127.0
    with np.errstate(divide="ignore"):
        idv = np.where(d != 0, 1.0 / np.where(d != 0, d, 1), 0).astype(np.float32)
    return d.astype(np.float32), idv


def _roundf(v):
    """C roundf: halves away from zero."""
    return np.sign(v) * np.floor(np.abs(v) + 0.5)


def _q8_act(b):
    """Activation blocks of 32 as ggml's x86 quantize_row_q8_0/q8_1 (what llama.cpp's CPU backend runs on
    activations): d = amax/127 and id = 127/amax in float, rounded half to even."""
    amax = np.abs(b).max(axis=1)
    d = (amax / np.float32(127.0)).astype(np.float32)
    with np.errstate(divide="ignore"):
        idv = np.where(amax != 0, np.float32(127.0) / np.where(amax != 0, amax, 1), 0).astype(np.float32)
    q = np.rint(b * idv[:, None]).astype(np.int8)
    return d, q


def quantize_act_q8_0(x):
    b, lead = _to_blocks(x, 32)
    d, q = _q8_act(b)
    return _pack([d.astype(np.float16)[:, None], q], lead, x.shape[-1] // 32)


def quantize_act_q8_1(x):
    b, lead = _to_blocks(x, 32)
    d, q = _q8_act(b)
    s = (q.astype(np.int32).sum(axis=1).astype(np.float32) * d).astype(np.float16)
    return _pack([d.astype(np.float16)[:, None], s[:, None], q], lead, x.shape[-1] // 32)


def quantize_q8_0(x):
    """ggml's quantize_row_q8_0_ref (what llama-quantize writes): id = 1/d, roundf."""
    b, lead = _to_blocks(x, 32)
    d, idv = _q8_scale(b)
    q = _roundf(b * idv[:, None]).astype(np.int8)
    return _pack([d.astype(np.float16)[:, None], q], lead, x.shape[-1] // 32)


def quantize_q8_1(x):
    """ggml's quantize_row_q8_1_ref."""
    b, lead = _to_blocks(x, 32)
    d, idv = _q8_scale(b)
    q = _roundf(b * idv[:, None]).astype(np.int8)
    s = (q.astype(np.int32).sum(axis=1).astype(np.float32) * d).astype(np.float16)
    return _pack([d.astype(np.float16)[:, None], s[:, None], q], lead, x.shape[-1] // 32)


def quantize_act(x, t):
    """Activations rounded to a dot type as llama.cpp's x86 CPU backend does (Q8_K's is its reference)."""
    t = GGMLType(t)
    if t == T.Q8_0:
        return quantize_act_q8_0(x)
    if t == T.Q8_1:
        return quantize_act_q8_1(x)
    return quantize(x, t)


def _nearest_int(v):
    """ggml's nearest_int: round half to even (the 1.5*2^23 trick)."""
    return np.rint(v)


def quantize_q8_k(x):
    b, lead = _to_blocks(x, QK_K)
    n = len(b)
    idx = np.abs(b).argmax(axis=1)
    mx = b[np.arange(n), idx]
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.where(mx != 0, -127.0 / np.where(mx != 0, mx, 1), 0).astype(np.float32)
    q = np.minimum(127, _nearest_int(iscale[:, None] * b)).astype(np.int8)
    q[mx == 0] = 0
    with np.errstate(divide="ignore"):
        d = np.where(iscale != 0, 1.0 / np.where(iscale != 0, iscale, 1), 0).astype(np.float32)
    bsums = q.reshape(n, 16, 16).astype(np.int32).sum(axis=2).astype(np.int16)
    return _pack([d[:, None], q, bsums], lead, x.shape[-1] // QK_K)


def quantize_q4_0(x):
    b, lead = _to_blocks(x, 32)
    n = len(b)
    idx = np.abs(b).argmax(axis=1)
    mx = b[np.arange(n), idx]
    d = (mx / -8).astype(np.float32)
    with np.errstate(divide="ignore"):
        idv = np.where(d != 0, 1.0 / np.where(d != 0, d, 1), 0).astype(np.float32)
    q = np.minimum(15, np.trunc(b * idv[:, None] + 8.5)).astype(np.uint8)
    qs = q[:, :16] | (q[:, 16:] << 4)
    return _pack([d.astype(np.float16)[:, None], qs], lead, x.shape[-1] // 32)


def quantize_q4_1(x):
    b, lead = _to_blocks(x, 32)
    mn = b.min(axis=1)
    mx = b.max(axis=1)
    d = ((mx - mn) / 15).astype(np.float32)
    with np.errstate(divide="ignore"):
        idv = np.where(d != 0, 1.0 / np.where(d != 0, d, 1), 0).astype(np.float32)
    q = np.minimum(15, np.trunc((b - mn[:, None]) * idv[:, None] + 0.5)).astype(np.uint8)
    qs = q[:, :16] | (q[:, 16:] << 4)
    return _pack([d.astype(np.float16)[:, None], mn.astype(np.float16)[:, None], qs], lead, x.shape[-1] // 32)


def quantize_q5_0(x):
    b, lead = _to_blocks(x, 32)
    n = len(b)
    idx = np.abs(b).argmax(axis=1)
    mx = b[np.arange(n), idx]
    d = (mx / -16).astype(np.float32)
    with np.errstate(divide="ignore"):
        idv = np.where(d != 0, 1.0 / np.where(d != 0, d, 1), 0).astype(np.float32)
    q = np.minimum(31, np.trunc(b * idv[:, None] + 16.5)).astype(np.uint32)
    qs = ((q[:, :16] & 0xF) | ((q[:, 16:] & 0xF) << 4)).astype(np.uint8)
    qh = (((q >> 4) & 1) << np.arange(32, dtype=np.uint32)).sum(axis=1).astype("<u4")
    return _pack([d.astype(np.float16)[:, None], qh[:, None], qs], lead, x.shape[-1] // 32)


def quantize_f16(x):
    return np.asarray(x, np.float32).astype(np.float16).view(np.uint8)


def quantize_bf16(x):
    u = np.ascontiguousarray(np.asarray(x, np.float32)).view(np.uint32)
    # round to nearest even; NaN stays NaN (quiet)
    r = ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r[nan] = ((u[nan] >> 16) | 64).astype(np.uint16)
    return r.view(np.uint8)


_QUANT = {T.Q8_0: quantize_q8_0, T.Q8_1: quantize_q8_1, T.Q8_K: quantize_q8_k, T.Q4_0: quantize_q4_0,
          T.Q4_1: quantize_q4_1, T.Q5_0: quantize_q5_0, T.F16: quantize_f16, T.BF16: quantize_bf16}

QUANTIZE_TYPES = frozenset(_QUANT)


def quantize(x: np.ndarray, t: GGMLType) -> np.ndarray:
    t = GGMLType(t)
    fn = _QUANT.get(t)
    if fn is None:
        raise NotImplementedError(f"quantizing to {t.name} is not implemented")
    return fn(x)
