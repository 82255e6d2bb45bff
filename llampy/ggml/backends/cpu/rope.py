"""ROPE with ggml's exact float32 arithmetic: theta = pos, multiplied by theta_scale pair after pair; cosf/sinf
(Numba's float32 math calls the C library's, as ggml does); the rotation with the compiler's fused multiply-add
(x0*cos - x1*sin computed as fma(x0, cos, -(x1*sin))); NEOX's halves sixteen lanes at a time."""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .direct import Direct, Prepare
from .rows import index_error, index_prepare, set_rows_f16_checked
from .simd import v16_fma, v16_load, v16_mul, v16_scale, v16_store


@njit(cache=True)
def _ramp(low, high, i0):
    y = (np.float32(i0 / 2) - low) / max(np.float32(0.001), high - low)
    return np.float32(1.0) - min(np.float32(1.0), max(np.float32(0.0), y))


# error_model="numpy": a zero frequency factor (a file's rope_freqs) divides to inf as in C, not ZeroDivisionError
@njit(cache=True, error_model="numpy")
def rope_cache(pos, n_dims, theta_scale, freq_scale, ff, has_ff, ext_factor, mscale, corr0, corr1, cos_out, sin_out):
    for t in range(pos.shape[0]):
        theta = np.float32(pos[t])
        for j in range(n_dims // 2):
            f = ff[j] if has_ff else np.float32(1.0)
            th_extrap = np.float32(theta / f)
            th_interp = np.float32(freq_scale * th_extrap)
            th = th_interp
            ms = mscale
            if ext_factor != 0.0:
                mix = np.float32(_ramp(corr0, corr1, 2 * j) * ext_factor)
                th = np.float32(th_interp * (np.float32(1.0) - mix) + th_extrap * mix)
                ms = np.float32(mscale * (np.float32(1.0) + np.float32(0.1) * np.float32(math.log(np.float32(1.0) / freq_scale))))
            cos_out[t, j] = np.float32(math.cos(th)) * ms
            sin_out[t, j] = np.float32(math.sin(th)) * ms
            theta = np.float32(theta * theta_scale)


# ggml_mrope_cache_init: rows (4, n_tokens) of positions; pair j takes the angle of its section's row; every row's
# angle is multiplied by theta_scale after each pair (the vision rope, indep, restarts a section's angle at its row)
@njit(cache=True, error_model="numpy")
def mrope_cache(rows, s0, s1, s2, s3, indep, theta_scale, freq_scale, ff, has_ff, ext_factor, mscale, corr0, corr1,
                cos_out, sin_out):
    sect_dims = s0 + s1 + s2 + s3
    sec_w = s0 + s1
    sec_e = sec_w + s2
    th = np.empty(4, np.float32)
    for t in range(rows.shape[1]):
        for r in range(4):
            th[r] = np.float32(rows[r, t])
        for j in range(cos_out.shape[1]):
            sector = j % sect_dims
            if indep:
                if sector == 0:
                    th[0] = np.float32(rows[0, t])
                elif sector == s0:
                    th[1] = np.float32(rows[1, t])
                elif sector == sec_w:
                    th[2] = np.float32(rows[2, t])
                elif sector == sec_e:
                    th[3] = np.float32(rows[3, t])
            r = 0
            if sector >= s0 and sector < sec_w:
                r = 1
            elif sector >= sec_w and sector < sec_w + s2:
                r = 2
            elif sector >= sec_w + s2:
                r = 3
            f = ff[j] if has_ff else np.float32(1.0)
            th_extrap = np.float32(th[r] / f)
            th_interp = np.float32(freq_scale * th_extrap)
            ang = th_interp
            ms = mscale
            if ext_factor != 0.0:
                mix = np.float32(_ramp(corr0, corr1, 2 * j) * ext_factor)
                ang = np.float32(th_interp * (np.float32(1.0) - mix) + th_extrap * mix)
                ms = np.float32(mscale * (np.float32(1.0) + np.float32(0.1) * np.float32(math.log(np.float32(1.0) / freq_scale))))
            cos_out[t, j] = np.float32(math.cos(ang)) * ms
            sin_out[t, j] = np.float32(math.sin(ang)) * ms
            for q in range(4):
                th[q] = np.float32(th[q] * theta_scale)


@njit(cache=True, inline="always")
def _rope_token(x, out, cos, sin, n_dims, neox, t):
    ne3, nt, nh, hd = x.shape
    half = n_dims // 2
    # NEOX pairs (j, j + half) lie in two runs: sixteen pairs per step, the same fused multiply-adds
    h16 = half - half % 16 if neox else 0
    if True:
        for a in range(ne3):
            for h in range(nh):
                xr, orow = x[a, t, h], out[a, t, h]
                for j in range(0, h16, 16):
                    c, s = v16_load(cos[t], j), v16_load(sin[t], j)
                    x0, x1 = v16_load(xr, j), v16_load(xr, j + half)
                    v16_store(orow, j, v16_fma(x0, c, v16_scale(v16_mul(x1, s), np.float32(-1.0))))
                    v16_store(orow, j + half, v16_fma(x0, s, v16_mul(x1, c)))
                for j in range(h16, half):
                    if neox:
                        i0, i1 = j, j + half
                    else:
                        i0, i1 = 2 * j, 2 * j + 1
                    c = cos[t, j]
                    s = sin[t, j]
                    x0 = x[a, t, h, i0]
                    x1 = x[a, t, h, i1]
                    out[a, t, h, i0] = np.float32(np.float64(x0) * np.float64(c) - np.float64(np.float32(x1 * s)))
                    out[a, t, h, i1] = np.float32(np.float64(x0) * np.float64(s) + np.float64(np.float32(x1 * c)))
                for i in range(n_dims, hd):
                    out[a, t, h, i] = x[a, t, h, i]


@njit(parallel=True, cache=True)
def rope_apply(x, out, cos, sin, n_dims, neox):
    """x, out: (ne3, n_tokens, n_head, head_dim) float32."""
    for t in prange(x.shape[1]):
        _rope_token(x, out, cos, sin, n_dims, neox, t)


@njit(cache=True)
def rope_apply_1(x, out, cos, sin, n_dims, neox):
    """``rope_apply`` on one thread (decode-sized inputs: a parallel region costs more than the work)."""
    for t in range(x.shape[1]):
        _rope_token(x, out, cos, sin, n_dims, neox, t)


@njit(cache=True)
def rope_store_f16(x, out, cos, sin, n_dims, neox, src, idx, n_rows, dst):
    """``rope_apply_1``, then the rotated rows stored as F16 into the cache rows idx (``rows.set_rows_f16_checked``
    of src, a view of out): a decoded token's K rotated and written to its cell in one call. False, with nothing
    stored, where an index is outside 0..n_rows - 1 (the caller raises, as SET_ROWS does)."""
    for t in range(x.shape[1]):
        _rope_token(x, out, cos, sin, n_dims, neox, t)
    return set_rows_f16_checked(src, idx, n_rows, dst)


def _corr_dim(n_dims, n_ctx_orig, n_rot, base):
    return n_dims * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))


_TRIG: dict = {}


class _Trig:
    """cos/sin of one shape and one set of RoPE constants, and the positions (their bytes) and frequency factors
    they were last filled for."""
    __slots__ = ("cos", "sin", "pos", "ff")

    def __init__(self, nt, half):
        self.cos = np.empty((nt, half), np.float32)
        self.sin = np.empty((nt, half), np.float32)
        self.pos = None
        self.ff = None


def _trig_buffers(nt: int, half: int, consts: tuple) -> _Trig:
    """The cos/sin tables shared by every RoPE of this shape and these constants: a model's layers rotate q and k
    by the same positions, so the tables are filled once per batch, not once per node (Gemma 3's two sets of
    constants, local and global layers, get one each)."""
    key = (nt, half) + consts
    tr = _TRIG.get(key)
    if tr is None:
        if len(_TRIG) > 64:
            _TRIG.clear()
        tr = _TRIG[key] = _Trig(nt, half)
    return tr


def bind(x: np.ndarray, pos: np.ndarray, p: dict, ff: np.ndarray | None, out: np.ndarray, store=None,
         inputs: bool = False):
    """The rotation of x by positions pos into out (float32, x's shape, contiguous), set up once: the constants
    and the cos/sin tables are made here, and the returned call refills the tables only when the positions (or the
    frequency factors) differ from what they hold, then rotates. ``store``: (src, idx, n_rows, dst) of a SET_ROWS
    into an F16 cache that reads out (``rope_store_f16``: one call for both), or None (the rotation alone; also
    what a store that does not fit returns: the caller binds the two nodes apart).

    ``inputs``: pos, ff and the store's idx are graph inputs or weights, not written while the graph runs. The
    tables are then those of pos's memory, shared by the ropes reading it, and the call says what it runs
    (``direct``): the refill test and the index test as ``Prepare`` steps, which a plan's fast run makes once for
    all of them (a decoded token's 2 x n_layer ropes test the positions once), then the kernel."""
    n_dims = p["n_dims"]
    f32 = np.float32
    # powf(freq_base, -2.0f/n_dims): the exponent rounded to float first (it is not exact for n_dims 24, 40, ...)
    theta_scale = f32(math.pow(f32(p["freq_base"]), f32(-2.0 / n_dims)))
    corr0 = corr1 = f32(0.0)
    if p["ext_factor"] != 0.0:
        corr0 = f32(max(0.0, math.floor(_corr_dim(n_dims, p["n_ctx_orig"], p["beta_fast"], p["freq_base"]))))
        corr1 = f32(min(n_dims - 1.0, math.ceil(_corr_dim(n_dims, p["n_ctx_orig"], p["beta_slow"], p["freq_base"]))))
    nt = len(pos)
    ffa = np.ascontiguousarray(ff, dtype=f32) if ff is not None else np.ones(1, f32)
    has_ff = ff is not None
    freq_scale, ext, attn = f32(p["freq_scale"]), f32(p["ext_factor"]), f32(p["attn_factor"])
    if p.get("sections"):
        if store is not None:
            return None
        return _bind_multi(x, pos, p, ffa, has_ff, out, theta_scale, freq_scale, ext, attn, corr0, corr1)
    consts = (n_dims, float(theta_scale), float(freq_scale), float(ext), float(attn), float(corr0), float(corr1),
              has_ff)
    if inputs:      # the tables of this memory: only ropes of the same positions (and factors) write them
        consts += (pos.ctypes.data, pos.strides, ffa.ctypes.data if has_ff else 0)
    tr = _trig_buffers(nt, n_dims // 2, consts)
    cos, sin = tr.cos, tr.sin
    neox = p["mode"] == 2
    apply = rope_apply if x.size >= (1 << 15) else rope_apply_1
    direct = x.dtype == f32 and x.flags.c_contiguous
    if store is not None and (apply is not rope_apply_1 or not direct):
        return None

    def refill():
        pi = pos if pos.dtype == np.int32 and pos.flags.c_contiguous else np.ascontiguousarray(pos, dtype=np.int32)
        fa = ffa if not has_ff or ff is None else np.ascontiguousarray(ff, dtype=f32)
        key = pi.tobytes()                  # the positions' bytes: a compare ~20x cheaper than np.array_equal's
        if tr.pos != key or (has_ff and not np.array_equal(tr.ff, fa)):
            tr.pos = None                   # invalid while being filled
            rope_cache(pi, n_dims, theta_scale, freq_scale, fa, has_ff, ext, attn, corr0, corr1, cos, sin)
            tr.pos, tr.ff = key, (fa.copy() if has_ff else None)

    def run():
        refill()
        if store is None:
            apply(x if direct else np.ascontiguousarray(x, dtype=f32), out, cos, sin, n_dims, neox)
        elif not rope_store_f16(x, out, cos, sin, n_dims, neox, *store):
            raise index_error("set_rows", store[2])
    if inputs and direct:
        steps = (Prepare(refill, ("rope tables", id(tr))),)
        if store is None:
            run.direct = steps + (Direct(apply, x, out, cos, sin, n_dims, neox),)
        else:               # the kernel's own test passes: the indices were tested first
            src, idx, n_rows, dst = store
            run.direct = steps + (index_prepare(idx, n_rows, "set_rows"),
                                  Direct(rope_store_f16, x, out, cos, sin, n_dims, neox, src, idx, n_rows, dst))
    return run


def _bind_multi(x, pos, p, ffa, has_ff, out, theta_scale, freq_scale, ext, attn, corr0, corr1):
    """ggml_rope_multi: MROPE rotates NeoX halves of n_dims, VISION pairs (i, i + n_dims) over the whole head; the
    tables are remade each run (an image's encoder runs once per image)."""
    n_rot = p["n_dims"] if p["mode"] == 8 else 2 * p["n_dims"]
    nt = len(pos) // 4
    cos = np.empty((nt, n_rot // 2), np.float32)
    sin = np.empty((nt, n_rot // 2), np.float32)
    s0, s1, s2, s3 = p["sections"]
    indep = p["mode"] == 24
    apply = rope_apply if x.size >= (1 << 15) else rope_apply_1

    def run():
        rows = np.ascontiguousarray(pos, dtype=np.int32).reshape(4, nt)
        mrope_cache(rows, s0, s1, s2, s3, indep, theta_scale, freq_scale, ffa, has_ff, ext, attn, corr0, corr1,
                    cos, sin)
        apply(np.ascontiguousarray(x, dtype=np.float32), out, cos, sin, n_rot, True)
    return run


def rope(x: np.ndarray, pos: np.ndarray, p: dict, ff: np.ndarray | None, out: np.ndarray | None = None):
    """x rotated by positions pos; into ``out`` (float32, x's shape, contiguous) when given, else a new array."""
    if out is None:
        out = np.empty(x.shape, np.float32)
    bind(x, pos, p, ff, out)()
    return out
