#!/usr/bin/env python3
"""Each decode product of a model alone (one activation row), against the DRAM read bandwidth: what bounds decode.

    python benchmarks/decode_products.py MODEL.gguf [-t 2] [--names attn_q ffn_gate ffn_down output] [--cache]

From DRAM (default): every layer's matrix of a name in turn (layer 0, 1, ... so that no matrix is in cache when its
turn comes; ``output`` alone, larger than the caches), ``-r`` passes, the best call's GB/s (bytes of the matrix /
time) with ``-t`` threads, beside ``stream_read.py``'s read bandwidth at the same thread count. ``--cache``: one
thread, the first rows of layer 0's matrix reused (in L2), the cost per 32 values in cycles from the slope between
two row counts (so the call's fixed cost drops out; ``--ghz``: the clock), and the GB/s a thread that cost allows.

A decode at two threads needs each thread to read half the bandwidth; where a kernel's in-cache rate a thread is not
well above that, its instructions and its misses overlap little and decode stays below the bandwidth (benchmarks/
README.md, issue 17: Q4_0's repacked kernel at 14.5 GB/s a thread in cache, ~13 needed, decode at 62-65%). Files:
compare_llamacpp.py --shape 1b writes the 1B shape's, under ~/.cache/llampy/shapes.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _tensors(reader, name):
    if name == "output":
        return ["output.weight"] if "output.weight" in reader.tensors else ["token_embd.weight"]
    out, i = [], 0
    while f"blk.{i}.{name}.weight" in reader.tensors:
        out.append(f"blk.{i}.{name}.weight")
        i += 1
    return out


def _best(fn, reps):
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def from_dram(reader, name, reps, rng):
    from llampy.ggml.backends.cpu import matmul
    from llampy.ggml.types import GGMLType
    names = _tensors(reader, name)
    ws = [reader.tensor_array(t) for t in names]
    wt = GGMLType(reader.tensors[names[0]].type)
    x = rng.standard_normal((1, reader.tensors[names[0]].ne[0])).astype(np.float32)
    out = np.empty((1, ws[0].shape[0]), np.float32)
    for w in ws:
        matmul.mul_mat(w, wt, x, out)
    best = float("inf")
    for _ in range(reps):
        for w in ws:
            t0 = time.perf_counter()
            matmul.mul_mat(w, wt, x, out)
            best = min(best, time.perf_counter() - t0)
    return wt.name, ws[0].shape, ws[0].nbytes, best


def in_cache(reader, name, reps, rng, ghz):
    from llampy.ggml.backends.cpu import matmul
    from llampy.ggml.types import GGMLType
    t = _tensors(reader, name)[0]
    wt = GGMLType(reader.tensors[t].type)
    w = reader.tensor_array(t)
    k = reader.tensors[t].ne[0]
    r1 = max(32, min(w.shape[0], 400_000 // w.strides[0]) // 16 * 16)      # ~400 KB: in a 512 KB+ L2
    r0 = r1 // 4 // 16 * 16 or 16
    x = rng.standard_normal((1, k)).astype(np.float32)
    parts = [(np.ascontiguousarray(w[:r]), np.empty((1, r), np.float32)) for r in (r0, r1)]
    best = [float("inf")] * 2
    for _ in range(reps):          # alternating, so that a slow moment costs both row counts alike
        for j, (wj, oj) in enumerate(parts):
            t0 = time.perf_counter()
            matmul.mul_mat(wj, wt, x, oj)
            best[j] = min(best[j], time.perf_counter() - t0)
    dt = best[1] - best[0]
    return wt.name, (r0, r1), dt * ghz * 1e9 / ((r1 - r0) * k / 32), (r1 - r0) * w.strides[0] / dt / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--names", nargs="+", default=["attn_q", "ffn_gate", "ffn_down", "output"])
    ap.add_argument("-r", "--reps", type=int, default=4, help="passes over the layers (--cache: calls, default 1500)")
    ap.add_argument("--cache", action="store_true", help="one thread, in cache: cycles per 32 values")
    ap.add_argument("--ghz", type=float, default=3.19)
    ap.add_argument("--no-stream", action="store_true", help="skip stream_read's bandwidth")
    a = ap.parse_args(argv)
    from llampy import tuning
    tuning.install()
    import numba
    from llampy.gguf.reader import GGUFReader
    threads = 1 if a.cache else a.threads
    numba.set_num_threads(threads)
    rng = np.random.default_rng(0)
    reader = GGUFReader(a.model)
    if not a.cache and not a.no_stream:
        import stream_read
        print(f"stream_read, {threads} threads: {stream_read.read_bandwidth(threads, 1024, 5):.2f} GB/s")
    for name in a.names:
        if not _tensors(reader, name):
            print(f"{name}: not in the file")
            continue
        if a.cache:
            reps = a.reps if a.reps != 4 else 1500
            t, (r0, r1), cyc, gbs = in_cache(reader, name, reps, rng, a.ghz)
            print(f"{name:10s} {t:6s} rows {r0}->{r1}: {cyc:5.2f} cycles / 32 values, {gbs:5.1f} GB/s a thread")
        else:
            t, shape, nbytes, best = from_dram(reader, name, max(1, a.reps if name != "output" else 3 * a.reps), rng)
            print(f"{name:10s} {t:6s} {shape} {nbytes / 1e6:7.1f} MB: {best * 1e6:8.1f} us, "
                  f"{nbytes / best / 1e9:6.2f} GB/s ({threads} threads)")
    reader.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
