"""llama.cpp's tiled k-quant product (cpu/dot_kquant_tiled.py) against an independent NumPy statement of its arithmetic, and
``mul_mat``'s choice between it and vec_dot as llama.cpp's CPU backend makes it (tiled from 8 activation rows,
except Q4_K whose rows llama.cpp repacks). Bit-equality with llama.cpp itself: ggml's own mul_mat through ctypes
for every format of its tiled path that llampy runs there (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS), and end to end
tests/llama/test_fidelity_real.py (Gemma 3's Q6_K ffn_down)."""
from __future__ import annotations

import numpy as np
import pytest

from llampy.ggml.backends.cpu import matmul, dot_kquant_scalar, dot_kquant, dot_kquant_tiled
from llampy.ggml.backends.cpu.act_quant import act_split
from llampy.ggml.backends.cpu.dot_q32 import F16_TABLE
from llampy.ggml.quants import dequantize
from llampy.ggml.quants_k import quantize_q4_k, quantize_q5_k, quantize_q6_k
from llampy.ggml.types import GGMLType as T
from tests import llamacpp

QUANT = {T.Q4_K: quantize_q4_k, T.Q5_K: quantize_q5_k, T.Q6_K: quantize_q6_k}
BLOCK = {T.Q4_K: 144, T.Q5_K: 176, T.Q6_K: 210}
D_AT = {T.Q4_K: 0, T.Q5_K: 0, T.Q6_K: 208}   # byte of the F16 d in a block (dmin follows for Q4_K/Q5_K)
F16_ONE, F16_ZERO = np.array([1], np.float16).view(np.uint8), np.array([0], np.float16).view(np.uint8)


def case(wtype, rows, k, n, seed):
    rng = np.random.default_rng(seed)
    w32 = rng.standard_normal((rows, k)).astype(np.float32)
    w32[0, :32] *= 50
    w = np.asarray(QUANT[wtype](w32)).reshape(rows, -1)
    x = (rng.standard_normal((n, k)) * 3).astype(np.float32)
    x[0, :5] = [40, -40, 0, 1e-3, 7]
    if k >= 512:
        x[-1, 256:512] = 0                  # a zero super-block: d_x = 0
    return w, x


def with_scales(w, wtype, d, dmin):
    """A copy of the blocks with every d (and dmin) replaced: dequantizing it gives the integer parts."""
    b = w.reshape(w.shape[0], -1, BLOCK[wtype]).copy()
    b[:, :, D_AT[wtype]:D_AT[wtype] + 2] = d
    if wtype != T.Q6_K:
        b[:, :, 2:4] = dmin
    return b.reshape(w.shape)


def reference(w, wtype, x):
    """ggml-cpu/tiled's VNNI microkernel in NumPy: per super-block, in order, r = f32(s1) * d_w
    [r = fma(-dmin_w, f32(s2), r)], out = fma(r, d_x, out); s1 = sum of scale * q * x_q, s2 = sum of min * x_q
    (exact integers, here through float64); fma through float64 (the product is exact)."""
    rows, k = w.shape[0], x.shape[1]
    s = act_split(x, T.Q8_K)
    xq = s.xq.astype(np.float64)
    sq = dequantize(with_scales(w, wtype, F16_ONE, F16_ZERO), wtype, k).reshape(rows, k).astype(np.float64)
    blocks = w.reshape(rows, -1, BLOCK[wtype])
    dw = blocks[:, :, D_AT[wtype]:D_AT[wtype] + 2].copy().view(np.float16)[..., 0].astype(np.float32)
    if wtype != T.Q6_K:
        mq = -dequantize(with_scales(w, wtype, F16_ZERO, F16_ONE), wtype, k).reshape(rows, k).astype(np.float64)
        dmin = blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    out = np.zeros((x.shape[0], rows), np.float32)
    for b in range(k // 256):
        sl = slice(b * 256, b * 256 + 256)
        r = ((xq[:, sl] @ sq[:, sl].T).astype(np.float32) * dw[None, :, b]).astype(np.float32)
        if wtype != T.Q6_K:
            s2 = (xq[:, sl] @ mq[:, sl].T).astype(np.float32)
            r = (-dmin[None, :, b].astype(np.float64) * s2 + r).astype(np.float32)
        out = (r.astype(np.float64) * s.xd[:, b, None] + out).astype(np.float32)
    return out


@pytest.mark.parametrize("wtype", [T.Q6_K, T.Q5_K, T.Q4_K], ids=lambda t: t.name)
@pytest.mark.parametrize("rows,k,n", [(13, 512, 8), (40, 1024, 9), (24, 768, 17), (7, 256, 12), (13, 1536, 33)])
def test_tiled_equals_reference(wtype, rows, k, n):
    """Q6_K from 16 activation rows: the broadcast form (``mm_q6_k_bc``) for whole steps of sixteen, the eight-row
    tiles for the rest and for an odd last weight row; (13, 1536, 33): two steps, a span of four super-blocks and
    one of two, 12 rows in the broadcast form (a task of 12), row 12 and activation row 32 in the tiles."""
    w, x = case(wtype, rows, k, n, rows * k + n)
    s = act_split(x, T.Q8_K)
    got = np.full((n, rows), np.nan, np.float32)
    dot_kquant_tiled.mm_k_tiled(w, dot_kquant_tiled.KINDS[wtype.name], s.xq, s.xd, s.xs, got, F16_TABLE)
    want = reference(w, wtype, x)
    assert np.array_equal(got, want)
    got[...] = np.nan       # and the eight-activation-rows form
    dot_kquant_tiled.mul_mat_tiles(w, wtype.name, s.xq, s.xd, s.xs, got)
    assert np.array_equal(got, want)


def test_tiled_differs_from_vec_dot():
    """The two float orders are not the same function: they part in the last bits (which is why the path matters)."""
    w, x = case(T.Q6_K, 64, 2048, 8, 1)
    s = act_split(x, T.Q8_K)
    tiled, vec = np.empty((8, 64), np.float32), np.empty((8, 64), np.float32)
    dot_kquant_tiled.mm_k_tiled(w, 6, s.xq, s.xd, s.xs, tiled, F16_TABLE)
    dot_kquant_scalar.mv_q6_k(w, s.xq, s.xd, s.xs, vec, F16_TABLE)
    assert np.allclose(tiled, vec, rtol=1e-4, atol=1e-3) and not np.array_equal(tiled, vec)


@pytest.mark.parametrize("wtype,rows", [(T.Q6_K, 24), (T.Q5_K, 24), (T.Q4_K, 13), (T.Q4_K, 16)])
def test_mul_mat_takes_llamacpps_path(wtype, rows):
    """Below 8 activation rows vec_dot (or Q4_K's repacked forms); from 8 rows the tiled kernel, unless llama.cpp
    repacks the weights (Q4_K, rows % 8 == 0). On AVX-512 the sixteen-row kernels take over with the same bits
    (Q6_K's tiled form from 8 rows, Q4_K's gemm from ``ROWS16_MIN_N``; 17: an odd last row, or a gemv row, after
    them)."""
    for n in (1, 7, 8, 11, 17, 24):
        w, x = case(wtype, rows, 512, n, n + rows)
        s = act_split(x, T.Q8_K)
        got = np.empty((n, rows), np.float32)
        matmul.mul_mat(w, wtype, x, got)
        want = np.empty_like(got)
        repacked = wtype == T.Q4_K and rows % 8 == 0
        if n >= dot_kquant_tiled.TILED_MIN_ROWS and not repacked:
            dot_kquant_tiled.mm_k_tiled(w, dot_kquant_tiled.KINDS[wtype.name], s.xq, s.xd, s.xs, want, F16_TABLE)
        elif repacked:
            dot_kquant.mv_q4_k_x8(w, s.xq, s.xd, s.xs, want, F16_TABLE, n - n % 4 if n >= 4 else 0)
        else:
            getattr(dot_kquant_scalar, "mv_" + wtype.name.lower())(w, s.xq, s.xd, s.xs, want, F16_TABLE)
        assert np.array_equal(got, want), n


@pytest.mark.parametrize("rows,k,n", [(40, 1024, 18), (16, 512, 16), (7, 256, 4)])
def test_q6_k_rows16_equals_reference(rows, k, n):
    """The sixteen-rows-as-lanes Q6_K kernel (AVX-512) against the NumPy statement of the tiled arithmetic; rows
    beyond the last full sixteen are computed as zeros and not stored."""
    from llampy.ggml.backends.cpu import simd
    if not simd.ROWS16:
        pytest.skip("this CPU has no AVX-512 VNNI: the sixteen-row kernels are not used here")
    w, x = case(T.Q6_K, rows, k, n, rows + k + n)
    s = act_split(x, T.Q8_K)
    got = np.full((n, rows), np.nan, np.float32)
    dot_kquant_tiled.mm_q6_k_rows16(w, s.xq, s.xd, s.xs, got, n)
    assert np.array_equal(got, reference(w, T.Q6_K, x))


@pytest.mark.slow
def test_target_neutral_path(tmp_path):
    """Without AVX2 (``LLAMPY_SIMD=generic``, a fresh Numba cache) the kernel still equals the reference."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, LLAMPY_SIMD="generic", NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                    "-k", "equals_reference and (Q6_K or Q4_K) and 13-512"], env=env, check=True, timeout=900)


GRID_TILES = [T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M]


@pytest.mark.parametrize("wtype", [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS] + GRID_TILES,
                         ids=lambda t: t.name)
def test_prompt_products_give_ggml_bits(wtype):
    """A prompt's product (8 and 21 activation rows, 44 weight rows: not repacked by llama.cpp, a ragged last
    group) through ``mul_mat`` against ggml's own mul_mat on the host's llama.cpp build (its tiled path). The grid
    formats (no quantizer in llampy): random blocks, d of mixed magnitudes (test_dot_blocks_ggml.weights)."""
    from llampy.ggml.quants import quantize
    lib = llamacpp.libggml_graph()
    rng = np.random.default_rng(int(wtype))
    rows, k = 44, 512
    if wtype in GRID_TILES:
        from tests.ggml.test_dot_blocks_ggml import weights
        w = weights(rng, rows, k, wtype)
    else:
        w32 = rng.standard_normal((rows, k)).astype(np.float32)
        w32[0, :32] *= 50
        w = quantize(w32, wtype).reshape(rows, -1)
    for n in (8, 21):
        x = (rng.standard_normal((n, k)) * 3).astype(np.float32)
        x[0, :5] = [40, -40, 0, 1e-3, 7]
        x[-1, 256:512] = 0
        got = np.full((n, rows), np.nan, np.float32)
        matmul.mul_mat(w, wtype, x, got)
        assert np.array_equal(got, llamacpp.ggml_mul_mat(lib, w, wtype, k, x)), n
