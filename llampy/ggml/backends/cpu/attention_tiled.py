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

from .claims import claim, workers
from .simd import (F16_VEC_LANES, f16_at, f32x8_fma_s, f32x8_load, f32x8_store, f32x8_zero, fma32, v16_exp_shifted,
                   v16_fma, v16_hmax, v16_load, v16_max, v16_reduce, v16_scale, v16_store, v16_zero)
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
    n_items = q.shape[0] * q.shape[1] * -(-q.shape[2] // Q_TILE)
    _tiled(np.ascontiguousarray(q, np.float32), kt, vt, k.shape[2], m, out, sc, cap,
           np.ascontiguousarray(slopes, np.float32), np.ascontiguousarray(sinks, np.float32), F16_VEC_LANES,
           workers(n_items))


def _pack(k, v):
    """K transposed per tile of 64 cells, (ke3, n_head_kv, n_tiles, dk, 64), and V (ve3, n_head_kv, n_tiles * 64,
    dv rounded up to 16), both float32 and zero past the cache's end (as ggml zero-pads its last tile)."""
    n_kv, dk = k.shape[2], k.shape[3]
    nt = (n_kv + KV_TILE - 1) // KV_TILE
    dv = v.shape[3]
    kt = np.empty(k.shape[:2] + (nt, dk, KV_TILE), np.float32)
    vt = np.empty(v.shape[:2] + (nt * KV_TILE, dv + (-dv) % 16), np.float32)
    if k.dtype == np.uint16 and v.dtype == np.uint16:      # the usual F16 cache: widened on all threads
        _pack_f16(k.view(np.uint8), v.view(np.uint8), kt, vt, n_kv)
        return kt, vt
    kf = k.astype(np.float32) if k.dtype == np.float32 else k.view(np.float16).astype(np.float32)
    vf = v.astype(np.float32) if v.dtype == np.float32 else v.view(np.float16).astype(np.float32)
    kp = np.zeros(k.shape[:2] + (nt * KV_TILE, dk), np.float32)
    kp[:, :, :n_kv] = kf
    kt[:] = kp.reshape(k.shape[:2] + (nt, KV_TILE, dk)).transpose(0, 1, 2, 4, 3)
    vt[:] = 0
    vt[:, :, :n_kv, :dv] = vf
    return kt, vt


@njit(parallel=True, cache=True, nogil=True)
def _pack_f16(kb, vb, kt, vt, n_kv):
    """``_pack`` of F16 K and V (their bytes: (e3, n_head_kv, n_kv, 2 * d) uint8), per tile on all threads."""
    nt, dk = kt.shape[2], kt.shape[3]
    dv, dvp = vb.shape[3] // 2, vt.shape[3]
    nk = kt.shape[0] * kt.shape[1] * nt
    nv = vt.shape[0] * vt.shape[1] * nt
    m = min(nk, nv)
    for jt in prange(nk + nv):
        # K and V tiles taken in turn, so that each thread's even run has its share of both (the K transposes
        # cost more than the V copies)
        j = np.int64(jt)
        if j < 2 * m:
            it = j // 2 if j % 2 == 0 else nk + j // 2
        else:
            it = j - m if nk > nv else j
        if it < nk:
            t = it % nt
            src = kb[it // nt // kt.shape[1], (it // nt) % kt.shape[1]]
            dst = kt[it // nt // kt.shape[1], (it // nt) % kt.shape[1], t]
            for c in range(KV_TILE):
                cell = t * KV_TILE + c
                if cell < n_kv:
                    for d in range(dk):
                        dst[d, c] = f16_at(src[cell], 2 * d)
                else:
                    for d in range(dk):
                        dst[d, c] = 0
        else:
            iv = it - nk
            t = iv % nt
            src = vb[iv // nt // vt.shape[1], (iv // nt) % vt.shape[1]]
            dst = vt[iv // nt // vt.shape[1], (iv // nt) % vt.shape[1]]
            for c in range(t * KV_TILE, (t + 1) * KV_TILE):
                o = dst[c]
                if c < n_kv:
                    for d in range(dv):
                        o[d] = f16_at(src[c], 2 * d)
                    for d in range(dv, dvp):
                        o[d] = 0
                else:
                    for d in range(dvp):
                        o[d] = 0


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
def _qk1(qr, kb, row, dk):
    """One query row against one tile: per cell an fma chain over the head's dimensions, from 0, into row."""
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
    v16_store(row, 0, a0)
    v16_store(row, 16, a1)
    v16_store(row, 32, a2)
    v16_store(row, 48, a3)


@njit(cache=True, nogil=True, inline="always")
def _qk2(qr, qs, kb, row, ros, dk):
    """``_qk1`` of two rows, each K load shared by both: the tile in halves of 32 cells, so that the eight
    accumulators, the K values and the two queries' dimensions stay in registers."""
    for h in range(0, KV_TILE, 32):
        a0 = v16_zero()
        a1 = v16_zero()
        b0 = v16_zero()
        b1 = v16_zero()
        for d in range(dk):
            kd = kb[d]
            k0 = v16_load(kd, h)
            k1 = v16_load(kd, h + 16)
            x = qr[d]
            y = qs[d]
            a0 = v16_fma(k0, x, a0)
            a1 = v16_fma(k1, x, a1)
            b0 = v16_fma(k0, y, b0)
            b1 = v16_fma(k1, y, b1)
        v16_store(row, h, a0)
        v16_store(row, h + 16, a1)
        v16_store(ros, h, b0)
        v16_store(ros, h + 16, b1)


@njit(cache=True, nogil=True, inline="always")
def _qk6(qt, kb, S, dk):
    """Q·K of six rows (qt: the query rows, S: their score rows) against one tile, 16 cells at a time: twelve
    accumulators (the fma chains overlap), each K load shared by the six rows; each cell's chain as in ``_qk1``."""
    q0, q1, q2, q3, q4, q5 = qt[0], qt[1], qt[2], qt[3], qt[4], qt[5]
    for j in range(0, KV_TILE, 16):
        a0 = a1 = a2 = a3 = a4 = a5 = f32x8_zero()
        b0 = b1 = b2 = b3 = b4 = b5 = f32x8_zero()
        for d in range(dk):
            kd = kb[d]
            u = f32x8_load(kd, j)
            w = f32x8_load(kd, j + 8)
            x = q0[d]
            a0, b0 = f32x8_fma_s(x, u, a0), f32x8_fma_s(x, w, b0)
            x = q1[d]
            a1, b1 = f32x8_fma_s(x, u, a1), f32x8_fma_s(x, w, b1)
            x = q2[d]
            a2, b2 = f32x8_fma_s(x, u, a2), f32x8_fma_s(x, w, b2)
            x = q3[d]
            a3, b3 = f32x8_fma_s(x, u, a3), f32x8_fma_s(x, w, b3)
            x = q4[d]
            a4, b4 = f32x8_fma_s(x, u, a4), f32x8_fma_s(x, w, b4)
            x = q5[d]
            a5, b5 = f32x8_fma_s(x, u, a5), f32x8_fma_s(x, w, b5)
        f32x8_store(S[0], j, a0)
        f32x8_store(S[0], j + 8, b0)
        f32x8_store(S[1], j, a1)
        f32x8_store(S[1], j + 8, b1)
        f32x8_store(S[2], j, a2)
        f32x8_store(S[2], j + 8, b2)
        f32x8_store(S[3], j, a3)
        f32x8_store(S[3], j + 8, b3)
        f32x8_store(S[4], j, a4)
        f32x8_store(S[4], j + 8, b4)
        f32x8_store(S[5], j, a5)
        f32x8_store(S[5], j + 8, b5)


@njit(cache=True, nogil=True, inline="always")
def _scores(row, sc, cap, kv_tile, has_mask, mrow, c0, slope):
    """The tile's Q·K values in row scaled (soft-capped, masked) in place; returns their maximum."""
    for j in range(0, KV_TILE, 16):
        v16_store(row, j, v16_scale(v16_load(row, j), sc))
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
def _pv4(rows, vh, vb, kv_tile, acc, dv8):
    """``_pv1`` of four rows at once over the first dv8 outputs (the head's size rounded up to 8): the same chains,
    each V load shared by the four, 24 outputs at a time (twelve accumulators: the chains overlap, which one row's
    64-long chain of dependent fmas cannot)."""
    r0, r1, r2, r3 = rows[0], rows[1], rows[2], rows[3]
    o0, o1, o2, o3 = acc[0], acc[1], acc[2], acc[3]
    j = 0
    while j + 24 <= dv8:
        a0, a1, a2, a3 = f32x8_load(o0, j), f32x8_load(o1, j), f32x8_load(o2, j), f32x8_load(o3, j)
        b0, b1, b2, b3 = f32x8_load(o0, j + 8), f32x8_load(o1, j + 8), f32x8_load(o2, j + 8), f32x8_load(o3, j + 8)
        e0, e1 = f32x8_load(o0, j + 16), f32x8_load(o1, j + 16)
        e2, e3 = f32x8_load(o2, j + 16), f32x8_load(o3, j + 16)
        for c in range(kv_tile):
            vr = vh[vb + c]
            u = f32x8_load(vr, j)
            w = f32x8_load(vr, j + 8)
            z = f32x8_load(vr, j + 16)
            x = r0[c]
            a0, b0, e0 = f32x8_fma_s(x, u, a0), f32x8_fma_s(x, w, b0), f32x8_fma_s(x, z, e0)
            x = r1[c]
            a1, b1, e1 = f32x8_fma_s(x, u, a1), f32x8_fma_s(x, w, b1), f32x8_fma_s(x, z, e1)
            x = r2[c]
            a2, b2, e2 = f32x8_fma_s(x, u, a2), f32x8_fma_s(x, w, b2), f32x8_fma_s(x, z, e2)
            x = r3[c]
            a3, b3, e3 = f32x8_fma_s(x, u, a3), f32x8_fma_s(x, w, b3), f32x8_fma_s(x, z, e3)
        f32x8_store(o0, j, a0)
        f32x8_store(o1, j, a1)
        f32x8_store(o2, j, a2)
        f32x8_store(o3, j, a3)
        f32x8_store(o0, j + 8, b0)
        f32x8_store(o1, j + 8, b1)
        f32x8_store(o2, j + 8, b2)
        f32x8_store(o3, j + 8, b3)
        f32x8_store(o0, j + 16, e0)
        f32x8_store(o1, j + 16, e1)
        f32x8_store(o2, j + 16, e2)
        f32x8_store(o3, j + 16, e3)
        j += 24
    while j < dv8:
        a0, a1, a2, a3 = f32x8_load(o0, j), f32x8_load(o1, j), f32x8_load(o2, j), f32x8_load(o3, j)
        for c in range(kv_tile):
            u = f32x8_load(vh[vb + c], j)
            a0 = f32x8_fma_s(r0[c], u, a0)
            a1 = f32x8_fma_s(r1[c], u, a1)
            a2 = f32x8_fma_s(r2[c], u, a2)
            a3 = f32x8_fma_s(r3[c], u, a3)
        f32x8_store(o0, j, a0)
        f32x8_store(o1, j, a1)
        f32x8_store(o2, j, a2)
        f32x8_store(o3, j, a3)
        j += 8


ROWS = 4        # query rows whose P·V chains are interleaved (each row's own order)


@njit(parallel=True, cache=True, nogil=True)
def _tiled(q, kt, vt, n_kv, mask, out, sc, cap, slopes, sinks, lanes, n_workers):
    ne3, n_head, n_q, dk = q.shape
    n_head_kv, nt = kt.shape[1], kt.shape[2]
    dv = out.shape[3]
    dvp = vt.shape[3]
    dv8 = dv + (-dv) % 8
    rk = n_head // n_head_kv
    has_mask = mask.shape[3] > 0
    n_qt = (n_q + Q_TILE - 1) // Q_TILE
    n_items = ne3 * n_head * n_qt
    counter = np.zeros(1, np.int64)
    for _ in prange(n_workers):     # each worker takes the next (batch, head, query tile) until none is left
        S = np.empty((Q_TILE, KV_TILE), np.float32)
        acc = np.empty((Q_TILE, dvp), np.float32)
        Ss = np.empty(Q_TILE, np.float32)
        Ms = np.empty(Q_TILE, np.float32)
        seen = np.empty(Q_TILE, np.bool_)
        live = np.empty(Q_TILE, np.bool_)
        while True:
            it = claim(counter)
            if it >= n_items:
                break
            i3 = it // (n_head * n_qt)
            h = (it // n_qt) % n_head
            i0 = (it % n_qt) * Q_TILE
            nr = min(Q_TILE, n_q - i0)
            kh = kt[i3 % kt.shape[0], h // rk]
            vh = vt[i3 % vt.shape[0], h // rk]
            slope = slopes[h]
            acc[:] = 0
            Ss[:] = 0
            Ms[:] = -np.inf
            # ggml's loop order: per tile of the cache, Q·K of the whole query tile, then its softmax, then its
            # P·V (the K tile, then the V tile, stays in L1 through its phase); each row still sees the tiles in
            # order, so its float order is that of a row walking alone
            for t in range(nt):
                c0 = t * KV_TILE
                kv_tile = min(KV_TILE, n_kv - c0)
                kb = kh[t]
                for r in range(nr):
                    seen[r] = True
                    if has_mask:        # a tile this row sees nothing of leaves it as it was
                        mrow = mask[i3 % mask.shape[0], h % mask.shape[1], i0 + r]
                        seen[r] = False
                        for j in range(kv_tile):
                            if slope * mrow[c0 + j] != -np.inf:
                                seen[r] = True
                                break
                # Q·K six rows at a time where six in a row see the tile, else two (any two that see it)
                p = -1
                r = 0
                while r < nr:
                    n6 = 0
                    while n6 < 6 and r + n6 < nr and seen[r + n6]:
                        n6 += 1
                    if n6 == 6:
                        _qk6(q[i3, h, i0 + r:i0 + r + 6], kb, S[r:r + 6], dk)
                        r += 6
                        continue
                    if seen[r]:
                        if p < 0:
                            p = r
                        else:
                            _qk2(q[i3, h, i0 + p], q[i3, h, i0 + r], kb, S[p], S[r], dk)
                            p = -1
                    r += 1
                if p >= 0:
                    _qk1(q[i3, h, i0 + p], kb, S[p], dk)
                for r in range(nr):
                    live[r] = False
                    if not seen[r]:
                        continue
                    mrow = mask[i3 % mask.shape[0], h % mask.shape[1], i0 + r] if has_mask else mask[0, 0, 0]
                    row = S[r]
                    tmax = _scores(row, sc, cap, kv_tile, has_mask, mrow, c0, slope)
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
                # P·V four rows at a time where the four are live
                for g in range(0, nr, ROWS):
                    ng = min(ROWS, nr - g)
                    n_live = 0
                    for r in range(g, g + ng):
                        if live[r]:
                            n_live += 1
                    if n_live == ROWS:
                        _pv4(S[g:g + ROWS], vh, c0, kv_tile, acc[g:g + ROWS], dv8)
                    else:
                        for r in range(g, g + ng):
                            if live[r]:
                                _pv1(S[r], vh, c0, kv_tile, acc[r])
            for r in range(nr):
                i = i0 + r
                S_ = Ss[r]
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
                    S_ = fma32(S_, ms, vs)     # S * ms + vs, contracted by the compiler as in the one_chunk path
                inv = np.float32(1.0) / S_ if S_ != 0 else np.float32(0.0)
                o = out[i3, i, h]
                for j in range(dv):
                    o[j] = ar[j] * inv
