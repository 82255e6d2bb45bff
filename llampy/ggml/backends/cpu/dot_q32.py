"""Numba integer dot products on raw GGUF blocks of the 32-value formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0).

Each kernel computes out[i, r] = dot(w[r], x[i]) for the activation rows already quantized by ``act_quant``
(xq int8 [n, k], xd float32 [n, k/32], xs = Q8_1's s), with the arithmetic of llama.cpp's x86 build
(ggml-cpu/arch/x86/quants.c, ``ggml_vec_dot_*`` AVX2 form, which the AVX-512 build also runs): per block, eight
int32 lanes, lane l = the sum of the four products of elements 4l..4l+3 (``mul_sum_i8_pairs_float``);
``acc[l] = fma(d_w * d_x, lane[l], acc[l])``; at the end ``hsum_float_8(acc)`` (+ ``summs`` for Q4_1/Q5_1, where
``summs = fma(m_w, s_x, summs)`` block after block). Integer sums are exact in any order; every float operation
is in ggml's order, so the results are bit-identical to llama.cpp's (docs/architecture.md says why that matters).

The lanes and accumulators are scalar locals (no heap arrays in the inner loop); ``fastmath={"contract"}`` lets
LLVM fuse ``d * lane + acc`` into the same fused multiply-add that ggml's ``_mm256_fmadd_ps`` does. Rows are
handed to the threads in chunks of ``ROW_CHUNK``.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .act_quant import q8_0_split
from .claims import claim, workers
from .simd import (HOST_VEC_LANES, ROWS16, UNSIGNED_OFFSET, f32x8_add, f32x8_hsum8, wsum_neg128, xdot, f16_at, f32x8_fma_s, f32x8_store,
                   f32x8_lane, f32x8_load, f32x8_scale, wbytes, wdot, dot_s8_s8, dot_u4_s8, dot_u5_s8, dot_u5_s8_bc,
                   f32x8_fma, f32x8_hsum, f32x8_zero,
                   fma32, i32_transpose16x8, i32x8_flip, i32x8_store, i32x8_to_f32x8, rows16_pairs2, v16_add, v16_fma, v16_geglu,
                   v16_load, v16_mul, v16_scale, v16_silu, v16_store, v16_tree8, v16_zero)

# fp16 bits -> float32, as a table (256 KiB): the scales are read with one lookup
F16_TABLE = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)

ROW_CHUNK = 16
# From this many activation rows (a multiple of 8) the prompt tiles hold sixteen weight rows as lanes
# (``_mv_rows16``): they transpose the weights once per call, which at 8 rows (eight parallel decodes) made them
# 13-27% slower than the one-row tiles for Q4_1 and Q8_0; at 16 even, at 32 0.63-0.78 (entry 51).
ROWS16_MIN_N = 16
# Q8_0's prompt tiles of sixteen activation rows (``_tile16``) where the CPU has 32 vector registers (AVX-512); with
# AVX2's sixteen, their sixteen accumulators and a block's operands spilled to the stack on every block, and the
# tiles of eight activation rows (``_tile8``) are faster: Q8_0 3072 x 1024 at n = 512, one thread, 51.4 -> 49.3 ms CPU.
# (Q5_0's five-bit decode, made once per weight block for all the tile's pairs, pays for the spills: 16 rows stay.)
TILE16 = HOST_VEC_LANES == 16
# Blocks of the weight rows the eight-row tiles take at a time, every row of a chunk against the same eight activation
# rows: a span of the rows (16 x 544 bytes) and of the activations (4 KiB) stay in the 32 KiB first-level cache
# across the chunk's rows; whole rows at k = 4608 did not (Q8_0 1024 x 4608, n = 512, one thread: 88.5 -> 79.2 ms CPU
# with spans of 32). Spans of 16 / 32 / 64 blocks, one thread, CPU ms: 1024 x 2048 33.1 / 34.7 / 35.8, 2048 x 8192
# 274.3 / 279.6 / 293.6, 4608 x 1024 74.5 / 74.6 / 75.1.
KSPAN = 16
PREFETCH_ROWS = 4   # rows ahead to prefetch: a kernel this slow leaves the hardware prefetchers idle otherwise


def _prefetch(builder, ptr, write):
    """llvm.prefetch of the i32x8* ``ptr`` (keep in all cache levels; for writing when ``write``)."""
    i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
    fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
    fn = builder.module.globals.get("llvm.prefetch.p0i8") or ir.Function(builder.module, fnty, "llvm.prefetch.p0i8")
    builder.call(fn, [ptr, ir.Constant(i32, int(write)), ir.Constant(i32, 3), ir.Constant(i32, 1)])


@intrinsic
def prefetch_byte(typingctx, arr, off):
    """llvm.prefetch (read, keep in all cache levels) of the byte ``off`` past the start of arr's data (any rank).
    A prefetch never faults; callers still keep ``off`` inside the array."""
    sig = types.void(arr, types.intp)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        i8p = ir.IntType(8).as_pointer()
        _prefetch(builder, builder.gep(builder.bitcast(ary.data, i8p), [args[1]]), False)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def prefetch_write(typingctx, arr, i, j):
    """llvm.prefetch for writing of element (i, j) of a 2-D float32 array: the tiles store one cache line per output
    row, rows apart, a pattern the hardware prefetchers do not follow; asking for the line a few rows ahead hides
    the read-for-ownership of an output buffer that is no longer in cache. Callers keep (i, j) inside arr."""
    sig = types.void(arr, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        s0 = cgutils.unpack_tuple(builder, ary.strides, 2)[0]
        i8p = ir.IntType(8).as_pointer()
        off = builder.add(builder.mul(args[1], s0), builder.mul(args[2], ir.Constant(s0.type, 4)))
        _prefetch(builder, builder.gep(builder.bitcast(ary.data, i8p), [off]), True)
        return context.get_dummy_value()
    return sig, codegen


OUT_AHEAD = 8   # activation rows ahead whose output line is prefetched for writing


@njit(cache=True, inline="always")
def prefetch_row(w, r):
    """Ask for row r + PREFETCH_ROWS of w, all of it at once, while row r is computed: the prompt tiles' form,
    which reuse each row for many activation rows (decode kernels spread theirs: ``prefetch_step``)."""
    rn = r + PREFETCH_ROWS
    if rn < w.shape[0]:
        s0 = w.strides[0]
        for p in range(rn * s0, rn * s0 + w.shape[1], 64):
            prefetch_byte(w, p)


# Decode kernels stream the weights once; the rows PREFETCH_AHEAD ahead of the ones being computed are asked for a
# piece per block step (``prefetch_step``), so the requests are spread over the compute instead of issued in one
# burst per row group. Measured on Gemma 3's 178 MB Q8_0 output matrix (benchmarks/README.md, entry 27): 2 threads
# 10.6 -> 29 GB/s; 4 rows ahead 25.6, 8 rows 29.1, 16 rows 23.9.
PREFETCH_AHEAD = 8


@njit(cache=True, inline="always")
def prefetch_base(w, r):
    """(byte offset of row r + PREFETCH_AHEAD, offset of w's last byte): the arguments of ``prefetch_step``."""
    s0 = w.strides[0]
    last = w.shape[0] * s0 - 1
    return min(last, (r + PREFETCH_AHEAD) * s0), last


@njit(cache=True, inline="always")
def prefetch_step(w, base, b, step):
    """Block step b's piece of the prefetch: the cache lines of bytes base + b * step .. + step (step: the bytes a
    step computes on, a compile-time constant, so that this unrolls to a few prefetch instructions)."""
    a = base[0] + b * step
    for j in range((step + 63) // 64 + 1):
        prefetch_byte(w, min(base[1], a + 64 * j))


@njit(cache=True, inline="always")
def _f16(tab, row, o):
    return tab[np.int32(row[o]) | (np.int32(row[o + 1]) << 8)]


@njit(cache=True, inline="always")
def _qh(wr, o):
    return (np.int64(wr[o]) | (np.int64(wr[o + 1]) << 8) | (np.int64(wr[o + 2]) << 16)
            | (np.int64(wr[o + 3]) << 24))


# Block formats of the kernel below (``kind``: loop-invariant, so LLVM unswitches the loops on it)
K_Q4_0, K_Q4_1, K_Q5_0, K_Q5_1, K_Q8_0 = 0, 1, 2, 3, 4


@njit(cache=True, inline="always")
def _block_bytes(kind):
    if kind == K_Q8_0:
        return 34
    return 18 if kind == K_Q4_0 else (20 if kind == K_Q4_1 else (22 if kind == K_Q5_0 else 24))


@njit(cache=True, inline="always")
def _block(kind, tab, wr, b, xr, xdb, xsb, xlr, acc, summs):
    """One block of ggml_vec_dot_<kind>_q8_{0,1} (AVX2 form): the eight int32 lanes (exact integers), then
    acc = fma(d_w * d_x, lanes, acc); for the formats with a min, summs = fma(m_w, s_x, summs). xlr: the
    activation row's ``lane_sums`` (the signed formats' offset form, see simd._signed_lanes)."""
    xo = b * 32
    if kind == K_Q8_0:
        o = b * 34
        lanes = dot_s8_s8(wr, o + 2, xr, xo, xlr, b * 8)
    elif kind == K_Q4_0:           # nibbles - 8
        o = b * 18
        lanes = dot_u4_s8(wr, o + 2, xr, xo, 8, xlr, b * 8)
    elif kind == K_Q4_1:           # unsigned nibbles
        o = b * 20
        lanes = dot_u4_s8(wr, o + 4, xr, xo, 0, xlr, 0)
        summs = fma32(f16_at(wr, o + 2), xsb, summs)
    elif kind == K_Q5_0:           # (nibble | qh bit << 4) - 16
        o = b * 22
        lanes = dot_u5_s8_bc(wr, o + 6, _qh(wr, o + 2), xr, xo, 16, xlr, b * 8)
    else:                          # Q5_1: unsigned 5-bit values
        o = b * 24
        lanes = dot_u5_s8(wr, o + 8, _qh(wr, o + 4), xr, xo, 0, xlr, 0)
        summs = fma32(f16_at(wr, o + 2), xsb, summs)
    d = np.float32(f16_at(wr, o) * xdb)
    return f32x8_fma(d, i32x8_to_f32x8(lanes), acc), summs


@njit(cache=True)
def lane_sums(xq, off, out):
    """out[i, 8b + l] = -off * (the sum of activations 32b + 4l .. 32b + 4l + 3 of row i): what the unsigned-offset
    form of the signed formats adds in the decode kernels (simd.UNSIGNED_OFFSET, ``simd._signed_lanes``)."""
    n, k = xq.shape
    for i in range(n):
        for g in range(k // 4):
            o = 4 * g
            out[i, g] = -off * (np.int32(xq[i, o]) + np.int32(xq[i, o + 1]) + np.int32(xq[i, o + 2]) +
                               np.int32(xq[i, o + 3]))


@njit(cache=True, inline="always")
def _signed(kind):
    """The formats whose values are signed (no min): Q8_0, Q4_0, Q5_0."""
    return kind == K_Q8_0 or kind == K_Q4_0 or kind == K_Q5_0


@njit(cache=True, inline="always")
def _offset(kind):
    """What the unsigned-offset form adds to a signed format's values (``lane_sums``)."""
    return 128 if kind == K_Q8_0 else (8 if kind == K_Q4_0 else 16)


@njit(cache=True, inline="always")
def _act_offset(kind):
    """Whether the prompt tiles take the activation-offset form (``_row8_off``): a signed format whose products with
    the activations plus 128 (unsigned bytes up to 255) stay exact. With VNNI's vpdpbusd (32-bit sums) every one;
    with AVX2's vpmaddubsw, whose pair sums saturate at 16 bits, Q4_0 and Q5_0 (|q| <= 16: 2 * 255 * 16 < 32767)
    but not Q8_0, which keeps ggml's sign trick. Measured on an AVX2 host (benchmarks/README.md): the sign trick per
    pair made Q4_0's tiles 1.4x Q4_1's time."""
    return _signed(kind) and (UNSIGNED_OFFSET or kind != K_Q8_0)


@njit(cache=True, inline="always")
def _offset_lane_sums(kind, xq):
    """The activations' ``lane_sums`` where the decode kernels use the weight-offset form (a signed format where it
    is exact, ``simd.offset_exact``: everywhere for Q4_0 and Q5_0, Q8_0 with ``UNSIGNED_OFFSET``), else an unused
    (n, 1) placeholder. Must agree with ``simd._signed_lanes``, which loads them."""
    n, k = xq.shape
    if _signed(kind) and (UNSIGNED_OFFSET or kind != K_Q8_0):
        xls = np.empty((n, k // 4), np.int32)
        lane_sums(xq, _offset(kind), xls)
        return xls
    return np.empty((n, 1), np.int32)


@njit(cache=True, inline="always")
def _group_activations(kind, xq, n8):
    """The activation rows 0 .. n8 regrouped for the tiles: xg[g, b, 32 j : 32 j + 32] = block b of row 16 g + j
    (plus 128, as unsigned bytes, where the tiles use the activation-offset form), so that a tile's pairs read
    their blocks at constant offsets from one pointer (the rows' own layout needed a pointer step per pair)."""
    n, k = xq.shape
    nb = k // 32
    ng = (n8 + 15) // 16
    xg = np.zeros((ng, nb, 512), np.int8)
    flip = _act_offset(kind)
    for i in prange(n8):              # on all threads: a serial pass here left the other core idle
        _group_row(xg, xq, i, flip)
    return xg


@njit(cache=True, inline="always")
def _group_row(xg, xq, i, flip):
    """Activation row i into its place in ``_group_activations``' layout (xg[i // 16, b, 32 (i % 16) ...])."""
    g, j = i // 16, i % 16
    xr = xq[i]
    for b in range(xg.shape[1]):
        dst = xg[g, b]
        for e in range(32):
            v = xr[32 * b + e]
            dst[32 * j + e] = v ^ np.int8(-128) if flip else v


@njit(cache=True, inline="always")
def _wblock(kind, wr, b, unsigned):
    """Block b of weight row wr decoded once for a tile's pairs (``wbytes``): its 32 values as bytes. ``unsigned`` (a
    literal): the signed formats as unsigned bytes, their values plus the offset (``_offset``: Q4_0's nibbles are q +
    8, Q5_0's five bits q + 16, Q8_0's q ^ 0x80), for the sixteen-row tiles; Q4_1 and Q5_1 are unsigned either way."""
    if kind == K_Q8_0:
        q = wbytes(wr, b * 34 + 2, 0, 4)
        return i32x8_flip(q) if unsigned else q
    if kind == K_Q4_0:
        return wbytes(wr, b * 18 + 2, 0, 1) if unsigned else wbytes(wr, b * 18 + 2, 0, 0)
    if kind == K_Q4_1:
        return wbytes(wr, b * 20 + 4, 0, 1)
    if kind == K_Q5_0:
        o = b * 22
        return wbytes(wr, o + 6, _qh(wr, o + 2), 3) if unsigned else wbytes(wr, o + 6, _qh(wr, o + 2), 2)
    o = b * 24
    return wbytes(wr, o + 8, _qh(wr, o + 4), 3)


@njit(cache=True, inline="always")
def _row8_off(kind, wr, b, xb, j0, dvr, a0, a1, a2, a3, a4, a5, a6, a7):
    """``_row8`` for the signed formats (Q4_0, Q5_0, Q8_0) in the activation-offset form: the activations are stored
    plus 128 as unsigned bytes (``_group_activations``), and each pair's lanes start from the block's -128 * (lane
    sums of q), computed once for the eight pairs (``xdot``). The same integer lanes."""
    q = _wblock(kind, wr, b, False)
    c = wsum_neg128(q)
    a0 = f32x8_fma(dvr[0], i32x8_to_f32x8(xdot(c, q, xb, (j0 + 0) * 32)), a0)
    a1 = f32x8_fma(dvr[1], i32x8_to_f32x8(xdot(c, q, xb, (j0 + 1) * 32)), a1)
    a2 = f32x8_fma(dvr[2], i32x8_to_f32x8(xdot(c, q, xb, (j0 + 2) * 32)), a2)
    a3 = f32x8_fma(dvr[3], i32x8_to_f32x8(xdot(c, q, xb, (j0 + 3) * 32)), a3)
    a4 = f32x8_fma(dvr[4], i32x8_to_f32x8(xdot(c, q, xb, (j0 + 4) * 32)), a4)
    a5 = f32x8_fma(dvr[5], i32x8_to_f32x8(xdot(c, q, xb, (j0 + 5) * 32)), a5)
    a6 = f32x8_fma(dvr[6], i32x8_to_f32x8(xdot(c, q, xb, (j0 + 6) * 32)), a6)
    a7 = f32x8_fma(dvr[7], i32x8_to_f32x8(xdot(c, q, xb, (j0 + 7) * 32)), a7)
    return a0, a1, a2, a3, a4, a5, a6, a7


@njit(cache=True, inline="always")
def _pairs8(q, xb, j0, dvr, signed, a0, a1, a2, a3, a4, a5, a6, a7):
    """The decoded weight block q against the blocks of activation rows j0..j0+7 of a group (xb: one block of
    sixteen rows side by side, ``_group_activations``), each pair's lanes fma'd with its scale dvr[k] (``signed``:
    a literal, the block's values are int8 rather than unsigned)."""
    a0 = f32x8_fma(dvr[0], i32x8_to_f32x8(wdot(q, xb, (j0 + 0) * 32, signed)), a0)
    a1 = f32x8_fma(dvr[1], i32x8_to_f32x8(wdot(q, xb, (j0 + 1) * 32, signed)), a1)
    a2 = f32x8_fma(dvr[2], i32x8_to_f32x8(wdot(q, xb, (j0 + 2) * 32, signed)), a2)
    a3 = f32x8_fma(dvr[3], i32x8_to_f32x8(wdot(q, xb, (j0 + 3) * 32, signed)), a3)
    a4 = f32x8_fma(dvr[4], i32x8_to_f32x8(wdot(q, xb, (j0 + 4) * 32, signed)), a4)
    a5 = f32x8_fma(dvr[5], i32x8_to_f32x8(wdot(q, xb, (j0 + 5) * 32, signed)), a5)
    a6 = f32x8_fma(dvr[6], i32x8_to_f32x8(wdot(q, xb, (j0 + 6) * 32, signed)), a6)
    a7 = f32x8_fma(dvr[7], i32x8_to_f32x8(wdot(q, xb, (j0 + 7) * 32, signed)), a7)
    return a0, a1, a2, a3, a4, a5, a6, a7


@njit(cache=True, inline="always")
def _row8(kind, wr, b, xb, j0, dvr, xsb, a0, a1, a2, a3, a4, a5, a6, a7, sv):
    """One block of one weight row against eight activation rows (j0..j0+7 of a group): the block decoded once, the
    eight mins (Q4_1, Q5_1) as one vector fma; each pair's lanes fma'd with its own scale dvr[k] = d_w * d_x
    (``_tile8``) exactly as the one-pair form does."""
    q = _wblock(kind, wr, b, False)
    if not _signed(kind):          # Q4_1, Q5_1: the min at byte 2 of the block
        sv = f32x8_fma_s(f16_at(wr, b * _block_bytes(kind) + 2), xsb, sv)
    if _signed(kind):
        a0, a1, a2, a3, a4, a5, a6, a7 = _pairs8(q, xb, j0, dvr, True, a0, a1, a2, a3, a4, a5, a6, a7)
    else:
        a0, a1, a2, a3, a4, a5, a6, a7 = _pairs8(q, xb, j0, dvr, False, a0, a1, a2, a3, a4, a5, a6, a7)
    return a0, a1, a2, a3, a4, a5, a6, a7, sv


@njit(cache=True, inline="always")
def _tile8(kind, wr, r, xg, xdT, xsT, i, b0, b1, nb, out, dvb, ab):
    """Weight row r against activation rows i..i+7 (xg: their group, ``_group_activations``, rows i % 16 .. of it),
    blocks b0 .. b1 of the row's nb: the pairs' accumulators (eight, and the min term's) start from ab (9, 8) where
    b0 > 0 and are left there where b1 < nb (``KSPAN``); at b1 == nb the dot products go to out. The eight scales
    d_w * d_x of every block are computed first into dvb (nb, 8), so that each pair's scale is then a broadcast load,
    folded into its fma, instead of a lane shuffle per pair and block."""
    j0 = i % 16
    bb = _block_bytes(kind)
    for b in range(b0, b1):
        f32x8_store(dvb[b], 0, f32x8_scale(f32x8_load(xdT[b], i), f16_at(wr, b * bb)))
    if b0 == 0:
        a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = f32x8_zero()
        sv = f32x8_zero()
    else:
        a0, a1, a2, a3 = f32x8_load(ab[0], 0), f32x8_load(ab[1], 0), f32x8_load(ab[2], 0), f32x8_load(ab[3], 0)
        a4, a5, a6, a7 = f32x8_load(ab[4], 0), f32x8_load(ab[5], 0), f32x8_load(ab[6], 0), f32x8_load(ab[7], 0)
        sv = f32x8_load(ab[8], 0)
    for b in range(b0, b1):
        if _act_offset(kind):
            a0, a1, a2, a3, a4, a5, a6, a7 = _row8_off(kind, wr, b, xg[b], j0, dvb[b], a0, a1, a2, a3, a4, a5, a6, a7)
        else:
            a0, a1, a2, a3, a4, a5, a6, a7, sv = _row8(kind, wr, b, xg[b], j0, dvb[b], f32x8_load(xsT[b], i),
                                                       a0, a1, a2, a3, a4, a5, a6, a7, sv)
    if b1 == nb:
        _store8(out, i, r, f32x8_add(f32x8_hsum8(a0, a1, a2, a3, a4, a5, a6, a7), sv))
    else:
        f32x8_store(ab[0], 0, a0)
        f32x8_store(ab[1], 0, a1)
        f32x8_store(ab[2], 0, a2)
        f32x8_store(ab[3], 0, a3)
        f32x8_store(ab[4], 0, a4)
        f32x8_store(ab[5], 0, a5)
        f32x8_store(ab[6], 0, a6)
        f32x8_store(ab[7], 0, a7)
        f32x8_store(ab[8], 0, sv)


@njit(cache=True, inline="always")
def _store8(out, i, r, v):
    """out[i + k, r] = lane k of v: the eight pairs' dot products, ``f32x8_hsum`` of each accumulator plus its min
    term (``f32x8_hsum8`` computes the eight sums as one transposed reduction, the same additions in the same tree:
    5-8% of a Q4_1 or Q5_0 tile's time at k = 576-640, where a tile is only 18-20 blocks long)."""
    out[i, r] = f32x8_lane(v, 0)
    out[i + 1, r] = f32x8_lane(v, 1)
    out[i + 2, r] = f32x8_lane(v, 2)
    out[i + 3, r] = f32x8_lane(v, 3)
    out[i + 4, r] = f32x8_lane(v, 4)
    out[i + 5, r] = f32x8_lane(v, 5)
    out[i + 6, r] = f32x8_lane(v, 6)
    out[i + 7, r] = f32x8_lane(v, 7)


@njit(cache=True, inline="always")
def _tile16(kind, wr, r, xg, xdT, xsT, i, nb, out, dvb):
    """``_tile8`` for activation rows i..i+15 (a whole group of xg): sixteen accumulators (AVX-512 gives 32 vector
    registers), each weight block loaded and decoded once for sixteen pairs (LLVM merges the two halves' decodes).
    dvb: (nb, 2, 8). Measured against eight-row tiles (n = 512, in-process A/B): Q8_0 576 x 1536 -17%, Q4_1 and
    Q5_0 -5%."""
    bb = _block_bytes(kind)
    for b in range(nb):
        d = f16_at(wr, b * bb)
        f32x8_store(dvb[b, 0], 0, f32x8_scale(f32x8_load(xdT[b], i), d))
        f32x8_store(dvb[b, 1], 0, f32x8_scale(f32x8_load(xdT[b], i + 8), d))
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = f32x8_zero()
    c0 = c1 = c2 = c3 = c4 = c5 = c6 = c7 = f32x8_zero()
    sa = sc = f32x8_zero()
    for b in range(nb):
        if _act_offset(kind):
            a0, a1, a2, a3, a4, a5, a6, a7 = _row8_off(kind, wr, b, xg[b], 0, dvb[b, 0], a0, a1, a2, a3, a4, a5, a6, a7)
            c0, c1, c2, c3, c4, c5, c6, c7 = _row8_off(kind, wr, b, xg[b], 8, dvb[b, 1],
                                                       c0, c1, c2, c3, c4, c5, c6, c7)
        else:
            a0, a1, a2, a3, a4, a5, a6, a7, sa = _row8(kind, wr, b, xg[b], 0, dvb[b, 0], f32x8_load(xsT[b], i),
                                                       a0, a1, a2, a3, a4, a5, a6, a7, sa)
            c0, c1, c2, c3, c4, c5, c6, c7, sc = _row8(kind, wr, b, xg[b], 8, dvb[b, 1], f32x8_load(xsT[b], i + 8),
                                                       c0, c1, c2, c3, c4, c5, c6, c7, sc)
    _store8(out, i, r, f32x8_add(f32x8_hsum8(a0, a1, a2, a3, a4, a5, a6, a7), sa))
    _store8(out, i + 8, r, f32x8_add(f32x8_hsum8(c0, c1, c2, c3, c4, c5, c6, c7), sc))


@njit(cache=True, inline="always")
def _mv_tiles(w, xq, xd, xs, out, tab, kind, counter, n_workers):
    """The activation rows 0 .. n - n % 8 of ``_mv_legacy``: sixteen at a time, then eight (Q8_0 eight at a time where
    the CPU has sixteen vector registers: ``TILE16``; a decode step's few rows: ``dot_whole``). Work items: chunks
    of ROW_CHUNK weight rows, claimed from ``counter`` (int64, zeroed) by ``n_workers`` workers (``claims``), so that
    a thread that loses its core for a while holds back its current chunk only, not a share fixed in advance."""
    rows = w.shape[0]
    n, k = xq.shape
    nb = k // 32
    n8 = n - n % 8
    xdT = np.ascontiguousarray(xd.T)      # (nb, n): the eight activations' scales of a block side by side
    xsT = np.ascontiguousarray(xs.T)
    xg = _group_activations(kind, xq, n8)
    n_chunks = (rows + ROW_CHUNK - 1) // ROW_CHUNK
    n16 = n8 - n8 % 16 if TILE16 or kind != K_Q8_0 else 0
    for _ in prange(n_workers):
        dvb = np.empty((nb, 8), np.float32)
        dv2 = np.empty((nb, 2, 8), np.float32)
        accb = np.empty((ROW_CHUNK, 9, 8), np.float32)
        while True:
            c = claim(counter)
            if c >= n_chunks:
                break
            r1 = min(rows, (c + 1) * ROW_CHUNK)
            r = c * ROW_CHUNK
            for rr in range(r, r1):
                prefetch_row(w, rr)
            for i in range(0, n16, 16):
                for rr in range(r, r1):
                    _tile16(kind, w[rr], rr, xg[i // 16], xdT, xsT, i, nb, out, dv2)
            for i in range(n16, n8, 8):
                for b0 in range(0, nb, KSPAN):
                    for rr in range(r, r1):
                        _tile8(kind, w[rr], rr, xg[i // 16], xdT, xsT, i, b0, min(nb, b0 + KSPAN), nb, out, dvb,
                               accb[rr - r])


# ------------------------------------------------------------------- prompt tiles, weight rows as lanes (AVX-512)

@njit(cache=True, inline="always")
def rows16_transpose(tmp, ws, at, n):
    """The int32 at + 16 q + r of ws = the int32 n r + q of tmp (q < n, r < 16): sixteen rows of n four-byte groups
    (row r at byte 4 n r of tmp) as the n registers of the rows-as-lanes tiles, group q's sixteen rows side by side."""
    n8 = n - n % 8
    for q in range(0, n8, 8):
        i32_transpose16x8(tmp, q, n, ws, at + 16 * q)
    t32 = tmp.view(np.int32)
    s32 = ws.view(np.int32)
    for q in range(n8, n):
        for r in range(16):
            s32[at + 16 * q + r] = t32[n * r + q]


@njit(cache=True, inline="always")
def _rows16_prep(kind, w, r0, nb, tmp, ws, dws, mws):
    """Weight rows r0..r0+15 transposed for ``rows16_pairs2``: ws[512 b + 64 l + 4 r + t] = unsigned byte 4l + t of
    row r's block b (``_wblock``, unsigned); dws[b, r] its F16 scale and, for Q4_1 / Q5_1, mws[b, r] its min. Once
    per call and row group, for all the activation rows (tmp: one block of the sixteen rows)."""
    bb = _block_bytes(kind)
    for b in range(nb):
        for r in range(16):
            wr = w[r0 + r]
            i32x8_store(tmp, 32 * r, _wblock(kind, wr, b, True))
            dws[b, r] = f16_at(wr, b * bb)
            if not _signed(kind):
                mws[b, r] = f16_at(wr, b * bb + 2)
        rows16_transpose(tmp, ws, 128 * b, 8)


@njit(cache=True, inline="always")
def _mv_rows16(w, xq, xd, xs, out, tab, kind):
    """The prompt tiles where the CPU has AVX-512 VNNI: weight rows 0 .. rows - rows % 16 against activation rows
    0 .. n - n % 8, sixteen weight rows (as the lanes of a 512-bit register, ``rows16_pairs2``) by two activation
    rows at a time. Every pair has ggml's eight lanes and its own fma per lane and block, in block order, and the
    sums ``hsum_float_8``'s tree (``v16_tree8``), plus the min term for Q4_1 / Q5_1: the one-row tiles' numbers, bit
    for bit. The weights are decoded and transposed once per call and row group (``_rows16_prep``), and each
    activation block's four-byte pieces are broadcast loads folded into the vpdpbusd. Measured against the one-row
    tiles (benchmarks/README.md, entry 51): Q5_0 2048 x 640 at n = 512, 2.2 -> 1.35 cycles per block product."""
    rows = w.shape[0]
    n, k = xq.shape
    nb = k // 32
    n8 = n - n % 8
    xls = _offset_lane_sums(kind, xq)
    for g in prange(rows // 16):
        r0 = 16 * g
        tmp = np.empty(512, np.uint8)
        ws = np.empty(nb * 512, np.uint8)
        dws = np.empty((nb, 16), np.float32)
        mws = np.empty((nb, 16), np.float32)
        _rows16_prep(kind, w, r0, nb, tmp, ws, dws, mws)
        for i in range(0, n8, 2):
            if i + OUT_AHEAD + 1 < n8:
                prefetch_write(out, i + OUT_AHEAD, r0)
                prefetch_write(out, i + OUT_AHEAD + 1, r0)
            v0, v1 = _rows16_pair(kind, ws, dws, mws, xq, xd, xs, xls, i, nb)
            v16_store(out[i], r0, v0)
            v16_store(out[i + 1], r0, v1)


@njit(cache=True, inline="always")
def _rows16_pair(kind, ws, dws, mws, xq, xd, xs, xls, i, nb):
    """Sixteen weight rows (``_rows16_prep``'s ws, dws, mws) against activation rows i and i + 1: the two rows'
    sixteen dot products, as two sixteen-lane vectors."""
    z = v16_zero()
    acc = (z, z, z, z, z, z, z, z, z, z, z, z, z, z, z, z)
    s0 = s1 = z
    for b in range(nb):
        dw = v16_load(dws[b], 0)
        d0, d1 = v16_scale(dw, xd[i, b]), v16_scale(dw, xd[i + 1, b])
        if _signed(kind):
            acc = rows16_pairs2(ws, 512 * b, xq, i, 32 * b, xls, 8 * b, True, d0, d1, acc)
        else:
            acc = rows16_pairs2(ws, 512 * b, xq, i, 32 * b, xls, 8 * b, False, d0, d1, acc)
            m = v16_load(mws[b], 0)
            s0 = v16_fma(m, xs[i, b], s0)
            s1 = v16_fma(m, xs[i + 1, b], s1)
    if _signed(kind):
        return v16_tree8(acc, 0), v16_tree8(acc, 1)
    return v16_add(v16_tree8(acc, 0), s0), v16_add(v16_tree8(acc, 1), s1)


GLU_SWIGLU, GLU_GEGLU = 0, 1


@njit(cache=True, inline="always")
def _mv_rows16_glu(wg, wu, xq, xd, xs, out, kind, glu, table):
    """A feed-forward's gate and up products and its gated unit in one pass (the MUL_MAT_GLU node): per group of
    sixteen weight rows both matrices are prepared once, and per pair of activation rows both tiles are computed
    (``_rows16_pair``, the products' exact bits) and combined in registers as ggml's vector GLU does it (glu:
    ``GLU_SWIGLU`` ggml_v_silu(g) * u, ``GLU_GEGLU`` the F16 GELU table times u, ``table``), so neither product is
    written to memory and read back. rows % 16 == 0 (every group of sixteen is a full vector of the GLU's rows) and
    n >= 2 (an odd last row is computed with the one before it, whose values it writes again, unchanged)."""
    rows = wg.shape[0]
    n, k = xq.shape
    nb = k // 32
    xls = _offset_lane_sums(kind, xq)
    for g in prange(rows // 16):
        r0 = 16 * g
        tmp = np.empty(512, np.uint8)
        wsg = np.empty(nb * 512, np.uint8)
        wsu = np.empty(nb * 512, np.uint8)
        dwg = np.empty((nb, 16), np.float32)
        dwu = np.empty((nb, 16), np.float32)
        mwg = np.empty((nb, 16), np.float32)
        mwu = np.empty((nb, 16), np.float32)
        _rows16_prep(kind, wg, r0, nb, tmp, wsg, dwg, mwg)
        _rows16_prep(kind, wu, r0, nb, tmp, wsu, dwu, mwu)
        for p in range((n + 1) // 2):
            i = min(2 * p, n - 2)
            if i + OUT_AHEAD + 1 < n:
                prefetch_write(out, i + OUT_AHEAD, r0)
                prefetch_write(out, i + OUT_AHEAD + 1, r0)
            g0, g1 = _rows16_pair(kind, wsg, dwg, mwg, xq, xd, xs, xls, i, nb)
            u0, u1 = _rows16_pair(kind, wsu, dwu, mwu, xq, xd, xs, xls, i, nb)
            if glu == GLU_SWIGLU:
                v16_store(out[i], r0, v16_mul(v16_silu(g0), u0))
                v16_store(out[i + 1], r0, v16_mul(v16_silu(g1), u1))
            else:
                v16_store(out[i], r0, v16_geglu(g0, u0, table))
                v16_store(out[i + 1], r0, v16_geglu(g1, u1, table))


@njit(cache=True, inline="always")
def _rows4(kind, w, r, xr, xdr, xsr, lr, nb, gb, at):
    """Rows r..r+3 of w against one activation row: the four dot products into gb[at..at+3] (``_mv_rest``'s
    one-row form: four chains, each in ggml's block order; the rows PREFETCH_AHEAD ahead prefetched meanwhile)."""
    w0, w1, w2, w3 = w[r], w[r + 1], w[r + 2], w[r + 3]
    pb = prefetch_base(w, r)
    step = 4 * _block_bytes(kind)
    a0 = a1 = a2 = a3 = f32x8_zero()
    s0 = s1 = s2 = s3 = np.float32(0.0)
    for b in range(nb):
        prefetch_step(w, pb, b, step)
        d = xdr[b]
        m = xsr[b]
        a0, s0 = _block(kind, xdr, w0, b, xr, d, m, lr, a0, s0)     # (_block does not read its table argument)
        a1, s1 = _block(kind, xdr, w1, b, xr, d, m, lr, a1, s1)
        a2, s2 = _block(kind, xdr, w2, b, xr, d, m, lr, a2, s2)
        a3, s3 = _block(kind, xdr, w3, b, xr, d, m, lr, a3, s3)
    gb[at] = f32x8_hsum(a0) + s0
    gb[at + 1] = f32x8_hsum(a1) + s1
    gb[at + 2] = f32x8_hsum(a2) + s2
    gb[at + 3] = f32x8_hsum(a3) + s3


@njit(cache=True, inline="always")
def _mv_rest_glu(wg, wu, xq, xd, xs, out, kind, glu, table):
    """MUL_MAT_GLU for a few activation rows (decoding): per group of sixteen weight rows, the gate's and the up
    matrix's sixteen dot products (``_rows4``, the decode kernels' numbers) and the gated unit over them as ggml's
    vector GLU computes it (``_mv_rows16_glu``'s), in one parallel region; neither product goes through memory and
    the unit is not a call of its own. rows % 16 == 0."""
    rows = wg.shape[0]
    n, k = xq.shape
    nb = k // 32
    xls = _offset_lane_sums(kind, xq)
    for c in prange(rows // 16):
        r0 = 16 * c
        gb = np.empty(16, np.float32)
        ub = np.empty(16, np.float32)
        for i in range(n):
            xr, lr, xdr, xsr = xq[i], xls[i], xd[i], xs[i]
            for q in range(0, 16, 4):
                _rows4(kind, wg, r0 + q, xr, xdr, xsr, lr, nb, gb, q)
                _rows4(kind, wu, r0 + q, xr, xdr, xsr, lr, nb, ub, q)
            if glu == GLU_SWIGLU:
                v16_store(out[i], r0, v16_mul(v16_silu(v16_load(gb, 0)), v16_load(ub, 0)))
            else:
                v16_store(out[i], r0, v16_geglu(v16_load(gb, 0), v16_load(ub, 0), table))


@njit(cache=True, inline="always")
def _mv_rest(w, xq, xd, xs, out, tab, kind, n8):
    """The activation rows n8 .. n of ``_mv_legacy``: pairs, then one. The rows PREFETCH_AHEAD ahead are
    prefetched a piece per block step (``prefetch_step``)."""
    rows = w.shape[0]
    n, k = xq.shape
    nb = k // 32
    xls = _offset_lane_sums(kind, xq)
    for c in prange((rows + ROW_CHUNK - 1) // ROW_CHUNK):
        r1 = min(rows, (c + 1) * ROW_CHUNK)
        r = c * ROW_CHUNK
        while r + 4 <= r1:
            w0, w1, w2, w3 = w[r], w[r + 1], w[r + 2], w[r + 3]
            pb = prefetch_base(w, r)
            step = 4 * _block_bytes(kind)   # inside the parallel loop: a constant there (prefetch_step unrolls)
            n2 = n8 + (n - n8) // 2 * 2
            for i in range(n8, n2, 2):     # two activation rows: eight chains, each weight block decoded once
                x0, x1, l0, l1 = xq[i], xq[i + 1], xls[i], xls[i + 1]
                a00 = a01 = a10 = a11 = a20 = a21 = a30 = a31 = f32x8_zero()
                s00 = s01 = s10 = s11 = s20 = s21 = s30 = s31 = np.float32(0.0)
                for b in range(nb):
                    prefetch_step(w, pb, b, step)
                    d0, d1 = xd[i, b], xd[i + 1, b]
                    m0, m1 = xs[i, b], xs[i + 1, b]
                    a00, s00 = _block(kind, tab, w0, b, x0, d0, m0, l0, a00, s00)
                    a01, s01 = _block(kind, tab, w0, b, x1, d1, m1, l1, a01, s01)
                    a10, s10 = _block(kind, tab, w1, b, x0, d0, m0, l0, a10, s10)
                    a11, s11 = _block(kind, tab, w1, b, x1, d1, m1, l1, a11, s11)
                    a20, s20 = _block(kind, tab, w2, b, x0, d0, m0, l0, a20, s20)
                    a21, s21 = _block(kind, tab, w2, b, x1, d1, m1, l1, a21, s21)
                    a30, s30 = _block(kind, tab, w3, b, x0, d0, m0, l0, a30, s30)
                    a31, s31 = _block(kind, tab, w3, b, x1, d1, m1, l1, a31, s31)
                out[i, r] = f32x8_hsum(a00) + s00
                out[i + 1, r] = f32x8_hsum(a01) + s01
                out[i, r + 1] = f32x8_hsum(a10) + s10
                out[i + 1, r + 1] = f32x8_hsum(a11) + s11
                out[i, r + 2] = f32x8_hsum(a20) + s20
                out[i + 1, r + 2] = f32x8_hsum(a21) + s21
                out[i, r + 3] = f32x8_hsum(a30) + s30
                out[i + 1, r + 3] = f32x8_hsum(a31) + s31
            for i in range(n2, n):
                xr, lr = xq[i], xls[i]
                a0 = a1 = a2 = a3 = f32x8_zero()
                s0 = s1 = s2 = s3 = np.float32(0.0)
                for b in range(nb):
                    prefetch_step(w, pb, b, step)
                    xdb = xd[i, b]
                    xsb = xs[i, b]
                    a0, s0 = _block(kind, tab, w0, b, xr, xdb, xsb, lr, a0, s0)
                    a1, s1 = _block(kind, tab, w1, b, xr, xdb, xsb, lr, a1, s1)
                    a2, s2 = _block(kind, tab, w2, b, xr, xdb, xsb, lr, a2, s2)
                    a3, s3 = _block(kind, tab, w3, b, xr, xdb, xsb, lr, a3, s3)
                out[i, r] = f32x8_hsum(a0) + s0
                out[i, r + 1] = f32x8_hsum(a1) + s1
                out[i, r + 2] = f32x8_hsum(a2) + s2
                out[i, r + 3] = f32x8_hsum(a3) + s3
            r += 4
        while r < r1:
            wr = w[r]
            for i in range(n8, n):
                xr, lr = xq[i], xls[i]
                a0 = f32x8_zero()
                s0 = np.float32(0.0)
                for b in range(nb):
                    a0, s0 = _block(kind, tab, wr, b, xr, xd[i, b], xs[i, b], lr, a0, s0)
                out[i, r] = f32x8_hsum(a0) + s0
            r += 1


def _mv_legacy(tiles, rows16, rest, w, xq, xd, xs, out, tab):
    """out[i, r] = dot(w[r], x[i]) for the 32-value formats. Four weight rows at a time: four independent fma
    chains keep the core busy while each waits on its previous block (one chain alone is latency-bound); with
    two or more activation rows, tiles of 4 weight rows x 2 activation rows (eight chains; LLVM decodes each
    weight block once for both). Every (r, i) still accumulates its own blocks in ggml's order. Measured
    (Q4_1 1536x576, 2 threads): 0.86 ns per block product at n = 1, 0.68 with 4x1 tiles at n = 512, 0.47 with
    4x2 (4x3 and 4x4 tiles spill registers: 0.49 and 1.2).
    Inlined into one parallel kernel per format, where ``kind`` is a constant and LLVM drops the other formats'
    branches (a run-time ``kind`` left them in the inner loop: 3x slower). Two kernels per format, the tiles of
    eight activation rows (``_mv_tiles``) and the rest (``_mv_rest``): decoding and short prompts need only the
    second, which compiles in 60% of the time of one kernel holding both (a cold start to the first token of
    SmolLM2: Q4_1 15.4 -> 9.4 s, Q8_0 15.9 -> 8.0 s)."""
    n, rows = xq.shape[0], w.shape[0]
    n8 = n - n % 8
    if n8 >= ROWS16_MIN_N and ROWS16 and rows >= 16:
        r16 = rows - rows % 16
        rows16(w, xq, xd, xs, out, tab)
        if r16 < rows:            # the last rows % 16 weight rows: all their activation rows in the decode form
            rest(w[r16:], xd, xq, xd, xs, out[:, r16:], tab, 0, False)
            w, out = w[:r16], out[:, :r16]
    elif n > 1:
        done = dot_whole.mv_whole(tiles, w, xq, xd, xs, out, tab)     # a decode step's rows (0 where it has no kernel)
        if not done and n8:
            tiles(w, xq, xd, xs, out, tab, np.zeros(1, np.int64), workers(-(-rows // ROW_CHUNK)))
        n8 = max(n8, done)
    if n8 < n:
        rest(w, xd, xq, xd, xs, out, tab, n8, False)


# ggml's Q8_0/Q4_0/Q5_0 have no min: their summs stays 0 and ``hsum + 0`` is the hsum itself
@njit(parallel=True, cache=True, nogil=True)
def _tiles_q8_0(w, xq, xd, xs, out, tab, counter, n_workers):
    _mv_tiles(w, xq, xd, xs, out, tab, K_Q8_0, counter, n_workers)


@njit(parallel=True, cache=True, nogil=True)
def _rows16_q8_0(w, xq, xd, xs, out, tab):
    _mv_rows16(w, xq, xd, xs, out, tab, K_Q8_0)


@njit(parallel=True, cache=True, nogil=True)
def _rest_q8_0(w, x, xq, xd, xs, out, tab, n8, quant):
    if quant:
        q8_0_split(x, xq, xd, xs, False)
    _mv_rest(w, xq, xd, xs, out, tab, K_Q8_0, n8)


def mv_q8_0(w, xq, xd, xs, out, tab):
    _mv_legacy(_tiles_q8_0, _rows16_q8_0, _rest_q8_0, w, xq, xd, xs, out, tab)


@njit(parallel=True, cache=True, nogil=True)
def _tiles_q4_0(w, xq, xd, xs, out, tab, counter, n_workers):
    _mv_tiles(w, xq, xd, xs, out, tab, K_Q4_0, counter, n_workers)


@njit(parallel=True, cache=True, nogil=True)
def _rows16_q4_0(w, xq, xd, xs, out, tab):
    _mv_rows16(w, xq, xd, xs, out, tab, K_Q4_0)


@njit(parallel=True, cache=True, nogil=True)
def _rest_q4_0(w, x, xq, xd, xs, out, tab, n8, quant):
    if quant:
        q8_0_split(x, xq, xd, xs, False)
    _mv_rest(w, xq, xd, xs, out, tab, K_Q4_0, n8)


def mv_q4_0(w, xq, xd, xs, out, tab):
    _mv_legacy(_tiles_q4_0, _rows16_q4_0, _rest_q4_0, w, xq, xd, xs, out, tab)


@njit(parallel=True, cache=True, nogil=True)
def _tiles_q4_1(w, xq, xd, xs, out, tab, counter, n_workers):
    _mv_tiles(w, xq, xd, xs, out, tab, K_Q4_1, counter, n_workers)


@njit(parallel=True, cache=True, nogil=True)
def _rows16_q4_1(w, xq, xd, xs, out, tab):
    _mv_rows16(w, xq, xd, xs, out, tab, K_Q4_1)


@njit(parallel=True, cache=True, nogil=True)
def _rest_q4_1(w, x, xq, xd, xs, out, tab, n8, quant):
    if quant:
        q8_0_split(x, xq, xd, xs, True)
    _mv_rest(w, xq, xd, xs, out, tab, K_Q4_1, n8)


def mv_q4_1(w, xq, xd, xs, out, tab):
    _mv_legacy(_tiles_q4_1, _rows16_q4_1, _rest_q4_1, w, xq, xd, xs, out, tab)


@njit(parallel=True, cache=True, nogil=True)
def _tiles_q5_0(w, xq, xd, xs, out, tab, counter, n_workers):
    _mv_tiles(w, xq, xd, xs, out, tab, K_Q5_0, counter, n_workers)


@njit(parallel=True, cache=True, nogil=True)
def _rows16_q5_0(w, xq, xd, xs, out, tab):
    _mv_rows16(w, xq, xd, xs, out, tab, K_Q5_0)


@njit(parallel=True, cache=True, nogil=True)
def _rest_q5_0(w, x, xq, xd, xs, out, tab, n8, quant):
    if quant:
        q8_0_split(x, xq, xd, xs, False)
    _mv_rest(w, xq, xd, xs, out, tab, K_Q5_0, n8)


def mv_q5_0(w, xq, xd, xs, out, tab):
    _mv_legacy(_tiles_q5_0, _rows16_q5_0, _rest_q5_0, w, xq, xd, xs, out, tab)


@njit(parallel=True, cache=True, nogil=True)
def _tiles_q5_1(w, xq, xd, xs, out, tab, counter, n_workers):
    _mv_tiles(w, xq, xd, xs, out, tab, K_Q5_1, counter, n_workers)


@njit(parallel=True, cache=True, nogil=True)
def _rows16_q5_1(w, xq, xd, xs, out, tab):
    _mv_rows16(w, xq, xd, xs, out, tab, K_Q5_1)


@njit(parallel=True, cache=True, nogil=True)
def _rest_q5_1(w, x, xq, xd, xs, out, tab, n8, quant):
    if quant:
        q8_0_split(x, xq, xd, xs, True)
    _mv_rest(w, xq, xd, xs, out, tab, K_Q5_1, n8)


def mv_q5_1(w, xq, xd, xs, out, tab):
    _mv_legacy(_tiles_q5_1, _rows16_q5_1, _rest_q5_1, w, xq, xd, xs, out, tab)


# MUL_MAT_GLU's fused kernels (sixteen-row tiles only: where the CPU has AVX-512 VNNI)
@njit(parallel=True, cache=True, nogil=True)
def _glu_q8_0(wg, wu, xq, xd, xs, out, glu, table):
    _mv_rows16_glu(wg, wu, xq, xd, xs, out, K_Q8_0, glu, table)


@njit(parallel=True, cache=True, nogil=True)
def _glu_q4_0(wg, wu, xq, xd, xs, out, glu, table):
    _mv_rows16_glu(wg, wu, xq, xd, xs, out, K_Q4_0, glu, table)


@njit(parallel=True, cache=True, nogil=True)
def _glu_q4_1(wg, wu, xq, xd, xs, out, glu, table):
    _mv_rows16_glu(wg, wu, xq, xd, xs, out, K_Q4_1, glu, table)


@njit(parallel=True, cache=True, nogil=True)
def _glu_q5_0(wg, wu, xq, xd, xs, out, glu, table):
    _mv_rows16_glu(wg, wu, xq, xd, xs, out, K_Q5_0, glu, table)


@njit(parallel=True, cache=True, nogil=True)
def _glu_q5_1(wg, wu, xq, xd, xs, out, glu, table):
    _mv_rows16_glu(wg, wu, xq, xd, xs, out, K_Q5_1, glu, table)


# the decode form alone (``_mv_legacy`` with fewer than eight activation rows), for a plan's bound product
# (matmul.bind_mul_mat): ``rest(w, x, xq, xd, xs, out, tab, 0, True)`` rounds x into the buffers first (Q8_0, or Q8_1
# for Q4_1 / Q5_1: act_split's quantizer, the same bytes), one call for the token's product
REST_KERNELS = {"q8_0": _rest_q8_0, "q4_0": _rest_q4_0, "q4_1": _rest_q4_1, "q5_0": _rest_q5_0, "q5_1": _rest_q5_1}
GLU_KERNELS = {"q8_0": _glu_q8_0, "q4_0": _glu_q4_0, "q4_1": _glu_q4_1, "q5_0": _glu_q5_0, "q5_1": _glu_q5_1}


# MUL_MAT_GLU of a few activation rows (decoding), any CPU: ``_mv_rest_glu``
@njit(parallel=True, cache=True, nogil=True)
def _glu_rest_q8_0(wg, wu, xq, xd, xs, out, glu, table):
    _mv_rest_glu(wg, wu, xq, xd, xs, out, K_Q8_0, glu, table)


@njit(parallel=True, cache=True, nogil=True)
def _glu_rest_q5_0(wg, wu, xq, xd, xs, out, glu, table):
    _mv_rest_glu(wg, wu, xq, xd, xs, out, K_Q5_0, glu, table)


@njit(parallel=True, cache=True, nogil=True)
def _glu_rest_q5_1(wg, wu, xq, xd, xs, out, glu, table):
    _mv_rest_glu(wg, wu, xq, xd, xs, out, K_Q5_1, glu, table)


# Q8_0, Q5_0 and Q5_1 (Q5_0's gate and up of SmolLM2, 30 layers streamed, one thread: 150 -> 143 us a layer). Q4_1,
# the default model's type, and Q4_0's rows that are not repacked run the three ops when decoding: the fused kernel
# saves ~7 us a layer at two threads (benchmarks/README.md, 2026-11-27) but is one more kernel for the default
# model's cold start to compile.
GLU_DECODE_KERNELS = {"q8_0": _glu_rest_q8_0, "q5_0": _glu_rest_q5_0, "q5_1": _glu_rest_q5_1}
GLU_DECODE_MAX_N = 7      # below the prompt tiles' eight rows (``_mv_legacy``): the products run ``_mv_rest`` alone


# ------------------------------------------------------------------------------------------ tile dequantization
# For the BLAS path: rows of blocks -> float32 [rows, k], exactly ggml's dequantize_row_* values
# (d * q, or d * q + m), written into a caller's tile so that no temporaries are allocated. Serial on purpose:
# OpenBLAS's threads spin for a while after each GEMM, and an OpenMP region started meanwhile on a 2-core machine
# waits for them (measured: a 150 us matvec took 1-3 ms right after a GEMM); the GEMM dominates anyway.

@njit(cache=True, nogil=True)
def dq_legacy(w, kind, out, tab):
    """kind: 0 Q4_0, 1 Q4_1, 2 Q5_0, 3 Q5_1, 4 Q8_0."""
    rows, k = out.shape
    nb = k // 32
    for r in range(rows):
        wr = w[r]
        for b in range(nb):
            xo = b * 32
            if kind == 4:
                o = b * 34
                d = _f16(tab, wr, o)
                for e in range(32):
                    out[r, xo + e] = np.float32(np.int8(wr[o + 2 + e])) * d
            elif kind == 0 or kind == 1:
                o = b * (18 if kind == 0 else 20)
                q0 = o + (2 if kind == 0 else 4)
                d = _f16(tab, wr, o)
                if kind == 0:
                    for e in range(16):
                        q = np.int32(wr[q0 + e])
                        out[r, xo + e] = np.float32((q & 15) - 8) * d
                        out[r, xo + 16 + e] = np.float32((q >> 4) - 8) * d
                else:
                    m = _f16(tab, wr, o + 2)
                    for e in range(16):
                        q = np.int32(wr[q0 + e])
                        out[r, xo + e] = np.float32(q & 15) * d + m
                        out[r, xo + 16 + e] = np.float32(q >> 4) * d + m
            else:
                o = b * (22 if kind == 2 else 24)
                hoff = 2 if kind == 2 else 4
                qh = _qh(wr, o + hoff)
                q0 = o + hoff + 4
                d = _f16(tab, wr, o)
                if kind == 2:
                    for e in range(16):
                        q = np.int32(wr[q0 + e])
                        out[r, xo + e] = np.float32(((q & 15) | ((qh >> e) & 1) << 4) - 16) * d
                        out[r, xo + 16 + e] = np.float32(((q >> 4) | ((qh >> (16 + e)) & 1) << 4) - 16) * d
                else:
                    m = _f16(tab, wr, o + 2)
                    for e in range(16):
                        q = np.int32(wr[q0 + e])
                        out[r, xo + e] = np.float32((q & 15) | ((qh >> e) & 1) << 4) * d + m
                        out[r, xo + 16 + e] = np.float32((q >> 4) | ((qh >> (16 + e)) & 1) << 4) * d + m


# a decode step's tiles over whole weight rows (``_mv_legacy``); last, as that module builds on this one's tiles
from . import dot_whole  # noqa: E402
