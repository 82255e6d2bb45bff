"""A decode step's products over whole weight rows: the eight-row tiles of ``dot_q32`` (``_tile8``, the same integer
lanes and fma chains, so the same bits as every other form of those kernels) for a server's few activation rows (one
per stream), over whole weight rows instead of ``KSPAN``-block spans (``WHOLE_ROWS_MAX_N``). ``dot_q32._mv_legacy``
hands its rows here first (``mv_whole``); the formats without a whole-row kernel keep dot_q32's tiles.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .claims import claim, workers
from .dot_q32 import (K_Q4_0, K_Q4_1, K_Q8_0, ROW_CHUNK, TILE16, _act_offset, _block, _group_row, _offset_lane_sums,
                      _rows4, _tile8, _tiles_q4_0, _tiles_q4_1, _tiles_q8_0, prefetch_row)
from .simd import f32x8_hsum, f32x8_zero

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


def whole_rows(n8, nb):
    """Whether the eight-row tiles of n8 activation rows of nb blocks run over whole weight rows (``_mv_whole``, for
    the formats that have it: ``WHOLE_KERNELS``)."""
    return not TILE16 and n8 <= WHOLE_ROWS_MAX_N and (n8 <= 8 or nb <= 64)


@njit(cache=True, inline="always")
def _group_rows(kind, xq, n8):
    """``dot_q32._group_activations`` (the same layout) by the calling thread alone: for a decode step's few rows
    the copy is a few microseconds, less than a parallel region of its own costs to start and join."""
    n, k = xq.shape
    nb = k // 32
    xg = np.empty(((n8 + 15) // 16, nb, 512), np.int8)
    flip = _act_offset(kind)
    for i in range(n8):
        _group_row(xg, xq, i, flip)
    return xg


@njit(cache=True, inline="always")
def _mv_whole(w, xq, xd, xs, out, tab, kind, counter, n_workers):
    """``_mv_tiles``' eight-row tiles over whole weight rows, for a decode step's few activation rows
    (``WHOLE_ROWS_MAX_N``): a kernel of its own, where the tiles' span bounds are the constants 0 and nb (inside
    ``_mv_tiles`` as a branch beside the span loop, the same loop ran 1.4x slower at 8 rows, one thread). The rows
    past the last group of eight (9-15, 17-23 streams...) in the same pass over each chunk of weight rows, while
    the chunk is in the first-level cache: four weight rows against one activation row at a time (``_rows4``, the
    decode kernels' chains, whose bits are the tiles'), then the chunk's last rows % 4 one at a time; before, a
    second kernel (``_mv_rest``) read the weights again. All n rows."""
    rows = w.shape[0]
    n, k = xq.shape
    nb = k // 32
    n8 = n - n % 8
    xdT = np.ascontiguousarray(xd.T)
    xsT = np.ascontiguousarray(xs.T)
    xg = _group_rows(kind, xq, n8)
    xls = _offset_lane_sums(kind, xq)
    n_chunks = (rows + ROW_CHUNK - 1) // ROW_CHUNK
    for _ in prange(n_workers):
        dvb = np.empty((nb, 8), np.float32)
        accb = np.empty((9, 8), np.float32)
        while True:
            c = claim(counter)
            if c >= n_chunks:
                break
            r1 = min(rows, (c + 1) * ROW_CHUNK)
            r = c * ROW_CHUNK
            for rr in range(r, r1):
                prefetch_row(w, rr)
            for i in range(0, n8, 8):
                for rr in range(r, r1):
                    _tile8(kind, w[rr], rr, xg[i // 16], xdT, xsT, i, 0, nb, nb, out, dvb, accb)
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


# ggml's Q8_0/Q4_0 have no min: their summs stays 0 and ``hsum + 0`` is the hsum itself
@njit(parallel=True, cache=True, nogil=True)
def _whole_q8_0(w, xq, xd, xs, out, tab, counter, n_workers):
    _mv_whole(w, xq, xd, xs, out, tab, K_Q8_0, counter, n_workers)


@njit(parallel=True, cache=True, nogil=True)
def _whole_q4_0(w, xq, xd, xs, out, tab, counter, n_workers):
    _mv_whole(w, xq, xd, xs, out, tab, K_Q4_0, counter, n_workers)


@njit(parallel=True, cache=True, nogil=True)
def _whole_q4_1(w, xq, xd, xs, out, tab, counter, n_workers):
    _mv_whole(w, xq, xd, xs, out, tab, K_Q4_1, counter, n_workers)


# the whole-row tiles by the span tiles they replace (``whole_rows``); Q5_0 and Q5_1 keep their sixteen-row tiles
WHOLE_KERNELS = {_tiles_q8_0: _whole_q8_0, _tiles_q4_0: _whole_q4_0, _tiles_q4_1: _whole_q4_1}


def mv_whole(tiles, w, xq, xd, xs, out, tab):
    """``dot_q32._mv_legacy``'s activation rows (n8 = n - n % 8 > 0 of them in groups of eight, fewer than
    ``ROWS16_MIN_N`` or no sixteen-row tiles on this CPU) on the whole-row kernel that replaces its span tiles
    ``tiles``, where there is one and ``whole_rows`` holds: the number of activation rows computed from the start,
    all n (0: none, the caller's tiles and decode form take them)."""
    n, k = xq.shape
    n8 = n - n % 8
    whole = WHOLE_KERNELS.get(tiles) if whole_rows(n8, k // 32) else None
    if whole is None:
        return 0
    whole(w, xq, xd, xs, out, tab, np.zeros(1, np.int64), workers(-(-w.shape[0] // ROW_CHUNK)))
    return n

