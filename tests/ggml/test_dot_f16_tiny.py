"""F16 and BF16 products in llamafile's tinyBLAS order (cpu/dot_f16_tiny.py), which ggml-cpu takes for F16 and BF16
weights from two activation rows on (rows % 4 == 0, k % 8 == 0): against a NumPy transliteration of that order, and
through matmul's dispatch; BF16 also against ggml's own mul_mat where llama.cpp is built."""
from __future__ import annotations

import numpy as np
import pytest

from llampy.ggml.backends.cpu import dot_f16_tiny, matmul as mm
from llampy.ggml.backends.cpu.act_quant import round_half
from llampy.ggml.types import GGMLType as T
from tests import llamacpp


def tinyblas_order(w16: np.ndarray, x: np.ndarray, bf16: bool = False) -> np.ndarray:
    """out[i, r]: x rounded to F16 (``bf16``: BF16, w then BF16 bits); one 8-lane float32 accumulator over k in steps
    of 8 (the half products are exact in float32, so each fma is one float32 addition); hsum(__m256): ((a4 + a0) +
    (a6 + a2)) + ((a5 + a1) + (a7 + a3))."""
    if bf16:
        w = (w16.astype(np.uint32) << 16).view(np.float32)
        xr = round_half(x, T.BF16)
    else:
        w = w16.astype(np.float32)
        xr = x.astype(np.float16).astype(np.float32)
    rows, k = w.shape
    out = np.empty((len(x), rows), np.float32)
    for i in range(len(x)):
        p = (w * xr[i]).reshape(rows, k // 8, 8)
        acc = np.zeros((rows, 8), np.float32)
        for j in range(k // 8):
            acc = (acc + p[:, j]).astype(np.float32)
        a = acc
        out[i] = ((a[:, 4] + a[:, 0]) + (a[:, 6] + a[:, 2])) + ((a[:, 5] + a[:, 1]) + (a[:, 7] + a[:, 3]))
    return out


@pytest.mark.parametrize("rows,k,n", [(8, 48, 2), (12, 96, 7), (20, 1152, 50), (4, 8, 3), (8, 40, 301)])
def test_tinyblas_order(rows, k, n):
    rng = np.random.default_rng(rows * k + n)
    w = (rng.standard_normal((rows, k)) * rng.choice([1e-3, 1.0, 30.0], size=(rows, 1))).astype(np.float16)
    x = (rng.standard_normal((n, k)) * rng.choice([1e-2, 1.0, 300.0], size=(n, 1))).astype(np.float32)
    assert dot_f16_tiny.applies(rows, k, n)
    want = tinyblas_order(w, x)
    out = np.full((n, rows), np.nan, np.float32)
    mm.mul_mat(w, T.F16, x, out)                          # the dispatch takes it
    assert np.array_equal(out, want)
    out[...] = np.nan
    mm.bind_mul_mat(w, T.F16, x, out, lambda: None)()
    assert np.array_equal(out, want)


def test_where_ggml_takes_tinyblas():
    assert not dot_f16_tiny.applies(8, 64, 1)             # one row: ggml_vec_dot_f16
    assert not dot_f16_tiny.applies(6, 64, 4)             # rows % 4
    assert not dot_f16_tiny.applies(8, 60, 4)             # k % 8


def _bf16_case(rows, k, n, seed):
    rng = np.random.default_rng(seed)
    w32 = (rng.standard_normal((rows, k)) * rng.choice([1e-3, 1.0, 30.0], size=(rows, 1))).astype(np.float32)
    w = (w32.view(np.uint32) >> 16).astype(np.uint16)
    x = (rng.standard_normal((n, k)) * rng.choice([1e-2, 1.0, 300.0], size=(n, 1))).astype(np.float32)
    x[0, :3] = np.array([0x3F808000, 0x3F818000, 0x3F80C000], np.uint32).view(np.float32)   # ties to even, above
    return w, x


@pytest.mark.parametrize("rows,k,n", [(8, 48, 2), (12, 96, 7), (20, 1152, 50), (8, 40, 301)])
def test_bf16_tinyblas_order(rows, k, n):
    """BF16 weights: x rounded to BF16 (to nearest even), then tinyBLAS's chain, through mul_mat and the bound call;
    one activation row keeps ggml_vec_dot_bf16 (dot_blocks)."""
    w, x = _bf16_case(rows, k, n, rows * k + n)
    want = tinyblas_order(w, x, bf16=True)
    out = np.full((n, rows), np.nan, np.float32)
    mm.mul_mat(w, T.BF16, x, out)
    assert np.array_equal(out, want)
    out[...] = np.nan
    mm.bind_mul_mat(w, T.BF16, x, out, lambda: None)()
    assert np.array_equal(out, want)


def test_bf16_prompt_gives_ggml_bits():
    """A BF16 prompt product (n = 2, 33: rows of three-row tiles and a rest) equals ggml's mul_mat on the host's
    llama.cpp build, where that build runs tinyBLAS in 8 lanes (AVX2; its AVX-512 builds take 16, or AVX512_BF16's
    vdpbf16ps, and llampy keeps the 8-lane chain on every host, as for F16)."""
    from llampy.ggml.backends.cpu.simd import HOST_VEC_LANES
    if HOST_VEC_LANES != 8:        # the tests' llama.cpp is built for the host
        pytest.skip("llama.cpp's AVX-512 build runs BF16's tinyBLAS in 16 lanes")
    lib = llamacpp.libggml_graph()
    for rows, k, n in ((44, 512, 33), (8, 64, 2)):
        w, x = _bf16_case(rows, k, n, n)
        out = np.full((n, rows), np.nan, np.float32)
        mm.mul_mat(w, T.BF16, x, out)
        assert np.array_equal(out, llamacpp.ggml_mul_mat(lib, w, T.BF16, k, x)), n
