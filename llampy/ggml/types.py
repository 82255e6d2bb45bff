"""GGML tensor types: ids exactly as in ggml.h, and the traits table.

A quantized type stores ``blck_size`` values in ``type_size`` bytes (one block). Rows of a tensor are
whole blocks, so a row of ``ne0`` values takes ``ne0 // blck_size * type_size`` bytes.
``vec_dot_type`` is the type llama.cpp's CPU backend rounds the *other* operand (activations) to before a
dot product with this type; llampy mirrors it so its numbers match (DESIGN.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np

QK_K = 256


class GGMLType(IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    # 4 and 5 (Q4_2, Q4_3) were removed from ggml
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    # 31-33 (Q4_0_4_4, Q4_0_4_8, Q4_0_8_8) were removed from GGUF files
    TQ1_0 = 34
    TQ2_0 = 35
    # 36-38 (IQ4_NL_4_4, ...) were removed
    MXFP4 = 39
    NVFP4 = 40
    Q1_0 = 41
    Q2_0 = 42


@dataclass(frozen=True)
class TypeTraits:
    type: GGMLType
    blck_size: int
    type_size: int
    is_quantized: bool
    vec_dot_type: GGMLType
    dtype: np.dtype | None  # numpy dtype of one element, for the plain (non-block) types

    @property
    def name(self) -> str:
        return self.type.name


T = GGMLType


def _t(t, blck, size, vdt, dtype=None):
    return TypeTraits(t, blck, size, blck > 1, vdt, np.dtype(dtype) if dtype else None)


TYPE_TRAITS: dict[GGMLType, TypeTraits] = {tt.type: tt for tt in [
    _t(T.F32, 1, 4, T.F32, np.float32),
    _t(T.F16, 1, 2, T.F16, np.float16),
    _t(T.BF16, 1, 2, T.BF16, np.uint16),  # raw bits; numpy has no bfloat16
    _t(T.F64, 1, 8, T.F64, np.float64),
    _t(T.I8, 1, 1, T.I8, np.int8),
    _t(T.I16, 1, 2, T.I16, np.int16),
    _t(T.I32, 1, 4, T.I32, np.int32),
    _t(T.I64, 1, 8, T.I64, np.int64),
    _t(T.Q4_0, 32, 18, T.Q8_0),
    _t(T.Q4_1, 32, 20, T.Q8_1),
    _t(T.Q5_0, 32, 22, T.Q8_0),
    _t(T.Q5_1, 32, 24, T.Q8_1),
    _t(T.Q8_0, 32, 34, T.Q8_0),
    _t(T.Q8_1, 32, 36, T.Q8_1),
    _t(T.Q2_K, QK_K, 84, T.Q8_K),
    _t(T.Q3_K, QK_K, 110, T.Q8_K),
    _t(T.Q4_K, QK_K, 144, T.Q8_K),
    _t(T.Q5_K, QK_K, 176, T.Q8_K),
    _t(T.Q6_K, QK_K, 210, T.Q8_K),
    _t(T.Q8_K, QK_K, 292, T.Q8_K),
    _t(T.IQ2_XXS, QK_K, 66, T.Q8_K),
    _t(T.IQ2_XS, QK_K, 74, T.Q8_K),
    _t(T.IQ2_S, QK_K, 82, T.Q8_K),
    _t(T.IQ3_XXS, QK_K, 98, T.Q8_K),
    _t(T.IQ3_S, QK_K, 110, T.Q8_K),
    _t(T.IQ1_S, QK_K, 50, T.Q8_K),
    _t(T.IQ1_M, QK_K, 56, T.Q8_K),
    _t(T.IQ4_NL, 32, 18, T.Q8_0),
    _t(T.IQ4_XS, QK_K, 136, T.Q8_K),
    _t(T.TQ1_0, QK_K, 54, T.Q8_K),
    _t(T.TQ2_0, QK_K, 66, T.Q8_K),
    _t(T.MXFP4, 32, 17, T.Q8_0),
    _t(T.NVFP4, 64, 36, T.Q8_0),
    _t(T.Q1_0, 128, 18, T.Q8_0),
    _t(T.Q2_0, 64, 18, T.Q8_0),
]}

assert len(TYPE_TRAITS) == len(GGMLType) == 35


def traits(t: GGMLType | int) -> TypeTraits:
    return TYPE_TRAITS[GGMLType(t)]


def row_size(t: GGMLType | int, ne0: int) -> int:
    """Bytes taken by a row of ``ne0`` values of type ``t``; ``ne0`` must be a whole number of blocks."""
    tt = TYPE_TRAITS[GGMLType(t)]
    if ne0 % tt.blck_size:
        raise ValueError(f"row of {ne0} values is not a whole number of {tt.name} blocks ({tt.blck_size})")
    return ne0 // tt.blck_size * tt.type_size


def type_from_dtype(dtype) -> GGMLType:
    dtype = np.dtype(dtype)
    for t in (T.F32, T.F16, T.F64, T.I8, T.I16, T.I32, T.I64):
        if TYPE_TRAITS[t].dtype == dtype:
            return t
    raise ValueError(f"no GGML type for numpy dtype {dtype}")
