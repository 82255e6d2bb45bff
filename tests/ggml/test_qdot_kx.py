"""The SIMD k-quant kernels (cpu/qdot_kx.py) against the scalar transliterations of llama.cpp's x86 forms
(cpu/qdot_k.py): Q4_K's repacked 8x8 gemv/gemm (every batch size: gemv rows and gemm groups of four) and Q6_K's
AVX2 vec_dot give the same bits, on random weights and on a real Gemma 3 tensor."""
from __future__ import annotations

import numpy as np
import pytest

from llampy.ggml.backends.cpu import qdot_k, qdot_kx
from llampy.ggml.backends.cpu.act_quant import act_split
from llampy.ggml.backends.cpu.qdot import F16_TABLE
from llampy.ggml.quants_k import quantize_q4_k
from llampy.ggml.types import GGMLType as T


def both(w, x):
    n = x.shape[0]
    s = act_split(x, T.Q8_K)
    n_gemm = n - n % 4 if n >= 4 else 0
    want = np.empty((n, w.shape[0]), np.float32)
    got = np.empty_like(want)
    qdot_k.mv_q4_k_x8(w, s.xq, s.xd, s.xs, want, F16_TABLE, n_gemm)
    qdot_kx.mv_q4_k_x8(w, s.xq, s.xd, s.xs, got, F16_TABLE, n_gemm)
    return got, want


@pytest.mark.parametrize("rows,k", [(8, 256), (40, 1024), (24, 768)])
def test_q4_k_simd_equals_scalar(rows, k):
    rng = np.random.default_rng(rows + k)
    w = np.asarray(quantize_q4_k(rng.standard_normal((rows, k)).astype(np.float32))).reshape(rows, -1)
    for n in (1, 2, 3, 4, 5, 8, 9):
        x = (rng.standard_normal((n, k)) * 3).astype(np.float32)
        x[0, :7] = [40, -40, 0, 1e-3, -1e-3, 7, -7]           # a large-magnitude block and small values
        got, want = both(w, x)
        assert np.array_equal(got, want), n


@pytest.mark.slow
def test_q4_k_simd_on_gemma3(gemma3_path):
    from llampy.gguf.reader import GGUFReader
    r = GGUFReader(str(gemma3_path))
    info = r.tensors["blk.0.attn_output.weight"]
    assert info.type == T.Q4_K
    w = np.ascontiguousarray(r.tensor_array("blk.0.attn_output.weight")[:64])
    rng = np.random.default_rng(3)
    for n in (1, 4, 6):
        got, want = both(w, (rng.standard_normal((n, info.ne[0])) * 2).astype(np.float32))
        assert np.array_equal(got, want)


@pytest.mark.parametrize("rows,k", [(8, 256), (40, 1024), (24, 768)])
def test_q6_k_simd_equals_scalar(rows, k):
    from llampy.ggml.quants_k import quantize_q6_k
    rng = np.random.default_rng(rows * k)
    w = np.asarray(quantize_q6_k(rng.standard_normal((rows, k)).astype(np.float32))).reshape(rows, -1)
    for n in (1, 2, 5):
        x = (rng.standard_normal((n, k)) * 3).astype(np.float32)
        x[0, :4] = [60, -60, 1e-3, 0]
        s = act_split(x, T.Q8_K)
        want = np.empty((n, rows), np.float32)
        got = np.empty_like(want)
        qdot_k.mv_q6_k(w, s.xq, s.xd, s.xs, want, F16_TABLE)
        qdot_kx.mv_q6_k(w, s.xq, s.xd, s.xs, got, F16_TABLE)
        assert np.array_equal(got, want), n
