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
from numba.extending import intrinsic

# fp16 bits -> float32, as a table (256 KiB): the scales are read with one lookup
F16_TABLE = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)

ROW_CHUNK = 16
PREFETCH_ROWS = 4   # rows ahead to prefetch: a kernel this slow leaves the hardware prefetchers idle otherwise


@intrinsic
def prefetch(typingctx, arr, idx):
    """llvm.prefetch (read, keep in all cache levels) of &arr[idx]."""
    sig = types.void(arr, idx)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        i8p = ir.IntType(8).as_pointer()
        ptr = builder.bitcast(builder.gep(ary.data, [args[1]]), i8p)
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = builder.module.globals.get("llvm.prefetch.p0i8") or ir.Function(builder.module, fnty, "llvm.prefetch.p0i8")
        builder.call(fn, [ptr, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()
    return sig, codegen


@njit(cache=True, inline="always")
def prefetch_row(w, r):
    """Ask for row r + PREFETCH_ROWS of w while row r is computed. Measured on SmolLM2's 28 MiB output matrix
    (Q8_0, 1 thread): 1.7 GB/s without, 3.6 GB/s with; matrices that sit in the cache are unaffected."""
    rn = r + PREFETCH_ROWS
    if rn < w.shape[0]:
        wn = w[rn]
        for p in range(0, wn.shape[0], 64):
            prefetch(wn, p)


@njit(cache=True, inline="always")
def _f16(tab, row, o):
    return tab[np.int32(row[o]) | (np.int32(row[o + 1]) << 8)]


@njit(cache=True, inline="always")
def _hsum8(a0, a1, a2, a3, a4, a5, a6, a7):
    """ggml's hsum_float_8: ((a4 + a0) + (a6 + a2)) + ((a5 + a1) + (a7 + a3))."""
    return ((a4 + a0) + (a6 + a2)) + ((a5 + a1) + (a7 + a3))


@njit(parallel=True, cache=True, fastmath={"contract"})
def mv_q8_0(w, xq, xd, xs, out, tab):
    rows = w.shape[0]
    n, k = xq.shape
    nb = k // 32
    for c in prange((rows + ROW_CHUNK - 1) // ROW_CHUNK):
        for r in range(c * ROW_CHUNK, min(rows, (c + 1) * ROW_CHUNK)):
            wr = w[r]
            prefetch_row(w, r)
            for i in range(n):
                xr = xq[i]
                a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
                for b in range(nb):
                    o = b * 34 + 2
                    xo = b * 32
                    l0 = l1 = l2 = l3 = l4 = l5 = l6 = l7 = 0
                    for j in range(4):
                        l0 += np.int32(np.int8(wr[o + j])) * np.int32(xr[xo + j])
                        l1 += np.int32(np.int8(wr[o + 4 + j])) * np.int32(xr[xo + 4 + j])
                        l2 += np.int32(np.int8(wr[o + 8 + j])) * np.int32(xr[xo + 8 + j])
                        l3 += np.int32(np.int8(wr[o + 12 + j])) * np.int32(xr[xo + 12 + j])
                        l4 += np.int32(np.int8(wr[o + 16 + j])) * np.int32(xr[xo + 16 + j])
                        l5 += np.int32(np.int8(wr[o + 20 + j])) * np.int32(xr[xo + 20 + j])
                        l6 += np.int32(np.int8(wr[o + 24 + j])) * np.int32(xr[xo + 24 + j])
                        l7 += np.int32(np.int8(wr[o + 28 + j])) * np.int32(xr[xo + 28 + j])
                    d = np.float32(_f16(tab, wr, o - 2) * xd[i, b])
                    a0 = d * np.float32(l0) + a0
                    a1 = d * np.float32(l1) + a1
                    a2 = d * np.float32(l2) + a2
                    a3 = d * np.float32(l3) + a3
                    a4 = d * np.float32(l4) + a4
                    a5 = d * np.float32(l5) + a5
                    a6 = d * np.float32(l6) + a6
                    a7 = d * np.float32(l7) + a7
                out[i, r] = _hsum8(a0, a1, a2, a3, a4, a5, a6, a7)


@njit(cache=True, inline="always")
def _nib_lanes(wr, o, xr, xo, off):
    """Lanes of a nibble block: element e < 16 is byte e's low nibble, element 16 + e its high nibble; ``off``
    is subtracted from every value (8 for Q4_0, 0 for Q4_1)."""
    l0 = l1 = l2 = l3 = l4 = l5 = l6 = l7 = 0
    for j in range(4):
        q = np.int32(wr[o + j])
        l0 += ((q & 15) - off) * np.int32(xr[xo + j])
        l4 += ((q >> 4) - off) * np.int32(xr[xo + 16 + j])
        q = np.int32(wr[o + 4 + j])
        l1 += ((q & 15) - off) * np.int32(xr[xo + 4 + j])
        l5 += ((q >> 4) - off) * np.int32(xr[xo + 20 + j])
        q = np.int32(wr[o + 8 + j])
        l2 += ((q & 15) - off) * np.int32(xr[xo + 8 + j])
        l6 += ((q >> 4) - off) * np.int32(xr[xo + 24 + j])
        q = np.int32(wr[o + 12 + j])
        l3 += ((q & 15) - off) * np.int32(xr[xo + 12 + j])
        l7 += ((q >> 4) - off) * np.int32(xr[xo + 28 + j])
    return l0, l1, l2, l3, l4, l5, l6, l7


@njit(cache=True, inline="always")
def _nib5_lanes(wr, o, qh, xr, xo, off):
    """Lanes of a 5-bit block: the nibble as in ``_nib_lanes`` plus bit e of ``qh`` as bit 4 of element e."""
    l0 = l1 = l2 = l3 = l4 = l5 = l6 = l7 = 0
    for j in range(4):
        q = np.int32(wr[o + j])
        l0 += (((q & 15) | ((qh >> j) & 1) << 4) - off) * np.int32(xr[xo + j])
        l4 += (((q >> 4) | ((qh >> (16 + j)) & 1) << 4) - off) * np.int32(xr[xo + 16 + j])
        q = np.int32(wr[o + 4 + j])
        l1 += (((q & 15) | ((qh >> (4 + j)) & 1) << 4) - off) * np.int32(xr[xo + 4 + j])
        l5 += (((q >> 4) | ((qh >> (20 + j)) & 1) << 4) - off) * np.int32(xr[xo + 20 + j])
        q = np.int32(wr[o + 8 + j])
        l2 += (((q & 15) | ((qh >> (8 + j)) & 1) << 4) - off) * np.int32(xr[xo + 8 + j])
        l6 += (((q >> 4) | ((qh >> (24 + j)) & 1) << 4) - off) * np.int32(xr[xo + 24 + j])
        q = np.int32(wr[o + 12 + j])
        l3 += (((q & 15) | ((qh >> (12 + j)) & 1) << 4) - off) * np.int32(xr[xo + 12 + j])
        l7 += (((q >> 4) | ((qh >> (28 + j)) & 1) << 4) - off) * np.int32(xr[xo + 28 + j])
    return l0, l1, l2, l3, l4, l5, l6, l7


@njit(cache=True, inline="always")
def _qh(wr, o):
    return (np.int64(wr[o]) | (np.int64(wr[o + 1]) << 8) | (np.int64(wr[o + 2]) << 16)
            | (np.int64(wr[o + 3]) << 24))


# ggml_vec_dot_q4_0_q8_0 (AVX2): the q8_0 lanes over the nibbles minus 8
@njit(parallel=True, cache=True, fastmath={"contract"})
def mv_q4_0(w, xq, xd, xs, out, tab):
    rows = w.shape[0]
    n, k = xq.shape
    nb = k // 32
    for c in prange((rows + ROW_CHUNK - 1) // ROW_CHUNK):
        for r in range(c * ROW_CHUNK, min(rows, (c + 1) * ROW_CHUNK)):
            wr = w[r]
            prefetch_row(w, r)
            for i in range(n):
                xr = xq[i]
                a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
                for b in range(nb):
                    o = b * 18
                    l0, l1, l2, l3, l4, l5, l6, l7 = _nib_lanes(wr, o + 2, xr, b * 32, 8)
                    d = np.float32(_f16(tab, wr, o) * xd[i, b])
                    a0 = d * np.float32(l0) + a0
                    a1 = d * np.float32(l1) + a1
                    a2 = d * np.float32(l2) + a2
                    a3 = d * np.float32(l3) + a3
                    a4 = d * np.float32(l4) + a4
                    a5 = d * np.float32(l5) + a5
                    a6 = d * np.float32(l6) + a6
                    a7 = d * np.float32(l7) + a7
                out[i, r] = _hsum8(a0, a1, a2, a3, a4, a5, a6, a7)


# ggml_vec_dot_q4_1_q8_1 (AVX2): unsigned nibbles; the mins through Q8_1's F16 s, summs = fma(m, s, summs),
# added after the hsum
@njit(parallel=True, cache=True, fastmath={"contract"})
def mv_q4_1(w, xq, xd, xs, out, tab):
    rows = w.shape[0]
    n, k = xq.shape
    nb = k // 32
    for c in prange((rows + ROW_CHUNK - 1) // ROW_CHUNK):
        for r in range(c * ROW_CHUNK, min(rows, (c + 1) * ROW_CHUNK)):
            wr = w[r]
            prefetch_row(w, r)
            for i in range(n):
                xr = xq[i]
                a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
                summs = np.float32(0.0)
                for b in range(nb):
                    o = b * 20
                    l0, l1, l2, l3, l4, l5, l6, l7 = _nib_lanes(wr, o + 4, xr, b * 32, 0)
                    summs = _f16(tab, wr, o + 2) * xs[i, b] + summs
                    d = np.float32(_f16(tab, wr, o) * xd[i, b])
                    a0 = d * np.float32(l0) + a0
                    a1 = d * np.float32(l1) + a1
                    a2 = d * np.float32(l2) + a2
                    a3 = d * np.float32(l3) + a3
                    a4 = d * np.float32(l4) + a4
                    a5 = d * np.float32(l5) + a5
                    a6 = d * np.float32(l6) + a6
                    a7 = d * np.float32(l7) + a7
                out[i, r] = _hsum8(a0, a1, a2, a3, a4, a5, a6, a7) + summs


# ggml_vec_dot_q5_0_q8_0 (AVX2): the q8_0 lanes over the signed 5-bit values (nibble | qh bit << 4) - 16
@njit(parallel=True, cache=True, fastmath={"contract"})
def mv_q5_0(w, xq, xd, xs, out, tab):
    rows = w.shape[0]
    n, k = xq.shape
    nb = k // 32
    for c in prange((rows + ROW_CHUNK - 1) // ROW_CHUNK):
        for r in range(c * ROW_CHUNK, min(rows, (c + 1) * ROW_CHUNK)):
            wr = w[r]
            prefetch_row(w, r)
            for i in range(n):
                xr = xq[i]
                a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
                for b in range(nb):
                    o = b * 22
                    l0, l1, l2, l3, l4, l5, l6, l7 = _nib5_lanes(wr, o + 6, _qh(wr, o + 2), xr, b * 32, 16)
                    d = np.float32(_f16(tab, wr, o) * xd[i, b])
                    a0 = d * np.float32(l0) + a0
                    a1 = d * np.float32(l1) + a1
                    a2 = d * np.float32(l2) + a2
                    a3 = d * np.float32(l3) + a3
                    a4 = d * np.float32(l4) + a4
                    a5 = d * np.float32(l5) + a5
                    a6 = d * np.float32(l6) + a6
                    a7 = d * np.float32(l7) + a7
                out[i, r] = _hsum8(a0, a1, a2, a3, a4, a5, a6, a7)


# ggml_vec_dot_q5_1_q8_1 (AVX2): unsigned 5-bit values, the mins as for Q4_1; acc = fma(lane, d_w * d_x, acc)
@njit(parallel=True, cache=True, fastmath={"contract"})
def mv_q5_1(w, xq, xd, xs, out, tab):
    rows = w.shape[0]
    n, k = xq.shape
    nb = k // 32
    for c in prange((rows + ROW_CHUNK - 1) // ROW_CHUNK):
        for r in range(c * ROW_CHUNK, min(rows, (c + 1) * ROW_CHUNK)):
            wr = w[r]
            prefetch_row(w, r)
            for i in range(n):
                xr = xq[i]
                a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
                summs = np.float32(0.0)
                for b in range(nb):
                    o = b * 24
                    l0, l1, l2, l3, l4, l5, l6, l7 = _nib5_lanes(wr, o + 8, _qh(wr, o + 4), xr, b * 32, 0)
                    summs = _f16(tab, wr, o + 2) * xs[i, b] + summs
                    d = np.float32(_f16(tab, wr, o) * xd[i, b])
                    a0 = d * np.float32(l0) + a0
                    a1 = d * np.float32(l1) + a1
                    a2 = d * np.float32(l2) + a2
                    a3 = d * np.float32(l3) + a3
                    a4 = d * np.float32(l4) + a4
                    a5 = d * np.float32(l5) + a5
                    a6 = d * np.float32(l6) + a6
                    a7 = d * np.float32(l7) + a7
                out[i, r] = _hsum8(a0, a1, a2, a3, a4, a5, a6, a7) + summs


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
