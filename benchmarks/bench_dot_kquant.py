"""The k-quant matrix-product kernels at Gemma 3 270M's shapes (hidden 640, ffn 2048): the scalar references
(cpu/dot_kquant_scalar.py, with --scalar) and the SIMD ones (cpu/dot_kquant.py), in GB/s of weight blocks read per call (best
of several timing rounds; 2 threads unless -t). At n > 1 each call reads the weights once for n activation rows.

    python benchmarks/bench_dot_kquant.py [-t 2] [--scalar]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from llampy.ggml.backends.cpu import dot_kquant_scalar, dot_kquant
from llampy.ggml.backends.cpu.act_quant import act_split
from llampy.ggml.backends.cpu.dot_q32 import F16_TABLE
from llampy.ggml.quants_k import quantize_q4_k, quantize_q5_k, quantize_q6_k
from llampy.ggml.types import GGMLType as T

QUANT = {"q4_k": quantize_q4_k, "q5_k": quantize_q5_k, "q6_k": quantize_q6_k}
# (format, rows, k): Gemma 3 270M's Q4_K attn_output (640 x 1024) and ffn_down (640 x 2048), Q6_K ffn_down; an
# ffn-sized Q4_K/Q5_K matrix (2048 x 768) and one with rows % 8 != 0 for the plain forms
SHAPES = [("q4_k", 640, 1024), ("q4_k", 640, 2048), ("q6_k", 640, 2048), ("q4_k", 2048, 768),
          ("q4_k", 644, 2048), ("q5_k", 640, 2048)]


def _kernels(fmt, rows, scalar):
    """name -> call(w, s, out, n) for the kernels that apply to this format and row count."""
    x8 = fmt == "q4_k" and rows % 8 == 0

    def gemm(n):
        return n - n % 4 if n >= 4 else 0
    ks = {}
    if x8:
        if scalar:
            ks["dot_kquant_scalar"] = lambda w, s, o, n: dot_kquant_scalar.mv_q4_k_x8(w, s.xq, s.xd, s.xs, o, F16_TABLE, gemm(n))
        ks["dot_kquant"] = lambda w, s, o, n: dot_kquant.mv_q4_k_x8(w, s.xq, s.xd, s.xs, o, F16_TABLE, gemm(n))
        return ks
    name = "mv_" + fmt
    if scalar:
        ks["dot_kquant_scalar"] = lambda w, s, o, n: getattr(dot_kquant_scalar, name)(w, s.xq, s.xd, s.xs, o, F16_TABLE)
    ks["dot_kquant"] = lambda w, s, o, n: getattr(dot_kquant, name)(w, s.xq, s.xd, s.xs, o, F16_TABLE)
    return ks


def _time(fn, reps):
    fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--scalar", action="store_true", help="also time the scalar references (slow)")
    ap.add_argument("-n", type=int, nargs="*", default=[1, 8])
    a = ap.parse_args()
    import numba
    numba.set_num_threads(a.threads)
    rng = np.random.default_rng(0)
    for fmt, rows, k in SHAPES:
        w = np.asarray(QUANT[fmt](rng.standard_normal((rows, k)).astype(np.float32))).reshape(rows, -1)
        for n in a.n:
            s = act_split(rng.standard_normal((n, k)).astype(np.float32), T.Q8_K)
            out = np.empty((n, rows), np.float32)
            cells = []
            for name, fn in _kernels(fmt, rows, a.scalar).items():
                reps = 3 if name == "dot_kquant_scalar" else 200
                dt = _time(lambda: fn(w, s, out, n), reps)
                cells.append(f"{name} {dt * 1e6:8.1f} us {w.nbytes / dt / 1e9:6.2f} GB/s")
            print(f"{fmt} {rows:5d} x {k:5d} n={n}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
