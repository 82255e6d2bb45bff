"""Dot products of the formats described in ``llampy/ggml/blocks.py`` that had no kernel of their own: F32, F16,
BF16, Q2_K, Q3_K, IQ4_XS, TQ1_0, TQ2_0 (against Q8_K activations), IQ4_NL, MXFP4 and the repacked rows of Q4_0
(against Q8_0), in llama.cpp's x86 float order; and, through the same entry points and row tiling (``_mv``), the
grid formats IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, whose decode kernels are ``dot_grid``'s.

    mul_mat(w, wtype, x, out, scratch)     # out[i, r] = dot(w[r], x[i]); x float32 [n, k], rounded here to the
                                           # format's dot type (blocks.BLOCKS[wtype].dot_type) as ggml does

The block facts (field offsets, block bytes) and the scalar parts of each decode rule (a sub-block's scale:
``blocks.q2_k_scale``, ``q3_k_scale``, ``iq4_xs_scale``) come from the table; the quant bytes of a 32-value group are
decoded sixteen or thirty-two lanes at a time by the intrinsics below, one per packing the table names (2-bit
planes, a high-bit plane, nibbles through the IQ4 value table). TQ1_0 decodes a whole super-block per intrinsic
(``tq1_lanes``), as the grid formats do (dot_grid).

Float order, per (weight row, activation row) pair (ggml-cpu/arch/x86/quants.c and vec.cpp, AVX2 forms):
- Q2_K, Q3_K, IQ4_XS (``ggml_vec_dot_*_q8_K``): per super-block eight exact int32 lanes (lane l: the scaled
  products of elements 4l..4l+3 of every 32-value group), ``acc = fma(d_x * d_w, lanes, acc)``; Q2_K first
  ``acc = fma(-d_x * dmin_w, madd(mins, bsums), acc)``; at the end ``hsum_float_8(acc)``.
- IQ4_NL: llama.cpp repacks rows % 8 == 0 (``gemv/gemm_q4_b32_8x8_q8_0_lut_avx``, the same per pair at every batch
  size): per block the exact integer sum, ``acc = fma(f32(isum), d_w * d_x, acc)``, one scalar chain. Other row
  counts: ``ggml_vec_dot_iq4_nl_q8_0`` (even and odd blocks in two f32x8 accumulators, their sum's hsum, an odd last
  block added with one fma).
- MXFP4: as IQ4_NL (repacked rows % 8 == 0: ``gemv_mxfp4_8x8_q8_0``; else ``ggml_vec_dot_mxfp4_q8_0``), the FP4
  value table and the block scale 2^(e - 128) in place of IQ4_NL's.
- Q4_0 with rows % 8 == 0 (llama.cpp repacks these too: ``gemv/gemm_q4_0_8x8_q8_0``): IQ4_NL's repacked chain with
  the values q - 8 (its other rows are dot_q32's ``ggml_vec_dot_q4_0_q8_0``).
- TQ2_0, TQ1_0 (``ggml_vec_dot_tq*_q8_K``): the digits 0..2 against x in exact int32 lanes (lane l: elements
  4l..4l+3 of every 32-value group) minus the activations' block sums 2l and 2l + 1 (the - 1 of each value),
  ``acc = fma(d_x * d_w, lanes, acc)`` (the source's mul and add, contracted by the compiler), ``hsum_float_8``.
- The grid formats: dot_grid's module text.
- F16 (``ggml_vec_dot_f16``, x rounded to F16): four f32x8 accumulators over steps of 32, ``fma(w, x, acc_j)``;
  reduced as GGML_F32x8_REDUCE: (a0 + a2) + (a1 + a3), halves added, two hadds. AVX-512 builds: sixteen lanes and
  steps of 64 (``_fdot16``); llampy follows the host's width (simd.F16_VEC_LANES), as llama.cpp built for it does. BF16 (``ggml_vec_dot_bf16``):
  the same four accumulators (``add(mul(w, x), c)``: the products of two 8-bit significands are exact, so this is
  the fma's value), reduced (c1 + c3) + (c2 + c4), then hsum_float_8. Leftover values (k % 32) in double.
- F32 (``ggml_vec_dot_f32``, one activation row: tinyBLAS takes n >= 2): F16's accumulators, widths and reduction
  on the float32 values; the leftovers ``sumf += w * x`` in float, the product rounded (as dot_f32_short's).
Integer lane sums are exact in any order; the float operations are ggml's, one for one, so each kernel gives
the same bits on AVX2, AVX-512 and the generic path (LLAMPY_SIMD).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ... import blocks as B
from ...types import GGMLType
from .act_quant import (PAR_ROWS, _round_bf16, _round_f16, act_split, q8_0_split, q8_k_split, round_half,
                        scratch_for)
from .direct import Direct
from .dot_kquant import _bc_interleave, _hadd, _madd, _maddubs, hsum8x_ir, i32x8_sum, prefetch_span
from .dot_q32 import (GLU_SWIGLU, ROW_CHUNK, _store8, prefetch_base, prefetch_byte, prefetch_row, prefetch_step)
from .simd import (F16_VEC_LANES, v16_add, v16_fma, v16_geglu, v16_load, v16_mul, v16_reduce, v16_silu, v16_store,
                   v16_zero)
from .simd import (AVX2, VNNI, _I16, _I32, _I8, _V_F32x8, _V_I32x8, _call, _elem_ptr, _load, _nibbles32,
                   _ptr,
                   _udot, f16_at, f32x8,
                   f32x8_add, f32x8_fma, f32x8_hsum, f32x8_load, f32x8_scale, f32x8_store, f32x8_zero,
                   i32x8, i32x8_add, i32x8_to_f32x8)

T = GGMLType
_V32 = ir.VectorType(_I8, 32)
_V16 = ir.VectorType(_I8, 16)
_W16 = ir.VectorType(_I16, 16)


def _splat(ty, v):
    return ir.Constant(ty, [v] * ty.count)


def _shuf(builder, a, b, idx):
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, len(idx)), list(idx)))


# ------------------------------------------------------------------------------------------------ group decoders

@intrinsic
def crumbs32(typingctx, w, off, shift):
    """32 two-bit values: the 32 bytes at byte ``off`` of w shifted right by ``shift``, masked to 2 bits (Q2_K's low
    bits of one 32-value group: ``(q2bits >> 2s) & 3``), as unsigned bytes."""
    def codegen(context, builder, sig, args):
        q = _load(builder, _ptr(context, builder, sig.args[0], args[0], args[1], _V32))
        s = builder.trunc(context.cast(builder, args[2], sig.args[2], types.int64), _I8)
        sv = builder.shuffle_vector(builder.insert_element(ir.Constant(_V32, None), s, ir.Constant(_I32, 0)),
                                    ir.Constant(_V32, None), ir.Constant(ir.VectorType(_I32, 32), [0] * 32))
        return builder.bitcast(builder.and_(builder.lshr(q, sv), _splat(_V32, 3)), _V_I32x8)
    return i32x8(w, types.intp, shift), codegen


def _nib_lut32(kv):
    """An intrinsic: 32 signed bytes, the value table kv at the nibbles of the 16 bytes at byte ``off`` of w
    (elements 0..15 the low nibbles, 16..31 the high ones), as ggml's ``_mm_shuffle_epi8(values128, nibbles)``."""
    kv = [int(v) for v in kv]

    @intrinsic
    def nib_lut(typingctx, w, off):
        def codegen(context, builder, sig, args):
            q = _load(builder, _ptr(context, builder, sig.args[0], args[0], args[1], _V16))
            return builder.bitcast(_lut_nibbles(builder, q, kv), _V_I32x8)
        return i32x8(w, types.intp), codegen
    return nib_lut


def _lut_nibbles(builder, q, kv):
    """<16 x i8> packed nibbles -> <32 x i8>: kv at the low nibbles (elements 0..15), then at the high ones."""
    lo = builder.and_(q, _splat(_V16, 15))
    hi = builder.lshr(q, _splat(_V16, 4))
    return _lut32(builder, _shuf(builder, lo, hi, range(32)), kv)


def _signed_madd(builder, a, b, s16):
    """madd(mul_add_epi8(a, b), s16): ggml's sign trick (maddubs(|a|, b with a's sign); exact, |a| <= 127) on two
    <32 x i8>, the pair sums times the <16 x i16> s16. b's sign change is one vpsignb on AVX2 (``_sign_of``; the
    compares and selects that state it were not folded into one)."""
    return _madd(builder, _maddubs(builder, _abs8(builder, a), _sign_of(builder, b, a)), s16)


nib_lut32 = _nib_lut32(B.KVALUES_IQ4NL)      # IQ4_NL, IQ4_XS
fp4_lut32 = _nib_lut32(B.KVALUES_FP4)        # MXFP4


def _row_ptr(context, builder, aryty, ary, r, off):
    """(i8* to byte ``off`` of row ``r`` of a 2-D array, the row stride): the rows of a tile are addressed from one
    base, with no array view per row."""
    a = context.make_array(aryty)(context, builder, ary)
    s0 = cgutils.unpack_tuple(builder, a.strides, 2)[0]
    p = builder.gep(builder.bitcast(a.data, _I8.as_pointer()), [builder.add(builder.mul(r, s0), off)])
    return p, s0


def _abs8(builder, v):
    """|v| of a <32 x i8> (v > -128)."""
    zero = _splat(_V32, 0)
    return builder.select(builder.icmp_signed("<", v, zero), builder.sub(zero, v), v)


def _sign_of(builder, a, b):
    """a with b's sign (vpsignb on AVX2): a where b > 0, -a where b < 0, 0 where b == 0. With ``_abs8(b)``, ``_udot(|b|,
    _sign_of(a, b))`` is a . b exactly (|a|, |b| <= 127): ggml's sign trick with the roles swapped, so that the
    activations' |x| is taken once for every weight row it meets."""
    if AVX2:
        return _call(builder, "llvm.x86.avx2.psign.b", _V32, [a, b])
    zero = _splat(_V32, 0)
    r = builder.select(builder.icmp_signed("<", b, zero), builder.sub(zero, a), a)
    return builder.select(builder.icmp_signed("==", b, zero), zero, r)


def _lut32(builder, idx, tab):
    """<32 x i8> indices 0..15 -> the bytes of the 16-entry table tab at them (vpshufb on AVX2, the same table in
    both 128-bit halves)."""
    if AVX2:
        return _call(builder, "llvm.x86.avx2.pshuf.b", _V32, [ir.Constant(_V32, tab + tab), idx])
    v = ir.Constant(_V32, [0] * 32)
    for j, kj in enumerate(tab):
        v = builder.select(builder.icmp_unsigned("==", idx, _splat(_V32, j)), _splat(_V32, kj), v)
    return v


def _rows_pairs(context, builder, sig, args, j):
    """Rows j and j + 4 of ``_row_ptr``'s tile (args: w, r, o) as one <32 x i8>: row j's 16 bytes at o in the lower
    half, row j + 4's in the upper (a load and a vinserti128)."""
    p, s0 = _row_ptr(context, builder, sig.args[0], args[0], args[1], args[2])
    qa, qb = (_load(builder, builder.bitcast(builder.gep(p, [builder.mul(ir.Constant(s0.type, t), s0)]),
                                             _V16.as_pointer())) for t in (j, j + 4))
    return builder.shuffle_vector(qa, qb, ir.Constant(ir.VectorType(_I32, 32), list(range(32))))


def _x_halves(context, builder, sig, args, ia):
    """x's 16 values at byte args[ia + 1] and the 16 after them, each in both halves of a <32 x i8>."""
    xlo, xhi = (_load(builder, _ptr(context, builder, sig.args[ia], args[ia], builder.add(args[ia + 1], ir.Constant(
        args[ia + 1].type, d)), _V16)) for d in (0, 16))
    return tuple(builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, 32), list(range(16)) * 2))
                 for v in (xlo, xhi))


def _q4_rows8(kv):
    """An intrinsic: lane j the exact integer dot product of the 32-value block at byte ``o`` of row r + j of w (a
    2-D uint8 array; the table kv at the 16 nibble bytes there, low nibbles the block's first 16 values) with the 32
    int8 activations at byte xo of x: eight weight rows' block sums side by side, the lanes of llama.cpp's repacked
    gemv (one row per lane there too), from rows in GGUF's layout. Rows j and j + 4 share one 256-bit vector
    (``_rows_pairs``, as ``q40_rows8``): the table at its low nibbles against x's first 16 values in both halves, at
    its high ones against the last 16, each with the sign trick turned round (|x| times w given x's sign: |x| once
    for the eight rows), the two int32 sums added; four vectors of two rows reduced to row order by three vphaddd
    (eight vectors, six vphaddd and a cross-half add before: 576 x 576 IQ4_NL in cache, one thread, 18.8 -> 14.9
    us). The same integers."""
    kv = [int(v) for v in kv]

    @intrinsic
    def rows8(typingctx, w, r, o, x, xo):
        def codegen(context, builder, sig, args):
            xlo, xhi = _x_halves(context, builder, sig, args, 3)
            alo, ahi = _abs8(builder, xlo), _abs8(builder, xhi)
            m15, four = _splat(_V32, 15), _splat(_V32, 4)
            vs = []
            for j in range(4):
                v = _rows_pairs(context, builder, sig, args, j)
                lo = _udot(builder, alo, _sign_of(builder, _lut32(builder, builder.and_(v, m15), kv), xlo))
                vs.append(_udot(builder, ahi, _sign_of(builder, _lut32(builder, builder.lshr(v, four), kv), xhi), lo))
            return _hadd(builder, _hadd(builder, vs[0], vs[1]), _hadd(builder, vs[2], vs[3]))
        return i32x8(w, types.intp, types.intp, x, types.intp), codegen
    return rows8


def _q4_rows8_off(kv, bias):
    """``_q4_rows8`` in the offset form (``q40_rows8``'s), for a table with |v| <= bias and 4 * 2 * bias * 127 < 2^15
    (MXFP4: 12): the table shifted to kv + bias, unsigned bytes 0 .. 2 * bias, times x with no sign step (the two
    halves' pair sums <= 2 * 24 * 127 each, added as int16 before one vpmaddwd: exact), plus ``ns`` (int32: -bias
    times x's block sum, ``_r8_neg``, made once per call) in every lane. The same integers as the table and the sign
    trick (MXFP4 576 x 576 in cache, one thread: 18.9 -> 14.7 us)."""
    ku = [int(v) + bias for v in kv]
    assert min(ku) >= 0 and 4 * max(ku) * 127 < 1 << 15

    @intrinsic
    def rows8(typingctx, w, r, o, x, xo, ns):
        def codegen(context, builder, sig, args):
            xlo, xhi = _x_halves(context, builder, sig, args, 3)
            m15, four = _splat(_V32, 15), _splat(_V32, 4)
            vs = []
            for j in range(4):
                v = _rows_pairs(context, builder, sig, args, j)
                vs.append(_udot2(builder, _lut32(builder, builder.and_(v, m15), ku), xlo,
                                 _lut32(builder, builder.lshr(v, four), ku), xhi))
            h = _hadd(builder, _hadd(builder, vs[0], vs[1]), _hadd(builder, vs[2], vs[3]))
            t = builder.insert_element(ir.Constant(_V_I32x8, None), context.cast(builder, args[5], sig.args[5],
                                                                                 types.int32), ir.Constant(_I32, 0))
            return builder.add(h, _shuf(builder, t, t, [0] * 8))
        return i32x8(w, types.intp, types.intp, x, types.intp, types.int32), codegen
    return rows8


def _q4_acts8(kv):
    """An intrinsic: lane a the exact integer dot product of the 32-value block at byte ``o`` of the weight row wr
    (decoded once: kv at its nibbles) with the 32 int8 activations at byte xo of row i + a of x (a 2-D int8 array):
    one weight block against eight activation rows, their block sums side by side (the prompt tiles' form)."""
    kv = [int(v) for v in kv]

    @intrinsic
    def acts8(typingctx, wr, o, x, i, xo):
        def codegen(context, builder, sig, args):
            q = _load(builder, _ptr(context, builder, sig.args[0], args[0], args[1], _V16))
            a = _lut_nibbles(builder, q, kv)
            absa = _abs8(builder, a)          # ggml's sign trick: |w| once, each activation row given w's sign
            p, s0 = _row_ptr(context, builder, sig.args[2], args[2], args[3], args[4])
            lanes = []
            for j in range(8):
                xb = _load(builder, builder.bitcast(builder.gep(p, [builder.mul(ir.Constant(s0.type, j), s0)]),
                                                    _V32.as_pointer()))
                lanes.append(_udot(builder, absa, _sign_of(builder, xb, a)))
            return hsum8x_ir(builder, lanes)
        return i32x8(wr, types.intp, x, types.intp, types.intp), codegen
    return acts8


MX_BIAS = 12            # MXFP4's values (ggml's doubled E2M1, |v| <= 12) in the offset form
nl_rows8, nl_acts8 = _q4_rows8(B.KVALUES_IQ4NL), _q4_acts8(B.KVALUES_IQ4NL)
mx_rows8, mx_acts8 = _q4_rows8_off(B.KVALUES_FP4, MX_BIAS), _q4_acts8(B.KVALUES_FP4)
# Q4_0's rule q - 8 as a table (llama.cpp's repack XORs the nibbles with 0x88 so that its table gives q - 8)
Q4_0_VALUES = tuple(range(-8, 8))


@intrinsic
def q40_acts8(typingctx, wr, o, x, i, xo, neg, no):
    """``_q4_acts8`` with Q4_0's values q - 8, in the offset form: the block's unsigned nibbles (decoded once) times
    each of the eight activation rows (``_udot``: pair sums <= 2 * 15 * 127, exact), the eight sums reduced together,
    plus lanes no .. no + 7 of the int32 array ``neg``, -8 times each row's block sum (made once per call for every
    weight row, ``_tiles_r8``): the same integers as the table and the sign trick, without a lookup, an |w| and a
    sign per activation row (Q4_0 tiles at n = 512, 1536 x 576, one thread: 13.5 -> 11.6 ms CPU)."""
    def codegen(context, builder, sig, args):
        q = _load(builder, _ptr(context, builder, sig.args[0], args[0], args[1], _V16))
        a = _nibbles32(builder, q)
        p, s0 = _row_ptr(context, builder, sig.args[2], args[2], args[3], args[4])
        lanes = []
        for j in range(8):
            xb = _load(builder, builder.bitcast(builder.gep(p, [builder.mul(ir.Constant(s0.type, j), s0)]),
                                                _V32.as_pointer()))
            lanes.append(_udot(builder, a, xb))
        no = context.cast(builder, args[6], sig.args[6], types.intp)
        return builder.add(hsum8x_ir(builder, lanes),
                           _load(builder, _elem_ptr(context, builder, sig.args[5], args[5], no, _V_I32x8)))
    return i32x8(wr, types.intp, x, types.intp, types.intp, neg, types.intp), codegen


def _udot2(builder, a1, b1, a2, b2):
    """``_udot(a1, b1) + _udot(a2, b2)`` for unsigned a1, a2 <= 24 (Q4_0's nibbles, MXFP4's offset values): on AVX2
    the two vpmaddubsw's int16 pair sums added as int16 (four products, |sum| <= 4 * 24 * 128, exact) before one
    vpmaddwd; two vpdpbusd on VNNI. The same integers on every path."""
    if AVX2 and not VNNI:
        w16 = ir.VectorType(_I16, 16)
        p = builder.add(_call(builder, "llvm.x86.avx2.pmadd.ub.sw", w16, [a1, b1]),
                        _call(builder, "llvm.x86.avx2.pmadd.ub.sw", w16, [a2, b2]))
        return _call(builder, "llvm.x86.avx2.pmadd.wd", _V_I32x8, [p, ir.Constant(w16, [1] * 16)])
    return _udot(builder, a2, b2, _udot(builder, a1, b1))


@intrinsic
def q40_rows8(typingctx, w, r, o, x, xo, ns):
    """``_q4_rows8`` with Q4_0's values q - 8, in the offset form: each row's unsigned nibbles times x (pair sums
    <= 2 * 15 * 127, exact on AVX2 too), the eight rows' sums reduced together, plus ``ns`` (int32: -8 times x's
    block sum, ``_r8_neg``, made once per call) in every lane; the same integers as the table and the sign trick,
    without a lookup and a sign per row and block. Rows j and j + 4 share one 256-bit vector (row j's 16 bytes in
    the lower half, row j + 4's in the upper: one load and one vinserti128), so one mask gives both rows' low
    nibbles (against x's first 16 values broadcast to both halves) and one shift and mask their high nibbles
    (against x's last 16): four vectors of two rows, whose int32 lanes three vphaddd reduce to row order
    0..7 with no cross-half step (eight vectors, six vphaddd and a cross-half add before)."""
    def codegen(context, builder, sig, args):
        p, s0 = _row_ptr(context, builder, sig.args[0], args[0], args[1], args[2])
        xlo, xhi = (_load(builder, _ptr(context, builder, sig.args[3], args[3], builder.add(args[4], ir.Constant(
            args[4].type, d)), _V16)) for d in (0, 16))
        xlo, xhi = (builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, 32), list(range(16)) * 2))
                    for v in (xlo, xhi))
        m15, four = _splat(_V32, 15), _splat(_V32, 4)
        vs = []
        for j in range(4):
            qa, qb = (_load(builder, builder.bitcast(builder.gep(p, [builder.mul(ir.Constant(s0.type, t), s0)]),
                                                     _V16.as_pointer())) for t in (j, j + 4))
            v = builder.shuffle_vector(qa, qb, ir.Constant(ir.VectorType(_I32, 32), list(range(32))))
            vs.append(_udot2(builder, builder.and_(v, m15), xlo, builder.lshr(v, four), xhi))
        h = _hadd(builder, _hadd(builder, vs[0], vs[1]), _hadd(builder, vs[2], vs[3]))
        t = builder.insert_element(ir.Constant(_V_I32x8, None), context.cast(builder, args[5], sig.args[5],
                                                                             types.int32), ir.Constant(_I32, 0))
        return builder.add(h, _shuf(builder, t, t, [0] * 8))
    return i32x8(w, types.intp, types.intp, x, types.intp, types.int32), codegen


def _neg_sum(bias):
    """An intrinsic: -bias times the sum of the 32 int8 at byte xo of x (the offset forms' term: ``q40_rows8``,
    ``_q4_rows8_off``): one ``_udot`` and a reduction."""
    @intrinsic
    def neg(typingctx, x, xo):
        def codegen(context, builder, sig, args):
            v = _udot(builder, _splat(_V32, bias), _x32(context, builder, sig, args, 0, 1))
            return builder.sub(ir.Constant(_I32, 0), _call(builder, "llvm.vector.reduce.add.v8i32", _I32, [v]))
        return types.int32(x, types.intp), codegen
    return neg


q40_neg, mx_neg = _neg_sum(8), _neg_sum(MX_BIAS)


@intrinsic
def f16_rows8(typingctx, w, r, o):
    """Lane j: the F16 value at byte ``o`` of row r + j of w (a 2-D uint8 array), as float32 (exact)."""
    def codegen(context, builder, sig, args):
        p, s0 = _row_ptr(context, builder, sig.args[0], args[0], args[1], args[2])
        v = ir.Constant(ir.VectorType(_I16, 8), None)
        for j in range(8):
            h = _load(builder, builder.bitcast(builder.gep(p, [builder.mul(ir.Constant(s0.type, j), s0)]),
                                               _I16.as_pointer()))
            v = builder.insert_element(v, h, ir.Constant(_I32, j))
        return builder.fpext(builder.bitcast(v, ir.VectorType(ir.HalfType(), 8)), _V_F32x8)
    return f32x8(w, types.intp, types.intp), codegen


@intrinsic
def f32x8_set(typingctx, a0, a1, a2, a3, a4, a5, a6, a7):
    """Eight float32 scalars as lanes 0..7."""
    def codegen(context, builder, sig, args):
        v = ir.Constant(_V_F32x8, None)
        for j in range(8):
            v = builder.insert_element(v, context.cast(builder, args[j], sig.args[j], types.float32),
                                       ir.Constant(_I32, j))
        return v
    return f32x8(a0, a1, a2, a3, a4, a5, a6, a7), codegen


def _tq1_digit_vec(builder, a, c16, d4, g):
    """<32 x i8>: TQ1_0's values 32g..32g+31 as their block bytes times 3^digit mod 256 (``blocks.tq1_0_byte_digit``),
    from ``a`` (bytes 0..31), ``c16`` (32..47) and ``d4`` (48..51, widened to 16 lanes)."""
    src, pw = zip(*(B.tq1_0_byte_digit.py_func(32 * g + v) for v in range(32)))
    pows = [int(B.POW3[n]) & 255 for n in pw]
    if max(src) < 32:
        q = _shuf(builder, a, a, src) if list(src) != list(range(32)) else a
    else:
        q = _shuf(builder, c16, d4, [b - 32 if b < 48 else 16 + b - 48 for b in src])
    if pows != [1] * 32:
        q = builder.mul(q, ir.Constant(_V32, pows))
    return q


def _tq1_digits(builder, q):
    """The digit (q * 3) >> 8 of each byte q, as ggml's AVX2 kernel takes it: a saturating - 1, two rounding averages,
    the top two bits (the same digit for every byte; vpsubusb, vpavgb, vpsrlw, vpand)."""
    ext = ir.VectorType(_I16, 32)

    def avg(u, v):
        if AVX2:      # the call itself: LLVM saw through the generic form and widened the bytes to int16
            return _call(builder, "llvm.x86.avx2.pavg.b", _V32, [u, v])
        t = builder.add(builder.add(builder.zext(u, ext), builder.zext(v, ext)), _splat(ext, 1))
        return builder.trunc(builder.lshr(t, _splat(ext, 1)), _V32)
    q1 = _call(builder, "llvm.usub.sat.v32i8", _V32, [q, _splat(_V32, 1)])
    return builder.lshr(avg(q1, avg(q1, _splat(_V32, 0))), _splat(_V32, 6))


@intrinsic
def tq1_lanes(typingctx, w, o, x, xo):
    """TQ1_0's eight int32 lanes of one super-block before its block sums are taken off (the block at byte o of w,
    the 256 int8 activations at byte xo of x): per 32-value group the digits 0..2 times x (maddubs), the sixteen
    pair sums of the eight groups added as int16 (<= 8 * 2 * 2 * 128, exact), then summed in pairs (madd by 1):
    lane l the products of elements 4l..4l+3 of every group, as ``lanes_u`` per group gave them. The digits of a
    byte taken as ggml's AVX2 kernel does (``_tq1_digits``), the 3^n multiples of the 32 shared bytes one byte
    multiply each."""
    def codegen(context, builder, sig, args):
        wty, xty = sig.args[0], sig.args[2]
        ity = context.get_value_type(types.intp)
        o = context.cast(builder, args[1], sig.args[1], types.intp)
        xo = context.cast(builder, args[3], sig.args[3], types.intp)

        def at(off, vty):
            return _load(builder, _ptr(context, builder, wty, args[0], builder.add(o, ir.Constant(ity, off)), vty))
        a = at(0, _V32)
        c16 = at(32, _V16)
        d4 = at(48, ir.VectorType(_I8, 4))
        d4 = _shuf(builder, d4, d4, [j & 3 for j in range(16)])
        acc = None
        for g in range(8):
            q = _tq1_digits(builder, _tq1_digit_vec(builder, a, c16, d4, g))
            xv = _load(builder, _ptr(context, builder, xty, args[2], builder.add(xo, ir.Constant(ity, 32 * g)), _V32))
            p16 = _maddubs(builder, q, xv)
            acc = p16 if acc is None else builder.add(acc, p16)
        return _madd(builder, acc, _splat(_W16, 1))
    return i32x8(w, types.intp, x, types.intp), codegen


def _x32(context, builder, sig, args, ia, io):
    return _load(builder, _ptr(context, builder, sig.args[ia], args[ia], args[io], _V32))


def _scale_pair(context, builder, sig, args, i0, i1):
    """<16 x i16>: scale i0 in lanes 0..7, scale i1 in 8..15 (the two 16-value sub-blocks of a 32-value group)."""
    s0 = builder.trunc(context.cast(builder, args[i0], sig.args[i0], types.int64), _I16)
    s1 = builder.trunc(context.cast(builder, args[i1], sig.args[i1], types.int64), _I16)
    v = builder.insert_element(ir.Constant(ir.VectorType(_I16, 2), None), s0, ir.Constant(_I32, 0))
    v = builder.insert_element(v, s1, ir.Constant(_I32, 1))
    return _shuf(builder, v, v, [0] * 8 + [1] * 8)


@intrinsic
def lanes_u(typingctx, q, x, xo, s0, s1):
    """Eight int32 lanes: ``madd(scales, maddubs(q, x))`` with the unsigned bytes in ``q`` (from a decoder), the 32
    int8 activations at byte xo of x, scale s0 over elements 0..15 and s1 over 16..31 (ggml's k-quant step)."""
    if q != i32x8:
        return None

    def codegen(context, builder, sig, args):
        p16 = _maddubs(builder, builder.bitcast(args[0], _V32), _x32(context, builder, sig, args, 1, 2))
        return _madd(builder, _scale_pair(context, builder, sig, args, 3, 4), p16)
    return i32x8(i32x8, x, types.intp, s0, s1), codegen


@intrinsic
def q3k_lanes(typingctx, w, o, x, xo):
    """Q3_K's eight int32 lanes of one super-block (the block at byte o of w, the 256 int8 activations at byte xo of
    x): per 32-value group c, ``madd(scales, maddubs(q3l, x) - maddubs(q3h, x))`` (q3l the two low bits, q3h 4
    where the high bit is clear; the difference taken on the int16 pair sums as ggml does), summed over the groups. The sixteen 6-bit scales are decoded at once into one vector (ggml's AVX2 kernel does the
    same with its kmask shifts), each group's pair a shuffle of it; the low-bit bytes and the high-bit mask are
    loaded once for all groups."""
    kinds = {"hm": Q3_HM, "qs": Q3_QS, "sc": Q3_SC}

    def codegen(context, builder, sig, args):
        wty, xty = sig.args[0], sig.args[2]
        ity = context.get_value_type(types.intp)
        o = context.cast(builder, args[1], sig.args[1], types.intp)
        xo = context.cast(builder, args[3], sig.args[3], types.intp)

        def at(off, vty):
            return _load(builder, _ptr(context, builder, wty, args[0], builder.add(o, ir.Constant(ity, off)), vty))
        lo8 = at(kinds["sc"], ir.VectorType(_I8, 8))
        hi4 = at(kinds["sc"] + 8, ir.VectorType(_I8, 4))
        lo = builder.lshr(_shuf(builder, lo8, lo8, [j & 7 for j in range(16)]),
                          ir.Constant(_V16, [4 * (j >> 3) for j in range(16)]))
        hi = builder.lshr(_shuf(builder, hi4, hi4, [j & 3 for j in range(16)]),
                          ir.Constant(_V16, [2 * (j >> 2) for j in range(16)]))
        sc = builder.or_(builder.and_(lo, _splat(_V16, 15)), builder.shl(builder.and_(hi, _splat(_V16, 3)),
                                                                          _splat(_V16, 4)))
        sc16 = builder.sext(builder.sub(sc, _splat(_V16, 32)), _W16)
        hm = builder.xor(at(kinds["hm"], _V32), _splat(_V32, -1))
        qs = [at(kinds["qs"], _V32), at(kinds["qs"] + 32, _V32)]
        acc = None
        for c in range(8):
            q = builder.and_(builder.lshr(qs[c >> 2], _splat(_V32, 2 * (c & 3))), _splat(_V32, 3))
            h = builder.shl(builder.and_(builder.lshr(hm, _splat(_V32, c)), _splat(_V32, 1)), _splat(_V32, 2))
            xv = _load(builder, _ptr(context, builder, xty, args[2], builder.add(xo, ir.Constant(ity, 32 * c)), _V32))
            p16 = builder.sub(_maddubs(builder, q, xv), _maddubs(builder, h, xv))
            v = _madd(builder, _shuf(builder, sc16, sc16, [2 * c] * 8 + [2 * c + 1] * 8), p16)
            acc = v if acc is None else builder.add(acc, v)
        return acc
    return i32x8(w, o, x, xo), codegen


@intrinsic
def lanes_s(typingctx, q, x, xo, s):
    """Eight int32 lanes of the signed bytes in ``q`` times the 32 int8 activations at byte xo of x, times the scale
    ``s``: ggml's ``madd(mul_add_epi8(q, x), set1(s))`` (sign trick: maddubs(|q|, x with q's sign); exact, |q| <= 127)."""
    if q != i32x8:
        return None

    def codegen(context, builder, sig, args):
        a = builder.bitcast(args[0], _V32)
        b = _x32(context, builder, sig, args, 1, 2)
        sv = builder.trunc(context.cast(builder, args[3], sig.args[3], types.int64), _I16)
        return _signed_madd(builder, a, b, _shuf(builder, builder.insert_element(ir.Constant(_W16, None), sv,
                                                                                 ir.Constant(_I32, 0)),
                                                  ir.Constant(_W16, None), [0] * 16))
    return i32x8(i32x8, x, types.intp, s), codegen


@intrinsic
def iq4xs_lanes(typingctx, w, o, x, xo):
    """IQ4_XS's eight int32 lanes of one super-block (the block at byte o of w, the 256 int8 activations at byte
    xo of x): per 32-value group g, the IQ4_NL table at its nibbles times x by the sign trick, the pair sums times
    the group's 6-bit scale (``lanes_s``), summed over the groups. The eight scales are decoded at once into one
    vector (low nibbles from scales_l, two high bits each from scales_h), each group's a broadcast of its lane."""
    kv = [int(v) for v in B.KVALUES_IQ4NL]

    def codegen(context, builder, sig, args):
        wty, xty = sig.args[0], sig.args[2]
        ity = context.get_value_type(types.intp)
        o = context.cast(builder, args[1], sig.args[1], types.intp)
        xo = context.cast(builder, args[3], sig.args[3], types.intp)

        def at(off, vty):
            return _load(builder, _ptr(context, builder, wty, args[0], builder.add(o, ir.Constant(ity, off)), vty))
        v8 = ir.VectorType(_I8, 8)
        w8 = ir.VectorType(_I16, 8)
        sl = at(X4_SL, ir.VectorType(_I8, 4))
        lo = builder.and_(builder.lshr(_shuf(builder, sl, sl, [g >> 1 for g in range(8)]),
                                       ir.Constant(v8, [4 * (g & 1) for g in range(8)])), _splat(v8, 15))
        sh = at(X4_SH, ir.VectorType(_I16, 1))
        hi = builder.and_(builder.lshr(_shuf(builder, sh, sh, [0] * 8), ir.Constant(w8, [2 * g for g in range(8)])),
                          _splat(w8, 3))
        ls = builder.sub(builder.or_(builder.zext(lo, w8), builder.shl(hi, _splat(w8, 4))), _splat(w8, 32))
        acc = None
        for g in range(8):
            q = _lut_nibbles(builder, at(X4_QS + 16 * g, _V16), kv)
            xv = _load(builder, _ptr(context, builder, xty, args[2], builder.add(xo, ir.Constant(ity, 32 * g)), _V32))
            v = _signed_madd(builder, q, xv, _shuf(builder, ls, ls, [g] * 16))
            acc = v if acc is None else builder.add(acc, v)
        return acc
    return i32x8(w, o, x, xo), codegen


@intrinsic
def q2k_min_lanes(typingctx, w, o, bs, bo):
    """Q2_K's min term before its conversion: ``madd(mins, bsums)``, the sixteen 4-bit mins (high nibbles of the
    scales at byte o of w) against the activations' sixteen block sums (int16, from element bo of bs)."""
    def codegen(context, builder, sig, args):
        sc = _load(builder, _ptr(context, builder, sig.args[0], args[0], args[1], _V16))
        mins = builder.zext(builder.lshr(sc, _splat(_V16, 4)), _W16)
        b = _load(builder, _elem_ptr(context, builder, sig.args[2], args[2], args[3], _W16))
        return _madd(builder, mins, b)
    return i32x8(w, types.intp, bs, types.intp), codegen


@intrinsic
def bsum_lanes(typingctx, bs, bo):
    """Eight int32 lanes, lane m the sum of the activations' block sums 2m and 2m + 1 (int16, from element bo of
    bs): ggml's ``madd(sumi - bsums, 1)`` for the ternary formats takes them from the value lanes so."""
    def codegen(context, builder, sig, args):
        b = _load(builder, _elem_ptr(context, builder, sig.args[0], args[0], args[1], _W16))
        return _madd(builder, b, _splat(_W16, 1))
    return i32x8(bs, types.intp), codegen


@intrinsic
def i32x8_sub(typingctx, a, b):
    if a != i32x8 or b != i32x8:
        return None

    def codegen(context, builder, sig, args):
        return builder.sub(args[0], args[1])
    return i32x8(i32x8, i32x8), codegen


@intrinsic
def i32x8_zero(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(_V_I32x8, [0] * 8)
    return i32x8(), codegen


# ------------------------------------------------------------------------------------------------ float loads

@intrinsic
def f32x8_ld(typingctx, arr, i, bf):
    """arr[i:i+8] as float32 lanes: a float32 array as it is, uint16 bits widened as F16 (``bf`` False) or BF16
    (``bf`` True: shifted to the top of a float32); ``bf`` a literal."""
    if not isinstance(arr, types.Array) or arr.dtype not in (types.float32, types.uint16):
        return None
    if not isinstance(bf, types.BooleanLiteral):
        return None
    dt, is_bf = arr.dtype, bf.literal_value

    def codegen(context, builder, sig, args):
        if dt == types.float32:
            return _load(builder, _elem_ptr(context, builder, sig.args[0], args[0], args[1], _V_F32x8))
        h = _load(builder, _elem_ptr(context, builder, sig.args[0], args[0], args[1], ir.VectorType(_I16, 8)))
        if not is_bf:
            return builder.fpext(builder.bitcast(h, ir.VectorType(ir.HalfType(), 8)), _V_F32x8)
        u = builder.shl(builder.zext(h, _V_I32x8), _splat(_V_I32x8, 16))
        return builder.bitcast(u, _V_F32x8)
    return f32x8(arr, types.intp, bf), codegen


@intrinsic
def f32x8_fmav(typingctx, a, b, c):
    """a * b + c per lane, rounded once."""
    if a != f32x8 or b != f32x8 or c != f32x8:
        return None

    def codegen(context, builder, sig, args):
        return _call(builder, "llvm.fma.v8f32", _V_F32x8, list(args))
    return f32x8(f32x8, f32x8, f32x8), codegen


@intrinsic
def f16_reduce(typingctx, a0, a1, a2, a3):
    """GGML_F32x8_REDUCE (AVX) of four accumulators: x0 = (a0 + a2) + (a1 + a3); t = low half + high half; two
    hadds: (t0 + t1) + (t2 + t3)."""
    if any(a != f32x8 for a in (a0, a1, a2, a3)):
        return None

    def codegen(context, builder, sig, args):
        fa = builder.fadd
        x = fa(fa(args[0], args[2]), fa(args[1], args[3]))
        e = [builder.extract_element(x, ir.Constant(_I32, i)) for i in range(8)]
        t = [fa(e[i], e[i + 4]) for i in range(4)]
        return fa(fa(t[0], t[1]), fa(t[2], t[3]))
    return types.float32(f32x8, f32x8, f32x8, f32x8), codegen


# ------------------------------------------------------------------------------------------------ block steps
# kind: loop-invariant, so each kernel below is compiled for one format
K_Q2_K, K_Q3_K, K_IQ4_XS, K_IQ4_NL_R8, K_IQ4_NL = 0, 1, 2, 3, 4
K_TQ2_0, K_TQ1_0, K_MXFP4_R8, K_MXFP4 = 5, 6, 7, 8
K_IQ2_XXS, K_IQ2_XS, K_IQ2_S, K_IQ3_XXS, K_IQ3_S = 9, 10, 11, 12, 13
K_IQ1_S, K_IQ1_M = 14, 15
K_Q4_0_R8 = 16
IQ1S_BYTES = B.BLOCKS[T.IQ1_S].type_size
IQ1M_BYTES = B.BLOCKS[T.IQ1_M].type_size
IQ2XXS_BYTES = B.BLOCKS[T.IQ2_XXS].type_size
IQ2XS_BYTES = B.BLOCKS[T.IQ2_XS].type_size
IQ2S_BYTES = B.BLOCKS[T.IQ2_S].type_size
IQ3XXS_BYTES = B.BLOCKS[T.IQ3_XXS].type_size
IQ3S_BYTES = B.BLOCKS[T.IQ3_S].type_size

Q2 = B.BLOCKS[T.Q2_K]
Q3 = B.BLOCKS[T.Q3_K]
X4 = B.BLOCKS[T.IQ4_XS]
N4 = B.BLOCKS[T.IQ4_NL]
Q2_BYTES, Q2_QS, Q2_D, Q2_DMIN = Q2.type_size, Q2.field("qs").offset, Q2.field("d").offset, Q2.field("dmin").offset
Q3_BYTES, Q3_QS, Q3_HM, Q3_D = Q3.type_size, Q3.field("qs").offset, Q3.field("hmask").offset, Q3.field("d").offset
Q3_SC = Q3.field("scales").offset
X4_BYTES, X4_QS, X4_D = X4.type_size, X4.field("qs").offset, X4.field("d").offset
X4_SH, X4_SL = X4.field("scales_h").offset, X4.field("scales_l").offset
N4_BYTES, N4_QS, N4_D = N4.type_size, N4.field("qs").offset, N4.field("d").offset
Q40 = B.BLOCKS[T.Q4_0]
Q40_BYTES, Q40_QS, Q40_D = Q40.type_size, Q40.field("qs").offset, Q40.field("d").offset
T2 = B.BLOCKS[T.TQ2_0]
T1 = B.BLOCKS[T.TQ1_0]
MX = B.BLOCKS[T.MXFP4]
T2_BYTES, T2_QS, T2_D = T2.type_size, T2.field("qs").offset, T2.field("d").offset
T1_BYTES, T1_D = T1.type_size, T1.field("d").offset
MX_BYTES, MX_QS, MX_E = MX.type_size, MX.field("qs").offset, MX.field("e").offset


@njit(cache=True, inline="always")
def _step_bytes(kind):
    """Weight bytes one step of ``_step`` reads (a super-block; IQ4_NL, MXFP4: two blocks, their vec_dot form)."""
    if kind == K_Q2_K:
        return Q2_BYTES
    if kind == K_Q3_K:
        return Q3_BYTES
    if kind == K_IQ4_XS:
        return X4_BYTES
    if kind == K_TQ2_0:
        return T2_BYTES
    if kind == K_TQ1_0:
        return T1_BYTES
    if kind == K_MXFP4:
        return 2 * MX_BYTES
    if kind == K_IQ2_XXS:
        return IQ2XXS_BYTES
    if kind == K_IQ2_XS:
        return IQ2XS_BYTES
    if kind == K_IQ2_S:
        return IQ2S_BYTES
    if kind == K_IQ3_XXS:
        return IQ3XXS_BYTES
    if kind == K_IQ3_S:
        return IQ3S_BYTES
    if kind == K_IQ1_S:
        return IQ1S_BYTES
    if kind == K_IQ1_M:
        return IQ1M_BYTES
    return 2 * N4_BYTES


@njit(cache=True, inline="always")
def _n_steps(kind, k):
    if kind == K_IQ4_NL or kind == K_MXFP4:
        return k // 64
    return k // 256


@njit(cache=True, inline="always")
def _nl_isum(wr, o, xr, xo):
    return i32x8_sum(lanes_s(nib_lut32(wr, o + N4_QS), xr, xo, 1))


@njit(cache=True, inline="always")
def _mx_lanes(wr, o, xr, xo, g):
    return lanes_s(fp4_lut32(wr, o + g * MX_BYTES + MX_QS), xr, xo + 32 * g, 1)


@njit(cache=True, inline="always")
def _mx_d(wr, o, xdr, b0, g):
    return np.float32(B.e8m0_half(wr[o + g * MX_BYTES + MX_E]) * xdr[b0 + g])


@njit(cache=True, inline="always")
def _mx_isum(wr, o, xr, xo):
    return i32x8_sum(lanes_s(fp4_lut32(wr, o + MX_QS), xr, xo, 1))


# One step function per format and one final function per float order, all module-level names: one function
# holding several formats' branches, taking ``kind`` as an argument, was inlined with every branch at each of
# ``_mv``'s thirteen call sites (Numba prunes on ``kind`` only after inlining): compiling IQ2_XXS's kernel took
# 119 s of CPU, Q2_K's 42 s; one format each, 44 s and 19 s. Each takes the ``kind`` argument of ``_mv``'s common
# signature without using it.


@njit(cache=True, inline="always")
def _st_q2_k(kind, wr, b, xr, xdr, bsr, a1, a2, s):
    o = b * Q2_BYTES
    xo = b * 256
    xdb = xdr[b]
    lanes = i32x8_zero()
    for c in range(8):
        q = crumbs32(wr, o + Q2_QS + 32 * (c >> 2), 2 * (c & 3))
        lanes = i32x8_add(lanes, lanes_u(q, xr, xo + 32 * c, B.q2_k_scale(wr, o, 2 * c),
                                         B.q2_k_scale(wr, o, 2 * c + 1)))
    d = np.float32(xdb * f16_at(wr, o + Q2_D))
    dmin = np.float32(-xdb * f16_at(wr, o + Q2_DMIN))
    a1 = f32x8_fma(dmin, i32x8_to_f32x8(q2k_min_lanes(wr, o, bsr, b * 16)), a1)
    a1 = f32x8_fma(d, i32x8_to_f32x8(lanes), a1)
    return a1, a2, s


@njit(cache=True, inline="always")
def _st_q3_k(kind, wr, b, xr, xdr, bsr, a1, a2, s):
    o = b * Q3_BYTES
    d = np.float32(xdr[b] * f16_at(wr, o + Q3_D))
    a1 = f32x8_fma(d, i32x8_to_f32x8(q3k_lanes(wr, o, xr, b * 256)), a1)
    return a1, a2, s


@njit(cache=True, inline="always")
def _st_iq4_xs(kind, wr, b, xr, xdr, bsr, a1, a2, s):
    o = b * X4_BYTES
    d = np.float32(f16_at(wr, o + X4_D) * xdr[b])
    a1 = f32x8_fma(d, i32x8_to_f32x8(iq4xs_lanes(wr, o, xr, b * 256)), a1)
    return a1, a2, s


@njit(cache=True, inline="always")
def _st_iq4_nl(kind, wr, b, xr, xdr, bsr, a1, a2, s):
    o = b * 2 * N4_BYTES
    xo = b * 64
    d1 = np.float32(xdr[2 * b] * f16_at(wr, o + N4_D))
    d2 = np.float32(xdr[2 * b + 1] * f16_at(wr, o + N4_BYTES + N4_D))
    a1 = f32x8_fma(d1, i32x8_to_f32x8(lanes_s(nib_lut32(wr, o + N4_QS), xr, xo, 1)), a1)
    a2 = f32x8_fma(d2, i32x8_to_f32x8(lanes_s(nib_lut32(wr, o + N4_BYTES + N4_QS), xr, xo + 32, 1)), a2)
    return a1, a2, s


@njit(cache=True, inline="always")
def _st_tq2_0(kind, wr, b, xr, xdr, bsr, a1, a2, s):
    # digits 0..2 against x, minus the block sums: sum (q - 1) x with ggml's lanes (module doc)
    o = b * T2_BYTES
    xo = b * 256
    lanes = i32x8_sub(i32x8_zero(), bsum_lanes(bsr, b * 16))
    for c in range(8):
        q = crumbs32(wr, o + T2_QS + 32 * (c >> 2), 2 * (c & 3))
        lanes = i32x8_add(lanes, lanes_u(q, xr, xo + 32 * c, 1, 1))
    a1 = f32x8_fma(np.float32(xdr[b] * f16_at(wr, o + T2_D)), i32x8_to_f32x8(lanes), a1)
    return a1, a2, s


@njit(cache=True, inline="always")
def _st_tq1_0(kind, wr, b, xr, xdr, bsr, a1, a2, s):
    o = b * T1_BYTES
    lanes = i32x8_sub(tq1_lanes(wr, o, xr, b * 256), bsum_lanes(bsr, b * 16))
    a1 = f32x8_fma(np.float32(xdr[b] * f16_at(wr, o + T1_D)), i32x8_to_f32x8(lanes), a1)
    return a1, a2, s


@njit(cache=True, inline="always")
def _st_mxfp4(kind, wr, b, xr, xdr, bsr, a1, a2, s):
    o = b * 2 * MX_BYTES
    xo = b * 64
    a1 = f32x8_fma(_mx_d(wr, o, xdr, 2 * b, 0), i32x8_to_f32x8(_mx_lanes(wr, o, xr, xo, 0)), a1)
    a2 = f32x8_fma(_mx_d(wr, o, xdr, 2 * b, 1), i32x8_to_f32x8(_mx_lanes(wr, o, xr, xo, 1)), a2)
    return a1, a2, s


@njit(cache=True, inline="always")
def _fin_lanes(kind, wr, xr, xdr, k, a1, a2, s):
    """Q2_K, Q3_K, IQ4_XS, TQ2_0, TQ1_0: hsum_float_8 of the lanes."""
    return f32x8_hsum(a1)


@njit(cache=True, inline="always")
def _fin_iq4_nl(kind, wr, xr, xdr, k, a1, a2, s):
    r = f32x8_hsum(f32x8_add(a1, a2))
    nb = k // 32
    if nb % 2:           # the odd last block, as ggml's scalar tail: sumf += d * (sumi1 + sumi2), not
        # contracted (the x86 build's code: vmulss, vaddss)
        b = nb - 1
        d = np.float32(xdr[b] * f16_at(wr, b * N4_BYTES + N4_D))
        r = np.float32(r + np.float32(d * np.float32(_nl_isum(wr, b * N4_BYTES, xr, b * 32))))
    return r


@njit(cache=True, inline="always")
def _fin_mxfp4(kind, wr, xr, xdr, k, a1, a2, s):
    r = f32x8_hsum(f32x8_add(a1, a2))
    nb = k // 32
    if nb % 2:
        b = nb - 1
        r = np.float32(r + np.float32(_mx_d(wr, b * MX_BYTES, xdr, b, 0)
                                      * np.float32(_mx_isum(wr, b * MX_BYTES, xr, b * 32))))
    return r


# dot_grid's kernels inline _mv, _n_steps and _step_bytes too: Numba's cache checks a kernel's own file only, so a
# change here needs dot_grid.py touched for its kernels to compile again
@njit(cache=True, inline="always")
def _mv(w, xq, xd, bsums, out, kind, _step, _final):
    """out[i, r] = dot(w[r], x[i]) with a format's step and final functions (``_st_*``, ``_fin_*``): tiles of 4
    weight rows x 2 activation rows (eight independent chains, each weight block decoded once for both activations), then 4 x 1,
    then single rows."""
    rows = w.shape[0]
    n, k = xq.shape
    ns = _n_steps(kind, k)
    n2 = n - n % 2
    for c in prange((rows + ROW_CHUNK - 1) // ROW_CHUNK):
        r1 = min(rows, (c + 1) * ROW_CHUNK)
        r = c * ROW_CHUNK
        while r + 4 <= r1:
            w0, w1, w2, w3 = w[r], w[r + 1], w[r + 2], w[r + 3]
            pb = prefetch_base(w, r)
            step = 4 * _step_bytes(kind)
            for i in range(0, n2, 2):
                x0, x1, d0, d1, b0, b1 = xq[i], xq[i + 1], xd[i], xd[i + 1], bsums[i], bsums[i + 1]
                a00 = a01 = a10 = a11 = a20 = a21 = a30 = a31 = f32x8_zero()
                e00 = e01 = e10 = e11 = e20 = e21 = e30 = e31 = f32x8_zero()
                s00 = s01 = s10 = s11 = s20 = s21 = s30 = s31 = np.float32(0.0)
                for b in range(ns):
                    prefetch_step(w, pb, b, step)
                    a00, e00, s00 = _step(kind, w0, b, x0, d0, b0, a00, e00, s00)
                    a01, e01, s01 = _step(kind, w0, b, x1, d1, b1, a01, e01, s01)
                    a10, e10, s10 = _step(kind, w1, b, x0, d0, b0, a10, e10, s10)
                    a11, e11, s11 = _step(kind, w1, b, x1, d1, b1, a11, e11, s11)
                    a20, e20, s20 = _step(kind, w2, b, x0, d0, b0, a20, e20, s20)
                    a21, e21, s21 = _step(kind, w2, b, x1, d1, b1, a21, e21, s21)
                    a30, e30, s30 = _step(kind, w3, b, x0, d0, b0, a30, e30, s30)
                    a31, e31, s31 = _step(kind, w3, b, x1, d1, b1, a31, e31, s31)
                out[i, r] = _final(kind, w0, x0, d0, k, a00, e00, s00)
                out[i + 1, r] = _final(kind, w0, x1, d1, k, a01, e01, s01)
                out[i, r + 1] = _final(kind, w1, x0, d0, k, a10, e10, s10)
                out[i + 1, r + 1] = _final(kind, w1, x1, d1, k, a11, e11, s11)
                out[i, r + 2] = _final(kind, w2, x0, d0, k, a20, e20, s20)
                out[i + 1, r + 2] = _final(kind, w2, x1, d1, k, a21, e21, s21)
                out[i, r + 3] = _final(kind, w3, x0, d0, k, a30, e30, s30)
                out[i + 1, r + 3] = _final(kind, w3, x1, d1, k, a31, e31, s31)
            for i in range(n2, n):
                xr, dr, br = xq[i], xd[i], bsums[i]
                a0 = a1 = a2 = a3 = f32x8_zero()
                e0 = e1 = e2 = e3 = f32x8_zero()
                s0 = s1 = s2 = s3 = np.float32(0.0)
                for b in range(ns):
                    prefetch_step(w, pb, b, step)
                    a0, e0, s0 = _step(kind, w0, b, xr, dr, br, a0, e0, s0)
                    a1, e1, s1 = _step(kind, w1, b, xr, dr, br, a1, e1, s1)
                    a2, e2, s2 = _step(kind, w2, b, xr, dr, br, a2, e2, s2)
                    a3, e3, s3 = _step(kind, w3, b, xr, dr, br, a3, e3, s3)
                out[i, r] = _final(kind, w0, xr, dr, k, a0, e0, s0)
                out[i, r + 1] = _final(kind, w1, xr, dr, k, a1, e1, s1)
                out[i, r + 2] = _final(kind, w2, xr, dr, k, a2, e2, s2)
                out[i, r + 3] = _final(kind, w3, xr, dr, k, a3, e3, s3)
            r += 4
        while r < r1:
            wr = w[r]
            for i in range(n):
                a0 = e0 = f32x8_zero()
                s0 = np.float32(0.0)
                for b in range(ns):
                    a0, e0, s0 = _step(kind, wr, b, xq[i], xd[i], bsums[i], a0, e0, s0)
                out[i, r] = _final(kind, wr, xq[i], xd[i], k, a0, e0, s0)
            r += 1


# The decode kernels below take x itself beside its buffers: with ``quant`` they round x into them first (on the
# calling thread, before the rows are shared out), so a decoded token's product is one call, not a quantizer's call
# and then the kernel's (``bind_decode``); the quantizers are act_split's, so the same bytes either way.
@njit(cache=True, inline="always")
def _quant_k(x, xq, xd, bsums, quant):
    if quant:
        q8_k_split(x, xq, xd, bsums)


@njit(cache=True, inline="always")
def _quant_0(x, xq, xd, xs, quant):
    if quant:
        q8_0_split(x, xq, xd, xs, False)


@njit(parallel=True, cache=True, nogil=True)
def _q2_k(w, x, xq, xd, bsums, out, quant):
    _quant_k(x, xq, xd, bsums, quant)
    _mv(w, xq, xd, bsums, out, K_Q2_K, _st_q2_k, _fin_lanes)


@njit(parallel=True, cache=True, nogil=True)
def _q3_k(w, x, xq, xd, bsums, out, quant):
    _quant_k(x, xq, xd, bsums, quant)
    _mv(w, xq, xd, bsums, out, K_Q3_K, _st_q3_k, _fin_lanes)


@njit(parallel=True, cache=True, nogil=True)
def _iq4_xs(w, x, xq, xd, bsums, out, quant):
    _quant_k(x, xq, xd, bsums, quant)
    _mv(w, xq, xd, bsums, out, K_IQ4_XS, _st_iq4_xs, _fin_lanes)


@njit(parallel=True, cache=True, nogil=True)
def _iq4_nl(w, x, xq, xd, bsums, out, quant):
    _quant_0(x, xq, xd, bsums, quant)
    _mv(w, xq, xd, bsums, out, K_IQ4_NL, _st_iq4_nl, _fin_iq4_nl)


@njit(parallel=True, cache=True, nogil=True)
def _tq2_0(w, x, xq, xd, bsums, out, quant):
    _quant_k(x, xq, xd, bsums, quant)
    _mv(w, xq, xd, bsums, out, K_TQ2_0, _st_tq2_0, _fin_lanes)


@njit(parallel=True, cache=True, nogil=True)
def _tq1_0(w, x, xq, xd, bsums, out, quant):
    _quant_k(x, xq, xd, bsums, quant)
    _mv(w, xq, xd, bsums, out, K_TQ1_0, _st_tq1_0, _fin_lanes)


@njit(parallel=True, cache=True, nogil=True)
def _mxfp4(w, x, xq, xd, bsums, out, quant):
    _quant_0(x, xq, xd, bsums, quant)
    _mv(w, xq, xd, bsums, out, K_MXFP4, _st_mxfp4, _fin_mxfp4)


# ------------------------------------------------------------------------------------------------ repacked rows
# IQ4_NL, MXFP4 and Q4_0 with rows % 8 == 0, which llama.cpp repacks eight rows to a block
# (``gemv/gemm_q4_b32_8x8_q8_0_lut_avx``, Q4_0's nibbles XORed with 0x88 so that its table gives q - 8): per (weight row, activation row) pair and block, the exact integer sum,
# ``acc = fma(f32(isum), d_w * d_x, acc)``, in block order, at every batch size (its gemm keeps the gemv's chain). Decode holds eight weight rows as the lanes of
# one accumulator per activation row, as the gemv does (``_mv_r8``: the eight rows' block sums by one transposed
# reduction, their scales one vector); prompts hold eight or sixteen activation rows as lanes against one weight
# row, its block decoded once for all of them (``_tiles_r8``). The same chain per pair either way.

@njit(cache=True, inline="always")
def _r8_bytes(kind):
    if kind == K_Q4_0_R8:
        return Q40_BYTES
    return MX_BYTES if kind == K_MXFP4_R8 else N4_BYTES


@njit(cache=True, inline="always")
def _r8_rows(kind, w, r, o, xr, xo, neg, b):
    """Lane j: the block sum of weight row r + j (its block at byte o) with the activations at byte xo of xr (Q4_0,
    MXFP4: block b's term of ``neg``, that row's ``_r8_neg``)."""
    if kind == K_Q4_0_R8:
        return q40_rows8(w, r, o + Q40_QS, xr, xo, neg[b])
    if kind == K_MXFP4_R8:
        return mx_rows8(w, r, o + MX_QS, xr, xo, neg[b])
    return nl_rows8(w, r, o + N4_QS, xr, xo)


@njit(cache=True, inline="always")
def _r8_neg(kind, xq):
    """Q4_0 / MXFP4: [i, b] = -8 / -12 times the sum of activation row i's block b (the offset form's term,
    ``q40_rows8``, ``_q4_rows8_off``), once per call for all the weight rows; IQ4_NL: one column, unused."""
    n, k = xq.shape
    nb = k // 32 if kind == K_Q4_0_R8 or kind == K_MXFP4_R8 else 1
    neg = np.empty((n, nb), np.int32)
    if kind == K_Q4_0_R8:
        for i in range(n):
            xr = xq[i]
            for b in range(nb):
                neg[i, b] = q40_neg(xr, 32 * b)
    elif kind == K_MXFP4_R8:
        for i in range(n):
            xr = xq[i]
            for b in range(nb):
                neg[i, b] = mx_neg(xr, 32 * b)
    return neg


@njit(cache=True, inline="always")
def _r8_wscales(kind, w, r, o):
    """Lane j: the scale of the block at byte o of weight row r + j."""
    if kind == K_MXFP4_R8:
        return f32x8_set(B.e8m0_half(w[r, o + MX_E]), B.e8m0_half(w[r + 1, o + MX_E]),
                         B.e8m0_half(w[r + 2, o + MX_E]), B.e8m0_half(w[r + 3, o + MX_E]),
                         B.e8m0_half(w[r + 4, o + MX_E]), B.e8m0_half(w[r + 5, o + MX_E]),
                         B.e8m0_half(w[r + 6, o + MX_E]), B.e8m0_half(w[r + 7, o + MX_E]))
    return f16_rows8(w, r, o + (Q40_D if kind == K_Q4_0_R8 else N4_D))


@njit(cache=True, inline="always")
def _r8_acts(kind, wr, o, xq, i, xo, neg, no):
    """Lane a: the block sum of weight row wr (its block at byte o) with the activations at byte xo of row i + a
    (Q4_0: ``neg`` from element no, -8 times the activation rows' block sums, see ``_tiles_r8``)."""
    if kind == K_Q4_0_R8:
        return q40_acts8(wr, o + Q40_QS, xq, i, xo, neg, no)
    if kind == K_MXFP4_R8:
        return mx_acts8(wr, o + MX_QS, xq, i, xo)
    return nl_acts8(wr, o + N4_QS, xq, i, xo)


@njit(cache=True, inline="always")
def _r8_wscale(kind, wr, o):
    if kind == K_MXFP4_R8:
        return B.e8m0_half(wr[o + MX_E])
    return f16_at(wr, o + (Q40_D if kind == K_Q4_0_R8 else N4_D))


@njit(cache=True, inline="always")
def _mv_r8(w, xq, xd, out, kind):
    """out[i, r] = dot(w[r], x[i]), rows % 8 == 0: eight weight rows (lanes) by two activation rows at a time, each
    weight block decoded once for both; the rows PREFETCH_AHEAD (eight: the next group) ahead asked for a piece
    per block step (``prefetch_span``: one bound per step)."""
    rows = w.shape[0]
    n, k = xq.shape
    nb = k // 32
    ng = rows // 8
    n2 = n - n % 2
    neg = _r8_neg(kind, xq)
    for c in prange((ng + 1) // 2):          # sixteen rows (ROW_CHUNK) per task
        for g in range(2 * c, min(ng, 2 * c + 2)):
            r = 8 * g
            pb = prefetch_base(w, r)
            bb = _r8_bytes(kind)
            step = 8 * _r8_bytes(kind)
            for i in range(0, n2, 2):
                x0, x1 = xq[i], xq[i + 1]
                a0 = a1 = f32x8_zero()
                for b in range(nb):
                    prefetch_span(w, pb, b, step)
                    dw = _r8_wscales(kind, w, r, b * bb)
                    a0 = f32x8_fmav(i32x8_to_f32x8(_r8_rows(kind, w, r, b * bb, x0, 32 * b, neg[i], b)),
                                    f32x8_scale(dw, xd[i, b]), a0)
                    a1 = f32x8_fmav(i32x8_to_f32x8(_r8_rows(kind, w, r, b * bb, x1, 32 * b, neg[i + 1], b)),
                                    f32x8_scale(dw, xd[i + 1, b]), a1)
                f32x8_store(out[i], r, a0)
                f32x8_store(out[i + 1], r, a1)
            if n2 < n:
                xr = xq[n2]
                a0 = f32x8_zero()
                for b in range(nb):
                    prefetch_span(w, pb, b, step)
                    a0 = f32x8_fmav(i32x8_to_f32x8(_r8_rows(kind, w, r, b * bb, xr, 32 * b, neg[n2], b)),
                                    f32x8_scale(_r8_wscales(kind, w, r, b * bb), xd[n2, b]), a0)
                f32x8_store(out[n2], r, a0)


@njit(cache=True, inline="always")
def _mv_r8_glu(wg, wu, xq, xd, out, kind, glu, table):
    """MUL_MAT_GLU of a few activation rows (decoding) over repacked rows, rows % 16 == 0: per sixteen weight rows
    the gate's and the up matrix's products, each pair's chain ``_mv_r8``'s (eight rows as lanes, one accumulator
    per activation row), then the gated unit over the sixteen as ggml's vector GLU computes it (dot_q32
    ``_mv_rest_glu``'s: ggml_v_silu(g) * u, or the F16 GELU table times u), in one parallel region; neither product
    goes through memory."""
    rows = wg.shape[0]
    n, k = xq.shape
    nb = k // 32
    bb = _r8_bytes(kind)
    step = 8 * bb
    gb = np.empty(rows, np.float32)      # the products of a chunk's sixteen rows (one allocation, not one per task)
    ub = np.empty(rows, np.float32)
    neg = _r8_neg(kind, xq)
    for c in prange(rows // 16):
        for i in range(n):
            xr = xq[i]
            for r in range(16 * c, 16 * c + 16, 8):
                f32x8_store(gb, r, _r8_chain(wg, r, xr, xd[i], nb, bb, step, kind, neg[i]))
                f32x8_store(ub, r, _r8_chain(wu, r, xr, xd[i], nb, bb, step, kind, neg[i]))
            _glu16(out[i], 16 * c, gb, ub, glu, table)


@njit(cache=True, inline="always")
def _r8_chain(w, r, xr, xdr, nb, bb, step, kind, neg):
    """Rows r .. r + 8 of w (lanes) against one activation row: ``_mv_r8``'s chain, the next group prefetched."""
    pb = prefetch_base(w, r)
    a = f32x8_zero()
    for b in range(nb):
        prefetch_span(w, pb, b, step)
        a = f32x8_fmav(i32x8_to_f32x8(_r8_rows(kind, w, r, b * bb, xr, 32 * b, neg, b)),
                       f32x8_scale(_r8_wscales(kind, w, r, b * bb), xdr[b]), a)
    return a


@njit(cache=True, inline="always")
def _glu16(orow, r0, gb, ub, glu, table):
    if glu == GLU_SWIGLU:
        v16_store(orow, r0, v16_mul(v16_silu(v16_load(gb, r0)), v16_load(ub, r0)))
    else:
        v16_store(orow, r0, v16_geglu(v16_load(gb, r0), v16_load(ub, r0), table))


# The prompt tiles of IQ4_NL, MXFP4 and Q4_0 in a broadcast form (``_tiles_r8``): per weight row and block, four
# values at a time broadcast to every lane against eight activation rows' four values at the same place, the
# activations interleaved once per call so that those 32 bytes are one load (``dot_kquant._bc_interleave``: for eight
# rows and a block, four values of row 0, of row 1, ..., then the next four). The eight lanes' sums are each row's
# block sum with no reduction across lanes (``_q4_acts8``'s transposed reduction cost a fifth of its time), the weight
# row's blocks decoded once per call into values and |values| (``r8_dec_store``). The same integers, the same chain.

def _r8_dec(kv):
    """An intrinsic: the 32 values of the 16 nibble bytes at byte ``o`` of wr (kv at the nibbles, ``_lut_nibbles``)
    stored at byte ``do`` of dst, their absolute values at ``do + 32``."""
    kv = [int(v) for v in kv]

    @intrinsic
    def dec_store(typingctx, wr, o, dst, do):
        def codegen(context, builder, sig, args):
            a = _lut_nibbles(builder, _load(builder, _ptr(context, builder, sig.args[0], args[0], args[1], _V16)), kv)
            for off, v in ((0, a), (32, _abs8(builder, a))):
                at = builder.add(args[3], ir.Constant(args[3].type, off))
                st = builder.store(v, _ptr(context, builder, sig.args[2], args[2], at, _V32))
                st.align = 1
            return context.get_dummy_value()
        return types.none(wr, types.intp, dst, types.intp), codegen
    return dec_store


def _r8_dec_off(kv, bias):
    """An intrinsic: the 32 values of the 16 nibble bytes at byte ``o`` of wr in the offset form (kv + bias at the
    nibbles: unsigned), stored at byte ``do`` of dst, for ``q40_acts16_bc`` (MXFP4: no sign step per activation
    row, -bias times the rows' block sums in ``neg``; 1536 x 576, n = 512, one thread, CPU: 9.7 -> 7.7 ms)."""
    ku = [int(v) + bias for v in kv]
    assert min(ku) >= 0 and 4 * max(ku) * 128 < 1 << 15

    @intrinsic
    def dec_store(typingctx, wr, o, dst, do):
        def codegen(context, builder, sig, args):
            a = _lut_nibbles(builder, _load(builder, _ptr(context, builder, sig.args[0], args[0], args[1], _V16)), ku)
            st = builder.store(a, _ptr(context, builder, sig.args[2], args[2], args[3], _V32))
            st.align = 1
            return context.get_dummy_value()
        return types.none(wr, types.intp, dst, types.intp), codegen
    return dec_store


nl_dec_store, mx_dec_store = _r8_dec(B.KVALUES_IQ4NL), _r8_dec_off(B.KVALUES_FP4, MX_BIAS)


@intrinsic
def q40_dec_store(typingctx, wr, o, dst, do):
    """Q4_0's 32 unsigned nibbles (q, not q - 8: the offset form, ``q40_acts8``) of the 16 bytes at byte ``o`` of wr,
    stored at byte ``do`` of dst."""
    def codegen(context, builder, sig, args):
        a = _nibbles32(builder, _load(builder, _ptr(context, builder, sig.args[0], args[0], args[1], _V16)))
        st = builder.store(a, _ptr(context, builder, sig.args[2], args[2], args[3], _V32))
        st.align = 1
        return context.get_dummy_value()
    return types.none(wr, types.intp, dst, types.intp), codegen


def _bcast4(context, builder, sig, args, ia, off):
    """The four bytes at byte args[ia + 1] + off of array args[ia], in every 32-bit lane of a <32 x i8>."""
    at = builder.add(args[ia + 1], ir.Constant(args[ia + 1].type, off))
    s = _load(builder, _ptr(context, builder, sig.args[ia], args[ia], at, _I32))
    v = builder.insert_element(ir.Constant(_V_I32x8, None), s, ir.Constant(_I32, 0))
    return builder.bitcast(builder.shuffle_vector(v, v, ir.Constant(_V_I32x8, [0] * 8)), _V32)


@intrinsic
def acts16_bc(typingctx, wd, wo, xi, xo0, xo1):
    """Two <8 x i32>: lane a of the first, the exact block sum of the decoded weight block at byte wo of wd (values,
    then |values|: ``r8_dec_store``) with activation row a of the interleaved block at byte xo0 of xi
    (``dot_kquant._bc_interleave``); the second, with the one at xo1. Per four values: the weights' four broadcast,
    ggml's sign trick (|w| times x given w's sign), the pair sums widened and added (``_udot``)."""
    def codegen(context, builder, sig, args):
        acc0 = acc1 = None
        for g in range(8):
            wv = _bcast4(context, builder, sig, args, 0, 4 * g)
            av = _bcast4(context, builder, sig, args, 0, 32 + 4 * g)
            x0 = _load(builder, _ptr(context, builder, sig.args[2], args[2],
                                     builder.add(args[3], ir.Constant(args[3].type, 32 * g)), _V32))
            acc0 = _udot(builder, av, _sign_of(builder, x0, wv), acc0)
            x1 = _load(builder, _ptr(context, builder, sig.args[2], args[2],
                                     builder.add(args[4], ir.Constant(args[4].type, 32 * g)), _V32))
            acc1 = _udot(builder, av, _sign_of(builder, x1, wv), acc1)
        return context.make_tuple(builder, sig.return_type, [acc0, acc1])
    return types.UniTuple(i32x8, 2)(wd, types.intp, xi, types.intp, types.intp), codegen


@intrinsic
def q40_acts16_bc(typingctx, wd, wo, xi, xo0, xo1, neg, no0, no1):
    """``acts16_bc`` in the offset form (Q4_0, MXFP4): the unsigned values at byte wo of wd (``q40_dec_store``: the
    nibbles; ``mx_dec_store``: the table + 12, <= 24), four at a time broadcast, times the interleaved activations
    (``_udot``: no sign step), plus lanes no0 .. no0 + 7 (no1 ..) of ``neg``, -bias times each activation row's
    block sum (``_tiles_r8``)."""
    def codegen(context, builder, sig, args):
        accs = []
        for xo, no in ((args[3], args[6]), (args[4], args[7])):
            n0 = context.cast(builder, no, sig.args[6], types.intp)
            accs.append(_load(builder, _elem_ptr(context, builder, sig.args[5], args[5], n0, _V_I32x8)))
        for g in range(8):
            wv = _bcast4(context, builder, sig, args, 0, 4 * g)
            for j, xo in enumerate((args[3], args[4])):
                xv = _load(builder, _ptr(context, builder, sig.args[2], args[2],
                                         builder.add(xo, ir.Constant(xo.type, 32 * g)), _V32))
                accs[j] = _udot(builder, wv, xv, accs[j])
        return context.make_tuple(builder, sig.return_type, accs)
    return types.UniTuple(i32x8, 2)(wd, types.intp, xi, types.intp, types.intp, neg, types.intp, types.intp), codegen


@njit(cache=True, inline="always")
def _r8_dec_store(kind, wr, o, wd, do):
    if kind == K_MXFP4_R8:
        mx_dec_store(wr, o + MX_QS, wd, do)
    elif kind == K_Q4_0_R8:
        q40_dec_store(wr, o + Q40_QS, wd, do)
    else:
        nl_dec_store(wr, o + N4_QS, wd, do)


@njit(cache=True, inline="always")
def _tiles_r8(w, xq, xd, out, kind):
    """The activation rows 0 .. n - n % 8 of ``_mv_r8``'s product: each weight row against sixteen (then eight)
    activation rows, the pairs' chains the lanes of two (one) accumulators and each pair's scale d_w * d_x one lane
    of a vector product. Rows in chunks of ROW_CHUNK per task, their blocks decoded once into a scratch of the
    task's own (``r8_dec_store``) that stays in cache for all the activation rows; the sixteen-row steps in the
    broadcast form (above; Q4_0 and MXFP4 in the offset form, their unsigned values broadcast with no sign step,
    -8 / -12 times the rows' block sums in ``neg`` added), the last eight rows by ``_r8_acts`` (one transposed
    reduction per block).
    1536 x 576, n = 512, one thread, CPU: IQ4_NL 13.2 -> 9.5 ms, Q4_0 11.0 -> 8.1 (2048 x 8192: 239 -> 171; no
    aliasing of the activation rows at k % 4096 == 0: one block of eight rows is 256 contiguous bytes) against the
    form with that reduction for every step. Same bits."""
    rows = w.shape[0]
    n, k = xq.shape
    nb = k // 32
    n8 = n - n % 8
    n16 = n8 - n8 % 16
    xdT = np.ascontiguousarray(xd.T)
    xi = np.empty(n16 * k, np.int8)
    _bc_interleave(xq, n16, xi)
    off = kind == K_Q4_0_R8 or kind == K_MXFP4_R8      # the offset forms (q40_acts16_bc)
    bias = 8 if kind == K_Q4_0_R8 else MX_BIAS
    neg = np.zeros(nb * n if off else 1, np.int32)   # -bias * sum of block b of row i at b * n + i
    if off:
        for i in prange(n8):
            for b in range(nb):
                t = np.int32(0)
                for e in range(32 * b, 32 * b + 32):
                    t += np.int32(xq[i, e])
                neg[b * n + i] = -bias * t
    bb = _r8_bytes(kind)
    for c in prange((rows + ROW_CHUNK - 1) // ROW_CHUNK):
        r0 = c * ROW_CHUNK
        r1 = min(rows, r0 + ROW_CHUNK)
        wd = np.empty(ROW_CHUNK * nb * 64, np.int8)
        for r in range(r0, r1):
            for b in range(nb):
                _r8_dec_store(kind, w[r], b * bb, wd, ((r - r0) * nb + b) * 64)
        for i in range(0, n16, 16):
            ig = i // 8
            for r in range(r0, r1):
                wr = w[r]
                a0 = a1 = f32x8_zero()
                for b in range(nb):
                    dw = _r8_wscale(kind, wr, b * bb)
                    wo = ((r - r0) * nb + b) * 64
                    if off:
                        s0, s1 = q40_acts16_bc(wd, wo, xi, (ig * nb + b) * 256, ((ig + 1) * nb + b) * 256, neg,
                                               b * n + i, b * n + i + 8)
                    else:
                        s0, s1 = acts16_bc(wd, wo, xi, (ig * nb + b) * 256, ((ig + 1) * nb + b) * 256)
                    a0 = f32x8_fmav(i32x8_to_f32x8(s0), f32x8_scale(f32x8_load(xdT[b], i), dw), a0)
                    a1 = f32x8_fmav(i32x8_to_f32x8(s1), f32x8_scale(f32x8_load(xdT[b], i + 8), dw), a1)
                _store8(out, i, r, a0)
                _store8(out, i + 8, r, a1)
        for i in range(n16, n8, 8):
            for r in range(r0, r1):
                wr = w[r]
                a0 = f32x8_zero()
                for b in range(nb):
                    o = b * bb
                    a0 = f32x8_fmav(i32x8_to_f32x8(_r8_acts(kind, wr, o, xq, i, 32 * b, neg, b * n + i)),
                                    f32x8_scale(f32x8_load(xdT[b], i), _r8_wscale(kind, wr, o)), a0)
                _store8(out, i, r, a0)


@njit(parallel=True, cache=True, nogil=True)
def _iq4_nl_r8(w, x, xq, xd, bsums, out, quant):
    _quant_0(x, xq, xd, bsums, quant)
    _mv_r8(w, xq, xd, out, K_IQ4_NL_R8)


@njit(parallel=True, cache=True, nogil=True)
def _iq4_nl_r8_tiles(w, xq, xd, out):
    _tiles_r8(w, xq, xd, out, K_IQ4_NL_R8)


@njit(parallel=True, cache=True, nogil=True)
def _mxfp4_r8(w, x, xq, xd, bsums, out, quant):
    _quant_0(x, xq, xd, bsums, quant)
    _mv_r8(w, xq, xd, out, K_MXFP4_R8)


@njit(parallel=True, cache=True, nogil=True)
def _mxfp4_r8_tiles(w, xq, xd, out):
    _tiles_r8(w, xq, xd, out, K_MXFP4_R8)


@njit(parallel=True, cache=True, nogil=True)
def _q4_0_r8(w, x, xq, xd, bsums, out, quant):
    _quant_0(x, xq, xd, bsums, quant)
    _mv_r8(w, xq, xd, out, K_Q4_0_R8)


@njit(parallel=True, cache=True, nogil=True)
def _q4_0_r8_tiles(w, xq, xd, out):
    _tiles_r8(w, xq, xd, out, K_Q4_0_R8)


@njit(parallel=True, cache=True, nogil=True)
def _iq4_nl_r8_glu(wg, wu, x, xq, xd, xs, out, quant, glu, table):
    _quant_0(x, xq, xd, xs, quant)
    _mv_r8_glu(wg, wu, xq, xd, out, K_IQ4_NL_R8, glu, table)


@njit(parallel=True, cache=True, nogil=True)
def _mxfp4_r8_glu(wg, wu, x, xq, xd, xs, out, quant, glu, table):
    _quant_0(x, xq, xd, xs, quant)
    _mv_r8_glu(wg, wu, xq, xd, out, K_MXFP4_R8, glu, table)



# ------------------------------------------------------------------------------------------------ F16, BF16, F32
K_F16, K_BF16, K_F32 = 0, 1, 2
F_AHEAD = 8


@njit(cache=True, inline="always")
def _f32_tail(r, wr, xr, np_, k):
    """ggml_vec_dot_f32's leftovers after its vector body: ``sumf += x[i]*y[i]`` in float, the product rounded
    (not contracted: dot_f32_short.py)."""
    for j in range(np_, k):
        r = np.float32(r + np.float32(wr[j] * xr[j]))
    return r


@njit(cache=True, inline="always")
def _fdot16(wr, xr, k, kind):
    """``ggml_vec_dot_f16`` (or ``_f32``: ``kind``) as AVX-512 builds run it: four sixteen-lane accumulators over each
    64 values, reduced (c0 + c2) + (c1 + c3) and then as _mm512_reduce_add_ps; the leftover values (k % 64) in double
    (F32: in float)."""
    c0 = c1 = c2 = c3 = v16_zero()
    np_ = k - k % 64
    for j in range(0, np_, 64):
        c0 = v16_fma(v16_load(wr, j), v16_load(xr, j), c0)
        c1 = v16_fma(v16_load(wr, j + 16), v16_load(xr, j + 16), c1)
        c2 = v16_fma(v16_load(wr, j + 32), v16_load(xr, j + 32), c2)
        c3 = v16_fma(v16_load(wr, j + 48), v16_load(xr, j + 48), c3)
    r = v16_reduce(v16_add(v16_add(c0, c2), v16_add(c1, c3)))
    if np_ == k:
        return r
    if kind == K_F32:      # ggml_vec_dot_f32 (sumf a float)
        return _f32_tail(r, wr, xr, np_, k)
    s = np.float64(r)
    for j in range(np_, k):
        s += np.float64(np.float32(B.f16_from_bits(np.int32(wr[j])) * xr[j]))
    return np.float32(s)


@njit(cache=True, inline="always")
def _fdot(kind, wr, xr, k):
    """One (weight row, activation row) pair of ``ggml_vec_dot_f16`` / ``_bf16`` / ``_f32`` (module doc); F16 and F32
    in the build's register width (``F16_VEC_LANES``: AVX-512 builds sum in sixteen lanes, ``_fdot16``)."""
    if (kind == K_F16 or kind == K_F32) and F16_VEC_LANES == 16:
        return _fdot16(wr, xr, k, kind)
    c0 = c1 = c2 = c3 = f32x8_zero()
    np_ = k - k % 32
    for j in range(0, np_, 32):
        if kind == K_F16 or kind == K_F32:     # F32: wr float32, loaded as it is
            c0 = f32x8_fmav(f32x8_ld(wr, j, False), f32x8_ld(xr, j, False), c0)
            c1 = f32x8_fmav(f32x8_ld(wr, j + 8, False), f32x8_ld(xr, j + 8, False), c1)
            c2 = f32x8_fmav(f32x8_ld(wr, j + 16, False), f32x8_ld(xr, j + 16, False), c2)
            c3 = f32x8_fmav(f32x8_ld(wr, j + 24, False), f32x8_ld(xr, j + 24, False), c3)
        else:
            c0 = f32x8_fmav(f32x8_ld(wr, j, True), f32x8_ld(xr, j, False), c0)
            c1 = f32x8_fmav(f32x8_ld(wr, j + 8, True), f32x8_ld(xr, j + 8, False), c1)
            c2 = f32x8_fmav(f32x8_ld(wr, j + 16, True), f32x8_ld(xr, j + 16, False), c2)
            c3 = f32x8_fmav(f32x8_ld(wr, j + 24, True), f32x8_ld(xr, j + 24, False), c3)
    if kind == K_F16 or kind == K_F32:
        r = f16_reduce(c0, c1, c2, c3)
    else:
        r = f32x8_hsum(f32x8_add(f32x8_add(c0, c2), f32x8_add(c1, c3)))
    if np_ == k:
        return r
    if kind == K_F32:
        return _f32_tail(r, wr, xr, np_, k)
    s = np.float64(r)
    for j in range(np_, k):
        h = np.int32(wr[j])
        v = B.f16_from_bits(h) if kind == K_F16 else B.bf16_from_bits(h)
        s += np.float64(np.float32(v * xr[j]))
    return np.float32(s)


@njit(cache=True, inline="always")
def _mvf(w, xr, out, kind):
    """out[i, r] = dot(w[r], xr[i]) (xr: the activations rounded to the weight type, as float32): 4 weight rows at a
    time against each activation row."""
    rows, k = w.shape
    n = xr.shape[0]
    s0 = w.strides[0]
    for c in prange((rows + ROW_CHUNK - 1) // ROW_CHUNK):
        r1 = min(rows, (c + 1) * ROW_CHUNK)
        for r in range(c * ROW_CHUNK, r1):
            rn = r + F_AHEAD       # the row F_AHEAD ahead asked for while this one is computed (dot_q32's reason)
            if rn < rows:
                for p in range(rn * s0, rn * s0 + (4 if kind == K_F32 else 2) * k, 64):
                    prefetch_byte(w, p)
            wr = w[r]
            for i in range(n):
                out[i, r] = _fdot(kind, wr, xr[i], k)


@njit(parallel=True, cache=True, nogil=True)
def _f16(w, xr, out):
    _mvf(w, xr, out, K_F16)


@njit(parallel=True, cache=True, nogil=True)
def _bf16k(w, xr, out):
    _mvf(w, xr, out, K_BF16)


@njit(parallel=True, cache=True, nogil=True)
def _f32k(w, x, out):
    _mvf(w, x, out, K_F32)


# ------------------------------------------------------------------------------------------------ dispatch

_QK = {T.Q2_K: _q2_k, T.Q3_K: _q3_k, T.IQ4_XS: _iq4_xs, T.TQ2_0: _tq2_0, T.TQ1_0: _tq1_0, T.IQ4_NL: _iq4_nl,
       T.MXFP4: _mxfp4}
# the grid formats, whose decode kernels are dot_grid's (``dot_grid.DECODE``, on ``_mv`` above)
GRID_TYPES = frozenset({T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S})
# The types llama.cpp repacks (rows % 8 == 0, x86 AVX2 / AVX-512 builds): their decode kernel and prompt tiles. Q4_0
# takes them only there (matmul: its other rows are dot_q32's).
R8 = {T.IQ4_NL: (_iq4_nl_r8, _iq4_nl_r8_tiles), T.MXFP4: (_mxfp4_r8, _mxfp4_r8_tiles),
      T.Q4_0: (_q4_0_r8, _q4_0_r8_tiles)}
# MUL_MAT_GLU decoding over repacked rows (``_mv_r8_glu``). Not Q4_0: its two decode calls and the unit ran
# faster than the fused form (1536 x 576, 1 thread: 78 vs 89 us; IQ4_NL 96 vs 93)
R8_GLU = {T.IQ4_NL: _iq4_nl_r8_glu, T.MXFP4: _mxfp4_r8_glu}
TYPES = frozenset({T.F32, T.F16, T.BF16}) | frozenset(_QK) | GRID_TYPES


def _decoder(wtype: GGMLType):
    """The decode kernel of wtype (``_QK``'s or dot_grid's), None for the types without one."""
    return dot_grid.DECODE[wtype] if wtype in GRID_TYPES else _QK.get(wtype)


def repacked_rows(wtype: GGMLType, rows: int, repacked: bool = True) -> bool:
    """Whether llama.cpp runs these weights through its repacked gemv / gemm (``ggml_repack_get_optimal_repack_type``:
    IQ4_NL, MXFP4 and Q4_0 with rows % 8 == 0). ``repacked``: the tensor sits where llama.cpp repacks, a model's
    weight (its CPU extra buffer), not a view of the KV cache."""
    return repacked and rows % 8 == 0 and GGMLType(wtype) in R8


def mul_mat(w: np.ndarray, wtype: GGMLType, x: np.ndarray, out: np.ndarray, scratch=None, quantized=False,
            repacked=True) -> None:
    """out[n, rows] = x[n, k] . w[rows, k]^T for wtype in TYPES, or in R8 where ``repacked_rows`` (w: uint8 blocks
    [rows, row_bytes]; F16 float16 or uint16 bits, BF16 uint16 bits, F32 float32 [rows, k]; rows contiguous); out
    float32 with contiguous rows."""
    wtype = GGMLType(wtype)
    if wtype == T.F32:
        _f32k(w, x, out)
        return
    if wtype == T.F16:
        xr = round_half(x, T.F16)
        _f16(w.view(np.uint16), xr, out)
        return
    if wtype == T.BF16:
        xr = round_half(x, T.BF16)
        _bf16k(w.view(np.uint16), xr, out)
        return
    n, k = x.shape
    vdt = B.BLOCKS[wtype].dot_type
    s = scratch if quantized else act_split(x, vdt, scratch)
    if repacked_rows(wtype, w.shape[0], repacked):
        n8 = n - n % 8
        if n8:
            R8[wtype][1](w, s.xq, s.xd, out)
        if n8 < n:
            R8[wtype][0](w, s.xd, s.xq[n8:], s.xd[n8:], s.xs, out[n8:], False)
    else:
        _decoder(wtype)(w, s.xd, s.xq, s.xd, s.xs, out, False)


def bind_decode(w: np.ndarray, wtype: GGMLType, x: np.ndarray, out: np.ndarray, scratch, quantized: bool = False,
                repacked: bool = True):
    """``mul_mat`` of a batch below its tiles (fewer than eight activation rows: a decoded token) as one call, bound
    once: the decode kernel rounds x into ``scratch``'s buffers itself, or, ``quantized``, reads the rounding an
    earlier product of the same x left there (a ``Direct``, so the plan runs it on the kernel's entry point); F16 /
    BF16 (below round_half's parallel size): x rounded into a buffer of the call's own, then the kernel (a closure
    whose ``direct`` is those two calls). None where ``mul_mat`` takes another path (F32, a batch for the tiles) or
    x's rows are not one C-contiguous block (the kernels' compiled layout)."""
    wtype = GGMLType(wtype)
    n = x.shape[0]
    if wtype in (T.F16, T.BF16) and 0 < n < PAR_ROWS and x.dtype == np.float32 and x.flags.c_contiguous:
        # x rounded to the weight's half type into a buffer of this call's own (round_half's serial kernels)
        xr, w16 = np.empty(x.shape, np.float32), w.view(np.uint16)
        if wtype == T.F16:
            calls = (Direct(_round_f16, x, xr), Direct(_f16, w16, xr, out))
        else:
            calls = (Direct(_round_bf16, x.view(np.uint32), xr.view(np.uint32)), Direct(_bf16k, w16, xr, out))

        def run():
            calls[0]()
            calls[1]()
        run.direct = calls
        return run
    if repacked_rows(wtype, w.shape[0], repacked):
        kern = R8[wtype][0] if n < 8 else None
    else:
        kern = _decoder(wtype) if n < SMALL_N else None
    if kern is None or n == 0 or x.dtype != np.float32 or not x.flags.c_contiguous:
        return None
    return Direct(kern, w, x, scratch.xq, scratch.xd, scratch.xs, out, not quantized)


def act_scratch(n: int, k: int, wtype: GGMLType):
    return scratch_for(n, k, B.BLOCKS[GGMLType(wtype)].dot_type)


# ------------------------------------------------------------------------------------------------ dequantized tiles
# Rows of w as float32, each block through the table's decode rule (blocks.BLOCKS[t].decode): the weight tiles of
# the BLAS path (matmul._weights_tile) for prompts.

@njit(cache=True, inline="always")
def _dq(w, out, decode, bs, bk):
    rows = w.shape[0]
    nb = out.shape[1] // bk
    for r in range(rows):
        wr, orow = w[r], out[r]
        for b in range(nb):
            decode(wr, b * bs, orow, b * bk)


@njit(cache=True, nogil=True)
def _dq_q2_k(w, out):
    _dq(w, out, B.decode_q2_k, Q2_BYTES, 256)


@njit(cache=True, nogil=True)
def _dq_q3_k(w, out):
    _dq(w, out, B.decode_q3_k, Q3_BYTES, 256)


@njit(cache=True, nogil=True)
def _dq_iq4_xs(w, out):
    _dq(w, out, B.decode_iq4_xs, X4_BYTES, 256)


@njit(cache=True, nogil=True)
def _dq_iq4_nl(w, out):
    _dq(w, out, B.decode_iq4_nl, N4_BYTES, 32)


@njit(cache=True, nogil=True)
def _dq_tq2_0(w, out):
    _dq(w, out, B.decode_tq2_0, T2_BYTES, 256)


@njit(cache=True, nogil=True)
def _dq_tq1_0(w, out):
    _dq(w, out, B.decode_tq1_0, T1_BYTES, 256)


@njit(cache=True, nogil=True)
def _dq_mxfp4(w, out):
    _dq(w, out, B.decode_mxfp4, MX_BYTES, 32)


@njit(cache=True, nogil=True)
def _dq_iq2_xxs(w, out):
    _dq(w, out, B.decode_iq2_xxs, IQ2XXS_BYTES, 256)


@njit(cache=True, nogil=True)
def _dq_iq2_xs(w, out):
    _dq(w, out, B.decode_iq2_xs, IQ2XS_BYTES, 256)


@njit(cache=True, nogil=True)
def _dq_iq2_s(w, out):
    _dq(w, out, B.decode_iq2_s, IQ2S_BYTES, 256)


@njit(cache=True, nogil=True)
def _dq_iq3_xxs(w, out):
    _dq(w, out, B.decode_iq3_xxs, IQ3XXS_BYTES, 256)


@njit(cache=True, nogil=True)
def _dq_iq3_s(w, out):
    _dq(w, out, B.decode_iq3_s, IQ3S_BYTES, 256)


@njit(cache=True, nogil=True)
def _dq_iq1_s(w, out):
    _dq(w, out, B.decode_iq1_s, IQ1S_BYTES, 256)


@njit(cache=True, nogil=True)
def _dq_iq1_m(w, out):
    _dq(w, out, B.decode_iq1_m, IQ1M_BYTES, 256)


DEQUANT_TILE = {T.IQ1_S: _dq_iq1_s, T.IQ1_M: _dq_iq1_m, T.IQ2_XXS: _dq_iq2_xxs, T.IQ2_XS: _dq_iq2_xs,
                T.IQ2_S: _dq_iq2_s, T.IQ3_XXS: _dq_iq3_xxs,
                T.IQ3_S: _dq_iq3_s, T.Q2_K: _dq_q2_k, T.Q3_K: _dq_q3_k, T.IQ4_XS: _dq_iq4_xs, T.IQ4_NL: _dq_iq4_nl,
                T.TQ2_0: _dq_tq2_0, T.TQ1_0: _dq_tq1_0, T.MXFP4: _dq_mxfp4}


def use_kernel(wtype: GGMLType, n: int, rows: int, repacked: bool = True) -> bool:
    """Whether a batch of n activation rows takes these kernels (else the BLAS path's dequantized tiles). Below
    SMALL_N rows they run ggml's own order and read each weight once. From there llama.cpp runs other kernels
    (tinyBLAS for F16/BF16, its tiled k-quant kernel for Q2_K/Q3_K/IQ4_XS), except for the rows it repacks
    (``repacked_rows``), whose gemm keeps the gemv's chain: those take ``_tiles_r8`` at every size, exact.
    The ternary formats have no other kernel in llama.cpp (its vec_dot at every batch size): they take these
    kernels at every size too (``EVERY_N``), exact and faster than the BLAS path. The IQ1-IQ3 formats' prompts
    take llama.cpp's tiled path (``dot_kquant_tiled.mm_k_tiles``, from matmul)."""
    return n < SMALL_N or wtype in EVERY_N or repacked_rows(wtype, rows, repacked)


# TQ2_0 576 x 1536 (SmolLM2's ffn_down), n = 512, one thread, CPU time: these kernels 10.2 ms, the BLAS path's
# dequantized tiles 15.7 ms (TQ1_0 9.3 vs 18.3; at n = 16, 0.36 vs 3.4 ms)
EVERY_N = frozenset({T.TQ2_0, T.TQ1_0})


SMALL_N = 8


# the grid formats' decode kernels (``_decoder``); last, as that module builds on this one's row tiling
from . import dot_grid  # noqa: E402
