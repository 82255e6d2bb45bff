"""llama.cpp's tiled k-quant matrix product (ggml-cpu/tiled/), bit for bit: the path its CPU backend takes for
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS and the grid formats (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M:
signed codes, 2 ls + 1 per 32 or 16 values, d times 1/8, 1/4 or 1, no min) weights that are not repacked (on
x86: all but Q4_K with rows % 8 == 0)
when the batch has at least ``TILED_MIN_ROWS`` activation rows (``mm_k_tiles``; on AVX-512 VNNI Q6_K's sixteen-row
form ``mm_q6_k_rows16``; ``mm_k_tiled``, the first form, for Q4_K / Q5_K / Q6_K: the same bits). Below that, and for one-token decode, llama.cpp runs
``ggml_vec_dot_*_q8_K`` per row (``dot_kquant_scalar``/``dot_kquant``).

The float order differs from vec_dot's, so the two give different last bits; Gemma 3's Q6_K ``ffn_down`` in a
prompt of eight or more tokens goes through this path in llama.cpp. Per (weight row, activation row) and per
256-value super-block, in k order (ggml's AVX-512 VNNI microkernel ``tiled_run_micro_vnni_8x16``, which x86 builds
with AVX512-VNNI/VL/DQ use):

    s1 = sum over sub-blocks of scale * (the sub-block's products)        exact int32
    s2 = sum over sub-blocks of min * (the activation's sub-block sum)    exact int32 (Q4_K, Q5_K)
    r  = float(s1) * d_w                        (Q6_K: the weight codes less 32; no min)
    r  = fma(-dmin_w, float(s2), r)             (Q4_K, Q5_K: _mm512_fnmadd_ps)
    out = fma(r, d_x, out)                      out starts at 0; GCC contracts the epilogue's add(mul) to an fma

(Checked against llama.cpp's own ``ffn_out`` of Gemma 3 layer 0 through its eval callback: identical; with an
unfused mul and add, half the values differ.) The integer sums are exact in any order; the kernel decodes each
super-block of a few weight rows once and reuses it for every activation row.

    # w: uint8 [rows, row_bytes] GGUF blocks; xq int8 [n, k], xd float32 [n, k/256], bsums int16 [n, k/16]
    # (``act_quant.act_split(x, Q8_K)``)  ->  out float32 [n, rows]
    mm_k_tiled(w, kind, xq, xd, bsums, out, tab)    # kind: 4 (Q4_K), 5 (Q5_K), 6 (Q6_K)
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ... import blocks as B
from .claims import claim, workers
from .dot_q32 import OUT_AHEAD, _f16, _store8, prefetch_write, rows16_transpose
from .dot_blocks import _abs8, _sign_of, f32x8_fmav, i32x8_sub, i32x8_zero
from .dot_kquant_scalar import _scale_min
from .dot_kquant import _bc_interleave, _madd, _maddubs, hsum8x_ir, i32x8_lane, k_mins_dot
from .simd import (AVX2, VNNI, _V_I32x8, _call, _elem_ptr, _load, _ptr, f16_at, f32x8_fma, f32x8_load,
                   f32x8_scale, f32x8_store, f32x8_zero, fma32, i32x8, i32x8_add, i32x8_load, i32x8_to_f32x8,
                   q6k_decode_store, q6k_rows16_sb, v16_load, v16_store, v16_zero)

# ggml_tiled_min_batch: llama.cpp takes the tiled path from this many src1 rows (ggml-cpu/tiled/tiled.cpp)
TILED_MIN_ROWS = 8
KINDS = {"Q4_K": 4, "Q5_K": 5, "Q6_K": 6}
_R = 8   # weight rows decoded together (one prange item)

_I32 = ir.IntType(32)
_H16 = ir.VectorType(ir.IntType(16), 16)
_L8 = ir.VectorType(_I32, 8)
KV_IQ4NL = B.KVALUES_IQ4NL.astype(np.int8).view(np.uint8)     # IQ4_XS's signed values as bytes


def _madd16(builder, acc, a, b):
    """acc + the eight int32 lanes of a pair of <16 x i16> vectors' products, neighbours summed: vpdpwssd on VNNI
    (one instruction), vpmaddwd + vpaddd on AVX2, else target-neutral IR. Exact: |w| <= 4096, |x| <= 128."""
    if VNNI:
        return _call(builder, "llvm.x86.avx512.vpdpwssd.256", _L8,
                     [acc, builder.bitcast(a, _L8), builder.bitcast(b, _L8)])
    if AVX2:
        p = _call(builder, "llvm.x86.avx2.pmadd.wd", _L8, [a, b])
    else:
        w32 = ir.VectorType(_I32, 16)
        q = builder.mul(builder.sext(a, w32), builder.sext(b, w32))
        p = builder.add(builder.shuffle_vector(q, q, ir.Constant(_L8, list(range(0, 16, 2)))),
                        builder.shuffle_vector(q, q, ir.Constant(_L8, list(range(1, 16, 2)))))
    return builder.add(acc, p)


@intrinsic
def dot256_i16(typingctx, w, wo, x, xo):
    """The int32 sum of 256 int16 products: w's elements from element wo, x's from element xo (flat, C-contiguous),
    summed in eight lanes (``_madd16``), reduced at the end."""
    def codegen(context, builder, sig, args):
        acc = ir.Constant(_L8, [0] * 8)
        wb = builder.mul(args[1], ir.Constant(args[1].type, 2))   # byte offsets
        xb = builder.mul(args[3], ir.Constant(args[3].type, 2))
        for c in range(16):
            step = ir.Constant(wb.type, 32 * c)
            a = _load(builder, _ptr(context, builder, sig.args[0], args[0], builder.add(wb, step), _H16))
            b = _load(builder, _ptr(context, builder, sig.args[2], args[2], builder.add(xb, step), _H16))
            acc = _madd16(builder, acc, a, b)
        return _call(builder, "llvm.vector.reduce.add.v8i32", _I32, [acc])
    return types.int32(w, types.intp, x, types.intp), codegen


@intrinsic
def dot256_x8(typingctx, w, x, xo):
    """Lane t = the int32 sum of the 256 int16 products of row t of w (8 x 256, C-contiguous) and x's elements
    xo .. xo + 255: eight weight rows against one activation super-block, each 16-value piece of x loaded once for
    the eight rows (``dot256_i16`` per row loaded both operands for every product: two loads per vpmaddwd). The eight
    sums are reduced together (``dot_kquant.hsum8x_ir``; integer sums: exact in any order)."""
    def codegen(context, builder, sig, args):
        zero = ir.Constant(_L8, [0] * 8)
        accs = [zero] * 8
        xb = builder.mul(args[2], ir.Constant(args[2].type, 2))
        for c in range(16):
            xv = _load(builder, _ptr(context, builder, sig.args[1], args[1],
                                     builder.add(xb, ir.Constant(xb.type, 32 * c)), _H16))
            for t in range(8):
                wv = _load(builder, _ptr(context, builder, sig.args[0], args[0],
                                         ir.Constant(xb.type, 512 * t + 32 * c), _H16))
                accs[t] = _madd16(builder, accs[t], wv, xv)
        return hsum8x_ir(builder, accs)
    return i32x8(w, x, types.intp), codegen


@njit(cache=True, inline="always")
def _decode_q6_k(row, b, wq):
    """Super-block b of a Q6_K row: wq[e] = scale(e) * (q[e] - 32) (no mins)."""
    o = b * 210
    for h in range(2):
        ql = o + h * 64
        qh = o + 128 + h * 32
        for l in range(32):
            hb = np.int32(row[qh + l])
            lo = np.int32(row[ql + l])
            hi = np.int32(row[ql + 32 + l])
            e = h * 128 + l
            wq[e] = (lo & 15) | ((hb & 3) << 4)
            wq[e + 32] = (hi & 15) | (((hb >> 2) & 3) << 4)
            wq[e + 64] = (lo >> 4) | (((hb >> 4) & 3) << 4)
            wq[e + 96] = (hi >> 4) | (((hb >> 6) & 3) << 4)
    for e in range(256):
        wq[e] = np.int32(np.int8(row[o + 192 + e // 16])) * (np.int32(wq[e]) - 32)


@njit(cache=True, inline="always")
def _decode_q45_k(row, b, wq, mins, five):
    """Super-block b of a Q4_K (five=False) or Q5_K row: wq[e] = scale(e) * q[e], mins[s] per 32-value sub-block."""
    o = b * (176 if five else 144)
    qs = o + (48 if five else 16)
    for j in range(4):
        for l in range(32):
            v = np.int32(row[qs + j * 32 + l])
            lo = v & 15
            hi = v >> 4
            if five:
                hb = np.int32(row[o + 16 + l])
                lo |= ((hb >> (2 * j)) & 1) << 4
                hi |= ((hb >> (2 * j + 1)) & 1) << 4
            wq[j * 64 + l] = lo
            wq[j * 64 + 32 + l] = hi
    for s in range(8):
        sc, m = _scale_min(row, o + 4, s)
        mins[s] = m
        for e in range(s * 32, s * 32 + 32):
            wq[e] = sc * np.int32(wq[e])


@njit(parallel=True, cache=True, nogil=True)
def mm_k_tiled(w, kind, xq, xd, bsums, out, tab):
    rows = w.shape[0]
    n = xq.shape[0]
    k = xq.shape[1]
    nb = k // 256
    x16 = xq.astype(np.int16)
    for c in prange((rows + _R - 1) // _R):
        r0 = c * _R
        nr = min(_R, rows - r0)
        wq = np.empty((_R, 256), np.int16)
        mins = np.zeros((_R, 8), np.int32)
        dw = np.empty(_R, np.float32)
        mw = np.empty(_R, np.float32)
        for i in range(n):
            for t in range(nr):
                out[i, r0 + t] = 0
        for b in range(nb):
            for t in range(nr):
                row = w[r0 + t]
                if kind == 6:
                    _decode_q6_k(row, b, wq[t])
                    dw[t] = _f16(tab, row, b * 210 + 208)
                else:
                    o = b * (176 if kind == 5 else 144)
                    _decode_q45_k(row, b, wq[t], mins[t], kind == 5)
                    dw[t] = _f16(tab, row, o)
                    mw[t] = _f16(tab, row, o + 2)
            for i in range(n):
                if nr == _R:       # a full chunk: the eight rows' integer sums in one pass over the activations
                    s8 = dot256_x8(wq, x16, i * k + b * 256)
                for t in range(nr):
                    if nr == _R:
                        s1 = i32x8_lane(s8, t)
                    else:
                        s1 = dot256_i16(wq, t * 256, x16, i * k + b * 256)
                    r = np.float32(np.float32(s1) * dw[t])
                    if kind != 6:
                        s2 = np.int32(0)
                        for s in range(8):
                            s2 += mins[t, s] * (np.int32(bsums[i, b * 16 + 2 * s]) +
                                                np.int32(bsums[i, b * 16 + 2 * s + 1]))
                        r = fma32(-mw[t], np.float32(s2), r)
                    out[i, r0 + t] = fma32(r, xd[i, b], out[i, r0 + t])


# ------------------------------------------------------------- Q6_K, sixteen weight rows as lanes (AVX-512)

# Super-blocks per pass of the sixteen-row kernels over the activation rows: 16 KiB of expanded weights, which
# stay in L1 (32 KiB) with the activations beside them; a whole 2048-value row (32 KiB) did not.
ROWS16_SB_CHUNK = 4


@njit(cache=True, inline="always")
def _q6k_rows16_prep(w, r0, nr, nb, tmp, ws, scs, dws):
    """Weight rows r0 .. r0 + nr - 1 (nr <= 16; the arrays come zeroed, so missing rows stay zeros) for
    ``q6k_rows16_sb``: ws[4096 b + 64 q + 4 r + t] = code 4 q + t of row r's super-block b (the values plus 32);
    scs[b, j, r] = scale j (j < 16), then scs[b, 16 + m, r] = the pair (-32 sc_2m) | (-32 sc_2m+1) << 16; dws[b, r]
    = d."""
    for b in range(nb):
        o = b * 210
        for r in range(nr):
            wr = w[r0 + r]
            q6k_decode_store(wr, o, tmp, 256 * r)
            for j in range(16):
                scs[b, j, r] = np.int32(np.int8(wr[o + 192 + j]))
            for m in range(8):
                lo = -32 * np.int32(np.int8(wr[o + 192 + 2 * m]))
                hi = -32 * np.int32(np.int8(wr[o + 193 + 2 * m]))
                scs[b, 16 + m, r] = (lo & 0xFFFF) | (hi << 16)
            dws[b, r] = f16_at(wr, o + 208)
        rows16_transpose(tmp, ws, 1024 * b, 64)


@njit(parallel=True, cache=True, nogil=True)
def mm_q6_k_rows16(w, xq, xd, bsums, out, n2):
    """Activation rows 0 .. n2 (even) of ``mm_k_tiled`` for Q6_K where the CPU has AVX-512 VNNI: sixteen weight rows
    as the lanes of 512-bit registers (decoded and transposed once per call) by two activation rows, each super-block
    the tiled kernel's exact s1 and its two float operations (``q6k_rows16_sb``), so the same bits."""
    rows = w.shape[0]
    nb = xq.shape[1] // 256
    for g in prange((rows + 15) // 16):
        r0 = 16 * g
        nr = min(16, rows - r0)
        tmp = np.zeros(16 * 256, np.uint8)
        ws = np.empty(nb * 4096, np.uint8)
        scs = np.zeros((nb, 24, 16), np.int32)
        dws = np.zeros((nb, 16), np.float32)
        part = np.empty((n2, 16), np.float32)    # the running sums between super-block chunks
        _q6k_rows16_prep(w, r0, nr, nb, tmp, ws, scs, dws)
        sflat = scs.reshape(-1)
        for b0 in range(0, nb, ROWS16_SB_CHUNK):     # the chunk's weights stay in L1 for all activation rows
            b1 = min(nb, b0 + ROWS16_SB_CHUNK)
            for i in range(0, n2, 2):
                if b0 == 0:
                    z = v16_zero()
                    acc = (z, z)
                else:
                    acc = (v16_load(part[i], 0), v16_load(part[i + 1], 0))
                for b in range(b0, b1):
                    acc = q6k_rows16_sb(ws, 4096 * b, xq, i, 256 * b, sflat, 384 * b, bsums, 16 * b,
                                        v16_load(dws[b], 0), xd[i, b], xd[i + 1, b], acc)
                v16_store(part[i], 0, acc[0])
                v16_store(part[i + 1], 0, acc[1])
        for i in range(n2):
            if nr == 16:
                if i + OUT_AHEAD < n2:
                    prefetch_write(out, i + OUT_AHEAD, r0)
                v16_store(out[i], r0, v16_load(part[i], 0))
            else:
                for r in range(nr):
                    out[i, r0 + r] = part[i, r]


# ------------------------------------------------------------- eight activation rows as lanes (any x86 width)
# ``mm_k_tiles``: the tiled kernel's float order for Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS, ggml's AVX2 microkernel
# (tiled_run_microtile_avx2) laid out for Numba. A group of eight weight rows is decoded once per call into byte codes
# (the values, or the values plus a bias for Q3_K / Q6_K and the grid formats) and sixteen int16 scales per super-block;
# then for eight activation rows at a time and each super-block, one pass over the 32-byte pieces: the weight piece
# loaded once, for each activation row ``madd(maddubs(w, x), scales)`` into its own accumulator (IQ4_XS: ggml's sign
# trick, its signed values), the eight accumulators reduced together so that lane c is activation row c's s1. The bias
# (Q3_K: 4, Q6_K: 32, the grid formats: GRID_BIAS) comes off s1 as sum(scale * bias * the activations' 16-value sums),
# the mins term s2 (Q2_K, Q4_K, Q5_K) likewise from the block sums: integers, exact in any order. The float steps per
# super-block are the tiled kernel's, eight activation rows a vector: r = f32(s1) * d_w; r = fma(-dmin_w, f32(s2), r);
# out = fma(r, d_x, out) from 0 in k order.
TILES = {"Q2_K": 2, "Q3_K": 3, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6, "IQ4_XS": 7,
         "IQ2_XXS": 8, "IQ2_XS": 9, "IQ2_S": 10, "IQ3_XXS": 11, "IQ3_S": 12, "IQ1_S": 13, "IQ1_M": 14}
# the grid formats' block bytes (blocks.BLOCKS), by kind
_GRID_BYTES = (66, 74, 82, 98, 110, 50, 56)
# the grid formats' codes are their values (|v| <= 62: IQ3_XXS's grid, 4 .. 62) plus this bias, unsigned bytes
# 2 .. 126 that take maddubs(w, x) as the unsigned formats do (no saturation: 2 * 126 * 127 < 2^15), the bias coming
# off s1 as Q3_K's does (mt16 = bias * scale against the 16-value sums): the same integers as the sign trick
# maddubs(|w|, sign(x, w)), one vpsignb fewer per activation row and 32-byte piece (IQ3_XXS's 576 x 1536 product
# at n = 512, one thread: 13.8 -> 9.8 ms, ggml's 10.3-11.1)
GRID_BIAS = 64
TILES_ROWS = 8      # weight rows per work item (their codes, 8 x k bytes, stay in L1 beside eight activation rows)
_V32 = ir.VectorType(ir.IntType(8), 32)
_V2H = ir.VectorType(ir.IntType(16), 2)


def _rows8(context, builder, aty, a, j, last, off):
    """Byte pointers to ``off`` in rows min(j + c, last), c < 8, of the 2-D array ``a`` (the tiles' eight
    activation rows; the last row repeated past the end)."""
    ity = context.get_value_type(types.intp)
    arr = context.make_array(aty)(context, builder, a)
    s0 = cgutils.unpack_tuple(builder, arr.strides, 2)[0]
    base = builder.bitcast(arr.data, ir.IntType(8).as_pointer())
    out = []
    for c in range(8):
        jc = builder.add(j, ir.Constant(ity, c))
        jc = builder.select(builder.icmp_signed(">", jc, last), last, jc)
        out.append(builder.gep(base, [builder.add(builder.mul(jc, s0), off)]))
    return out


def _tile8(signed):
    """An intrinsic: lane c = the int32 sum over one super-block of the codes at byte ``co`` of ``codes`` (256
    bytes) times activation row min(j + c, last) of xq from byte xo, each 16-value half of a 32-byte piece times
    its int16 scale (sc16[so + 2p], sc16[so + 2p + 1] for piece p). The codes are unsigned bytes (``maddubs(w,
    x)``), or, ``signed``, signed values through ggml's sign trick ``maddubs(|w|, sign(x, w))`` (exact: Q8_K's
    codes lie in -127..127, and |w| <= 127)."""
    @intrinsic
    def tile8(typingctx, codes, co, sc16, so, xq, j, last, xo):
        def codegen(context, builder, sig, args):
            ity = context.get_value_type(types.intp)
            co_, so_, j_, last_, xo_ = (context.cast(builder, args[i], sig.args[i], types.intp)
                                        for i in (1, 3, 5, 6, 7))
            xp = _rows8(context, builder, sig.args[4], args[4], j_, last_, xo_)
            accs = [None] * 8
            for p in range(8):
                wv = _load(builder, _ptr(context, builder, sig.args[0], args[0],
                                         builder.add(co_, ir.Constant(ity, 32 * p)), _V32))
                s2 = _load(builder, _ptr(context, builder, sig.args[2], args[2],
                                         builder.mul(builder.add(so_, ir.Constant(ity, 2 * p)), ir.Constant(ity, 2)),
                                         _V2H))
                scv = builder.shuffle_vector(s2, s2, ir.Constant(ir.VectorType(_I32, 16), [0] * 8 + [1] * 8))
                aw = _abs8(builder, wv) if signed else wv     # |w| once for the eight activation rows
                for c in range(8):
                    xv = _load(builder, builder.bitcast(builder.gep(xp[c], [ir.Constant(ity, 32 * p)]),
                                                        _V32.as_pointer()))
                    if signed:
                        xv = _sign_of(builder, xv, wv)
                    v = _madd(builder, _maddubs(builder, aw, xv), scv)
                    accs[c] = v if accs[c] is None else builder.add(accs[c], v)
            return hsum8x_ir(builder, accs)
        return i32x8(codes, types.intp, sc16, types.intp, xq, types.intp, types.intp, types.intp), codegen
    return tile8


tile8_u = _tile8(False)
tile8_s = _tile8(True)


@intrinsic
def tile8_m(typingctx, mt, mo, bs, j, last, bo):
    """Lane c = sum over s < 16 of mt[mo + s] * bs[min(j + c, last), bo + s] (int16 terms, int32 sum: the mins or
    the bias times the scales against the activations' 16-value sums)."""
    def codegen(context, builder, sig, args):
        ity = context.get_value_type(types.intp)
        mo_, j_, last_, bo_ = (context.cast(builder, args[i], sig.args[i], types.intp) for i in (1, 3, 4, 5))
        m = _load(builder, _elem_ptr(context, builder, sig.args[0], args[0], mo_, _H16))
        rows = _rows8(context, builder, sig.args[2], args[2], j_, last_, builder.mul(bo_, ir.Constant(ity, 2)))
        accs = [_madd(builder, m, _load(builder, builder.bitcast(p, _H16.as_pointer()))) for p in rows]
        return hsum8x_ir(builder, accs)
    return i32x8(mt, types.intp, bs, types.intp, types.intp, types.intp), codegen


@njit(cache=True, inline="always")
def _tiles_decode(kind, row, b, codes, co, sc16, mt16, so, dd, dm, di):
    """Super-block b of a weight row into the tiles' layout: 256 codes at codes[co:], sixteen scales (one per 16
    values) at sc16[so:], the mins or bias terms at mt16[so:], d and dmin at dd[di], dm[di]."""
    if kind == 2:                               # Q2_K: 84 bytes, scales/mins[16], qs[64], d, dmin
        o = b * 84
        for p in range(8):
            q = o + 16 + 32 * (p >> 2)
            sh = 2 * (p & 3)
            for l in range(32):
                codes[co + 32 * p + l] = (row[q + l] >> sh) & 3
        for s in range(16):
            v = np.int16(row[o + s])
            sc16[so + s] = v & 15
            mt16[so + s] = v >> 4
        dd[di] = f16_at(row, o + 80)
        dm[di] = f16_at(row, o + 82)
    elif kind == 3:                             # Q3_K: 110 bytes, hmask[32], qs[64], scales[12], d; codes q + 4
        o = b * 110
        for p in range(8):
            q = o + 32 + 32 * (p >> 2)
            sh = 2 * (p & 3)
            hs = 4 * (p >> 2) + (p & 3)
            for l in range(32):
                codes[co + 32 * p + l] = ((row[q + l] >> sh) & 3) | (((row[o + l] >> hs) & 1) << 2)
        for s in range(16):
            lo = (np.int16(row[o + 96 + (s & 7)]) >> (4 * (s >> 3))) & 15
            hi = (np.int16(row[o + 104 + (s & 3)]) >> (2 * (s >> 2))) & 3
            sc = (lo | (hi << 4)) - 32
            sc16[so + s] = sc
            mt16[so + s] = 4 * sc
        dd[di] = f16_at(row, o + 108)
    elif kind == 4 or kind == 5:                # Q4_K: 144 bytes, Q5_K: 176 (qh[32] before qs)
        five = kind == 5
        o = b * (176 if five else 144)
        qs = o + (48 if five else 16)
        for jj in range(4):
            for l in range(32):
                v = row[qs + 32 * jj + l]
                lo = v & 15
                hi = v >> 4
                if five:
                    hb = row[o + 16 + l]
                    lo |= ((hb >> (2 * jj)) & 1) << 4
                    hi |= ((hb >> (2 * jj + 1)) & 1) << 4
                codes[co + 64 * jj + l] = lo
                codes[co + 64 * jj + 32 + l] = hi
        for s in range(8):
            sc, m = _scale_min(row, o + 4, s)
            sc16[so + 2 * s] = sc
            sc16[so + 2 * s + 1] = sc
            mt16[so + 2 * s] = m
            mt16[so + 2 * s + 1] = m
        dd[di] = f16_at(row, o)
        dm[di] = f16_at(row, o + 2)
    elif kind == 6:                             # Q6_K: 210 bytes, ql[128], qh[64], scales[16] (int8), d; codes q + 32
        o = b * 210
        for h in range(2):
            ql = o + h * 64
            qh = o + 128 + h * 32
            e0 = co + h * 128
            for l in range(32):
                hb = row[qh + l]
                lo = row[ql + l]
                hi = row[ql + 32 + l]
                codes[e0 + l] = (lo & 15) | ((hb & 3) << 4)
                codes[e0 + 32 + l] = (hi & 15) | (((hb >> 2) & 3) << 4)
                codes[e0 + 64 + l] = (lo >> 4) | (((hb >> 4) & 3) << 4)
                codes[e0 + 96 + l] = (hi >> 4) | (((hb >> 6) & 3) << 4)
        for s in range(16):
            sc = np.int16(np.int8(row[o + 192 + s]))
            sc16[so + s] = sc
            mt16[so + s] = 32 * sc
        dd[di] = f16_at(row, o + 208)
    elif kind >= 8:                             # the grid formats: values + GRID_BIAS, one scale per 16, no min
        _grid_decode(kind, row, b * _GRID_BYTES[kind - 8], codes, co, sc16, so, dd, di)
        for s in range(16):
            mt16[so + s] = GRID_BIAS * sc16[so + s]
    else:                                       # IQ4_XS: 136 bytes, d, scales_h, scales_l[4], qs[128]; signed values
        o = b * 136
        for g in range(8):
            q = o + 8 + 16 * g
            for l in range(16):
                v = row[q + l]
                codes[co + 32 * g + l] = KV_IQ4NL[v & 15]
                codes[co + 32 * g + 16 + l] = KV_IQ4NL[v >> 4]
            lo = (np.int16(row[o + 4 + (g >> 1)]) >> (4 * (g & 1))) & 15
            hi = ((np.int16(row[o + 2]) | (np.int16(row[o + 3]) << 8)) >> (2 * g)) & 3
            sc = (lo | (hi << 4)) - 32
            sc16[so + 2 * g] = sc
            sc16[so + 2 * g + 1] = sc
        dd[di] = f16_at(row, o)


@njit(cache=True, inline="always")
def _put8(codes, co, grid, gi, n, signs, v0):
    """n signed values of grid entry gi at codes[co..] plus GRID_BIAS (value v0 + j negated where its sign bit is
    set)."""
    for j in range(n):
        v = np.int32(grid[gi, j])
        codes[co + j] = np.uint8((-v if (signs >> (v0 + j)) & 1 else v) + GRID_BIAS)


@njit(cache=True, inline="always")
def _grid_decode(kind, row, o, codes, co, sc16, so, dd, di):
    """A grid format's super-block at byte o of the row, as llama.cpp's tiled unpack makes it
    (ggml-cpu/tiled/tiled.cpp): the values (grid entry times its signs; IQ1_S / IQ1_M: 8 * grid + delta, delta
    -/+1) plus GRID_BIAS as codes, 2 ls + 1 per 32 or 16 values (sc16: one per 16), d = F16 d times 1/8 (IQ3_XXS: 1/4,
    IQ3_S: 1; exact products)."""
    if kind == 13 or kind == 14:                # IQ1_S, IQ1_M
        for g in range(8):
            for c in range(4):
                if kind == 13:
                    gi = B.iq1_s_grid_idx(row, o, g, c)
                    neg = B.iq1_s_neg(row, o, g)
                else:
                    gi = B.iq1_m_grid_idx(row, o, g, c)
                    neg = B.iq1_m_neg(row, o, g, c)
                delta = -1 if neg else 1
                for j in range(8):
                    codes[co + 32 * g + 8 * c + j] = np.uint8(8 * np.int32(B.IQ1S_GRID[gi, j]) + delta + GRID_BIAS)
            for h in range(2):
                ls = B.iq1_s_ls(row, o, g) if kind == 13 else B.iq1_m_ls(row, o, g, h)
                sc16[so + 2 * g + h] = 2 * ls + 1
        dd[di] = np.float32((B.f16_at(row, o) if kind == 13 else B.iq1_m_d(row, o)) * np.float32(0.125))
        return
    for g in range(8):
        if kind == 8:                           # IQ2_XXS: 8 values per grid entry, a scale per 32
            sg = B.iq2_xxs_signs(row, o, g)
            for c in range(4):
                _put8(codes, co + 32 * g + 8 * c, B.IQ2XXS_GRID, B.iq2_xxs_grid_idx(row, o, g, c), 8, sg, 8 * c)
            sc16[so + 2 * g] = sc16[so + 2 * g + 1] = 2 * B.iq2_xxs_ls(row, o, g, 0) + 1
        elif kind == 9 or kind == 10:           # IQ2_XS, IQ2_S: a scale per 16
            sg = B.iq2_xs_signs(row, o, g) if kind == 9 else B.iq2_s_signs(row, o, g)
            for c in range(4):
                if kind == 9:
                    _put8(codes, co + 32 * g + 8 * c, B.IQ2XS_GRID, B.iq2_xs_grid_idx(row, o, g, c), 8, sg, 8 * c)
                else:
                    _put8(codes, co + 32 * g + 8 * c, B.IQ2S_GRID, B.iq2_s_grid_idx(row, o, g, c), 8, sg, 8 * c)
            for h in range(2):
                ls = B.iq2_xs_ls(row, o, g, h) if kind == 9 else B.iq2_s_ls(row, o, g, h)
                sc16[so + 2 * g + h] = 2 * ls + 1
        elif kind == 11:                        # IQ3_XXS: 4 values per grid entry, a scale per 32
            sg = B.iq3_xxs_signs(row, o, g)
            for c in range(8):
                _put8(codes, co + 32 * g + 4 * c, B.IQ3XXS_GRID, B.iq3_xxs_grid_idx(row, o, g, c), 4, sg, 4 * c)
            sc16[so + 2 * g] = sc16[so + 2 * g + 1] = 2 * B.iq3_xxs_ls(row, o, g, 0) + 1
        else:                                   # IQ3_S
            sg = B.iq3_s_signs(row, o, g)
            for c in range(8):
                _put8(codes, co + 32 * g + 4 * c, B.IQ3S_GRID, B.iq3_s_grid_idx(row, o, g, c), 4, sg, 4 * c)
            sc16[so + 2 * g] = sc16[so + 2 * g + 1] = 2 * B.iq3_s_ls(row, o, g, 0) + 1
    f = np.float32(0.25) if kind == 11 else (np.float32(1.0) if kind == 12 else np.float32(0.125))
    dd[di] = np.float32(B.f16_at(row, o) * f)


@njit(parallel=True, cache=True, nogil=True)
def mm_k_tiles(w, kind, xq, xd, bsums, out, xdt, counter, n_workers):
    """out[i, r] for every activation row i (xq int8 [n, k], xd [n, k/256], bsums int16 [n, k/16]: Q8_K) and
    weight row r, in the tiled kernel's order (see above); ``xdt`` = xd transposed, [k/256, n rounded up to 8]
    (its padding anything finite). Work items: groups of TILES_ROWS weight rows, claimed from ``counter`` (int64,
    zeroed) by ``n_workers`` workers (``claims``)."""
    rows = w.shape[0]
    n, k = xq.shape
    nb = k // 256
    ng = (rows + TILES_ROWS - 1) // TILES_ROWS
    last = n - 1
    for _ in prange(n_workers):
        codes = np.empty(TILES_ROWS * k, np.uint8)
        sc16 = np.zeros(TILES_ROWS * nb * 16, np.int16)
        mt16 = np.zeros(TILES_ROWS * nb * 16, np.int16)
        dd = np.zeros(TILES_ROWS * nb, np.float32)
        dm = np.zeros(TILES_ROWS * nb, np.float32)
        res = np.empty(8, np.float32)
        while True:
            g = claim(counter)
            if g >= ng:
                break
            r0 = g * TILES_ROWS
            nr = min(TILES_ROWS, rows - r0)
            for t in range(nr):
                row = w[r0 + t]
                for b in range(nb):
                    _tiles_decode(kind, row, b, codes, t * k + 256 * b, sc16, mt16,
                                  (t * nb + b) * 16, dd, dm, t * nb + b)
            for j in range(0, n, 8):
                nc = min(8, n - j)
                for t in range(nr):
                    acc = f32x8_zero()
                    for b in range(nb):
                        so = (t * nb + b) * 16
                        if kind == 7:
                            s1 = tile8_s(codes, t * k + 256 * b, sc16, so, xq, j, last, 256 * b)
                        else:
                            s1 = tile8_u(codes, t * k + 256 * b, sc16, so, xq, j, last, 256 * b)
                        if kind == 3 or kind == 6 or kind >= 8:
                            s1 = i32x8_sub(s1, tile8_m(mt16, so, bsums, j, last, 16 * b))
                        r = f32x8_scale(i32x8_to_f32x8(s1), dd[t * nb + b])
                        if kind == 2 or kind == 4 or kind == 5:
                            r = f32x8_fma(-dm[t * nb + b], i32x8_to_f32x8(tile8_m(mt16, so, bsums, j, last, 16 * b)), r)
                        acc = f32x8_fmav(r, f32x8_load(xdt[b], j), acc)
                    f32x8_store(res, 0, acc)
                    for c in range(nc):
                        out[j + c, r0 + t] = res[c]


# ------------------------------------------------------------- Q6_K, eight activation rows as lanes (broadcast)
# ``mm_q6_k_bc``: Q6_K's tiled order (above) from BC6_MIN activation rows, in the broadcast form of
# ``dot_kquant._bc_tiles``: eight activation rows as the lanes (interleaved once per call), each weight row's codes
# (the values plus 32) decoded once per call, per four values the row's four broadcast against the interleaved
# activations (maddubs; two of a 16-value group's four pair sums added in 16 bits, |sum| <= 2 * 2 * 63 * 127 <
# 2^15), one madd with the group's scale; the bias 32 * scale off s1 through the 16-value block sums (madd), as
# ``tile8_m``. The lanes are the activation rows' s1 directly (no ``hsum8x`` per super-block), the same float steps
# per super-block: r = f32(s1) * d_w, out = fma(r, d_x, out). Super-blocks in spans of BC6_SPAN (the span's
# activations and weights stay in L1; the running sums kept between spans).
BC6_MIN = 16
BC6_CHUNK = 16
BC6_SPAN = 4


@intrinsic
def q6k_bc_blk2(typingctx, wd, wo0, wo1, xi, xo0, xo1, sc, so0, so1, acc4):
    """One 32-value block of two decoded Q6_K weight rows (32 codes at bytes wo0, wo1 of wd) against two blocks of
    eight interleaved activation rows (the block's 256 bytes from xo0 and xo1 of xi); the rows' two scales of the
    block packed as two int16 at elements so0, so1 of the int32 ``sc``. ``acc4`` plus four i32x8: (row 0, rows at
    xo0), (row 0, xo1), (row 1, xo0), (row 1, xo1), lane a = the exact sum of scale * code * x. (A whole
    super-block per call compiled to a block LLVM scheduled with hundreds of spills: 1.5x slower.)"""
    def codegen(context, builder, sig, args):
        wty, wa, xty, xa, sty, sa = sig.args[0], args[0], sig.args[3], args[3], sig.args[6], args[6]
        wos, xos, sos = (args[1], args[2]), (args[4], args[5]), (args[7], args[8])
        _W16 = ir.VectorType(ir.IntType(16), 16)
        a4 = cgutils.unpack_tuple(builder, args[9], 4)
        acc = [[a4[0], a4[1]], [a4[2], a4[3]]]
        for m in range(2):              # the block's two 16-value scale groups, four-value groups 4 m .. 4 m + 3
            scv = []
            for r in range(2):
                q = _load(builder, _elem_ptr(context, builder, sty, sa,
                                             builder.add(sos[r], ir.Constant(sos[r].type, m)), _I32))
                v = builder.insert_element(ir.Constant(_V_I32x8, None), q, ir.Constant(_I32, 0))
                scv.append(builder.bitcast(builder.shuffle_vector(v, v, ir.Constant(_V_I32x8, [0] * 8)), _W16))
            for half in range(2):
                s16 = [[None, None], [None, None]]
                for t in range(2):
                    g = 4 * m + 2 * half + t
                    xoff = 32 * g
                    xv = [_load(builder, _ptr(context, builder, xty, xa, builder.add(xo, ir.Constant(xo.type, xoff)),
                                              _V32)) for xo in xos]
                    for r in range(2):
                        at = builder.add(wos[r], ir.Constant(wos[r].type, 16 * m + 8 * half + 4 * t))
                        q = _load(builder, _ptr(context, builder, wty, wa, at, _I32))
                        v = builder.insert_element(ir.Constant(_V_I32x8, None), q, ir.Constant(_I32, 0))
                        wv = builder.bitcast(builder.shuffle_vector(v, v, ir.Constant(_V_I32x8, [0] * 8)), _V32)
                        for a in range(2):
                            p = _maddubs(builder, wv, xv[a])
                            s16[r][a] = p if s16[r][a] is None else builder.add(s16[r][a], p)
                for r in range(2):
                    for a in range(2):
                        acc[r][a] = builder.add(acc[r][a], _madd(builder, s16[r][a], scv[r]))
        return context.make_tuple(builder, sig.return_type, [acc[0][0], acc[0][1], acc[1][0], acc[1][1]])
    sig = types.UniTuple(i32x8, 4)(wd, types.intp, types.intp, xi, types.intp, types.intp, sc, types.intp,
                                   types.intp, types.UniTuple(i32x8, 4))
    return sig, codegen


@njit(cache=True, inline="always")
def _bc6_decode(w, r0, r1, nb, wd, wsc, wmt, wdd):
    """Rows r0 .. r1 - 1 for ``q6k_bc_sb2``: codes of row rr = r - r0, super-block b at byte (rr nb + b) 256 of wd;
    wsc[rr, 16 b + m] = scale m as two int16; wmt[rr, 8 b + q] = 32 sc_2q | 32 sc_2q+1 << 16 (the bias, for
    ``k_mins_dot``); wdd[rr, b] = d."""
    for r in range(r0, r1):
        wr = w[r]
        rr = r - r0
        for b in range(nb):
            o = b * 210
            q6k_decode_store(wr, o, wd, (rr * nb + b) * 256)
            for m in range(16):
                sc = np.int32(np.int8(wr[o + 192 + m]))
                wsc[rr, 16 * b + m] = (sc & 0xFFFF) | (sc << 16)
            for q in range(8):
                lo = 32 * np.int32(np.int8(wr[o + 192 + 2 * q]))
                hi = 32 * np.int32(np.int8(wr[o + 193 + 2 * q]))
                wmt[rr, 8 * b + q] = (lo & 0xFFFF) | (hi << 16)
            wdd[rr, b] = f16_at(wr, o + 208)


@njit(cache=True, inline="always")
def _bc6_bias(wmt, rr, b, bpT, i):
    """Lanes a = sum over the sixteen 16-value groups of super-block b of 32 * scale * (activation row i + a's sum
    of the group), for rows i .. i + 7 (bpT: the sums packed in pairs, transposed)."""
    t = k_mins_dot(i32x8_load(bpT[8 * b], i), wmt[rr, 8 * b])
    for q in range(1, 8):
        t = i32x8_add(t, k_mins_dot(i32x8_load(bpT[8 * b + q], i), wmt[rr, 8 * b + q]))
    return t


@njit(parallel=True, cache=True, nogil=True)
def mm_q6_k_bc(w, xq, xd, bsums, out, n16):
    """Activation rows 0 .. n16 - 1 (n16 % 16 == 0) of ``mm_k_tiles`` for Q6_K, in the broadcast form (above):
    tiles of two weight rows by sixteen activation rows. Same bits."""
    rows = w.shape[0]
    k = xq.shape[1]
    nb = k // 256
    xdT = np.ascontiguousarray(xd[:n16].T)
    bp = np.empty((n16, nb * 8), np.int32)
    for i in prange(n16):
        for t in range(nb * 8):
            bp[i, t] = (np.int32(bsums[i, 2 * t]) & 0xFFFF) | (np.int32(bsums[i, 2 * t + 1]) << 16)
    bpT = np.ascontiguousarray(bp.T)
    xi = np.empty(n16 * k, np.int8)
    _bc_interleave(xq, n16, xi)
    ns = k // 32
    r2 = rows - rows % 2
    for c in prange((r2 + BC6_CHUNK - 1) // BC6_CHUNK):
        r0 = c * BC6_CHUNK
        r1 = min(r2, r0 + BC6_CHUNK)
        wd = np.empty(BC6_CHUNK * nb * 256, np.uint8)
        wsc = np.empty((BC6_CHUNK, nb * 16), np.int32)
        wmt = np.empty((BC6_CHUNK, nb * 8), np.int32)
        wdd = np.empty((BC6_CHUNK, nb), np.float32)
        part = np.empty((BC6_CHUNK, 16), np.float32)
        wscf = wsc.reshape(-1)
        _bc6_decode(w, r0, r1, nb, wd, wsc, wmt, wdd)
        for i in range(0, n16, 16):
            x0 = (i // 8) * ns * 256
            x1 = x0 + ns * 256
            for b0 in range(0, nb, BC6_SPAN):
                b1 = min(nb, b0 + BC6_SPAN)
                for r in range(r0, r1, 2):
                    rr = r - r0
                    if b0 == 0:
                        a00 = a01 = a10 = a11 = f32x8_zero()
                    else:
                        a00, a01 = f32x8_load(part[rr], 0), f32x8_load(part[rr], 8)
                        a10, a11 = f32x8_load(part[rr + 1], 0), f32x8_load(part[rr + 1], 8)
                    for b in range(b0, b1):
                        wo = (rr * nb + b) * 256
                        so = (rr * nb + b) * 16
                        z = i32x8_zero()
                        v = (z, z, z, z)
                        for j in range(8):
                            v = q6k_bc_blk2(wd, wo + 32 * j, wo + nb * 256 + 32 * j, xi, x0 + 2048 * b + 256 * j,
                                            x1 + 2048 * b + 256 * j, wscf, so + 2 * j, so + nb * 16 + 2 * j, v)
                        v00, v01, v10, v11 = v
                        xv0, xv1 = f32x8_load(xdT[b], i), f32x8_load(xdT[b], i + 8)
                        a00 = f32x8_fmav(f32x8_scale(i32x8_to_f32x8(i32x8_sub(v00, _bc6_bias(wmt, rr, b, bpT, i))),
                                                     wdd[rr, b]), xv0, a00)
                        a01 = f32x8_fmav(f32x8_scale(i32x8_to_f32x8(i32x8_sub(v01, _bc6_bias(wmt, rr, b, bpT, i + 8))),
                                                     wdd[rr, b]), xv1, a01)
                        a10 = f32x8_fmav(f32x8_scale(i32x8_to_f32x8(i32x8_sub(v10, _bc6_bias(wmt, rr + 1, b, bpT, i))),
                                                     wdd[rr + 1, b]), xv0, a10)
                        a11 = f32x8_fmav(f32x8_scale(i32x8_to_f32x8(i32x8_sub(v11, _bc6_bias(wmt, rr + 1, b, bpT,
                                                                                              i + 8))),
                                                     wdd[rr + 1, b]), xv1, a11)
                    if b1 < nb:
                        f32x8_store(part[rr], 0, a00)
                        f32x8_store(part[rr], 8, a01)
                        f32x8_store(part[rr + 1], 0, a10)
                        f32x8_store(part[rr + 1], 8, a11)
                    else:
                        _store8(out, i, r, a00)
                        _store8(out, i + 8, r, a01)
                        _store8(out, i, r + 1, a10)
                        _store8(out, i + 8, r + 1, a11)


def _mm_tiles(w, kind, xq, xd, bsums, out):
    n = xq.shape[0]
    xdt = np.zeros((xd.shape[1], -(-n // 8) * 8), np.float32)
    xdt[:, :n] = xd.T
    mm_k_tiles(w, kind, xq, xd, bsums, out, xdt, np.zeros(1, np.int64), workers(-(-w.shape[0] // TILES_ROWS)))


def mul_mat_tiles(w, name, xq, xd, bsums, out):
    """``mm_k_tiles`` for a weight of format ``name`` (a key of TILES) against Q8_K activations (act_split's
    buffers), out float32 [n, rows] with contiguous rows; Q6_K from BC6_MIN rows in the broadcast form
    (``mm_q6_k_bc``) for whole steps of sixteen activation rows and pairs of weight rows."""
    n = xq.shape[0]
    if name == "Q6_K" and n >= BC6_MIN:
        n16 = n - n % 16
        mm_q6_k_bc(w, xq, xd, bsums, out, n16)
        r2 = w.shape[0] - w.shape[0] % 2
        if r2 < w.shape[0]:       # the odd last weight row (into a contiguous buffer: mm_k_tiles' one signature)
            last = np.empty((n16, w.shape[0] - r2), np.float32)
            _mm_tiles(w[r2:], TILES[name], xq[:n16], xd[:n16], bsums[:n16], last)
            out[:n16, r2:] = last
        if n16 < n:
            _mm_tiles(w, TILES[name], xq[n16:], xd[n16:], bsums[n16:], out[n16:])
        return
    _mm_tiles(w, TILES[name], xq, xd, bsums, out)
