#!/usr/bin/env python3
"""Each decode product of a model alone (one activation row), against the DRAM read bandwidth: what bounds decode.

    python benchmarks/decode_products.py MODEL.gguf [-t 2] [--names attn_q ffn_gate ffn_down output] [--cache]
    python benchmarks/decode_products.py MODEL.gguf --pattern [--names all] [-r 6]
    python benchmarks/decode_products.py MODEL.gguf --step [-r 4]

From DRAM (default): every layer's matrix of a name in turn (layer 0, 1, ... so that no matrix is in cache when its
turn comes; ``output`` alone, larger than the caches), ``-r`` passes, the best call's GB/s (bytes of the matrix /
time) with ``-t`` threads, beside ``stream_read.py``'s read bandwidth at the same thread count. ``--cache``: one
thread, the first rows of layer 0's matrix reused (in L2), the cost per 32 values in cycles from the slope between
two row counts (so the call's fixed cost drops out; ``--ghz``: the clock), and the GB/s a thread that cost allows.

``--pattern``: beside each product (from DRAM), a pure streaming loop over the same matrices with the decode
kernel's access pattern and no arithmetic (``pattern_kernel``: chunks of ROW_CHUNK rows split over the threads as
the kernels' prange does, the format's rows-per-pass in lockstep, a byte per cache line, the rows PREFETCH_AHEAD
ahead asked for at ``prefetch_step``'s rate), passes alternating; per name the best pass over all its layers, and
the sums over the names: the product's time against the pattern's says whether a product's shortfall from the read
bandwidth is the access pattern (memory side: the pattern reads no faster) or the kernel (instruction side).
``--names all``: every matrix a decode step reads, so the sums are one token's products (the fused gate/up GLU run
as two products). A name whose layers together fit the last-level cache (the 1B shape's attn_k and attn_v, 9-18
MB) is read partly from it by both, so its figures exceed the DRAM rate; the sums are the decode's proportions.

``--step``: the whole decode step instead, split by op: ``-r`` x 16 single-token decodes from an empty cache (as
llama-bench's tg), every node's call timed (serve_profile's timed plans), per op its calls a token, best and median
call, and the time a token in the products, in the other ops, around the nodes and outside the graph.

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


# weight rows a decode kernel computes in lockstep (one activation row), per format, for rows % 8 == 0: Q4_0's and
# Q4_K's repacked gemv (dot_blocks._mv_r8, dot_kquant.mv_q4_k_x8), Q8_0 dot_q32._mv_rest, Q5_K and Q6_K dot_kquant's
# gemv (four rows a pass)
PASS_ROWS = {"Q4_0": 8, "Q8_0": 4, "Q4_K": 8, "Q5_K": 4, "Q6_K": 4}
ALL_NAMES = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "output"]


def pattern_kernel():
    from numba import njit, prange

    from llampy.ggml.backends.cpu.dot_q32 import ROW_CHUNK, prefetch_base, prefetch_byte

    @njit(parallel=True, nogil=True, cache=True)
    def _walk(w, g):
        """Touch every cache line of w (uint8 [rows, row bytes]) in the decode kernels' order: chunks of ROW_CHUNK
        rows split over the threads, g rows in lockstep (one byte load per row and 64 bytes), the g rows
        PREFETCH_AHEAD ahead asked for at the same rate (g lines a step, ``prefetch_step``'s sweep)."""
        rows, nbytes = w.shape
        nc = (rows + ROW_CHUNK - 1) // ROW_CHUNK
        out = np.zeros(nc, np.int64)
        for c in prange(nc):
            s = np.int64(0)
            for r in range(c * ROW_CHUNK, min(rows, (c + 1) * ROW_CHUNK), g):
                pb = prefetch_base(w, r)
                for t in range(0, nbytes, 64):
                    for j in range(g):
                        prefetch_byte(w, min(pb[1], pb[0] + g * t + 64 * j))
                        s += w[r + j, t]
            out[c] = s
        return out
    return _walk


def with_pattern(reader, name, reps, rng):
    """Per pass, every layer's matrix of ``name`` by the product, then by ``pattern_kernel``: the best pass's time of
    each (all its layers) and the bytes."""
    from llampy.ggml.backends.cpu import matmul
    from llampy.ggml.types import GGMLType
    names = _tensors(reader, name)
    ws = [reader.tensor_array(t) for t in names]
    wt = GGMLType(reader.tensors[names[0]].type)
    g = PASS_ROWS.get(wt.name, 4)
    x = rng.standard_normal((1, reader.tensors[names[0]].ne[0])).astype(np.float32)
    out = np.empty((1, ws[0].shape[0]), np.float32)
    walk = pattern_kernel()
    for w in ws:
        matmul.mul_mat(w, wt, x, out)
        walk(w, g)
    best = [float("inf")] * 2
    for _ in range(reps):
        for j in (0, 1):
            t0 = time.perf_counter()
            for w in ws:
                if j == 0:
                    matmul.mul_mat(w, wt, x, out)
                else:
                    walk(w, g)
            best[j] = min(best[j], time.perf_counter() - t0)
    return wt.name, g, sum(w.nbytes for w in ws), best


def step_split(path, reps, threads):
    """``--step``: one decode step by op (see the module text); prints the lines."""
    import collections

    from llampy.ggml.backends.cpu import backend as cpu_backend
    from llampy.ggml.types import GGMLType
    from llampy.llama.batch import Batch
    from llampy.llama.context import Context
    from llampy.llama.model import Model
    calls: dict = collections.defaultdict(list)
    timing = [False]
    bind = cpu_backend.CPUBackend._bind

    def timed_bind(self, node):
        call = bind(self, node)
        src = node.src[0] if node.src else None
        key = (node.op.name, GGMLType(src.type).name if src is not None else "",
               "x".join(str(int(v)) for v in src.ne[:2]) if src is not None else "")

        def run():
            if not timing[0]:
                return call()
            t0 = time.perf_counter()
            call()
            calls[key].append(time.perf_counter() - t0)
        return run
    cpu_backend.CPUBackend._bind = timed_bind
    n_tok = 16 * reps
    m = Model(path, n_threads=threads)
    ctx = Context(m, n_ctx=n_tok + 1, n_batch=2048, n_ubatch=512)
    graph = [0.0]
    compute = ctx.sched.graph_compute

    def timed_compute(*a, **k):
        t0 = time.perf_counter()
        try:
            return compute(*a, **k)
        finally:
            graph[0] += time.perf_counter() - t0
    ctx.sched.graph_compute = timed_compute
    rng = np.random.default_rng(0)
    for timed in (False, True):          # an untimed round first: kernels loaded, graphs built
        ctx.kv_clear()
        calls.clear()
        graph[0] = 0.0
        timing[0] = timed
        t0 = time.perf_counter()
        for i, t in enumerate(rng.integers(0, m.hparams.n_vocab, n_tok)):
            ctx.decode(Batch.from_tokens([int(t)], pos0=i))
        wall = time.perf_counter() - t0
    ms = 1e3 / n_tok
    tot = {k: sum(v) for k, v in calls.items()}
    ops = sum(tot.values())
    mm = sum(v for k, v in tot.items() if k[0].startswith("MUL_MAT"))
    print(f"{Path(path).name}, {threads} threads: {wall * ms:.2f} ms a token (every node timed): products "
          f"{mm * ms:.2f}, other ops {(ops - mm) * ms:.2f}, around the nodes {(graph[0] - ops) * ms:.2f}, outside "
          f"graph_compute {(wall - graph[0]) * ms:.2f}; {sum(len(v) for v in calls.values()) // n_tok} nodes a token")
    best = 0.0
    for k in sorted(tot, key=lambda k: -tot[k]):
        ts = sorted(calls[k])
        best += ts[0] * len(ts) / n_tok
        print(f"  {k[0]:15s} {k[1]:5s} {k[2]:12s} {len(ts) // n_tok:3d} a token: best {ts[0] * 1e6:7.0f} us, median "
              f"{ts[len(ts) // 2] * 1e6:7.0f} us, {tot[k] * ms:7.2f} ms a token")
    print(f"  every node at its best call: {best * 1e3:.2f} ms a token")


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
    ap.add_argument("--pattern", action="store_true",
                    help="beside each product, a streaming loop with its access pattern (passes alternating)")
    ap.add_argument("--step", action="store_true", help="the whole decode step, split by op")
    a = ap.parse_args(argv)
    if a.names == ["all"]:
        a.names = ALL_NAMES
    from llampy import tuning
    tuning.install()
    import numba
    from llampy.gguf.reader import GGUFReader
    threads = 1 if a.cache else a.threads
    numba.set_num_threads(threads)
    if a.step:
        step_split(a.model, a.reps, threads)
        return 0
    rng = np.random.default_rng(0)
    reader = GGUFReader(a.model)
    if not a.cache and not a.no_stream:
        import stream_read
        print(f"stream_read, {threads} threads: {stream_read.read_bandwidth(threads, 1024, 5):.2f} GB/s")
    tot = [0, 0.0, 0.0]
    for name in a.names:
        if not _tensors(reader, name):
            print(f"{name}: not in the file")
            continue
        if a.pattern:
            t, g, nbytes, (tp, tw) = with_pattern(reader, name, a.reps, rng)
            tot = [tot[0] + nbytes, tot[1] + tp, tot[2] + tw]
            print(f"{name:11s} {t:5s} {g} rows a pass, {nbytes / 1e6:7.1f} MB: product {nbytes / tp / 1e9:6.2f} GB/s, "
                  f"pattern {nbytes / tw / 1e9:6.2f} GB/s, product / pattern {tw / tp:.0%} ({threads} threads)")
        elif a.cache:
            reps = a.reps if a.reps != 4 else 1500
            t, (r0, r1), cyc, gbs = in_cache(reader, name, reps, rng, a.ghz)
            print(f"{name:10s} {t:6s} rows {r0}->{r1}: {cyc:5.2f} cycles / 32 values, {gbs:5.1f} GB/s a thread")
        else:
            t, shape, nbytes, best = from_dram(reader, name, max(1, a.reps if name != "output" else 3 * a.reps), rng)
            print(f"{name:10s} {t:6s} {shape} {nbytes / 1e6:7.1f} MB: {best * 1e6:8.1f} us, "
                  f"{nbytes / best / 1e9:6.2f} GB/s ({threads} threads)")
    if a.pattern and len(a.names) > 1:
        print(f"sum of the above, {tot[0] / 1e6:.1f} MB: products {tot[1] * 1e3:.2f} ms ({tot[0] / tot[1] / 1e9:.2f} "
              f"GB/s), pattern {tot[2] * 1e3:.2f} ms ({tot[0] / tot[2] / 1e9:.2f} GB/s)")
    if not a.cache and not a.no_stream:
        print(f"stream_read, {threads} threads, after: {stream_read.read_bandwidth(threads, 1024, 5):.2f} GB/s")
    reader.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
