"""The IQ1 / IQ2 / IQ3 quantizers: ggml-quants.c's quantize_row_iq{2_xxs,2_xs,2_s,3_xxs,3_s,1_s,1_m}_impl, the
searches over the lattice grids, byte for byte (what ggml_quantize_chunk writes for llama-quantize).

The searches work on levels l (0..2 on the 2-bit grids and IQ1's ternary one, 0..7 on the 3-bit grids) valued
2l + 1. A point is looked up by its level code (2 or 3 bits per coordinate) in ``kmap``; a code that is not on the
grid maps to its list of nearest grid points, as iq2xs_init_impl / iq3xs_init_impl build it: every grid point at
one of the ``nwant`` smallest distinct squared distances, by distance then index. The level grids are the decoding
tables' values ranked (they equal ggml's kgrid_* tables; a test checks it).

IQ2_XXS, IQ2_XS and IQ1_S need an importance matrix (ggml asserts); IQ2_S, IQ3_XXS, IQ3_S and IQ1_M have their own
weights without one. Two ggml quirks kept on purpose, since they decide the bytes: IQ3_S does not advance its qs and
signs pointers past an all-zero group of 32, and IQ3_XXS flips only the first four sign groups on a negative scale.
"""
from __future__ import annotations

import threading

import numpy as np

from . import quants_tables as tab
from .quants_base import F32, njit, to_f16_bytes
from .types import GGMLType, QK_K, TYPE_TRAITS

T = GGMLType

FLT_MAX = F32(3.4028234663852886e38)
# quant_weights is required by these (ggml_quantize_requires_imatrix)
REQUIRES_IMATRIX = frozenset({T.IQ2_XXS, T.IQ2_XS, T.IQ1_S})
SEARCH_TYPES = frozenset({T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M})


# ------------------------------------------------------------------------------------------------ grids

@njit(cache=True)
def _code(levels, j, bits):
    u = 0
    for k in range(levels.shape[1]):
        u |= int(levels[j, k]) << (bits * k)
    return u


@njit(cache=True)
def _coord_dist2(levels, bits):
    """D[k, v, j] = squared distance along coordinate k between level v (2v) and grid point j's level, so a code's
    squared distances to every grid point are a sum of dim rows (SIMD over j)."""
    ngrid, dim = levels.shape
    D = np.empty((dim, 1 << bits, ngrid), np.int32)
    for k in range(dim):
        for v in range(1 << bits):
            for j in range(ngrid):
                diff = 2 * np.int32(levels[j, k]) - 2 * v
                D[k, v, j] = diff * diff
    return D


@njit(cache=True)
def _neighbour_dists(D, i, bits, nwant, d2, vals):
    """d2 = code i's squared distances to every grid point; vals = their nwant smallest distinct values, ascending
    (fewer if there are fewer). Returns how many."""
    dim, _, ngrid = D.shape
    mask = (1 << bits) - 1
    row = D[0, i & mask]
    for j in range(ngrid):
        d2[j] = row[j]
    for k in range(1, dim):
        row = D[k, (i >> (bits * k)) & mask]
        for j in range(ngrid):
            d2[j] += row[j]
    big = np.int32(1 << 30)
    prev = np.int32(-1)
    nv = 0
    for t in range(nwant):
        m = big
        for j in range(ngrid):
            v = d2[j]
            m = min(m, v if v > prev else big)
        if m == big:
            break
        vals[t] = m
        prev = m
        nv += 1
    return nv


@njit(cache=True)
def _build_neighbours(levels, bits, kmap_size, nwant):
    """kmap [kmap_size] (grid index, or -(offset + 1) into nb) and nb: per off-grid code, its count then indices"""
    ngrid = levels.shape[0]
    kmap = np.full(kmap_size, -1, np.int32)
    for j in range(ngrid):
        kmap[_code(levels, j, bits)] = j
    D = _coord_dist2(levels, bits)
    d2 = np.empty(ngrid, np.int32)
    vals = np.empty(nwant, np.int32)
    counts = np.zeros(kmap_size, np.int32)
    total = 0
    for i in range(kmap_size):
        if kmap[i] >= 0:
            continue
        nv = _neighbour_dists(D, i, bits, nwant, d2, vals)
        last = vals[nv - 1]
        n = 0
        for j in range(ngrid):
            n += np.int32(d2[j] <= last)
        counts[i] = n
        total += 1 + n
    nb = np.empty(total, np.uint16)
    off = 0
    for i in range(kmap_size):
        if kmap[i] >= 0:
            continue
        nv = _neighbour_dists(D, i, bits, nwant, d2, vals)
        kmap[i] = -(off + 1)
        nb[off] = counts[i]
        off += 1
        # by distance, then index
        for t in range(nv):
            for j in range(ngrid):
                if d2[j] == vals[t]:
                    nb[off] = j
                    off += 1
    return kmap, nb


def _levels(decode_bytes) -> np.ndarray:
    """a decoding grid [n, dim] -> its levels (rank of each value among the grid's distinct values)"""
    return np.searchsorted(np.unique(decode_bytes), decode_bytes).astype(np.int8)


# type -> (decoding grid, bits per level, kmap size, nwant) as iq2xs_init_impl / iq3xs_init_impl
_GRID_SPEC = {
    T.IQ2_XXS: (tab.IQ2XXS_GRID_BYTES, 2, 43692, 2), T.IQ2_XS: (tab.IQ2XS_GRID_BYTES, 2, 43692, 2),
    T.IQ2_S: (tab.IQ2S_GRID_BYTES, 2, 43692, 1), T.IQ1_S: (tab.IQ1S_GRID_BYTES, 2, 43692, 3),
    T.IQ1_M: (tab.IQ1S_GRID_BYTES, 2, 43692, 3), T.IQ3_XXS: (tab.IQ3XXS_GRID_BYTES, 3, 4096, 2),
    T.IQ3_S: (tab.IQ3S_GRID_BYTES, 3, 4096, 3),
}
_TABLES: dict = {}
_LOCK = threading.Lock()


def grid_tables(t: GGMLType):
    """(grid int8 [n, dim] of 2l+1 values, kmap int32, neighbours uint16), built once per process (IQ1's takes a
    second or so: 41644 off-grid codes against 2048 points)."""
    dec, bits, kmap_size, nwant = _GRID_SPEC[T(t)]
    key = (id(dec), nwant)                              # IQ1_S and IQ1_M share theirs
    with _LOCK:
        got = _TABLES.get(key)
        if got is None:
            lv = _levels(dec)
            kmap, nb = _build_neighbours(lv, bits, kmap_size, nwant)
            got = _TABLES[key] = ((2 * lv + 1).astype(np.int8), kmap, nb)
    return got


# ------------------------------------------------------------------------------------------------ shared steps

@njit(cache=True, inline="always")
def _nearest(v):
    return int((v + F32(12582912.0)) - F32(12582912.0))


@njit(cache=True, inline="always")
def _fmax(a, b):
    """ggml's MAX(a, b): a > b ? a : b"""
    return a if a > b else b


@njit(cache=True)
def _block_weights(xb, qw, qoff, has_w, sigma2, weight, none_mode):
    """weight[i] = qw * sqrt(sigma2 + x^2); without an imatrix x^2 (none_mode 0) or sigma2 / 4 + x^2 (IQ2_S)"""
    for i in range(xb.shape[0]):
        if has_w:
            weight[i] = qw[qoff + i] * np.sqrt(sigma2 + xb[i] * xb[i])
        elif none_mode == 1:
            weight[i] = F32(0.25) * sigma2 + xb[i] * xb[i]
        else:
            weight[i] = xb[i] * xb[i]


@njit(cache=True)
def _fold_signs(xb, weight, xval, signs, even):
    """xval = |x| per group of 8, sign bits in signs[k]; with ``even`` an odd number of negatives un-flips the value
    of least weight * x^2 (the 7-bit sign codes of IQ2_XXS / IQ2_XS / IQ3_XXS hold an even count)."""
    for k in range(xb.shape[0] // 8):
        nflip = 0
        s = 0
        for i in range(8):
            v = xb[8 * k + i]
            if v >= 0:
                xval[8 * k + i] = v
            else:
                xval[8 * k + i] = -v
                nflip += 1
                s |= 1 << i
        if even:
            if nflip % 2:
                imin = 0
                mn = weight[8 * k] * xb[8 * k] * xb[8 * k]
                for i in range(1, 8):
                    ax = weight[8 * k + i] * xb[8 * k + i] * xb[8 * k + i]
                    if ax < mn:
                        mn = ax
                        imin = i
                xval[8 * k + imin] = -xval[8 * k + imin]
                s ^= 1 << imin
            s &= 127
        signs[k] = s


@njit(cache=True)
def _best_neighbour(nb, start, grid, xval, w, off, scale, L):
    """iq2_find_best_neighbour / iq3_find_best_neighbour: least sum w (scale q - x)^2 among the listed points.
    Written out per grid width (4 or 8) with the point's x and w in registers; the same sums in the same order."""
    dim = grid.shape[1]
    best = FLT_MAX
    gi = -1
    x0 = xval[off]
    x1 = xval[off + 1]
    x2 = xval[off + 2]
    x3 = xval[off + 3]
    w0 = w[off]
    w1 = w[off + 1]
    w2 = w[off + 2]
    w3 = w[off + 3]
    if dim == 4:
        for j in range(1, int(nb[start]) + 1):
            g = int(nb[start + j])
            d = scale * F32(grid[g, 0]) - x0
            d2 = w0 * d * d
            d = scale * F32(grid[g, 1]) - x1
            d2 += w1 * d * d
            d = scale * F32(grid[g, 2]) - x2
            d2 += w2 * d * d
            d = scale * F32(grid[g, 3]) - x3
            d2 += w3 * d * d
            if d2 < best:
                best = d2
                gi = g
    else:
        x4 = xval[off + 4]
        x5 = xval[off + 5]
        x6 = xval[off + 6]
        x7 = xval[off + 7]
        w4 = w[off + 4]
        w5 = w[off + 5]
        w6 = w[off + 6]
        w7 = w[off + 7]
        for j in range(1, int(nb[start]) + 1):
            g = int(nb[start + j])
            d = scale * F32(grid[g, 0]) - x0
            d2 = w0 * d * d
            d = scale * F32(grid[g, 1]) - x1
            d2 += w1 * d * d
            d = scale * F32(grid[g, 2]) - x2
            d2 += w2 * d * d
            d = scale * F32(grid[g, 3]) - x3
            d2 += w3 * d * d
            d = scale * F32(grid[g, 4]) - x4
            d2 += w4 * d * d
            d = scale * F32(grid[g, 5]) - x5
            d2 += w5 * d * d
            d = scale * F32(grid[g, 6]) - x6
            d2 += w6 * d * d
            d = scale * F32(grid[g, 7]) - x7
            d2 += w7 * d * d
            if d2 < best:
                best = d2
                gi = g
    if gi < 0:
        raise ValueError("IQ quantization: no grid point found (non-finite values?)")
    for i in range(dim):
        L[off + i] = (grid[gi, i] - 1) // 2
    return gi


@njit(cache=True)
def _levels_to_grid(L, off, dim, bits, kmaxq, kmap, nb, grid, xval, w, scale, id_, L_out):
    """levels of nearest_int(0.5 (id x - 1)) clamped, to a grid index; off-grid codes take the best neighbour
    (which writes L_out); returns (index, on grid)"""
    u = 0
    for i in range(dim):
        l = max(0, min(kmaxq - 1, _nearest(F32(0.5) * (id_ * xval[off + i] - F32(1.0)))))
        L[off + i] = l
        u |= l << (bits * i)
    gi = kmap[u]
    if gi >= 0:
        return gi, True
    return _best_neighbour(nb, -gi - 1, grid, xval, w, off, scale, L_out), False


@njit(cache=True)
def _fit(weight, xval, L, n):
    sumqx = F32(0.0)
    sumq2 = F32(0.0)
    for i in range(n):
        w = weight[i]
        q = F32(2 * L[i] + 1)
        sumqx += w * xval[i] * q
        sumq2 += w * q * q
    return sumqx, sumq2


@njit(cache=True)
def _grid_of(L, off, dim, bits, kmap):
    u = 0
    for i in range(dim):
        u |= int(L[off + i]) << (bits * i)
    gi = kmap[u]
    if gi < 0:
        raise ValueError("IQ quantization: a point off the grid")
    return gi


@njit(cache=True)
def _put_u32(o, off, v):
    for b in range(4):
        o[off + b] = (v >> (8 * b)) & 255


@njit(cache=True)
def _grid_search(xval, weight, waux, n, dim, bits, kmaxq, kmap, nb, grid, L, Laux, on_grid, on_aux,
                 scale, nstep, step, mx, fix):
    """The scale search of the IQ2 / IQ3 types: id = (2 kMaxQ - 1 + is step) / mx for is in -nstep..nstep, best
    sum qx^2 / sum q2; then, at the best scale, the groups left off the grid are placed again (fix 0: IQ2_XS, IQ2_S,
    IQ3_XXS), or every group if one is off (fix 1: IQ3_S), or every group always (fix 2: IQ2_XXS), and the scale
    refitted. Returns the scale."""
    best = F32(0.0)
    ngroups = n // dim
    Lf = np.empty(n, F32)
    wx = np.empty(n, F32)
    for i in range(n):
        wx[i] = weight[i] * xval[i]                     # ggml's w*xval[i]*q is (w*xval[i])*q
    for k in range(ngroups):
        on_grid[k] = fix == 0
    top = F32(kmaxq - 1)
    for is_ in range(-nstep, nstep + 1):
        id_ = (F32(2 * kmaxq - 1) + F32(is_) * step) / mx
        this_scale = F32(1.0) / id_
        # every level first, in one loop over the values (SIMD: the nearest integer and the clamp as floats, which
        # hold small integers exactly), then each group's code, and the best neighbour where it is off the grid
        for i in range(n):
            r = (F32(0.5) * (id_ * xval[i] - F32(1.0)) + F32(12582912.0)) - F32(12582912.0)
            Lf[i] = min(max(r, F32(0.0)), top)
        for k in range(ngroups):
            u = 0
            for i in range(dim):
                l = int(Lf[dim * k + i])
                Laux[dim * k + i] = l
                u |= l << (bits * i)
            gi = kmap[u]
            on_aux[k] = gi >= 0
            if gi < 0:
                _best_neighbour(nb, -gi - 1, grid, xval, waux, dim * k, this_scale, Laux)
        sumqx = F32(0.0)
        sumq2 = F32(0.0)
        for i in range(n):                              # _fit, with w * x taken once per block
            q = F32(2 * Laux[i] + 1)
            sumqx += wx[i] * q
            sumq2 += weight[i] * q * q
        if sumq2 > 0 and sumqx * sumqx > best * sumq2:
            scale = sumqx / sumq2
            best = scale * sumqx
            for i in range(n):
                L[i] = Laux[i]
            for k in range(ngroups):
                on_grid[k] = on_aux[k]
    n_off = 0
    for k in range(ngroups):
        if not on_grid[k]:
            n_off += 1
    if (n_off > 0 or fix == 2) and scale > 0:
        id_ = F32(1.0) / scale
        for k in range(ngroups):
            if on_grid[k] and fix == 0:
                continue
            gi, on = _levels_to_grid(L, dim * k, dim, bits, kmaxq, kmap, nb, grid, xval, waux, scale, id_, L)
            for i in range(dim):
                L[dim * k + i] = (grid[gi, i] - 1) // 2
        sumqx, sumq2 = _fit(weight, xval, L, n)
        if sumq2 > 0:
            scale = sumqx / sumq2
    return scale


# ------------------------------------------------------------------------------------------------ IQ2

@njit(cache=True)
def _make_qp_u8(x, nmax, L, qw):
    """make_qp_quants as IQ2_XXS calls it: on the sign-folded values, where one may be negative, so levels below 0
    occur and L (uint8_t in ggml) keeps them as 256 + l, which the refinement then reads back."""
    n = x.shape[0]
    mx = F32(0.0)
    for i in range(n):
        mx = _fmax(mx, x[i])
    if mx < F32(1e-15):
        for i in range(n):
            L[i] = 0
        return F32(0.0)
    fn = F32(nmax)
    iscale = fn / mx
    for i in range(n):
        L[i] = _nearest(iscale * x[i]) & 255
    scale = F32(1.0) / iscale
    best_mse = F32(0.0)
    for i in range(n):
        diff = x[i] - scale * F32(L[i])
        best_mse += qw[i] * diff * diff
    for is_ in range(-4, 5):
        if is_ == 0:
            continue
        iscale_is = (F32(0.1) * F32(is_) + fn) / mx
        scale_is = F32(1.0) / iscale_is
        mse = F32(0.0)
        for i in range(n):
            l = min(nmax, _nearest(iscale_is * x[i]))
            diff = x[i] - scale_is * F32(l)
            mse += qw[i] * diff * diff
        if mse < best_mse:
            best_mse = mse
            iscale = iscale_is
    sumlx = F32(0.0)
    suml2 = F32(0.0)
    for i in range(n):
        l = min(nmax, _nearest(iscale * x[i]))
        L[i] = l & 255
        sumlx += qw[i] * x[i] * F32(l)
        suml2 += qw[i] * F32(l) * F32(l)
    for itry in range(5):
        n_changed = 0
        for i in range(n):
            w = qw[i]
            fl = F32(L[i])
            slx = sumlx - w * x[i] * fl
            sl2 = suml2 - w * fl * fl
            if slx > 0 and sl2 > 0:
                new_l = min(nmax, _nearest(x[i] * sl2 / slx))
                if new_l != L[i]:
                    fnl = F32(new_l)
                    slx += w * x[i] * fnl
                    sl2 += w * fnl * fnl
                    if slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = new_l & 255
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    return sumlx / suml2 if suml2 > 0 else F32(0.0)


@njit(cache=True, nogil=True)
def _iq2_xxs(x, qw, grid, kmap, nb, out, dout):
    nrows, n = x.shape
    weight = np.empty(32, F32)
    waux = np.empty(32, F32)
    xval = np.empty(32, F32)
    L = np.zeros(32, np.int64)
    Laux = np.zeros(32, np.int64)
    Lqp = np.zeros(32, np.int64)
    on_grid = np.zeros(4, np.bool_)
    on_aux = np.zeros(4, np.bool_)
    signs = np.zeros(4, np.int64)
    q2 = np.zeros(16, np.int64)
    scales = np.zeros(8, F32)
    for r in range(nrows):
        for ibl in range(n // QK_K):
            o = out[r, ibl]
            q2[:] = 0
            max_scale = F32(0.0)
            xbl = x[r, QK_K * ibl:QK_K * (ibl + 1)]
            sumx2 = F32(0.0)
            for i in range(QK_K):
                sumx2 += xbl[i] * xbl[i]
            sigma2 = sumx2 / F32(QK_K)
            for ib in range(8):
                xb = xbl[32 * ib:32 * ib + 32]
                _block_weights(xb, qw, QK_K * ibl + 32 * ib, True, sigma2, weight, 0)
                for i in range(32):
                    waux[i] = np.sqrt(weight[i])
                _fold_signs(xb, weight, xval, signs, True)
                mx = xval[0]
                for i in range(1, 32):
                    mx = _fmax(mx, xval[i])
                if mx < F32(1e-15):
                    scales[ib] = 0
                    L[:] = 0
                    continue
                scale = _make_qp_u8(xval, 4, Lqp, weight)
                for i in range(32):
                    L[i] = Lqp[i]
                eff_max = scale * F32(3.0)
                if eff_max <= 0:
                    scales[ib] = 0
                    L[:] = 0
                    continue
                scale = _grid_search(xval, weight, waux, 32, 8, 2, 3, kmap, nb, grid, L, Laux, on_grid, on_aux,
                                     scale, 6, F32(0.1), eff_max, 2)
                if scale < 0:
                    scale = -scale
                    for k in range(4):
                        signs[k] = (~signs[k]) & 127
                for k in range(4):
                    gi = _grid_of(L, 8 * k, 8, 2, kmap)
                    q2[2 * ib] |= gi << (8 * k)
                    q2[2 * ib + 1] |= signs[k] << (7 * k)
                scales[ib] = scale
                max_scale = _fmax(max_scale, scale)
            if max_scale == 0:
                continue
            d = max_scale / F32(31.0)
            dout[r, ibl] = d
            id_ = F32(1.0) / d
            for ib in range(8):
                l = max(0, min(15, _nearest(F32(0.5) * (id_ * scales[ib] - F32(1.0)))))
                q2[2 * ib + 1] |= l << 28
            for j in range(16):
                _put_u32(o, 2 + 4 * j, q2[j])


@njit(cache=True, nogil=True)
def _iq2_xs_s(x, qw, has_w, is_s, grid, kmap, nb, out, dout):
    """IQ2_XS (is_s False: 7-bit even sign codes, weights required) and IQ2_S (8-bit signs, 10-bit grid index)"""
    nrows, n = x.shape
    weight = np.empty(16, F32)
    waux = np.empty(16, F32)
    xval = np.empty(16, F32)
    L = np.zeros(16, np.int64)
    Laux = np.zeros(16, np.int64)
    signs = np.zeros(2, np.int64)
    on_grid = np.zeros(2, np.bool_)
    on_aux = np.zeros(2, np.bool_)
    scales = np.zeros(16, F32)
    eps = F32(1e-8) if is_s else F32(1e-15)
    for r in range(nrows):
        for ibl in range(n // QK_K):
            o = out[r, ibl]
            max_scale = F32(0.0)
            xbl = x[r, QK_K * ibl:QK_K * (ibl + 1)]
            sumx2 = F32(0.0)
            for i in range(QK_K):
                sumx2 += xbl[i] * xbl[i]
            sigma2 = (F32(2.0) * sumx2 if is_s else sumx2) / F32(QK_K)
            for ib in range(16):
                xb = xbl[16 * ib:16 * ib + 16]
                _block_weights(xb, qw, QK_K * ibl + 16 * ib, has_w, sigma2, weight, 1)
                for i in range(16):
                    waux[i] = np.sqrt(weight[i])
                _fold_signs(xb, weight, xval, signs, not is_s)
                mx = xval[0]
                for i in range(1, 16):
                    mx = _fmax(mx, xval[i])
                L[:] = 0
                if mx < eps:
                    scales[ib] = 0
                    continue
                scale = _grid_search(xval, weight, waux, 16, 8, 2, 3, kmap, nb, grid, L, Laux, on_grid, on_aux,
                                     mx / F32(5.0), 9, F32(0.1), mx, 0)
                if scale < 0:
                    scale = -scale
                    for k in range(2):
                        signs[k] = (~signs[k]) & (255 if is_s else 127)
                for k in range(2):
                    gi = _grid_of(L, 8 * k, 8, 2, kmap)
                    if is_s:
                        i8 = 2 * ib + k
                        o[2 + i8] = gi & 255
                        o[66 + i8 // 4] |= (gi >> 8) << (2 * (i8 % 4))
                        o[34 + i8] = signs[k]
                    else:
                        v = gi | (signs[k] << 9)
                        o[2 + 4 * ib + 2 * k] = v & 255
                        o[3 + 4 * ib + 2 * k] = v >> 8
                scales[ib] = scale
                max_scale = _fmax(max_scale, scale)
            if max_scale == 0:
                if not is_s:
                    o[2:66] = 0
                continue
            d = max_scale / F32(31.0)
            dout[r, ibl] = d * F32(0.9875) if is_s else d
            id_ = F32(1.0) / d
            so = 74 if is_s else 66
            for ib in range(16):
                l = max(0, min(15, _nearest(F32(0.5) * (id_ * scales[ib] - F32(1.0)))))
                o[so + ib // 2] |= l << (4 * (ib % 2))


# ------------------------------------------------------------------------------------------------ IQ3

@njit(cache=True, nogil=True)
def _iq3(x, qw, has_w, is_s, grid, kmap, nb, out, dout):
    """IQ3_XXS (is_s False: 8-bit grid index, 7-bit even sign codes beside the scale) and IQ3_S (9-bit index,
    8-bit signs, 4-bit scales apart)"""
    nrows, n = x.shape
    weight = np.empty(32, F32)
    waux = np.empty(32, F32)
    xval = np.empty(32, F32)
    L = np.zeros(32, np.int64)
    Laux = np.zeros(32, np.int64)
    signs = np.zeros(4, np.int64)
    on_grid = np.zeros(8, np.bool_)
    on_aux = np.zeros(8, np.bool_)
    scales = np.zeros(8, F32)
    for r in range(nrows):
        for ibl in range(n // QK_K):
            o = out[r, ibl]
            max_scale = F32(0.0)
            xbl = x[r, QK_K * ibl:QK_K * (ibl + 1)]
            sumx2 = F32(0.0)
            for i in range(QK_K):
                sumx2 += xbl[i] * xbl[i]
            sigma2 = F32(2.0) * sumx2 / F32(QK_K)
            qs_at = 2                                   # IQ3_S: advanced only past groups it writes
            signs_at = 74
            for ib in range(8):
                xb = xbl[32 * ib:32 * ib + 32]
                _block_weights(xb, qw, QK_K * ibl + 32 * ib, has_w, sigma2, weight, 0)
                for i in range(32):
                    waux[i] = np.sqrt(weight[i])
                _fold_signs(xb, weight, xval, signs, not is_s)
                mx = xval[0]
                for i in range(1, 32):
                    mx = _fmax(mx, xval[i])
                L[:] = 0
                if (is_s and mx == 0) or (not is_s and mx < F32(1e-8)):
                    scales[ib] = 0
                    continue
                if is_s:
                    scale = _grid_search(xval, weight, waux, 32, 4, 3, 8, kmap, nb, grid, L, Laux, on_grid, on_aux,
                                         mx / F32(15.0), 9, F32(0.2), mx, 1)
                else:
                    scale = _grid_search(xval, weight, waux, 32, 4, 3, 8, kmap, nb, grid, L, Laux, on_grid, on_aux,
                                         mx / F32(15.0), 15, F32(0.2), mx, 0)
                if scale < 0:
                    scale = -scale
                    for k in range(4):
                        signs[k] = (~signs[k]) & (255 if is_s else 127)
                for k in range(8):
                    gi = _grid_of(L, 4 * k, 4, 3, kmap)
                    if is_s:
                        o[qs_at + k] = gi & 255
                        o[66 + ib] |= (gi >> 8) << k
                    else:
                        o[2 + 8 * ib + k] = gi
                if is_s:
                    qs_at += 8
                    for k in range(4):
                        o[signs_at + k] = signs[k]
                    signs_at += 4
                else:
                    _put_u32(o, 66 + 4 * ib, signs[0] | (signs[1] << 7) | (signs[2] << 14) | (signs[3] << 21))
                scales[ib] = scale
                max_scale = _fmax(max_scale, scale)
            if max_scale == 0:
                if not is_s:
                    o[2:98] = 0
                continue
            d = max_scale / F32(31.0)
            dout[r, ibl] = d * (F32(1.033) if is_s else F32(1.0125))
            id_ = F32(1.0) / d
            for ib in range(8):
                l = max(0, min(15, _nearest(F32(0.5) * (id_ * scales[ib] - F32(1.0)))))
                if is_s:
                    o[106 + ib // 2] |= l << (4 * (ib % 2))
                else:
                    o[66 + 4 * ib + 3] |= l << 4


# ------------------------------------------------------------------------------------------------ IQ1

@njit(cache=True)
def _stable_order(xb, idx):
    """idx = the order of xb ascending, ties in index order (glibc's qsort is a merge sort here)"""
    n = xb.shape[0]
    for j in range(n):
        idx[j] = j
    for j in range(1, n):
        v = idx[j]
        p = j
        while p > 0 and xb[v] < xb[idx[p - 1]]:
            idx[p] = idx[p - 1]
            p -= 1
        idx[p] = v


@njit(cache=True)
def _best_neighbour2(nb, start, grid, xb, weight, off, scale, xg, L):
    """iq1_find_best_neighbour2: least sum w (scale xg[l] - x)^2 among the listed points. scale * xg[l] is taken
    once per level (ggml takes the same product per value), and the grid's 1/3/5 become 0/1/2 by a shift of an
    int32 rather than Python's floor division of an int64: a third less time in IQ1_S/IQ1_M."""
    sq = np.empty(3, F32)
    for l in range(3):
        sq[l] = scale * xg[l]
    best = FLT_MAX
    gi = -1
    for j in range(1, int(nb[start]) + 1):
        g = int(nb[start + j])
        d2 = F32(0.0)
        for i in range(8):
            diff = sq[(np.int32(grid[g, i]) - np.int32(1)) >> np.int32(1)] - xb[off + i]
            d2 += weight[off + i] * diff * diff
        if d2 < best:
            best = d2
            gi = g
    if gi < 0:
        raise ValueError("IQ1 quantization: no grid point found (non-finite values?)")
    for i in range(8):
        L[off + i] = (grid[gi, i] - 1) // 2
    return gi


@njit(cache=True)
def _iq1_assign(L, idx, n, i1, i2):
    for j in range(n):
        L[idx[j]] = 0 if j < i1 else (1 if j < i2 else 2)


@njit(cache=True, nogil=True)
def _iq1_s(x, qw, grid, kmap, nb, out, dout):
    nrows, n = x.shape
    x_p = np.array([F32(-0.875), F32(0.125), F32(1.125)], F32)
    x_m = np.array([F32(-1.125), F32(-0.125), F32(0.875)], F32)
    weight = np.empty(32, F32)
    sumx = np.empty(33, F32)
    sumw = np.empty(33, F32)
    idx = np.zeros(32, np.int64)
    L = np.zeros(32, np.int64)
    index = np.zeros(4, np.int64)
    scales = np.zeros(8, F32)
    shifts = np.zeros(8, np.int64)
    for r in range(nrows):
        for ibl in range(n // QK_K):
            o = out[r, ibl]
            max_scale = F32(0.0)
            xbl = x[r, QK_K * ibl:QK_K * (ibl + 1)]
            sumx2 = F32(0.0)
            for i in range(QK_K):
                sumx2 += xbl[i] * xbl[i]
            sigma2 = F32(2.0) * sumx2 / F32(QK_K)
            for ib in range(8):
                xb = xbl[32 * ib:32 * ib + 32]
                _block_weights(xb, qw, QK_K * ibl + 32 * ib, True, sigma2, weight, 0)
                mx = abs(xb[0])
                for i in range(1, 32):
                    mx = _fmax(mx, abs(xb[i]))
                if mx < F32(1e-12):
                    scales[ib] = 0
                    shifts[ib] = 1
                    continue
                _stable_order(xb, idx)
                sumx[0] = 0
                sumw[0] = 0
                for j in range(32):
                    i = idx[j]
                    sumx[j + 1] = sumx[j] + weight[i] * xb[i]
                    sumw[j + 1] = sumw[j] + weight[i]
                best_score = -FLT_MAX
                scale = mx
                besti1 = -1
                besti2 = -1
                best_shift = 0
                for i1 in range(33):
                    for i2 in range(i1, 33):
                        for sh in range(2):
                            xx = x_p if sh == 0 else x_m
                            sumqx = ((sumx[i1] - sumx[0]) * xx[0] + (sumx[i2] - sumx[i1]) * xx[1]
                                     + (sumx[32] - sumx[i2]) * xx[2])
                            sumq2 = ((sumw[i1] - sumw[0]) * xx[0] * xx[0] + (sumw[i2] - sumw[i1]) * xx[1] * xx[1]
                                     + (sumw[32] - sumw[i2]) * xx[2] * xx[2])
                            if sumq2 > 0 and sumqx * sumqx > best_score * sumq2:
                                scale = sumqx / sumq2
                                best_score = scale * sumqx
                                besti1 = i1
                                besti2 = i2
                                best_shift = 1 if sh == 0 else -1
                if besti1 < 0 or besti2 < 0 or best_shift == 0:
                    scales[ib] = 0
                    shifts[ib] = 1
                    continue
                _iq1_assign(L, idx, 32, besti1, besti2)
                if scale < 0:
                    for j in range(32):
                        L[j] = 2 - L[j]
                    scale = -scale
                    best_shift = -best_shift
                xx = x_p if best_shift == 1 else x_m
                all_on = True
                for k in range(4):
                    u = 0
                    for j in range(8):
                        u |= L[8 * k + j] << (2 * j)
                    gi = kmap[u]
                    if gi < 0:
                        all_on = False
                        gi = _best_neighbour2(nb, -gi - 1, grid, xb, weight, 8 * k, scale, xx, L)
                    index[k] = gi
                if not all_on:
                    sumqx = F32(0.0)
                    sumq2 = F32(0.0)
                    for k in range(4):
                        for j in range(8):
                            w = weight[8 * k + j]
                            q = xx[(grid[index[k], j] - 1) // 2]
                            sumqx += w * q * xb[8 * k + j]
                            sumq2 += w * q * q
                    if sumqx > 0 and sumq2 > 0:
                        scale = sumqx / sumq2
                h = 0
                for k in range(4):
                    o[2 + 4 * ib + k] = index[k] & 255
                    h |= (index[k] >> 8) << (3 * k)
                o[34 + 2 * ib] = h & 255
                o[35 + 2 * ib] = h >> 8
                scales[ib] = scale
                shifts[ib] = best_shift
                max_scale = _fmax(max_scale, scale)
            if max_scale == 0:
                continue
            d = max_scale / F32(15.0)
            dout[r, ibl] = d * F32(1.125)
            id_ = F32(1.0) / d
            for ib in range(8):
                l = max(0, min(7, _nearest(F32(0.5) * (id_ * scales[ib] - F32(1.0)))))
                if shifts[ib] == -1:
                    l |= 8
                o[35 + 2 * ib] |= l << 4


@njit(cache=True, nogil=True)
def _iq1_m(x, qw, has_w, grid, kmap, nb, out, dout):
    nrows, n = x.shape
    x_p = np.array([F32(-0.875), F32(0.125), F32(1.125)], F32)
    x_m = np.array([F32(-1.125), F32(-0.125), F32(0.875)], F32)
    masks = np.array([0x00, 0x80, 0x08, 0x88], np.int64)
    weight = np.empty(16, F32)
    px = np.zeros((2, 17), F32)
    pw = np.zeros((2, 17), F32)
    idx = np.zeros(16, np.int64)
    L = np.zeros(16, np.int64)
    index = np.zeros(2, np.int64)
    scales = np.zeros(16, F32)
    shifts = np.zeros(16, np.int64)
    sc = np.zeros(4, np.int64)
    p2 = x_p[2]
    m2 = x_m[2]
    cp1 = x_p[0] * x_p[0] - x_p[1] * x_p[1]
    cp2 = x_p[1] * x_p[1] - x_p[2] * x_p[2]
    cm1 = x_m[0] * x_m[0] - x_m[1] * x_m[1]
    cm2 = x_m[1] * x_m[1] - x_m[2] * x_m[2]
    for r in range(nrows):
        for ibl in range(n // QK_K):
            o = out[r, ibl]
            max_scale = F32(0.0)
            xbl = x[r, QK_K * ibl:QK_K * (ibl + 1)]
            sumx2 = F32(0.0)
            for i in range(QK_K):
                sumx2 += xbl[i] * xbl[i]
            sigma2 = F32(2.0) * sumx2 / F32(QK_K)
            for ib in range(16):
                xb = xbl[16 * ib:16 * ib + 16]
                _block_weights(xb, qw, QK_K * ibl + 16 * ib, has_w, sigma2, weight, 0)
                mx = abs(xb[0])
                for i in range(1, 16):
                    mx = _fmax(mx, abs(xb[i]))
                if mx < F32(1e-7):
                    scales[ib] = 0
                    shifts[ib] = 0
                    continue
                _stable_order(xb, idx)
                best_score = -FLT_MAX
                scale = mx
                besti1 = -1
                besti2 = -1
                best_k = -1
                px[:, 0] = 0
                pw[:, 0] = 0
                for j in range(16):
                    i = idx[j]
                    h = 0 if i < 8 else 1
                    px[h, j + 1] = px[h, j] + weight[i] * xb[i]
                    px[1 - h, j + 1] = px[1 - h, j]
                    pw[h, j + 1] = pw[h, j] + weight[i]
                    pw[1 - h, j + 1] = pw[1 - h, j]
                # the split search on scalars (registers), in ggml's operation order: the two halves' sums for
                # x_p and x_m, then the four sign combinations in order k = 0..3
                tx0 = px[0, 16]
                tx1 = px[1, 16]
                tw0p = pw[0, 16] * p2 * p2
                tw1p = pw[1, 16] * p2 * p2
                tw0m = pw[0, 16] * m2 * m2
                tw1m = pw[1, 16] * m2 * m2
                for i1 in range(17):
                    a0 = px[0, i1]
                    a1 = px[1, i1]
                    b0 = pw[0, i1]
                    b1 = pw[1, i1]
                    for i2 in range(i1, 17):
                        sx0 = a0 + px[0, i2]
                        sx1 = a1 + px[1, i2]
                        qxp0 = tx0 * p2 - sx0
                        qxm0 = tx0 * m2 - sx0
                        qxp1 = tx1 * p2 - sx1
                        qxm1 = tx1 * m2 - sx1
                        c0 = pw[0, i2]
                        c1 = pw[1, i2]
                        q2p0 = tw0p + b0 * cp1 + c0 * cp2
                        q2m0 = tw0m + b0 * cm1 + c0 * cm2
                        q2p1 = tw1p + b1 * cp1 + c1 * cp2
                        q2m1 = tw1m + b1 * cm1 + c1 * cm2
                        for k in range(4):
                            sqx = (qxp0 if k < 2 else qxm0) + (qxp1 if k % 2 == 0 else qxm1)
                            sq2 = (q2p0 if k < 2 else q2m0) + (q2p1 if k % 2 == 0 else q2m1)
                            if sq2 > 0 and sqx * sqx > best_score * sq2:
                                scale = sqx / sq2
                                best_score = scale * sqx
                                besti1 = i1
                                besti2 = i2
                                best_k = k
                if besti1 < 0 or besti2 < 0 or best_k < 0:
                    scales[ib] = 0
                    shifts[ib] = 0
                    continue
                _iq1_assign(L, idx, 16, besti1, besti2)
                if scale < 0:
                    for j in range(16):
                        L[j] = 2 - L[j]
                    scale = -scale
                    best_k = 3 - best_k
                all_on = True
                for k in range(2):
                    xx = (x_p if best_k < 2 else x_m) if k == 0 else (x_p if best_k % 2 == 0 else x_m)
                    u = 0
                    for j in range(8):
                        u |= L[8 * k + j] << (2 * j)
                    gi = kmap[u]
                    if gi < 0:
                        all_on = False
                        gi = _best_neighbour2(nb, -gi - 1, grid, xb, weight, 8 * k, scale, xx, L)
                    index[k] = gi
                if not all_on:
                    sqx = F32(0.0)
                    sq2 = F32(0.0)
                    for k in range(2):
                        xx = (x_p if best_k < 2 else x_m) if k == 0 else (x_p if best_k % 2 == 0 else x_m)
                        for j in range(8):
                            w = weight[8 * k + j]
                            q = xx[(grid[index[k], j] - 1) // 2]
                            sqx += w * q * xb[8 * k + j]
                            sq2 += w * q * q
                    if sqx > 0 and sq2 > 0:
                        scale = sqx / sq2
                o[2 * ib] = index[0] & 255
                o[2 * ib + 1] = index[1] & 255
                o[32 + ib] = (index[0] >> 8) | ((index[1] >> 8) << 4)
                scales[ib] = scale
                shifts[ib] = best_k
                max_scale = _fmax(max_scale, scale)
            if max_scale == 0:
                continue
            sc[:] = 0
            d = max_scale / F32(15.0)
            id_ = F32(1.0) / d
            sqx = F32(0.0)
            sq2 = F32(0.0)
            for ib in range(16):
                l = max(0, min(7, _nearest(F32(0.5) * (id_ * scales[ib] - F32(1.0)))))
                sc[ib // 4] |= l << (3 * (ib % 4))
                o[32 + ib] |= masks[shifts[ib]]
                xb = xbl[16 * ib:16 * ib + 16]
                _block_weights(xb, qw, QK_K * ibl + 16 * ib, has_w, sigma2, weight, 0)
                for k in range(2):
                    xx = (x_p if shifts[ib] < 2 else x_m) if k == 0 else (x_p if shifts[ib] % 2 == 0 else x_m)
                    gi = int(o[2 * ib + k]) + ((int(o[32 + ib]) << (8 - 4 * k)) & 0x700)
                    for j in range(8):
                        w = weight[8 * k + j]
                        q = xx[(grid[gi, j] - 1) // 2] * F32(2 * l + 1)
                        sqx += w * q * xb[8 * k + j]
                        sq2 += w * q * q
            if sq2 > 0:
                d = sqx / sq2
            dout[r, ibl] = d * F32(1.1125)
            for j in range(4):
                o[48 + 2 * j] = sc[j] & 255
                o[49 + 2 * j] = sc[j] >> 8


# ------------------------------------------------------------------------------------------------ entry

def quantize_iq(x: np.ndarray, t: GGMLType, imatrix: np.ndarray | None = None) -> np.ndarray:
    """x float32 [nrows, n_per_row] -> the bytes of ggml's quantize_<type>(x, nrows, n_per_row, imatrix).

    ``imatrix`` float32 [n_per_row] or None; IQ2_XXS, IQ2_XS and IQ1_S refuse to run without one, as ggml does."""
    t = T(t)
    if t not in SEARCH_TYPES:
        raise ValueError(f"{t.name} is not an IQ1/IQ2/IQ3 grid type")
    x = np.ascontiguousarray(x, F32)
    if x.ndim == 1:
        x = x.reshape(1, -1)
    nrows, n = x.shape
    if n % QK_K:
        raise ValueError(f"{t.name}: rows of {n} values are not whole blocks of {QK_K}")
    has_w = imatrix is not None
    if not has_w and t in REQUIRES_IMATRIX:
        raise ValueError(f"quantizing to {t.name} requires an importance matrix")
    qw = np.ascontiguousarray(imatrix, F32).reshape(-1) if has_w else np.zeros(1, F32)
    if has_w and qw.shape[0] != n:
        raise ValueError(f"imatrix has {qw.shape[0]} values, rows have {n}")
    grid, kmap, nb = grid_tables(t)
    size = TYPE_TRAITS[t].type_size
    out = np.zeros((nrows, n // QK_K, size), np.uint8)
    dout = np.zeros((nrows, n // QK_K), F32)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        if t == T.IQ2_XXS:
            _iq2_xxs(x, qw, grid, kmap, nb, out, dout)
        elif t in (T.IQ2_XS, T.IQ2_S):
            _iq2_xs_s(x, qw, has_w, t == T.IQ2_S, grid, kmap, nb, out, dout)
        elif t in (T.IQ3_XXS, T.IQ3_S):
            _iq3(x, qw, has_w, t == T.IQ3_S, grid, kmap, nb, out, dout)
        elif t == T.IQ1_S:
            _iq1_s(x, qw, grid, kmap, nb, out, dout)
        else:
            _iq1_m(x, qw, has_w, grid, kmap, nb, out, dout)
    dh = to_f16_bytes(dout.reshape(-1)).reshape(nrows, n // QK_K, 2)
    if t == T.IQ1_M:
        # the fp16 scale's four nibbles sit in the top bits of the four 16-bit scale words
        u = dh.view("<u2")[..., 0].astype(np.uint16)
        sc = out[..., 48:56].copy().view("<u2")
        sc[..., 0] |= (u & 0x000F) << 12
        sc[..., 1] |= (u & 0x00F0) << 8
        sc[..., 2] |= (u & 0x0F00) << 4
        sc[..., 3] |= u & 0xF000
        out[..., 48:56] = sc.view(np.uint8)
    else:
        out[..., 0:2] = dh
    return out.reshape(nrows, -1)
