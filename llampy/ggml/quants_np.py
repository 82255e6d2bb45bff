"""The row conversions ``llama.quant`` can run without Numba: F32, F16, BF16 and Q8_0 from float32 (or fp16) rows.

Importing Numba and loading its first cached kernel costs about half a second of CPU, more than NumPy needs for
these conversions on a model of a few hundred million values; a file whose tensors need nothing else is converted
here, and the Numba kernels (``quants_rows``) take over where their speed pays for the start-up. Same bytes as
``quants.quantize`` (ggml's reference rounding). This module imports NumPy only.
"""
from __future__ import annotations

import numpy as np

from .types import GGMLType

T = GGMLType
F32 = np.float32

NUMPY_TYPES = frozenset({T.F32, T.F16, T.BF16, T.Q8_0})

# the float32 just below 0.5: trunc(v + copysign(_HALF_DOWN, v)) is C's roundf for |v| <= 128 (halves away from
# zero; 0.49999997 itself stays 0, which v + 0.5 would round up to 1.0); checked against quants_base.roundf around
# every integer and half in the tests
_HALF_DOWN = F32(0.49999997)


def f16_to_f32(h: np.ndarray, out: np.ndarray) -> None:
    """fp16 bit patterns (uint16) -> float32 into ``out`` (GGML_FP16_TO_FP32: exact, NaN payloads kept)."""
    np.copyto(out, h.view(np.float16), casting="unsafe")


def quantize_f16(x):
    return np.ascontiguousarray(x, F32).astype("<f2").view(np.uint8).reshape(np.shape(x)[:-1] + (-1,))


def quantize_bf16(x):
    """ggml_compute_fp32_to_bf16: round to nearest even; NaN made quiet."""
    u = np.ascontiguousarray(x, F32).view(np.uint32)
    r = ((u.astype(np.uint64) + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r[nan] = ((u[nan] >> 16) | 64).astype(np.uint16)
    return r.astype("<u2").view(np.uint8).reshape(np.shape(x)[:-1] + (-1,))


def _q8_0(b: np.ndarray, o: np.ndarray) -> None:
    """quantize_row_q8_0_ref over blocks b float32 [n, 32] into o uint8 [n, 34] {d, qs[32]}: d = amax / 127,
    id = d ? 1/d : 0, qs = roundf(x * id)."""
    amax = np.abs(b).max(axis=1)
    d = amax / F32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, F32(1) / d, F32(0)).astype(F32, copy=False)
    v = b * inv[:, None]
    v += np.copysign(_HALF_DOWN, v)
    o[:, 2:] = v.astype(np.int8).view(np.uint8)         # float -> int8 truncates, as the C cast
    o[:, :2] = d.astype("<f2").view(np.uint8).reshape(-1, 2)


def quantize_rows(x: np.ndarray, t: GGMLType, out: np.ndarray) -> None:
    """float32 [nrows, k] -> the rows of type ``t`` (one of NUMPY_TYPES) into ``out`` (uint8, C-contiguous)."""
    t = GGMLType(t)
    if t not in NUMPY_TYPES:
        raise ValueError(f"{t.name} is not converted here")
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):     # as quants.quantize: inf fits fp16
        if t == T.Q8_0:
            x = np.ascontiguousarray(x, F32)
            _q8_0(x.reshape(-1, 32), out.reshape(-1, 34))
            return
        y = np.ascontiguousarray(x, F32).view(np.uint8) if t == T.F32 else \
            quantize_f16(x) if t == T.F16 else quantize_bf16(x)
    out.reshape(y.shape)[...] = y
