"""Block formats (ggml-common.h): vectorised dequantize, and quantize with ggml's reference rounding.

``dequantize(data, t)`` takes the raw bytes (uint8, last axis whole blocks; plain types also as typed arrays) and
returns float32 with the last axis in values. ``quantize(x, t)`` is the inverse for the types llama-quantize
writes, with exactly its rounding (ggml-quants.c, no importance matrix), plus the activation dot types Q8_1 and
Q8_K. ``quantize_act`` rounds activations the way llama.cpp's x86 CPU backend does before a quantized dot product.

This module holds the public entry, the plain types and the 32-value formats; the k-quants live in
``quants_k``, the IQ/ternary/FP4 formats in ``quants_iq``, their tables in ``quants_tables``.
"""
from __future__ import annotations

import numpy as np

from . import quants_iq as iq
from . import quants_k as kq
from .quants_base import (F32, f16, nibbles, pack, roundf, safe_inv, signed_absmax, split_blocks,
                          to_blocks, to_f16_bytes)
from .quants_np import quantize_bf16, quantize_f16
from .quants_tables import kvalues_iq4nl
from .types import GGMLType, QK_K, TYPE_TRAITS

T = GGMLType

KVALUES_IQ4NL = kvalues_iq4nl  # kept under its old name for callers


# ------------------------------------------------------------------------------------------------ dequantize

# The hot formats scale in place: a model's worth of float32 temporaries costs more than the arithmetic.

def _dq_q4_0(b):
    q = (nibbles(b[:, 2:18]).astype(np.int8) - 8).astype(F32)
    q *= f16(b[:, 0:2])[:, None]
    return q


def _dq_q4_1(b):
    q = nibbles(b[:, 4:20]).astype(F32)
    q *= f16(b[:, 0:2])[:, None]
    q += f16(b[:, 2:4])[:, None]
    return q


def _q5_bits(qh_bytes, qs):
    qh = np.ascontiguousarray(qh_bytes).view("<u4")[:, 0:1]
    hi = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4
    return nibbles(qs) | hi


def _dq_q5_0(b):
    q = (_q5_bits(b[:, 2:6], b[:, 6:22]).astype(np.int8) - 16).astype(F32)
    q *= f16(b[:, 0:2])[:, None]
    return q


def _dq_q5_1(b):
    q = _q5_bits(b[:, 4:8], b[:, 8:24]).astype(F32)
    q *= f16(b[:, 0:2])[:, None]
    q += f16(b[:, 2:4])[:, None]
    return q


def _dq_q8_0(b):
    q = b[:, 2:34].view(np.int8).astype(F32)
    q *= f16(b[:, 0:2])[:, None]
    return q


def _dq_q8_1(b):
    return f16(b[:, 0:2])[:, None] * b[:, 4:36].view(np.int8).astype(F32)


def _dq_q8_k(b):
    return np.ascontiguousarray(b[:, 0:4]).view("<f4") * b[:, 4:260].view(np.int8).astype(F32)


def _dq_q1_0(b):
    d = f16(b[:, 0:2])[:, None]
    bits = np.unpackbits(b[:, 2:18], axis=1, bitorder="little").astype(bool)
    return np.where(bits, d, -d)


def _dq_q2_0(b):
    q = (b[:, 2:18, None] >> np.array([0, 2, 4, 6], np.uint8)) & 3          # [n, 16, 4]: value j = byte j//4
    return (q.reshape(len(b), 64).astype(np.int8) - 1).astype(F32) * f16(b[:, 0:2])[:, None]


_DEQUANT = {
    T.Q4_0: _dq_q4_0, T.Q4_1: _dq_q4_1, T.Q5_0: _dq_q5_0, T.Q5_1: _dq_q5_1, T.Q8_0: _dq_q8_0, T.Q8_1: _dq_q8_1,
    T.Q8_K: _dq_q8_k, T.Q1_0: _dq_q1_0, T.Q2_0: _dq_q2_0, **kq.DEQUANT, **iq.DEQUANT,
}

_PLAIN = (T.F32, T.F16, T.BF16, T.F64, T.I8, T.I16, T.I32, T.I64)

DEQUANTIZE_TYPES = frozenset(_DEQUANT) | frozenset(_PLAIN)


def _dequantize_plain(data: np.ndarray, t: GGMLType) -> np.ndarray:
    dt = TYPE_TRAITS[t].dtype.newbyteorder("<")             # BF16: its raw uint16 bits
    if data.dtype == np.uint8:
        data = np.ascontiguousarray(data)
        data = data.view(dt) if data.ndim else data.reshape(1).view(dt)
    elif t == T.BF16 and data.dtype == np.int16:
        data = data.view(np.uint16)
    elif data.dtype != dt:
        raise TypeError(f"{t.name}: expected raw bytes or {dt} values, got {data.dtype}")
    if t == T.BF16:
        return (data.astype(np.uint32) << 16).view(F32)
    return data.astype(F32)


def dequantize(data: np.ndarray, t: GGMLType, ne0: int | None = None) -> np.ndarray:
    """data: [..., row bytes] (or 1-D) of type t -> float32 [..., row values].

    With ``ne0`` (values per row), the result's last axis is ``ne0``: 1-D data of several rows comes back as
    [nrows, ne0]; otherwise ``ne0`` must equal the values per row of the last axis.
    """
    t = GGMLType(t)
    data = np.asarray(data)
    if t in _PLAIN:
        out = _dequantize_plain(data, t)
    else:
        fn = _DEQUANT.get(t)
        if fn is None:
            raise NotImplementedError(f"dequantizing {t.name} is not implemented")
        blocks, shape = split_blocks(data, t)
        with np.errstate(over="ignore", invalid="ignore"):   # random bytes may hold inf/nan scales, as in ggml
            out = fn(blocks).astype(F32, copy=False).reshape(shape)
    if ne0 is not None and out.shape[-1] != ne0:
        if out.ndim != 1 or out.shape[0] % ne0:
            raise ValueError(f"{t.name}: {out.shape[-1]} values per row, not {ne0}")
        out = out.reshape(-1, ne0)
    return out


# ------------------------------------------------------------------------------------------------ quantize
# Each mirrors quantize_row_<type>_ref (ggml-quants.c), which is what llama-quantize runs with no imatrix.

def _trunc_u8(v):
    """C ``(int8_t)(float)`` then used as uint8 (the values are small and non-negative here)."""
    return np.trunc(v).astype(np.int32).astype(np.uint8)


def quantize_q4_0(x):
    b, lead = to_blocks(x, 32)
    d = signed_absmax(b) / F32(-8)
    q = np.minimum(15, _trunc_u8(b * safe_inv(d)[:, None] + F32(8.5)))
    return pack([to_f16_bytes(d), q[:, :16] | (q[:, 16:] << 4)], lead, x.shape[-1] // 32)


def quantize_q4_1(x):
    b, lead = to_blocks(x, 32)
    mn, mx = b.min(axis=1), b.max(axis=1)
    d = (mx - mn) / F32(15)
    q = np.minimum(15, _trunc_u8((b - mn[:, None]) * safe_inv(d)[:, None] + F32(0.5)))
    return pack([to_f16_bytes(d), to_f16_bytes(mn), q[:, :16] | (q[:, 16:] << 4)], lead, x.shape[-1] // 32)


def _q5_pack(q):
    qs = (q[:, :16] & 0xF) | ((q[:, 16:] & 0xF) << 4)
    qh = np.packbits((q >> 4) & 1, axis=1, bitorder="little")                   # [n, 4] = little-endian uint32
    return qh, qs


def quantize_q5_0(x):
    b, lead = to_blocks(x, 32)
    d = signed_absmax(b) / F32(-16)
    q = np.minimum(31, _trunc_u8(b * safe_inv(d)[:, None] + F32(16.5)))
    qh, qs = _q5_pack(q)
    return pack([to_f16_bytes(d), qh, qs], lead, x.shape[-1] // 32)


def quantize_q5_1(x):
    b, lead = to_blocks(x, 32)
    mn, mx = b.min(axis=1), b.max(axis=1)
    d = (mx - mn) / F32(31)
    q = _trunc_u8((b - mn[:, None]) * safe_inv(d)[:, None] + F32(0.5))        # no clamp in ggml: bits are masked
    qh, qs = _q5_pack(q)
    return pack([to_f16_bytes(d), to_f16_bytes(mn), qh, qs], lead, x.shape[-1] // 32)


def _q8_ref(b):
    d = np.abs(b).max(axis=1) / F32(127)
    q = roundf(b * safe_inv(d)[:, None]).astype(np.int8)
    return d, q


def quantize_q8_0(x):
    """quantize_row_q8_0_ref: d = amax/127, id = 1/d, roundf."""
    b, lead = to_blocks(x, 32)
    d, q = _q8_ref(b)
    return pack([to_f16_bytes(d), q], lead, x.shape[-1] // 32)


def quantize_q8_1(x):
    """quantize_row_q8_1_ref: as Q8_0, plus s = fp16(sum(q) * d)."""
    b, lead = to_blocks(x, 32)
    d, q = _q8_ref(b)
    s = q.astype(np.int32).sum(axis=1).astype(F32) * d
    return pack([to_f16_bytes(d), to_f16_bytes(s), q], lead, x.shape[-1] // 32)


def quantize_q8_k(x):
    """quantize_row_q8_K_ref: float32 d = 1/iscale with iscale = -127/max (max: signed value of largest |x|),
    q = min(127, nearest_int(iscale*x)), bsums = sums of 16. An all-zero block is all zeros (ggml leaves its bsums
    as they were; we write 0)."""
    b, lead = to_blocks(x, QK_K)
    mx = signed_absmax(b)
    zero = mx == 0
    with np.errstate(divide="ignore"):
        iscale = np.where(zero, F32(0), F32(-127) / np.where(zero, F32(1), mx)).astype(F32)
    q = np.minimum(127, np.rint(iscale[:, None] * b)).astype(np.int8)
    d = np.where(zero, F32(0), F32(1) / np.where(zero, F32(1), iscale)).astype(F32)
    bsums = q.reshape(len(b), 16, 16).astype(np.int32).sum(axis=2).astype("<i2")
    return pack([d.astype("<f4"), q, bsums], lead, x.shape[-1] // QK_K)


def quantize_q1_0(x):
    """quantize_row_q1_0_ref: d = mean |x| (summed in order), one sign bit per value (1 for x >= 0)."""
    b, lead = to_blocks(x, 128)
    s = np.zeros(len(b), F32)
    for j in range(128):                      # sequential float32 sum, as the C loop (128 vector steps)
        s += np.abs(b[:, j])
    d = s / F32(128)
    qs = np.packbits(b >= 0, axis=1, bitorder="little")
    return pack([to_f16_bytes(d), qs], lead, x.shape[-1] // 128)


def quantize_q2_0(x):
    """quantize_row_q2_0_ref: d = amax, q = clamp(roundf(x/d) + 1, 0, 3), 4 per byte from the low bits."""
    b, lead = to_blocks(x, 64)
    d = np.abs(b).max(axis=1)
    q = np.clip(roundf(b * safe_inv(d)[:, None]) + 1, 0, 3).astype(np.uint8).reshape(len(b), 16, 4)
    qs = q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)
    return pack([to_f16_bytes(d), qs], lead, x.shape[-1] // 64)


_QUANT = {
    T.F16: quantize_f16, T.BF16: quantize_bf16,
    T.Q4_0: quantize_q4_0, T.Q4_1: quantize_q4_1, T.Q5_0: quantize_q5_0, T.Q5_1: quantize_q5_1,
    T.Q8_0: quantize_q8_0, T.Q8_1: quantize_q8_1, T.Q8_K: quantize_q8_k,
    T.Q1_0: quantize_q1_0, T.Q2_0: quantize_q2_0,
    **kq.QUANT, **iq.QUANT,
}

QUANTIZE_TYPES = frozenset(_QUANT)


def quantize(x: np.ndarray, t: GGMLType) -> np.ndarray:
    """x: float32 [..., k], k whole blocks -> uint8 [..., k // blck * type_size], as llama-quantize writes it."""
    t = GGMLType(t)
    fn = _QUANT.get(t)
    if fn is None:
        from .quants_iq_search import SEARCH_TYPES, quantize_iq
        if t in SEARCH_TYPES:       # the grid searches (slow; not in QUANTIZE_TYPES): IQ2_XXS/XS, IQ1_S refuse
            x = np.asarray(x, F32)
            return quantize_iq(x.reshape(-1, x.shape[-1]), t).reshape(x.shape[:-1] + (-1,))
        raise NotImplementedError(f"quantizing to {t.name} is not implemented")
    x = np.asarray(x, F32)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        return fn(x)


# ------------------------------------------------------------------------------------------------ activations

def _q8_act(b):
    """Activation blocks of 32 as ggml's x86 quantize_row_q8_0/q8_1 (what llama.cpp's CPU backend runs on
    activations): d = amax/127 and id = 127/amax in float, rounded half to even."""
    amax = np.abs(b).max(axis=1)
    d = (amax / F32(127)).astype(F32)
    with np.errstate(divide="ignore"):
        idv = np.where(amax != 0, F32(127) / np.where(amax != 0, amax, F32(1)), F32(0)).astype(F32)
    q = np.rint(b * idv[:, None]).astype(np.int8)
    return d, q


def quantize_act_q8_0(x):
    b, lead = to_blocks(x, 32)
    d, q = _q8_act(b)
    return pack([to_f16_bytes(d), q], lead, x.shape[-1] // 32)


def quantize_act_q8_1(x):
    b, lead = to_blocks(x, 32)
    d, q = _q8_act(b)
    s = q.astype(np.int32).sum(axis=1).astype(F32) * d
    return pack([to_f16_bytes(d), to_f16_bytes(s), q], lead, x.shape[-1] // 32)


def quantize_act(x, t):
    """Activations rounded to a dot type as llama.cpp's x86 CPU backend does (Q8_K's is its reference)."""
    t = GGMLType(t)
    if t == T.Q8_0:
        return quantize_act_q8_0(x)
    if t == T.Q8_1:
        return quantize_act_q8_1(x)
    return quantize(x, t)


__all__ = ["dequantize", "quantize", "quantize_act", "DEQUANTIZE_TYPES", "QUANTIZE_TYPES"]
