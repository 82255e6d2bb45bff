#!/usr/bin/env python3
"""Matrix products of the block-table formats (backends/cpu/dot_blocks.py) against Q4_1's kernel, one process.

    python benchmarks/bench_blocks.py [--types F16 BF16 Q2_K Q3_K IQ4_NL IQ4_XS] [--n 1 128] [--reps 50]

For each type and batch size n: the time of one ``matmul.mul_mat`` on SmolLM2's feed-forward shapes (up: 1536 x 576
with 576-wide rows, down: 576 x 1536; 256-value formats take the down shape only, as llama-quantize gives them),
the minimum over --reps calls (robust to a shared machine's load), the weight bytes read per second, and the same
product through the path these types took before the table's kernels (``--before``: dequantized tiles and BLAS for
F16/BF16, the reference dequantizer for the rest). Q4_1, the default model's type, is the yardstick.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llampy.ggml import quants as lq                         # noqa: E402
from llampy.ggml.backends.cpu import matmul as mm           # noqa: E402
from llampy.ggml.types import GGMLType, TYPE_TRAITS          # noqa: E402

T = GGMLType


def weights(t, rows, k, rng):
    q = lq.quantize(rng.standard_normal((rows, k)).astype(np.float32), t)
    if t == T.F16:
        return q.view(np.float16).reshape(rows, k)
    if t == T.BF16:
        return q.view(np.uint16).reshape(rows, k)
    return q.reshape(rows, -1)


def best(fn, reps):
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", nargs="+", default=["Q4_1", "F16", "BF16", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS"])
    ap.add_argument("--n", nargs="+", type=int, default=[1, 128])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1, help="Numba threads (1: the kernels' own speed, which a "
                    "loaded machine's thread wake-ups do not blur)")
    ap.add_argument("--before", action="store_true", help="also time the path these types took before")
    a = ap.parse_args(argv)
    from llampy import tuning
    tuning.install()
    import numba
    numba.set_num_threads(a.threads)
    rng = np.random.default_rng(0)
    print("| type | shape | n | ms | GB/s | before ms |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in a.types:
        t = T[name]
        shapes = [(576, 1536)] if TYPE_TRAITS[t].blck_size == 256 else [(1536, 576), (576, 1536)]
        for rows, k in shapes:
            w = weights(t, rows, k, rng)
            for n in a.n:
                x = rng.standard_normal((n, k)).astype(np.float32)
                out = np.empty((n, rows), np.float32)
                dt = best(lambda: mm.mul_mat(w, t, x, out), a.reps)
                before = ""
                if a.before and t != T.Q4_1:
                    if t in (T.F16, T.BF16):
                        bt = best(lambda: mm._mul_mat_blas(w, t, x, out), max(3, a.reps // 10))
                    else:
                        bt = best(lambda: mm._mul_mat_fallback(w, t, x, out), 3)
                    before = f"{bt * 1e3:.3f}"
                print(f"| {name} | {rows}x{k} | {n} | {dt * 1e3:.3f} | {w.nbytes / dt / 1e9:.1f} | {before} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
