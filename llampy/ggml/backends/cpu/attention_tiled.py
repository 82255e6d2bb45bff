"""FLASH_ATTN_EXT for many queries (n_q >= 64) in the float order of ggml-cpu's tiled kernel
(ggml_compute_forward_flash_attn_ext_tiled, simd_gemm), bit for bit.

ggml walks the cache in tiles of 64 cells. Per query row and tile: each Q·K value is one fma chain over the head's
dimensions starting from 0, then multiplied by the scale (and soft-capped), -inf past the cache's end, plus the
mask times the ALiBi slope; the tile's maximum updates the running one (the accumulator and the sum multiplied by
expf(old - new) when it grows); the tile's exponentials are ggml_v_expf(x - max), summed per register (eight lanes
on AVX2, sixteen on AVX-512, in that register's reduction order) into a double that is added to the float sum; the
values accumulate as one fma chain per output over the tile's cells, continuing the previous tiles' accumulator.
At the end the row is multiplied by 1 / sum. Rows are independent, so how ggml groups queries into tiles and
threads changes nothing; a tile where a row sees no cell leaves that row as it was, whether ggml skips the tile
for all its rows or only zeroes that row.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .simd import (F16_VEC_LANES, fma32, v16_exp_shifted, v16_fma, v16_hmax, v16_load, v16_max, v16_reduce,
                   v16_scale, v16_store, v16_zero)
from .softmax import expf

KV_TILE = 64        # GGML_FA_TILE_KV
Q_TILE = 64         # GGML_FA_TILE_Q: the tiled path is taken from this many queries on


def flash_attn_tiled(q, k, v, mask, out, scale: float, softcap: float, slopes, sinks) -> None:
    """q (ne3, n_head, n_q, dk) float32; k (ke3, n_head_kv, n_kv, dk), v (ve3, n_head_kv, n_kv, dv) float32 or F16
    bits (uint16); mask float32 (m3, m2, >= n_q, n_kv) or None; out (ne3, n_q, n_head, dv) float32; slopes float32
    (n_head,) (ALiBi, ones without); sinks float32 (n_head,) or empty. ``scale``, ``softcap``: the op's parameters."""
    sc = np.float32(scale)
    cap = np.float32(softcap)
    if cap != 0:
        sc = np.float32(sc / cap)       # ggml: scale /= logit_softcap, in float
    kt, vt = _pack(np.ascontiguousarray(k), np.ascontiguousarray(v))
    m = np.zeros((1, 1, 1, 0), np.float32) if mask is None else np.ascontiguousarray(mask, np.float32)
    _tiled(np.ascontiguousarray(q, np.float32), kt, vt, k.shape[2], m, out, sc, cap,
           np.ascontiguousarray(slopes, np.float32), np.ascontiguousarray(sinks, np.float32), F16_VEC_LANES)


def _pack(k, v):
    """K transposed per tile of 64 cells, (ke3, n_head_kv, n_tiles, dk, 64), and V (ve3, n_head_kv, n_tiles * 64,
    dv rounded up to 16), both float32 and zero past the cache's end (as ggml zero-pads its last tile)."""
    n_kv, dk = k.shape[2], k.shape[3]
    nt = (n_kv + KV_TILE - 1) // KV_TILE
    kf = k.astype(np.float32) if k.dtype == np.float32 else k.view(np.float16).astype(np.float32)
    vf = v.astype(np.float32) if v.dtype == np.float32 else v.view(np.float16).astype(np.float32)
    kp = np.zeros(k.shape[:2] + (nt * KV_TILE, dk), np.float32)
    kp[:, :, :n_kv] = kf
    kt = np.ascontiguousarray(kp.reshape(k.shape[:2] + (nt, KV_TILE, dk)).transpose(0, 1, 2, 4, 3))
    dv = v.shape[3]
    vp = np.zeros(v.shape[:2] + (nt * KV_TILE, dv + (-dv) % 16), np.float32)
    vp[:, :, :n_kv, :dv] = vf
    return kt, vp


@njit(cache=True, nogil=True, inline="always")
def _chunk_sum(row, lanes):
    """ggml_vec_soft_max_f32's sum of 64 exponentials: per register of ``lanes`` values its horizontal sum (AVX2:
    lanes l + l+4, then l + l+2, then 0 + 1; AVX-512: _mm512_reduce_add_ps), each added to a double."""
    tot = np.float64(0.0)
    if lanes == 16:
        for j in range(0, KV_TILE, 16):
            tot += np.float64(v16_reduce(v16_load(row, j)))
    else:
        for j in range(0, KV_TILE, 8):
            a0 = row[j] + row[j + 4]
            a1 = row[j + 1] + row[j + 5]
            a2 = row[j + 2] + row[j + 6]
            a3 = row[j + 3] + row[j + 7]
            tot += np.float64((a0 + a2) + (a1 + a3))
    return tot


@njit(cache=True, nogil=True, inline="always")
def _scores(qr, kb, row, dk, sc, cap, kv_tile, has_mask, mrow, c0, slope):
    """One query row against one tile: the scaled (soft-capped, masked) scores into row; returns their maximum."""
    # Q·K: per cell an fma chain over the head's dimensions, from 0
    a0 = v16_zero()
    a1 = v16_zero()
    a2 = v16_zero()
    a3 = v16_zero()
    for d in range(dk):
        x = qr[d]
        kd = kb[d]
        a0 = v16_fma(v16_load(kd, 0), x, a0)
        a1 = v16_fma(v16_load(kd, 16), x, a1)
        a2 = v16_fma(v16_load(kd, 32), x, a2)
        a3 = v16_fma(v16_load(kd, 48), x, a3)
    v16_store(row, 0, v16_scale(a0, sc))
    v16_store(row, 16, v16_scale(a1, sc))
    v16_store(row, 32, v16_scale(a2, sc))
    v16_store(row, 48, v16_scale(a3, sc))
    if cap != 0:
        for j in range(KV_TILE):
            row[j] = np.float32(np.tanh(row[j])) * cap
    for j in range(kv_tile, KV_TILE):
        row[j] = -np.inf
    if has_mask:
        for j in range(kv_tile):
            row[j] = row[j] + slope * mrow[c0 + j]
    vm = v16_max(v16_max(v16_load(row, 0), v16_load(row, 16)),
                 v16_max(v16_load(row, 32), v16_load(row, 48)))
    return v16_hmax(vm)


@njit(cache=True, nogil=True, inline="always")
def _pv1(row, vh, vb, kv_tile, acc):
    """P·V of one row: per output an fma chain over the tile's cells, continuing the accumulator."""
    for j in range(0, acc.shape[0], 16):
        av = v16_load(acc, j)
        for c in range(kv_tile):
            av = v16_fma(v16_load(vh[vb + c], j), row[c], av)
        v16_store(acc, j, av)


@njit(cache=True, nogil=True, inline="always")
def _pv4(rows, vh, vb, kv_tile, acc):
    """``_pv1`` of four rows at once: the same chains, each V load shared by the four (the chains overlap, which a
    single row's 64-long chain of dependent fmas cannot)."""
    r0, r1, r2, r3 = rows[0], rows[1], rows[2], rows[3]
    for j in range(0, acc.shape[1], 16):
        b0 = v16_load(acc[0], j)
        b1 = v16_load(acc[1], j)
        b2 = v16_load(acc[2], j)
        b3 = v16_load(acc[3], j)
        for c in range(kv_tile):
            vv = v16_load(vh[vb + c], j)
            b0 = v16_fma(vv, r0[c], b0)
            b1 = v16_fma(vv, r1[c], b1)
            b2 = v16_fma(vv, r2[c], b2)
            b3 = v16_fma(vv, r3[c], b3)
        v16_store(acc[0], j, b0)
        v16_store(acc[1], j, b1)
        v16_store(acc[2], j, b2)
        v16_store(acc[3], j, b3)


ROWS = 4        # query rows walked through the cache together (their P·V chains interleaved; each row's own order)


@njit(parallel=True, cache=True, nogil=True)
def _tiled(q, kt, vt, n_kv, mask, out, sc, cap, slopes, sinks, lanes):
    ne3, n_head, n_q, dk = q.shape
    n_head_kv, nt = kt.shape[1], kt.shape[2]
    dv = out.shape[3]
    dvp = vt.shape[3]
    rk = n_head // n_head_kv
    has_mask = mask.shape[3] > 0
    n_qt = (n_q + Q_TILE - 1) // Q_TILE
    for it in prange(ne3 * n_head * n_qt):
        i3 = it // (n_head * n_qt)
        h = (it // n_qt) % n_head
        i0 = (it % n_qt) * Q_TILE
        i1 = min(i0 + Q_TILE, n_q)
        kh = kt[i3 % kt.shape[0], h // rk]
        vh = vt[i3 % vt.shape[0], h // rk]
        slope = slopes[h]
        rows = np.empty((ROWS, KV_TILE), np.float32)
        acc = np.empty((ROWS, dvp), np.float32)
        Ss = np.empty(ROWS, np.float32)
        Ms = np.empty(ROWS, np.float32)
        live = np.empty(ROWS, np.bool_)
        for g0 in range(i0, i1, ROWS):
            nr = min(ROWS, i1 - g0)
            acc[:] = 0
            Ss[:] = 0
            Ms[:] = -np.inf
            for t in range(nt):
                c0 = t * KV_TILE
                kv_tile = min(KV_TILE, n_kv - c0)
                n_live = 0
                for r in range(nr):
                    live[r] = False
                    i = g0 + r
                    mrow = mask[i3 % mask.shape[0], h % mask.shape[1], i] if has_mask else mask[0, 0, 0]
                    if has_mask:        # a tile this row sees nothing of leaves it as it was
                        seen = False
                        for j in range(kv_tile):
                            if slope * mrow[c0 + j] != -np.inf:
                                seen = True
                                break
                        if not seen:
                            continue
                    row = rows[r]
                    tmax = _scores(q[i3, h, i], kh[t], row, dk, sc, cap, kv_tile, has_mask, mrow, c0, slope)
                    if tmax == -np.inf:
                        continue
                    M = Ms[r]
                    Mnew = max(M, tmax)
                    if Mnew > M:
                        ms = expf(M - Mnew)
                        ar = acc[r]
                        for j in range(0, dvp, 16):
                            v16_store(ar, j, v16_scale(v16_load(ar, j), ms))
                        Ss[r] = Ss[r] * ms
                    Ms[r] = Mnew
                    for j in range(0, KV_TILE, 16):
                        v16_store(row, j, v16_exp_shifted(v16_load(row, j), Mnew))
                    Ss[r] = np.float32(np.float64(Ss[r]) + _chunk_sum(row, lanes))
                    live[r] = True
                    n_live += 1
                if n_live == ROWS:
                    _pv4(rows, vh, c0, kv_tile, acc)
                else:
                    for r in range(nr):
                        if live[r]:
                            _pv1(rows[r], vh, c0, kv_tile, acc[r])
            for r in range(nr):
                i = g0 + r
                S = Ss[r]
                M = Ms[r]
                ar = acc[r]
                if sinks.shape[0] > 0:
                    s = sinks[h]
                    ms = np.float32(1.0)
                    vs = np.float32(1.0)
                    if s > M:
                        ms = expf(M - s)
                        for j in range(0, dvp, 16):
                            v16_store(ar, j, v16_scale(v16_load(ar, j), ms))
                    else:
                        vs = expf(s - M)
                    S = fma32(S, ms, vs)     # S * ms + vs, contracted by the compiler as in the one_chunk path
                inv = np.float32(1.0) / S if S != 0 else np.float32(0.0)
                o = out[i3, i, h]
                for j in range(dv):
                    o[j] = ar[j] * inv
