"""Dot products of the grid formats (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) against Q8_K
activations, a decoded token's matrix-vector products in llama.cpp's x86 float order: their super-block intrinsics,
step and final functions and kernels on ``dot_blocks``' row tiling (``_mv``). Called through ``dot_blocks``
(``mul_mat``, ``bind_decode``); their prompts take dot_kquant_tiled's tiles, their dequantized tiles are
dot_blocks'.

Each intrinsic decodes a whole super-block (``iq2xs_lanes`` ...) at the table's field offsets (``blocks.BLOCKS``),
where one scalar per index, sign and scale through bounds-wrapping array reads took 1.2-2.3x ggml's time for a
decoded token. As ggml's AVX2 kernels: the grid indices are read and computed in scalar registers (IQ3_S's 64 as a
vector), the grid entries and, for the formats with 7-bit sign indices (IQ2_XXS, IQ2_XS, IQ3_XXS), the signs'
eight +-1 bytes loaded by index into vectors, the signs applied by vpsignb; the scales as vectors. Extracting each
index from a vector (two shuffle uops) and computing the sign bytes by the table's parity rule in vectors kept the
shuffle ports busy: 1.25-1.6x this time. IQ1_M's deltas are the activations' sums of four (one pass per call)
times the signed scales: four madds a block.

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
def iq1m_lanes(typingctx, tab, w, o, x, xo, qs4, qo):
    """IQ1_M's two sets of eight int32 lanes of one super-block (the block at byte o of w, the 256 int8 activations
    at byte xo of x), ggml_vec_dot_iq1_m_q8_K's sumi1 and sumi2: per 32-value group the four grid entries (``tab``:
    iq1s_grid, eight values each) times x by the sign trick, and the deltas (+-1 per eight values, the sign bit of
    each index nibble) times x, each pair sum times its sixteen values' scale 2 ls + 1. The grid indices are
    computed in scalar registers from the block's bytes, as ggml does (extracting them from a vector took two
    shuffle uops each); the deltas' lanes come from the activations' sums of four (``qs4`` from element qo,
    ``_quad_sums``: the same for every weight row) times the scales with the deltas' signs, four madds a block where
    ggml sums +-x per group (the same integers: the activations are in [-127, 127])."""
    def codegen(context, builder, sig, args):
        tty, wty, xty = sig.args[0], sig.args[1], sig.args[3]
        ity = context.get_value_type(types.intp)
        o = context.cast(builder, args[2], sig.args[2], types.intp)
        xo = context.cast(builder, args[4], sig.args[4], types.intp)

        def at(off, vty):
            return _load(builder, _ptr(context, builder, wty, args[1], builder.add(o, ir.Constant(ity, off)), vty))
        qh = at(_fo(T.IQ1_M, "qh"), _V16)
        sc = at(_fo(T.IQ1_M, "scales"), ir.VectorType(_I16, 4))
        sat = _scalar_at(context, builder, sig, args)
        qhs = [builder.zext(sat(_fo(T.IQ1_M, "qh") + h, _I8), _I32) for h in range(16)]

        def lane(j):     # index 4g + c: qs[4g + c] | ((qh[2g + c // 2] >> 4 (c % 2)) & 7) << 8
            hi = builder.and_(builder.shl(qhs[j >> 1], ir.Constant(_I32, 8 - 4 * (j & 1))), ir.Constant(_I32, 0x700))
            return builder.or_(builder.zext(sat(_fo(T.IQ1_M, "qs") + j, _I8), _I32), hi)
        # scale 2g + h: 2 ((sc[g // 2] >> (6 (g % 2) + 3 h)) & 7) + 1
        v16 = ir.VectorType(_I32, 16)
        s32 = builder.zext(_shuf(builder, sc, sc, [g >> 1 for g in range(8) for h in range(2)]), v16)
        sh = [6 * (g & 1) + 3 * h for g in range(8) for h in range(2)]
        s32 = builder.and_(builder.lshr(s32, ir.Constant(v16, sh)), _splat(v16, 7))
        s16 = builder.trunc(builder.add(builder.shl(s32, _splat(v16, 1)), _splat(v16, 1)), _W16)
        i64 = ir.IntType(64)
        tp = builder.bitcast(context.make_array(tty)(context, builder, args[0]).data, i64.as_pointer())
        acc1 = None
        for g in range(8):
            q = ir.Constant(ir.VectorType(i64, 4), None)
            for c in range(4):
                i = builder.zext(lane(4 * g + c), ity)
                q = builder.insert_element(q, _load(builder, builder.gep(tp, [i])), ir.Constant(_I32, c))
            q = builder.bitcast(q, _V32)
            xv = _load(builder, _ptr(context, builder, xty, args[3], builder.add(xo, ir.Constant(ity, 32 * g)), _V32))
            sp = _shuf(builder, s16, s16, [2 * g] * 8 + [2 * g + 1] * 8)
            v1 = _madd(builder, sp, _maddubs(builder, _abs8(builder, q), _sign_of(builder, xv, q)))
            acc1 = v1 if acc1 is None else builder.add(acc1, v1)
        # the deltas: lane j of group g is +-(2 ls + 1) (scale 2g + j // 4; minus where bit 3 + 4 ((j // 2) % 2) of
        # qh[2g + j // 4] is set) times the sum of x over values 4j .. 4j + 3 (qs4: groups 2p, 2p + 1 in alternate
        # int16 lanes), four madds
        v64 = ir.VectorType(_I16, 64)
        pos = [(2 * p + e, j) for p in range(4) for j in range(8) for e in range(2)]
        sc64 = _shuf(builder, s16, s16, [2 * g + j // 4 for g, j in pos])
        qh64 = builder.zext(_shuf(builder, qh, qh, [2 * g + j // 4 for g, j in pos]), v64)
        bits = ir.Constant(v64, [1 << (3 + 4 * ((j // 2) % 2)) for g, j in pos])
        m = builder.sext(builder.icmp_unsigned("!=", builder.and_(qh64, bits), ir.Constant(v64, [0] * 64)), v64)
        sg = builder.sub(builder.xor(sc64, m), m)
        qo = context.cast(builder, args[6], sig.args[6], types.intp)
        acc2 = None
        for p in range(4):
            qv = _load(builder, _elem_ptr(context, builder, sig.args[5], args[5],
                                          builder.add(qo, ir.Constant(ity, 16 * p)), _W16))
            v2 = _madd(builder, qv, _shuf(builder, sg, sg, list(range(16 * p, 16 * p + 16))))
            acc2 = v2 if acc2 is None else builder.add(acc2, v2)
        return context.make_tuple(builder, sig.return_type, [acc1, acc2])
    return types.UniTuple(i32x8, 2)(tab, w, types.intp, x, types.intp, qs4, types.intp), codegen


def _grid_groups(context, builder, sig, args, idx, ks8, sp, per=4):
    """The eight groups' lanes of a grid format's super-block, summed: group g's ``per`` table entries (args[0]:
    four uint64 of 8 values, or eight uint32 of 4) at indices per * g .. (``idx``: an index vector, or idx(j) the
    j-th index as a scalar), times the activations (args[3] from byte args[4] + 32 g) with their signs applied,
    the pair sums times ``sp(g)`` (a <16 x i16>). Signs: ``ks8`` a vector of sign bytes (bit v % 8 of byte
    4g + v // 8 for value v, tested in byte lanes: a 0 / -1 mask m, x ^ m - m, ggml's xor-sub: -(-128) stays
    -128), or ks8(g, c) the 7-bit ksigns index of values 8c .. 8c + 7 of group g, whose eight +-1 bytes args[5]
    holds (``KSIGNS8``, ggml's keven_signs_q2xs), applied by vpsignb as ggml does."""
    ity = context.get_value_type(types.intp)
    xo = context.cast(builder, args[4], sig.args[4], types.intp)
    et = ir.IntType(256 // per)          # four uint64 entries a group (8 values each) or eight uint32 (4 values)
    tp = builder.bitcast(context.make_array(sig.args[0])(context, builder, args[0]).data, et.as_pointer())
    bit = ir.Constant(_V32, [1 << (v % 8) for v in range(32)])
    if callable(ks8):
        sp_tab = builder.bitcast(context.make_array(sig.args[5])(context, builder, args[5]).data,
                                 ir.IntType(64).as_pointer())
    acc = None
    for g in range(8):
        q = ir.Constant(ir.VectorType(et, per), None)
        for c in range(per):
            i = idx(per * g + c) if callable(idx) else builder.extract_element(idx, ir.Constant(_I32, per * g + c))
            i = builder.zext(i, ity)
            q = builder.insert_element(q, _load(builder, builder.gep(tp, [i])), ir.Constant(_I32, c))
        xv = _load(builder, _ptr(context, builder, sig.args[3], args[3], builder.add(xo, ir.Constant(ity, 32 * g)),
                                 _V32))
        if callable(ks8):
            sv = ir.Constant(ir.VectorType(ir.IntType(64), 4), None)
            for c in range(4):
                si = builder.zext(ks8(g, c), ity)
                sv = builder.insert_element(sv, _load(builder, builder.gep(sp_tab, [si])), ir.Constant(_I32, c))
            xs = _sign_of(builder, xv, builder.bitcast(sv, _V32))
        else:
            hb = _shuf(builder, ks8, ks8, [4 * g + v // 8 for v in range(32)])
            m = builder.sext(builder.icmp_unsigned("!=", builder.and_(hb, bit), _splat(_V32, 0)), _V32)
            xs = builder.sub(builder.xor(xv, m), m)
        v = _madd(builder, sp(g), _maddubs(builder, builder.bitcast(q, _V32), xs))
        acc = v if acc is None else builder.add(acc, v)
    return acc


def _scalar_at(context, builder, sig, args):
    """at(off, ty): the ty at byte off of the block at byte args[2] of the row args[1], a scalar load."""
    ity = context.get_value_type(types.intp)
    o = context.cast(builder, args[2], sig.args[2], types.intp)

    def at(off, ty):
        return _load(builder, _ptr(context, builder, sig.args[1], args[1], builder.add(o, ir.Constant(ity, off)), ty))
    return at


def _splat_v(builder, v, vty):
    """A vector of type vty with the scalar v in every lane."""
    u = builder.insert_element(ir.Constant(vty, None), v, ir.Constant(_I32, 0))
    return builder.shuffle_vector(u, u, ir.Constant(ir.VectorType(_I32, vty.count), [0] * vty.count))


def _fo(t, name):
    """The byte offset of field ``name`` in a block of format t (the table's layout)."""
    return B.BLOCKS[t].field(name).offset


def _block_at(context, builder, sig, args, off, vty):
    """The ``vty`` at byte ``off`` of the block at byte args[2] of the row args[1]."""
    ity = context.get_value_type(types.intp)
    o = context.cast(builder, args[2], sig.args[2], types.intp)
    return _load(builder, _ptr(context, builder, sig.args[1], args[1], builder.add(o, ir.Constant(ity, off)), vty))


@intrinsic
def iq2xs_lanes(typingctx, tab, w, o, x, xo, sgn):
    """IQ2_XS's eight int32 lanes of one super-block (the block at byte o of w, the 256 int8 activations at byte xo
    of x), ggml's sumi: per group the four iq2xs_grid entries (``tab``) times x with the signs applied (``sgn``:
    KSIGNS8), each pair sum times 2 ls + 1 of its sixteen values. The block's 32 u16 (9-bit index, 7-bit sign
    index) read as scalars, as ggml does; its sixteen scales as a vector. (The sign bytes computed as vectors by
    the table's parity rule and tested bit by bit took 1.25x this time.)"""
    def codegen(context, builder, sig, args):
        at = _scalar_at(context, builder, sig, args)
        qs = [at(_fo(T.IQ2_XS, "qs") + 2 * j, _I16) for j in range(32)]

        def idx(j):
            return builder.and_(qs[j], ir.Constant(_I16, 511))

        def ks8(g, c):
            return builder.lshr(qs[4 * g + c], ir.Constant(_I16, 9))
        sc = _block_at(context, builder, sig, args, _fo(T.IQ2_XS, "scales"), ir.VectorType(_I8, 8))
        s16 = builder.zext(_shuf(builder, sc, sc, [g for g in range(8) for h in range(2)]), _W16)
        s16 = builder.and_(builder.lshr(s16, ir.Constant(_W16, [0, 4] * 8)), _splat(_W16, 15))
        s16 = builder.add(builder.shl(s16, _splat(_W16, 1)), _splat(_W16, 1))
        return _grid_groups(context, builder, sig, args, idx, ks8,
                            lambda g: _shuf(builder, s16, s16, [2 * g] * 8 + [2 * g + 1] * 8))
    return i32x8(tab, w, types.intp, x, types.intp, sgn), codegen


@intrinsic
def iq2xxs_lanes(typingctx, tab, w, o, x, xo, sgn):
    """IQ2_XXS's eight int32 lanes of one super-block, as ``iq2xs_lanes``: per group eight bytes, four grid indices
    (iq2xxs_grid) and a u32 of four 7-bit sign indices and the group's scale in its top four bits, read as
    scalars."""
    def codegen(context, builder, sig, args):
        at = _scalar_at(context, builder, sig, args)
        q0 = _fo(T.IQ2_XXS, "qs")
        aux = [at(q0 + 8 * g + 4, _I32) for g in range(8)]

        def idx(j):      # the index bytes, read from the block as scalars (not extracted from a vector)
            return at(q0 + 8 * (j // 4) + j % 4, _I8)

        def sgn(g, c):   # the 7-bit sign index c of group g, looked up in ksigns as +-1 bytes (ggml's keven_signs)
            return builder.and_(builder.lshr(aux[g], ir.Constant(_I32, 7 * c)), ir.Constant(_I32, 127))

        def sp(g):
            ls = builder.trunc(builder.lshr(aux[g], ir.Constant(_I32, 28)), _I16)
            ls = builder.add(builder.shl(ls, ir.Constant(_I16, 1)), ir.Constant(_I16, 1))
            return _splat_v(builder, ls, _W16)
        return _grid_groups(context, builder, sig, args, idx, sgn, sp)
    return i32x8(tab, w, types.intp, x, types.intp, sgn), codegen


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
    block sums 2g, 2g + 1 (int16, from element bo of bs) times +-(2 ls + 1) (bit 15 of qh: minus), summed. The
    indices computed in scalar registers from the block's bytes (as ggml does), the scales and deltas as vectors.
    Returns (lanes, the deltas' sum as an int32 lane vector's total)."""
    def codegen(context, builder, sig, args):
        v8 = ir.VectorType(_I16, 8)
        qh = _block_at(context, builder, sig, args, _fo(T.IQ1_S, "qh"), v8)
        sat = _scalar_at(context, builder, sig, args)
        qhs = [builder.zext(sat(_fo(T.IQ1_S, "qh") + 2 * g, _I16), _I32) for g in range(8)]

        def lane(j):     # qs[j] | ((qh[j // 4] >> 3 (j % 4)) & 7) << 8
            h = qhs[j // 4]
            c = j % 4
            h = builder.shl(h, ir.Constant(_I32, 8 - 3 * c)) if c < 3 else builder.lshr(h, ir.Constant(_I32, 1))
            return builder.or_(builder.zext(sat(_fo(T.IQ1_S, "qs") + j, _I8), _I32),
                               builder.and_(h, ir.Constant(_I32, 0x700)))
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
                i = builder.zext(lane(4 * g + c), ity)
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
    2 ls + 1 of its two halves (a nibble each). The indices computed in scalar registers from the block's bytes, the
    signs and scales as vectors."""
    def codegen(context, builder, sig, args):
        at = _scalar_at(context, builder, sig, args)
        qh = [builder.zext(at(_fo(T.IQ2_S, "qh") + g, _I8), _I32) for g in range(8)]

        def idx(j):      # qs[j] | bits 2c, 2c + 1 (c = j % 4) of qh[j // 4] as bits 8, 9
            hi = builder.and_(builder.shl(qh[j // 4], ir.Constant(_I32, 8 - 2 * (j % 4))), ir.Constant(_I32, 0x300))
            return builder.or_(builder.zext(at(_fo(T.IQ2_S, "qs") + j, _I8), _I32), hi)
        ks8 = _block_at(context, builder, sig, args, _fo(T.IQ2_S, "signs"), _V32)
        sc = _block_at(context, builder, sig, args, _fo(T.IQ2_S, "scales"), ir.VectorType(_I8, 8))
        s16 = builder.zext(_shuf(builder, sc, sc, [g for g in range(8) for h in range(2)]), _W16)
        s16 = builder.and_(builder.lshr(s16, ir.Constant(_W16, [0, 4] * 8)), _splat(_W16, 15))
        s16 = builder.add(builder.shl(s16, _splat(_W16, 1)), _splat(_W16, 1))
        return _grid_groups(context, builder, sig, args, idx, ks8,
                            lambda g: _shuf(builder, s16, s16, [2 * g] * 8 + [2 * g + 1] * 8))
    return i32x8(tab, w, types.intp, x, types.intp), codegen


@intrinsic
def iq3xxs_lanes(typingctx, tab, w, o, x, xo, sgn):
    """IQ3_XXS's eight int32 lanes of one super-block, as ``iq2xxs_lanes``: per group eight iq3xxs_grid entries
    (four values each, a byte of qs each) and, from the u32 after the 64 index bytes, four 7-bit sign indices and
    the group's scale in the top four bits; read as scalars."""
    def codegen(context, builder, sig, args):
        at = _scalar_at(context, builder, sig, args)
        aux = [at(_fo(T.IQ3_XXS, "sas") + 4 * g, _I32) for g in range(8)]

        def idx(j):
            return at(_fo(T.IQ3_XXS, "qs") + j, _I8)

        def sgn(g, c):
            return builder.and_(builder.lshr(aux[g], ir.Constant(_I32, 7 * c)), ir.Constant(_I32, 127))

        def sp(g):
            ls = builder.trunc(builder.lshr(aux[g], ir.Constant(_I32, 28)), _I16)
            return _splat_v(builder, builder.add(builder.shl(ls, ir.Constant(_I16, 1)), ir.Constant(_I16, 1)), _W16)
        return _grid_groups(context, builder, sig, args, idx, sgn, sp, 8)
    return i32x8(tab, w, types.intp, x, types.intp, sgn), codegen


# ------------------------------------------------------------------------------------------------ block steps
G_IQ1 = B.tab.iq1s_grid
IQ1M_SC = B.BLOCKS[T.IQ1_M].field("scales").offset
# the grid formats' tables as ggml's kernels index them (uint64: 8 values per entry, uint32: 4)
G_IQ2_XXS = B.tab.iq2xxs_grid
# ksigns_iq2xs as eight +-1 bytes an entry (byte v -1 where bit v of the entry is set): ggml's keven_signs_q2xs
KSIGNS8 = (np.where((B.tab.ksigns_iq2xs[:, None].astype(np.uint32) >> np.arange(8)) & 1, -1, 1)
           .astype(np.int8).view(np.uint64).ravel())
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
def _quad_sums(xq):
    """IQ1_M's delta term's activations: the sums of x over each four values, super-block b's 64 at 64 b, groups 2p
    and 2p + 1 of it in alternate lanes of 16 int16 from 16 p (the layout of ``iq1m_lanes``' madds)."""
    n, k = xq.shape
    q = np.empty((n, k // 4), np.int16)
    for i in range(n):
        xr, qr = xq[i], q[i]
        for b in range(k // 256):
            for g in range(8):
                for j in range(8):
                    o = 256 * b + 32 * g + 4 * j
                    qr[64 * b + 16 * (g >> 1) + 2 * j + (g & 1)] = (np.int16(xr[o]) + np.int16(xr[o + 1])
                                                                    + np.int16(xr[o + 2]) + np.int16(xr[o + 3]))
    return q


@njit(cache=True, inline="always")
def _st_iq1_m(kind, wr, b, xr, xdr, bsr, a1, a2, s):
    # ggml_vec_dot_iq1_m_q8_K: the grid lanes and the deltas' lanes (+-x summed per chunk), both scaled per
    # 16 values, in two accumulators
    o = b * IQ1M_BYTES
    lanes, dl = iq1m_lanes(G_IQ1, wr, o, xr, b * 256, bsr, b * 64)
    d = np.float32(xdr[b] * _iq1_m_d(wr, o))
    a1 = f32x8_fma(d, i32x8_to_f32x8(lanes), a1)
    a2 = f32x8_fma(d, i32x8_to_f32x8(dl), a2)
    return a1, a2, s


@njit(cache=True, inline="always")
def _st_iq2_xxs(kind, wr, b, xr, xdr, bsr, a1, a2, s):
    # ggml_vec_dot_iq2_xxs_q8_K: the block's lanes (``iq2xxs_lanes``), one fma
    o = b * IQ2XXS_BYTES
    lanes = iq2xxs_lanes(G_IQ2_XXS, wr, o, xr, b * 256, KSIGNS8)
    a1 = f32x8_fma(np.float32(f16_at(wr, o) * xdr[b]), i32x8_to_f32x8(lanes), a1)
    return a1, a2, s


@njit(cache=True, inline="always")
def _st_iq2_xs(kind, wr, b, xr, xdr, bsr, a1, a2, s):
    o = b * IQ2XS_BYTES
    lanes = iq2xs_lanes(G_IQ2_XS, wr, o, xr, b * 256, KSIGNS8)
    a1 = f32x8_fma(np.float32(f16_at(wr, o) * xdr[b]), i32x8_to_f32x8(lanes), a1)
    return a1, a2, s


@njit(cache=True, inline="always")
def _st_iq2_s(kind, wr, b, xr, xdr, bsr, a1, a2, s):
    o = b * IQ2S_BYTES
    a1 = f32x8_fma(np.float32(f16_at(wr, o) * xdr[b]), i32x8_to_f32x8(iq2s_lanes(G_IQ2_S, wr, o, xr, b * 256)), a1)
    return a1, a2, s


@njit(cache=True, inline="always")
def _st_iq3_xxs(kind, wr, b, xr, xdr, bsr, a1, a2, s):
    o = b * IQ3XXS_BYTES
    lanes = iq3xxs_lanes(G_IQ3_XXS, wr, o, xr, b * 256, KSIGNS8)
    a1 = f32x8_fma(np.float32(f16_at(wr, o) * xdr[b]), i32x8_to_f32x8(lanes), a1)
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
    _mv(w, xq, xd, _quad_sums(xq), out, K_IQ1_M, _st_iq1_m, _fin_iq1_m)


DECODE = {T.IQ2_XXS: _iq2_xxs, T.IQ2_XS: _iq2_xs, T.IQ2_S: _iq2_s, T.IQ3_XXS: _iq3_xxs, T.IQ3_S: _iq3_s,
          T.IQ1_S: _iq1_s, T.IQ1_M: _iq1_m}
