"""SIMD vectors inside Numba: two vector types and the handful of operations ggml's x86 dot products are made of.

Numba has no vector types; these are registered here as first-class Numba types whose LLVM representation is a
vector register (``<8 x float>``, ``<8 x i32>``), with ``@intrinsic`` operations that emit plain, target-neutral
LLVM vector IR. A kernel written with them reads like ggml's intrinsics code and compiles to the same kind of
instructions (LLVM picks ``vpdpbusd`` / ``vpmaddubsw`` / ``vfmadd231ps`` on x86, their counterparts elsewhere):

    acc = f32x8_zero()
    for b in range(nb):
        lanes = dot_u4_s8(w, wo, x, xo)              # eight int32 lanes of four products (exact integers)
        acc = f32x8_fma(d_w * d_x, i32x8_to_f32x8(lanes), acc)  # one rounding per lane, as _mm256_fmadd_ps
    out = f32x8_hsum(acc)                               # ggml's hsum_float_8 order

Only the integer lane sums are reassociated (exact in any order); every float operation is one IEEE operation in
ggml's order, so kernels built from these stay bit-identical to llama.cpp.

Numba's on-disk cache checks only the source file of each cached kernel: after editing this module, clear the
``__pycache__`` of the kernels that use it (or set ``NUMBA_CACHE_DIR`` to a fresh directory).
"""
from __future__ import annotations

import os

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_I16 = ir.IntType(16)
_I8 = ir.IntType(8)
_V_F32x8 = ir.VectorType(_F32, 8)
_V_I32x8 = ir.VectorType(_I32, 8)


class F32x8(types.Type):
    """Eight float32 lanes (an AVX register)."""
    def __init__(self):
        super().__init__(name="f32x8")


class I32x8(types.Type):
    """Eight int32 lanes."""
    def __init__(self):
        super().__init__(name="i32x8")


f32x8 = F32x8()
i32x8 = I32x8()


@register_model(F32x8)
class _F32x8Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _V_F32x8)


@register_model(I32x8)
class _I32x8Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _V_I32x8)


def _ptr(context, builder, aryty, ary, off, elty):
    """Pointer to byte ``off`` of a C-contiguous array's data, cast to ``elty*``."""
    a = context.make_array(aryty)(context, builder, ary)
    p = builder.bitcast(a.data, _I8.as_pointer())
    p = builder.gep(p, [off])
    return builder.bitcast(p, elty.as_pointer())


def _load(builder, ptr):
    ld = builder.load(ptr)
    ld.align = 1
    return ld


def _host_features():
    try:
        import llvmlite.binding as llvm
        f = llvm.get_host_cpu_features()
        return {k for k, v in f.items() if v}
    except Exception:       # a host llvmlite cannot describe: the target-neutral forms
        return set()


# LLAMPY_SIMD=generic|avx2 forces a lesser instruction path (the tests check that every path gives the same numbers;
# use it with a fresh NUMBA_CACHE_DIR, since Numba's cache does not know about this switch)
_FORCE = os.environ.get("LLAMPY_SIMD", "")
_FEATS = _host_features() if _FORCE != "generic" else set()
VNNI = _FORCE not in ("avx2", "generic") and ("avxvnni" in _FEATS or {"avx512vnni", "avx512vl"} <= _FEATS)
AVX2 = "avx2" in _FEATS


def _call(builder, name, ret, args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def _udot(builder, a, b, acc=None):
    """<32 x i8> unsigned a, <32 x i8> signed b -> <8 x i32>, lane l = sum of a[e] * b[e] over e = 4l..4l+3
    (plus lane l of ``acc``, an <8 x i32>, when given): vpdpbusd where the CPU has VNNI (it accumulates into acc
    itself), vpmaddubsw + vpmaddwd on AVX2 (no saturation for |a| <= 128, |b| <= 127), else target-neutral IR.
    The integers are the same on every path."""
    if VNNI:
        start = ir.Constant(_V_I32x8, [0] * 8) if acc is None else acc
        return _call(builder, "llvm.x86.avx512.vpdpbusd.256", _V_I32x8,
                     [start, builder.bitcast(a, _V_I32x8), builder.bitcast(b, _V_I32x8)])
    if AVX2:
        p16 = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", ir.VectorType(_I16, 16), [a, b])
        r = _call(builder, "llvm.x86.avx2.pmadd.wd", _V_I32x8, [p16, ir.Constant(ir.VectorType(_I16, 16), [1] * 16)])
    else:
        w32 = ir.VectorType(_I32, 32)
        r = _lanes4(builder, builder.mul(builder.zext(a, w32), builder.sext(b, w32)))
    return r if acc is None else builder.add(r, acc)


def _sdot(builder, a, b):
    """As ``_udot`` with signed a: ggml's sign trick, |a| times b with a's sign (exact for b > -128). On AVX2 b takes
    a's sign with vpsignb, as ggml's ``_mm256_sign_epi8``: LLVM does not see the select form below as one and emitted
    three instructions (xor, sub, andn) per pair instead, a third of the AVX2 Q8_0 prompt tiles' work per pair."""
    v32 = ir.VectorType(_I8, 32)
    zero = ir.Constant(v32, [0] * 32)
    neg = builder.icmp_signed("<", a, zero)
    absa = builder.select(neg, builder.sub(zero, a), a)
    if AVX2:
        return _udot(builder, absa, _call(builder, "llvm.x86.avx2.psign.b", v32, [b, a]))
    sb = builder.select(neg, builder.sub(zero, b), b)
    sb = builder.select(builder.icmp_signed("==", a, zero), zero, sb)
    return _udot(builder, absa, sb)


def _lanes4(builder, prod32):
    """<32 x i32> -> <8 x i32>: lane l = p[4l] + p[4l+1] + p[4l+2] + p[4l+3] (ggml's madd/dpbusd grouping)."""
    parts = []
    for j in range(4):
        idx = ir.Constant(ir.VectorType(_I32, 8), [4 * l + j for l in range(8)])
        parts.append(builder.shuffle_vector(prod32, prod32, idx))
    return builder.add(builder.add(parts[0], parts[1]), builder.add(parts[2], parts[3]))


def _nibbles32(builder, q16):
    """16 bytes -> <32 x i8>: the low nibbles (elements 0..15), then the high nibbles (16..31)."""
    lo = builder.and_(q16, ir.Constant(ir.VectorType(_I8, 16), [15] * 16))
    hi = builder.lshr(q16, ir.Constant(ir.VectorType(_I8, 16), [4] * 16))
    return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 32), list(range(32))))


@intrinsic
def f32x8_zero(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(_V_F32x8, [0.0] * 8)
    return f32x8(), codegen


@intrinsic
def f32x8_fma(typingctx, d, v, acc):
    """acc + d * v per lane, rounded once (llvm.fma: _mm256_fmadd_ps(broadcast(d), v, acc))."""
    if not (isinstance(d, types.Float) and v == f32x8 and acc == f32x8):
        return None

    def codegen(context, builder, sig, args):
        dv = context.cast(builder, args[0], sig.args[0], types.float32)
        splat = builder.insert_element(ir.Constant(_V_F32x8, None), dv, ir.Constant(_I32, 0))
        splat = builder.shuffle_vector(splat, splat, ir.Constant(ir.VectorType(_I32, 8), [0] * 8))
        return _call(builder, "llvm.fma.v8f32", _V_F32x8, [splat, args[1], args[2]])
    return f32x8(d, f32x8, f32x8), codegen


@intrinsic
def i32x8_to_f32x8(typingctx, v):
    """int32 lanes -> float32 lanes (round to nearest, as _mm256_cvtepi32_ps)."""
    if v != i32x8:
        return None

    def codegen(context, builder, sig, args):
        return builder.sitofp(args[0], _V_F32x8)
    return f32x8(i32x8), codegen


@intrinsic
def f32x8_hsum(typingctx, v):
    """ggml's hsum_float_8: ((a4 + a0) + (a6 + a2)) + ((a5 + a1) + (a7 + a3))."""
    if v != f32x8:
        return None

    def codegen(context, builder, sig, args):
        a = [builder.extract_element(args[0], ir.Constant(_I32, i)) for i in range(8)]
        fa = builder.fadd
        return fa(fa(fa(a[4], a[0]), fa(a[6], a[2])), fa(fa(a[5], a[1]), fa(a[7], a[3])))
    return types.float32(f32x8), codegen


@intrinsic
def f32x8_hsum8(typingctx, a0, a1, a2, a3, a4, a5, a6, a7):
    """Lane k = ``f32x8_hsum(a_k)``, for eight vectors at once: the same three rounds of additions in the same tree
    (halves, then quarters, then neighbours), each round one vector addition over two of the vectors' partial sums
    side by side; 14 shuffles and 7 additions where eight hsums take 24 shuffles and 24 scalar additions."""
    if any(a != f32x8 for a in (a0, a1, a2, a3, a4, a5, a6, a7)):
        return None

    def codegen(context, builder, sig, args):
        def sh(x, y, idx):
            return builder.shuffle_vector(x, y, ir.Constant(ir.VectorType(_I32, 8), idx))
        # round 1, vectors k and k + 4 side by side: lanes l and l + 4 of each
        t = [builder.fadd(sh(args[k], args[k + 4], [0, 1, 2, 3, 8, 9, 10, 11]),
                          sh(args[k], args[k + 4], [4, 5, 6, 7, 12, 13, 14, 15])) for k in range(4)]
        # round 2: partial sums j and j + 2 of each; u01 = [a0: 2 | a1: 2 | a4: 2 | a5: 2], u23 likewise
        u01 = builder.fadd(sh(t[0], t[1], [0, 1, 8, 9, 4, 5, 12, 13]), sh(t[0], t[1], [2, 3, 10, 11, 6, 7, 14, 15]))
        u23 = builder.fadd(sh(t[2], t[3], [0, 1, 8, 9, 4, 5, 12, 13]), sh(t[2], t[3], [2, 3, 10, 11, 6, 7, 14, 15]))
        # round 3: the two partial sums of each vector, lanes in order a0 .. a7
        return builder.fadd(sh(u01, u23, [0, 2, 8, 10, 4, 6, 12, 14]), sh(u01, u23, [1, 3, 9, 11, 5, 7, 13, 15]))
    return f32x8(f32x8, f32x8, f32x8, f32x8, f32x8, f32x8, f32x8, f32x8), codegen


@intrinsic
def f32x8_add(typingctx, a, b):
    """a + b per lane."""
    if a != f32x8 or b != f32x8:
        return None

    def codegen(context, builder, sig, args):
        return builder.fadd(args[0], args[1])
    return f32x8(f32x8, f32x8), codegen


@intrinsic
def i32x8_add(typingctx, a, b):
    if a != i32x8 or b != i32x8:
        return None

    def codegen(context, builder, sig, args):
        return builder.add(args[0], args[1])
    return i32x8(i32x8, i32x8), codegen


@intrinsic
def f32x8_sub(typingctx, a, b):
    """a - b per lane."""
    if a != f32x8 or b != f32x8:
        return None

    def codegen(context, builder, sig, args):
        return builder.fsub(args[0], args[1])
    return f32x8(f32x8, f32x8), codegen


@intrinsic
def i32x8_load(typingctx, arr, i):
    """arr[i:i+8] of an int32 array as eight lanes."""
    if not isinstance(arr, types.Array) or arr.dtype != types.int32:
        return None

    def codegen(context, builder, sig, args):
        return _load(builder, _elem_ptr(context, builder, sig.args[0], args[0], args[1], _V_I32x8))
    return i32x8(arr, types.intp), codegen


def _signed_lanes(context, builder, sig, args, au, b, off, il, iso):
    """Eight int32 lanes of signed weights times int8 activations b, from ``au``: the weights plus ``off`` as
    unsigned bytes. Where the offset form is exact (``offset_exact(off)``, below): the products of au and b
    (vpdpbusd, or vpmaddubsw + vpmaddwd) added to the activations' negated lane sums times off
    (``dot_q32.lane_sums``: args[il] at element args[iso]); else ggml's sign trick on au - off. The same integers
    either way."""
    if offset_exact(off):
        acc = _load(builder, _elem_ptr(context, builder, sig.args[il], args[il], args[iso], _V_I32x8))
        return _udot(builder, au, b, acc)
    return _sdot(builder, builder.sub(au, ir.Constant(au.type, [off] * 32)), b)


@intrinsic
def dot_s8_s8(typingctx, w, wo, x, xo, xl, so):
    """32 int8 weights at byte wo of w times 32 int8 activations at byte xo of x: eight int32 lanes, lane l the sum
    of the products of elements 4l..4l+3 (ggml's mul_sum_i8_pairs_float before its conversion); xl[so:so+8]: the
    activations' ``lane_sums`` for an offset of 128."""
    def codegen(context, builder, sig, args):
        v32 = ir.VectorType(_I8, 32)
        a = _load(builder, _ptr(context, builder, sig.args[0], args[0], args[1], v32))
        b = _load(builder, _ptr(context, builder, sig.args[2], args[2], args[3], v32))
        return _signed_lanes(context, builder, sig, args, builder.xor(a, ir.Constant(v32, [-128] * 32)), b, 128, 4, 5)
    return i32x8(w, types.intp, x, types.intp, xl, types.intp), codegen


@intrinsic
def dot_u4_s8(typingctx, w, wo, x, xo, off, xl, so):
    """(``off``: a literal integer.) 16 bytes of nibbles at byte wo of w (element e < 16: byte e's low nibble, 16 + e:
    its high nibble), minus ``off`` (8 for Q4_0, 0 for Q4_1), times 32 int8 activations at byte xo of x: eight int32
    lanes of four. xl[so:so+8]: the activations' ``lane_sums`` for ``off`` (unused when it is 0)."""
    def codegen(context, builder, sig, args):
        q = _load(builder, _ptr(context, builder, sig.args[0], args[0], args[1], ir.VectorType(_I8, 16)))
        a = _nibbles32(builder, q)
        b = _load(builder, _ptr(context, builder, sig.args[2], args[2], args[3], ir.VectorType(_I8, 32)))
        if off.literal_value == 0:
            return _udot(builder, a, b)
        return _signed_lanes(context, builder, sig, args, a, b, off.literal_value, 5, 6)
    if not isinstance(off, types.IntegerLiteral):
        return None
    return i32x8(w, types.intp, x, types.intp, off, xl, types.intp), codegen


def _high_bits(builder, qh):
    """<32 x i8>: element e is 16 where bit e of the i32 ``qh`` is set, else 0 (the 5-bit formats' fifth bit).
    As a <32 x i1> mask: one kmov + a masked byte move on AVX-512BW (a shift-and-mask per lane of 32 int32
    lanes before: ~15 instructions per weight block)."""
    v32 = ir.VectorType(_I8, 32)
    mask = builder.bitcast(qh, ir.VectorType(ir.IntType(1), 32))
    return builder.select(mask, ir.Constant(v32, [16] * 32), ir.Constant(v32, [0] * 32))


def _nibbles32_bc(builder, q16):
    """``_nibbles32`` as a 128-bit broadcast, one shift of the upper half's 64-bit lanes by 4 and one mask (AVX2:
    vbroadcasti128 from memory, vpsrlvq, vpand; the two-half form took a shift, a vinserti128 and the mask)."""
    v = builder.bitcast(builder.shuffle_vector(q16, q16, ir.Constant(ir.VectorType(_I32, 32), list(range(16)) * 2)),
                        ir.VectorType(ir.IntType(64), 4))
    v = builder.lshr(v, ir.Constant(ir.VectorType(ir.IntType(64), 4), [0, 0, 4, 4]))
    return builder.and_(builder.bitcast(v, ir.VectorType(_I8, 32)), ir.Constant(ir.VectorType(_I8, 32), [15] * 32))


def _dot_u5_s8(name, nibbles):
    """The typer of an intrinsic ``name``: ``dot_u5_s8`` with the nibbles of a block's 16 bytes split by
    ``nibbles(builder, q16)``."""
    def typer(typingctx, w, wo, qh, x, xo, off, xl, so):
        def codegen(context, builder, sig, args):
            q = _load(builder, _ptr(context, builder, sig.args[0], args[0], args[1], ir.VectorType(_I8, 16)))
            a = builder.or_(nibbles(builder, q), _high_bits(builder, context.cast(builder, args[2], sig.args[2],
                                                                                  types.int32)))
            b = _load(builder, _ptr(context, builder, sig.args[3], args[3], args[4], ir.VectorType(_I8, 32)))
            if off.literal_value == 0:
                return _udot(builder, a, b)
            return _signed_lanes(context, builder, sig, args, a, b, off.literal_value, 6, 7)
        if not isinstance(off, types.IntegerLiteral):
            return None
        return i32x8(w, types.intp, types.int64, x, types.intp, off, xl, types.intp), codegen
    typer.__name__ = typer.__qualname__ = name
    return typer


# As ``dot_u4_s8`` with bit e of the 32-bit ``qh`` as bit 4 of element e (Q5_0: off 16, Q5_1: off 0).
dot_u5_s8 = intrinsic(_dot_u5_s8("dot_u5_s8", _nibbles32))
# The same lanes, the nibbles split by ``_nibbles32_bc``. Q5_0's decode (dot_q32._block): one thread, SmolLM2's Q5_0
# matrices, 6-9% less time a call; Q5_1's larger matrices measured no better.
dot_u5_s8_bc = intrinsic(_dot_u5_s8("dot_u5_s8_bc", _nibbles32_bc))


@intrinsic
def fma32(typingctx, a, b, c):
    """float32 a * b + c rounded once (llvm.fma.f32: the vfmadd ggml's compiled C gets from contraction)."""
    def codegen(context, builder, sig, args):
        v = [context.cast(builder, x, t, types.float32) for x, t in zip(args, sig.args)]
        return _call(builder, "llvm.fma.f32", _F32, v)
    return types.float32(a, b, c), codegen


# ----------------------------------------------------------------------------- sixteen float32 lanes (AVX-512)
_F16x = ir.VectorType(_F32, 16)
_H16 = ir.VectorType(ir.HalfType(), 16)


class F16L(types.Type):
    """Sixteen float32 lanes (a ``__m512``: ggml's F16/F32 vector ops on AVX-512)."""
    def __init__(self):
        super().__init__(name="f32x16")


f16l = F16L()


@register_model(F16L)
class _F16LModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _F16x)


def _elem_ptr(context, builder, aryty, ary, idx, vecty):
    """Pointer to element ``idx`` counted from the start of an array's data (of a contiguous 1-d array: its element
    idx), cast to ``vecty*``."""
    a = context.make_array(aryty)(context, builder, ary)
    return builder.bitcast(builder.gep(a.data, [idx]), vecty.as_pointer())


@intrinsic
def v16_zero(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(_F16x, [0.0] * 16)
    return f16l(), codegen


@intrinsic
def v16_load(typingctx, arr, i):
    """arr[i:i+16] of a float32 array, or of F16 bits (uint16) widened to float32 (_mm512_cvtph_ps)."""
    if not isinstance(arr, types.Array) or arr.dtype not in (types.float32, types.uint16):
        return None

    def codegen(context, builder, sig, args):
        if sig.args[0].dtype == types.float32:
            return _load(builder, _elem_ptr(context, builder, sig.args[0], args[0], args[1], _F16x))
        h = _load(builder, _elem_ptr(context, builder, sig.args[0], args[0], args[1], ir.VectorType(_I16, 16)))
        return builder.fpext(builder.bitcast(h, _H16), _F16x)
    return f16l(arr, types.intp), codegen


def _store_lanes(vecty):
    """codegen of ``arr[i:i + lanes] = v`` for a float32 array and a vector of type vecty."""
    def codegen(context, builder, sig, args):
        st = builder.store(args[2], _elem_ptr(context, builder, sig.args[0], args[0], args[1], vecty))
        st.align = 4
        return context.get_dummy_value()
    return codegen


@intrinsic
def v16_store(typingctx, arr, i, v):
    """arr[i:i+16] = v (float32 array)."""
    if v != f16l:
        return None
    return types.void(arr, types.intp, f16l), _store_lanes(_F16x)


def _splat16(builder, s):
    v = builder.insert_element(ir.Constant(_F16x, None), s, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, 16), [0] * 16))


@intrinsic
def v16_fma(typingctx, a, b, c):
    """a * b + c per lane, rounded once; a or b may be a float32 scalar (broadcast)."""
    if c != f16l or not (a == f16l or b == f16l):
        return None

    def codegen(context, builder, sig, args):
        ops = []
        for x, t in zip(args[:2], sig.args[:2]):
            ops.append(x if t == f16l else _splat16(builder, context.cast(builder, x, t, types.float32)))
        return _call(builder, "llvm.fma.v16f32", _F16x, [ops[0], ops[1], args[2]])
    return f16l(a, b, c), codegen


@intrinsic
def v16_scale(typingctx, a, s):
    """a * s per lane (s a float32 scalar)."""
    if a != f16l:
        return None

    def codegen(context, builder, sig, args):
        return builder.fmul(args[0], _splat16(builder, context.cast(builder, args[1], sig.args[1], types.float32)))
    return f16l(f16l, s), codegen


@intrinsic
def v16_add(typingctx, a, b):
    if a != f16l or b != f16l:
        return None

    def codegen(context, builder, sig, args):
        return builder.fadd(args[0], args[1])
    return f16l(f16l, f16l), codegen


@intrinsic
def v16_round_f16(typingctx, a):
    """Each lane rounded to the nearest F16 value (to nearest even, subnormals and overflow as the hardware's
    _mm512_cvtps_ph does) and widened back: a store to an F16 array and a load."""
    if a != f16l:
        return None

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.fptrunc(args[0], _H16), _F16x)
    return f16l(f16l), codegen


def _halving(builder, v, combine):
    """Lanes l and l + 8 combined, then l and l + 4, l + 2, l + 1 (GCC's _mm512_reduce_*_ps order); lane 0."""
    for half in (8, 4, 2, 1):
        lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, half), list(range(half))))
        hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, half), [half + l for l in range(half)]))
        v = combine(lo, hi, half)
    return builder.extract_element(v, ir.Constant(_I32, 0))


@intrinsic
def v16_reduce(typingctx, a):
    """_mm512_reduce_add_ps as GCC expands it: lanes l + l+8, then l + l+4, l + l+2, l + l+1."""
    if a != f16l:
        return None

    def codegen(context, builder, sig, args):
        return _halving(builder, args[0], lambda lo, hi, half: builder.fadd(lo, hi))
    return types.float32(f16l), codegen


@intrinsic
def v16_reduce_x8(typingctx, a):
    """GGML_F32x8_REDUCE's last steps (AVX builds) on sixteen lanes that hold two eight-lane registers side by side,
    x0 in lanes 0..7 and x1 in 8..15: x0 + x1, then t = low half + high half, then two hadds: (t0 + t1) + (t2 + t3)."""
    if a != f16l:
        return None

    def codegen(context, builder, sig, args):
        fa = builder.fadd
        e = [builder.extract_element(args[0], ir.Constant(_I32, i)) for i in range(16)]
        x = [fa(e[i], e[i + 8]) for i in range(8)]
        t = [fa(x[i], x[i + 4]) for i in range(4)]
        return fa(fa(t[0], t[1]), fa(t[2], t[3]))
    return types.float32(f16l), codegen


@intrinsic
def round_f16(typingctx, x):
    """A float32 rounded to the nearest F16 value and widened back (vcvtps2ph: ties to even, subnormals,
    overflow to inf), the scalar form of ``v16_round_f16``."""
    def codegen(context, builder, sig, args):
        v = context.cast(builder, args[0], sig.args[0], types.float32)
        return builder.fpext(builder.fptrunc(v, ir.HalfType()), _F32)
    return types.float32(x), codegen


AVX512F = _FORCE not in ("avx2", "generic") and "avx512f" in _FEATS
# ggml's vector helpers (ggml_vec_dot_f16, ggml_v_expf in SiLU and softmax, the attention kernels' sums) run in the
# register width of the build: sixteen lanes and steps of 64 with AVX-512, eight and 32 with AVX2, and their float
# order follows it (through F16 accumulators and softmax a last-bit difference grows to ~0.2 in a log-prob). llampy
# reproduces one build's order on every host: the AVX-512 build's by default (the build the project's recorded
# llama.cpp outputs come from), or LLAMPY_FLOAT_ORDER=avx2 / host (the host's own, to match a native llama.cpp built
# on an AVX2 machine). LLAMPY_SIMD picks llampy's instructions, not this order.
HOST_VEC_LANES = 16 if "avx512f" in (_FEATS if _FORCE != "generic" else _host_features()) else 8
_ORDER = os.environ.get("LLAMPY_FLOAT_ORDER", "avx512").lower()
if _ORDER not in ("avx512", "avx2", "host"):
    raise ValueError(f"LLAMPY_FLOAT_ORDER={_ORDER!r}: expected avx512, avx2 or host")
F16_VEC_LANES = {"avx512": 16, "avx2": 8}.get(_ORDER, HOST_VEC_LANES)


def _c16(v):
    return ir.Constant(_F16x, [float(v)] * 16)


def _fma16(builder, a, b, c):
    return _call(builder, "llvm.fma.v16f32", _F16x, [a, b, c])


def _v_expf(builder, x):
    """ggml_v_expf in the form of the host's build (``F16_VEC_LANES``): ``_v_expf512`` or ``_v_expf_avx2``. The
    two round differently (ggml's AVX2 and AVX-512 SiLU differ in the last bit for about one value in eight)."""
    return _v_expf512(builder, x) if F16_VEC_LANES == 16 else _v_expf_avx2(builder, x)


def _v_expf_avx2(builder, x):
    """ggml_v_expf, AVX2 form, lane by lane on a float vector of any width or on one float: n = round(x / ln 2)
    and b as in the AVX-512 form, the polynomial's last term a multiply (c1 * b, not fma(c1, b, 1)), then
    fma(k, j, k) with k = 2^n made from z's bits; for 126 < |n| <= 192 two scalings (fma(s2, j, s2) * s1), beyond
    192 s1 * s1 (inf or 0)."""
    f = float.fromhex
    if isinstance(x.type, ir.VectorType):
        w = x.type.count
        vi = ir.VectorType(_I32, w)
        c = lambda v: ir.Constant(x.type, [float(v)] * w)              # noqa: E731
        ci = lambda v: ir.Constant(vi, [v] * w)                          # noqa: E731
        fty = f"v{w}f32"
    else:
        vi = _I32
        c = lambda v: ir.Constant(_F32, float(v))                         # noqa: E731
        ci = lambda v: ir.Constant(_I32, v)                               # noqa: E731
        fty = "f32"

    def fma(a, b_, c_):
        return _call(builder, f"llvm.fma.{fty}", x.type, [a, b_, c_])
    r = c(f("0x1.8p23"))
    z = fma(x, c(f("0x1.715476p+0")), r)
    n = builder.fsub(z, r)
    negn = builder.fneg(n)
    b = fma(negn, c(f("0x1.7f7d1cp-20")), fma(negn, c(f("0x1.62e4p-1")), x))
    e = builder.shl(builder.bitcast(z, vi), ci(23))
    k = builder.bitcast(builder.add(e, ci(0x3F800000)), x.type)
    absn = _call(builder, f"llvm.fabs.{fty}", x.type, [n])
    u = builder.fmul(b, b)
    j = fma(fma(fma(c(f("0x1.0e4020p-7")), b, c(f("0x1.573e2ep-5"))), u,
                fma(c(f("0x1.555e66p-3")), b, c(f("0x1.fffdb6p-2")))),
            u, builder.fmul(c(f("0x1.ffffecp-1")), b))
    g = builder.select(builder.fcmp_ordered("<=", n, c(0.0)), ci(0x82000000 - (1 << 32)), ci(0))
    s1 = builder.bitcast(builder.add(g, ci(0x7F000000)), x.type)
    s2 = builder.bitcast(builder.sub(e, g), x.type)
    mid = builder.fmul(fma(s2, j, s2), s1)
    res = builder.select(builder.fcmp_ordered(">", absn, c(126.0)), mid, fma(k, j, k))
    return builder.select(builder.fcmp_ordered(">", absn, c(192.0)), builder.fmul(s1, s1), res)


@intrinsic
def expf_lane(typingctx, x):
    """ggml_v_expf of one float32 in the AVX2 form (``_v_expf_avx2``): one lane of it, for leftovers that ggml runs
    through an eight-lane step where llampy's loop runs sixteen."""
    def codegen(context, builder, sig, args):
        return _v_expf_avx2(builder, context.cast(builder, args[0], sig.args[0], types.float32))
    return types.float32(x), codegen


def _v_expf512(builder, x):
    """ggml_v_expf (AVX-512 form): 2^n * p(b) with n = round(x / ln 2), b the reduced argument in two fnmadd
    steps, p a degree-5 polynomial in fmas, _mm512_scalef_ps; |n| > 192 gives +inf or 0. The constants and the
    operation order are ggml's; without AVX-512 the scaling is a multiply by 2^n built from its bits (the same
    value wherever the result is a normal float)."""
    f = float.fromhex
    r = _c16(f("0x1.8p23"))
    z = _fma16(builder, x, _c16(f("0x1.715476p+0")), r)
    n = builder.fsub(z, r)
    negn = builder.fneg(n)
    b = _fma16(builder, negn, _c16(f("0x1.7f7d1cp-20")), _fma16(builder, negn, _c16(f("0x1.62e4p-1")), x))
    u = builder.fmul(b, b)
    j = _fma16(builder,
               _fma16(builder, _fma16(builder, _c16(f("0x1.0e4020p-7")), b, _c16(f("0x1.573e2ep-5"))), u,
                      _fma16(builder, _c16(f("0x1.555e66p-3")), b, _c16(f("0x1.fffdb6p-2")))),
               u, _fma16(builder, _c16(f("0x1.ffffecp-1")), b, _c16(1.0)))
    if AVX512F:
        res = _call(builder, "llvm.x86.avx512.mask.scalef.ps.512", _F16x,
                    [j, n, ir.Constant(_F16x, None), ir.Constant(_I16, -1), ir.Constant(_I32, 4)])
    else:
        i16 = ir.VectorType(_I32, 16)
        ni = builder.fptosi(n, i16)
        lo, hi = ir.Constant(i16, [-126] * 16), ir.Constant(i16, [127] * 16)
        nc = builder.select(builder.icmp_signed("<", ni, lo), lo, builder.select(builder.icmp_signed(">", ni, hi),
                                                                                 hi, ni))
        p2 = builder.bitcast(builder.shl(builder.add(nc, ir.Constant(i16, [127] * 16)), ir.Constant(i16, [23] * 16)),
                             _F16x)
        res = builder.fmul(j, p2)
    absn = _call(builder, "llvm.fabs.v16f32", _F16x, [n])
    big = builder.fcmp_ordered(">", absn, _c16(192.0))
    alt = builder.select(builder.fcmp_ordered("<=", n, _c16(0.0)), _c16(0.0), _c16(float("inf")))
    return builder.select(big, alt, res)


@intrinsic
def v16_silu(typingctx, x):
    """ggml_v_silu: x / (1 + ggml_v_expf(-x)), sixteen lanes."""
    if x != f16l:
        return None

    def codegen(context, builder, sig, args):
        e = _v_expf(builder, builder.fneg(args[0]))
        return builder.fdiv(args[0], builder.fadd(_c16(1.0), e))
    return f16l(f16l), codegen


@intrinsic
def v16_mul(typingctx, a, b):
    if a != f16l or b != f16l:
        return None

    def codegen(context, builder, sig, args):
        return builder.fmul(args[0], args[1])
    return f16l(f16l, f16l), codegen


@intrinsic
def f16_at(typingctx, arr, off):
    """The F16 value stored at byte ``off`` of a uint8 array, as float32 (one vcvtph2ps on F16C hardware; exact)."""
    def codegen(context, builder, sig, args):
        h = _load(builder, _ptr(context, builder, sig.args[0], args[0], args[1], _I16))
        return builder.fpext(builder.bitcast(h, ir.HalfType()), _F32)
    return types.float32(arr, types.intp), codegen


@intrinsic
def v16_exp_shifted(typingctx, x, m):
    """ggml_v_expf(x - m) per lane (m a float32 scalar): the softmax numerator."""
    if x != f16l:
        return None

    def codegen(context, builder, sig, args):
        mv = _splat16(builder, context.cast(builder, args[1], sig.args[1], types.float32))
        return _v_expf(builder, builder.fsub(args[0], mv))
    return f16l(f16l, m), codegen


@intrinsic
def v16_max(typingctx, a, b):
    """Lane-wise maximum (llvm.maxnum)."""
    if a != f16l or b != f16l:
        return None

    def codegen(context, builder, sig, args):
        return _call(builder, "llvm.maxnum.v16f32", _F16x, [args[0], args[1]])
    return f16l(f16l, f16l), codegen


@intrinsic
def v16_hmax(typingctx, a):
    """The largest of the sixteen lanes."""
    if a != f16l:
        return None

    def codegen(context, builder, sig, args):
        def vmax(lo, hi, half):
            return _call(builder, f"llvm.maxnum.v{half}f32", ir.VectorType(_F32, half), [lo, hi])
        return _halving(builder, args[0], vmax)
    return types.float32(f16l), codegen


@intrinsic
def v16_abs(typingctx, a):
    """Lane-wise absolute value."""
    if a != f16l:
        return None

    def codegen(context, builder, sig, args):
        return _call(builder, "llvm.fabs.v16f32", _F16x, [args[0]])
    return f16l(f16l), codegen


@intrinsic
def v16_find_abs(typingctx, a, m):
    """The first lane l with |a[l]| == m (m a float32), or 16 where there is none: one compare and a count of
    trailing zeros of its mask."""
    if a != f16l:
        return None

    def codegen(context, builder, sig, args):
        mv = _splat16(builder, context.cast(builder, args[1], sig.args[1], types.float32))
        eq = builder.fcmp_ordered("==", _call(builder, "llvm.fabs.v16f32", _F16x, [args[0]]), mv)
        bits = builder.zext(builder.bitcast(eq, _I16), _I32)
        return _call(builder, "llvm.cttz.i32", _I32, [builder.or_(bits, ir.Constant(_I32, 1 << 16)),
                                                      ir.Constant(ir.IntType(1), 0)])
    return types.int32(f16l, m), codegen


@intrinsic
def v16_find_ne(typingctx, a, m, last):
    """The first lane l with a[l] != m (m a float32; a NaN lane counts as different), or 16 where there is none;
    with the literal ``last`` true, the last such lane, or -1: one compare and a count of its mask's zeros."""
    if a != f16l or not isinstance(last, types.BooleanLiteral):
        return None
    from_end = last.literal_value

    def codegen(context, builder, sig, args):
        mv = _splat16(builder, context.cast(builder, args[1], sig.args[1], types.float32))
        bits = builder.zext(builder.bitcast(builder.fcmp_unordered("!=", args[0], mv), _I16), _I32)
        no = ir.Constant(ir.IntType(1), 0)
        if from_end:      # 31 - ctlz over 32 bits: the highest set bit, -1 for none
            return builder.sub(ir.Constant(_I32, 31), _call(builder, "llvm.ctlz.i32", _I32, [bits, no]))
        return _call(builder, "llvm.cttz.i32", _I32, [builder.or_(bits, ir.Constant(_I32, 1 << 16)), no])
    return types.int32(f16l, m, last), codegen


@intrinsic
def v16_q8(typingctx, out, i, v, s, clamp):
    """The activation quantizers' rounding, sixteen lanes at once: q = rint(v * s) (float32 product, round half to
    even), at most 127 when the literal ``clamp`` is true (Q8_K), stored as int8 at out[i:i+16]; returns the sum of
    the sixteen q (exact)."""
    if v != f16l or not isinstance(clamp, types.BooleanLiteral) or not isinstance(out, types.Array) \
            or out.dtype != types.int8:
        return None
    cl = clamp.literal_value

    def codegen(context, builder, sig, args):
        x = builder.fmul(args[2], _splat16(builder, context.cast(builder, args[3], sig.args[3], types.float32)))
        r = _call(builder, "llvm.rint.v16f32", _F16x, [x])
        if cl:
            r = _call(builder, "llvm.minnum.v16f32", _F16x, [r, ir.Constant(_F16x, [127.0] * 16)])
        q = builder.fptosi(r, ir.VectorType(_I32, 16))
        st = builder.store(builder.trunc(q, ir.VectorType(_I8, 16)),
                           _elem_ptr(context, builder, sig.args[0], args[0], args[1], ir.VectorType(_I8, 16)))
        st.align = 1
        return _call(builder, "llvm.vector.reduce.add.v16i32", _I32, [q])
    return types.int32(out, types.intp, f16l, s, clamp), codegen


@intrinsic
def v16_geglu(typingctx, x, u, table):
    """GELU(x) * u in sixteen lanes, as ggml_vec_geglu_f32 with GGML_GELU_FP16 does it per value: 0 where
    x <= -10, x * u where x >= 10, else table[F16 bits of x] * u (``table``: float32, 65536 entries; x rounded to
    F16 as vcvtps2ph does). The lookups are sixteen scalar loads; the rest is vector work."""
    if x != f16l or u != f16l or not isinstance(table, types.Array) or table.dtype != types.float32:
        return None

    def codegen(context, builder, sig, args):
        xv, uv = args[0], args[1]
        idx = builder.zext(builder.bitcast(builder.fptrunc(xv, _H16), ir.VectorType(_I16, 16)),
                           ir.VectorType(_I32, 16))
        base = context.make_array(sig.args[2])(context, builder, args[2]).data
        t = ir.Constant(_F16x, None)
        for lane in range(16):
            k = ir.Constant(_I32, lane)
            t = builder.insert_element(t, builder.load(builder.gep(base, [builder.extract_element(idx, k)])), k)
        big = builder.fcmp_ordered(">=", xv, ir.Constant(_F16x, [10.0] * 16))
        small = builder.fcmp_ordered("<=", xv, ir.Constant(_F16x, [-10.0] * 16))
        r = builder.select(big, builder.fmul(xv, uv), builder.fmul(t, uv))
        return builder.select(small, ir.Constant(_F16x, [0.0] * 16), r)
    return f16l(f16l, f16l, table), codegen


@intrinsic
def v16_f16_copy(typingctx, out, src, j):
    """out[j:j+16] = the F16 bit patterns of the float32 values whose bit patterns are src[j:j+16] (uint32):
    vcvtps2ph's round to nearest even, overflow to inf and subnormals; a NaN becomes 0x7E00 with its sign, as
    ``rows.f32_to_f16_bits`` makes it. out: uint16, src: uint32, both contiguous."""
    if not (isinstance(out, types.Array) and out.dtype == types.uint16 and isinstance(src, types.Array)
            and src.dtype == types.uint32):
        return None

    def codegen(context, builder, sig, args):
        v16i = ir.VectorType(_I16, 16)
        bits = _load(builder, _elem_ptr(context, builder, sig.args[1], args[1], args[2], ir.VectorType(_I32, 16)))
        x = builder.bitcast(bits, _F16x)
        h = builder.bitcast(builder.fptrunc(x, _H16), v16i)
        sign = builder.trunc(builder.lshr(bits, ir.Constant(ir.VectorType(_I32, 16), [16] * 16)), v16i)
        qnan = builder.or_(builder.and_(sign, ir.Constant(v16i, [0x8000] * 16)), ir.Constant(v16i, [0x7E00] * 16))
        h = builder.select(builder.fcmp_unordered("uno", x, x), qnan, h)
        st = builder.store(h, _elem_ptr(context, builder, sig.args[0], args[0], args[2], v16i))
        st.align = 2
        return context.get_dummy_value()
    return types.void(out, src, types.intp), codegen


@intrinsic
def v16_splat(typingctx, s):
    def codegen(context, builder, sig, args):
        return _splat16(builder, context.cast(builder, args[0], sig.args[0], types.float32))
    return f16l(s), codegen


@intrinsic
def f32x8_load(typingctx, arr, i):
    """arr[i:i+8] of a float32 array as eight lanes."""
    if not isinstance(arr, types.Array) or arr.dtype != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return _load(builder, _elem_ptr(context, builder, sig.args[0], args[0], args[1], _V_F32x8))
    return f32x8(arr, types.intp), codegen


@intrinsic
def f32x8_store(typingctx, arr, i, v):
    """arr[i:i+8] = v (a float32 array)."""
    if not isinstance(arr, types.Array) or arr.dtype != types.float32 or v != f32x8:
        return None
    return types.void(arr, types.intp, f32x8), _store_lanes(_V_F32x8)


@intrinsic
def f32x8_scale(typingctx, v, s):
    """v * s per lane (s a float32 scalar, broadcast)."""
    if v != f32x8:
        return None

    def codegen(context, builder, sig, args):
        sv = builder.insert_element(ir.Constant(_V_F32x8, None), context.cast(builder, args[1], sig.args[1], types.float32),
                                    ir.Constant(_I32, 0))
        sv = builder.shuffle_vector(sv, sv, ir.Constant(ir.VectorType(_I32, 8), [0] * 8))
        return builder.fmul(args[0], sv)
    return f32x8(f32x8, s), codegen


@intrinsic
def f32x8_fma_s(typingctx, s, v, acc):
    """s * v + acc per lane, rounded once (s a float32 scalar, broadcast; v, acc vectors)."""
    if v != f32x8 or acc != f32x8:
        return None

    def codegen(context, builder, sig, args):
        sv = builder.insert_element(ir.Constant(_V_F32x8, None), context.cast(builder, args[0], sig.args[0], types.float32),
                                    ir.Constant(_I32, 0))
        sv = builder.shuffle_vector(sv, sv, ir.Constant(ir.VectorType(_I32, 8), [0] * 8))
        return _call(builder, "llvm.fma.v8f32", _V_F32x8, [sv, args[1], args[2]])
    return f32x8(s, f32x8, f32x8), codegen


@intrinsic
def f32x8_fma_lane(typingctx, dv, k, v, acc):
    """fma(lane k of dv broadcast, v, acc): the per-pair scale taken from a vector of eight scales (one vpermps)."""
    if dv != f32x8 or v != f32x8 or acc != f32x8 or not isinstance(k, types.IntegerLiteral):
        return None
    lane = k.literal_value

    def codegen(context, builder, sig, args):
        sv = builder.shuffle_vector(args[0], args[0], ir.Constant(ir.VectorType(_I32, 8), [lane] * 8))
        return _call(builder, "llvm.fma.v8f32", _V_F32x8, [sv, args[2], args[3]])
    return f32x8(f32x8, k, f32x8, f32x8), codegen


@intrinsic
def f32x8_lane(typingctx, v, k):
    """Lane k (a literal) of v."""
    if v != f32x8 or not isinstance(k, types.IntegerLiteral):
        return None
    lane = k.literal_value

    def codegen(context, builder, sig, args):
        return builder.extract_element(args[0], ir.Constant(_I32, lane))
    return types.float32(f32x8, k), codegen


@intrinsic
def wbytes(typingctx, w, wo, qh, kind):
    """The 32 values of one weight block as bytes (an i32x8 to reuse against several activations with ``wdot``):
    kind 0 Q4_0 (nibbles - 8), 1 Q4_1 (nibbles), 2 Q5_0 (5-bit - 16), 3 Q5_1 (5-bit), 4 Q8_0 (int8 as stored);
    ``qh`` the 32 high bits of the 5-bit formats (ignored otherwise)."""
    if not isinstance(kind, types.IntegerLiteral):
        return None
    kv = kind.literal_value

    def codegen(context, builder, sig, args):
        v32 = ir.VectorType(_I8, 32)
        if kv == 4:
            return builder.bitcast(_load(builder, _ptr(context, builder, sig.args[0], args[0], args[1], v32)), _V_I32x8)
        a = _nibbles32(builder, _load(builder, _ptr(context, builder, sig.args[0], args[0], args[1],
                                                  ir.VectorType(_I8, 16))))
        if kv in (2, 3):
            a = builder.or_(a, _high_bits(builder, context.cast(builder, args[2], sig.args[2], types.int32)))
        off = {0: 8, 1: 0, 2: 16, 3: 0}[kv]
        if off:
            a = builder.sub(a, ir.Constant(v32, [off] * 32))
        return builder.bitcast(a, _V_I32x8)
    return i32x8(w, types.intp, types.int64, kind), codegen


@intrinsic
def wdot(typingctx, a, x, xo, signed):
    """Eight int32 lanes of four products: the 32 weight bytes in ``a`` (from ``wbytes``; signed a literal bool:
    int8 values, else unsigned) times 32 int8 activations at byte xo of x."""
    if a != i32x8 or not isinstance(signed, types.BooleanLiteral):
        return None
    sg = signed.literal_value

    def codegen(context, builder, sig, args):
        v32 = ir.VectorType(_I8, 32)
        b = _load(builder, _ptr(context, builder, sig.args[1], args[1], args[2], v32))
        av = builder.bitcast(args[0], v32)
        return _sdot(builder, av, b) if sg else _udot(builder, av, b)
    return i32x8(i32x8, x, types.intp, signed), codegen


@intrinsic
def f16_bits(typingctx, x):
    """The F16 bit pattern of float32 x rounded to nearest even (vcvtps2ph), as an int32 in 0..65535."""
    def codegen(context, builder, sig, args):
        xv = context.cast(builder, args[0], sig.args[0], types.float32)
        h = builder.bitcast(builder.fptrunc(xv, ir.HalfType()), _I16)
        return builder.zext(h, _I32)
    return types.int32(x), codegen


# Signed weights against several activations: with exact unsigned products (VNNI's vpdpbusd, or the target-neutral
# form), an offset makes one operand unsigned instead of ggml's sign trick. The decode kernels offset the weights,
# sum (q + off) * x - off * sum(x) per lane, the activations' lane sums computed once per call (``lane_sums``); the
# prompt tiles offset the activations, sum q * (x + 128) - 128 * sum(q), once per weight block (``xdot``).
# pmaddubsw saturates at 255 times a byte, so AVX2 keeps the sign trick for Q8_0 (offset 128); Q4_0's and Q5_0's
# offsets (8, 16) leave pair sums of at most 2 * 31 * 127 < 32767, so they take the offset form there too.
UNSIGNED_OFFSET = VNNI or not AVX2


def offset_exact(off):
    """Whether weights offset by ``off`` into unsigned bytes give exact products with int8 activations here."""
    return UNSIGNED_OFFSET or off <= 16


@intrinsic
def wsum_neg128(typingctx, a):
    """-128 times the lane sums of the signed weight bytes in ``a`` (from ``wbytes``): the correction ``xdot`` starts
    from, computed once per weight block."""
    if a != i32x8:
        return None

    def codegen(context, builder, sig, args):
        v32 = ir.VectorType(_I8, 32)
        r = _udot(builder, ir.Constant(v32, [-128] * 32), builder.bitcast(args[0], v32))
        return builder.sub(ir.Constant(_V_I32x8, [0] * 8), r)
    return i32x8(a), codegen


@intrinsic
def xdot(typingctx, c, a, x, xo):
    """c plus eight int32 lanes of four products: the 32 activations at byte xo of x, stored as x + 128 (unsigned
    bytes: x ^ 0x80), times the signed weight bytes in ``a``. With c = ``wsum_neg128(a)`` the lanes are those of
    sum(x * q): the activation-offset form of the prompt tiles (``UNSIGNED_OFFSET``), one instruction per pair on
    VNNI, with no per-activation correction to load."""
    if c != i32x8 or a != i32x8:
        return None

    def codegen(context, builder, sig, args):
        v32 = ir.VectorType(_I8, 32)
        b = _load(builder, _ptr(context, builder, sig.args[2], args[2], args[3], v32))
        return _udot(builder, b, builder.bitcast(args[1], v32), args[0])
    return i32x8(i32x8, i32x8, x, types.intp), codegen




# ----------------------------------------------------------------------- weight rows as lanes (AVX-512 VNNI)
# The prompt tiles' transposed form (dot_q32._mv_rows16): sixteen weight rows side by side in a 512-bit register, lane
# r holding four bytes of row r, so that one vpdpbusd against four activation bytes broadcast to every lane gives
# ggml's lane l of sixteen (row, activation) pairs at once. Each lane is still one pair's exact integer lane, and
# each pair keeps its own fma chain per lane l (an accumulator per l, rows as lanes), so the float operations are
# ggml's, one for one. Only where the CPU has AVX-512 VNNI (elsewhere the one-row tiles run).
ROWS16 = VNNI and {"avx512vnni", "avx512bw", "avx512f"} <= _FEATS
_I32x16 = ir.VectorType(_I32, 16)


def _splat_any(builder, v, vecty):
    s = builder.insert_element(ir.Constant(vecty, None), v, ir.Constant(_I32, 0))
    return builder.shuffle_vector(s, s, ir.Constant(ir.VectorType(_I32, vecty.count), [0] * vecty.count))


@intrinsic
def i32x8_store(typingctx, arr, off, v):
    """The 32 bytes of v stored at byte ``off`` of arr's data (a uint8 array)."""
    if v != i32x8:
        return None

    def codegen(context, builder, sig, args):
        st = builder.store(args[2], _ptr(context, builder, sig.args[0], args[0], args[1], _V_I32x8))
        st.align = 1
        return context.get_dummy_value()
    return types.void(arr, types.intp, i32x8), codegen


@intrinsic
def i32x8_at(typingctx, arr, off):
    """The 32 bytes at byte ``off`` of arr's data (a uint8 array) as an i32x8 (``i32x8_store``'s load)."""
    def codegen(context, builder, sig, args):
        ld = builder.load(_ptr(context, builder, sig.args[0], args[0], args[1], _V_I32x8))
        ld.align = 1
        return ld
    return i32x8(arr, types.intp), codegen


@intrinsic
def i32x8_flip(typingctx, v):
    """Each byte of v xor 0x80: int8 q as the unsigned byte q + 128."""
    if v != i32x8:
        return None

    def codegen(context, builder, sig, args):
        return builder.xor(args[0], ir.Constant(_V_I32x8, [-0x7F7F7F80] * 8))
    return i32x8(i32x8), codegen


@intrinsic
def rows16_pairs2(typingctx, ws, wo, xq, i, xo, xls, lo, corr, dv0, dv1, acc):
    """One 32-value block of sixteen weight rows against activation rows i and i + 1: ``acc`` (sixteen f32x16, row
    i's lanes l = 0..7 then row i + 1's) gets fma(dv, float(lane l), acc[l]) per pair, dv0 / dv1 the rows' sixteen
    scales d_w * d_x. ws: the block's eight registers from byte wo (register l = the rows' unsigned bytes 4l..4l+3,
    ``dot_q32._rows16_prep``); the activations: bytes xo..xo + 31 of xq's rows. ``corr`` (a literal bool): add the
    activations' lane sums xls[i, lo + l] (the signed formats' offset: -off * the sum of the four activations)."""
    if not isinstance(corr, types.BooleanLiteral) or not isinstance(acc, types.UniTuple) or acc.count != 16:
        return None
    with_corr = corr.literal_value

    def codegen(context, builder, sig, args):
        wbase = _ptr(context, builder, sig.args[0], args[0], args[1], _I8)
        regs = [_load(builder, builder.bitcast(builder.gep(wbase, [ir.Constant(_I32, 64 * g)]), _I32x16.as_pointer()))
                for g in range(8)]
        xa = context.make_array(sig.args[2])(context, builder, args[2])
        xs0 = cgutils.unpack_tuple(builder, xa.strides, 2)[0]
        xbase = builder.bitcast(xa.data, _I8.as_pointer())
        la = context.make_array(sig.args[5])(context, builder, args[5])
        ls0 = cgutils.unpack_tuple(builder, la.strides, 2)[0]
        lbase = builder.bitcast(la.data, _I8.as_pointer())
        accs = list(cgutils.unpack_tuple(builder, args[10]))
        four = ir.Constant(args[6].type, 4)
        for c, dv in enumerate((args[8], args[9])):
            row = builder.add(args[3], ir.Constant(args[3].type, c))
            xp = builder.gep(xbase, [builder.add(builder.mul(row, xs0), args[4])])
            lp = builder.gep(lbase, [builder.add(builder.mul(row, ls0), builder.mul(args[6], four))])
            for g in range(8):
                x4 = _load(builder, builder.bitcast(builder.gep(xp, [ir.Constant(_I32, 4 * g)]), _I32.as_pointer()))
                start = ir.Constant(_I32x16, [0] * 16)
                if with_corr:   # the lane's offset correction as vpdpbusd's starting value (a broadcast load; a
                    l4 = _load(builder, builder.bitcast(builder.gep(lp, [ir.Constant(_I32, 4 * g)]),
                                                        _I32.as_pointer()))
                    start = _splat_any(builder, l4, _I32x16)    # vpaddd after it measured 12% slower)
                t = _call(builder, "llvm.x86.avx512.vpdpbusd.512", _I32x16,
                          [start, regs[g], _splat_any(builder, x4, _I32x16)])
                accs[8 * c + g] = _call(builder, "llvm.fma.v16f32", _F16x,
                                        [dv, builder.sitofp(t, _F16x), accs[8 * c + g]])
        return context.make_tuple(builder, sig.return_type, accs)
    return acc(ws, types.intp, xq, types.intp, types.intp, xls, types.intp, corr, f16l, f16l, acc), codegen


@intrinsic
def v16_tree8(typingctx, acc, k):
    """ggml's hsum_float_8 over accumulators 8k..8k+7 of ``acc``, lane by lane: ((a4 + a0) + (a6 + a2)) + ((a5 + a1) +
    (a7 + a3)), sixteen pairs' sums at once."""
    if not isinstance(k, types.IntegerLiteral) or not isinstance(acc, types.UniTuple):
        return None
    kv = k.literal_value

    def codegen(context, builder, sig, args):
        a = cgutils.unpack_tuple(builder, args[0])[8 * kv:8 * kv + 8]
        add = builder.fadd
        return add(add(add(a[4], a[0]), add(a[6], a[2])), add(add(a[5], a[1]), add(a[7], a[3])))
    return f16l(acc, k), codegen


@intrinsic
def v16_sub(typingctx, a, b):
    if a != f16l or b != f16l:
        return None

    def codegen(context, builder, sig, args):
        return builder.fsub(args[0], args[1])
    return f16l(f16l, f16l), codegen


@intrinsic
def nib_split_store(typingctx, src, so, dst, do):
    """The 32 bytes at byte so of src as 64 unsigned values at byte do of dst: their low nibbles, then their high
    nibbles (a Q4_K pair of sub-blocks, ``dot_kquant._q4k_rows16_prep``)."""
    def codegen(context, builder, sig, args):
        v32 = ir.VectorType(_I8, 32)
        q = _load(builder, _ptr(context, builder, sig.args[0], args[0], args[1], v32))
        lo = builder.and_(q, ir.Constant(v32, [15] * 32))
        hi = builder.lshr(q, ir.Constant(v32, [4] * 32))
        for part, add in ((lo, 0), (hi, 32)):
            at = builder.add(args[3], ir.Constant(args[3].type, add))
            st = builder.store(part, _ptr(context, builder, sig.args[2], args[2], at, v32))
            st.align = 1
        return context.get_dummy_value()
    return types.void(src, types.intp, dst, types.intp), codegen


@intrinsic
def q4k_rows16_pair(typingctx, ws, wo, xq, i, xo, scs, so, bp, bo, dv0, dv1, ev0, ev1, acc):
    """One pair of Q4_K sub-blocks (2p, 2p + 1) of sixteen weight rows (as lanes) against activation rows i and
    i + 1, in llama.cpp's gemm form: isum = sc_2p * (the 2p products) + sc_2p+1 * (the 2p+1 products), exact;
    acc[c] = fma(float(isum), dv_c, acc[c]) and, with imin = m_2p * bs_2p + m_2p+1 * bs_2p+1 (one vpmaddwd against
    the packed block-sum pair bp[i + c, bo]), acc[2 + c] = fma(float(imin), ev_c, acc[2 + c]). ws: the two
    sub-blocks' sixteen registers (eight each) from byte wo; the activations from byte xo of xq's rows; scs[so ..]:
    the sixteen rows' sc_2p, sc_2p+1 and packed mins (int32, sixteen each)."""
    if not isinstance(acc, types.UniTuple) or acc.count != 4:
        return None

    def codegen(context, builder, sig, args):
        wbase = _ptr(context, builder, sig.args[0], args[0], args[1], _I8)
        xa = context.make_array(sig.args[2])(context, builder, args[2])
        xs0 = cgutils.unpack_tuple(builder, xa.strides, 2)[0]
        xbase = builder.bitcast(xa.data, _I8.as_pointer())
        sbase = _ptr(context, builder, sig.args[5], args[5], builder.mul(args[6], ir.Constant(args[6].type, 4)),
                     _I32x16)
        sc = [_load(builder, builder.gep(sbase, [ir.Constant(_I32, t)])) for t in range(3)]
        ba = context.make_array(sig.args[7])(context, builder, args[7])
        bs0 = cgutils.unpack_tuple(builder, ba.strides, 2)[0]
        bbase = builder.bitcast(ba.data, _I8.as_pointer())
        accs = list(cgutils.unpack_tuple(builder, args[13]))
        w16 = ir.VectorType(_I16, 32)
        zero = ir.Constant(_I32x16, [0] * 16)
        for c in range(2):
            row = builder.add(args[3], ir.Constant(args[3].type, c))
            xp = builder.gep(xbase, [builder.add(builder.mul(row, xs0), args[4])])
            isum = None
            for h in range(2):
                ts = [zero, zero]     # two chains of four: eight dependent vpdpbusd made the loop wait on latency
                for g in range(8):
                    wv = _load(builder, builder.bitcast(builder.gep(wbase, [ir.Constant(_I32, 512 * h + 64 * g)]),
                                                        _I32x16.as_pointer()))
                    x4 = _load(builder, builder.bitcast(builder.gep(xp, [ir.Constant(_I32, 32 * h + 4 * g)]),
                                                        _I32.as_pointer()))
                    ts[g % 2] = _call(builder, "llvm.x86.avx512.vpdpbusd.512", _I32x16,
                                      [ts[g % 2], wv, _splat_any(builder, x4, _I32x16)])
                t = builder.mul(builder.add(ts[0], ts[1]), sc[h])
                isum = t if isum is None else builder.add(isum, t)
            bo = builder.mul(args[8], ir.Constant(args[8].type, 4))
            b4 = _load(builder, builder.bitcast(builder.gep(bbase, [builder.add(builder.mul(row, bs0), bo)]),
                                                _I32.as_pointer()))
            imin = _call(builder, "llvm.x86.avx512.pmaddw.d.512", _I32x16,
                         [builder.bitcast(sc[2], w16), builder.bitcast(_splat_any(builder, b4, _I32x16), w16)])
            accs[c] = _call(builder, "llvm.fma.v16f32", _F16x, [builder.sitofp(isum, _F16x), args[9 + c], accs[c]])
            accs[2 + c] = _call(builder, "llvm.fma.v16f32", _F16x,
                                [builder.sitofp(imin, _F16x), args[11 + c], accs[2 + c]])
        return context.make_tuple(builder, sig.return_type, accs)
    return acc(ws, types.intp, xq, types.intp, types.intp, scs, types.intp, bp, types.intp, f16l, f16l, f16l, f16l,
               acc), codegen


@intrinsic
def q6k_decode_store(typingctx, src, o, dst, do):
    """The 256 six-bit codes (0..63, unsigned: the values plus 32) of the Q6_K super-block at byte o of src, in k
    order at byte do of dst (ggml's dequantize_row_q6_K layout: ql's nibbles, qh's bit pairs)."""
    def codegen(context, builder, sig, args):
        v32 = ir.VectorType(_I8, 32)

        def c(v):
            return ir.Constant(v32, [v] * 32)

        def at(base, off):
            return builder.add(base, ir.Constant(base.type, off))
        for h in range(2):
            ql0 = _load(builder, _ptr(context, builder, sig.args[0], args[0], at(args[1], 64 * h), v32))
            ql1 = _load(builder, _ptr(context, builder, sig.args[0], args[0], at(args[1], 64 * h + 32), v32))
            qh = _load(builder, _ptr(context, builder, sig.args[0], args[0], at(args[1], 128 + 32 * h), v32))
            def high(shift):      # qh's bit pair at ``shift`` as bits 4-5
                return builder.shl(builder.and_(builder.lshr(qh, c(shift)), c(3)), c(4))
            parts = [builder.or_(builder.and_(ql0, c(15)), high(0)), builder.or_(builder.and_(ql1, c(15)), high(2)),
                     builder.or_(builder.lshr(ql0, c(4)), high(4)), builder.or_(builder.lshr(ql1, c(4)), high(6))]
            for m, v in enumerate(parts):
                st = builder.store(v, _ptr(context, builder, sig.args[2], args[2], at(args[3], 128 * h + 32 * m), v32))
                st.align = 1
        return context.get_dummy_value()
    return types.void(src, types.intp, dst, types.intp), codegen


@intrinsic
def q6k_rows16_sb(typingctx, ws, wo, xq, i, xo, scs, so, bs, bo, dw, xd0, xd1, acc):
    """One Q6_K super-block of sixteen weight rows (as lanes) against activation rows i and i + 1 in the tiled
    kernel's form (``dot_kquant_tiled``): s1 = sum over the sixteen sub-blocks of sc_j * (products of q - 32), exact (the
    unsigned codes' products, sc_j times each sub-block's, then -32 sc_j times the activations' block sums by
    vpdpwssd from the packed pairs at scs[so + 256 ..] and bs[i + c, bo ..]); r = float(s1) * d_w, acc[c] =
    fma(r, d_x, acc[c]). ws: sixty-four registers from byte wo (sub-block j's four at 256 j); scs[so ..]: the rows'
    sixteen scales (int32, sixteen each) then the eight packed pairs of -32 * scale."""
    if not isinstance(acc, types.UniTuple) or acc.count != 2:
        return None

    def codegen(context, builder, sig, args):
        wbase = _ptr(context, builder, sig.args[0], args[0], args[1], _I8)
        xa = context.make_array(sig.args[2])(context, builder, args[2])
        xs0 = cgutils.unpack_tuple(builder, xa.strides, 2)[0]
        xbase = builder.bitcast(xa.data, _I8.as_pointer())
        sbase = _ptr(context, builder, sig.args[5], args[5], builder.mul(args[6], ir.Constant(args[6].type, 4)),
                     _I32x16)
        ba = context.make_array(sig.args[7])(context, builder, args[7])
        bs0 = cgutils.unpack_tuple(builder, ba.strides, 2)[0]
        bbase = builder.bitcast(ba.data, _I8.as_pointer())
        accs = list(cgutils.unpack_tuple(builder, args[12]))
        zero = ir.Constant(_I32x16, [0] * 16)
        xps, bps, s1s = [], [], []
        for c in range(2):
            row = builder.add(args[3], ir.Constant(args[3].type, c))
            xps.append(builder.gep(xbase, [builder.add(builder.mul(row, xs0), args[4])]))
            bps.append(builder.gep(bbase, [builder.add(builder.mul(row, bs0),
                                                       builder.mul(args[8], ir.Constant(args[8].type, 2)))]))
            s1s.append(zero)
        # sub-block by sub-block, its four registers used for both activation rows right after their load (with the
        # rows outermost, LLVM kept all sixty-four loaded registers for the second row and spilled them)
        for j in range(16):
            wv = [_load(builder, builder.bitcast(builder.gep(wbase, [ir.Constant(_I32, 256 * j + 64 * g)]),
                                                 _I32x16.as_pointer())) for g in range(4)]
            sc = _load(builder, builder.gep(sbase, [ir.Constant(_I32, j)]))
            for c in range(2):
                t = zero
                for g in range(4):
                    x4 = _load(builder, builder.bitcast(builder.gep(xps[c], [ir.Constant(_I32, 16 * j + 4 * g)]),
                                                        _I32.as_pointer()))
                    t = _call(builder, "llvm.x86.avx512.vpdpbusd.512", _I32x16,
                              [t, wv[g], _splat_any(builder, x4, _I32x16)])
                s1s[c] = builder.add(s1s[c], builder.mul(t, sc))
        for c in range(2):
            bp, s1 = bps[c], s1s[c]
            for m in range(8):
                sp = _load(builder, builder.gep(sbase, [ir.Constant(_I32, 16 + m)]))
                b4 = _load(builder, builder.bitcast(builder.gep(bp, [ir.Constant(_I32, 4 * m)]), _I32.as_pointer()))
                s1 = _call(builder, "llvm.x86.avx512.vpdpwssd.512", _I32x16, [s1, sp, _splat_any(builder, b4, _I32x16)])
            r = builder.fmul(builder.sitofp(s1, _F16x), args[9])
            xdv = _splat_any(builder, context.cast(builder, args[10 + c], sig.args[10 + c], types.float32), _F16x)
            accs[c] = _call(builder, "llvm.fma.v16f32", _F16x, [r, xdv, accs[c]])
        return context.make_tuple(builder, sig.return_type, accs)
    return (acc(ws, types.intp, xq, types.intp, types.intp, scs, types.intp, bs, types.intp, f16l, xd0, xd1, acc),
            codegen)


# ----------------------------------------------------------------------- row sums of squares, eight rows as lanes
# ggml's norms sum each row's float32 squares in double, one after another: a chain of dependent additions per row.
# Eight rows side by side in a vector of doubles keep each row's chain, in its order, while eight rows advance per
# addition (the columns come from an 8 x 8 transpose of the squares).
_F64 = ir.DoubleType()
_D8 = ir.VectorType(_F64, 8)


class D8(types.Type):
    """Eight float64 lanes (a 512-bit register)."""
    def __init__(self):
        super().__init__(name="f64x8")


d8 = D8()


@register_model(D8)
class _D8Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _D8)


@intrinsic
def d8_zero(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(_D8, [0.0] * 8)
    return d8(), codegen


@intrinsic
def d8_lane(typingctx, v, k):
    """Lane k of v as a float64."""
    if v != d8:
        return None

    def codegen(context, builder, sig, args):
        return builder.extract_element(args[0], context.cast(builder, args[1], sig.args[1], types.int32))
    return types.float64(v, k), codegen


def _transpose8(builder, v):
    """Eight <8 x float> rows as eight columns (unpack, pair shuffle, half swap: 24 shuffles)."""
    def sh(a, b, idx):
        return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, 8), idx))
    lo, hi = [0, 8, 1, 9, 4, 12, 5, 13], [2, 10, 3, 11, 6, 14, 7, 15]
    a = [sh(v[2 * p], v[2 * p + 1], lo) for p in range(4)]
    b = [sh(v[2 * p], v[2 * p + 1], hi) for p in range(4)]
    pl, ph = [0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15]
    c = [sh(a[0], a[1], pl), sh(a[0], a[1], ph), sh(b[0], b[1], pl), sh(b[0], b[1], ph),
         sh(a[2], a[3], pl), sh(a[2], a[3], ph), sh(b[2], b[3], pl), sh(b[2], b[3], ph)]
    first, second = [0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]
    return ([sh(c[e], c[e + 4], first) for e in range(4)] + [sh(c[e], c[e + 4], second) for e in range(4)])


@intrinsic
def d8_add_squares(typingctx, x, r, j, acc):
    """acc (lane k: row r + k's running sum) plus float64(float32(x[r + k, c]²)) for c = j .. j + 7, one column
    after another: eight rows' chains of ggml's norm sum, each in its own order. x: a float32 2-D array with
    contiguous rows; rows r..r + 7 and columns j..j + 7 inside it."""
    if not isinstance(x, types.Array) or x.dtype != types.float32 or x.ndim != 2 or acc != d8:
        return None

    def codegen(context, builder, sig, args):
        xa = context.make_array(sig.args[0])(context, builder, args[0])
        s0 = cgutils.unpack_tuple(builder, xa.strides, 2)[0]
        base = builder.bitcast(xa.data, _I8.as_pointer())
        r = context.cast(builder, args[1], sig.args[1], types.intp)
        j4 = builder.mul(context.cast(builder, args[2], sig.args[2], types.intp), ir.Constant(s0.type, 4))
        rows = []
        for k in range(8):
            off = builder.add(builder.mul(builder.add(r, ir.Constant(r.type, k)), s0), j4)
            v = _load(builder, builder.bitcast(builder.gep(base, [off]), _V_F32x8.as_pointer()))
            rows.append(builder.fmul(v, v))
        acc = args[3]
        for col in _transpose8(builder, rows):
            acc = builder.fadd(acc, builder.fpext(col, _D8))
        return acc
    return d8(x, types.intp, types.intp, d8), codegen


@intrinsic
def i32_transpose16x8(typingctx, src, so, n, dst, do):
    """dst's int32 do + 16 c + r = src's int32 so + n r + c for r < 16, c < 8: eight int32 columns of sixteen rows
    (row r of src n int32 apart) as eight registers of sixteen lanes, one row per lane (two 8 x 8 transposes in
    shuffles, in place of 128 scalar moves). src, dst: uint8 arrays; so, do count int32."""
    if not all(isinstance(a, types.Array) for a in (src, dst)):
        return None

    def codegen(context, builder, sig, args):
        def base(i):
            a = context.make_array(sig.args[i])(context, builder, args[i])
            return builder.bitcast(a.data, _I32.as_pointer())
        sp, dp = base(0), base(3)
        so_, n_, do_ = (context.cast(builder, args[i], sig.args[i], types.intp) for i in (1, 2, 4))
        rows = [_load(builder, builder.bitcast(
            builder.gep(sp, [builder.add(so_, builder.mul(n_, ir.Constant(n_.type, r)))]), _V_I32x8.as_pointer()))
            for r in range(16)]
        top, bottom = _transpose8(builder, rows[:8]), _transpose8(builder, rows[8:])
        both = ir.Constant(ir.VectorType(_I32, 16), list(range(16)))
        for c in range(8):
            col = builder.shuffle_vector(top[c], bottom[c], both)
            st = builder.store(col, builder.bitcast(builder.gep(dp, [builder.add(do_, ir.Constant(do_.type, 16 * c))]),
                                                    _I32x16.as_pointer()))
            st.align = 1
        return context.get_dummy_value()
    return types.void(src, types.intp, types.intp, dst, types.intp), codegen
