"""The row conversions ``llama.quant`` can run without Numba: F32, F16, BF16, Q8_0 and the other 32-value formats
(Q4_0, Q4_1, Q5_0, Q5_1, whose ``quantize_row_<type>_ref`` is one pass per block) from float32 (or fp16) rows.

Importing Numba and loading its first cached kernel costs about half a second of CPU, more than NumPy needs for
these conversions on a model of a hundred million values or so (the default model, whose 576-wide rows give every
k-quant tensor a 32-value fallback type); a file whose tensors need nothing else is converted here, and the Numba
kernels (``quants_rows``) take over where their speed pays for the start-up. Same bytes as ``quants.quantize``
(ggml's reference rounding). This module imports NumPy only.
"""
from __future__ import annotations

import numpy as np

from .types import GGMLType

T = GGMLType
F32 = np.float32

NUMPY_TYPES = frozenset({T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1})

# what the Numba kernels quantize (quants.QUANTIZE_TYPES, F32 and the grid searches' quants_iq_search.SEARCH_TYPES),
# and which of those need an importance matrix (quants_iq_search.REQUIRES_IMATRIX): named here so that planning a
# file imports no Numba (llama.quant forks its NumPy helper process before Numba loads); test_quantize checks them
# against those modules
KERNEL_TYPES = frozenset({
    T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q8_1, T.Q8_K, T.Q1_0, T.Q2_0,
    T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS, T.TQ1_0, T.TQ2_0, T.MXFP4, T.NVFP4,
    T.IQ1_M, T.IQ1_S, T.IQ2_S, T.IQ2_XS, T.IQ2_XXS, T.IQ3_S, T.IQ3_XXS})
KERNEL_NEEDS_IMATRIX = frozenset({T.IQ2_XXS, T.IQ2_XS, T.IQ1_S})

# the float32 just below 0.5: trunc(v + copysign(_HALF_DOWN, v)) is C's roundf for |v| <= 128 (halves away from
# zero; 0.49999997 itself stays 0, which v + 0.5 would round up to 1.0); checked against quants_base.roundf around
# every integer and half in the tests
_HALF_DOWN = F32(0.49999997)


_TABLES: dict = {}


def _f16_table(kind: str) -> np.ndarray:
    """Every fp16 bit pattern's float32 (``"f32"``: GGML_FP16_TO_FP32, NumPy's exact cast, NaN payloads kept) or
    bfloat16 bits (``"bf16"``: that float32 through quantize_bf16), indexed by the pattern; made once."""
    tab = _TABLES.get(kind)
    if tab is None:
        f = np.arange(65536, dtype=np.uint16).view(np.float16).astype(F32)
        tab = _TABLES[kind] = f if kind == "f32" else quantize_bf16(f).view(np.uint16)
    return tab


def f16_to_f32(h: np.ndarray, out: np.ndarray) -> None:
    """fp16 bit patterns (uint16) -> float32 into ``out`` (GGML_FP16_TO_FP32: exact, NaN payloads kept): a lookup
    in the 65536-entry table (0.8 ns a value, AVX2 Zen 3; NumPy's float16 cast 1.9). ``mode="wrap"``: a uint16
    index is always in range, and ``take`` then writes ``out`` without an intermediate buffer."""
    np.take(_f16_table("f32"), h, out=out, mode="wrap")


def f16_to_bf16(h: np.ndarray, out: np.ndarray) -> None:
    """fp16 bit patterns (uint16) -> bfloat16 bit patterns (uint16) into ``out``, in one pass: what llama-quantize
    writes for an F16 tensor going to BF16 (ggml_fp16_to_fp32_row, then ggml_compute_fp32_to_bf16's rounding to
    nearest even and quiet NaNs) looked up per pattern, 0.8 ns a value where the float32 round trip took 2.7."""
    np.take(_f16_table("bf16"), h, out=out, mode="wrap")


def quantize_f16(x):
    return np.ascontiguousarray(x, F32).astype("<f2").view(np.uint8).reshape(np.shape(x)[:-1] + (-1,))


def quantize_bf16(x):
    """ggml_compute_fp32_to_bf16: round to nearest even; NaN made quiet."""
    x = np.ascontiguousarray(x, F32)
    u = x.view(np.uint32)
    r = u >> 16                         # in uint32, in place: u + 0x7FFF + 1 wraps only for a NaN, replaced below
    r &= 1
    r += 0x7FFF
    r += u
    r >>= 16
    nan = np.isnan(x)
    if nan.any():
        r[nan] = (u[nan] >> 16) | 64
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


def _f16_into(o: np.ndarray, v: np.ndarray) -> None:
    o[...] = v.astype("<f2").view(np.uint8).reshape(-1, 2)


def _inv(d: np.ndarray) -> np.ndarray:
    """``d ? 1.0f/d : 0.0f``"""
    with np.errstate(divide="ignore"):
        return np.where(d != 0, F32(1) / d, F32(0)).astype(F32, copy=False)


def _signed_absmax(b: np.ndarray) -> np.ndarray:
    """Per block the value of largest magnitude, the first one on ties (ggml's ``if (amax < fabsf(v))``)."""
    return np.take_along_axis(b, np.abs(b).argmax(axis=1)[:, None], axis=1)[:, 0]


def _levels(v: np.ndarray, top: int | None) -> np.ndarray:
    """C's ``(int8_t)`` of v >= 0 (truncation; as quants._trunc_u8), then ``MIN(top, .)``; v is overwritten."""
    q = np.trunc(v, out=v).astype(np.int32).astype(np.uint8)
    if top is not None:
        np.minimum(q, top, out=q)
    return q


def _nibbles_into(o: np.ndarray, q: np.ndarray) -> None:
    """qs[j] = q[j] low nibble | q[j + 16] low nibble << 4 (q holds levels below 16, or is masked first)."""
    np.bitwise_or(q[:, :16], q[:, 16:] << 4, out=o)


def _qx_0(b: np.ndarray, o: np.ndarray, nlev: int) -> None:
    """quantize_row_q4_0_ref (nlev 8: {d, qs[16]}) / q5_0 (nlev 16: {d, qh[4], qs[16]}): d = max / -nlev (max the
    signed value of largest magnitude), id = d ? 1/d : 0, L = MIN(2 nlev - 1, (int8_t)(x id + nlev + 0.5))."""
    d = _signed_absmax(b) / F32(-nlev)
    v = b * _inv(d)[:, None]
    v += F32(nlev + 0.5)
    q = _levels(v, 2 * nlev - 1)
    _f16_into(o[:, :2], d)
    if nlev == 8:
        _nibbles_into(o[:, 2:18], q)
    else:
        o[:, 2:6] = np.packbits((q >> 4) & 1, axis=1, bitorder="little")       # qh: bit j = L[j] bit 4
        _nibbles_into(o[:, 6:22], q & 0xF)


def _qx_1(b: np.ndarray, o: np.ndarray, nmax: int) -> None:
    """quantize_row_q4_1_ref (nmax 15: {d, m, qs[16]}) / q5_1 (nmax 31, no clamp: {d, m, qh[4], qs[16]}):
    d = (max - min) / nmax, L = (int8_t)((x - min) id + 0.5)."""
    mn = b.min(axis=1)
    d = (b.max(axis=1) - mn) / F32(nmax)
    v = b - mn[:, None]
    v *= _inv(d)[:, None]
    v += F32(0.5)
    q = _levels(v, 15 if nmax == 15 else None)
    _f16_into(o[:, :2], d)
    _f16_into(o[:, 2:4], mn)
    if nmax == 15:
        _nibbles_into(o[:, 4:20], q)
    else:
        o[:, 4:8] = np.packbits((q >> 4) & 1, axis=1, bitorder="little")
        _nibbles_into(o[:, 8:24], q & 0xF)


# type -> (block writer, block bytes, its argument)
_BLOCKS = {T.Q4_0: (_qx_0, 18, 8), T.Q5_0: (_qx_0, 22, 16), T.Q4_1: (_qx_1, 20, 15), T.Q5_1: (_qx_1, 24, 31)}


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
        if t in _BLOCKS:
            fn, size, arg = _BLOCKS[t]
            fn(np.ascontiguousarray(x, F32).reshape(-1, 32), out.reshape(-1, size), arg)
            return
        y = np.ascontiguousarray(x, F32).view(np.uint8) if t == T.F32 else \
            quantize_f16(x) if t == T.F16 else quantize_bf16(x)
    out.reshape(y.shape)[...] = y
