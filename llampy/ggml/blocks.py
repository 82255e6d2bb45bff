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

from .quants_tables import kvalues_iq4nl
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
    lut: tuple | None = None     # value table of the non-linear formats (IQ4_*: kvalues_iq4nl)
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
        size = {"f16": 2, "bf16": 2, "f32": 4, "u8": 1, "i8": 1, "u16": 2, "i16": 2}
        end = max(f.offset + size[f.dtype] * f.count for f in b.fields)
        assert end == b.type_size, (t, end)


_check()

__all__ = ["BLOCKS", "BlockFormat", "Field"]
