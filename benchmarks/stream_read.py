#!/usr/bin/env python3
"""DRAM read bandwidth, STREAM-like, and what a decode step of a model must read against it.

    python benchmarks/stream_read.py [-t 2] [--mib 1024] [--model PATH [--tg TOK_PER_S]] [--json]

The read kernel sums an int64 array far larger than the caches (``--mib``, default 1 GiB) with ``-t`` threads
(Numba, each thread a contiguous range, eight independent sums per thread so that the loads, not the adds, bound
it), each thread asking for the line ``PREFETCH_AHEAD`` bytes ahead of the one it reads, as the decode kernels do
(``dot_q32.prefetch_step``): without it the loop read 8-12% less than decode's own products (AVX2 Zen 3, 2 threads,
16 MiB pieces, tenth percentile: 22.2-24.0 GB/s plain, 27.8-27.9 with 4-16 KiB ahead; 1 thread 12.9 and 14.4), and
decode read at 102-109% of that figure. The best of ``-r`` passes is the bandwidth in GB/s (10^9 bytes), as STREAM
reports its best. ``--model``: the
bytes one decode step reads (every matrix once, one row of the token embedding; what ``gpu_bench.decode_bytes``
counts), the time per token that bandwidth allows, and, with ``--tg`` (a measured decode speed, tok/s, e.g. from
compare_llamacpp.py --shape 1b), the fraction of the bandwidth that decode reached. ``--json``: the bandwidth
alone, as {"threads", "mib", "read_gbps"} (compare_llamacpp.py measures it so in its run).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


PREFETCH_AHEAD = 4096     # bytes


def read_kernel():
    from numba import njit, prange

    from llampy.ggml.backends.cpu.dot_q32 import prefetch_byte

    @njit(parallel=True, nogil=True, cache=True)
    def _sum(a, parts):
        n = a.shape[0]
        out = np.zeros(parts, np.int64)
        last = 8 * n - 1
        for p in prange(parts):
            lo = n * p // parts
            hi = n * (p + 1) // parts
            s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = np.int64(0)
            j = lo
            while j + 8 <= hi:
                prefetch_byte(a, min(last, 8 * j + PREFETCH_AHEAD))     # one 64-byte line per step
                s0 += a[j]
                s1 += a[j + 1]
                s2 += a[j + 2]
                s3 += a[j + 3]
                s4 += a[j + 4]
                s5 += a[j + 5]
                s6 += a[j + 6]
                s7 += a[j + 7]
                j += 8
            while j < hi:
                s0 += a[j]
                j += 1
            out[p] = s0 + s1 + s2 + s3 + s4 + s5 + s6 + s7
        return out
    return _sum


def read_bandwidth(threads: int, mib: int, reps: int) -> float:
    import numba
    numba.set_num_threads(threads)
    a = np.ones(mib * (1 << 20) // 8, np.int64)        # written once: every page present
    kernel = read_kernel()
    kernel(a[:1024], threads)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        s = kernel(a, threads)
        best = min(best, time.perf_counter() - t0)
        assert s.sum() == a.shape[0]
    return a.nbytes / best / 1e9


def decode_bytes(path: str) -> int:
    """Bytes of weights one decode step reads: every 2-D tensor whole, but one row of the token embedding (and the
    embedding whole where it is also the output head: no output.weight)."""
    from llampy.ggml.types import row_size
    from llampy.gguf.reader import GGUFReader
    r = GGUFReader(path)
    tied = "output.weight" not in r.tensors
    n = 0
    for info in r.tensors.values():
        nbytes = row_size(info.type, info.ne[0]) * int(np.prod(info.ne[1:]))
        if info.name == "token_embd.weight" and not tied:
            n += row_size(info.type, info.ne[0])
        else:
            n += nbytes
    r.close()
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("-r", "--reps", type=int, default=5)
    ap.add_argument("--model")
    ap.add_argument("--tg", type=float, help="measured decode tok/s of --model")
    ap.add_argument("--json", action="store_true", help="print the bandwidth only, as JSON")
    a = ap.parse_args(argv)
    if a.tg is not None and not a.model:
        ap.error("--tg needs --model")
    bw = read_bandwidth(a.threads, a.mib, a.reps)
    if a.json:
        print(json.dumps({"threads": a.threads, "mib": a.mib, "read_gbps": bw}))
        return 0
    print(f"read bandwidth, {a.threads} threads, {a.mib} MiB: {bw:.2f} GB/s")
    if a.model:
        nb = decode_bytes(a.model)
        print(f"{Path(a.model).name}: {nb / 1e6:.1f} MB per decode step; at {bw:.2f} GB/s: "
              f"{nb / bw / 1e6:.2f} ms per token ({bw * 1e9 / nb:.1f} tok/s)")
        if a.tg:
            print(f"measured {a.tg:.1f} tok/s: {nb * a.tg / 1e9:.2f} GB/s, {nb * a.tg / 1e9 / bw:.0%} of the read "
                  f"bandwidth")
    return 0


if __name__ == "__main__":
    sys.exit(main())
