"""Activations with ggml's exact float32 arithmetic. ggml's CPU SiLU runs the host build's register width at a
time (16 lanes on AVX-512, 8 on AVX2) through its own polynomial exp (ggml_v_expf, whose AVX-512 and AVX2 forms
round differently), and the C library's expf for the leftover elements; the results differ from a correctly rounded
exp in the last bit, which SmolLM2 notices. ``F16_VEC_LANES`` (simd.py) picks the host's width and form."""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .simd import F16_VEC_LANES, expf_lane, f16_bits, v16_geglu, v16_load, v16_mul, v16_silu, v16_store

_R = np.float32(float.fromhex("0x1.8p23"))
_LOG2E = np.float32(float.fromhex("0x1.715476p+0"))
_LN2_HI = np.float32(float.fromhex("0x1.62e4p-1"))
_LN2_LO = np.float32(float.fromhex("0x1.7f7d1cp-20"))
_C5 = np.float32(float.fromhex("0x1.0e4020p-7"))
_C4 = np.float32(float.fromhex("0x1.573e2ep-5"))
_C3 = np.float32(float.fromhex("0x1.555e66p-3"))
_C2 = np.float32(float.fromhex("0x1.fffdb6p-2"))
_C1 = np.float32(float.fromhex("0x1.ffffecp-1"))


@njit(cache=True, inline="always")
def _fma(a, b, c):
    """float32 fused multiply-add: the exact product and sum, rounded once (through float64)."""
    return np.float32(np.float64(a) * np.float64(b) + np.float64(c))


@njit(cache=True)
def v_expf(x):
    """One lane of ggml_v_expf in the host build's form."""
    if F16_VEC_LANES == 8:
        return expf_lane(x)
    z = _fma(x, _LOG2E, _R)
    n = np.float32(z - _R)
    b = _fma(-n, _LN2_LO, _fma(-n, _LN2_HI, x))
    u = np.float32(b * b)
    j = _fma(_fma(_fma(_C5, b, _C4), u, _fma(_C3, b, _C2)), u, _fma(_C1, b, np.float32(1.0)))
    if abs(n) > 192:
        return np.float32(0.0) if n <= 0 else np.float32(np.inf)
    return np.float32(math.ldexp(np.float64(j), int(n)))


@njit(cache=True, inline="always")
def _silu_v(x):
    return np.float32(x / np.float32(np.float32(1.0) + v_expf(np.float32(-x))))


@njit(cache=True, inline="always")
def _silu_s(x):
    return np.float32(x / np.float32(np.float32(1.0) + np.float32(math.exp(np.float32(-x)))))


@njit(cache=True, inline="always")
def _swiglu_row(gr, ur, orow):
    n = gr.shape[0]
    n16 = n - n % 16
    for i in range(0, n16, 16):
        v16_store(orow, i, v16_mul(v16_silu(v16_load(gr, i)), v16_load(ur, i)))
    nv = n - n % F16_VEC_LANES
    for i in range(n16, nv):            # AVX2: an eight-lane step more
        orow[i] = np.float32(_silu_v(gr[i]) * ur[i])
    for i in range(nv, n):
        orow[i] = np.float32(_silu_s(gr[i]) * ur[i])


@njit(cache=True)
def swiglu_rows(g, u, out):
    """out = silu(g) * u, row by row (g, u, out: float32 [rows, n], rows contiguous): ggml_vec_swiglu_f32, lanes of
    16 through ggml_v_silu, leftovers scalar with expf."""
    for r in range(g.shape[0]):
        _swiglu_row(g[r], u[r], out[r])


@njit(parallel=True, cache=True)
def swiglu_rows_par(g, u, out):
    """``swiglu_rows`` with the rows on all threads (prompts: ``GLU_PAR_ROWS`` rows and more)."""
    for r in prange(g.shape[0]):
        _swiglu_row(g[r], u[r], out[r])


@njit(cache=True, inline="always")
def _silu_row(xr, orow):
    n = xr.shape[0]
    n16 = n - n % 16
    nv = n - n % F16_VEC_LANES
    for i in range(0, n16, 16):
        v16_store(orow, i, v16_silu(v16_load(xr, i)))
    for i in range(n16, nv):        # AVX2: an eight-lane step more
        orow[i] = _silu_v(xr[i])
    for i in range(nv, n):
        orow[i] = _silu_s(xr[i])


@njit(cache=True)
def silu_rows(x, out):
    for r in range(x.shape[0]):
        _silu_row(x[r], out[r])


@njit(parallel=True, cache=True)
def silu_rows_par(x, out):
    """``silu_rows`` with the rows on all threads (prompts: Mamba-2's convolution outputs, 512 x 2304 per layer)."""
    for r in prange(x.shape[0]):
        _silu_row(x[r], out[r])


@njit(cache=True)
def _gelu_table(xs):
    a = np.float32(0.044715)
    c = np.float32(0.79788456080286535587989211986876)
    out = np.empty(xs.shape[0], np.float32)
    for i in range(xs.shape[0]):
        x = xs[i]
        inner = _fma(np.float32(a * x), x, np.float32(1.0))     # the compiler fuses (a*x)*x + 1
        t = np.float32(math.tanh(np.float32(np.float32(c * x) * inner)))
        out[i] = np.float32(np.float32(np.float32(0.5) * x) * np.float32(np.float32(1.0) + t))
    return out


_GELU_F16 = None


def gelu_table() -> np.ndarray:
    """ggml_table_gelu_f16: GELU (tanh form, float32, tanhf) of every F16 value, rounded to F16, as float32."""
    global _GELU_F16
    if _GELU_F16 is None:
        xs = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)
        _GELU_F16 = _gelu_table(xs).astype(np.float16).astype(np.float32)
    return _GELU_F16


def gelu_f32(x: np.ndarray) -> np.ndarray:
    """ggml's CPU GELU for float32: the F16 table for -10 < x < 10, 0 below, x above."""
    x = np.asarray(x, dtype=np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        v = gelu_table()[x.astype(np.float16).view(np.uint16)]
    return np.where(x <= -10, np.float32(0), np.where(x >= 10, x, v)).astype(np.float32)


@njit(parallel=True, cache=True, nogil=True)
def gelu_rows_par(x, table, out):
    """out = gelu(x) row by row on all threads, as ggml_vec_gelu_f32 with GGML_GELU_FP16 (``gelu_f32``'s numbers:
    0 for x <= -10, x for x >= 10, else the F16 table at x's F16 value): the vision encoders' GELU over
    n_patches x n_ff values, 30 ns a value through NumPy's temporaries."""
    for r in prange(x.shape[0]):
        xr, orow = x[r], out[r]
        for i in range(xr.shape[0]):
            v = xr[i]
            if v <= np.float32(-10.0):
                orow[i] = np.float32(0.0)
            elif v >= np.float32(10.0):
                orow[i] = v
            else:
                orow[i] = table[f16_bits(v)]


@njit(cache=True, inline="always")
def _geglu_row(gr, ur, table, orow):
    n = gr.shape[0]
    n16 = n - n % 16
    for i in range(0, n16, 16):
        v16_store(orow, i, v16_geglu(v16_load(gr, i), v16_load(ur, i), table))
    for i in range(n16, n):
        x = gr[i]
        if x <= np.float32(-10.0):
            orow[i] = np.float32(0.0)
        elif x >= np.float32(10.0):
            orow[i] = x * ur[i]
        else:
            orow[i] = table[f16_bits(x)] * ur[i]


@njit(cache=True)
def geglu_rows(g, u, table, out):
    """out = gelu(g) * u, row by row: ggml_vec_geglu_f32 with GGML_GELU_FP16, i.e. 0 for g <= -10, g * u for
    g >= 10, else the F16 GELU table at g's F16 value (``table``: ``gelu_table()``) times u; sixteen values at a
    time (``simd.v16_geglu``), the rest one by one."""
    for r in range(g.shape[0]):
        _geglu_row(g[r], u[r], table, out[r])


@njit(parallel=True, cache=True)
def geglu_rows_par(g, u, table, out):
    """``geglu_rows`` with the rows on all threads (prompts: ``GLU_PAR_ROWS`` rows and more)."""
    for r in prange(g.shape[0]):
        _geglu_row(g[r], u[r], table, out[r])


# From this many rows the GLUs run on all threads: one thread took 14 ms of Gemma 3's pp512 (512 x 2048 per layer)
# and 7 ms of SmolLM2's; a decode step's single row stays serial (no parallel region to start).
GLU_PAR_ROWS = 16


# EXP, TANH, SIGMOID and SOFTPLUS: ggml-cpu's scalar loops over the C library's expf, tanhf and logf
# (ggml_vec_exp_f32, ggml_vec_tanh_f32, ggml_vec_sigmoid_f32, op_softplus). NumPy's float32 exp, tanh and log are its
# own vector code, a last bit away on some inputs (softplus: 200 of Qwen 3.5's 512 decay inputs, which moved one
# perplexity chunk by 0.018); Numba's math functions on float32 call the C library's.
@njit(cache=True)
def libm_unary(x, out, kind):
    """x, out: float32, flat. kind 0: expf(x); 1: tanhf(x); 2: 1 / (1 + expf(-x)); 3: softplus as ggml's
    op_softplus, x above 20, else logf(1 + expf(x))."""
    one = np.float32(1.0)
    for i in range(x.shape[0]):
        v = x[i]
        if kind == 0:
            out[i] = np.float32(math.exp(v))
        elif kind == 1:
            out[i] = np.float32(math.tanh(v))
        elif kind == 2:
            out[i] = one / (one + np.float32(math.exp(np.float32(-v))))
        else:
            out[i] = v if v > np.float32(20.0) else np.float32(math.log(one + np.float32(math.exp(v))))
