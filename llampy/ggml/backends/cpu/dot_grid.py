"""Dot products of the grid formats (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) against Q8_K
activations, a decoded token's matrix-vector products in llama.cpp's x86 float order: their super-block intrinsics,
step and final functions and kernels on ``dot_blocks``' row tiling (``_mv``). Called through ``dot_blocks``
(``mul_mat``, ``bind_decode``); their prompts take dot_kquant_tiled's tiles, their dequantized tiles are
dot_blocks'.

Each intrinsic decodes a whole super-block (``iq2xs_lanes`` ...): its grid indices, sign bytes and scales as vectors
at the table's field offsets (``blocks.BLOCKS``), the grid entries gathered by index, where one scalar per index,
sign and scale through bounds-wrapping array reads took 1.2-2.3x ggml's time for a decoded token.

Float order, per (weight row, activation row) pair (ggml-cpu/arch/x86/quants.c, AVX2 forms):
- IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S: exact lanes of grid bytes times signed x times 2 ls + 1, ``acc =
  fma(d_w * d_x, lanes, acc)``, then ``f * hsum_float_8(acc)`` (f: 1/8, 1/4 for IQ3_XXS, 1 for IQ3_S).
- IQ1_S: the grid lanes as above, the delta term an integer per super-block (block sums times +-scale) in a scalar
  chain ``s = fma(d, isum, s)``; ``hsum_float_8(acc) + 1/8 * s``. IQ1_M: grid lanes and the deltas' lanes (+-x
  per chunk, scaled per 16 values) in two f32x8 accumulators, ``fma(1/8, hsum(acc2), hsum(acc1))``.
Integer lane sums are exact in any order; the float operations are ggml's, one for one.

A separate module so that Numba's cache keeps these kernels when dot_blocks.py changes and the other way round (the
cache checks a kernel's own file only): a change to what they take from dot_blocks (``_mv``, ``_quant_k``, the
intrinsics' helpers) needs this file touched too, so that its kernels compile again.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from ... import blocks as B
from ...types import GGMLType
from .dot_blocks import (IQ1M_BYTES, IQ1S_BYTES, IQ2S_BYTES, IQ2XS_BYTES, IQ2XXS_BYTES, IQ3S_BYTES, IQ3XXS_BYTES,
                         K_IQ1_M, K_IQ1_S, K_IQ2_S, K_IQ2_XS, K_IQ2_XXS, K_IQ3_S, K_IQ3_XXS, _V16, _V32, _W16, _abs8,
                         _mv, _quant_k, _shuf, _sign_of, _splat)
from .dot_kquant import _madd, _maddubs, i32x8_sum
from .simd import (_I16, _I32, _I8, _elem_ptr, _load, _ptr, f16_at, f32x8_fma, f32x8_hsum, fma32, i32x8,
                   i32x8_to_f32x8)

T = GGMLType


@intrinsic
def f16_bits(typingctx, u):
    """The F16 value of the bits in the low 16 bits of the integer u, as float32 (one vcvtph2ps; exact):
    ``blocks.f16_from_bits`` without its branches and libm's ldexp."""
    if not isinstance(u, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        h = builder.trunc(args[0], _I16)
        return builder.fpext(builder.bitcast(h, ir.HalfType()), ir.FloatType())
    return types.float32(u), codegen


@intrinsic
def iq1m_lanes(typingctx, tab, w, o, x, xo):
    """IQ1_M's two sets of eight int32 lanes of one super-block (the block at byte o of w, the 256 int8 activations
    at byte xo of x), ggml_vec_dot_iq1_m_q8_K's sumi1 and sumi2: per 32-value group the four grid entries (``tab``:
    iq1s_grid, eight values each) times x by the sign trick, and the deltas (+-1 per eight values, the sign bit of
    each index nibble) times x, each pair sum times its sixteen values' scale 2 ls + 1. The 32 grid indices, the
    sixteen scales and the deltas' byte masks are decoded as vectors for the whole block (one scalar each, with
    bounds-wrapping array reads, cost 2.3x ggml's time)."""
    def codegen(context, builder, sig, args):
        tty, wty, xty = sig.args[0], sig.args[1], sig.args[3]
        ity = context.get_value_type(types.intp)
        o = context.cast(builder, args[2], sig.args[2], types.intp)
        xo = context.cast(builder, args[4], sig.args[4], types.intp)

        def at(off, vty):
            return _load(builder, _ptr(context, builder, wty, args[1], builder.add(o, ir.Constant(ity, off)), vty))
        qs = at(_fo(T.IQ1_M, "qs"), _V32)
        qh = at(_fo(T.IQ1_M, "qh"), _V16)
        sc = at(_fo(T.IQ1_M, "scales"), ir.VectorType(_I16, 4))
        w32 = ir.VectorType(_I16, 32)
        # index 4g + c: qs[4g + c] | ((qh[2g + c // 2] >> 4 (c % 2)) & 7) << 8
        qhx = builder.zext(_shuf(builder, qh, qh, [j >> 1 for j in range(32)]), w32)
        idx = builder.or_(builder.zext(qs, w32),
                          builder.mul(builder.and_(qhx, ir.Constant(w32, [7, 0x70] * 16)),
                                      ir.Constant(w32, [256, 16] * 16)))
        # scale 2g + h: 2 ((sc[g // 2] >> (6 (g % 2) + 3 h)) & 7) + 1
        v16 = ir.VectorType(_I32, 16)
        s32 = builder.zext(_shuf(builder, sc, sc, [g >> 1 for g in range(8) for h in range(2)]), v16)
        sh = [6 * (g & 1) + 3 * h for g in range(8) for h in range(2)]
        s32 = builder.and_(builder.lshr(s32, ir.Constant(v16, sh)), _splat(v16, 7))
        s16 = builder.trunc(builder.add(builder.shl(s32, _splat(v16, 1)), _splat(v16, 1)), _W16)
        i64 = ir.IntType(64)
        tp = builder.bitcast(context.make_array(tty)(context, builder, args[0]).data, i64.as_pointer())
        ones = _splat(_V32, 1)
        dbit = ir.Constant(_V32, ([8] * 8 + [128] * 8) * 2)
        acc1 = acc2 = None
        for g in range(8):
            q = ir.Constant(ir.VectorType(i64, 4), None)
            for c in range(4):
                i = builder.zext(builder.extract_element(idx, ir.Constant(_I32, 4 * g + c)), ity)
                q = builder.insert_element(q, _load(builder, builder.gep(tp, [i])), ir.Constant(_I32, c))
            q = builder.bitcast(q, _V32)
            xv = _load(builder, _ptr(context, builder, xty, args[3], builder.add(xo, ir.Constant(ity, 32 * g)), _V32))
            sp = _shuf(builder, s16, s16, [2 * g] * 8 + [2 * g + 1] * 8)
            v1 = _madd(builder, sp, _maddubs(builder, _abs8(builder, q), _sign_of(builder, xv, q)))
            # the deltas' signs: chunk c negative where bit 3 + 4 (c % 2) of qh[2g + c // 2] is set; x ^ m - m is
            # ggml's sign_epi8(x, +-1) (-(-128) stays -128)
            hb = _shuf(builder, qh, qh, [2 * g + (v >> 4) for v in range(32)])
            m = builder.sext(builder.icmp_unsigned("!=", builder.and_(hb, dbit), _splat(_V32, 0)), _V32)
            v2 = _madd(builder, sp, _maddubs(builder, ones, builder.sub(builder.xor(xv, m), m)))
            acc1 = v1 if acc1 is None else builder.add(acc1, v1)
            acc2 = v2 if acc2 is None else builder.add(acc2, v2)
        return context.make_tuple(builder, sig.return_type, [acc1, acc2])
    return types.UniTuple(i32x8, 2)(tab, w, types.intp, x, types.intp), codegen


def _ksigns_ir(builder, s):
    """ksigns_iq2xs[s] of each lane of an integer vector s (7-bit sign indices): s with its parity as bit 7 (the
    table's rule: the eighth sign makes the count of minus signs even)."""
    t = s.type

    def sh(v, n):
        return builder.lshr(v, _splat(t, n))
    p = builder.xor(s, sh(s, 4))
    p = builder.xor(p, sh(p, 2))
    p = builder.xor(p, sh(p, 1))
    return builder.or_(s, builder.shl(builder.and_(p, _splat(t, 1)), _splat(t, 7)))


def _grid_groups(context, builder, sig, args, idx, ks8, sp, per=4):
    """The eight groups' lanes of a grid format's super-block, summed: group g's ``per`` table entries (args[0]:
    four uint64 of 8 values, or eight uint32 of 4) at lanes per * g .. of the index vector ``idx``, times the
    activations (args[3] from byte args[4] + 32 g) with the sign bits of bytes 4g .. 4g + 3 of ``ks8`` applied
    (bit v % 8 of byte 4g + v // 8 for value v, tested in byte lanes: a 0 / -1 mask m, x ^ m - m, ggml's xor-sub:
    -(-128) stays -128), the pair sums times ``sp(g)`` (a <16 x i16>)."""
    ity = context.get_value_type(types.intp)
    xo = context.cast(builder, args[4], sig.args[4], types.intp)
    et = ir.IntType(256 // per)          # four uint64 entries a group (8 values each) or eight uint32 (4 values)
    tp = builder.bitcast(context.make_array(sig.args[0])(context, builder, args[0]).data, et.as_pointer())
    bit = ir.Constant(_V32, [1 << (v % 8) for v in range(32)])
    acc = None
    for g in range(8):
        q = ir.Constant(ir.VectorType(et, per), None)
        for c in range(per):
            i = builder.zext(builder.extract_element(idx, ir.Constant(_I32, per * g + c)), ity)
            q = builder.insert_element(q, _load(builder, builder.gep(tp, [i])), ir.Constant(_I32, c))
        xv = _load(builder, _ptr(context, builder, sig.args[3], args[3], builder.add(xo, ir.Constant(ity, 32 * g)),
                                 _V32))
        hb = _shuf(builder, ks8, ks8, [4 * g + v // 8 for v in range(32)])
        m = builder.sext(builder.icmp_unsigned("!=", builder.and_(hb, bit), _splat(_V32, 0)), _V32)
        v = _madd(builder, sp(g), _maddubs(builder, builder.bitcast(q, _V32), builder.sub(builder.xor(xv, m), m)))
        acc = v if acc is None else builder.add(acc, v)
    return acc


def _fo(t, name):
    """The byte offset of field ``name`` in a block of format t (the table's layout)."""
    return B.BLOCKS[t].field(name).offset


def _block_at(context, builder, sig, args, off, vty):
    """The ``vty`` at byte ``off`` of the block at byte args[2] of the row args[1]."""
    ity = context.get_value_type(types.intp)
    o = context.cast(builder, args[2], sig.args[2], types.intp)
    return _load(builder, _ptr(context, builder, sig.args[1], args[1], builder.add(o, ir.Constant(ity, off)), vty))


def _to_bytes(builder, v):
    """The low byte of each lane of an integer vector, as a byte vector of as many lanes."""
    return builder.trunc(v, ir.VectorType(_I8, v.type.count))


@intrinsic
def iq2xs_lanes(typingctx, tab, w, o, x, xo):
    """IQ2_XS's eight int32 lanes of one super-block (the block at byte o of w, the 256 int8 activations at byte xo
    of x), ggml's sumi: per group the four iq2xs_grid entries (``tab``) times x with the signs applied, each pair sum
    times 2 ls + 1 of its sixteen values. The block's 32 u16 (9-bit index, 7-bit sign index), its sign bytes
    (``_ksigns_ir``: the table's rule, no lookup) and its sixteen scales decoded as vectors at once (scalars through
    bounds-wrapping array reads and ksigns lookups were 1.5x ggml's time)."""
    def codegen(context, builder, sig, args):
        w32 = ir.VectorType(_I16, 32)
        qs = _block_at(context, builder, sig, args, _fo(T.IQ2_XS, "qs"), w32)
        idx = builder.and_(qs, _splat(w32, 511))
        ks8 = _to_bytes(builder, _ksigns_ir(builder, builder.lshr(qs, _splat(w32, 9))))
        sc = _block_at(context, builder, sig, args, _fo(T.IQ2_XS, "scales"), ir.VectorType(_I8, 8))
        s16 = builder.zext(_shuf(builder, sc, sc, [g for g in range(8) for h in range(2)]), _W16)
        s16 = builder.and_(builder.lshr(s16, ir.Constant(_W16, [0, 4] * 8)), _splat(_W16, 15))
        s16 = builder.add(builder.shl(s16, _splat(_W16, 1)), _splat(_W16, 1))
        return _grid_groups(context, builder, sig, args, idx, ks8,
                            lambda g: _shuf(builder, s16, s16, [2 * g] * 8 + [2 * g + 1] * 8))
    return i32x8(tab, w, types.intp, x, types.intp), codegen


@intrinsic
def iq2xxs_lanes(typingctx, tab, w, o, x, xo):
    """IQ2_XXS's eight int32 lanes of one super-block, as ``iq2xs_lanes``: per group eight bytes, four grid indices
    (iq2xxs_grid) and a u32 of four 7-bit sign indices and the group's scale in its top four bits, decoded as
    vectors for the whole block."""
    def codegen(context, builder, sig, args):
        v16 = ir.VectorType(_I32, 16)
        v32 = ir.VectorType(_I32, 32)
        # lane 2g: the group's four index bytes, lane 2g + 1: its aux u32
        raw = _block_at(context, builder, sig, args, _fo(T.IQ2_XXS, "qs"), v16)
        idx = builder.bitcast(raw, ir.VectorType(_I8, 64))
        idx = _shuf(builder, idx, idx, [8 * (j // 4) + j % 4 for j in range(32)])
        aux = _shuf(builder, raw, raw, [2 * (j // 4) + 1 for j in range(32)])
        s = builder.and_(builder.lshr(aux, ir.Constant(v32, [7 * (j % 4) for j in range(32)])), _splat(v32, 127))
        ks8 = _to_bytes(builder, _ksigns_ir(builder, s))
        ls = builder.trunc(builder.lshr(_shuf(builder, raw, raw, [2 * g + 1 for g in range(8)]),
                                        _splat(ir.VectorType(_I32, 8), 28)), ir.VectorType(_I16, 8))
        ls = builder.add(builder.shl(ls, _splat(ir.VectorType(_I16, 8), 1)), _splat(ir.VectorType(_I16, 8), 1))
        return _grid_groups(context, builder, sig, args, idx, ks8, lambda g: _shuf(builder, ls, ls, [g] * 16))
    return i32x8(tab, w, types.intp, x, types.intp), codegen


@intrinsic
def iq3s_lanes(typingctx, tab, w, o, x, xo):
    """IQ3_S's eight int32 lanes of one super-block, as ``iq2xs_lanes``: per group eight iq3s_grid entries (four
    values each; index: a byte of qs and bit c of the group's qh byte as its ninth), the group's four sign bytes
    as they are stored, its scale 2 ls + 1 (a nibble per group) over all 32 values; decoded as vectors for the
    whole block."""
    def codegen(context, builder, sig, args):
        w64 = ir.VectorType(_I16, 64)
        qs = builder.zext(_block_at(context, builder, sig, args, _fo(T.IQ3_S, "qs"), ir.VectorType(_I8, 64)), w64)
        qh = _block_at(context, builder, sig, args, _fo(T.IQ3_S, "qh"), ir.VectorType(_I8, 8))
        qhx = _shuf(builder, qh, qh, [j // 8 for j in range(64)])
        b64 = ir.VectorType(_I8, 64)
        b8 = builder.icmp_unsigned("!=", builder.and_(qhx, ir.Constant(b64, [1 << (j % 8) for j in range(64)])),
                                   ir.Constant(b64, [0] * 64))
        idx = builder.or_(qs, builder.and_(builder.sext(b8, w64), _splat(w64, 256)))
        ks8 = _block_at(context, builder, sig, args, _fo(T.IQ3_S, "signs"), _V32)
        sc = _block_at(context, builder, sig, args, _fo(T.IQ3_S, "scales"), ir.VectorType(_I8, 4))
        v8 = ir.VectorType(_I16, 8)
        ls = builder.zext(_shuf(builder, sc, sc, [g >> 1 for g in range(8)]), v8)
        ls = builder.and_(builder.lshr(ls, ir.Constant(v8, [4 * (g & 1) for g in range(8)])), _splat(v8, 15))
        ls = builder.add(builder.shl(ls, _splat(v8, 1)), _splat(v8, 1))
        return _grid_groups(context, builder, sig, args, idx, ks8, lambda g: _shuf(builder, ls, ls, [g] * 16), 8)
    return i32x8(tab, w, types.intp, x, types.intp), codegen


@intrinsic
def iq1s_lanes(typingctx, tab, w, o, x, xo, bs, bo):
    """IQ1_S's grid lanes of one super-block and its deltas' integer, ggml_vec_dot_iq1_s_q8_K's sumi and sumi1
    before their conversion: per group the four iq1s_grid entries (index: a byte of qs and three bits of the
    group's qh u16) times x by the sign trick, the pair sums times 2 ls + 1; the deltas' term the activations'
    block sums 2g, 2g + 1 (int16, from element bo of bs) times +-(2 ls + 1) (bit 15 of qh: minus), summed. Decoded
    as vectors for the whole block. Returns (lanes, the deltas' sum as an int32 lane vector's total)."""
    def codegen(context, builder, sig, args):
        w32 = ir.VectorType(_I16, 32)
        v8 = ir.VectorType(_I16, 8)
        qs = builder.zext(_block_at(context, builder, sig, args, _fo(T.IQ1_S, "qs"), _V32), w32)
        qh = _block_at(context, builder, sig, args, _fo(T.IQ1_S, "qh"), v8)
        qhx = _shuf(builder, qh, qh, [j // 4 for j in range(32)])
        hi = builder.shl(builder.and_(builder.lshr(qhx, ir.Constant(w32, [3 * (j % 4) for j in range(32)])),
                                      _splat(w32, 7)), _splat(w32, 8))
        idx = builder.or_(qs, hi)
        ls = builder.add(builder.shl(builder.and_(builder.lshr(qh, _splat(v8, 12)), _splat(v8, 7)), _splat(v8, 1)),
                         _splat(v8, 1))
        ity = context.get_value_type(types.intp)
        xo = context.cast(builder, args[4], sig.args[4], types.intp)
        i64 = ir.IntType(64)
        tp = builder.bitcast(context.make_array(sig.args[0])(context, builder, args[0]).data, i64.as_pointer())
        acc = None
        for g in range(8):
            q = ir.Constant(ir.VectorType(i64, 4), None)
            for c in range(4):
                i = builder.zext(builder.extract_element(idx, ir.Constant(_I32, 4 * g + c)), ity)
                q = builder.insert_element(q, _load(builder, builder.gep(tp, [i])), ir.Constant(_I32, c))
            q = builder.bitcast(q, _V32)
            xv = _load(builder, _ptr(context, builder, sig.args[3], args[3], builder.add(xo, ir.Constant(ity, 32 * g)),
                                     _V32))
            v = _madd(builder, _shuf(builder, ls, ls, [g] * 16),
                      _maddubs(builder, _abs8(builder, q), _sign_of(builder, xv, q)))
            acc = v if acc is None else builder.add(acc, v)
        # deltas: pair g of the sixteen block sums times ls_g, negated where bit 15 of qh[g] is set
        sl = builder.select(builder.icmp_signed("<", qh, _splat(v8, 0)), builder.sub(_splat(v8, 0), ls), ls)
        sl16 = _shuf(builder, sl, sl, [j // 2 for j in range(16)])
        bsv = _load(builder, _elem_ptr(context, builder, sig.args[5], args[5],
                                       context.cast(builder, args[6], sig.args[6], types.intp), _W16))
        return context.make_tuple(builder, sig.return_type, [acc, _madd(builder, bsv, sl16)])
    return types.UniTuple(i32x8, 2)(tab, w, types.intp, x, types.intp, bs, types.intp), codegen


@intrinsic
def iq2s_lanes(typingctx, tab, w, o, x, xo):
    """IQ2_S's eight int32 lanes of one super-block, as ``iq2xs_lanes``: per group four iq2s_grid entries (index: a
    byte of qs and two bits of the group's qh byte above it), the group's four sign bytes as stored, the scales
    2 ls + 1 of its two halves (a nibble each); decoded as vectors for the whole block."""
    def codegen(context, builder, sig, args):
        w32 = ir.VectorType(_I16, 32)
        qs = builder.zext(_block_at(context, builder, sig, args, _fo(T.IQ2_S, "qs"), _V32), w32)
        qh = _block_at(context, builder, sig, args, _fo(T.IQ2_S, "qh"), ir.VectorType(_I8, 8))
        qhx = builder.zext(_shuf(builder, qh, qh, [j // 4 for j in range(32)]), w32)
        hi = builder.and_(builder.shl(qhx, ir.Constant(w32, [8 - 2 * (j % 4) for j in range(32)])),
                          _splat(w32, 0x300))
        idx = builder.or_(qs, hi)
        ks8 = _block_at(context, builder, sig, args, _fo(T.IQ2_S, "signs"), _V32)
        sc = _block_at(context, builder, sig, args, _fo(T.IQ2_S, "scales"), ir.VectorType(_I8, 8))
        s16 = builder.zext(_shuf(builder, sc, sc, [g for g in range(8) for h in range(2)]), _W16)
        s16 = builder.and_(builder.lshr(s16, ir.Constant(_W16, [0, 4] * 8)), _splat(_W16, 15))
        s16 = builder.add(builder.shl(s16, _splat(_W16, 1)), _splat(_W16, 1))
        return _grid_groups(context, builder, sig, args, idx, ks8,
                            lambda g: _shuf(builder, s16, s16, [2 * g] * 8 + [2 * g + 1] * 8))
    return i32x8(tab, w, types.intp, x, types.intp), codegen


@intrinsic
def iq3xxs_lanes(typingctx, tab, w, o, x, xo):
    """IQ3_XXS's eight int32 lanes of one super-block, as ``iq2xxs_lanes``: per group eight iq3xxs_grid entries
    (four values each, a byte of qs each) and, from the u32 after the 64 index bytes, four 7-bit sign indices and
    the group's scale in the top four bits; decoded as vectors for the whole block."""
    def codegen(context, builder, sig, args):
        v8 = ir.VectorType(_I32, 8)
        v32 = ir.VectorType(_I32, 32)
        idx = _block_at(context, builder, sig, args, _fo(T.IQ3_XXS, "qs"), ir.VectorType(_I8, 64))
        aux8 = _block_at(context, builder, sig, args, _fo(T.IQ3_XXS, "sas"), v8)
        aux = _shuf(builder, aux8, aux8, [j // 4 for j in range(32)])
        s = builder.and_(builder.lshr(aux, ir.Constant(v32, [7 * (j % 4) for j in range(32)])), _splat(v32, 127))
        ks8 = _to_bytes(builder, _ksigns_ir(builder, s))
        w8 = ir.VectorType(_I16, 8)
        ls = builder.trunc(builder.lshr(aux8, _splat(v8, 28)), w8)
        ls = builder.add(builder.shl(ls, _splat(w8, 1)), _splat(w8, 1))
        return _grid_groups(context, builder, sig, args, idx, ks8, lambda g: _shuf(builder, ls, ls, [g] * 16), 8)
    return i32x8(tab, w, types.intp, x, types.intp), codegen


# ------------------------------------------------------------------------------------------------ block steps
G_IQ1 = B.tab.iq1s_grid
IQ1M_SC = B.BLOCKS[T.IQ1_M].field("scales").offset
# the grid formats' tables as ggml's kernels index them (uint64: 8 values per entry, uint32: 4)
G_IQ2_XXS = B.tab.iq2xxs_grid
G_IQ2_XS = B.tab.iq2xs_grid
G_IQ2_S = B.tab.iq2s_grid
G_IQ3_XXS = B.tab.iq3xxs_grid
G_IQ3_S = B.tab.iq3s_grid


@njit(cache=True, inline="always")
def _st_iq1_s(kind, wr, b, xr, xdr, bsr, a1, a2, s):
    # ggml_vec_dot_iq1_s_q8_K: exact lanes of the grid (signed) times x and a scalar integer for the deltas'
    # block-sum term; acc = fma(d, lanes, acc), s += d * isum (contracted: one fma)
    o = b * IQ1S_BYTES
    lanes, dv = iq1s_lanes(G_IQ1, wr, o, xr, b * 256, bsr, b * 16)
    d = np.float32(xdr[b] * f16_at(wr, o))
    a1 = f32x8_fma(d, i32x8_to_f32x8(lanes), a1)
    s = fma32(d, np.float32(i32x8_sum(dv)), s)
    return a1, a2, s


@njit(cache=True, inline="always")
def _iq1_m_d(wr, o):
    """IQ1_M's super-block scale: ``blocks.iq1_m_d``'s F16 bits (the top nibbles of the four scale words), converted
    by one instruction (``blocks.f16_from_bits`` took libm's ldexp)."""
    o += IQ1M_SC
    return f16_bits((B.u16_at(wr, o) >> 12) | ((B.u16_at(wr, o + 2) >> 8) & 0x00F0)
                    | ((B.u16_at(wr, o + 4) >> 4) & 0x0F00) | (B.u16_at(wr, o + 6) & 0xF000))


@njit(cache=True, inline="always")
def _st_iq1_m(kind, wr, b, xr, xdr, bsr, a1, a2, s):
    # ggml_vec_dot_iq1_m_q8_K: the grid lanes and the deltas' lanes (+-x summed per chunk), both scaled per
    # 16 values, in two accumulators
    o = b * IQ1M_BYTES
    lanes, dl = iq1m_lanes(G_IQ1, wr, o, xr, b * 256)
    d = np.float32(xdr[b] * _iq1_m_d(wr, o))
    a1 = f32x8_fma(d, i32x8_to_f32x8(lanes), a1)
    a2 = f32x8_fma(d, i32x8_to_f32x8(dl), a2)
    return a1, a2, s


@njit(cache=True, inline="always")
def _st_iq2_xxs(kind, wr, b, xr, xdr, bsr, a1, a2, s):
    # ggml_vec_dot_iq2_xxs_q8_K: the block's lanes (``iq2xxs_lanes``), one fma
    o = b * IQ2XXS_BYTES
    a1 = f32x8_fma(np.float32(f16_at(wr, o) * xdr[b]), i32x8_to_f32x8(iq2xxs_lanes(G_IQ2_XXS, wr, o, xr, b * 256)),
                   a1)
    return a1, a2, s


@njit(cache=True, inline="always")
def _st_iq2_xs(kind, wr, b, xr, xdr, bsr, a1, a2, s):
    o = b * IQ2XS_BYTES
    a1 = f32x8_fma(np.float32(f16_at(wr, o) * xdr[b]), i32x8_to_f32x8(iq2xs_lanes(G_IQ2_XS, wr, o, xr, b * 256)), a1)
    return a1, a2, s


@njit(cache=True, inline="always")
def _st_iq2_s(kind, wr, b, xr, xdr, bsr, a1, a2, s):
    o = b * IQ2S_BYTES
    a1 = f32x8_fma(np.float32(f16_at(wr, o) * xdr[b]), i32x8_to_f32x8(iq2s_lanes(G_IQ2_S, wr, o, xr, b * 256)), a1)
    return a1, a2, s


@njit(cache=True, inline="always")
def _st_iq3_xxs(kind, wr, b, xr, xdr, bsr, a1, a2, s):
    o = b * IQ3XXS_BYTES
    a1 = f32x8_fma(np.float32(f16_at(wr, o) * xdr[b]), i32x8_to_f32x8(iq3xxs_lanes(G_IQ3_XXS, wr, o, xr, b * 256)),
                   a1)
    return a1, a2, s


@njit(cache=True, inline="always")
def _st_iq3_s(kind, wr, b, xr, xdr, bsr, a1, a2, s):
    o = b * IQ3S_BYTES
    a1 = f32x8_fma(np.float32(f16_at(wr, o) * xdr[b]), i32x8_to_f32x8(iq3s_lanes(G_IQ3_S, wr, o, xr, b * 256)), a1)
    return a1, a2, s


# as the x86 build computes them: IQ1_S's hsum(accum) + IQ1S_DELTA * accum1 not contracted, IQ1_M's
# hsum(accum1) + IQ1M_DELTA * hsum(accum2) one fma
@njit(cache=True, inline="always")
def _fin_iq1_s(kind, wr, xr, xdr, k, a1, a2, s):
    return np.float32(f32x8_hsum(a1) + np.float32(B.IQ1_DELTA * s))


@njit(cache=True, inline="always")
def _fin_iq1_m(kind, wr, xr, xdr, k, a1, a2, s):
    return fma32(B.IQ1_DELTA, f32x8_hsum(a2), f32x8_hsum(a1))


# the grid formats: f * hsum_float_8(acc), f = 1/8 (IQ2_*), 1/4 (IQ3_XXS), 1 (IQ3_S)
@njit(cache=True, inline="always")
def _fin_grid8(kind, wr, xr, xdr, k, a1, a2, s):
    return np.float32(np.float32(0.125) * f32x8_hsum(a1))


@njit(cache=True, inline="always")
def _fin_grid4(kind, wr, xr, xdr, k, a1, a2, s):
    return np.float32(np.float32(0.25) * f32x8_hsum(a1))


@njit(cache=True, inline="always")
def _fin_grid1(kind, wr, xr, xdr, k, a1, a2, s):
    return np.float32(np.float32(1.0) * f32x8_hsum(a1))


# the decode kernels (dot_blocks: they round x into its buffers first with ``quant``)
@njit(parallel=True, cache=True, nogil=True)
def _iq2_xxs(w, x, xq, xd, bsums, out, quant):
    _quant_k(x, xq, xd, bsums, quant)
    _mv(w, xq, xd, bsums, out, K_IQ2_XXS, _st_iq2_xxs, _fin_grid8)


@njit(parallel=True, cache=True, nogil=True)
def _iq2_xs(w, x, xq, xd, bsums, out, quant):
    _quant_k(x, xq, xd, bsums, quant)
    _mv(w, xq, xd, bsums, out, K_IQ2_XS, _st_iq2_xs, _fin_grid8)


@njit(parallel=True, cache=True, nogil=True)
def _iq2_s(w, x, xq, xd, bsums, out, quant):
    _quant_k(x, xq, xd, bsums, quant)
    _mv(w, xq, xd, bsums, out, K_IQ2_S, _st_iq2_s, _fin_grid8)


@njit(parallel=True, cache=True, nogil=True)
def _iq3_xxs(w, x, xq, xd, bsums, out, quant):
    _quant_k(x, xq, xd, bsums, quant)
    _mv(w, xq, xd, bsums, out, K_IQ3_XXS, _st_iq3_xxs, _fin_grid4)


@njit(parallel=True, cache=True, nogil=True)
def _iq3_s(w, x, xq, xd, bsums, out, quant):
    _quant_k(x, xq, xd, bsums, quant)
    _mv(w, xq, xd, bsums, out, K_IQ3_S, _st_iq3_s, _fin_grid1)


@njit(parallel=True, cache=True, nogil=True)
def _iq1_s(w, x, xq, xd, bsums, out, quant):
    _quant_k(x, xq, xd, bsums, quant)
    _mv(w, xq, xd, bsums, out, K_IQ1_S, _st_iq1_s, _fin_iq1_s)


@njit(parallel=True, cache=True, nogil=True)
def _iq1_m(w, x, xq, xd, bsums, out, quant):
    _quant_k(x, xq, xd, bsums, quant)
    _mv(w, xq, xd, bsums, out, K_IQ1_M, _st_iq1_m, _fin_iq1_m)


DECODE = {T.IQ2_XXS: _iq2_xxs, T.IQ2_XS: _iq2_xs, T.IQ2_S: _iq2_s, T.IQ3_XXS: _iq3_xxs, T.IQ3_S: _iq3_s,
          T.IQ1_S: _iq1_s, T.IQ1_M: _iq1_m}
