"""F16 weight products in llamafile's tinyBLAS order, which ggml-cpu takes for F16 weights (after rounding the
activations to F16) whenever a batch has 2 or more rows, the weight rows are a multiple of 4 and k a multiple of 8
(``llamafile_sgemm``, AVX2 build: ``tinyBLAS<8, __m256, __m256, ggml_fp16_t, ggml_fp16_t, float>``).

Per (weight row, activation row) pair: one f32x8 accumulator over k in steps of 8, ``acc = fma(w, x, acc)``, then
``hsum``: ((a4 + a0) + (a6 + a2)) + ((a5 + a1) + (a7 + a3)). The pairs are independent, so the kernel computes 4
weight rows x 3 activation rows at a time (twelve accumulators: the FMA chains overlap) without changing a bit.
The activations are rounded to F16 bits first, as ggml does (half the bytes of float32: the block of rows a thread
keeps over all the weight rows stays nearer the core), and widened as they are loaded.

    mul_mat_f16(w_bits uint16 [rows, k], x float32 [n, k], out float32 [n, rows])

BF16 weights take the same class on AVX2 (``tinyBLAS<8, __m256, __m256, ggml_bf16_t, ggml_bf16_t, float>``, x rounded to
BF16 by ggml's from_float: round to nearest even, a NaN kept quiet): the same tiles and chain (``mul_mat_bf16``), the
weights' BF16 halves widened by a 16-bit shift as they are loaded; x stays float32 after its rounding (one widening per
weight load only: 1536 x 576, n = 512, one thread, 17.6 -> 14.4 ms CPU; ggml's 17.5; the BLAS path's dequantized
tiles took ~40).
"""
from __future__ import annotations

import numpy as np
from numba import get_num_threads, njit, prange

from .claims import claim, workers
from ...types import GGMLType
from .act_quant import round_half
from .dot_blocks import f32x8_fmav, f32x8_ld
from .simd import f16_bits, f32x8_hsum, f32x8_zero, v16_f16_copy

RB = 4          # weight rows per tile
CB = 3          # activation rows per tile
# activation rows a thread takes at once (its x rows are read again for every 4 weight rows; the weights, once per
# block): up to 144 (at 4096 x 1152 x 4304 on Zen 3, 10-15% less CPU time than 48; 192 and 288 no better)
N_BLOCK = 144
K_F16, K_BF16 = 0, 1     # the half type of w and of the rounded x


def applies(rows: int, k: int, n: int) -> bool:
    """Whether ggml-cpu runs this product through tinyBLAS (else ggml_vec_dot_f16)."""
    return n >= 2 and rows % 4 == 0 and k % 8 == 0


@njit(cache=True, inline="always")
def _ld(a, l, kind):
    """Eight halves of a (uint16 bits of ``kind``'s type) from l, widened to float32."""
    if kind == K_BF16:
        return f32x8_ld(a, l, True)
    return f32x8_ld(a, l, False)


@njit(cache=True, inline="always")
def _dot1(w, r, x, i, k, kind):
    acc = f32x8_zero()
    for l in range(0, k, 8):
        acc = f32x8_fmav(_ld(w[r], l, kind), _ld(x[i], l, kind), acc)
    return f32x8_hsum(acc)


@njit(cache=True, inline="always")
def _tile(w, r, x, i, k, out, kind):
    a00 = a01 = a02 = a10 = a11 = a12 = a20 = a21 = a22 = a30 = a31 = a32 = f32x8_zero()
    w0, w1, w2, w3 = w[r], w[r + 1], w[r + 2], w[r + 3]
    x0, x1, x2 = x[i], x[i + 1], x[i + 2]
    for l in range(0, k, 8):
        v0 = _ld(x0, l, kind)
        v1 = _ld(x1, l, kind)
        v2 = _ld(x2, l, kind)
        u = _ld(w0, l, kind)
        a00 = f32x8_fmav(u, v0, a00)
        a01 = f32x8_fmav(u, v1, a01)
        a02 = f32x8_fmav(u, v2, a02)
        u = _ld(w1, l, kind)
        a10 = f32x8_fmav(u, v0, a10)
        a11 = f32x8_fmav(u, v1, a11)
        a12 = f32x8_fmav(u, v2, a12)
        u = _ld(w2, l, kind)
        a20 = f32x8_fmav(u, v0, a20)
        a21 = f32x8_fmav(u, v1, a21)
        a22 = f32x8_fmav(u, v2, a22)
        u = _ld(w3, l, kind)
        a30 = f32x8_fmav(u, v0, a30)
        a31 = f32x8_fmav(u, v1, a31)
        a32 = f32x8_fmav(u, v2, a32)
    out[i, r], out[i + 1, r], out[i + 2, r] = f32x8_hsum(a00), f32x8_hsum(a01), f32x8_hsum(a02)
    out[i, r + 1], out[i + 1, r + 1], out[i + 2, r + 1] = f32x8_hsum(a10), f32x8_hsum(a11), f32x8_hsum(a12)
    out[i, r + 2], out[i + 1, r + 2], out[i + 2, r + 2] = f32x8_hsum(a20), f32x8_hsum(a21), f32x8_hsum(a22)
    out[i, r + 3], out[i + 1, r + 3], out[i + 2, r + 3] = f32x8_hsum(a30), f32x8_hsum(a31), f32x8_hsum(a32)


@njit(parallel=True, cache=True, nogil=True)
def _to_f16(xu, xf, out):
    """out = the F16 bits of the float32 values (xu their bits, xf the same memory as float32), rounded to
    nearest even as GGML_FP32_TO_FP16 (vcvtps2ph) rounds them."""
    n, k = xu.shape
    k16 = k - k % 16
    for i in prange(n):
        for j in range(0, k16, 16):
            v16_f16_copy(out[i], xu[i], j)
        for j in range(k16, k):
            out[i, j] = f16_bits(xf[i, j])


@njit(parallel=True, cache=True, nogil=True)
def _mm(w, x, out, nb, n_workers):
    _mm_kind(w, x, out, nb, n_workers, K_F16)


@njit(parallel=True, cache=True, nogil=True)
def _mm_bf16(w, x, out, nb, n_workers):
    _mm_kind(w, x, out, nb, n_workers, K_BF16)


@njit(cache=True, inline="always")
def _mm_kind(w, x, out, nb, n_workers, kind):
    rows, k = w.shape
    n = x.shape[0]
    n_blocks = (n + nb - 1) // nb
    counter = np.zeros(1, np.int64)
    for _ in prange(n_workers):     # each worker takes the next block of activation rows until none is left
        while True:
            b = claim(counter)
            if b >= n_blocks:
                break
            i0 = b * nb
            i1 = min(n, i0 + nb)
            i_full = i0 + (i1 - i0) // CB * CB
            for r in range(0, rows - rows % RB, RB):
                for i in range(i0, i_full, CB):
                    _tile(w, r, x, i, k, out, kind)
                for i in range(i_full, i1):
                    for rr in range(r, r + RB):
                        out[i, rr] = _dot1(w, rr, x, i, k, kind)
            for rr in range(rows - rows % RB, rows):
                for i in range(i0, i1):
                    out[i, rr] = _dot1(w, rr, x, i, k, kind)


def block_rows(n: int, n_threads: int) -> int:
    """Activation rows per block: at most N_BLOCK, a multiple of CB, the blocks a multiple of the threads (equal
    shares when the threads run at the same speed; the workers take blocks as they finish, so a thread that loses
    its core for a while is not waited for)."""
    n_blocks = n_threads * -(-n // (n_threads * N_BLOCK))
    return max(CB, -(-n // (n_blocks * CB)) * CB)


def mul_mat_f16(w: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """out [n, rows] = x [n, k] (float32, rows contiguous; rounded to F16 here) times w (F16 bits)^T."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    xh = np.empty(x.shape, np.uint16)
    _to_f16(x.view(np.uint32), x, xh)
    nb = block_rows(x.shape[0], get_num_threads())
    _mm(w.view(np.uint16), xh, out, nb, workers(-(-x.shape[0] // nb)))


def mul_mat_bf16(w: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """out [n, rows] = x [n, k] (float32, rows contiguous; rounded to BF16 here) times w (BF16 bits)^T."""
    xr = round_half(x, GGMLType.BF16)
    nb = block_rows(x.shape[0], get_num_threads())
    _mm_bf16(w.view(np.uint16), xr, out, nb, workers(-(-x.shape[0] // nb)))
