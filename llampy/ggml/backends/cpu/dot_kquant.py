"""The k-quant dot products (Q4_K, Q5_K, Q6_K against Q8_K activations) in SIMD, tiled over weight rows.

Same arguments and bits as the scalar transliterations in ``dot_kquant_scalar`` (the tests' references), with the integer
work done as ggml's AVX2 k-quant code does it: ``maddubs`` (unsigned weight bytes times int8 activations, pairs
summed to int16; no saturation: |q| <= 63, |x| <= 128) then ``madd`` with the sub-block's scale broadcast to int16
lanes, which widens to eight int32 lanes of four products times the scale — the lane structure of
``ggml_vec_dot_q{4,5,6}_K_q8_K`` (lane l: elements 4l..4l+3 of every 32-value group), exact in any order.

- ``mv_q4_k_x8`` (llama.cpp's repacked ``gemv/gemm_q4_K_8x8_q8_K``, rows % 8 == 0): eight weight rows per tile,
  the rows as the eight lanes of the float accumulators, as the repacked kernels hold them. Per super-block (gemv)
  or pair of sub-blocks (gemm, activation rows below ``n_gemm``), each row's lanes are reduced (``_hsum8x``: eight
  vectors to one vector of eight sums) and one vector fma does the eight rows' ``acc = fma(isum, d_w * d_x,
  acc)``; the mins likewise (gemm: from the scales transposed to rows-as-lanes and the activation block sums
  packed in pairs, ``_bs_pairs``; gemv: ``q4k_gemv8``). ``out = acc - mins`` is one 8-float store.
- ``mv_q6_k``, ``mv_q4_k``, ``mv_q5_k`` (``ggml_vec_dot_*_q8_K`` AVX2 forms): per (row, activation) one f32x8
  accumulator in ggml's lane order; tiles of 4 weight rows x 1 or 2 activation rows so that several independent
  fma chains overlap and each decoded weight block serves both activations.
"""
from __future__ import annotations

import numpy as np
from llvmlite import binding, ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .dot_q32 import (OUT_AHEAD, ROW_CHUNK, _prefetch, _store8, prefetch_base, prefetch_byte, prefetch_row,
                      prefetch_write, rows16_transpose)
from .dot_kquant_scalar import _scale_min
from .simd import (AVX2, VNNI, _V_F32x8, _V_I32x8, _I16, _I32, _I8, _call, _elem_ptr, _load, _ptr, f32x8, f32x8_fma, f32x8_hsum, f32x8_lane,
                   f32x8_load, f32x8_scale, f32x8_sub, f32x8_zero, f16_at, fma32, i32x8, i32x8_add,
                   i32x8_load, i32x8_to_f32x8, nib_split_store, q4k_rows16_pair, v16_load, v16_scale, v16_store,
                   v16_sub, v16_zero)

_V32 = ir.VectorType(_I8, 32)
_W16 = ir.VectorType(_I16, 16)
_W32 = ir.VectorType(_I32, 16)


def _const(ty, v):
    return ir.Constant(ty, [v] * ty.count)


def _shuf(builder, a, b, idx):
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, len(idx)), list(idx)))


def _maddubs(builder, a, b):
    """<32 x i8> unsigned a, signed b -> <16 x i16>: a[2m] * b[2m] + a[2m+1] * b[2m+1] (_mm256_maddubs_epi16;
    exact here: a <= 63, |b| <= 128)."""
    if AVX2:
        return _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _W16, [a, b])
    w = ir.VectorType(_I16, 32)
    p = builder.mul(builder.zext(a, w), builder.sext(b, w))
    return builder.add(_shuf(builder, p, p, range(0, 32, 2)), _shuf(builder, p, p, range(1, 32, 2)))


def _madd(builder, a, b):
    """<16 x i16> a, b -> <8 x i32>: a[2l] * b[2l] + a[2l+1] * b[2l+1] (_mm256_madd_epi16)."""
    if AVX2:
        return _call(builder, "llvm.x86.avx2.pmadd.wd", _V_I32x8, [a, b])
    p = builder.mul(builder.sext(a, _W32), builder.sext(b, _W32))
    return builder.add(_shuf(builder, p, p, range(0, 16, 2)), _shuf(builder, p, p, range(1, 16, 2)))


def _madd_acc(builder, acc, a, b):
    """acc + _madd(a, b): one vpdpwssds where the CPU has VNNI. The saturating form, because LLVM splits the
    plain vpdpwssd back into vpmaddwd + vpaddd (measured 5-10% slower); the same integers here, as no sum comes
    near 2^31 (a super-block's is at most 256 values * |scale| 128 * q 63 * |x| 128 < 2^29)."""
    if acc is None:
        return _madd(builder, a, b)
    if VNNI:
        return _call(builder, "llvm.x86.avx512.vpdpwssds.256", _V_I32x8,
                     [acc, builder.bitcast(a, _V_I32x8), builder.bitcast(b, _V_I32x8)])
    return builder.add(acc, _madd(builder, a, b))


def _bcast16(builder, s16, j):
    """Element j of a <16 x i16> in all sixteen lanes."""
    return _shuf(builder, s16, s16, [j] * 16)


def _load32(context, builder, aryty, ary, off, add=0):
    if add:
        off = builder.add(off, ir.Constant(off.type, add))
    return _load(builder, _ptr(context, builder, aryty, ary, off, _V32))


def _scales16(context, builder, aryty, ary, off):
    """The 12 scale bytes of the Q4_K/Q5_K super-block at byte ``off`` (bytes off+4..off+15) -> <16 x i16>: the eight 6-bit scales, then
    the eight mins (ggml's kmask1..3 unpacking of ``utmp``; the values of ``_scale_min``)."""
    # u = the words u0, u1, u2 (and the next block's first, unused) in one 16-byte load; the four results as lanes
    # [s_lo, s_hi, m_lo, m_hi] = [u0 & k1, (u2 & k2) | ((u0 >> 6) & k3) << 4, u1 & k1, ((u2 >> 4) & k2) | ...]
    v4 = ir.VectorType(_I32, 4)
    return _scales16_at(builder, _ptr(context, builder, aryty, ary, builder.add(off, ir.Constant(off.type, 4)), v4))


def _scales16_at(builder, ptr, as_bytes=False):
    """``_scales16`` of the 12 scale bytes at ``ptr`` (a <4 x i32>*); ``as_bytes``: the same sixteen values as
    <16 x i8>."""
    v4 = ir.VectorType(_I32, 4)
    u = _load(builder, ptr)
    a = builder.and_(_shuf(builder, u, u, [0, 0, 1, 1]), ir.Constant(v4, [0x3F3F3F3F, 0, 0x3F3F3F3F, 0]))
    hi2 = builder.and_(builder.lshr(_shuf(builder, u, u, [2, 2, 2, 2]), ir.Constant(v4, [0, 0, 4, 4])),
                       ir.Constant(v4, [0, 0x0F0F0F0F, 0, 0x0F0F0F0F]))
    top = builder.shl(builder.and_(builder.lshr(_shuf(builder, u, u, [0, 0, 1, 1]), ir.Constant(v4, [6] * 4)),
                                   ir.Constant(v4, [0, 0x03030303, 0, 0x03030303])), ir.Constant(v4, [4] * 4))
    v = builder.bitcast(builder.or_(builder.or_(a, hi2), top), ir.VectorType(_I8, 16))
    return v if as_bytes else builder.zext(v, _W16)


@intrinsic
def k_scales(typingctx, w, o):
    """The scales and mins of the Q4_K/Q5_K super-block at byte o of w, as sixteen int16 (an i32x8 to pass on)."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(_scales16(context, builder, sig.args[0], args[0], args[1]), _V_I32x8)
    return i32x8(w, types.intp), codegen


def _scaled(builder, q, xv, s16, j):
    """madd(scale j broadcast, maddubs(q, x)): eight int32 lanes of four products times scale j."""
    return _madd(builder, _bcast16(builder, s16, j), _maddubs(builder, q, xv))


@intrinsic
def q4k_pdot(typingctx, w, qo, x, xo, s, j):
    """One pair of Q4_K sub-blocks (2j in the low nibbles, 2j+1 in the high nibbles of the 32 bytes at byte qo of
    w) times the 64 activations at byte xo of x, scaled by scales 2j and 2j+1 of ``s`` (from ``k_scales``): eight
    int32 lanes, lane l = sc[2j] * (products 4l..4l+3 of sub-block 2j) + sc[2j+1] * (the same of 2j+1)."""
    if s != i32x8 or not isinstance(j, types.IntegerLiteral):
        return None
    jv = j.literal_value

    def codegen(context, builder, sig, args):
        q = _load32(context, builder, sig.args[0], args[0], args[1])
        lo = builder.and_(q, _const(_V32, 15))
        hi = builder.lshr(q, _const(_V32, 4))
        xa = _load32(context, builder, sig.args[2], args[2], args[3])
        xb = _load32(context, builder, sig.args[2], args[2], args[3], 32)
        s16 = builder.bitcast(args[4], _W16)
        return builder.add(_scaled(builder, lo, xa, s16, 2 * jv), _scaled(builder, hi, xb, s16, 2 * jv + 1))
    return i32x8(w, types.intp, x, types.intp, s, j), codegen


def _k_sb(context, builder, sig, args, five):
    """The eight lanes of a whole Q4_K (Q5_K: ``five``) super-block: lane l = sum over sub-blocks j of
    sc_j * (products 4l..4l+3 of j); the scale products accumulated through ``_madd_acc``."""
    wt, row, o = sig.args[0], args[0], args[1]
    xt, x, xo = sig.args[2], args[2], args[3]
    s16 = builder.bitcast(args[4], _W16)
    qs = 48 if five else 16
    h = _load32(context, builder, wt, row, o, 16) if five else None
    acc = None
    for p in range(4):
        q = _load32(context, builder, wt, row, o, qs + 32 * p)
        lo = builder.and_(q, _const(_V32, 15))
        hi = builder.lshr(q, _const(_V32, 4))
        if five:
            one = _const(_V32, 1)
            lo = builder.or_(lo, builder.shl(builder.and_(builder.lshr(h, _const(_V32, 2 * p)), one), _const(_V32, 4)))
            hi = builder.or_(hi, builder.shl(builder.and_(builder.lshr(h, _const(_V32, 2 * p + 1)), one),
                                             _const(_V32, 4)))
        xa = _load32(context, builder, xt, x, xo, 64 * p)
        xb = _load32(context, builder, xt, x, xo, 64 * p + 32)
        acc = _madd_acc(builder, acc, _bcast16(builder, s16, 2 * p), _maddubs(builder, lo, xa))
        acc = _madd_acc(builder, acc, _bcast16(builder, s16, 2 * p + 1), _maddubs(builder, hi, xb))
    return acc


@intrinsic
def q4k_sb(typingctx, w, o, x, xo, s):
    """The whole Q4_K super-block at byte o of w against the 256 activations at byte xo of x (scales ``s``)."""
    if s != i32x8:
        return None

    def codegen(context, builder, sig, args):
        return _k_sb(context, builder, sig, args, False)
    return i32x8(w, types.intp, x, types.intp, s), codegen


@intrinsic
def q5k_sb(typingctx, w, o, x, xo, s):
    """As ``q4k_sb`` for a Q5_K super-block."""
    if s != i32x8:
        return None

    def codegen(context, builder, sig, args):
        return _k_sb(context, builder, sig, args, True)
    return i32x8(w, types.intp, x, types.intp, s), codegen


@intrinsic
def q5k_pdot(typingctx, w, qo, ho, x, xo, s, j):
    """As ``q4k_pdot`` for Q5_K: bit 2j (low nibbles) and 2j+1 (high nibbles) of the 32 bytes at byte ho of w are
    bit 4 of the values."""
    if s != i32x8 or not isinstance(j, types.IntegerLiteral):
        return None
    jv = j.literal_value

    def codegen(context, builder, sig, args):
        q = _load32(context, builder, sig.args[0], args[0], args[1])
        h = _load32(context, builder, sig.args[0], args[0], args[2])
        one = _const(_V32, 1)
        hl = builder.shl(builder.and_(builder.lshr(h, _const(_V32, 2 * jv)), one), _const(_V32, 4))
        hh = builder.shl(builder.and_(builder.lshr(h, _const(_V32, 2 * jv + 1)), one), _const(_V32, 4))
        lo = builder.or_(builder.and_(q, _const(_V32, 15)), hl)
        hi = builder.or_(builder.lshr(q, _const(_V32, 4)), hh)
        xa = _load32(context, builder, sig.args[3], args[3], args[4])
        xb = _load32(context, builder, sig.args[3], args[3], args[4], 32)
        s16 = builder.bitcast(args[5], _W16)
        return builder.add(_scaled(builder, lo, xa, s16, 2 * jv), _scaled(builder, hi, xb, s16, 2 * jv + 1))
    return i32x8(w, types.intp, types.intp, x, types.intp, s, j), codegen


@intrinsic
def k_min_lanes(typingctx, s, bs, bo):
    """Lane j: min_j * (bsums[bo + 2j] + bsums[bo + 2j + 1]) (``s`` from ``k_scales``; bs int16 block sums)."""
    if s != i32x8:
        return None

    def codegen(context, builder, sig, args):
        s16 = builder.bitcast(args[0], _W16)
        md = _shuf(builder, s16, s16, [8 + l // 2 for l in range(16)])
        b = _load(builder, _elem_ptr(context, builder, sig.args[1], args[1], args[2], _W16))
        return _madd(builder, md, b)
    return i32x8(s, bs, types.intp), codegen


@intrinsic
def k_mins_t(typingctx, s0, s1, s2, s3, s4, s5, s6, s7):
    """The mins of eight rows' ``k_scales`` transposed to rows-as-lanes, in pairs: four i32x8, vector p lane k =
    (min 2p of row k, min 2p+1 of row k) as two int16 (for ``k_mins_dot``)."""
    if any(a != i32x8 for a in (s0, s1, s2, s3, s4, s5, s6, s7)):
        return None

    def codegen(context, builder, sig, args):
        v = [builder.bitcast(a, _W16) for a in args]
        c = [_shuf(builder, v[2 * t], v[2 * t + 1], range(32)) for t in range(4)]
        c = [_shuf(builder, c[2 * t], c[2 * t + 1], range(64)) for t in range(2)]
        c = _shuf(builder, c[0], c[1], range(128))
        res = [builder.bitcast(_shuf(builder, c, c, [16 * k + 8 + 2 * p + t for k in range(8) for t in range(2)]),
                               _V_I32x8) for p in range(4)]
        return context.make_tuple(builder, sig.return_type, res)
    return types.UniTuple(i32x8, 4)(i32x8, i32x8, i32x8, i32x8, i32x8, i32x8, i32x8, i32x8), codegen


@intrinsic
def k_mins_dot(typingctx, m, bp):
    """madd of ``k_mins_t``'s vector with the packed pair of block-sum pairs ``bp`` (``_bs_pairs``): lane k =
    min_2p(row k) * (bs[g] + bs[g+1]) + min_2p+1(row k) * (bs[g+2] + bs[g+3])."""
    if m != i32x8:
        return None

    def codegen(context, builder, sig, args):
        b = context.cast(builder, args[1], sig.args[1], types.int32)
        bv = builder.insert_element(ir.Constant(_V_I32x8, None), b, ir.Constant(_I32, 0))
        bv = _shuf(builder, bv, bv, [0] * 8)
        return _madd(builder, builder.bitcast(args[0], _W16), builder.bitcast(bv, _W16))
    return i32x8(i32x8, bp), codegen


def _hadd(builder, a, b):
    """vphaddd: within each 128-bit half, adjacent pairs of a, then of b."""
    ev = [0, 2, 8, 10, 4, 6, 12, 14]
    return builder.add(_shuf(builder, a, b, ev), _shuf(builder, a, b, [e + 1 for e in ev]))


def hsum8x_ir(builder, vs):
    """Eight <8 x i32> values -> one, lane k the sum of vs[k]'s lanes (exact)."""
    h = [_hadd(builder, vs[2 * t], vs[2 * t + 1]) for t in range(4)]
    lo, hi = _hadd(builder, h[0], h[1]), _hadd(builder, h[2], h[3])
    return builder.add(_shuf(builder, lo, hi, [0, 1, 2, 3, 8, 9, 10, 11]),
                       _shuf(builder, lo, hi, [4, 5, 6, 7, 12, 13, 14, 15]))


@intrinsic
def hsum8x(typingctx, v0, v1, v2, v3, v4, v5, v6, v7):
    """Eight i32x8 -> one i32x8, lane k the sum of v_k's lanes (exact)."""
    if any(a != i32x8 for a in (v0, v1, v2, v3, v4, v5, v6, v7)):
        return None

    def codegen(context, builder, sig, args):
        return hsum8x_ir(builder, args)
    return i32x8(i32x8, i32x8, i32x8, i32x8, i32x8, i32x8, i32x8, i32x8), codegen


@intrinsic
def i32x8_sum(typingctx, v):
    """The sum of the eight lanes (exact)."""
    if v != i32x8:
        return None

    def codegen(context, builder, sig, args):
        return _call(builder, "llvm.vector.reduce.add.v8i32", _I32, [args[0]])
    return types.int32(i32x8), codegen


@intrinsic
def i32x8_lane(typingctx, v, k):
    """Lane k (run-time) of v."""
    if v != i32x8:
        return None

    def codegen(context, builder, sig, args):
        return builder.extract_element(args[0], context.cast(builder, args[1], sig.args[1], types.int32))
    return types.int32(i32x8, k), codegen


@intrinsic
def i32x8_pairs4(typingctx, v):
    """Lanes 0..3: v[2k] + v[2k+1]; lanes 4..7: 0."""
    if v != i32x8:
        return None

    def codegen(context, builder, sig, args):
        z = ir.Constant(_V_I32x8, [0] * 8)
        return builder.add(_shuf(builder, args[0], z, [0, 2, 4, 6, 8, 8, 8, 8]),
                           _shuf(builder, args[0], z, [1, 3, 5, 7, 8, 8, 8, 8]))
    return i32x8(i32x8), codegen


@intrinsic
def f16_rows8x2(typingctx, w, r, o):
    """The F16 pairs at byte o of rows r..r+7 of a 2-d uint8 array (Q4_K's d and dmin): two f32x8 (exact)."""
    def codegen(context, builder, sig, args):
        a = context.make_array(sig.args[0])(context, builder, args[0])
        s0 = cgutils.unpack_tuple(builder, a.strides, 2)[0]
        base = builder.bitcast(a.data, _I8.as_pointer())
        v = ir.Constant(_V_I32x8, None)
        for k in range(8):
            off = builder.add(builder.mul(builder.add(args[1], ir.Constant(args[1].type, k)), s0), args[2])
            p = builder.bitcast(builder.gep(base, [off]), _I32.as_pointer())
            v = builder.insert_element(v, _load(builder, p), ir.Constant(_I32, k))
        h = builder.bitcast(v, ir.VectorType(ir.HalfType(), 16))
        d = builder.fpext(_shuf(builder, h, h, range(0, 16, 2)), _V_F32x8)
        m = builder.fpext(_shuf(builder, h, h, range(1, 16, 2)), _V_F32x8)
        return context.make_tuple(builder, sig.return_type, [d, m])
    return types.UniTuple(f32x8, 2)(w, types.intp, types.intp), codegen


@intrinsic
def f32x8_mul_s(typingctx, v, s):
    """v * s per lane (s a float32 scalar)."""
    if v != f32x8:
        return None

    def codegen(context, builder, sig, args):
        sv = builder.insert_element(ir.Constant(_V_F32x8, None), context.cast(builder, args[1], sig.args[1], types.float32),
                                    ir.Constant(_I32, 0))
        return builder.fmul(args[0], _shuf(builder, sv, sv, [0] * 8))
    return f32x8(f32x8, s), codegen


@intrinsic
def f32x8_fmav(typingctx, a, b, c):
    """a * b + c per lane, rounded once."""
    if a != f32x8 or b != f32x8 or c != f32x8:
        return None

    def codegen(context, builder, sig, args):
        return _call(builder, "llvm.fma.v8f32", _V_F32x8, list(args))
    return f32x8(f32x8, f32x8, f32x8), codegen


@intrinsic
def f32x8_store_diff(typingctx, arr, i, a, b):
    """arr[i:i+8] = a - b (float32 array)."""
    if a != f32x8 or b != f32x8:
        return None

    def codegen(context, builder, sig, args):
        st = builder.store(builder.fsub(args[2], args[3]), _elem_ptr(context, builder, sig.args[0], args[0],
                                                                    args[1], _V_F32x8))
        st.align = 4
        return context.get_dummy_value()
    return types.void(arr, types.intp, f32x8, f32x8), codegen


# ---------------------------------------------------------------------------------------- Q4_K, repacked 8x8
@njit(cache=True, inline="always")
def prefetch_span(w, base, b, step):
    """``dot_q32.prefetch_step`` with one bound per step instead of one per cache line: the lines of bytes base[0] +
    b * step .. + step (step a compile-time constant), the window moved back to end at w's last byte near the end.
    Q4_K's eight-row gemv step: 19 prefetches and one bound where each line took a compare, a move and an address
    (about 60 of its 800 instructions; no change in time measured, the vector units bound it)."""
    n = (step + 63) // 64 + 1
    a = max(0, min(base[0] + b * step, base[1] - 64 * (n - 1)))
    for j in range(n):
        prefetch_byte(w, a + 64 * j)


@njit(cache=True)
def _bs_pairs(bsums, out):
    """out[i, 4b + p] = (bs[g] + bs[g+1]) | (bs[g+2] + bs[g+3]) << 16 with g = 16b + 4p: the two block-sum pairs
    of sub-blocks 2p and 2p+1 as two int16 (each |sum| <= 4096), for ``k_mins_dot``."""
    n, m = bsums.shape
    for i in range(n):
        for t in range(m // 4):
            g = 4 * t
            a = np.int32(bsums[i, g]) + np.int32(bsums[i, g + 1])
            b = np.int32(bsums[i, g + 2]) + np.int32(bsums[i, g + 3])
            out[i, t] = (a & 0xFFFF) | (b << 16)


@njit(cache=True, inline="always")
def _q4k_all(w, o, xr, xo, s):
    """The whole super-block of one row: lane l = sum over sub-blocks j of sc_j * (products 4l..4l+3 of j)."""
    return q4k_sb(w, o, xr, xo, s)


def _row_ptr(context, builder, aryty, ary, r, k, off):
    """Pointer to byte ``off`` of row r + k (k a Python int) of a 2-d uint8 array, as <32 x i8>*."""
    a = context.make_array(aryty)(context, builder, ary)
    s0 = cgutils.unpack_tuple(builder, a.strides, 2)[0]
    base = builder.bitcast(a.data, _I8.as_pointer())
    at = builder.add(builder.mul(builder.add(r, ir.Constant(r.type, k)), s0), off)
    return builder.bitcast(builder.gep(base, [at]), _V32.as_pointer())


def _bcast_b(builder, sb, j):
    """Byte j of each 128-bit half of the <32 x i8> ``sb`` zero-extended into all sixteen int16 lanes (one vpshufb;
    a word broadcast of a scale took a move to lane 0 and a vpbroadcastw)."""
    if AVX2:
        mask = ir.Constant(_V32, [j if e % 2 == 0 else 0x80 for e in range(32)])
        return builder.bitcast(_call(builder, "llvm.x86.avx2.pshuf.b", _V32, [sb, mask]), _W16)
    return builder.zext(_shuf(builder, sb, sb, [j] * 16), _W16)


# Byte of scale j in ``_scale_bytes_dup``'s halves (min j: 4 bytes further): s0..s3, m0..m3, s4..s7, m4..m7.
_SB_AT = (0, 1, 2, 3, 8, 9, 10, 11)
_I64 = ir.IntType(64)


def _scale_bytes_dup(context, builder, aryty, ary, r, k, o):
    """The scales and mins of the Q4_K super-block at byte o of row r + k, as bytes s0..s3, m0..m3, s4..s7, m4..m7
    in both 128-bit halves of a <32 x i8> (``_SB_AT``), unpacked in 64-bit scalar words (ggml's ``utmp`` steps, two
    32-bit words at once) so that the vector units, the decode's bound, do only the moves: with A the 8 bytes u0 u1
    and C the word u2, lo = A & 0x3F.. = (s0..s3, m0..m3), hi = (C & 0x0F..) | ((C >> 4) & 0x0F..) << 32 | ((A >> 6)
    & 0x03..) << 4 = (s4..s7, m4..m7)."""
    pa = builder.bitcast(_row_ptr(context, builder, aryty, ary, r, k, builder.add(o, ir.Constant(o.type, 4))),
                         _I64.as_pointer())
    pc = builder.bitcast(_row_ptr(context, builder, aryty, ary, r, k, builder.add(o, ir.Constant(o.type, 12))),
                         _I32.as_pointer())
    a = _load(builder, pa)
    c = builder.zext(_load(builder, pc), _I64)
    c64 = lambda v: ir.Constant(_I64, v)
    lo = builder.and_(a, c64(0x3F3F3F3F3F3F3F3F))
    hi = builder.or_(builder.and_(c, c64(0x0F0F0F0F)),
                     builder.shl(builder.and_(builder.lshr(c, c64(4)), c64(0x0F0F0F0F)), c64(32)))
    hi = builder.or_(hi, builder.shl(builder.and_(builder.lshr(a, c64(6)), c64(0x0303030303030303)), c64(4)))
    v2 = ir.VectorType(_I64, 2)
    v = builder.insert_element(builder.insert_element(ir.Constant(v2, None), lo, ir.Constant(_I32, 0)), hi,
                               ir.Constant(_I32, 1))
    return builder.bitcast(_shuf(builder, v, v, [0, 1, 0, 1]), _V32)


def _prefetch_here(builder, ptr):
    """A read prefetch of the line at ``ptr`` kept where it stands among the step's instructions: on AVX2 an inline
    ``prefetcht0`` with side effects, which LLVM does not move past the loads around it (its ``llvm.prefetch``
    calls it gathers into one burst at the end of the step); elsewhere ``llvm.prefetch``. Numba's JIT parses
    inline assembly only once the native asm parser is registered (idempotent)."""
    if not AVX2:
        return _prefetch(builder, ptr, False)
    binding.initialize_native_asmparser()
    builder.asm(ir.FunctionType(ir.VoidType(), [ptr.type]), "prefetcht0 ($0)", "r", [ptr], True)


PF_STEP = 8 * 144                       # bytes of one eight-row Q4_K gemv step
PF_LINES = (PF_STEP + 63) // 64 + 1     # ``prefetch_span``'s lines for it


@intrinsic
def q4k_gemv8(typingctx, w, r, o, x, xo, bs, bo, pa):
    """The super-blocks at byte o of rows r..r+7 of w against the 256 activations at byte xo of x: (isum, imin),
    two i32x8 with the rows as lanes: isum lane k = sum over sub-blocks j of sc_j * (q_j . x_j) of row k, imin lane
    k = sum over j of m_j * (bs[bo + 2j] + bs[bo + 2j + 1]) (the int16 block sums ``bs``). The integers of
    ``q4k_sb`` / ``k_min_lanes`` reduced by ``hsum8x``, computed pair by pair of sub-blocks across the eight rows
    (each pair's 64 activations loaded once, eight accumulators live: no spills), each row's scales as bytes in
    both halves so one vpshufb broadcasts a scale. ``pa``: the step's share of the rows ahead (``prefetch_span``'s
    PF_LINES lines, bytes pa + 64 j of w), two or three lines before each pair's loads: LLVM gathered the
    ``prefetch_span`` calls into one burst of 19 at the step's end."""
    def codegen(context, builder, sig, args):
        wt, wa, rr, o = sig.args[0], args[0], args[1], args[2]
        xt, xa, xo = sig.args[3], args[3], args[4]
        pdata = builder.bitcast(context.make_array(wt)(context, builder, wa).data, _I8.as_pointer())
        v4 = ir.VectorType(_I32, 4)
        bsv = _load(builder, _elem_ptr(context, builder, sig.args[5], args[5], args[6], _W16))
        sums, mins = [], []
        for half in range(2):      # four rows at a time: their scales and accumulators fit the sixteen registers
            rows = range(4 * half, 4 * half + 4)
            sbs = {k: _scale_bytes_dup(context, builder, wt, wa, rr, k, o) for k in rows}
            acc = {}
            for p in range(4):
                for j in range(PF_LINES):
                    if j * 8 // PF_LINES == 4 * half + p:
                        pj = builder.add(args[7], ir.Constant(args[7].type, 64 * j))
                        _prefetch_here(builder, builder.gep(pdata, [pj]))
                xl = _load32(context, builder, xt, xa, xo, 64 * p)
                xh = _load32(context, builder, xt, xa, xo, 64 * p + 32)
                qo = builder.add(o, ir.Constant(o.type, 16 + 32 * p))
                for k in rows:
                    q = _load(builder, _row_ptr(context, builder, wt, wa, rr, k, qo))
                    lo = builder.and_(q, _const(_V32, 15))
                    hi = builder.lshr(q, _const(_V32, 4))
                    a = _madd_acc(builder, acc.get(k), _bcast_b(builder, sbs[k], _SB_AT[2 * p]),
                                  _maddubs(builder, lo, xl))
                    acc[k] = _madd_acc(builder, a, _bcast_b(builder, sbs[k], _SB_AT[2 * p + 1]),
                                       _maddubs(builder, hi, xh))
            mn = []
            for k in rows:
                if AVX2:
                    mask = ir.Constant(_V32, [4 + _SB_AT[e // 4] if e % 2 == 0 else 0x80 for e in range(32)])
                    md = builder.bitcast(_call(builder, "llvm.x86.avx2.pshuf.b", _V32, [sbs[k], mask]), _W16)
                else:
                    md = builder.zext(_shuf(builder, sbs[k], sbs[k], [4 + _SB_AT[l // 2] for l in range(16)]),
                                      _W16)
                mn.append(_madd(builder, md, bsv))
            a = [acc[k] for k in rows]
            sums.append(_hadd(builder, _hadd(builder, a[0], a[1]), _hadd(builder, a[2], a[3])))
            mins.append(_hadd(builder, _hadd(builder, mn[0], mn[1]), _hadd(builder, mn[2], mn[3])))

        def fold(lo, hi):      # hsum8x_ir's last step
            return builder.add(_shuf(builder, lo, hi, [0, 1, 2, 3, 8, 9, 10, 11]),
                               _shuf(builder, lo, hi, [4, 5, 6, 7, 12, 13, 14, 15]))
        return context.make_tuple(builder, sig.return_type, [fold(*sums), fold(*mins)])
    return types.UniTuple(i32x8, 2)(w, types.intp, types.intp, x, types.intp, bs, types.intp, types.intp), codegen


@njit(cache=True, inline="always")
def _x8_gemv(w, r, xq, xd, bsums, out, i0, i1, nb):
    """Rows r..r+7 against activation rows i0..i1 in the gemv form (llama.cpp's repacked gemv: per super-block
    acc = fma(isum, d_w * d_x, acc), mins likewise; out = acc - mins) through ``q4k_gemv8``."""
    pb = prefetch_base(w, r)
    for i in range(i0, i1):
        xr = xq[i]
        bs = bsums[i]
        acc = f32x8_zero()
        accm = f32x8_zero()
        for b in range(nb):
            o = b * 144
            pa = max(0, min(pb[0] + b * PF_STEP, pb[1] - 64 * (PF_LINES - 1)))    # prefetch_span's window
            isum, imin = q4k_gemv8(w, r, o, xr, b * 256, bs, b * 16, pa)
            dr, er = f16_rows8x2(w, r, o)
            acc = f32x8_fmav(i32x8_to_f32x8(isum), f32x8_mul_s(dr, xd[i, b]), acc)
            accm = f32x8_fmav(i32x8_to_f32x8(imin), f32x8_mul_s(er, xd[i, b]), accm)
        f32x8_store_diff(out[i], r, acc, accm)


@intrinsic
def q4k_pair8x4(typingctx, w, r, qo, xq, i, xo, s0, s1, s2, s3, s4, s5, s6, s7, p):
    """Pair p (a literal) of the super-blocks at byte qo - 16 - 32p of rows r..r+7 of w against activation rows
    i..i+3 of xq (their 64 values from byte xo): four i32x8, vector a lane k = row k's pair sum for activation
    i + a (the gemm form's isum, exact). Each row's 32 weight bytes are decoded once for the four activations;
    rows are reduced two by two (vphaddd tree) to keep few vectors live."""
    if not isinstance(p, types.IntegerLiteral) or any(t != i32x8 for t in (s0, s1, s2, s3, s4, s5, s6, s7)):
        return None
    pv = p.literal_value

    def codegen(context, builder, sig, args):
        wt, wa, rr, qo = sig.args[0], args[0], args[1], args[2]
        xt, xa, ii, xo = sig.args[3], args[3], args[4], args[5]
        xa_ = context.make_array(xt)(context, builder, xa)
        xs0 = cgutils.unpack_tuple(builder, xa_.strides, 2)[0]
        xbase = builder.bitcast(xa_.data, _I8.as_pointer())
        xl, xh = [], []
        for a in range(4):
            at = builder.add(builder.mul(builder.add(ii, ir.Constant(ii.type, a)), xs0), xo)
            pl = builder.bitcast(builder.gep(xbase, [at]), _V32.as_pointer())
            ph = builder.bitcast(builder.gep(xbase, [builder.add(at, ir.Constant(at.type, 32))]), _V32.as_pointer())
            xl.append(_load(builder, pl))
            xh.append(_load(builder, ph))

        def rowvecs(k):
            q = _load(builder, _row_ptr(context, builder, wt, wa, rr, k, qo))
            lo = builder.and_(q, _const(_V32, 15))
            hi = builder.lshr(q, _const(_V32, 4))
            s16 = builder.bitcast(args[6 + k], _W16)
            sl, sh = _bcast16(builder, s16, 2 * pv), _bcast16(builder, s16, 2 * pv + 1)
            return [_madd_acc(builder, _madd(builder, sl, _maddubs(builder, lo, xl[a])), sh,
                              _maddubs(builder, hi, xh[a])) for a in range(4)]

        quads = []
        for half in range(2):
            pairs = []
            for t in range(2):
                v0, v1 = rowvecs(4 * half + 2 * t), rowvecs(4 * half + 2 * t + 1)
                pairs.append([_hadd(builder, v0[a], v1[a]) for a in range(4)])
            quads.append([_hadd(builder, pairs[0][a], pairs[1][a]) for a in range(4)])
        lo, hi = quads
        res = [builder.add(_shuf(builder, lo[a], hi[a], [0, 1, 2, 3, 8, 9, 10, 11]),
                           _shuf(builder, lo[a], hi[a], [4, 5, 6, 7, 12, 13, 14, 15])) for a in range(4)]
        return context.make_tuple(builder, sig.return_type, res)
    sig = types.UniTuple(i32x8, 4)(w, types.intp, types.intp, xq, types.intp, types.intp,
                                i32x8, i32x8, i32x8, i32x8, i32x8, i32x8, i32x8, i32x8, p)
    return sig, codegen


@njit(cache=True, inline="always")
def _gemm4_step(v0, v1, v2, v3, m, bp, i, t, d0, d1, d2, d3, e0, e1, e2, e3, a0, a1, a2, a3, c0, c1, c2, c3):
    """One pair of sub-blocks for four activation rows: acc = fma(isum, d, acc), mins = fma(imin, dmin, mins)."""
    a0 = f32x8_fmav(i32x8_to_f32x8(v0), d0, a0)
    c0 = f32x8_fmav(i32x8_to_f32x8(k_mins_dot(m, bp[i, t])), e0, c0)
    a1 = f32x8_fmav(i32x8_to_f32x8(v1), d1, a1)
    c1 = f32x8_fmav(i32x8_to_f32x8(k_mins_dot(m, bp[i + 1, t])), e1, c1)
    a2 = f32x8_fmav(i32x8_to_f32x8(v2), d2, a2)
    c2 = f32x8_fmav(i32x8_to_f32x8(k_mins_dot(m, bp[i + 2, t])), e2, c2)
    a3 = f32x8_fmav(i32x8_to_f32x8(v3), d3, a3)
    c3 = f32x8_fmav(i32x8_to_f32x8(k_mins_dot(m, bp[i + 3, t])), e3, c3)
    return a0, a1, a2, a3, c0, c1, c2, c3


@njit(cache=True, inline="always")
def _x8_gemm4(w, r, xq, xd, bp, out, i, nb):
    """Rows r..r+7 against activation rows i..i+3 (gemm form): per super-block the scales, mins and F16 factors
    of the eight rows unpacked once for the four activations."""
    w0, w1, w2, w3, w4, w5, w6, w7 = w[r], w[r + 1], w[r + 2], w[r + 3], w[r + 4], w[r + 5], w[r + 6], w[r + 7]
    a0 = a1 = a2 = a3 = f32x8_zero()
    c0 = c1 = c2 = c3 = f32x8_zero()
    for b in range(nb):
        o = b * 144
        xo = b * 256
        t = 4 * b
        s0, s1, s2, s3 = k_scales(w0, o), k_scales(w1, o), k_scales(w2, o), k_scales(w3, o)
        s4, s5, s6, s7 = k_scales(w4, o), k_scales(w5, o), k_scales(w6, o), k_scales(w7, o)
        m0, m1, m2, m3 = k_mins_t(s0, s1, s2, s3, s4, s5, s6, s7)
        dr, er = f16_rows8x2(w, r, o)
        d0, d1, d2, d3 = f32x8_mul_s(dr, xd[i, b]), f32x8_mul_s(dr, xd[i + 1, b]), f32x8_mul_s(dr, xd[i + 2, b]), \
            f32x8_mul_s(dr, xd[i + 3, b])
        e0, e1, e2, e3 = f32x8_mul_s(er, xd[i, b]), f32x8_mul_s(er, xd[i + 1, b]), f32x8_mul_s(er, xd[i + 2, b]), \
            f32x8_mul_s(er, xd[i + 3, b])
        v0, v1, v2, v3 = q4k_pair8x4(w, r, o + 16, xq, i, xo, s0, s1, s2, s3, s4, s5, s6, s7, 0)
        a0, a1, a2, a3, c0, c1, c2, c3 = _gemm4_step(v0, v1, v2, v3, m0, bp, i, t, d0, d1, d2, d3, e0, e1, e2, e3,
                                                     a0, a1, a2, a3, c0, c1, c2, c3)
        v0, v1, v2, v3 = q4k_pair8x4(w, r, o + 48, xq, i, xo + 64, s0, s1, s2, s3, s4, s5, s6, s7, 1)
        a0, a1, a2, a3, c0, c1, c2, c3 = _gemm4_step(v0, v1, v2, v3, m1, bp, i, t + 1, d0, d1, d2, d3, e0, e1, e2,
                                                     e3, a0, a1, a2, a3, c0, c1, c2, c3)
        v0, v1, v2, v3 = q4k_pair8x4(w, r, o + 80, xq, i, xo + 128, s0, s1, s2, s3, s4, s5, s6, s7, 2)
        a0, a1, a2, a3, c0, c1, c2, c3 = _gemm4_step(v0, v1, v2, v3, m2, bp, i, t + 2, d0, d1, d2, d3, e0, e1, e2,
                                                     e3, a0, a1, a2, a3, c0, c1, c2, c3)
        v0, v1, v2, v3 = q4k_pair8x4(w, r, o + 112, xq, i, xo + 192, s0, s1, s2, s3, s4, s5, s6, s7, 3)
        a0, a1, a2, a3, c0, c1, c2, c3 = _gemm4_step(v0, v1, v2, v3, m3, bp, i, t + 3, d0, d1, d2, d3, e0, e1, e2,
                                                     e3, a0, a1, a2, a3, c0, c1, c2, c3)
    f32x8_store_diff(out[i], r, a0, c0)
    f32x8_store_diff(out[i + 1], r, a1, c1)
    f32x8_store_diff(out[i + 2], r, a2, c2)
    f32x8_store_diff(out[i + 3], r, a3, c3)


# The gemm rows in a broadcast form (``_bc_tiles``, from BC_MIN activation rows): eight activation rows as the
# lanes, interleaved once per call (``_bc_interleave``: for eight rows and a sub-block, values 4g .. 4g + 3 of row 0,
# of row 1, ..., side by side), each weight row decoded once per call into unsigned values, its scales and mins
# unpacked (``_bc_decode``); per four values the weight row's four broadcast to every lane, maddubs against the
# interleaved activations, the 16-bit pair sums of a sub-block added (|sum| <= 8 * 2 * 15 * 127 < 2^15, as ggml's
# own gemm adds them), one madd with the sub-block's scale (``q4k_bc_pair2``). The lanes are the rows' pair sums
# directly: no reduction across lanes (``q4k_pair8x4``'s hadd trees), the same integers and the same two fma chains
# per (weight row, activation row) as the gemm form. One thread, CPU, n = 512, 2048 x 2048: 71 -> 28 ms (30 -> 78
# GMAC/s; a loaded host). Same bits.
BC_MIN = 16
BC_CHUNK = 16      # weight rows decoded per task


@intrinsic
def q4k_bc_pair2(typingctx, wd, wo0, wo1, xi, xo0, xo1, c00, c01, c10, c11):
    """Pair p of sub-blocks of two decoded weight rows (unsigned values at bytes wo0 and wo1 of wd, 64 each: sub-block
    2p then 2p + 1) against two blocks of eight interleaved activation rows (the pair's 512 bytes from xo0 and xo1 of
    xi, ``_bc_interleave``); c00 .. c11: the rows' sub-block scales packed as two int16 (row, sub-block). Four i32x8:
    (row 0, rows at xo0), (row 0, xo1), (row 1, xo0), (row 1, xo1), lane a = the pair's exact isum for that
    activation row."""
    def codegen(context, builder, sig, args):
        wty, wa, xty, xa = sig.args[0], args[0], sig.args[3], args[3]
        wos, xos = (args[1], args[2]), (args[4], args[5])
        tot = [[None, None], [None, None]]
        for h in range(2):
            s16 = [[None, None], [None, None]]
            for g in range(8):
                xv = [_load(builder, _ptr(context, builder, xty, xa,
                                          builder.add(xo, ir.Constant(xo.type, 256 * h + 32 * g)), _V32)) for xo in xos]
                for r in range(2):
                    at = builder.add(wos[r], ir.Constant(wos[r].type, 32 * h + 4 * g))
                    q = _load(builder, _ptr(context, builder, wty, wa, at, _I32))
                    v = builder.insert_element(ir.Constant(_V_I32x8, None), q, ir.Constant(_I32, 0))
                    wv = builder.bitcast(_shuf(builder, v, v, [0] * 8), _V32)
                    for a in range(2):
                        m = _maddubs(builder, wv, xv[a])
                        s16[r][a] = m if s16[r][a] is None else builder.add(s16[r][a], m)
            for r in range(2):
                c = context.cast(builder, args[6 + 2 * r + h], sig.args[6 + 2 * r + h], types.int32)
                cv = builder.insert_element(ir.Constant(_V_I32x8, None), c, ir.Constant(_I32, 0))
                cv = builder.bitcast(_shuf(builder, cv, cv, [0] * 8), _W16)
                for a in range(2):
                    t = _madd(builder, s16[r][a], cv)
                    tot[r][a] = t if tot[r][a] is None else builder.add(tot[r][a], t)
        return context.make_tuple(builder, sig.return_type, [tot[0][0], tot[0][1], tot[1][0], tot[1][1]])
    sig = types.UniTuple(i32x8, 4)(wd, types.intp, types.intp, xi, types.intp, types.intp, c00, c01, c10, c11)
    return sig, codegen


@njit(cache=True, inline="always")
def _bc_interleave(xq, n16, xi):
    """xi[((i // 8) * k / 32 + s) * 256 + 32 g + 4 a + e] = xq[8 (i // 8) + a, 32 s + 4 g + e] for the rows below
    n16."""
    k = xq.shape[1]
    ns = k // 32
    for ig in prange(n16 // 8):
        for sb in range(ns):
            base = (ig * ns + sb) * 256
            for g in range(8):
                for a in range(8):
                    for e in range(4):
                        xi[base + 32 * g + 4 * a + e] = xq[8 * ig + a, 32 * sb + 4 * g + e]


@njit(cache=True, inline="always")
def _bc_decode(w, r0, r1, nb, wd, wsc, wmn, wdd):
    """Rows r0 .. r1 - 1 for ``q4k_bc_pair2``: row rr = r - r0's values of super-block b (unsigned nibbles, in order)
    at byte (rr nb + b) 256 of wd; wsc[rr, 8b + j] = sc_j | sc_j << 16; wmn[rr, 4b + p] = m_2p | m_2p+1 << 16 (for
    ``k_mins_dot``); wdd[rr, 2b], wdd[rr, 2b + 1] = d, dmin."""
    for r in range(r0, r1):
        wr = w[r]
        rr = r - r0
        for b in range(nb):
            o = b * 144
            for p in range(4):
                nib_split_store(wr, o + 16 + 32 * p, wd, (rr * nb + b) * 256 + 64 * p)
                sa, ma = _scale_min(wr, o + 4, 2 * p)
                sc, mb = _scale_min(wr, o + 4, 2 * p + 1)
                wsc[rr, 8 * b + 2 * p] = np.int32(sa) | (np.int32(sa) << 16)
                wsc[rr, 8 * b + 2 * p + 1] = np.int32(sc) | (np.int32(sc) << 16)
                wmn[rr, 4 * b + p] = np.int32(ma) | (np.int32(mb) << 16)
            wdd[rr, 2 * b] = f16_at(wr, o)
            wdd[rr, 2 * b + 1] = f16_at(wr, o + 2)


@njit(cache=True, inline="always")
def _bc_mins(wmn, wdd, rr, bpT, xdT, i, nb):
    """The mins chain of weight row rr against activation rows i .. i + 15 (two f32x8): per pair of sub-blocks
    mins = fma(imin, dmin_w * d_x, mins), as ``_gemm4_step``."""
    m0 = m1 = f32x8_zero()
    for b in range(nb):
        dm = wdd[rr, 2 * b + 1]
        e0, e1 = f32x8_scale(f32x8_load(xdT[b], i), dm), f32x8_scale(f32x8_load(xdT[b], i + 8), dm)
        for p in range(4):
            mp = wmn[rr, 4 * b + p]
            m0 = f32x8_fmav(i32x8_to_f32x8(k_mins_dot(i32x8_load(bpT[4 * b + p], i), mp)), e0, m0)
            m1 = f32x8_fmav(i32x8_to_f32x8(k_mins_dot(i32x8_load(bpT[4 * b + p], i + 8), mp)), e1, m1)
    return m0, m1


@njit(cache=True, inline="always")
def _bc_tiles(w, r8, xq, xd, bp, out, n16, nb):
    """Weight rows 0 .. r8 - 1 (r8 % 8 == 0) against activation rows 0 .. n16 - 1 (n16 % 16 == 0) in the broadcast
    form: tiles of two weight rows by sixteen activation rows, acc = fma(isum, d_w * d_x, acc) per pair of
    sub-blocks, then the mins chain (``_bc_mins``), out = acc - mins."""
    k = xq.shape[1]
    xdT = np.ascontiguousarray(xd[:n16].T)
    bpT = np.ascontiguousarray(bp[:n16].T)
    xi = np.empty(n16 * k, np.int8)
    _bc_interleave(xq, n16, xi)
    ns = k // 32
    for c in prange((r8 + BC_CHUNK - 1) // BC_CHUNK):
        r0 = c * BC_CHUNK
        r1 = min(r8, r0 + BC_CHUNK)
        wd = np.empty(BC_CHUNK * nb * 256, np.uint8)
        wsc = np.empty((BC_CHUNK, nb * 8), np.int32)
        wmn = np.empty((BC_CHUNK, nb * 4), np.int32)
        wdd = np.empty((BC_CHUNK, nb * 2), np.float32)
        _bc_decode(w, r0, r1, nb, wd, wsc, wmn, wdd)
        for i in range(0, n16, 16):
            x0 = (i // 8) * ns * 256
            x1 = x0 + ns * 256
            for r in range(r0, r1, 2):
                rr = r - r0
                a00 = a01 = a10 = a11 = f32x8_zero()
                for b in range(nb):
                    d0, d1 = wdd[rr, 2 * b], wdd[rr + 1, 2 * b]
                    xv0, xv1 = f32x8_load(xdT[b], i), f32x8_load(xdT[b], i + 8)
                    d00, d01 = f32x8_scale(xv0, d0), f32x8_scale(xv1, d0)
                    d10, d11 = f32x8_scale(xv0, d1), f32x8_scale(xv1, d1)
                    for p in range(4):
                        wo = (rr * nb + b) * 256 + 64 * p
                        xo = (8 * b + 2 * p) * 256
                        j = 8 * b + 2 * p
                        v00, v01, v10, v11 = q4k_bc_pair2(wd, wo, wo + nb * 256, xi, x0 + xo, x1 + xo, wsc[rr, j],
                                                          wsc[rr, j + 1], wsc[rr + 1, j], wsc[rr + 1, j + 1])
                        a00 = f32x8_fmav(i32x8_to_f32x8(v00), d00, a00)
                        a01 = f32x8_fmav(i32x8_to_f32x8(v01), d01, a01)
                        a10 = f32x8_fmav(i32x8_to_f32x8(v10), d10, a10)
                        a11 = f32x8_fmav(i32x8_to_f32x8(v11), d11, a11)
                m0, m1 = _bc_mins(wmn, wdd, rr, bpT, xdT, i, nb)
                _store8(out, i, r, f32x8_sub(a00, m0))
                _store8(out, i + 8, r, f32x8_sub(a01, m1))
                m0, m1 = _bc_mins(wmn, wdd, rr + 1, bpT, xdT, i, nb)
                _store8(out, i, r + 1, f32x8_sub(a10, m0))
                _store8(out, i + 8, r + 1, f32x8_sub(a11, m1))


@njit(parallel=True, cache=True, nogil=True)
def mv_q4_k_x8(w, xq, xd, bsums, out, tab, n_gemm):
    """Same arguments and results as dot_kquant_scalar.mv_q4_k_x8 (``tab`` unused: the F16 scales convert in hardware);
    ``n_gemm`` a multiple of 4 (llama.cpp's gemm takes the activation rows in fours), at most n."""
    rows = w.shape[0]
    n = xq.shape[0]
    nb = xq.shape[1] // 256
    if n_gemm % 4 != 0 or n_gemm > n:
        raise ValueError("n_gemm must be a multiple of 4, at most the number of activation rows")
    bp = np.empty((n, nb * 4), np.int32)
    _bs_pairs(bsums, bp)
    r8 = rows - rows % 8
    n16 = n_gemm - n_gemm % 16 if n_gemm >= BC_MIN else 0
    if n16:
        _bc_tiles(w, r8, xq, xd, bp, out, n16, nb)
    for c in prange((r8 // 8 + 1) // 2):
        for r in range(16 * c, min(r8, 16 * c + 16), 8):
            if n_gemm:         # the gemv rows prefetch as they go (``_x8_gemv``)
                for p in range(8):
                    prefetch_row(w, r + p)
            for i in range(n16, n_gemm, 4):
                _x8_gemm4(w, r, xq, xd, bp, out, i, nb)
            _x8_gemv(w, r, xq, xd, bsums, out, n_gemm, n, nb)
    for r in range(r8, rows):          # rows beyond the eights (not a repacked shape; kept for completeness)
        row = w[r]
        for i in range(n):
            acc = np.float32(0.0)
            accm = np.float32(0.0)
            for b in range(nb):
                o = b * 144
                s = k_scales(row, o)
                ml = k_min_lanes(s, bsums[i], b * 16)
                dd = np.float32(f16_at(row, o) * xd[i, b])
                de = np.float32(f16_at(row, o + 2) * xd[i, b])
                if i < n_gemm:
                    for p in range(4):
                        if p == 0:
                            v = q4k_pdot(row, o + 16, xq[i], b * 256, s, 0)
                        elif p == 1:
                            v = q4k_pdot(row, o + 48, xq[i], b * 256 + 64, s, 1)
                        elif p == 2:
                            v = q4k_pdot(row, o + 80, xq[i], b * 256 + 128, s, 2)
                        else:
                            v = q4k_pdot(row, o + 112, xq[i], b * 256 + 192, s, 3)
                        acc = fma32(np.float32(i32x8_sum(v)), dd, acc)
                        accm = fma32(np.float32(i32x8_lane(i32x8_pairs4(ml), p)), de, accm)
                else:
                    acc = fma32(np.float32(i32x8_sum(_q4k_all(row, o, xq[i], b * 256, s))), dd, acc)
                    accm = fma32(np.float32(i32x8_sum(ml)), de, accm)
            out[i, r] = np.float32(acc - accm)


# --------------------------------------------------------- Q4_K gemm form, sixteen weight rows as lanes (AVX-512)

@njit(cache=True, inline="always")
def _q4k_rows16_prep(w, r0, nr, nb, tmp, ws, scs, dws, mws):
    """Weight rows r0 .. r0 + nr - 1 (nr <= 16; the arrays come zeroed, so the missing rows of a last group stay
    zeros) for ``q4k_rows16_pair``: ws[4096 b + 512 j + 64 l + 4 r + t] = value 32 j + 4 l + t of row r's
    super-block b (unsigned nibbles); per super-block b and pair p, scs[b, p] = the rows' sc_2p, sc_2p+1 and mins
    (m_2p | m_2p+1 << 16); dws / mws: d and dmin."""
    for b in range(nb):
        o = b * 144
        for r in range(nr):
            wr = w[r0 + r]
            for p in range(4):
                nib_split_store(wr, o + 16 + 32 * p, tmp, 256 * r + 64 * p)
                s_lo, m_lo = _scale_min(wr, o + 4, 2 * p)
                s_hi, m_hi = _scale_min(wr, o + 4, 2 * p + 1)
                scs[b, p, 0, r] = s_lo
                scs[b, p, 1, r] = s_hi
                scs[b, p, 2, r] = m_lo | (m_hi << 16)
            dws[b, r] = f16_at(wr, o)
            mws[b, r] = f16_at(wr, o + 2)
        rows16_transpose(tmp, ws, 1024 * b, 64)


@njit(parallel=True, cache=True, nogil=True)
def mm_q4_k_rows16(w, xq, xd, bsums, out, n_gemm):
    """Activation rows 0 .. n_gemm (even) of ``mv_q4_k_x8``'s gemm form, where the CPU has AVX-512 VNNI: sixteen
    weight rows as the lanes of 512-bit registers (decoded and transposed once per call, ``_q4k_rows16_prep``)
    by two activation rows; per pair of sub-blocks the same exact isum and imin and the same two fmas as
    ``_x8_gemm4``, so the same bits. Rows in a last group of fewer than sixteen are computed as zeros and not
    stored."""
    rows = w.shape[0]
    n = xq.shape[0]
    nb = xq.shape[1] // 256
    bp = np.empty((n, nb * 4), np.int32)
    _bs_pairs(bsums, bp)
    for g in prange((rows + 15) // 16):
        r0 = 16 * g
        nr = min(16, rows - r0)
        tmp = np.zeros(16 * 256, np.uint8)
        ws = np.empty(nb * 4096, np.uint8)
        scs = np.zeros((nb, 4, 3, 16), np.int32)
        dws = np.zeros((nb, 16), np.float32)
        mws = np.zeros((nb, 16), np.float32)
        part = np.empty(16, np.float32)
        _q4k_rows16_prep(w, r0, nr, nb, tmp, ws, scs, dws, mws)
        sflat = scs.reshape(-1)
        for i in range(0, n_gemm, 2):
            if i + OUT_AHEAD + 1 < n_gemm and nr == 16:
                prefetch_write(out, i + OUT_AHEAD, r0)
                prefetch_write(out, i + OUT_AHEAD + 1, r0)
            z = v16_zero()
            acc = (z, z, z, z)
            for b in range(nb):
                dw = v16_load(dws[b], 0)
                mw = v16_load(mws[b], 0)
                dv0, dv1 = v16_scale(dw, xd[i, b]), v16_scale(dw, xd[i + 1, b])
                ev0, ev1 = v16_scale(mw, xd[i, b]), v16_scale(mw, xd[i + 1, b])
                for p in range(4):
                    acc = q4k_rows16_pair(ws, 4096 * b + 1024 * p, xq, i, 256 * b + 64 * p, sflat, 48 * (4 * b + p),
                                          bp, 4 * b + p, dv0, dv1, ev0, ev1, acc)
            for c in range(2):
                v = v16_sub(acc[0], acc[2]) if c == 0 else v16_sub(acc[1], acc[3])
                if nr == 16:
                    v16_store(out[i + c], r0, v)
                else:
                    v16_store(part, 0, v)
                    for r in range(nr):
                        out[i + c, r0 + r] = part[r]


# ------------------------------------------------------------------------ Q6_K, Q4_K, Q5_K: the vec_dot forms
@intrinsic
def q6k_lanes(typingctx, w, o, x, xo, bs, bo):
    """One Q6_K super-block (byte o of w) against 256 activations (byte xo of x; their block sums from element bo
    of the int16 ``bs``): ggml_vec_dot_q6_K_q8_K's eight int32 lanes before the conversion: per 32-value group,
    maddubs of the unsigned 6-bit values with the activations, madd with the group's two scales (lanes 0..3, 4..7),
    summed; minus q8sclsub = 32 * madd(scales, bsums)."""
    def codegen(context, builder, sig, args):
        wt, row, o = sig.args[0], args[0], args[1]
        sc8 = _load(builder, _ptr(context, builder, wt, row, builder.add(o, ir.Constant(o.type, 192)),
                                  ir.VectorType(_I8, 16)))
        sc = builder.sext(sc8, _W16)
        acc = None
        for h in range(2):
            qa = _load32(context, builder, wt, row, o, 64 * h)
            qb = _load32(context, builder, wt, row, o, 64 * h + 32)
            qh = _load32(context, builder, wt, row, o, 128 + 32 * h)
            for g in range(4):
                src = qa if g % 2 == 0 else qb
                lo = builder.and_(src, _const(_V32, 15)) if g < 2 else builder.lshr(src, _const(_V32, 4))
                hb = builder.and_(builder.lshr(qh, _const(_V32, 2 * g)), _const(_V32, 3))
                q = builder.or_(lo, builder.shl(hb, _const(_V32, 4)))
                xv = _load32(context, builder, sig.args[2], args[2], args[3], 128 * h + 32 * g)
                j = 8 * h + 2 * g
                acc = _madd_acc(builder, acc, _shuf(builder, sc, sc, [j] * 8 + [j + 1] * 8), _maddubs(builder, q, xv))
        b = _load(builder, _elem_ptr(context, builder, sig.args[4], args[4], args[5], _W16))
        sub = builder.shl(_madd(builder, sc, b), _const(_V_I32x8, 5))
        return builder.sub(acc, sub)
    return i32x8(w, types.intp, x, types.intp, bs, types.intp), codegen


def _q6_scale_dups(builder, sc8):
    """The sixteen int8 scales of a Q6_K super-block (<16 x i8>) sign-extended to int16, as two vectors with the
    same eight scales in both 128-bit halves: (s0..s7, s0..s7) and (s8..s15, s8..s15), for ``_q6_scale_pair``."""
    sc = builder.sext(sc8, _W16)
    return [_shuf(builder, sc, sc, list(range(8 * h, 8 * h + 8)) * 2) for h in range(2)]


def _q6_scale_pair(builder, dup, g):
    """Lanes 0..7 scale 2g, lanes 8..15 scale 2g + 1 of a ``_q6_scale_dups`` vector: one vpshufb (the word form
    of the shuffle took a byte shuffle and a sign extension per group)."""
    if AVX2:
        mask = [4 * g + e % 2 if e < 16 else 4 * g + 2 + e % 2 for e in range(32)]
        b = _call(builder, "llvm.x86.avx2.pshuf.b", _V32, [builder.bitcast(dup, _V32), ir.Constant(_V32, mask)])
        return builder.bitcast(b, _W16)
    return _shuf(builder, dup, dup, [2 * g] * 8 + [2 * g + 1] * 8)


def _q6k_rows_codegen(nr):
    def codegen(context, builder, sig, args):
        wt, wa, rr, o = sig.args[0], args[0], args[1], args[2]
        xt, xa, xo = sig.args[3], args[3], args[4]

        def ld(k, off, ty=_V32):
            p = _row_ptr(context, builder, wt, wa, rr, k, builder.add(o, ir.Constant(o.type, off)))
            return _load(builder, builder.bitcast(p, ty.as_pointer()))
        acc = [None] * nr
        for h in range(2):
            dup = [_q6_scale_dups(builder, ld(k, 192, ir.VectorType(_I8, 16)))[h] for k in range(nr)]
            for g in range(4):
                xv = _load32(context, builder, xt, xa, xo, 128 * h + 32 * g)
                for k in range(nr):
                    src = ld(k, 64 * h + 32 * (g % 2))
                    qh = ld(k, 128 + 32 * h)
                    lo = builder.and_(src, _const(_V32, 15)) if g < 2 else builder.lshr(src, _const(_V32, 4))
                    hb = builder.and_(builder.lshr(qh, _const(_V32, 2 * g)), _const(_V32, 3))
                    q = builder.or_(lo, builder.shl(hb, _const(_V32, 4)))
                    acc[k] = _madd_acc(builder, acc[k], _q6_scale_pair(builder, dup[k], g), _maddubs(builder, q, xv))
        b = _load(builder, _elem_ptr(context, builder, sig.args[5], args[5], args[6], _W16))
        sc = [builder.sext(ld(k, 192, ir.VectorType(_I8, 16)), _W16) for k in range(nr)]
        res = [builder.sub(acc[k], builder.shl(_madd(builder, sc[k], b), _const(_V_I32x8, 5))) for k in range(nr)]
        return context.make_tuple(builder, sig.return_type, res)
    return codegen


@intrinsic
def q6k_lanes2(typingctx, w, r, o, x, xo, bs, bo):
    """``q6k_lanes`` of rows r and r + 1 of w (the super-blocks at byte o) against the same activations: two i32x8,
    the same lanes. Each 32-value group's activations are loaded once for both rows and used at once, and each
    scale pair is one vpshufb (``_q6_scale_pair``; the word shuffle took a byte shuffle and a sign extension)."""
    return types.UniTuple(i32x8, 2)(w, types.intp, types.intp, x, types.intp, bs, types.intp), _q6k_rows_codegen(2)


@njit(cache=True, inline="always")
def _q5k_all(w, o, xr, xo, s):
    return q5k_sb(w, o, xr, xo, s)


K_Q4_K, K_Q5_K, K_Q6_K = 4, 5, 6


@njit(cache=True, inline="always")
def _kbytes(kind):
    """Bytes of one super-block."""
    return 210 if kind == K_Q6_K else (144 if kind == K_Q4_K else 176)


@njit(cache=True, inline="always")
def _kblock(kind, wr, b, xr, xdb, bsr, acc, accm, summs):
    """Super-block b of one (weight row, activation row) pair in ggml_vec_dot_<kind>_q8_K's float order:
    acc = fma(d_x * d_w, lanes, acc); Q4_K's mins in four lanes, accm = fma(-d_x * dmin_w, pair sums, accm);
    Q5_K's summs = fma(-d_x * dmin_w, sum of mins * bsums, summs)."""
    xo = b * 256
    if kind == K_Q6_K:
        o = b * 210
        d = np.float32(xdb * f16_at(wr, o + 208))
        acc = f32x8_fma(d, i32x8_to_f32x8(q6k_lanes(wr, o, xr, xo, bsr, b * 16)), acc)
    elif kind == K_Q4_K:
        o = b * 144
        s = k_scales(wr, o)
        d = np.float32(xdb * f16_at(wr, o))
        dmin = np.float32(-xdb * f16_at(wr, o + 2))
        accm = f32x8_fma(dmin, i32x8_to_f32x8(i32x8_pairs4(k_min_lanes(s, bsr, b * 16))), accm)
        acc = f32x8_fma(d, i32x8_to_f32x8(_q4k_all(wr, o, xr, xo, s)), acc)
    else:
        o = b * 176
        s = k_scales(wr, o)
        d = np.float32(xdb * f16_at(wr, o))
        dmin = np.float32(-xdb * f16_at(wr, o + 2))
        summs = fma32(dmin, np.float32(i32x8_sum(k_min_lanes(s, bsr, b * 16))), summs)
        acc = f32x8_fma(d, i32x8_to_f32x8(_q5k_all(wr, o, xr, xo, s)), acc)
    return acc, accm, summs


@njit(cache=True, inline="always")
def _kfinal(kind, acc, accm, summs):
    if kind == K_Q6_K:
        return f32x8_hsum(acc)
    if kind == K_Q4_K:
        m0 = np.float32(f32x8_lane(accm, 0) + f32x8_lane(accm, 2))
        m1 = np.float32(f32x8_lane(accm, 1) + f32x8_lane(accm, 3))
        return f32x8_hsum(acc) + np.float32(m0 + m1)
    return f32x8_hsum(acc) + summs


@njit(cache=True, inline="always")
def _tile2x4(kind, u0, u1, r, xq, xd, bsums, out, i, nb):
    """Weight rows r, r + 1 against activation rows i..i+3: eight chains, each weight block decoded once for four
    activation rows."""
    x0, x1, x2, x3 = xq[i], xq[i + 1], xq[i + 2], xq[i + 3]
    b0, b1, b2, b3 = bsums[i], bsums[i + 1], bsums[i + 2], bsums[i + 3]
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = f32x8_zero()
    m00 = m01 = m02 = m03 = m10 = m11 = m12 = m13 = f32x8_zero()
    s00 = s01 = s02 = s03 = s10 = s11 = s12 = s13 = np.float32(0.0)
    for b in range(nb):
        d0, d1, d2, d3 = xd[i, b], xd[i + 1, b], xd[i + 2, b], xd[i + 3, b]
        a00, m00, s00 = _kblock(kind, u0, b, x0, d0, b0, a00, m00, s00)
        a01, m01, s01 = _kblock(kind, u0, b, x1, d1, b1, a01, m01, s01)
        a02, m02, s02 = _kblock(kind, u0, b, x2, d2, b2, a02, m02, s02)
        a03, m03, s03 = _kblock(kind, u0, b, x3, d3, b3, a03, m03, s03)
        a10, m10, s10 = _kblock(kind, u1, b, x0, d0, b0, a10, m10, s10)
        a11, m11, s11 = _kblock(kind, u1, b, x1, d1, b1, a11, m11, s11)
        a12, m12, s12 = _kblock(kind, u1, b, x2, d2, b2, a12, m12, s12)
        a13, m13, s13 = _kblock(kind, u1, b, x3, d3, b3, a13, m13, s13)
    out[i, r] = _kfinal(kind, a00, m00, s00)
    out[i + 1, r] = _kfinal(kind, a01, m01, s01)
    out[i + 2, r] = _kfinal(kind, a02, m02, s02)
    out[i + 3, r] = _kfinal(kind, a03, m03, s03)
    out[i, r + 1] = _kfinal(kind, a10, m10, s10)
    out[i + 1, r + 1] = _kfinal(kind, a11, m11, s11)
    out[i + 2, r + 1] = _kfinal(kind, a12, m12, s12)
    out[i + 3, r + 1] = _kfinal(kind, a13, m13, s13)


@njit(cache=True, inline="always")
def _mv_k4(w, xq, xd, bsums, out, kind):
    """``_mv_k`` for activation rows in fours (n % 4 == 0): tiles of 2 weight rows x 4 activation rows."""
    rows = w.shape[0]
    n = xq.shape[0]
    nb = xq.shape[1] // 256
    for c in prange((rows + ROW_CHUNK - 1) // ROW_CHUNK):
        r1 = min(rows, (c + 1) * ROW_CHUNK)
        r = c * ROW_CHUNK
        while r + 2 <= r1:
            prefetch_row(w, r)
            prefetch_row(w, r + 1)
            u0, u1 = w[r], w[r + 1]
            for i in range(0, n, 4):
                _tile2x4(kind, u0, u1, r, xq, xd, bsums, out, i, nb)
            r += 2
        if r < r1:
            wr = w[r]
            for i in range(n):
                a0 = m0 = f32x8_zero()
                s0 = np.float32(0.0)
                for b in range(nb):
                    a0, m0, s0 = _kblock(kind, wr, b, xq[i], xd[i, b], bsums[i], a0, m0, s0)
                out[i, r] = _kfinal(kind, a0, m0, s0)


@njit(cache=True, inline="always")
def _mv_k(w, xq, xd, bsums, out, kind):
    """out[i, r] = dot(w[r], x[i]): tiles of 4 weight rows x 2 activation rows (eight independent fma chains, each
    weight block decoded once for both), then 4 x 1, then single rows; each pair in its own accumulators."""
    rows = w.shape[0]
    n = xq.shape[0]
    nb = xq.shape[1] // 256
    n2 = n - n % 2
    for c in prange((rows + ROW_CHUNK - 1) // ROW_CHUNK):
        r1 = min(rows, (c + 1) * ROW_CHUNK)
        r = c * ROW_CHUNK
        while r + 4 <= r1:
            w0, w1, w2, w3 = w[r], w[r + 1], w[r + 2], w[r + 3]
            pb = prefetch_base(w, r)
            step = 4 * _kbytes(kind)        # inside the parallel loop: a constant there (prefetch_step unrolls)
            for i in range(0, n2, 2):
                x0, x1, b0, b1 = xq[i], xq[i + 1], bsums[i], bsums[i + 1]
                a00 = a01 = a10 = a11 = a20 = a21 = a30 = a31 = f32x8_zero()
                m00 = m01 = m10 = m11 = m20 = m21 = m30 = m31 = f32x8_zero()
                s00 = s01 = s10 = s11 = s20 = s21 = s30 = s31 = np.float32(0.0)
                for b in range(nb):
                    prefetch_span(w, pb, b, step)
                    d0, d1 = xd[i, b], xd[i + 1, b]
                    a00, m00, s00 = _kblock(kind, w0, b, x0, d0, b0, a00, m00, s00)
                    a01, m01, s01 = _kblock(kind, w0, b, x1, d1, b1, a01, m01, s01)
                    a10, m10, s10 = _kblock(kind, w1, b, x0, d0, b0, a10, m10, s10)
                    a11, m11, s11 = _kblock(kind, w1, b, x1, d1, b1, a11, m11, s11)
                    a20, m20, s20 = _kblock(kind, w2, b, x0, d0, b0, a20, m20, s20)
                    a21, m21, s21 = _kblock(kind, w2, b, x1, d1, b1, a21, m21, s21)
                    a30, m30, s30 = _kblock(kind, w3, b, x0, d0, b0, a30, m30, s30)
                    a31, m31, s31 = _kblock(kind, w3, b, x1, d1, b1, a31, m31, s31)
                out[i, r] = _kfinal(kind, a00, m00, s00)
                out[i + 1, r] = _kfinal(kind, a01, m01, s01)
                out[i, r + 1] = _kfinal(kind, a10, m10, s10)
                out[i + 1, r + 1] = _kfinal(kind, a11, m11, s11)
                out[i, r + 2] = _kfinal(kind, a20, m20, s20)
                out[i + 1, r + 2] = _kfinal(kind, a21, m21, s21)
                out[i, r + 3] = _kfinal(kind, a30, m30, s30)
                out[i + 1, r + 3] = _kfinal(kind, a31, m31, s31)
            for i in range(n2, n):
                xr, br = xq[i], bsums[i]
                a0 = a1 = a2 = a3 = f32x8_zero()
                m0 = m1 = m2 = m3 = f32x8_zero()
                s0 = s1 = s2 = s3 = np.float32(0.0)
                for b in range(nb):
                    prefetch_span(w, pb, b, step)
                    db = xd[i, b]
                    if kind == K_Q6_K:      # the four rows' lanes at once (``q6k_lanes4``), the same float steps
                        o = b * 210
                        l0, l1 = q6k_lanes2(w, r, o, xr, b * 256, br, b * 16)
                        l2, l3 = q6k_lanes2(w, r + 2, o, xr, b * 256, br, b * 16)
                        a0 = f32x8_fma(np.float32(db * f16_at(w0, o + 208)), i32x8_to_f32x8(l0), a0)
                        a1 = f32x8_fma(np.float32(db * f16_at(w1, o + 208)), i32x8_to_f32x8(l1), a1)
                        a2 = f32x8_fma(np.float32(db * f16_at(w2, o + 208)), i32x8_to_f32x8(l2), a2)
                        a3 = f32x8_fma(np.float32(db * f16_at(w3, o + 208)), i32x8_to_f32x8(l3), a3)
                        continue
                    a0, m0, s0 = _kblock(kind, w0, b, xr, db, br, a0, m0, s0)
                    a1, m1, s1 = _kblock(kind, w1, b, xr, db, br, a1, m1, s1)
                    a2, m2, s2 = _kblock(kind, w2, b, xr, db, br, a2, m2, s2)
                    a3, m3, s3 = _kblock(kind, w3, b, xr, db, br, a3, m3, s3)
                out[i, r] = _kfinal(kind, a0, m0, s0)
                out[i, r + 1] = _kfinal(kind, a1, m1, s1)
                out[i, r + 2] = _kfinal(kind, a2, m2, s2)
                out[i, r + 3] = _kfinal(kind, a3, m3, s3)
            r += 4
        while r < r1:
            wr = w[r]
            for i in range(n):
                a0 = m0 = f32x8_zero()
                s0 = np.float32(0.0)
                for b in range(nb):
                    a0, m0, s0 = _kblock(kind, wr, b, xq[i], xd[i, b], bsums[i], a0, m0, s0)
                out[i, r] = _kfinal(kind, a0, m0, s0)
            r += 1


# Each format: one parallel kernel for activation rows in fours (prompts, parallel decode), one for the rest; in one
# kernel, the larger tiles made LLVM's code for n = 1 and 2 about 15% slower.
@njit(parallel=True, cache=True, nogil=True)
def _q6_k4(w, xq, xd, bsums, out):
    _mv_k4(w, xq, xd, bsums, out, K_Q6_K)


@njit(parallel=True, cache=True, nogil=True)
def _q6_k(w, xq, xd, bsums, out):
    _mv_k(w, xq, xd, bsums, out, K_Q6_K)


@njit(parallel=True, cache=True, nogil=True)
def _q4_k4(w, xq, xd, bsums, out):
    _mv_k4(w, xq, xd, bsums, out, K_Q4_K)


@njit(parallel=True, cache=True, nogil=True)
def _q4_k(w, xq, xd, bsums, out):
    _mv_k(w, xq, xd, bsums, out, K_Q4_K)


@njit(parallel=True, cache=True, nogil=True)
def _q5_k4(w, xq, xd, bsums, out):
    _mv_k4(w, xq, xd, bsums, out, K_Q5_K)


@njit(parallel=True, cache=True, nogil=True)
def _q5_k(w, xq, xd, bsums, out):
    _mv_k(w, xq, xd, bsums, out, K_Q5_K)


# Below this many activation rows the 4 x 2 kernel takes them all: such products read the weights from memory
# either way (Q6_K 640 x 2048, n = 4..7: within noise of the split), and a short prompt then compiles and loads
# one kernel per format instead of two (Gemma 3's first token from an empty cache: about 5 s less).
SMALL_N = 8


def _split4(k4, k1, w, xq, xd, bsums, out):
    n = xq.shape[0]
    n4 = n - n % 4 if n >= SMALL_N else 0
    if n4:
        k4(w, xq[:n4], xd[:n4], bsums[:n4], out[:n4])
    if n4 < n:
        k1(w, xq[n4:], xd[n4:], bsums[n4:], out[n4:])


def mv_q6_k(w, xq, xd, bsums, out, tab):
    """Same arguments and results as dot_kquant_scalar.mv_q6_k (``tab`` unused)."""
    _split4(_q6_k4, _q6_k, w, xq, xd, bsums, out)


def mv_q4_k(w, xq, xd, bsums, out, tab):
    """Same arguments and results as dot_kquant_scalar.mv_q4_k (``tab`` unused)."""
    _split4(_q4_k4, _q4_k, w, xq, xd, bsums, out)


def mv_q5_k(w, xq, xd, bsums, out, tab):
    """Same arguments and results as dot_kquant_scalar.mv_q5_k (``tab`` unused)."""
    _split4(_q5_k4, _q5_k, w, xq, xd, bsums, out)
