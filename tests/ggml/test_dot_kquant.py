"""The tiled SIMD k-quant kernels (cpu/dot_kquant.py) against the scalar transliterations of llama.cpp's x86 forms
(cpu/dot_kquant_scalar.py): bit-identical outputs on random Q4_K/Q5_K/Q6_K weights (rows in eights and not, every batch size
from 1 to 9: gemv rows, gemm groups of four, 2-activation tiles and their tails) and on the real Gemma 3
270M tensors."""
from __future__ import annotations

import numpy as np
import pytest

from llampy.ggml.backends.cpu import dot_kquant_scalar, dot_kquant
from llampy.ggml.backends.cpu.act_quant import act_split
from llampy.ggml.backends.cpu.dot_q32 import F16_TABLE
from llampy.ggml.quants_k import quantize_q4_k, quantize_q5_k, quantize_q6_k
from llampy.ggml.types import GGMLType as T

QUANT = {T.Q4_K: quantize_q4_k, T.Q5_K: quantize_q5_k, T.Q6_K: quantize_q6_k}
N_LIST = (1, 2, 3, 4, 5, 8, 9)


def n_gemm(n):
    return n - n % 4 if n >= 4 else 0


def run_both(w, wtype, x, x8):
    """(new, reference) outputs of the kernel for wtype (``x8``: Q4_K's repacked form)."""
    n = x.shape[0]
    s = act_split(x, T.Q8_K)
    want = np.empty((n, w.shape[0]), np.float32)
    got = np.full_like(want, np.nan)
    if x8:
        dot_kquant_scalar.mv_q4_k_x8(w, s.xq, s.xd, s.xs, want, F16_TABLE, n_gemm(n))
        dot_kquant.mv_q4_k_x8(w, s.xq, s.xd, s.xs, got, F16_TABLE, n_gemm(n))
    else:
        name = "mv_" + wtype.name.lower()
        getattr(dot_kquant_scalar, name)(w, s.xq, s.xd, s.xs, want, F16_TABLE)
        getattr(dot_kquant, name)(w, s.xq, s.xd, s.xs, got, F16_TABLE)
    return got, want


def random_case(wtype, rows, k, seed):
    rng = np.random.default_rng(seed)
    w32 = rng.standard_normal((rows, k)).astype(np.float32)
    w32[0, :32] *= 50                                           # one sub-block of large scales
    w = np.asarray(QUANT[wtype](w32)).reshape(rows, -1)
    xs = []
    for n in N_LIST:
        x = (rng.standard_normal((n, k)) * 3).astype(np.float32)
        x[0, :7] = [40, -40, 0, 1e-3, -1e-3, 7, -7]             # a large-magnitude block and small values
        if k >= 512:
            x[-1, 256:512] = 0                                  # an all-zero super-block (d_x = 0)
        xs.append(x)
    return w, xs


@pytest.mark.parametrize("rows,k", [(8, 256), (40, 1024), (24, 768), (13, 512)])
def test_q4_k_x8_equals_scalar(rows, k):
    w, xs = random_case(T.Q4_K, rows, k, rows + k)
    for x in xs:
        got, want = run_both(w, T.Q4_K, x, True)
        assert np.array_equal(got, want), x.shape[0]


@pytest.mark.parametrize("rows", [24, 13])
def test_q4_k_x8_broadcast_tiles_equal_scalar(rows):
    """From ``BC_MIN`` gemm rows the sixteen-row steps run in the broadcast form (``_bc_tiles``: activation rows as
    lanes): the same bits as the scalar form for gemm rows 0..31 there, 32..35 in the eight-row gemm form and a
    gemv row; 24 weight rows (a task of sixteen and one of eight) and 13 (eight, then five beyond the eights)."""
    w, _ = random_case(T.Q4_K, rows, 512, 5 + rows)
    n = 37
    x = (np.random.default_rng(6).standard_normal((n, 512)) * 3).astype(np.float32)
    x[3, 256:512] = 0
    x[20, :32] = 127                                            # the 16-bit pair sums near their largest
    got, want = run_both(w, T.Q4_K, x, True)
    assert n_gemm(n) - n_gemm(n) % 16 >= dot_kquant.BC_MIN
    assert np.array_equal(got, want)


@pytest.mark.parametrize("rows,k,n", [(40, 1024, 20), (16, 256, 8), (8, 512, 4)])
def test_q4_k_rows16_equals_x8_gemm(rows, k, n):
    """Q4_K's gemm form with sixteen weight rows as lanes (AVX-512) against the eight-row repacked kernel's: the
    same bits for every gemm row; a last group of eight rows is computed with zero rows beside it."""
    from llampy.ggml.backends.cpu import simd
    if not simd.ROWS16:
        pytest.skip("this CPU has no AVX-512 VNNI: the sixteen-row kernels are not used here")
    rng = np.random.default_rng(rows + n)
    w = np.asarray(quantize_q4_k(rng.standard_normal((rows, k)).astype(np.float32))).reshape(rows, -1)
    s = act_split((rng.standard_normal((n, k)) * 3).astype(np.float32), T.Q8_K)
    got = np.full((n, rows), np.nan, np.float32)
    want = np.empty((n, rows), np.float32)
    dot_kquant.mm_q4_k_rows16(w, s.xq, s.xd, s.xs, got, n)
    dot_kquant.mv_q4_k_x8(w, s.xq, s.xd, s.xs, want, F16_TABLE, n)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("wtype", [T.Q6_K, T.Q4_K, T.Q5_K], ids=lambda t: t.name)
@pytest.mark.parametrize("rows,k", [(8, 256), (13, 512), (40, 1024)])
def test_vec_dot_forms_equal_scalar(wtype, rows, k):
    """mv_q6_k, mv_q4_k, mv_q5_k: 4x2 and 4x1 tiles and single rows all keep ggml_vec_dot's lanes."""
    w, xs = random_case(wtype, rows, k, 3 * rows + k + wtype)
    for x in xs:
        got, want = run_both(w, wtype, x, False)
        assert np.array_equal(got, want), x.shape[0]


@pytest.mark.slow
def test_real_gemma3_k_quants(gemma3_path):
    from llampy.gguf.reader import GGUFReader
    r = GGUFReader(str(gemma3_path))
    rng = np.random.default_rng(7)
    cases = [("blk.0.attn_output.weight", T.Q4_K), ("blk.1.ffn_down.weight", T.Q4_K),
             ("blk.0.ffn_down.weight", T.Q6_K)]
    seen = set()
    for name, wtype in cases:
        info = r.tensors[name]
        if info.type != wtype:
            continue
        seen.add(wtype)
        w = np.ascontiguousarray(r.tensor_array(name))
        k = info.ne[0]
        for n in (1, 2, 5, 8):
            x = (rng.standard_normal((n, k)) * 2).astype(np.float32)
            if wtype == T.Q4_K:
                got, want = run_both(w[:128], wtype, x, True)
                assert np.array_equal(got, want), (name, n)
                got, want = run_both(w[:61], wtype, x, False)      # the plain form (rows not in eights)
            else:
                got, want = run_both(w[:128], wtype, x, False)
            assert np.array_equal(got, want), (name, n)
    assert seen == {T.Q4_K, T.Q6_K}
