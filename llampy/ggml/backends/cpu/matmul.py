"""Matrix products on the CPU with llama.cpp's numerics: the activations are rounded to the weight type's
``vec_dot_type`` (Q8_0, Q8_1, Q8_K, F16, BF16) before the dot products, as ggml's CPU backend does.

    # w: [rows, k] (uint8 blocks [rows, row_bytes] | float32/float16 [rows, k] | uint16 bits for BF16)
    # x: float32 [n, k]   ->   out: float32 [n, rows];   out[i, r] = dot(w[r], x[i])
    mul_mat(w, wtype, x, out)

Two paths:
- integer (``dot_q32``, ``dot_kquant_scalar``): x quantized once per call (``act_quant``, buffers cached by shape), then Numba
  integer dot products straight on the GGUF blocks in llama.cpp's float order: bit-identical to llama.cpp.
- the block table's formats (F16, BF16, Q2_K, Q3_K, IQ4_NL, IQ4_XS: ``dot_blocks``): their own kernels in ggml's
  float order for batches below ``dot_blocks.SMALL_N`` rows; from there Q2_K, Q3_K and IQ4_XS take llama.cpp's
  tiled order (``dot_kquant_tiled.mm_k_tiles``, as Q4_K / Q5_K / Q6_K do), the others BLAS with tiles dequantized
  by the table's decode rules; and the weights llama.cpp repacks on x86 (IQ4_NL, MXFP4, Q4_0 with rows % 8 == 0,
  not the KV cache's views: ``dot_blocks.repacked_rows``) on its repacked gemv / gemm chain at every batch size.
- BLAS: x rounded through its dot type and back to float32 (exact values), tiles of w dequantized to float32 in
  Numba (``TILE_BYTES`` at a time), ``np.matmul`` per tile. The same numbers up to float32 summation order
  (relative ~1e-7 of |w|·|x|); the Q8_1 formats' min term is corrected to ggml's ``m_w * F16(s_x)`` (see
  ``_round_x``), so the remaining difference is summation order only.

Which path: at most ``exact_max_rows`` activation rows (default ``DECODE_MAX_ROWS``: all) take the integer path.
The integer kernels are the default at every batch size: they are bit-identical to llama.cpp (docs/architecture.md:
SmolLM2's outliers make its outputs sensitive to the last bit) and, with the prompt tiles, faster than the BLAS path
(pp512 in one run, benchmarks/README.md: SmolLM2 616 tok/s integer, 320 BLAS; Gemma 3 617 vs 423). ``LLAMPY_FAST_PROMPT=1`` (or
``CPUBackend.exact_max_rows``) sends batches from ``BLAS_MIN_ROWS`` rows on to BLAS instead — for the formats
without integer kernels it is the only path.

Threads: the integer kernels are Numba ``prange`` loops (threading layer: OpenMP here, ``numba.set_num_threads``
sets their count); the BLAS path runs the same number of Python threads over row ranges, OpenBLAS itself
single-threaded (see ``_blas_workers``). On a loaded 2-core machine libgomp's default spin-waiting makes a 2-thread
region wait for a descheduled worker for milliseconds (a 150 us matvec took ~7 ms, median); ``OMP_WAIT_POLICY=
PASSIVE`` (set before Numba starts its pool) bounds that at the price of a futex wake per region.
"""
from __future__ import annotations

import os

import numpy as np

from ...types import GGMLType, TYPE_TRAITS
from . import (dot_blocks, dot_f16_tiny, dot_f32_short, dot_q32, dot_whole, dot_kquant_scalar, dot_kquant,
               dot_kquant_tiled)
from .act_quant import act_split, bf16_bits_to_f32, q8_round_rows, quantize_act, round_act
from .direct import Direct
from .dot_q32 import F16_TABLE, ROWS16_MIN_N
from .simd import ROWS16

T = GGMLType

SUPPORTED_DIRECT: frozenset = frozenset({T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
                                         T.Q4_K, T.Q5_K, T.Q6_K}) | frozenset(dot_blocks.DEQUANT_TILE)

# integer kernels: weight type -> kernel(w, xq, xd, xs, out, tab)
_KERNELS = {T.Q8_0: dot_q32.mv_q8_0, T.Q4_0: dot_q32.mv_q4_0, T.Q4_1: dot_q32.mv_q4_1, T.Q5_0: dot_q32.mv_q5_0,
            T.Q5_1: dot_q32.mv_q5_1, T.Q5_K: dot_kquant.mv_q5_k, T.Q6_K: dot_kquant.mv_q6_k}
_DQ_LEGACY = {T.Q4_0: 0, T.Q4_1: 1, T.Q5_0: 2, T.Q5_1: 3, T.Q8_0: 4}
_DQ_K = {T.Q4_K: 4, T.Q5_K: 5, T.Q6_K: 6}

# Batches of this many rows or more go to BLAS when exactness is waived; below it the integer kernels are faster
# (SmolLM2 gate 1536x576 Q4_1, 2 threads: n=4 integer 1.0 ms vs BLAS 1.25 ms; n=8 2.0 ms vs 1.4 ms).
BLAS_MIN_ROWS = 6
DECODE_MAX_ROWS = BLAS_MIN_ROWS - 1 if os.environ.get("LLAMPY_FAST_PROMPT") == "1" else 1 << 30
TILE_BYTES = 2 << 20   # float32 bytes of one dequantized weight tile (stays in the large cache)

__all__ = ["SUPPORTED_DIRECT", "mul_mat", "quantize_act", "round_act", "BLAS_MIN_ROWS", "DECODE_MAX_ROWS"]


def _as_2d_rows(a: np.ndarray) -> np.ndarray:
    """A view whose last axis is contiguous (Numba's kernels index it directly); copies only if it is not."""
    return a if a.strides[-1] == a.itemsize else np.ascontiguousarray(a)


def mul_mat(w: np.ndarray, wtype: GGMLType, x: np.ndarray, out: np.ndarray, exact_max_rows: int | None = None,
            scratch=None, repacked: bool = True) -> None:
    """out[n, rows] = x[n, k] · w[rows, k]^T with llama.cpp's CPU numerics (see module doc). ``scratch``: an
    ``act_quant.ActScratch`` for x's shape, to reuse (else buffers are cached by shape). ``repacked``: w sits where
    llama.cpp repacks its rows (a model's weight; False for a view of the KV cache): IQ4_NL, MXFP4 and Q4_0 with
    rows % 8 == 0 take its repacked chain then (``dot_blocks.repacked_rows``)."""
    wtype = GGMLType(wtype)
    n, k = x.shape
    rows = w.shape[0]
    if out.shape != (n, rows):
        raise ValueError(f"out has shape {out.shape}, expected {(n, rows)}")
    if n == 0 or rows == 0:
        return
    limit = DECODE_MAX_ROWS if exact_max_rows is None else exact_max_rows
    if n <= limit and dot_blocks.repacked_rows(wtype, rows, repacked) and _rows_ok(w, x, out):
        dot_blocks.mul_mat(w, wtype, x, out, scratch)    # llama.cpp's repacked rows (dot_blocks._mv_r8, _tiles_r8)
        return
    if wtype == T.F32 and k <= dot_f32_short.MAX_K and n <= limit:
        dot_f32_short.mul_mat_f32_short(_as_2d_rows(w), _as_2d_rows(x), out)    # ggml_vec_dot_f32's scalar loop
        return
    if wtype in (T.F16, T.BF16) and n <= limit and _rows_ok(w, x, out):
        if dot_f16_tiny.applies(rows, k, n):
            _mul_mat_f16_tiny(w, wtype, x, out)          # ggml's tinyBLAS order (dot_f16_tiny)
        else:
            dot_blocks.mul_mat(w, wtype, x, out, scratch)    # where tinyBLAS refuses, ggml_vec_dot_f16/_bf16 at any n
        return
    if wtype in dot_blocks.TYPES and n <= limit and dot_blocks.use_kernel(wtype, n, rows, repacked) \
            and _rows_ok(w, x, out):
        dot_blocks.mul_mat(w, wtype, x, out, scratch, repacked=repacked)    # the block table's formats (dot_blocks)
        return
    if n <= limit and (wtype in _KERNELS or wtype == T.Q4_K):
        _mul_mat_int(_as_2d_rows(w), wtype, x, out, scratch)
        return
    if n <= limit and wtype.name in dot_kquant_tiled.TILES and n >= dot_kquant_tiled.TILED_MIN_ROWS \
            and _rows_ok(w, x, out):
        _mul_mat_tiles(w, wtype, x, out, scratch)     # Q2_K, Q3_K, IQ4_XS, IQ1-IQ3 prompts: llama.cpp's tiled order
        return
    if wtype in SUPPORTED_DIRECT:
        _mul_mat_blas(w, wtype, x, out)
        return
    _mul_mat_fallback(w, wtype, x, out)


def bind_mul_mat(w: np.ndarray, wtype: GGMLType, x: np.ndarray, out: np.ndarray, limit_fn, reuse: bool = False,
                 repacked: bool = True):
    """A plan's matrix product, bound once: when the integer path applies (a kernel for wtype, the batch within
    ``limit_fn()``'s row limit, x and out float32 with contiguous rows), the call made on every run with its own
    activation buffers, skipping ``mul_mat``'s checks and lookups; else None (the caller uses ``mul_mat``).
    ``reuse``: the plan's previous product quantized this same x into the same buffers (``act_scratch``), and
    nothing wrote x since: skip quantizing it again (q, k and v, or gate and up, read one x). ``repacked``: as
    ``mul_mat``'s."""
    wtype = GGMLType(wtype)
    n, k = x.shape
    if wtype in dot_blocks.TYPES or dot_blocks.repacked_rows(wtype, w.shape[0], repacked):
        return _bind_blocks(w, wtype, x, out, limit_fn, reuse, repacked)
    if not (wtype in _KERNELS or wtype == T.Q4_K) or n == 0 or w.shape[0] == 0:
        return None
    if x.dtype != np.float32 or x.strides[-1] != 4 or out.dtype != np.float32 or out.strides[-1] != 4:
        return None
    if out.shape != (n, w.shape[0]) or w.strides[-1] != 1:
        return None
    vdt = TYPE_TRAITS[wtype].vec_dot_type
    scratch = act_scratch(n, k, wtype)

    def fallback(limit):
        mul_mat(w, wtype, x, out, limit, repacked=repacked)

    kernel = _KERNELS.get(wtype)
    if kernel is not None and vdt in (T.Q8_0, T.Q8_1):
        # the 32-value formats: the quantizer and the kernel called directly, their arguments bound here
        from .act_quant import q8_0_quantizer
        xq, xd, xs, with_s, tab = scratch.xq, scratch.xd, scratch.xs, vdt == T.Q8_1, F16_TABLE
        quantize = q8_0_quantizer(n)
        few = n > 1 and dot_whole.few_rows(wtype.name.lower(), n, k)    # 2-7 rows in a tile of four or eight
        rest = dot_q32.REST_KERNELS.get(wtype.name.lower()) if n < 8 and x.flags.c_contiguous and not few else None
        if rest is not None:        # decoding: _mv_legacy's decode form rounding x itself, one call
            quant = not reuse

            def run_rest():
                limit = limit_fn()
                if n > (DECODE_MAX_ROWS if limit is None else limit):
                    return fallback(limit)
                rest(w, x, xq, xd, xs, out, tab, 0, quant)
            return _direct(run_rest, n, limit_fn, Direct(rest, w, x, xq, xd, xs, out, tab, 0, quant))

        def run():
            limit = limit_fn()
            if n > (DECODE_MAX_ROWS if limit is None else limit):
                return fallback(limit)
            if not reuse:
                quantize(x, xq, xd, xs, with_s)
            kernel(w, xq, xd, xs, out, tab)
        # a server's decode step (2-32 rows): the kernel's whole-row call itself, bound (dot_whole.whole_call)
        whole = dot_whole.whole_call(wtype.name.lower(), w, xq, xd, xs, out, tab) if rest is None else None
        if whole is not None:
            return _direct(run, n, limit_fn, *(() if reuse else (Direct(quantize, x, xq, xd, xs, with_s),)), whole)
        return run

    kq = _k_decode_kernel(w, wtype, n)
    if kq is not None:
        # the k-quants' decode (below their tiles' and 4-row kernels' batch sizes): _mul_mat_int's choice, made here
        from .act_quant import q8_k_quantizer
        xq, xd, xs, quantize = scratch.xq, scratch.xd, scratch.xs, q8_k_quantizer(n)
        kernel, extra = kq

        def run_k():
            limit = limit_fn()
            if n > (DECODE_MAX_ROWS if limit is None else limit):
                return fallback(limit)
            if not reuse:
                quantize(x, xq, xd, xs)
            kernel(w, xq, xd, xs, out, *extra)
        calls = () if reuse else (Direct(quantize, x, xq, xd, xs),)
        return _direct(run_k, n, limit_fn, *calls, Direct(kernel, w, xq, xd, xs, out, *extra))

    def run():
        limit = limit_fn()
        if n <= (DECODE_MAX_ROWS if limit is None else limit):
            _mul_mat_int(w, wtype, x, out, scratch, quantized=reuse)
        else:
            fallback(limit)
    return run


def bind_mul_mat_glu(wg: np.ndarray, wu: np.ndarray, wtype: GGMLType, x: np.ndarray, out: np.ndarray, glu: str,
                     limit_fn, unfused, repacked: bool = True):
    """A MUL_MAT_GLU node's fused call (``dot_q32._mv_rows16_glu``: both products and the gated unit per tile, neither
    product stored), bound once; None where that kernel does not apply: a 32-value format on an AVX-512 VNNI CPU,
    at least ``ROWS16_MIN_N`` activation rows, weight rows a multiple of 16, float32 rows contiguous. Up to
    ``dot_q32.GLU_DECODE_MAX_N`` rows (decoding) on any CPU, Q8_0 weights: ``dot_q32._mv_rest_glu``. ``unfused()``
    runs the node as its three ops, for batches past ``limit_fn()``'s integer-path limit (as ``bind_mul_mat``).
    The rows llama.cpp repacks (``dot_blocks.repacked_rows``), whose chain is not vec_dot's, take
    ``dot_blocks._mv_r8_glu`` (``_bind_glu_r8``) when decoding, else the unfused ops."""
    wtype = GGMLType(wtype)
    n, k = x.shape
    if dot_blocks.repacked_rows(wtype, wg.shape[0], repacked):
        return _bind_glu_r8(wg, wu, wtype, x, out, glu, limit_fn, unfused)
    vdt = TYPE_TRAITS[wtype].vec_dot_type
    if n <= dot_q32.GLU_DECODE_MAX_N:       # decoding: the decode products and the unit in one region, any CPU
        kernel = dot_q32.GLU_DECODE_KERNELS.get(wtype.name.lower())
    else:
        kernel = dot_q32.GLU_KERNELS.get(wtype.name.lower()) if ROWS16 and n >= ROWS16_MIN_N else None
    if kernel is None or wg.shape[0] % 16 or vdt not in (T.Q8_0, T.Q8_1):
        return None
    if x.dtype != np.float32 or x.strides[-1] != 4 or out.dtype != np.float32 or out.strides[-1] != 4:
        return None
    if out.shape != (n, wg.shape[0]) or wg.shape != wu.shape or wg.strides[-1] != 1 or wu.strides[-1] != 1:
        return None
    from .act import gelu_table
    from .act_quant import q8_0_quantizer
    scratch = act_scratch(n, k, wtype)
    xq, xd, xs, with_s = scratch.xq, scratch.xd, scratch.xs, vdt == T.Q8_1
    quantize = q8_0_quantizer(n)
    code = dot_q32.GLU_SWIGLU if glu == "swiglu" else dot_q32.GLU_GEGLU
    table = gelu_table() if code == dot_q32.GLU_GEGLU else np.zeros(1, np.float32)

    def run():
        limit = limit_fn()
        if n > (DECODE_MAX_ROWS if limit is None else limit):
            return unfused()
        quantize(x, xq, xd, xs, with_s)
        kernel(wg, wu, xq, xd, xs, out, code, table)
    return _direct(run, n, limit_fn, Direct(quantize, x, xq, xd, xs, with_s),
                   Direct(kernel, wg, wu, xq, xd, xs, out, code, table))


def _bind_glu_r8(wg, wu, wtype, x, out, glu, limit_fn, unfused):
    """``bind_mul_mat_glu`` for the rows llama.cpp repacks, decoding (fewer than eight activation rows, weight rows
    a multiple of 16, x and out C-contiguous float32): ``dot_blocks._mv_r8_glu``, both products on the repacked
    chain and the gated unit in one call that also rounds x; else None."""
    n, k = x.shape
    kernel = dot_blocks.R8_GLU.get(wtype)
    if kernel is None or not 0 < n < 8 or wg.shape[0] % 16 or wg.shape != wu.shape:
        return None
    if not (x.dtype == np.float32 and x.flags.c_contiguous and out.dtype == np.float32 and out.flags.c_contiguous
            and out.shape == (n, wg.shape[0]) and wg.strides[-1] == 1 and wu.strides[-1] == 1):
        return None
    from .act import gelu_table
    s = act_scratch(n, k, wtype)
    code = dot_q32.GLU_SWIGLU if glu == "swiglu" else dot_q32.GLU_GEGLU
    table = gelu_table() if code == dot_q32.GLU_GEGLU else np.zeros(1, np.float32)
    xq, xd, xs = s.xq, s.xd, s.xs

    def run():
        limit = limit_fn()
        if n > (DECODE_MAX_ROWS if limit is None else limit):
            return unfused()
        kernel(wg, wu, x, xq, xd, xs, out, True, code, table)
    return _direct(run, n, limit_fn, Direct(kernel, wg, wu, x, xq, xd, xs, out, True, code, table))


def _direct(run, n, limit_fn, *calls):
    """``run``, a bound product checking its n activation rows against ``limit_fn()`` each time, told what it runs
    when the check passes (``direct``: these calls), where it passes under the limit it is bound at: the plan runs
    them instead while that limit holds (``backend.Plan``)."""
    limit = limit_fn()
    if n <= (DECODE_MAX_ROWS if limit is None else limit):
        run.direct = calls
    return run


def _rows_ok(w, x, out) -> bool:
    """The block-table kernels' layout: float32 x and out with contiguous rows, w's rows contiguous."""
    return (x.dtype == np.float32 and x.strides[-1] == 4 and out.dtype == np.float32 and out.strides[-1] == 4
            and w.strides[-1] == w.itemsize)


def _bind_blocks(w, wtype, x, out, limit_fn, reuse, repacked=True):
    """``bind_mul_mat`` for the formats of the block table (``dot_blocks``) and the rows llama.cpp repacks: their
    kernel where it applies, else None (``mul_mat``'s BLAS path for prompts)."""
    n, k = x.shape
    if wtype in (T.F16, T.BF16) and dot_f16_tiny.applies(w.shape[0], k, n) and _rows_ok(w, x, out) \
            and out.shape == (n, w.shape[0]):
        def run_tiny():
            limit = limit_fn()
            if n > (DECODE_MAX_ROWS if limit is None else limit):
                return mul_mat(w, wtype, x, out, limit, repacked=repacked)
            _mul_mat_f16_tiny(w, wtype, x, out)
        return _direct(run_tiny, n, limit_fn,
                       Direct(dot_f16_tiny.mul_mat_bf16 if wtype == T.BF16 else dot_f16_tiny.mul_mat_f16, w, x, out))
    # F16 / BF16 where tinyBLAS refuses: ggml's vec_dot at any n
    small = dot_blocks.use_kernel(wtype, n, w.shape[0], repacked) or wtype in (T.F16, T.BF16)
    if n == 0 or w.shape[0] == 0 or not small or not _rows_ok(w, x, out):
        return None
    if out.shape != (n, w.shape[0]):
        return None
    scratch = act_scratch(n, k, wtype)
    quantized = reuse and TYPE_TRAITS[wtype].vec_dot_type not in (T.F32, T.F16, T.BF16)
    decode = dot_blocks.bind_decode(w, wtype, x, out, scratch, quantized, repacked)
    if decode is not None:       # a decoded token: one kernel call (it rounds x itself), no lookups per call
        def run_decode():
            limit = limit_fn()
            if n > (DECODE_MAX_ROWS if limit is None else limit):
                return mul_mat(w, wtype, x, out, limit, repacked=repacked)
            decode()
        return _direct(run_decode, n, limit_fn, *decode.direct)

    def run():
        limit = limit_fn()
        if n > (DECODE_MAX_ROWS if limit is None else limit):
            return mul_mat(w, wtype, x, out, limit, repacked=repacked)
        dot_blocks.mul_mat(w, wtype, x, out, scratch, quantized, repacked)
    return run


def _mul_mat_f16_tiny(w, wtype, x, out) -> None:
    """F16 or BF16 weights against 2 or more activation rows (rows % 4 == 0, k % 8 == 0): x rounded to the weight's
    half type, then llamafile's tinyBLAS order, as ggml-cpu computes them (dot_f16_tiny rounds x itself)."""
    if wtype == T.BF16:
        dot_f16_tiny.mul_mat_bf16(w, x, out)
    else:
        dot_f16_tiny.mul_mat_f16(w, x, out)


def act_scratch(n: int, k: int, wtype: GGMLType):
    """The activation buffers a bound product of this weight type and shape quantizes x into (shared by every
    product of the same shape and dot type: the calls run one after another)."""
    from .act_quant import scratch_for
    return scratch_for(n, k, TYPE_TRAITS[GGMLType(wtype)].vec_dot_type)


def _k_decode_kernel(w, wtype, n):
    """The kernel ``_mul_mat_int`` runs for n activation rows of a Q4_K / Q5_K / Q6_K weight when that is one call
    of (w, xq, xd, bsums, out, *extra) (a decoded token: below the tiled kernels' and the 4-row kernels' batch
    sizes), as (kernel, extra); else None."""
    if wtype not in (T.Q4_K, T.Q5_K, T.Q6_K) or n >= min(dot_kquant.SMALL_N, dot_kquant_tiled.TILED_MIN_ROWS):
        return None
    if wtype == T.Q4_K and w.shape[0] % 8 == 0:
        if n >= 4:          # n_gemm rows of the gemm form first
            return None
        return dot_kquant.mv_q4_k_x8, (F16_TABLE, 0)
    return {T.Q4_K: dot_kquant._q4_k, T.Q5_K: dot_kquant._q5_k, T.Q6_K: dot_kquant._q6_k}[wtype], ()


def _mul_mat_tiles(w, wtype, x, out, scratch):
    """A prompt's product of a format llama.cpp runs through its tiled kernel (``dot_kquant_tiled.TILES``): x
    rounded to Q8_K, then ``mm_k_tiles``."""
    s = act_split(x, T.Q8_K, scratch)
    dot_kquant_tiled.mul_mat_tiles(w, wtype.name, s.xq, s.xd, s.xs, out)


def _mul_mat_int(w, wtype, x, out, scratch, quantized: bool = False):
    vdt = TYPE_TRAITS[wtype].vec_dot_type
    s = scratch if quantized else act_split(x, vdt, scratch)
    res = out if (out.dtype == np.float32 and out.strides[-1] == 4) else np.empty(out.shape, np.float32)
    if (wtype.name in dot_kquant_tiled.KINDS and x.shape[0] >= dot_kquant_tiled.TILED_MIN_ROWS
            and not (wtype == T.Q4_K and w.shape[0] % 8 == 0)):   # llama.cpp's tiled path (see dot_kquant_tiled)
        n = x.shape[0]
        if wtype == T.Q6_K and ROWS16:    # sixteen rows as lanes, then an odd last row (from 8 rows: 0.26-0.43x
            # the tiled kernel's time at n = 8-32, where Q4_K's and the 32-value formats' need 16)
            dot_kquant_tiled.mm_q6_k_rows16(w, s.xq, s.xd, s.xs, res, n - n % 2)
            if n % 2:
                dot_kquant_tiled.mm_k_tiled(w, 6, s.xq[n - 1:], s.xd[n - 1:], s.xs[n - 1:], res[n - 1:], F16_TABLE)
        else:       # the tiled order, eight activation rows as lanes (dot_kquant_tiled.mm_k_tiles)
            dot_kquant_tiled.mul_mat_tiles(w, wtype.name, s.xq, s.xd, s.xs, res)
    elif wtype == T.Q4_K:
        n = x.shape[0]
        if w.shape[0] % 8 == 0:   # llama.cpp repacks these rows (8x8) and runs its gemv/gemm forms
            n_gemm = n - n % 4 if n >= 4 else 0
            if ROWS16 and n_gemm >= ROWS16_MIN_N:     # the gemm form with sixteen rows as lanes, then the gemv rows
                # (at 8 rows 1.2x the eight-row kernel's time: it transposes the weights once per call)
                dot_kquant.mm_q4_k_rows16(w, s.xq, s.xd, s.xs, res, n_gemm)
                if n_gemm < n:
                    dot_kquant.mv_q4_k_x8(w, s.xq[n_gemm:], s.xd[n_gemm:], s.xs[n_gemm:], res[n_gemm:], F16_TABLE, 0)
            else:
                dot_kquant.mv_q4_k_x8(w, s.xq, s.xd, s.xs, res, F16_TABLE, n_gemm)
        else:
            dot_kquant.mv_q4_k(w, s.xq, s.xd, s.xs, res, F16_TABLE)
    else:
        _KERNELS[wtype](w, s.xq, s.xd, s.xs, res, F16_TABLE)
    if res is not out:
        out[...] = res


# ------------------------------------------------------------------------------------------------ BLAS path

def _round_x(x, vdt):
    """x rounded through the dot type, as float32 [n, k]; for Q8_1 also the min-term correction ``delta``
    [n, k/32]: ggml adds each block's min times Q8_1's s = F16(d * sum(q)), a float product over the rounded
    values gives min * d * sum(q) instead, so add back delta @ mins^T with delta = s - d * sum(q) (about one
    F16 rounding of the block sum, ~5e-4 relative; without it the results differ by that much where mins are
    large)."""
    if vdt not in (T.Q8_0, T.Q8_1, T.Q8_K):
        return round_act(x, vdt), None
    n, k = x.shape
    if vdt == T.Q8_K:
        s = act_split(x, vdt)
        xr = s.xq.reshape(n, k // 256, 256).astype(np.float32)
        xr *= s.xd[:, :, None]
        return xr.reshape(n, k), None
    xr = np.empty((n, k), np.float32)
    delta = np.empty((n, k // 32), np.float32) if vdt == T.Q8_1 else None
    q8_round_rows(x, xr, delta if delta is not None else xr, delta is not None)
    return xr, delta


def _weights_tile(w, wtype, r0, r1, k, buf):
    """Rows r0..r1 of w as float32 [r1 - r0, k] (in buf where a kernel writes it)."""
    if wtype == T.F32:
        return np.asarray(w[r0:r1], dtype=np.float32)
    t = buf[:r1 - r0]
    if wtype == T.F16:
        t[...] = w[r0:r1]
    elif wtype == T.BF16:
        t[...] = bf16_bits_to_f32(w[r0:r1])
    elif wtype in _DQ_LEGACY:
        dot_q32.dq_legacy(_as_2d_rows(w[r0:r1]), _DQ_LEGACY[wtype], t, F16_TABLE)
    elif wtype in _DQ_K:
        dot_kquant_scalar.dq_k(_as_2d_rows(w[r0:r1]), _DQ_K[wtype], t, F16_TABLE)
    elif wtype in dot_blocks.DEQUANT_TILE:     # the block table's decode rules
        dot_blocks.DEQUANT_TILE[wtype](_as_2d_rows(w[r0:r1]), t)
    else:
        from ...quants import dequantize   # lazily: the library's vectorised reference for the other formats
        t[...] = dequantize(np.ascontiguousarray(w[r0:r1]), wtype).reshape(r1 - r0, k)
    return t


def _blas_rows(w, wtype, xr, delta, out, r0, r1, step):
    """out[:, r0:r1] through float32 tiles of step rows (one worker's share)."""
    k = xr.shape[1]
    buf = np.empty((step, k), np.float32)
    direct = out.dtype == np.float32 and out.strides[1] == 4
    bs = TYPE_TRAITS[wtype].type_size
    for a in range(r0, r1, step):
        b = min(r1, a + step)
        wt = _weights_tile(w, wtype, a, b, k, buf)
        if direct:     # BLAS writes straight into out's columns (a row-strided view is fine for it)
            rt = out[:, a:b]
            np.matmul(xr, wt.T, out=rt)
        else:
            rt = xr @ wt.T
        if delta is not None:
            mins = np.ascontiguousarray(w[a:b].reshape(b - a, k // 32, bs)[:, :, 2:4]).view(np.float16)
            rt += delta @ mins[:, :, 0].astype(np.float32).T
        if not direct:
            out[:, a:b] = rt


def _mul_mat_blas(w, wtype, x, out):
    n, k = x.shape
    rows = w.shape[0]
    if x.dtype != np.float32 or x.strides[1] != 4:
        x = np.ascontiguousarray(x, dtype=np.float32)
    xr, delta = _round_x(x, TYPE_TRAITS[wtype].vec_dot_type)
    nt = _blas_workers() if rows >= 64 else 1
    step = max(8, min(-(-rows // nt), TILE_BYTES // (4 * k)))
    if nt <= 1:
        _blas_rows(w, wtype, xr, delta, out, 0, rows, step)
        return
    # coarse split: each worker owns a contiguous range of rows (whole tiles), dequantizes (Numba, nogil) and
    # multiplies (single-threaded OpenBLAS) on its own; the only synchronisation is the join at the end
    cut = [rows * i // nt for i in range(nt + 1)]
    futs = [_POOL.submit(_blas_rows, w, wtype, xr, delta, out, cut[i], cut[i + 1], step) for i in range(1, nt)]
    _blas_rows(w, wtype, xr, delta, out, cut[0], cut[1], step)
    for f in futs:
        f.result()


# Threads for the BLAS path. OpenBLAS's own threads spin after each GEMM and synchronise finely; on this 2-core,
# shared machine that stalled the Numba kernels that followed (OpenMP regions waiting for a spinning core) and
# made 2-thread GEMMs slower than one under load. So where OpenBLAS runs single-threaded (the process tuning sets
# it: llampy.tuning) the BLAS path splits the rows over Python threads instead (measured: 3.8 ms vs 4.4 ms with
# OpenBLAS's 2 threads, 7.2 ms with one); where OpenBLAS has its own threads, it is called from one.
_POOL = None
_POOL_N = 0


def _blas_workers() -> int:
    global _POOL, _POOL_N
    import numba

    from .blas import get_threads
    n = numba.get_num_threads() if get_threads() == 1 else 1
    if n != _POOL_N:
        from concurrent.futures import ThreadPoolExecutor
        if _POOL is not None:
            _POOL.shutdown(wait=False)
        _POOL = ThreadPoolExecutor(max(1, n - 1), thread_name_prefix="llampy-blas") if n > 1 else None
        _POOL_N = n
    return n


def _mul_mat_fallback(w, wtype, x, out):
    """Types without kernels: dequantized weights (llampy's reference dequantize) times x rounded through the
    dot type, tile by tile."""
    from ...quants import dequantize
    n, k = x.shape
    rows = w.shape[0]
    xr, delta = _round_x(np.ascontiguousarray(x, dtype=np.float32), TYPE_TRAITS[wtype].vec_dot_type)
    assert delta is None     # the Q8_1 formats (Q4_1, Q5_1) have kernels
    step = max(8, min(rows, TILE_BYTES // (4 * k)))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        wt = dequantize(np.ascontiguousarray(w[r0:r1]), wtype).reshape(r1 - r0, k)
        out[:, r0:r1] = xr @ wt.T
