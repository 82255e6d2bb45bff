"""A decode step's products over whole weight rows: the eight-row tiles of ``dot_q32`` (``_tile8``, the same integer
lanes and fma chains, so the same bits as every other form of those kernels) for a server's few activation rows (one
per stream), over whole weight rows instead of ``KSPAN``-block spans (``WHOLE_ROWS_MAX_N``). ``dot_q32._mv_legacy``
hands its rows here first (``mv_whole``); the formats without a whole-row kernel keep dot_q32's tiles.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .claims import claim, workers
from .direct import Direct, prange_only
from .dot_q32 import (K_Q4_0, K_Q4_1, K_Q8_0, ROW_CHUNK, ROWS16_MIN_N, TILE16, _act_offset, _block, _block_bytes, _group_row,
                      _offset_lane_sums, _rows4, _signed, _tile8, _tile16, _tiles_q4_0, _tiles_q4_1, _tiles_q8_0, _wblock,
                      prefetch_row)
from .simd import (ROWS16, f16_at, f32x8_add, f32x8_fma, f32x8_fma_s, f32x8_hsum, f32x8_hsum8, f32x8_load, f32x8_scale,
                   f32x8_store, f32x8_zero, i32x8_to_f32x8, wdot, wsum_neg128, xdot)

# Up to this many activation rows (a server's decode steps: one row per stream) the eight-row tiles take whole weight
# rows (``whole_rows``, ``_mv_whole``) where the CPU has sixteen vector registers: the span form's accumulators kept
# in a buffer between spans, and its last short span (k = 576: 16 + 2 blocks), made Q4_1's eight-row tiles 1.7x
# their whole-row time. One thread, us per activation row, spans or sixteen-row tiles -> whole rows: Q4_1
# 1536 x 576 n = 8 37.4 -> 22.0, n = 32 25.2 -> 20.9; 2048 x 2048 n = 8 206 -> 105, n = 32 120 -> 114; Q8_0
# 1536 x 576 n = 8 28.2 -> 24.6, 49152 x 576 n = 32 907 -> 796; Q4_0 576 x 1536 n = 8 36.0 -> 26.3. Not for Q5_0 /
# Q5_1 (their sixteen-row tiles stay ahead: 576 x 1536 n = 32 31.3 vs 38.3), nor past 64 blocks a row with more than
# one group (1024 x 4608 n = 32: Q8_0 145 -> 158, the group's activations no longer stay in the first-level cache),
# nor for prompts (n = 512 the spans keep their lead: 1024 x 2048 Q8_0 66 vs 73).
WHOLE_ROWS_MAX_N = 32
# The activation rows past the last group of eight (m = n % 8: a step of a few streams, a speculative check of a few
# drafted tokens, the streams past a multiple of eight) take a tile of four (``_tile4``) from PAD4[kind] of them
# (up to four), one of eight from PAD8[kind], their lanes past n zero; the others go one at a time (the decode chains,
# ``_rows4``; below eight rows dot_q32's decode form, ``few_rows``). Each row's numbers are the same whatever the
# tile (the batch-invariance tests). Measured on an AVX2 host, quiet (one thread, CPU us per activation row,
# benchmarks/README.md): Q4_1 1536 x 576 at n = 4 / 5 / 6 / 7 66.0 / 63.2 / 65.3 / 63.0 -> 54.0 / 54.6 / 45.7 / 39.2,
# 34.0 at n = 8; the tile of four costs 0.8 of the tile of eight, so at 2-3 rows the decode form stays (68.1, 62.9).
# Q8_0's and Q4_0's tiles are no cheaper a row than their decode form on AVX2 (Q8_0 49152 x 576: 1186 at n = 7,
# 1282 at n = 8): never.
PAD4 = (8, 4, 8, 8, 8)      # by kind: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (8: never)
PAD8 = (8, 5, 8, 8, 8)
# By kind, whether the groups of sixteen activation rows (16-32 streams) take the sixteen-row tile (``_tile16``: each
# weight block decoded once for sixteen pairs, the accumulators past AVX2's sixteen registers on the stack) rather
# than two of eight. Q4_1 at n = 32, two threads, quiet, us a call, eight-row -> sixteen-row tiles: 192 x 576
# 87.5 -> 81.1, 576 x 576 231.7 -> 197.9, 1536 x 576 581.9 -> 497.3, 576 x 1536 658.2 -> 542.6 (one thread 576 x
# 576 452 -> 358, 576 x 1536 1192 -> 914); in a noisier take 0-15% less on most rows at n = 16-32, one pass of
# 1536 x 576 slower (n = 16: 345 -> 497), the other not. Not Q8_0 on AVX2 (its sign trick's operands spill with
# them, as in ``dot_q32.TILE16``), nor Q4_0 (not measured: its weights take the repacked rows).
WHOLE16 = (False, True, False, False, False)


@njit(cache=True)
def tile_rows(kind, n):
    """(rows in eight-row tiles, rows in a tile of four): the n activation rows' tiles, the last padded with zero
    rows (``PAD4``, ``PAD8``); the rows past both go one at a time."""
    n8 = n - n % 8
    m = n - n8
    if m >= PAD8[kind] and n8 + 8 <= WHOLE_ROWS_MAX_N:
        return n8 + 8, 0
    if PAD4[kind] <= m <= 4:
        return n8, 4
    return n8, 0


def whole_rows(n_t, nb):
    """Whether the eight-row tiles of n_t activation rows of nb blocks run over whole weight rows (``_mv_whole``, for
    the formats that have it: ``WHOLE_KERNELS``)."""
    return not TILE16 and n_t <= WHOLE_ROWS_MAX_N and (n_t <= 8 or nb <= 64)


def few_rows(name, n, k):
    """Whether a product of 1 < n < 8 activation rows of a format named ``name`` ('q4_1') goes to the whole-row
    tiles (``mv_whole``) rather than the decode form alone (``dot_q32.REST_KERNELS``)."""
    kind = WHOLE_KINDS.get(name)
    return kind is not None and sum(tile_rows(kind, n)) > 0 and whole_rows(8, k // 32)


@njit(cache=True, inline="always")
def _group_rows(kind, xq, n_t):
    """``dot_q32._group_activations`` (the same layout) for the tiles' n_t rows, by the calling thread alone: for a
    decode step's few rows the copy is a few microseconds, less than a parallel region of its own costs to start
    and join. The rows of the last tile past the activation rows (``PAD_MIN``) are zero."""
    n, k = xq.shape
    nb = k // 32
    xg = np.zeros(((n_t + 15) // 16, nb, 512), np.int8)
    flip = _act_offset(kind)
    for i in range(min(n, n_t)):
        _group_row(xg, xq, i, flip)
    return xg


@njit(cache=True, inline="always")
def _columns(x, n_t):
    """x.T (n, nb -> nb, n_t) for the tiles' eight-lane loads of a block's scales, the columns past n zero."""
    n, nb = x.shape
    t = np.zeros((nb, n_t), np.float32)
    for i in range(min(n, n_t)):
        for b in range(nb):
            t[b, i] = x[i, b]
    return t


@njit(cache=True, inline="always")
def _tile4(kind, wr, xg, xdT, xsT, i, nb, dvb, lanes):
    """``dot_q32._tile8`` for the four activation rows i..i+3 (i % 8 == 0, xdT and xsT eight columns from i): the
    same lanes and fma chains for each pair, the weight block decoded once for four; lanes[0:4] = the dot products
    (``f32x8_hsum8`` of the four accumulators and four zeros: each lane's additions are its own)."""
    j0 = i % 16
    bb = _block_bytes(kind)
    for b in range(nb):
        f32x8_store(dvb[b], 0, f32x8_scale(f32x8_load(xdT[b], i), f16_at(wr, b * bb)))
    a0 = a1 = a2 = a3 = f32x8_zero()
    sv = f32x8_zero()
    for b in range(nb):
        q = _wblock(kind, wr, b, False)
        xb, dvr = xg[b], dvb[b]
        if _act_offset(kind):
            c = wsum_neg128(q)
            a0 = f32x8_fma(dvr[0], i32x8_to_f32x8(xdot(c, q, xb, j0 * 32)), a0)
            a1 = f32x8_fma(dvr[1], i32x8_to_f32x8(xdot(c, q, xb, (j0 + 1) * 32)), a1)
            a2 = f32x8_fma(dvr[2], i32x8_to_f32x8(xdot(c, q, xb, (j0 + 2) * 32)), a2)
            a3 = f32x8_fma(dvr[3], i32x8_to_f32x8(xdot(c, q, xb, (j0 + 3) * 32)), a3)
        elif _signed(kind):
            a0 = f32x8_fma(dvr[0], i32x8_to_f32x8(wdot(q, xb, j0 * 32, True)), a0)
            a1 = f32x8_fma(dvr[1], i32x8_to_f32x8(wdot(q, xb, (j0 + 1) * 32, True)), a1)
            a2 = f32x8_fma(dvr[2], i32x8_to_f32x8(wdot(q, xb, (j0 + 2) * 32, True)), a2)
            a3 = f32x8_fma(dvr[3], i32x8_to_f32x8(wdot(q, xb, (j0 + 3) * 32, True)), a3)
        else:               # Q4_1, Q5_1: the min at byte 2 of the block, the four mins as one vector fma
            sv = f32x8_fma_s(f16_at(wr, b * bb + 2), f32x8_load(xsT[b], i), sv)
            a0 = f32x8_fma(dvr[0], i32x8_to_f32x8(wdot(q, xb, j0 * 32, False)), a0)
            a1 = f32x8_fma(dvr[1], i32x8_to_f32x8(wdot(q, xb, (j0 + 1) * 32, False)), a1)
            a2 = f32x8_fma(dvr[2], i32x8_to_f32x8(wdot(q, xb, (j0 + 2) * 32, False)), a2)
            a3 = f32x8_fma(dvr[3], i32x8_to_f32x8(wdot(q, xb, (j0 + 3) * 32, False)), a3)
    z = f32x8_zero()
    f32x8_store(lanes, 0, f32x8_add(f32x8_hsum8(a0, a1, a2, a3, z, z, z, z), sv))


@njit(cache=True, inline="always")
def _mv_whole(w, xq, xd, xs, out, tab, kind, counter, n_workers):
    """``_mv_tiles``' eight-row tiles over whole weight rows, for a decode step's few activation rows
    (``WHOLE_ROWS_MAX_N``): a kernel of its own, where the tiles' span bounds are the constants 0 and nb (inside
    ``_mv_tiles`` as a branch beside the span loop, the same loop ran 1.4x slower at 8 rows, one thread). The rows
    past the last group of eight in the same pass over each chunk of weight rows, while the chunk is in the
    first-level cache (``tile_rows``): a tile of eight or four with zero rows past n, or else four weight rows
    against one activation row at a time (``_rows4``, the decode kernels' chains, whose bits are the tiles'), then
    the chunk's last rows % 4 one at a time; before, a second kernel (``_mv_rest``) read the weights again. All n
    rows. The groups of sixteen activation rows take ``_tile16`` where ``WHOLE16`` says, the rest ``_tile8``."""
    rows = w.shape[0]
    n, k = xq.shape
    nb = k // 32
    n8 = n - n % 8
    n16 = n8 - n8 % 16 if WHOLE16[kind] else 0
    n_t, n4 = tile_rows(kind, n)
    n_c = n8 + 8 if n_t > n8 or n4 else n8       # the columns the tiles load (eight from each tile's first row)
    xdT = _columns(xd, n_c)
    xsT = _columns(xs, n_c)
    xg = _group_rows(kind, xq, n_c)
    xls = _offset_lane_sums(kind, xq)
    n_chunks = (rows + ROW_CHUNK - 1) // ROW_CHUNK
    counter[0] = 0          # a plan's bound call passes the same counter every run
    for _ in prange(n_workers):
        dvb = np.empty((nb, 8), np.float32)
        dv2 = np.empty((nb, 2, 8), np.float32)
        accb = np.empty((9, 8), np.float32)
        ob = np.empty((n_c, ROW_CHUNK), np.float32)
        lanes = np.empty(8, np.float32)
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
                for rr in range(r, r1):
                    _tile8(kind, w[rr], rr, xg[i // 16], xdT, xsT, i, 0, nb, nb, out, dvb, accb)
            if n_t > n8:        # the last rows in a tile of eight of their own, its rows past n zero: through ob
                for rr in range(r, r1):
                    _tile8(kind, w[rr], rr - r, xg[n8 // 16], xdT, xsT, n8, 0, nb, nb, ob, dvb, accb)
                for i in range(n8, n):
                    for rr in range(r, r1):
                        out[i, rr] = ob[i, rr - r]
                continue
            if n4:              # a tile of four, its rows past n zero
                for rr in range(r, r1):
                    _tile4(kind, w[rr], xg[n8 // 16], xdT, xsT, n8, nb, dvb, lanes)
                    for i in range(n8, n):
                        out[i, rr] = lanes[i - n8]
                continue
            r4 = r + (r1 - r) // 4 * 4
            for i in range(n8, n):
                xr, lr, xdr, xsr, orow = xq[i], xls[i], xd[i], xs[i], out[i]
                for rr in range(r, r4, 4):
                    _rows4(kind, w, rr, xr, xdr, xsr, lr, nb, orow, rr)
                for rr in range(r4, r1):
                    wr = w[rr]
                    a = f32x8_zero()
                    sm = np.float32(0.0)
                    for b in range(nb):
                        a, sm = _block(kind, tab, wr, b, xr, xdr[b], xsr[b], lr, a, sm)
                    orow[rr] = f32x8_hsum(a) + sm


# ggml's Q8_0/Q4_0 have no min: their summs stays 0 and ``hsum + 0`` is the hsum itself. One parallel region a call,
# the prange's (``direct.prange_only``): the activations' layout before it stays on the calling thread.
@njit(parallel=prange_only(), cache=True, nogil=True)
def _whole_q8_0(w, xq, xd, xs, out, tab, counter, n_workers):
    _mv_whole(w, xq, xd, xs, out, tab, K_Q8_0, counter, n_workers)


@njit(parallel=prange_only(), cache=True, nogil=True)
def _whole_q4_0(w, xq, xd, xs, out, tab, counter, n_workers):
    _mv_whole(w, xq, xd, xs, out, tab, K_Q4_0, counter, n_workers)


@njit(parallel=prange_only(), cache=True, nogil=True)
def _whole_q4_1(w, xq, xd, xs, out, tab, counter, n_workers):
    _mv_whole(w, xq, xd, xs, out, tab, K_Q4_1, counter, n_workers)


# the whole-row tiles by the span tiles they replace (``whole_rows``); Q5_0 and Q5_1 keep their sixteen-row tiles
WHOLE_KERNELS = {_tiles_q8_0: _whole_q8_0, _tiles_q4_0: _whole_q4_0, _tiles_q4_1: _whole_q4_1}
WHOLE_KINDS = {"q8_0": K_Q8_0, "q4_0": K_Q4_0, "q4_1": K_Q4_1}
_WHOLE_BY_NAME = {"q8_0": _whole_q8_0, "q4_0": _whole_q4_0, "q4_1": _whole_q4_1}
_KINDS = {_tiles_q8_0: K_Q8_0, _tiles_q4_0: K_Q4_0, _tiles_q4_1: K_Q4_1}


def _takes(kind, n: int, k: int) -> bool:
    """Whether the whole-row kernel of ``kind`` takes n activation rows of k values: a tile takes some of them
    (``tile_rows``) and ``whole_rows`` holds."""
    n_t, n4 = tile_rows(kind, n)
    return bool(n_t or n4) and whole_rows(max(n_t, 8), k // 32)


def mv_whole(tiles, w, xq, xd, xs, out, tab):
    """``dot_q32._mv_legacy``'s activation rows (n >= 2; fewer than ``ROWS16_MIN_N`` in groups of eight, or no
    sixteen-row tiles on this CPU) on the whole-row kernel that replaces its span tiles ``tiles``, where there is
    one, ``whole_rows`` holds and a tile takes some of them (``tile_rows``): the number of activation rows computed
    from the start, all n (0: none, the caller's tiles and decode form take them)."""
    n, k = xq.shape
    whole = WHOLE_KERNELS.get(tiles)
    if whole is None or not _takes(_KINDS[tiles], n, k):
        return 0
    whole(w, xq, xd, xs, out, tab, np.zeros(1, np.int64), workers(-(-w.shape[0] // ROW_CHUNK)))
    return n


def whole_call(name, w, xq, xd, xs, out, tab):
    """A plan's product ``dot_q32.mv_<name>(w, xq, xd, xs, out, tab)`` as one ``Direct`` call of its whole-row kernel,
    where ``_mv_legacy`` would hand all n activation rows to ``mv_whole`` (n >= 2, no sixteen-row tiles for them on
    this CPU, ``mv_whole``'s conditions); else None. The same kernel and arguments, so the same bits; the plan's
    fast run skips the three Python functions and the dispatcher's typing in between (~4 us a product, ~210
    products in a SmolLM2 decode step). Its chunk counter is bound once (the kernel zeroes it) and its worker count
    is the thread count at binding (a later, narrower pool runs the extra workers' empty claims)."""
    n, k = xq.shape
    whole = _WHOLE_BY_NAME.get(name)
    if (whole is None or n < 2 or (n - n % 8 >= ROWS16_MIN_N and ROWS16 and w.shape[0] >= 16)
            or not _takes(WHOLE_KINDS[name], n, k)):
        return None
    return Direct(whole, w, xq, xd, xs, out, tab, np.zeros(1, np.int64), workers(-(-w.shape[0] // ROW_CHUNK)))
