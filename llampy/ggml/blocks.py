"""Block formats: one table of what each tensor type's bytes are, beside ``types.TYPE_TRAITS``.

For each format: its block size and bytes, its fields (name, byte offset, element type, count, bits per packed
value), the type llama.cpp rounds the other operand to before a dot product (``dot_type``), how its values are
grouped under scales (``group``: values per sub-block scale), its value table for the non-linear formats (``lut``),
and its *decode rule*: a small Numba function (``@njit(inline="always")``) that turns the block at byte ``o`` of a
uint8 row into its ``blck_size`` float32 values. The rule is written once, here; backends specialise their kernels
from it (``backends/cpu/dot_blocks.py``: dequantized tiles, and the SIMD decode kernels read the same field
offsets), and the tests hold it against the library's reference dequantizer (``quants.dequantize``).

    value j of a block = d * scale[j // group] * q[j] - dmin * min[j // group]     (the k-quant shape)

The rule's parts are separate functions too (``q2_k_quant(w, o, j)``, ``q2_k_scale(w, o, s)``, ...), for kernels
that keep the integers apart from the scales, as ggml's integer dot products do.

Formats whose kernels predate this table (Q4_0 ... Q8_0, Q4_K, Q5_K, Q6_K) are listed with their facts only
(``decode`` None): their kernels still state those facts themselves (dot_q32.py, dot_kquant.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import njit

from . import quants_tables as tab
from .quants_tables import kvalues_fp4, kvalues_iq4nl
from .types import QK_K, GGMLType, TYPE_TRAITS

T = GGMLType


@dataclass(frozen=True)
class Field:
    name: str
    offset: int          # bytes from the block's start
    dtype: str           # element type: 'f16', 'bf16', 'f32', 'u8', 'i8', 'u16', 'i16'
    count: int = 1       # elements
    bits: int = 0        # bits per value packed in the elements (0: each element is one value)


@dataclass(frozen=True)
class BlockFormat:
    type: GGMLType
    blck_size: int
    type_size: int
    dot_type: GGMLType
    fields: tuple
    group: int = 0               # values per sub-block scale (0: one scale for the block)
    lut: tuple | None = None     # value table of the non-linear formats (IQ4_*: kvalues_iq4nl; the IQ grid formats:
    #                              (grid, the factor ggml's integer dot product applies at the end))
    decode: object = None       # njit (w uint8[:], o byte offset, out float32[:], oo) -> None

    def field(self, name: str) -> Field:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(f"{self.type.name} has no field {name!r}")

    @property
    def name(self) -> str:
        return self.type.name


# ------------------------------------------------------------------------------------------------ scalar reads

@njit(cache=True, inline="always")
def u16_at(w, o):
    return np.int32(w[o]) | (np.int32(w[o + 1]) << 8)


@njit(cache=True, inline="always")
def f16_from_bits(h):
    """F16 bits (an integer 0..65535) -> its value as float32 (exact)."""
    e = (h >> 10) & 31
    m = h & 1023
    if e == 0:
        v = np.float32(math.ldexp(np.float64(m), -24))
    elif e == 31:
        v = np.float32(np.inf) if m == 0 else np.float32(np.nan)
    else:
        v = np.float32(math.ldexp(np.float64(1024 + m), e - 25))
    return -v if h & 0x8000 else v


@njit(cache=True, inline="always")
def bf16_from_bits(h):
    """BF16 bits (an integer 0..65535) -> its value as float32 (exact)."""
    e = (h >> 7) & 255
    m = h & 127
    if e == 0:
        v = np.float32(math.ldexp(np.float64(m), -133))
    elif e == 255:
        v = np.float32(np.inf) if m == 0 else np.float32(np.nan)
    else:
        v = np.float32(math.ldexp(np.float64(128 + m), e - 134))
    return -v if h & 0x8000 else v


@njit(cache=True, inline="always")
def f16_at(w, o):
    """The F16 value stored little-endian at byte o, as float32 (exact)."""
    return f16_from_bits(u16_at(w, o))


@njit(cache=True, inline="always")
def bf16_at(w, o):
    """The BF16 value stored little-endian at byte o, as float32."""
    return bf16_from_bits(u16_at(w, o))


# ------------------------------------------------------------------------------------------------ decode rules
# Q2_K (84 bytes): scales[16] (low nibble: scale, high: min, one pair per 16 values), qs[64] (2 bits per value),
# d, dmin (F16). Value j: byte qs[32 * (j // 128) + j % 32], bits 2 * ((j % 128) // 32).

@njit(cache=True, inline="always")
def q2_k_quant(w, o, j):
    return (np.int32(w[o + 16 + 32 * (j >> 7) + (j & 31)]) >> (2 * ((j & 127) >> 5))) & 3


@njit(cache=True, inline="always")
def q2_k_scale(w, o, s):
    return np.int32(w[o + s]) & 15


@njit(cache=True, inline="always")
def q2_k_min(w, o, s):
    return np.int32(w[o + s]) >> 4


@njit(cache=True)
def decode_q2_k(w, o, out, oo):
    d = f16_at(w, o + 80)
    dmin = f16_at(w, o + 82)
    for s in range(16):
        dl = np.float32(d * np.float32(q2_k_scale(w, o, s)))
        ml = np.float32(dmin * np.float32(q2_k_min(w, o, s)))
        for j in range(16 * s, 16 * s + 16):
            out[oo + j] = np.float32(dl * np.float32(q2_k_quant(w, o, j))) - ml


# Q3_K (110 bytes): hmask[32] (the third bit), qs[64] (two low bits, as Q2_K's), scales[12] (sixteen 6-bit scales,
# packed: low nibbles in bytes 0..7, the top two bits in 8..11), d (F16). Value j: low bits as Q2_K, high bit
# hmask[j % 32] bit 4 * (j // 128) + (j % 128) // 32; q = low - 4 where the high bit is clear.

@njit(cache=True, inline="always")
def q3_k_quant(w, o, j):
    lo = (np.int32(w[o + 32 + 32 * (j >> 7) + (j & 31)]) >> (2 * ((j & 127) >> 5))) & 3
    hb = (np.int32(w[o + (j & 31)]) >> (4 * (j >> 7) + ((j & 127) >> 5))) & 1
    return lo - 4 + 4 * hb


@njit(cache=True, inline="always")
def q3_k_scale(w, o, s):
    lo = (np.int32(w[o + 96 + (s & 7)]) >> (4 * (s >> 3))) & 15
    hi = (np.int32(w[o + 104 + (s & 3)]) >> (2 * (s >> 2))) & 3
    return (lo | (hi << 4)) - 32


@njit(cache=True)
def decode_q3_k(w, o, out, oo):
    d = f16_at(w, o + 108)
    for s in range(16):
        dl = np.float32(d * np.float32(q3_k_scale(w, o, s)))
        for j in range(16 * s, 16 * s + 16):
            out[oo + j] = np.float32(dl * np.float32(q3_k_quant(w, o, j)))


KVALUES_IQ4NL = kvalues_iq4nl.astype(np.int32)


# IQ4_NL (18 bytes): d (F16), qs[16]; value j < 16: kvalues[qs[j] & 15], j >= 16: kvalues[qs[j - 16] >> 4].

@njit(cache=True, inline="always")
def iq4_nl_quant(w, o, j):
    return KVALUES_IQ4NL[(np.int32(w[o + 2 + (j & 15)]) >> (4 * (j >> 4))) & 15]


@njit(cache=True)
def decode_iq4_nl(w, o, out, oo):
    d = f16_at(w, o)
    for j in range(32):
        out[oo + j] = np.float32(d * np.float32(iq4_nl_quant(w, o, j)))


# IQ4_XS (136 bytes): d (F16), scales_h (u16: two bits per 32 values), scales_l[4] (a nibble per 32 values),
# qs[128] (IQ4_NL's nibbles, 16 bytes per 32 values); scale of group g: (low nibble | high bits << 4) - 32.

@njit(cache=True, inline="always")
def iq4_xs_quant(w, o, j):
    return KVALUES_IQ4NL[(np.int32(w[o + 8 + 16 * (j >> 5) + (j & 15)]) >> (4 * ((j >> 4) & 1))) & 15]


@njit(cache=True, inline="always")
def iq4_xs_scale(w, o, g):
    lo = (np.int32(w[o + 4 + (g >> 1)]) >> (4 * (g & 1))) & 15
    hi = (u16_at(w, o + 2) >> (2 * g)) & 3
    return (lo | (hi << 4)) - 32


@njit(cache=True)
def decode_iq4_xs(w, o, out, oo):
    d = f16_at(w, o)
    for g in range(8):
        dl = np.float32(d * np.float32(iq4_xs_scale(w, o, g)))
        for j in range(32 * g, 32 * g + 32):
            out[oo + j] = np.float32(dl * np.float32(iq4_xs_quant(w, o, j)))


# TQ2_0 (66 bytes): qs[64] (2 bits per value, laid out as Q2_K's), d (F16); value j: (q - 1) * d, q in 0..2.

@njit(cache=True, inline="always")
def tq2_0_quant(w, o, j):
    return (np.int32(w[o + 32 * (j >> 7) + (j & 31)]) >> (2 * ((j & 127) >> 5))) & 3


@njit(cache=True)
def decode_tq2_0(w, o, out, oo):
    d = f16_at(w, o + 64)
    for j in range(256):
        out[oo + j] = np.float32(np.float32(tq2_0_quant(w, o, j) - 1) * d)


# TQ1_0 (54 bytes): qs[48] (five base-3 digits per byte), qh[4] (four per byte), d (F16). A byte's digit n is
# ((uint8)(byte * 3^n) * 3) >> 8 (the byte stores the fraction ceil(v * 256 / 243)). Value j: j < 160: byte j % 32,
# digit j // 32; j < 240: byte 32 + (j - 160) % 16, digit (j - 160) // 16; else byte 48 + (j - 240) % 4, digit
# (j - 240) // 4; (digit - 1) * d.
POW3 = np.array([1, 3, 9, 27, 81], np.int32)


@njit(cache=True, inline="always")
def tq1_0_byte_digit(j):
    """(byte offset in the block, digit) of value j."""
    if j < 160:
        return j & 31, j >> 5
    if j < 240:
        return 32 + ((j - 160) & 15), (j - 160) >> 4
    return 48 + ((j - 240) & 3), (j - 240) >> 2


@njit(cache=True, inline="always")
def tq1_0_quant(w, o, j):
    b, n = tq1_0_byte_digit(j)
    return (((np.int32(w[o + b]) * POW3[n]) & 255) * 3) >> 8


@njit(cache=True)
def decode_tq1_0(w, o, out, oo):
    d = f16_at(w, o + 52)
    for j in range(256):
        out[oo + j] = np.float32(np.float32(tq1_0_quant(w, o, j) - 1) * d)


# MXFP4 (17 bytes): e (E8M0 scale), qs[16] (FP4 E2M1 nibbles, laid out as IQ4_NL's); value j: kvalues_fp4[nibble]
# (twice the E2M1 value) * 2^(e - 128) (GGML_E8M0_TO_FP32_HALF: half the scale, exact, subnormal for e < 2).
KVALUES_FP4 = kvalues_fp4.astype(np.int32)


# ggml's GGML_E8M0_TO_FP32_HALF as a table: 2^(e - 128) for each exponent byte (e < 2: float32 subnormals). A
# table load, not libm's ldexp: one call per 32-value block was most of MXFP4's decode time.
E8M0_HALF = np.array([math.ldexp(1.0, e - 128) for e in range(256)], dtype=np.float32)


@njit(cache=True, inline="always")
def e8m0_half(e):
    return E8M0_HALF[np.int32(e)]


@njit(cache=True, inline="always")
def mxfp4_quant(w, o, j):
    return KVALUES_FP4[(np.int32(w[o + 1 + (j & 15)]) >> (4 * (j >> 4))) & 15]


@njit(cache=True)
def decode_mxfp4(w, o, out, oo):
    d = e8m0_half(w[o])
    for j in range(32):
        out[oo + j] = np.float32(np.float32(mxfp4_quant(w, o, j)) * d)


# NVFP4 (36 bytes, 64 values): d[4] (UE4M3 scales, one per 16 values), qs[32] (E2M1 nibbles; sub-block s: bytes
# 8s..8s+7, values 16s+i low nibble, 16s+8+i high); value: kvalues_fp4[nibble] * ggml_ue4m3_to_fp32(d[s]) (half
# the UE4M3 value, 0 for the bytes 0x00 and 0x7F; bit 7 is not read).
UE4M3_HALF = np.array([0.0 if b in (0, 0x7F) else
                       math.ldexp((b & 7), -10) if (b >> 3) & 15 == 0 else math.ldexp(8 + (b & 7), ((b >> 3) & 15) - 11)
                       for b in range(256)], dtype=np.float32)


@njit(cache=True, inline="always")
def nvfp4_quant(w, o, j):
    s = j >> 4
    return KVALUES_FP4[(np.int32(w[o + 4 + 8 * s + (j & 7)]) >> (4 * ((j >> 3) & 1))) & 15]


@njit(cache=True)
def decode_nvfp4(w, o, out, oo):
    for s in range(4):
        d = UE4M3_HALF[np.int32(w[o + s])]
        for j in range(16 * s, 16 * s + 16):
            out[oo + j] = np.float32(np.float32(nvfp4_quant(w, o, j)) * d)


# Q1_0 (18 bytes, 128 values): d (F16), qs[16] (a sign bit per value, value j: bit j % 8 of byte j // 8); value
# d where the bit is set, else -d.
@njit(cache=True, inline="always")
def q1_0_quant(w, o, j):
    return 2 * ((np.int32(w[o + 2 + (j >> 3)]) >> (j & 7)) & 1) - 1


@njit(cache=True)
def decode_q1_0(w, o, out, oo):
    d = f16_at(w, o)
    for j in range(128):
        out[oo + j] = d if q1_0_quant(w, o, j) > 0 else -d


# Q2_0 (18 bytes, 64 values): d (F16), qs[16] (2 bits per value, value j: bits 2 (j % 4) of byte j // 4); value
# (q - 1) * d, q in 0..3.
@njit(cache=True, inline="always")
def q2_0_quant(w, o, j):
    return (np.int32(w[o + 2 + (j >> 2)]) >> (2 * (j & 3))) & 3


@njit(cache=True)
def decode_q2_0(w, o, out, oo):
    d = f16_at(w, o)
    for j in range(64):
        out[oo + j] = np.float32(np.float32(q2_0_quant(w, o, j) - 1) * d)


# ------------------------------------------------------------------------------------------------ IQ grid formats
# IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S: each group of 32 values is 4 (8-value) or 8 (4-value) entries of a grid
# of unsigned magnitudes (``grid``: the table's entries as bytes), a sign bit per value and an integer scale per 16
# values, ``2 * nibble + 1``. The parts, per group g of the super-block at byte o:
#     <fmt>_grid_idx(w, o, g, c)  grid entry of chunk c (values 8c..8c+7, or 4c..4c+3 for the 4-value grids)
#     <fmt>_signs(w, o, g)        the 32 sign bits (bit v: value v negated)
#     <fmt>_ls(w, o, g, h)        the 4-bit scale of half h (values 16h..16h+15)
# value v of group g = d * (0.5 + ls) * f * grid[idx][v % n] * (-1 if sign bit v), f = 0.25 (IQ2_*), 0.5
# (IQ3_XXS), or d * (2 ls + 1) * grid (IQ3_S): the reference dequantizer's float order; ``dot_scale``: the factor
# ggml's integer dot products apply to d * sum((2 ls + 1) * grid * x) at the end (0.125, 0.25, 1).
KSIGNS = tab.ksigns_iq2xs.astype(np.int64)
IQ2XXS_GRID = tab.IQ2XXS_GRID_BYTES
IQ2XS_GRID = tab.IQ2XS_GRID_BYTES
IQ2S_GRID = tab.IQ2S_GRID_BYTES
IQ3XXS_GRID = tab.IQ3XXS_GRID_BYTES
IQ3S_GRID = tab.IQ3S_GRID_BYTES


@njit(cache=True, inline="always")
def u32_at(w, o):
    return (np.int64(w[o]) | (np.int64(w[o + 1]) << 8) | (np.int64(w[o + 2]) << 16)
            | (np.int64(w[o + 3]) << 24))


@njit(cache=True, inline="always")
def _ksigns4(aux):
    """Four 7-bit sign indices (bits 0..27 of aux) -> 32 sign bits (ksigns_iq2xs: the eighth bit is the parity)."""
    return (KSIGNS[aux & 127] | (KSIGNS[(aux >> 7) & 127] << 8) | (KSIGNS[(aux >> 14) & 127] << 16)
            | (KSIGNS[(aux >> 21) & 127] << 24))


# IQ2_XXS (66 bytes): d (F16), then per group 8 bytes: 4 grid indices (iq2xxs_grid, 8 values each), a u32 of four
# 7-bit sign indices and the scale in its top 4 bits.
@njit(cache=True, inline="always")
def iq2_xxs_grid_idx(w, o, g, c):
    return np.int64(w[o + 2 + 8 * g + c])


@njit(cache=True, inline="always")
def iq2_xxs_signs(w, o, g):
    return _ksigns4(u32_at(w, o + 6 + 8 * g))


@njit(cache=True, inline="always")
def iq2_xxs_ls(w, o, g, h):
    return u32_at(w, o + 6 + 8 * g) >> 28


# IQ2_XS (74 bytes): d (F16), qs[32] u16 (9-bit grid index into iq2xs_grid, 7-bit sign index), scales[8] (a nibble
# per 16 values).
@njit(cache=True, inline="always")
def iq2_xs_grid_idx(w, o, g, c):
    return np.int64(u16_at(w, o + 2 + 8 * g + 2 * c) & 511)


@njit(cache=True, inline="always")
def iq2_xs_signs(w, o, g):
    s = np.int64(0)
    for c in range(4):
        s |= KSIGNS[u16_at(w, o + 2 + 8 * g + 2 * c) >> 9] << (8 * c)
    return s


@njit(cache=True, inline="always")
def iq2_xs_ls(w, o, g, h):
    return (np.int64(w[o + 66 + g]) >> (4 * h)) & 15


# IQ2_S (82 bytes): d (F16), qs[32] (low 8 bits of the grid indices into iq2s_grid), signs[32] (a bit per value),
# qh[8] (two high index bits per chunk), scales[8] (a nibble per 16 values).
@njit(cache=True, inline="always")
def iq2_s_grid_idx(w, o, g, c):
    return np.int64(w[o + 2 + 4 * g + c]) | ((np.int64(w[o + 66 + g]) << (8 - 2 * c)) & 0x300)


@njit(cache=True, inline="always")
def iq2_s_signs(w, o, g):
    return u32_at(w, o + 34 + 4 * g)


@njit(cache=True, inline="always")
def iq2_s_ls(w, o, g, h):
    return (np.int64(w[o + 74 + g]) >> (4 * h)) & 15


# IQ3_XXS (98 bytes): d (F16), qs[64] (grid indices into iq3xxs_grid, 4 values each), then per group a u32 of four
# 7-bit sign indices and the scale in its top 4 bits.
@njit(cache=True, inline="always")
def iq3_xxs_grid_idx(w, o, g, c):
    return np.int64(w[o + 2 + 8 * g + c])


@njit(cache=True, inline="always")
def iq3_xxs_signs(w, o, g):
    return _ksigns4(u32_at(w, o + 66 + 4 * g))


@njit(cache=True, inline="always")
def iq3_xxs_ls(w, o, g, h):
    return u32_at(w, o + 66 + 4 * g) >> 28


# IQ3_S (110 bytes): d (F16), qs[64] (low 8 bits of the indices into iq3s_grid), qh[8] (the ninth bits, one byte
# per group), signs[32] (a bit per value), scales[4] (a nibble per group).
@njit(cache=True, inline="always")
def iq3_s_grid_idx(w, o, g, c):
    return np.int64(w[o + 2 + 8 * g + c]) | (((np.int64(w[o + 66 + g]) >> c) & 1) << 8)


@njit(cache=True, inline="always")
def iq3_s_signs(w, o, g):
    return u32_at(w, o + 74 + 4 * g)


@njit(cache=True, inline="always")
def iq3_s_ls(w, o, g, h):
    return (np.int64(w[o + 106 + (g >> 1)]) >> (4 * (g & 1))) & 15


@njit(cache=True, inline="always")
def _grid_put(out, oo, db, grid, gi, n, signs, v0):
    """n values of grid entry gi at out[oo..], value v0 + j of the group negated where its sign bit is set."""
    for j in range(n):
        v = np.float32(db * np.float32(grid[gi, j]))
        out[oo + j] = -v if (signs >> (v0 + j)) & 1 else v


@njit(cache=True)
def decode_iq2_xxs(w, o, out, oo):
    d = f16_at(w, o)
    for g in range(8):
        db = np.float32(np.float32(d * np.float32(np.float32(0.5) + np.float32(iq2_xxs_ls(w, o, g, 0))))
                        * np.float32(0.25))
        sg = iq2_xxs_signs(w, o, g)
        for c in range(4):
            _grid_put(out, oo + 32 * g + 8 * c, db, IQ2XXS_GRID, iq2_xxs_grid_idx(w, o, g, c), 8, sg, 8 * c)


@njit(cache=True)
def decode_iq2_xs(w, o, out, oo):
    d = f16_at(w, o)
    for g in range(8):
        sg = iq2_xs_signs(w, o, g)
        for c in range(4):
            db = np.float32(np.float32(d * np.float32(np.float32(0.5) + np.float32(iq2_xs_ls(w, o, g, c >> 1))))
                            * np.float32(0.25))
            _grid_put(out, oo + 32 * g + 8 * c, db, IQ2XS_GRID, iq2_xs_grid_idx(w, o, g, c), 8, sg, 8 * c)


@njit(cache=True)
def decode_iq2_s(w, o, out, oo):
    d = f16_at(w, o)
    for g in range(8):
        sg = iq2_s_signs(w, o, g)
        for c in range(4):
            db = np.float32(np.float32(d * np.float32(np.float32(0.5) + np.float32(iq2_s_ls(w, o, g, c >> 1))))
                            * np.float32(0.25))
            _grid_put(out, oo + 32 * g + 8 * c, db, IQ2S_GRID, iq2_s_grid_idx(w, o, g, c), 8, sg, 8 * c)


@njit(cache=True)
def decode_iq3_xxs(w, o, out, oo):
    d = f16_at(w, o)
    for g in range(8):
        db = np.float32(np.float32(d * np.float32(np.float32(0.5) + np.float32(iq3_xxs_ls(w, o, g, 0))))
                        * np.float32(0.5))
        sg = iq3_xxs_signs(w, o, g)
        for c in range(8):
            _grid_put(out, oo + 32 * g + 4 * c, db, IQ3XXS_GRID, iq3_xxs_grid_idx(w, o, g, c), 4, sg, 4 * c)


@njit(cache=True)
def decode_iq3_s(w, o, out, oo):
    d = f16_at(w, o)
    for g in range(8):
        db = np.float32(d * np.float32(1 + 2 * iq3_s_ls(w, o, g, 0)))
        sg = iq3_s_signs(w, o, g)
        for c in range(8):
            _grid_put(out, oo + 32 * g + 4 * c, db, IQ3S_GRID, iq3_s_grid_idx(w, o, g, c), 4, sg, 4 * c)


# IQ1_S (50 bytes): d (F16), qs[32] (low 8 bits of the indices into iq1s_grid: 8 values in -1..1 each), qh[8]
# (u16 per group: three high index bits per chunk, the scale in bits 12..14, the delta's sign in bit 15).
# IQ1_M (56 bytes): qs[32], qh[16] (a nibble per chunk: three high index bits, the delta's sign), scales[8] (four
# u16: 3-bit scales per 16 values, d's F16 bits in their top nibbles). Value: d * (2 s + 1) * (grid + delta),
# delta = -/+ 1/8 (IQ1S_DELTA, IQ1M_DELTA: ggml's dot products add delta times the block sums at the end).
IQ1S_GRID = tab.IQ1S_GRID_BYTES
IQ1_DELTA = np.float32(0.125)


@njit(cache=True, inline="always")
def iq1_s_grid_idx(w, o, g, c):
    return np.int64(w[o + 2 + 4 * g + c]) | (((np.int64(u16_at(w, o + 34 + 2 * g)) >> (3 * c)) & 7) << 8)


@njit(cache=True, inline="always")
def iq1_s_ls(w, o, g):
    return (np.int64(u16_at(w, o + 34 + 2 * g)) >> 12) & 7


@njit(cache=True, inline="always")
def iq1_s_neg(w, o, g):
    """Whether group g's delta is negative."""
    return (u16_at(w, o + 34 + 2 * g) & 0x8000) != 0


@njit(cache=True, inline="always")
def iq1_m_grid_idx(w, o, g, c):
    return np.int64(w[o + 4 * g + c]) | (((np.int64(w[o + 32 + 2 * g + (c >> 1)]) >> (4 * (c & 1))) & 7) << 8)


@njit(cache=True, inline="always")
def iq1_m_neg(w, o, g, c):
    return ((np.int64(w[o + 32 + 2 * g + (c >> 1)]) >> (4 * (c & 1))) & 8) != 0


@njit(cache=True, inline="always")
def iq1_m_ls(w, o, g, h):
    return (np.int64(u16_at(w, o + 48 + 2 * (g >> 1))) >> (6 * (g & 1) + 3 * h)) & 7


@njit(cache=True, inline="always")
def iq1_m_d(w, o):
    u = ((u16_at(w, o + 48) >> 12) | ((u16_at(w, o + 50) >> 8) & 0x00F0) | ((u16_at(w, o + 52) >> 4) & 0x0F00)
         | (u16_at(w, o + 54) & 0xF000))
    return f16_from_bits(u)


@njit(cache=True, inline="always")
def _iq1_put(out, oo, dl, gi, neg):
    delta = -IQ1_DELTA if neg else IQ1_DELTA
    for j in range(8):
        out[oo + j] = np.float32(dl * np.float32(np.float32(IQ1S_GRID[gi, j]) + delta))


@njit(cache=True)
def decode_iq1_s(w, o, out, oo):
    d = f16_at(w, o)
    for g in range(8):
        dl = np.float32(d * np.float32(2 * iq1_s_ls(w, o, g) + 1))
        neg = iq1_s_neg(w, o, g)
        for c in range(4):
            _iq1_put(out, oo + 32 * g + 8 * c, dl, iq1_s_grid_idx(w, o, g, c), neg)


@njit(cache=True)
def decode_iq1_m(w, o, out, oo):
    d = iq1_m_d(w, o)
    for g in range(8):
        for c in range(4):
            dl = np.float32(d * np.float32(2 * iq1_m_ls(w, o, g, c >> 1) + 1))
            _iq1_put(out, oo + 32 * g + 8 * c, dl, iq1_m_grid_idx(w, o, g, c), iq1_m_neg(w, o, g, c))


@njit(cache=True)
def decode_f16(w, o, out, oo):
    out[oo] = f16_at(w, o)


@njit(cache=True)
def decode_bf16(w, o, out, oo):
    out[oo] = bf16_at(w, o)


# ------------------------------------------------------------------------------------------------ the table

def _f(name, offset, dtype, count=1, bits=0):
    return Field(name, offset, dtype, count, bits)


_KV = tuple(int(v) for v in kvalues_iq4nl)

BLOCKS: dict[GGMLType, BlockFormat] = {b.type: b for b in [
    BlockFormat(T.F16, 1, 2, T.F16, (_f("v", 0, "f16"),), decode=decode_f16),
    BlockFormat(T.BF16, 1, 2, T.BF16, (_f("v", 0, "bf16"),), decode=decode_bf16),
    BlockFormat(T.Q2_K, QK_K, 84, T.Q8_K,
                (_f("scales", 0, "u8", 16, 4), _f("qs", 16, "u8", 64, 2), _f("d", 80, "f16"), _f("dmin", 82, "f16")),
                group=16, decode=decode_q2_k),
    BlockFormat(T.Q3_K, QK_K, 110, T.Q8_K,
                (_f("hmask", 0, "u8", 32, 1), _f("qs", 32, "u8", 64, 2), _f("scales", 96, "u8", 12, 6),
                 _f("d", 108, "f16")),
                group=16, decode=decode_q3_k),
    BlockFormat(T.IQ4_NL, 32, 18, T.Q8_0, (_f("d", 0, "f16"), _f("qs", 2, "u8", 16, 4)),
                lut=_KV, decode=decode_iq4_nl),
    BlockFormat(T.IQ4_XS, QK_K, 136, T.Q8_K,
                (_f("d", 0, "f16"), _f("scales_h", 2, "u16", 1, 2), _f("scales_l", 4, "u8", 4, 4),
                 _f("qs", 8, "u8", 128, 4)),
                group=32, lut=_KV, decode=decode_iq4_xs),
    BlockFormat(T.TQ2_0, QK_K, 66, T.Q8_K, (_f("qs", 0, "u8", 64, 2), _f("d", 64, "f16")), decode=decode_tq2_0),
    BlockFormat(T.TQ1_0, QK_K, 54, T.Q8_K,
                (_f("qs", 0, "u8", 48, 0), _f("qh", 48, "u8", 4, 0), _f("d", 52, "f16")), decode=decode_tq1_0),
    BlockFormat(T.MXFP4, 32, 17, T.Q8_0, (_f("e", 0, "u8"), _f("qs", 1, "u8", 16, 4)),
                lut=tuple(int(v) for v in kvalues_fp4), decode=decode_mxfp4),
    BlockFormat(T.NVFP4, 64, 36, T.Q8_0, (_f("d", 0, "u8", 4), _f("qs", 4, "u8", 32, 4)), group=16,
                lut=tuple(int(v) for v in kvalues_fp4), decode=decode_nvfp4),
    BlockFormat(T.Q1_0, 128, 18, T.Q8_0, (_f("d", 0, "f16"), _f("qs", 2, "u8", 16, 1)), decode=decode_q1_0),
    BlockFormat(T.Q2_0, 64, 18, T.Q8_0, (_f("d", 0, "f16"), _f("qs", 2, "u8", 16, 2)), decode=decode_q2_0),
    BlockFormat(T.IQ2_XXS, QK_K, 66, T.Q8_K, (_f("d", 0, "f16"), _f("qs", 2, "u16", 32)),
                group=32, lut=(tab.iq2xxs_grid, 0.125), decode=decode_iq2_xxs),
    BlockFormat(T.IQ2_XS, QK_K, 74, T.Q8_K, (_f("d", 0, "f16"), _f("qs", 2, "u16", 32), _f("scales", 66, "u8", 8, 4)),
                group=16, lut=(tab.iq2xs_grid, 0.125), decode=decode_iq2_xs),
    BlockFormat(T.IQ2_S, QK_K, 82, T.Q8_K,
                (_f("d", 0, "f16"), _f("qs", 2, "u8", 32), _f("signs", 34, "u8", 32, 1), _f("qh", 66, "u8", 8, 2),
                 _f("scales", 74, "u8", 8, 4)),
                group=16, lut=(tab.iq2s_grid, 0.125), decode=decode_iq2_s),
    BlockFormat(T.IQ3_XXS, QK_K, 98, T.Q8_K, (_f("d", 0, "f16"), _f("qs", 2, "u8", 64), _f("sas", 66, "u32", 8)),
                group=32, lut=(tab.iq3xxs_grid, 0.25), decode=decode_iq3_xxs),
    BlockFormat(T.IQ3_S, QK_K, 110, T.Q8_K,
                (_f("d", 0, "f16"), _f("qs", 2, "u8", 64), _f("qh", 66, "u8", 8, 1), _f("signs", 74, "u8", 32, 1),
                 _f("scales", 106, "u8", 4, 4)),
                group=32, lut=(tab.iq3s_grid, 1.0), decode=decode_iq3_s),
    BlockFormat(T.IQ1_S, QK_K, 50, T.Q8_K, (_f("d", 0, "f16"), _f("qs", 2, "u8", 32), _f("qh", 34, "u16", 8)),
                group=32, lut=(tab.iq1s_grid, 1.0), decode=decode_iq1_s),
    BlockFormat(T.IQ1_M, QK_K, 56, T.Q8_K, (_f("qs", 0, "u8", 32), _f("qh", 32, "u8", 16, 4),
                                           _f("scales", 48, "u8", 8, 3)),
                group=16, lut=(tab.iq1s_grid, 1.0), decode=decode_iq1_m),
    # facts only: these formats' kernels (dot_q32.py, dot_kquant.py) predate the table
    BlockFormat(T.F32, 1, 4, T.F32, (_f("v", 0, "f32"),)),
    BlockFormat(T.Q4_0, 32, 18, T.Q8_0, (_f("d", 0, "f16"), _f("qs", 2, "u8", 16, 4))),
    BlockFormat(T.Q4_1, 32, 20, T.Q8_1, (_f("d", 0, "f16"), _f("m", 2, "f16"), _f("qs", 4, "u8", 16, 4))),
    BlockFormat(T.Q5_0, 32, 22, T.Q8_0, (_f("d", 0, "f16"), _f("qh", 2, "u8", 4, 1), _f("qs", 6, "u8", 16, 4))),
    BlockFormat(T.Q5_1, 32, 24, T.Q8_1,
                (_f("d", 0, "f16"), _f("m", 2, "f16"), _f("qh", 4, "u8", 4, 1), _f("qs", 8, "u8", 16, 4))),
    BlockFormat(T.Q8_0, 32, 34, T.Q8_0, (_f("d", 0, "f16"), _f("qs", 2, "i8", 32))),
    BlockFormat(T.Q4_K, QK_K, 144, T.Q8_K,
                (_f("d", 0, "f16"), _f("dmin", 2, "f16"), _f("scales", 4, "u8", 12, 6), _f("qs", 16, "u8", 128, 4)),
                group=32),
    BlockFormat(T.Q5_K, QK_K, 176, T.Q8_K,
                (_f("d", 0, "f16"), _f("dmin", 2, "f16"), _f("scales", 4, "u8", 12, 6), _f("qh", 16, "u8", 32, 1),
                 _f("qs", 48, "u8", 128, 4)),
                group=32),
    BlockFormat(T.Q6_K, QK_K, 210, T.Q8_K,
                (_f("ql", 0, "u8", 128, 4), _f("qh", 128, "u8", 64, 2), _f("scales", 192, "i8", 16),
                 _f("d", 208, "f16")),
                group=16),
    # the activation formats the dot products round to
    BlockFormat(T.Q8_1, 32, 36, T.Q8_1, (_f("d", 0, "f16"), _f("s", 2, "f16"), _f("qs", 4, "i8", 32))),
    BlockFormat(T.Q8_K, QK_K, 292, T.Q8_K, (_f("d", 0, "f32"), _f("qs", 4, "i8", 256), _f("bsums", 260, "i16", 16))),
]}


def _check():
    for t, b in BLOCKS.items():
        tt = TYPE_TRAITS[t]
        assert (b.blck_size, b.type_size, b.dot_type) == (tt.blck_size, tt.type_size, tt.vec_dot_type), t
        size = {"f16": 2, "bf16": 2, "f32": 4, "u8": 1, "i8": 1, "u16": 2, "i16": 2, "u32": 4}
        end = max(f.offset + size[f.dtype] * f.count for f in b.fields)
        assert end == b.type_size, (t, end)


_check()

__all__ = ["BLOCKS", "BlockFormat", "Field"]
