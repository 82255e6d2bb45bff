"""Helpers shared by the block-format modules: splitting bytes into blocks, fp16 fields, packing, rounding.

Every float computation in the quants modules is done in float32, in the order ggml's C code does it, so that the
results are bit-identical to ggml's (C ``float`` arithmetic without fused multiply-add).
"""
from __future__ import annotations

import os

import numpy as np
from llvmlite import ir
from numba import types
from numba.core.extending import intrinsic

from .kernel_cache import cached_njit
from .types import GGMLType, TYPE_TRAITS

F32 = np.float32


# every module whose code or globals the quantize kernels compile in
_HERE = os.path.dirname(os.path.abspath(__file__))
KERNEL_SOURCES = tuple(os.path.join(_HERE, m + ".py") for m in (
    "types", "quants_base", "quants_tables", "quants_k", "quants_rows", "quants_iq", "quants_iq_search",
    "quants_imatrix"))
njit = cached_njit(KERNEL_SOURCES)


def f16(b: np.ndarray) -> np.ndarray:
    """uint8 [n, 2] (little-endian fp16 fields) -> float32 [n]"""
    return np.ascontiguousarray(b).view("<f2")[:, 0].astype(F32)


def to_f16_bytes(v: np.ndarray) -> np.ndarray:
    """float32 [n] -> uint8 [n, 2], rounded to nearest even as GGML_FP32_TO_FP16."""
    return np.asarray(v, F32).astype("<f2").view(np.uint8).reshape(-1, 2)


def round_f16(v: np.ndarray) -> np.ndarray:
    """GGML_FP16_TO_FP32(GGML_FP32_TO_FP16(v))"""
    return np.asarray(v, F32).astype(np.float16).astype(F32)


@intrinsic
def _f32_bits(typingctx, v):
    """The bit pattern of a float32 as a uint32 (a register move; Numba scalars have no view)."""
    if not isinstance(v, types.Float) or v.bitwidth != 32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@intrinsic
def _bits_f32(typingctx, u):
    """The float32 whose bit pattern is the low 32 bits of an integer."""
    if not isinstance(u, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        x = args[0]
        if u.bitwidth > 32:
            x = builder.trunc(x, ir.IntType(32))
        elif u.bitwidth < 32:
            x = builder.zext(x, ir.IntType(32))
        return builder.bitcast(x, ir.FloatType())
    return types.float32(u), codegen


@njit(cache=True, nogil=True)
def fp16_bits(v):
    """GGML_FP32_TO_FP16 inside Numba kernels: float32 -> its fp16 bit pattern, nearest even (as F16C and NumPy),
    from the float's bits (a NaN gives the quiet NaN 0x7E00 with its sign)."""
    f = _f32_bits(F32(v))
    s = (f >> np.uint32(16)) & np.uint32(0x8000)
    a = f & np.uint32(0x7FFFFFFF)
    if a > np.uint32(0x7F800000):
        return np.int64(s | np.uint32(0x7E00))
    if a >= np.uint32(0x477FF000):                          # 65520 and up round past 65504: infinity
        return np.int64(s | np.uint32(0x7C00))
    if a < np.uint32(0x38800000):                           # below 2^-14: subnormal steps of 2^-24, nearest even
        y = _bits_f32(a) * F32(16777216.0)                  # exact (a power of two); y < 1024
        return np.int64(s) | np.int64((y + F32(8388608.0)) - F32(8388608.0))
    # rebias the exponent (127 -> 15) and round the mantissa's low 13 bits to nearest even (a carry moves into
    # the exponent, as it should)
    r = a - np.uint32(0x38000000) + np.uint32(0x0FFF) + ((a >> np.uint32(13)) & np.uint32(1))
    return np.int64(s | (r >> np.uint32(13)))


@njit(cache=True, nogil=True)
def fp16_value(h):
    """GGML_FP16_TO_FP32 of a bit pattern from fp16_bits (finite)."""
    e = (h >> 10) & 31
    m = h & 1023
    if e == 0:
        v = F32(m) * F32(5.9604644775390625e-08)            # m 2^-24, exact
        return -v if h & 0x8000 else v
    return _bits_f32(np.uint32(((h & 0x8000) << 16) | ((e + 112) << 23) | (m << 13)))


def as_bytes(data: np.ndarray) -> np.ndarray:
    data = np.asarray(data)
    if data.dtype != np.uint8:
        data = np.ascontiguousarray(data)
        data = data.view(np.uint8).reshape(data.shape[:-1] + (-1,)) if data.ndim else data.reshape(1).view(np.uint8)
    return data


def split_blocks(data: np.ndarray, t: GGMLType) -> tuple[np.ndarray, tuple]:
    """bytes [..., nbytes] -> (blocks uint8 [n, type_size], the value shape [..., nvalues])"""
    tt = TYPE_TRAITS[t]
    data = as_bytes(data)
    if data.ndim == 0 or data.shape[-1] % tt.type_size:
        raise ValueError(f"{t.name}: last axis of {data.shape} is not whole blocks of {tt.type_size} bytes")
    nb = data.shape[-1] // tt.type_size
    return np.ascontiguousarray(data).reshape(-1, tt.type_size), data.shape[:-1] + (nb * tt.blck_size,)


def to_blocks(x: np.ndarray, blck: int) -> tuple[np.ndarray, tuple]:
    """float [..., k] -> (float32 [n, blck], leading shape)"""
    x = np.ascontiguousarray(x, dtype=F32)
    if x.ndim == 0 or x.shape[-1] % blck:
        raise ValueError(f"row of {x.shape[-1:]} values is not a whole number of blocks of {blck}")
    return x.reshape(-1, blck), x.shape[:-1]


def pack(parts, lead: tuple, nblocks_per_row: int) -> np.ndarray:
    """Concatenate per-block fields (each [n, ...], any dtype, little-endian) into uint8 [..., row bytes]."""
    n = len(parts[0])
    cols = [np.ascontiguousarray(p).view(np.uint8).reshape(n, -1) for p in parts]
    out = np.concatenate(cols, axis=1)
    return out.reshape(lead + (nblocks_per_row * out.shape[1],))


def nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's nearest_int: v + 1.5*2^23 in float32 rounds half to even, i.e. rint (for |v| < 2^22)."""
    return np.rint(np.asarray(v, F32)).astype(np.int32)


def roundf(v: np.ndarray) -> np.ndarray:
    """C roundf: halves away from zero. (floor(|v| + 0.5) would round 0.49999997 up.)"""
    a = np.abs(v)
    fl = np.floor(a)
    return np.copysign(fl + np.floor(2 * (a - fl)), v)


def safe_inv(d: np.ndarray) -> np.ndarray:
    """``d ? 1.0f/d : 0.0f``"""
    d = np.asarray(d, F32)
    with np.errstate(divide="ignore"):
        return np.where(d != 0, F32(1) / np.where(d != 0, d, F32(1)), F32(0)).astype(F32)


def signed_absmax(b: np.ndarray) -> np.ndarray:
    """The value of largest magnitude per row, the first one on ties (ggml's ``if (amax < fabsf(v))`` loops)."""
    idx = np.abs(b).argmax(axis=1)
    return b[np.arange(len(b)), idx]


def nibbles(qs: np.ndarray) -> np.ndarray:
    """uint8 [n, m] -> [n, 2m]: all low nibbles, then all high nibbles (the q4 layout)."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=1)
