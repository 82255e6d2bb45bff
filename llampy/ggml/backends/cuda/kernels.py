"""Triton kernels of the CUDA backend: block formats decoded inside the kernels.

Each block format of the table (``ggml/blocks.py``) has a *value rule* here: a ``@triton.jit`` function that takes
row pointers (uint8, one per row, shape [BN, 1]) and element indices (shape [1, BK]) and returns the float32 values
of those elements, reading the block's fields at the offsets the table gives. Two kernels are specialised from the
rules by a ``constexpr`` type id, so each format compiles to its own machine code:

- ``matvec``: y[c, r] = sum_k w[r, k] * x[c, k] for up to 8 columns (decode, small batches), the weights read once
  from device memory and decoded in registers; one column: float32 multiply-add; more: tensor-core ``tl.dot`` over
  F16 tiles of 16 columns (the rows of x padded with zeros).
- ``dequant``: rows of a block-format matrix (all of them, or those an index names: get_rows) to F16 or F32, for
  the prompt path (dequantized tiles, then cuBLAS) and for embeddings.

The rules hold to ggml's dequantize_row_* (ggml-quants.c); ``tests/ggml/test_cuda_backend.py`` checks each against
``quants.dequantize`` and its field offsets against the table. Under ``TRITON_INTERPRET=1`` the same kernels run on
the CPU over torch CPU tensors (CI has no GPU).
"""
from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

from ...quants_tables import (IQ1S_GRID_BYTES, IQ2S_GRID_BYTES, IQ2XS_GRID_BYTES, IQ2XXS_GRID_BYTES, IQ3S_GRID_BYTES,
                              IQ3XXS_GRID_BYTES, ksigns_iq2xs, kvalues_iq4nl)
from ...types import GGMLType as T

# the constexpr id of each format: its GGMLType value
Q4_0: tl.constexpr = tl.constexpr(int(T.Q4_0))
Q4_1: tl.constexpr = tl.constexpr(int(T.Q4_1))
Q5_0: tl.constexpr = tl.constexpr(int(T.Q5_0))
Q5_1: tl.constexpr = tl.constexpr(int(T.Q5_1))
Q8_0: tl.constexpr = tl.constexpr(int(T.Q8_0))
Q2_K: tl.constexpr = tl.constexpr(int(T.Q2_K))
Q3_K: tl.constexpr = tl.constexpr(int(T.Q3_K))
Q4_K: tl.constexpr = tl.constexpr(int(T.Q4_K))
Q5_K: tl.constexpr = tl.constexpr(int(T.Q5_K))
Q6_K: tl.constexpr = tl.constexpr(int(T.Q6_K))
IQ4_NL: tl.constexpr = tl.constexpr(int(T.IQ4_NL))
IQ4_XS: tl.constexpr = tl.constexpr(int(T.IQ4_XS))
IQ2_XXS: tl.constexpr = tl.constexpr(int(T.IQ2_XXS))
IQ2_XS: tl.constexpr = tl.constexpr(int(T.IQ2_XS))
IQ2_S: tl.constexpr = tl.constexpr(int(T.IQ2_S))
IQ3_XXS: tl.constexpr = tl.constexpr(int(T.IQ3_XXS))
IQ3_S: tl.constexpr = tl.constexpr(int(T.IQ3_S))
IQ1_S: tl.constexpr = tl.constexpr(int(T.IQ1_S))
IQ1_M: tl.constexpr = tl.constexpr(int(T.IQ1_M))
TQ1_0: tl.constexpr = tl.constexpr(int(T.TQ1_0))
TQ2_0: tl.constexpr = tl.constexpr(int(T.TQ2_0))
MXFP4: tl.constexpr = tl.constexpr(int(T.MXFP4))
NVFP4: tl.constexpr = tl.constexpr(int(T.NVFP4))
Q1_0: tl.constexpr = tl.constexpr(int(T.Q1_0))
Q2_0: tl.constexpr = tl.constexpr(int(T.Q2_0))
F16: tl.constexpr = tl.constexpr(int(T.F16))
BF16: tl.constexpr = tl.constexpr(int(T.BF16))
F32: tl.constexpr = tl.constexpr(int(T.F32))

# the formats the kernels decode
TYPES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS,
         T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M, T.TQ1_0, T.TQ2_0, T.MXFP4, T.NVFP4, T.Q1_0,
         T.Q2_0, T.F16, T.BF16, T.F32)

# the kernels' one table argument ``lut`` (int8 on the device): IQ4_NL's values, ksigns_iq2xs (the sign bytes of
# the IQ2/IQ3 formats, read & 255), then the grids' entries as bytes (8 a entry for IQ2 and IQ1, 4 for IQ3; all
# < 128; IQ1's are -1, 0, 1);
# the offsets of each part
_LUT_PARTS = [kvalues_iq4nl.astype(np.int8), ksigns_iq2xs.astype(np.uint8).view(np.int8)] + [
    g.reshape(-1).view(np.int8) for g in (IQ2XXS_GRID_BYTES, IQ2XS_GRID_BYTES, IQ2S_GRID_BYTES, IQ3XXS_GRID_BYTES,
                                          IQ3S_GRID_BYTES, IQ1S_GRID_BYTES)]
LUT = np.concatenate(_LUT_PARTS)
_OFFS = np.cumsum([0] + [len(a) for a in _LUT_PARTS]).tolist()
LUT_KSIGNS: tl.constexpr = tl.constexpr(_OFFS[1])
LUT_IQ2XXS: tl.constexpr = tl.constexpr(_OFFS[2])
LUT_IQ2XS: tl.constexpr = tl.constexpr(_OFFS[3])
LUT_IQ2S: tl.constexpr = tl.constexpr(_OFFS[4])
LUT_IQ3XXS: tl.constexpr = tl.constexpr(_OFFS[5])
LUT_IQ3S: tl.constexpr = tl.constexpr(_OFFS[6])
LUT_IQ1S: tl.constexpr = tl.constexpr(_OFFS[7])

# the byte offsets each rule reads, per format: the tests hold them to the table's fields (blocks.BLOCKS)
FIELD_OFFSETS = {
    T.Q4_0: {"d": 0, "qs": 2}, T.Q4_1: {"d": 0, "m": 2, "qs": 4}, T.Q5_0: {"d": 0, "qh": 2, "qs": 6},
    T.Q5_1: {"d": 0, "m": 2, "qh": 4, "qs": 8}, T.Q8_0: {"d": 0, "qs": 2},
    T.Q2_K: {"scales": 0, "qs": 16, "d": 80, "dmin": 82},
    T.Q3_K: {"hmask": 0, "qs": 32, "scales": 96, "d": 108},
    T.Q4_K: {"d": 0, "dmin": 2, "scales": 4, "qs": 16},
    T.Q5_K: {"d": 0, "dmin": 2, "scales": 4, "qh": 16, "qs": 48},
    T.Q6_K: {"ql": 0, "qh": 128, "scales": 192, "d": 208},
    T.IQ4_NL: {"d": 0, "qs": 2}, T.IQ4_XS: {"d": 0, "scales_h": 2, "scales_l": 4, "qs": 8},
    T.IQ2_XXS: {"d": 0, "qs": 2}, T.IQ2_XS: {"d": 0, "qs": 2, "scales": 66},
    T.IQ2_S: {"d": 0, "qs": 2, "signs": 34, "qh": 66, "scales": 74}, T.IQ3_XXS: {"d": 0, "qs": 2, "sas": 66},
    T.IQ3_S: {"d": 0, "qs": 2, "qh": 66, "signs": 74, "scales": 106}, T.IQ1_S: {"d": 0, "qs": 2, "qh": 34},
    T.IQ1_M: {"qs": 0, "qh": 32, "scales": 48}, T.TQ1_0: {"qs": 0, "qh": 48, "d": 52}, T.TQ2_0: {"qs": 0, "d": 64}, T.MXFP4: {"e": 0, "qs": 1},
    T.NVFP4: {"d": 0, "qs": 4}, T.Q1_0: {"d": 0, "qs": 2}, T.Q2_0: {"d": 0, "qs": 2},
}


# ------------------------------------------------------------------------------------------------ field reads
@triton.jit
def _u8(p, off):
    return tl.load(p + off).to(tl.int32)


@triton.jit
def _i8(p, off):
    return tl.load((p + off).to(tl.pointer_type(tl.int8))).to(tl.int32)


@triton.jit
def _f16(p, off):
    """The F16 at byte ``off`` (even: every block size and F16 field offset of the table is even)."""
    return tl.load((p + off).to(tl.pointer_type(tl.float16))).to(tl.float32)


@triton.jit
def _kscale(p, o, g, MIN: tl.constexpr):
    """Q4_K/Q5_K: the 6-bit scale (MIN=False) or min (MIN=True) of group g (0..7) from the 12 bytes at o + 4."""
    lo = g < 4
    gl = tl.where(lo, g, g - 4)
    if MIN:
        a = _u8(p, o + 4 + gl + 4)
        return tl.where(lo, a & 63, (_u8(p, o + 4 + gl + 8) >> 4) | ((a >> 6) << 4))
    a = _u8(p, o + 4 + gl)
    return tl.where(lo, a & 63, (_u8(p, o + 4 + gl + 8) & 15) | ((a >> 6) << 4))


# ------------------------------------------------------------------------------------------------ value rules
@triton.jit
def _value(p, k, lut, TYPE: tl.constexpr):
    """Values of elements k (int32) of the rows at p (uint8 pointers), as float32."""
    if TYPE == F32:
        v = tl.load((p + 4 * k).to(tl.pointer_type(tl.float32)))
    elif TYPE == F16:
        v = tl.load((p + 2 * k).to(tl.pointer_type(tl.float16))).to(tl.float32)
    elif TYPE == BF16:
        v = tl.load((p + 2 * k).to(tl.pointer_type(tl.bfloat16))).to(tl.float32)
    elif TYPE == Q4_0:      # d, qs[16]: j < 16 low nibbles, j >= 16 high; value d * (q - 8)
        o = (k // 32) * 18
        j = k % 32
        q = (_u8(p, o + 2 + (j % 16)) >> (4 * (j // 16))) & 15
        v = _f16(p, o) * (q - 8).to(tl.float32)
    elif TYPE == Q4_1:      # d, m, qs[16]: d * q + m
        o = (k // 32) * 20
        j = k % 32
        q = (_u8(p, o + 4 + (j % 16)) >> (4 * (j // 16))) & 15
        v = _f16(p, o) * q.to(tl.float32) + _f16(p, o + 2)
    elif TYPE == Q5_0:      # d, qh (32 fifth bits), qs[16]: d * (q - 16)
        o = (k // 32) * 22
        j = k % 32
        q = ((_u8(p, o + 6 + (j % 16)) >> (4 * (j // 16))) & 15) | (((_u8(p, o + 2 + j // 8) >> (j % 8)) & 1) << 4)
        v = _f16(p, o) * (q - 16).to(tl.float32)
    elif TYPE == Q5_1:      # d, m, qh, qs[16]: d * q + m
        o = (k // 32) * 24
        j = k % 32
        q = ((_u8(p, o + 8 + (j % 16)) >> (4 * (j // 16))) & 15) | (((_u8(p, o + 4 + j // 8) >> (j % 8)) & 1) << 4)
        v = _f16(p, o) * q.to(tl.float32) + _f16(p, o + 2)
    elif TYPE == Q8_0:      # d, qs[32] (int8)
        o = (k // 32) * 34
        v = _f16(p, o) * _i8(p, o + 2 + k % 32).to(tl.float32)
    elif TYPE == Q2_K:      # scales[16] (scale | min << 4 per 16 values), qs[64] (2 bits), d, dmin
        o = (k // 256) * 84
        j = k % 256
        sm = _u8(p, o + j // 16)
        q = (_u8(p, o + 16 + 32 * (j // 128) + j % 32) >> (2 * ((j % 128) // 32))) & 3
        v = _f16(p, o + 80) * ((sm & 15) * q).to(tl.float32) - _f16(p, o + 82) * (sm >> 4).to(tl.float32)
    elif TYPE == Q3_K:      # hmask[32], qs[64], scales[12] (sixteen 6-bit, minus 32), d
        o = (k // 256) * 110
        j = k % 256
        lo = (_u8(p, o + 32 + 32 * (j // 128) + j % 32) >> (2 * ((j % 128) // 32))) & 3
        hb = (_u8(p, o + j % 32) >> (4 * (j // 128) + (j % 128) // 32)) & 1
        s = j // 16
        sc = ((_u8(p, o + 96 + s % 8) >> (4 * (s // 8))) & 15) | (((_u8(p, o + 104 + s % 4) >> (2 * (s // 4))) & 3) << 4)
        v = _f16(p, o + 108) * ((sc - 32) * (lo - 4 + 4 * hb)).to(tl.float32)
    elif TYPE == Q4_K:      # d, dmin, scales[12] (eight 6-bit scale/min pairs), qs[128]
        o = (k // 256) * 144
        j = k % 256
        g = j // 32
        q = (_u8(p, o + 16 + 32 * (j // 64) + j % 32) >> (4 * (g % 2))) & 15
        v = _f16(p, o) * (_kscale(p, o, g, False) * q).to(tl.float32) \
            - _f16(p, o + 2) * _kscale(p, o, g, True).to(tl.float32)
    elif TYPE == Q5_K:      # d, dmin, scales[12], qh[32] (bit g of byte j % 32), qs[128]
        o = (k // 256) * 176
        j = k % 256
        g = j // 32
        q = ((_u8(p, o + 48 + 32 * (j // 64) + j % 32) >> (4 * (g % 2))) & 15) \
            | (((_u8(p, o + 16 + j % 32) >> g) & 1) << 4)
        v = _f16(p, o) * (_kscale(p, o, g, False) * q).to(tl.float32) \
            - _f16(p, o + 2) * _kscale(p, o, g, True).to(tl.float32)
    elif TYPE == Q6_K:      # ql[128], qh[64], scales[16] (int8), d; halves of 128 values, quarters of 32
        o = (k // 256) * 210
        j = k % 256
        n = j // 128
        qd = (j % 128) // 32
        l = j % 32
        ql = (_u8(p, o + 64 * n + l + 32 * (qd % 2)) >> (4 * (qd // 2))) & 15
        qh = (_u8(p, o + 128 + 32 * n + l) >> (2 * qd)) & 3
        sc = _i8(p, o + 192 + 8 * n + l // 16 + 2 * qd)
        v = _f16(p, o + 208) * (sc * ((ql | (qh << 4)) - 32)).to(tl.float32)
    elif TYPE == IQ4_NL:    # d, qs[16]: the nibbles index the non-linear table
        o = (k // 32) * 18
        j = k % 32
        q = (_u8(p, o + 2 + (j % 16)) >> (4 * (j // 16))) & 15
        v = _f16(p, o) * tl.load(lut + q).to(tl.float32)
    elif TYPE == IQ2_XXS:   # d, then per 32 values 4 grid indices and a u32 of four 7-bit sign indices + 4-bit ls
        o = (k // 256) * 66
        j = k % 256
        gb = o + 2 + 8 * (j // 32)
        aux = _u8(p, gb + 4) | (_u8(p, gb + 5) << 8) | (_u8(p, gb + 6) << 16) | (_u8(p, gb + 7) << 24)
        c = (j % 32) // 8
        db = (_f16(p, o) * (0.5 + ((aux >> 28) & 15).to(tl.float32))) * 0.25
        g = tl.load(lut + LUT_IQ2XXS + 8 * _u8(p, gb + c) + j % 8).to(tl.float32)
        sg = tl.load(lut + LUT_KSIGNS + ((aux >> (7 * c)) & 127)).to(tl.int32) & 255
        v = db * g
        v = tl.where(((sg >> (j % 8)) & 1) != 0, -v, v)
    elif TYPE == IQ2_XS:    # d, qs[32] u16 (9-bit index into iq2xs_grid, 7-bit sign index), scales[8] (a nibble per 16)
        o = (k // 256) * 74
        j = k % 256
        g = j // 32
        c = (j % 32) // 8
        q16 = _u8(p, o + 2 + 8 * g + 2 * c) | (_u8(p, o + 3 + 8 * g + 2 * c) << 8)
        ls = (_u8(p, o + 66 + g) >> (4 * (c // 2))) & 15
        db = (_f16(p, o) * (0.5 + ls.to(tl.float32))) * 0.25
        v = db * tl.load(lut + LUT_IQ2XS + 8 * (q16 & 511) + j % 8).to(tl.float32)
        sg = tl.load(lut + LUT_KSIGNS + (q16 >> 9)).to(tl.int32) & 255
        v = tl.where(((sg >> (j % 8)) & 1) != 0, -v, v)
    elif TYPE == IQ2_S:     # d, qs[32] (index bits 0..7), signs[32] (a bit a value), qh[8] (bits 8, 9), scales[8]
        o = (k // 256) * 82
        j = k % 256
        g = j // 32
        c = (j % 32) // 8
        idx = _u8(p, o + 2 + 4 * g + c) | ((_u8(p, o + 66 + g) << (8 - 2 * c)) & 0x300)
        ls = (_u8(p, o + 74 + g) >> (4 * (c // 2))) & 15
        db = (_f16(p, o) * (0.5 + ls.to(tl.float32))) * 0.25
        v = db * tl.load(lut + LUT_IQ2S + 8 * idx + j % 8).to(tl.float32)
        v = tl.where(((_u8(p, o + 34 + 4 * g + c) >> (j % 8)) & 1) != 0, -v, v)
    elif TYPE == IQ3_XXS:   # d, qs[64] (indices into iq3xxs_grid, 4 values each), per 32 a u32: 4 sign indices + ls
        o = (k // 256) * 98
        j = k % 256
        g = j // 32
        sa = o + 66 + 4 * g
        aux = _u8(p, sa) | (_u8(p, sa + 1) << 8) | (_u8(p, sa + 2) << 16) | (_u8(p, sa + 3) << 24)
        db = (_f16(p, o) * (0.5 + ((aux >> 28) & 15).to(tl.float32))) * 0.5
        v = db * tl.load(lut + LUT_IQ3XXS + 4 * _u8(p, o + 2 + 8 * g + (j % 32) // 4) + j % 4).to(tl.float32)
        sg = tl.load(lut + LUT_KSIGNS + ((aux >> (7 * ((j % 32) // 8))) & 127)).to(tl.int32) & 255
        v = tl.where(((sg >> (j % 8)) & 1) != 0, -v, v)
    elif TYPE == IQ3_S:     # d, qs[64] (index bits 0..7), qh[8] (bit 8), signs[32], scales[4] (a nibble per 32)
        o = (k // 256) * 110
        j = k % 256
        g = j // 32
        c = (j % 32) // 4
        idx = _u8(p, o + 2 + 8 * g + c) | (((_u8(p, o + 66 + g) >> c) & 1) << 8)
        ls = (_u8(p, o + 106 + g // 2) >> (4 * (g % 2))) & 15
        v = (_f16(p, o) * (1 + 2 * ls).to(tl.float32)) * tl.load(lut + LUT_IQ3S + 4 * idx + j % 4).to(tl.float32)
        v = tl.where(((_u8(p, o + 74 + 4 * g + (j % 32) // 8) >> (j % 8)) & 1) != 0, -v, v)
    elif TYPE == IQ1_S:     # d, qs[32] (index bits 0..7), qh[8] u16: 3 index bits a chunk, ls (12..14), delta sign (15)
        o = (k // 256) * 50
        j = k % 256
        g = j // 32
        c = (j % 32) // 8
        qh = _u8(p, o + 34 + 2 * g) | (_u8(p, o + 35 + 2 * g) << 8)
        idx = _u8(p, o + 2 + 4 * g + c) | (((qh >> (3 * c)) & 7) << 8)
        dl = _f16(p, o) * (2 * ((qh >> 12) & 7) + 1).to(tl.float32)
        delta = tl.where((qh & 0x8000) != 0, -0.125, 0.125)
        v = dl * (tl.load(lut + LUT_IQ1S + 8 * idx + j % 8).to(tl.float32) + delta)
    elif TYPE == IQ1_M:     # qs[32], qh[16] (a nibble a chunk: 3 index bits, the delta's sign), scales[8] (4 u16:
        o = (k // 256) * 56  # 3-bit ls per 16 values; d's F16 bits in their top nibbles)
        j = k % 256
        g = j // 32
        c = (j % 32) // 8
        hn = (_u8(p, o + 32 + 2 * g + c // 2) >> (4 * (c % 2))) & 15
        idx = _u8(p, o + 4 * g + c) | ((hn & 7) << 8)
        sc = _u8(p, o + 48 + 2 * (g // 2)) | (_u8(p, o + 49 + 2 * (g // 2)) << 8)
        db = (_u8(p, o + 49) >> 4) | (_u8(p, o + 51) & 0xF0) | ((_u8(p, o + 53) >> 4) << 8) | ((_u8(p, o + 55) >> 4) << 12)
        d = db.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        dl = d * (2 * ((sc >> (6 * (g % 2) + 3 * (c // 2))) & 7) + 1).to(tl.float32)
        delta = tl.where((hn & 8) != 0, -0.125, 0.125)
        v = dl * (tl.load(lut + LUT_IQ1S + 8 * idx + j % 8).to(tl.float32) + delta)
    elif TYPE == TQ1_0:     # qs[48] (five base-3 digits a byte), qh[4] (four), d: (digit - 1) * d
        o = (k // 256) * 54
        j = k % 256         # values 0..159: byte j % 32, digit j // 32; 160..239: 32 + .. % 16; then 48 + .. % 4
        b = tl.where(j < 160, j % 32, tl.where(j < 240, 32 + (j - 160) % 16, 48 + (j - 240) % 4))
        n = tl.where(j < 160, j // 32, tl.where(j < 240, (j - 160) // 16, (j - 240) // 4))
        p3 = tl.where(n == 0, 1, tl.where(n == 1, 3, tl.where(n == 2, 9, tl.where(n == 3, 27, 81))))
        q = (((_u8(p, o + b) * p3) & 255) * 3) >> 8     # the byte holds the digits as a fraction of 243
        v = (q - 1).to(tl.float32) * _f16(p, o + 52)
    elif TYPE == TQ2_0:     # qs[64] (2 bits per value, laid out as Q2_K's), d: (q - 1) * d, q in 0..2
        o = (k // 256) * 66
        j = k % 256
        q = (_u8(p, o + 32 * (j // 128) + j % 32) >> (2 * ((j % 128) // 32))) & 3
        v = (q - 1).to(tl.float32) * _f16(p, o + 64)
    elif TYPE == MXFP4:     # e (E8M0), qs[16] (E2M1 nibbles laid out as IQ4_NL's): kvalues_mxfp4[q] * 2^(e - 128)
        o = (k // 32) * 17
        j = k % 32
        q = (_u8(p, o + 1 + (j % 16)) >> (4 * (j // 16))) & 15
        m = q & 7           # twice the E2M1 magnitude: 0 1 2 3 4 6 8 12
        a = tl.where(m < 4, m, (2 + (m & 1)) << tl.maximum((m >> 1) - 1, 0))
        e = _u8(p, o)       # GGML_E8M0_TO_FP32_HALF's bits: (e - 1) << 23, a subnormal for e < 2
        s = tl.where(e < 2, 2097152 << e, (e - 1) << 23).to(tl.float32, bitcast=True)
        v = tl.where(q >= 8, -a, a).to(tl.float32) * s
    elif TYPE == NVFP4:     # d[4] (UE4M3 per 16 values), qs[32] (sub-block s: bytes 8s..8s+7, low nibbles then high)
        o = (k // 64) * 36
        j = k % 64
        q = (_u8(p, o + 4 + 8 * (j // 16) + j % 8) >> (4 * ((j // 8) % 2))) & 15
        m = q & 7           # twice the E2M1 magnitude, as MXFP4's
        a = tl.where(m < 4, m, (2 + (m & 1)) << tl.maximum((m >> 1) - 1, 0))
        u = _u8(p, o + j // 16)     # ggml_ue4m3_to_fp32: half of 1.m * 2^(e - 7), m * 2^-9 for e = 0; 0x7F is 0
        e = (u >> 3) & 15
        s = tl.where(e == 0, (u & 7).to(tl.float32) * 0.0009765625,
                     (((e + 119) << 23) | ((u & 7) << 20)).to(tl.float32, bitcast=True))
        s = tl.where(u == 127, 0.0, s)
        v = tl.where(q >= 8, -a, a).to(tl.float32) * s
    elif TYPE == Q1_0:      # d, qs[16]: value j is d where bit j % 8 of byte j // 8 is set, else -d
        o = (k // 128) * 18
        j = k % 128
        d = _f16(p, o)
        v = tl.where(((_u8(p, o + 2 + j // 8) >> (j % 8)) & 1) != 0, d, -d)
    elif TYPE == Q2_0:      # d, qs[16] (2 bits a value, four a byte from the low bits): (q - 1) * d
        o = (k // 64) * 18
        j = k % 64
        q = (_u8(p, o + 2 + j // 4) >> (2 * (j % 4))) & 3
        v = (q - 1).to(tl.float32) * _f16(p, o)
    else:                   # IQ4_XS: d, scales_h (u16, 2 bits per 32), scales_l[4] (a nibble per 32), qs[128]
        tl.static_assert(TYPE == IQ4_XS, "no value rule for this type")
        o = (k // 256) * 136
        j = k % 256
        g = j // 32
        q = (_u8(p, o + 8 + 16 * g + j % 16) >> (4 * ((j // 16) % 2))) & 15
        sh = _u8(p, o + 2) | (_u8(p, o + 3) << 8)
        sc = ((_u8(p, o + 4 + g // 2) >> (4 * (g % 2))) & 15) | (((sh >> (2 * g)) & 3) << 4)
        v = _f16(p, o) * ((sc - 32) * tl.load(lut + q)).to(tl.float32)
    return v


# ------------------------------------------------------------------------------------------------ activations
# Before a product with block-format weights, llama.cpp rounds the activations to the weight's dot type: 8-bit
# blocks of 32 (Q8_0, Q8_1: d = amax/127 stored as F16, q = x * 127/amax rounded half to even, as the x86
# quantizers) or of 256 (Q8_K: d = 1/iscale in float32, iscale = -127/max with max the value of largest |x|). The
# kernels round the same way in registers (ACT 1 and 2; 0: no rounding), so the GPU's products are the CPU's.
ACT_NONE: tl.constexpr = tl.constexpr(0)
ACT_Q8: tl.constexpr = tl.constexpr(1)
ACT_Q8_K: tl.constexpr = tl.constexpr(2)

ACT_OF_DOT_TYPE = {T.Q8_0: 1, T.Q8_1: 1, T.Q8_K: 2}


@triton.jit
def _rint(v):
    """Round to nearest, halves to even (|v| < 2^22): the float32 addition of 1.5 * 2^23 rounds the fraction away."""
    return (v + 12582912.0) - 12582912.0


@triton.jit
def _mul_rn(a, b):
    """a * b rounded to float32 on its own: an explicit fma with zero, which the compiler does not fuse with the
    addition that follows (a plain product followed by + c becomes one fma, rounding once: not ggml's value)."""
    return tl.fma(a, b, 0.0)


@triton.jit
def _q8_blocks(v, ACT: tl.constexpr):
    """v [NB, G] (G values per block along axis 1) quantized as the dot type's quantizer: (q as float32, d [NB])."""
    if ACT == ACT_Q8:
        amax = tl.max(tl.abs(v), axis=1)
        d = (amax / 127.0).to(tl.float16).to(tl.float32)
        iv = tl.where(amax != 0.0, 127.0 / tl.where(amax != 0.0, amax, 1.0), 0.0)
        q = _rint(_mul_rn(v, iv[:, None]))
    else:
        mx = _signed_extreme(v)
        zero = mx == 0.0
        isc = tl.where(zero, 0.0, -127.0 / tl.where(zero, 1.0, mx))
        d = tl.where(zero, 0.0, 1.0 / tl.where(zero, 1.0, isc))
        q = tl.minimum(_rint(_mul_rn(v, isc[:, None])), 127.0)
    return q, d


@triton.jit
def _round_blocks(xb, ACT: tl.constexpr):
    """xb [NB, G] (G values per block along axis 1) rounded as the dot type's quantizer, as float32 values."""
    q, d = _q8_blocks(xb, ACT)
    return q * d[:, None]


@triton.jit
def _round_act(x, BK: tl.constexpr, ACT: tl.constexpr):
    """x [BK] rounded block by block (BK a multiple of the block size)."""
    if ACT == ACT_NONE:
        return x
    G: tl.constexpr = 32 if ACT == ACT_Q8 else 256
    return tl.reshape(_round_blocks(tl.reshape(x, [BK // G, G]), ACT), [BK])


@triton.jit
def round_act(x, out, K, sx, so, ACT: tl.constexpr, BK: tl.constexpr):
    """out[r, :K] = x[r, :K] rounded to the dot type (the prompt path, before dequantized tiles and cuBLAS)."""
    r = tl.program_id(0).to(tl.int64)
    ks = tl.program_id(1) * BK + tl.arange(0, BK)
    v = tl.load(x + r * sx + ks, mask=ks < K, other=0.0)
    tl.store(out + r * so + ks, _round_act(v, BK, ACT), mask=ks < K)


# ------------------------------------------------------------------------------------------------ kernels
@triton.jit
def matvec(w, x, y, lut, N, K, KC, sw, sx, sy, ss, NC: tl.constexpr, TYPE: tl.constexpr, ACT: tl.constexpr,
           BN: tl.constexpr, BK: tl.constexpr):
    """y[s, c, r] = sum over k in split s of value(w row r, k) * round(x[c])[k], for c < NC; split s covers
    k in [s * KC, (s + 1) * KC) (KC a multiple of BK; the caller sums the splits, or there is one). w rows sw
    bytes apart; x and y float32 with column strides sx and sy and split stride ss (elements); x rounded to the
    dot type (ACT) block by block on the way in. Splitting K keeps enough loads in flight to fill the memory
    system when N alone gives too few programs."""
    pid = tl.program_id(0)
    sp = tl.program_id(1)
    rows = pid * BN + tl.arange(0, BN)
    p = w + tl.minimum(rows, N - 1).to(tl.int64)[:, None] * sw
    cols = tl.arange(0, 16)
    y += sp * ss
    if NC == 1:
        acc = tl.zeros([BN], tl.float32)
    else:
        acc2 = tl.zeros([BN, 16], tl.float32)
    for k0 in range(sp * KC, tl.minimum(sp * KC + KC, K), BK):
        ks = k0 + tl.arange(0, BK)
        km = ks < K
        v = _value(p, tl.minimum(ks, K - 1)[None, :], lut, TYPE)
        if NC == 1:
            xv = _round_act(tl.load(x + ks, mask=km, other=0.0), BK, ACT)
            acc += tl.sum(v * xv[None, :], axis=1)
        else:
            xt = tl.load(x + cols[:, None] * sx + ks[None, :], mask=km[None, :] & (cols[:, None] < NC), other=0.0)
            if ACT != ACT_NONE:
                G: tl.constexpr = 32 if ACT == ACT_Q8 else 256
                xt = tl.reshape(_round_blocks(tl.reshape(xt, [16 * BK // G, G]), ACT), [16, BK])
            acc2 += tl.dot(v, tl.trans(xt), input_precision="ieee")
    if NC == 1:
        tl.store(y + rows, acc, mask=rows < N)
    else:
        tl.store(y + cols[None, :] * sy + rows[:, None], acc2, mask=(rows[:, None] < N) & (cols[None, :] < NC))


# matvec_half's launch shape on a GPU (rows per program, K tile, warps): the least time over a 7B layer's three
# shapes on an H200 (benchmarks/gpu_matvec.py --half: 2.0-2.7 TB/s; (4, 512, 4) gave 7B F16 decode 89 tok/s,
# this 190): many small programs keep more loads in flight than a few wide ones
HALF_SHAPE = (1, 512, 2)


@triton.jit
def matvec_half(w, x, y, N, K, sw, sx, sy, NC: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """y[c, r] = w row r . round(x[c]) for c < NC: F16 or BF16 weights (w's element type), x float32 rounded to
    w's type on the way in (as ggml's vec_dot_f16 / vec_dot_bf16 round the activations), float32 sums. The
    activations are loaded at the tile's full shape (one layout with the weights: 16-byte loads, no conversions)
    and every tile element keeps its own partial sum until the end. Rows sw elements apart."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    p = w + tl.minimum(rows, N - 1).to(tl.int64)[:, None] * sw
    zr = tl.zeros([BN, 1], tl.int32)
    for c in tl.static_range(NC):
        acc = tl.zeros([BN, BK], tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)[None, :]
            km = (ks + zr) < K
            wv = tl.load(p + ks, mask=km, other=0.0).to(tl.float32)
            xv = tl.load(x + c * sx + ks + zr, mask=km, other=0.0)
            if w.dtype.element_ty == tl.bfloat16:
                xv = _round_bf16(xv)
            else:
                xv = xv.to(tl.float16).to(tl.float32)
            acc += wv * xv
        tl.store(y + c * sy + rows, tl.sum(acc, axis=1), mask=rows < N)


@triton.jit
def _source_rows(idx, r, NR, USE_IDX: tl.constexpr):
    """The weight rows that output rows r read (int64): idx[r] for a gather, else r (clamped to NR - 1)."""
    rc = tl.minimum(r, NR - 1)
    if USE_IDX:
        return tl.load(idx + rc).to(tl.int64)
    return rc.to(tl.int64)


@triton.jit
def dequant(w, idx, out, lut, NR, K, sw, so, USE_IDX: tl.constexpr, TYPE: tl.constexpr, OUT_F16: tl.constexpr,
            BR: tl.constexpr, BK: tl.constexpr):
    """out[r, k] = value(w row (idx[r] if USE_IDX else r), k) for r < NR, k < K; out rows so elements apart."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    src = _source_rows(idx, r, NR, USE_IDX)
    p = w + src[:, None] * sw
    ks = tl.program_id(1) * BK + tl.arange(0, BK)
    v = _value(p, tl.minimum(ks, K - 1)[None, :], lut, TYPE)
    m = (r[:, None] < NR) & (ks[None, :] < K)
    dst = out + r.to(tl.int64)[:, None] * so + ks[None, :]
    if OUT_F16:
        tl.store(dst, v.to(tl.float16), mask=m)
    else:
        tl.store(dst, v, mask=m)


@triton.jit
def _store_rows(out, r, so, j, v, ok, OUT_F16: tl.constexpr):
    """v at columns j of output rows r where ok (r, j and ok broadcast with v)."""
    dst = out + r.to(tl.int64) * so + j
    if OUT_F16:
        tl.store(dst, v.to(tl.float16), mask=ok)
    else:
        tl.store(dst, v, mask=ok)


@triton.jit
def dequant_fast(w, idx, out, NR, K, sw, so, USE_IDX: tl.constexpr, TYPE: tl.constexpr, OUT_F16: tl.constexpr,
                 BR: tl.constexpr):
    """``dequant`` for Q4_0, Q8_0, Q4_K and Q6_K, 256 values of BR rows per program: the values laid out in the
    tile's last axis as they lie in the block (32 consecutive bytes -> 32 consecutive outputs), so loads and
    stores are wide, and each scale is read once per group instead of once per value. The value rules'
    arithmetic, so the same values (prompts dequantize weights for cuBLAS: ~0.2 TB/s with the value rules'
    per-element byte gathers on a Q4_K_M 7B)."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    src = _source_rows(idx, r, NR, USE_IDX)
    col = tl.program_id(1) * 256
    r4 = r[:, None, None, None]
    if TYPE == Q4_K or TYPE == Q6_K:
        o = w + src * sw + tl.program_id(1) * (144 if TYPE == Q4_K else 210)
        b4 = o[:, None, None, None]
        l = tl.arange(0, 32)[None, None, None, :]
        if TYPE == Q4_K:        # [BR, c, h, l]: value 64c + 32h + l, nibble h of qs[32c + l], group 2c + h
            c = tl.arange(0, 4)[None, :, None, None]
            h = tl.arange(0, 2)[None, None, :, None]
            q = (tl.load(b4 + 16 + 32 * c + l).to(tl.int32) >> (4 * h)) & 15
            g = 2 * c + h
            v = _f16(b4, 0) * (_kscale(b4, 0, g, False) * q).to(tl.float32) \
                - _f16(b4, 2) * _kscale(b4, 0, g, True).to(tl.float32)
            j = 64 * c + 32 * h + l
        else:                   # [BR, n, qd, l]: value 128n + 32qd + l
            n = tl.arange(0, 2)[None, :, None, None]
            qd = tl.arange(0, 4)[None, None, :, None]
            ql = (tl.load(b4 + 64 * n + l + 32 * (qd % 2)).to(tl.int32) >> (4 * (qd // 2))) & 15
            qh = (tl.load(b4 + 128 + 32 * n + l).to(tl.int32) >> (2 * qd)) & 3
            sc = _i8(b4, 192 + 8 * n + l // 16 + 2 * qd)
            v = _f16(b4, 208) * (sc * ((ql | (qh << 4)) - 32)).to(tl.float32)
            j = 128 * n + 32 * qd + l
        _store_rows(out, r4, so, col + j, v, r4 < NR, OUT_F16)
    else:                       # Q4_0 / Q8_0: eight blocks of 32 [BR, b, h, l]: value 32b + 16h + l
        bi = tl.arange(0, 8)[None, :, None, None]
        blk = tl.program_id(1) * 8 + bi
        bs: tl.constexpr = 18 if TYPE == Q4_0 else 34
        b4 = (w + src * sw)[:, None, None, None] + tl.minimum(blk, K // 32 - 1) * bs
        h = tl.arange(0, 2)[None, None, :, None]
        l = tl.arange(0, 16)[None, None, None, :]
        if TYPE == Q4_0:
            q = (tl.load(b4 + 2 + l).to(tl.int32) >> (4 * h)) & 15
            v = _f16(b4, 0) * (q - 8).to(tl.float32)
        else:
            v = _f16(b4, 0) * _i8(b4, 2 + 16 * h + l).to(tl.float32)
        _store_rows(out, r4, so, 32 * blk + 16 * h + l, v, (r4 < NR) & (blk < K // 32), OUT_F16)


FAST_DEQUANT = frozenset({T.Q4_0, T.Q8_0, T.Q4_K, T.Q6_K})
FAST_DEQUANT_ON = True      # False: the value rules for every type (gpu_bench.py --dequant values, to compare)


# ------------------------------------------------------------------------------------------------ row kernels
# One launch where torch would take several: RMS norm with its weight (and a residual add), and rope.

@triton.jit
def rms_norm_mul(x, w, a, out, ne0, sx, sw, sa, so, eps, xq, xd, xs, HAS_W: tl.constexpr, HAS_ADD: tl.constexpr,
                 BLOCK: tl.constexpr, QG: tl.constexpr = 0):
    """out[r] = x[r] / sqrt(mean(x[r]^2) + eps) (* w[r % rows of w]) (+ a[r]); rows of ne0 float32 values,
    contiguous within a row, row strides sx, sw, sa, so (sw 0: one weight row for all). QG 32 or 256 (one row):
    the row also quantized for the integer decode kernels, as mmvq.quantize_act does it (int8 xq, scales xd, sums
    of 16 xs), saving their products a launch."""
    r = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    m = i < ne0
    v = tl.load(x + r * sx + i, mask=m, other=0.0)
    y = v * (1.0 / tl.sqrt(tl.sum(v * v, axis=0) / ne0 + eps))
    if HAS_W:
        y = y * tl.load(w + r * sw + i, mask=m, other=0.0)
    if HAS_ADD:
        y = y + tl.load(a + r * sa + i, mask=m, other=0.0)
    tl.store(out + r * so + i, y, mask=m)
    if QG > 0:
        _quantize_act_blocks(tl.reshape(y, [BLOCK // QG, QG]), ne0 // QG, xq, xd, xs, QG)


@triton.jit
def _quantize_act_blocks(v, nb, xq, xd, xs, G: tl.constexpr):
    """Blocks b < nb of v [NB, G] to the integer kernels' activation form (mmvq.quantize_act's arithmetic): G 32,
    Q8_0/Q8_1 (d = max|x| / 127 as F16, q = x * 127/max|x| rounded half to even); G 256, Q8_K (the signed value of
    largest |x| maps to -127); int8 q at xq[b * G + j], d at xd[b], sums of each 16 q at xs[b * G/16 + i]."""
    NB: tl.constexpr = v.shape[0]
    b = tl.arange(0, NB)
    j = tl.arange(0, G)
    if G == 32:
        q, d = _q8_blocks(v, ACT_Q8)
    else:
        q, d = _q8_blocks(v, ACT_Q8_K)
    qi = q.to(tl.int32)
    ok = b < nb
    tl.store(xq + b[:, None] * G + j[None, :], qi.to(tl.int8), mask=ok[:, None])
    tl.store(xd + b, d, mask=ok)
    g16 = tl.arange(0, G // 16)
    tl.store(xs + b[:, None] * (G // 16) + g16[None, :], tl.sum(tl.reshape(qi, [NB, G // 16, 16]), axis=2),
             mask=ok[:, None])


@triton.jit
def rope(x, pos, powers, ff, mix, out, n_head, sx_t, sx_h, so_t, so_h, ne0, freq_scale, mscale,
         N_DIMS: tl.constexpr, NEOX: tl.constexpr, HAS_FF: tl.constexpr, HAS_MIX: tl.constexpr,
         HALF: tl.constexpr, TAIL: tl.constexpr, rows=None, STORE: tl.constexpr = False):
    """Rotate the first N_DIMS values of row (token t, head h) by theta_i = pos[t] * powers[i] (/ ff[i]), YaRN's
    mix where given; NEOX pairs (i, i + N_DIMS/2), else (2i, 2i + 1); values past N_DIMS copied. ggml-cuda's form.
    STORE: the rotated row goes straight into the KV cache, at cache row rows[t] of head h, converted to the
    cache's type as set_rows converts (the rope and the store of K in one launch)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    i = tl.arange(0, HALF)
    m = i < N_DIMS // 2
    th = tl.load(pos + t).to(tl.float32) * tl.load(powers + i, mask=m, other=0.0)
    if HAS_FF:
        # IEEE division: Triton's float32 `/` is div.full.f32 (2 ulp), 1e-4 rad off at a position of 1000
        th = tl.math.div_rn(th, tl.load(ff + i, mask=m, other=1.0))
    theta = th * freq_scale
    if HAS_MIX:
        mx = tl.load(mix + i, mask=m, other=0.0)
        theta = theta * (1.0 - mx) + th * mx
    c = tl.cos(theta) * mscale
    s = tl.sin(theta) * mscale
    xr = x + t * sx_t + h * sx_h
    if STORE:
        orow = out + tl.load(rows + t).to(tl.int64) * so_t + h * so_h
    else:
        orow = out + t * so_t + h * so_h
    if NEOX:
        i0 = i
        i1 = i + N_DIMS // 2
    else:
        i0 = 2 * i
        i1 = 2 * i + 1
    x0 = tl.load(xr + i0, mask=m, other=0.0)
    x1 = tl.load(xr + i1, mask=m, other=0.0)
    _store_as(orow + i0, x0 * c - x1 * s, m)
    _store_as(orow + i1, x0 * s + x1 * c, m)
    if TAIL > 0:
        j = N_DIMS + tl.arange(0, TAIL)
        mj = j < ne0
        _store_as(orow + j, tl.load(xr + j, mask=mj, other=0.0), mj)


@triton.jit
def _store_as(p, v, m):
    """float32 values stored at p in p's type: F32 as they are, F16 to nearest, BF16 to nearest even (``_bf16_rne``:
    ggml_cpu_fp32_to_bf16; Triton's interpreter would truncate)."""
    if p.dtype.element_ty == tl.bfloat16:
        tl.store(p.to(tl.pointer_type(tl.int16)), (_bf16_rne(v) >> 16).to(tl.int16), mask=m)
    else:
        tl.store(p, v.to(p.dtype.element_ty), mask=m)


@triton.jit
def _bf16_rne(x):
    """float32 values' bits rounded to nearest even on the top 16 (ggml_compute_fp32_to_bf16; the GPU's cvt.rn does
    the same, Triton's interpreter truncates in .to(bfloat16)): int32, the BF16 bits in the top half."""
    u = x.to(tl.int32, bitcast=True)
    return (u + 0x7FFF + ((u >> 16) & 1)) & -65536


@triton.jit
def _round_bf16(x):
    """float32 values rounded to BF16 (``_bf16_rne``), as float32."""
    return _bf16_rne(x).to(tl.float32, bitcast=True)


@triton.jit
def set_rows(src, idx, dst, ne0, ss, sd, ss2, sd2, BLOCK: tl.constexpr):
    """dst[i2, idx[r]] = src[i2, r] (rows of float32 values, converted to dst's type; one index list for every
    i2, as the KV cache's heads): the cache's store in one launch. Grid (rows, i2, column blocks)."""
    r = tl.program_id(0).to(tl.int64)
    i2 = tl.program_id(1).to(tl.int64)
    i = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    m = i < ne0
    to = tl.load(idx + r).to(tl.int64)
    v = tl.load(src + i2 * ss2 + r * ss + i, mask=m, other=0.0)
    _store_as(dst + i2 * sd2 + to * sd + i, v, m)


# ------------------------------------------------------------------------------------------------ quantized rows
# The KV cache in a block format (llama.cpp's --cache-type-k/-v q8_0, q4_0, q4_1, q5_0, q5_1): its store quantizes
# float32 rows as ggml-cpu's from_float does, so a cache written here holds the CPU's bytes (Q8_0: x86's
# quantize_row_q8_0, d = amax / 127, q = x * 127/amax rounded half to even; the others ggml's quantize_row_*_ref:
# d from the block's signed extreme (Q4_0, Q5_0) or its range (Q4_1, Q5_1), q truncated after + 8.5 / + 16.5 /
# + 0.5, Q4_0 and Q4_1 capped at 15 and Q5_0 at 31). Its reads go through the value rules.
KV_QUANT_TYPES = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1)
KV_BLOCK_BYTES = {T.Q8_0: 34, T.Q4_0: 18, T.Q4_1: 20, T.Q5_0: 22, T.Q5_1: 24}


@triton.jit
def _signed_extreme(xf):
    """Per block (rows of xf [NB, G]): the value of largest magnitude, the first such (ggml's ``amax < |v|``)."""
    j = tl.argmax(tl.abs(xf), axis=1)
    g = tl.arange(0, xf.shape[1])
    return tl.sum(tl.where(g[None, :] == j[:, None], xf, 0.0), axis=1)


@triton.jit
def _quantize_blocks(xf, xl, xh, pb, bm, TYPE: tl.constexpr):
    """Quantize BB blocks of 32 values (xf [BB, 32] in order; xl, xh [BB, 16] its halves) into the blocks at
    byte pointers pb [BB], those where bm."""
    j16 = tl.arange(0, 16)
    m2 = bm[:, None]
    if TYPE == Q8_0:
        amax = tl.max(tl.abs(xf), axis=1)
        iv = tl.where(amax != 0.0, 127.0 / tl.where(amax != 0.0, amax, 1.0), 0.0)
        tl.store(pb.to(tl.pointer_type(tl.float16)), (amax / 127.0).to(tl.float16), mask=bm)
        g = tl.arange(0, 32)
        q = _rint(_mul_rn(xf, iv[:, None])).to(tl.int32)
        tl.store((pb[:, None] + 2 + g[None, :]).to(tl.pointer_type(tl.int8)), q.to(tl.int8), mask=m2)
    elif TYPE == Q4_0 or TYPE == Q5_0:
        mx = _signed_extreme(xf)
        if TYPE == Q4_0:
            d = mx / -8.0
        else:
            d = mx / -16.0
        iv = tl.where(d != 0.0, 1.0 / tl.where(d != 0.0, d, 1.0), 0.0)
        tl.store(pb.to(tl.pointer_type(tl.float16)), d.to(tl.float16), mask=bm)
        if TYPE == Q4_0:
            q0 = tl.minimum((_mul_rn(xl, iv[:, None]) + 8.5).to(tl.int32), 15)
            q1 = tl.minimum((_mul_rn(xh, iv[:, None]) + 8.5).to(tl.int32), 15)
            tl.store(pb[:, None] + 2 + j16[None, :], (q0 | (q1 << 4)).to(tl.uint8), mask=m2)
        else:
            q0 = tl.minimum((_mul_rn(xl, iv[:, None]) + 16.5).to(tl.int32), 31)
            q1 = tl.minimum((_mul_rn(xh, iv[:, None]) + 16.5).to(tl.int32), 31)
            qh = tl.sum(((q0 >> 4) << j16[None, :]) | ((q1 >> 4) << (j16[None, :] + 16)), axis=1)
            for b in tl.static_range(4):
                tl.store(pb + 2 + b, ((qh >> (8 * b)) & 255).to(tl.uint8), mask=bm)
            tl.store(pb[:, None] + 6 + j16[None, :], ((q0 & 15) | ((q1 & 15) << 4)).to(tl.uint8), mask=m2)
    else:
        tl.static_assert(TYPE == Q4_1 or TYPE == Q5_1, "no KV store for this type")
        lo = tl.min(xf, axis=1)
        hi = tl.max(xf, axis=1)
        if TYPE == Q4_1:
            d = (hi - lo) / 15.0
        else:
            d = (hi - lo) / 31.0
        iv = tl.where(d != 0.0, 1.0 / tl.where(d != 0.0, d, 1.0), 0.0)
        tl.store(pb.to(tl.pointer_type(tl.float16)), d.to(tl.float16), mask=bm)
        tl.store((pb + 2).to(tl.pointer_type(tl.float16)), lo.to(tl.float16), mask=bm)
        q0 = (_mul_rn(xl - lo[:, None], iv[:, None]) + 0.5).to(tl.int32)
        q1 = (_mul_rn(xh - lo[:, None], iv[:, None]) + 0.5).to(tl.int32)
        if TYPE == Q4_1:
            q0 = tl.minimum(q0, 15)
            q1 = tl.minimum(q1, 15)
            tl.store(pb[:, None] + 4 + j16[None, :], (q0 | (q1 << 4)).to(tl.uint8), mask=m2)
        else:           # ggml's (uint8_t) cast: no cap; the fifth bits go to qh
            qh = tl.sum((((q0 >> 4) & 1) << j16[None, :]) | (((q1 >> 4) & 1) << (j16[None, :] + 16)), axis=1)
            for b in tl.static_range(4):
                tl.store(pb + 4 + b, ((qh >> (8 * b)) & 255).to(tl.uint8), mask=bm)
            tl.store(pb[:, None] + 8 + j16[None, :], ((q0 & 15) | ((q1 & 15) << 4)).to(tl.uint8), mask=m2)


@triton.jit
def quantize_rows(src, idx, dst, NR, ne0, ss1, ss2, dne1, dne2, sd1, sd2, sd3, USE_IDX: tl.constexpr,
                  TYPE: tl.constexpr, BYTES: tl.constexpr, BB: tl.constexpr):
    """Float32 rows into rows of a block format (BYTES per block of 32): row r of source plane i2 (program 0 and
    1; elements ss1 and ss2 apart) goes to dst row idx[r] of plane i2 (USE_IDX: set_rows into the KV cache,
    sd1/sd2 bytes apart), or to the row numbered i2 * NR + r of dst's [dne1, dne2, ...] rows (sd1, sd2, sd3 bytes
    apart: a copy into a view). Program 2 takes BB blocks of 32."""
    r = tl.program_id(0).to(tl.int64)
    i2 = tl.program_id(1).to(tl.int64)
    blk = tl.program_id(2) * BB + tl.arange(0, BB)
    nb = ne0 // 32
    bm = blk < nb
    bc = tl.minimum(blk, nb - 1).to(tl.int64)
    srow = src + i2 * ss2 + r * ss1
    g = tl.arange(0, 32)
    j16 = tl.arange(0, 16)
    xf = tl.load(srow + bc[:, None] * 32 + g[None, :])
    xl = tl.load(srow + bc[:, None] * 32 + j16[None, :])
    xh = tl.load(srow + bc[:, None] * 32 + 16 + j16[None, :])
    if USE_IDX:
        drow = dst + i2 * sd2 + tl.load(idx + r).to(tl.int64) * sd1
    else:
        gr = i2 * NR + r
        drow = dst + (gr % dne1) * sd1 + ((gr // dne1) % dne2) * sd2 + (gr // (dne1 * dne2)) * sd3
    _quantize_blocks(xf, xl, xh, drow + bc * BYTES, bm, TYPE)


@triton.jit
def dequant_rows3(w, out, lut, NR, K, ne1, ne2, sw1, sw2, sw3, so, TYPE: tl.constexpr, OUT_F16: tl.constexpr,
                  BR: tl.constexpr, BK: tl.constexpr):
    """``dequant`` of rows laid out in up to three levels: row r of [ne1, ne2, ...] rows (r % ne1 the fastest)
    lies at w + (r % ne1) sw1 + (r // ne1 % ne2) sw2 + (r // (ne1 ne2)) sw3 bytes: a permuted or strided view
    of a block-format tensor (the KV cache's heads) to contiguous rows of F16 or F32."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    rc = tl.minimum(r, NR - 1).to(tl.int64)
    p = w + (rc % ne1) * sw1 + ((rc // ne1) % ne2) * sw2 + (rc // (ne1 * ne2)) * sw3
    ks = tl.program_id(1) * BK + tl.arange(0, BK)
    v = _value(p[:, None], tl.minimum(ks, K - 1)[None, :], lut, TYPE)
    _store_rows(out, r[:, None], so, ks[None, :], v, (r[:, None] < NR) & (ks[None, :] < K), OUT_F16)


@triton.jit
def swiglu(g, u, out, n, BLOCK: tl.constexpr, GELU: tl.constexpr = False):
    """out = silu(g) * u over n contiguous float32 values (ggml's silu: x / (1 + exp(-x))); with GELU, ggml-cpu's
    GELU of g instead (its F16 table: the tanh form at g's F16 rounding, rounded to F16; 0 at or below -10, g at or
    above 10)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    a = tl.load(g + i, mask=m, other=0.0)
    if GELU:
        h = a.to(tl.float16).to(tl.float32)
        y = 0.7978845608028654 * h * (1.0 + 0.044715 * h * h)
        e = tl.exp(-2.0 * tl.abs(y))
        t = (1.0 - e) / (1.0 + e)
        gl = (0.5 * h * (1.0 + tl.where(y < 0.0, -t, t))).to(tl.float16).to(tl.float32)
        act = tl.where(a <= -10.0, 0.0, tl.where(a >= 10.0, a, gl))
    else:
        act = a / (1.0 + tl.exp(-a))
    tl.store(out + i, act * tl.load(u + i, mask=m, other=0.0), mask=m)


@triton.jit
def attn_decode(q, k, v, mask, out, pml, n_kv, chunk, rk, sq_h, sk_n, sk_h, sv_n, sv_h, so_h, so_s, scale, lut, cap,
                sinks, HAS_MASK: tl.constexpr, SPLIT: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                BD: tl.constexpr, BDV: tl.constexpr, BN: tl.constexpr, QUANT: tl.constexpr = False,
                KT: tl.constexpr = 1, VT: tl.constexpr = 1, HAS_CAP: tl.constexpr = False,
                HAS_SINK: tl.constexpr = False):
    """One query row per head (decode) over the F16 cache: softmax(scale q k^T + mask) v for head h = program 0,
    its KV head h // rk; q rounded to F16 as ggml-cuda's kernels read it (to BF16 over a BF16 K, ggml-cpu's dot
    type); online softmax over tiles of BN keys.
    Program 1 takes keys [s * chunk, (s + 1) * chunk) (flash-decoding: a short cache gives H programs, too few for
    the device): with SPLIT, it writes its unnormalised sum to out[h, s] and (max, sum of weights) to pml[h, s] for
    attn_combine; without, the normalised row to out[h]. Rows with every key masked give zeros (as the other
    paths' nan_to_num). With QUANT, k and v are the bytes of a cache in block formats KT and VT (strides in
    bytes), read through the value rules, and q is rounded to Q8_0 blocks (K's dot type) instead of F16.
    HAS_CAP: scores soft-capped, cap * tanh(s / cap) (gemma 2); HAS_SINK: sinks[h] joins the softmax as a logit with
    no value (gpt-oss; the first split holds it)."""
    h = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1).to(tl.int64)
    kh = h // rk
    di = tl.arange(0, BD)
    dv = tl.arange(0, BDV)
    qv = tl.load(q + h * sq_h + di, mask=di < D, other=0.0)
    if QUANT:
        if KT == BF16:                                      # q rounded to K's dot type: BF16 (as ggml-cpu)
            qv = _round_bf16(qv)
        elif KT != F16 and KT != F32:                       # Q8_0 blocks
            qv = _round_act(qv, BD, ACT_Q8)
        else:
            qv = qv.to(tl.float16).to(tl.float32)
    elif k.dtype.element_ty == tl.bfloat16:
        qv = _round_bf16(qv)
    else:
        qv = qv.to(tl.float16).to(tl.float32)
    m_i = tl.full([], -float("inf"), tl.float32)
    l_i = tl.full([], 0.0, tl.float32)
    if HAS_SINK:
        sk = tl.load(sinks + h).to(tl.float32)
        m_i = tl.where(sp == 0, sk, m_i)
        l_i = tl.where(sp == 0, 1.0, l_i)
    acc = tl.zeros([BDV], tl.float32)
    lo = sp * chunk
    hi = tl.minimum(lo + chunk, n_kv)
    for n0 in range(lo, hi, BN):
        ns = n0 + tl.arange(0, BN)
        nm = ns < hi
        if QUANT:       # rows past the chunk read its last row (in the tensor) and are masked below
            nc = tl.minimum(ns, hi - 1).to(tl.int64)
            kt = _value(k + kh * sk_h + nc[:, None] * sk_n, tl.minimum(di, D - 1)[None, :], lut, KT)
            kt = tl.where(di[None, :] < D, kt, 0.0)
        else:
            kt = tl.load(k + kh * sk_h + ns[:, None] * sk_n + di[None, :], mask=nm[:, None] & (di[None, :] < D),
                         other=0.0).to(tl.float32)
        s = tl.sum(kt * qv[None, :], axis=1) * scale
        if HAS_CAP:         # cap * tanh(s / cap), tanh from one exp of -2|y| (stable both ways)
            y = s / cap
            e = tl.exp(-2.0 * tl.abs(y))
            t = (1.0 - e) / (1.0 + e)
            s = cap * tl.where(y < 0.0, -t, t)
        if HAS_MASK:
            s += tl.load(mask + ns, mask=nm, other=0.0).to(tl.float32)
        s = tl.where(nm, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        m_use = tl.where(m_new == -float("inf"), 0.0, m_new)
        p = tl.exp(s - m_use)
        alpha = tl.exp(m_i - m_use)
        if QUANT:
            vt = _value(v + kh * sv_h + nc[:, None] * sv_n, tl.minimum(dv, DV - 1)[None, :], lut, VT)
            vt = tl.where(nm[:, None] & (dv[None, :] < DV), vt, 0.0)
        else:
            vt = tl.load(v + kh * sv_h + ns[:, None] * sv_n + dv[None, :], mask=nm[:, None] & (dv[None, :] < DV),
                         other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * vt, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    if SPLIT:
        tl.store(out + h * so_h + sp * so_s + dv, acc, mask=dv < DV)
        tl.store(pml + (h * tl.num_programs(1) + sp) * 2, m_i)
        tl.store(pml + (h * tl.num_programs(1) + sp) * 2 + 1, l_i)
    else:
        tl.store(out + h * so_h + dv, tl.where(l_i > 0.0, acc / tl.where(l_i > 0.0, l_i, 1.0), 0.0),
                 mask=dv < DV)


@triton.jit
def attn_combine(part, pml, out, n_split, sp_h, sp_s, so_h, DV: tl.constexpr, BDV: tl.constexpr,
                 BS: tl.constexpr):
    """The splits of attn_decode for head h = program 0: each part rescaled by exp(its max - the row's max), summed,
    divided by the summed weights; a row whose every key was masked gives zeros."""
    h = tl.program_id(0).to(tl.int64)
    si = tl.arange(0, BS)
    sm = si < n_split
    dv = tl.arange(0, BDV)
    m = tl.load(pml + (h * n_split + si) * 2, mask=sm, other=-float("inf"))
    ls = tl.load(pml + (h * n_split + si) * 2 + 1, mask=sm, other=0.0)
    mx = tl.max(m, axis=0)
    mx = tl.where(mx == -float("inf"), 0.0, mx)
    w = tl.where(sm, tl.exp(m - mx), 0.0)
    acc = tl.load(part + h * sp_h + si[:, None] * sp_s + dv[None, :], mask=sm[:, None] & (dv[None, :] < DV),
                  other=0.0)
    num = tl.sum(acc * w[:, None], axis=0)
    den = tl.sum(ls * w, axis=0)
    tl.store(out + h * so_h + dv, tl.where(den > 0.0, num / tl.where(den > 0.0, den, 1.0), 0.0), mask=dv < DV)
