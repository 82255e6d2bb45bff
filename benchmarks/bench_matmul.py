"""Matrix-product kernels of the cpu backend on the real models' matrices.

    python benchmarks/bench_matmul.py [--quick] [--threads 1,2]

Reports, per matrix and thread count:
- matvec (n=1, the decode case): microseconds per call and GB/s of weights read (bytes of the GGUF blocks / time),
  through ``mul_mat`` as the engine calls it (activation quantization included);
- n=512 (a prompt batch): tok/s through the BLAS path and through the bit-exact integer path;
- the whole SmolLM2 layer stack (30 × q, k, v, o, gate, up, down) at n=512 as tok/s-equivalent (output head apart);
- the n at which BLAS overtakes the integer kernels (``BLAS_MIN_ROWS``);
- Numba compile time: the first call with an empty cache directory, and with the on-disk cache warm.
Machine noise (a shared 2-core box): each figure is the best of several repeats.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import numpy as np


def best_time(fn, min_time=0.3, repeats=5):
    fn()
    n = 1
    while True:
        t = time.perf_counter()
        for _ in range(n):
            fn()
        dt = time.perf_counter() - t
        if dt > min_time / repeats or n > 1 << 16:
            break
        n *= 4
    best = dt / n
    for _ in range(repeats - 1):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n)
    return best


def set_threads(n):
    """n threads for the kernels and for the BLAS path's workers (OpenBLAS itself runs single-threaded there)."""
    import numba
    numba.set_num_threads(n)


def load(path, names):
    from llampy.gguf.reader import GGUFReader
    r = GGUFReader(path)
    return {n: (r.tensor_array(n), r.tensors[n].type, r.tensors[n].ne[0]) for n in names}, r


def cold_compile_times():
    """First call of each kernel family with an empty NUMBA_CACHE_DIR (compile), then with that cache warm."""
    code = ("import time, numpy as np; t0 = time.perf_counter();"
            "from llampy.ggml.backends.cpu.matmul import mul_mat; from llampy.ggml.types import GGMLType as T;"
            "from llampy.ggml.quants import quantize; t1 = time.perf_counter();"
            "x = np.random.default_rng(0).standard_normal((2, 512)).astype(np.float32); o = np.empty((2, 16), np.float32);"
            "[mul_mat(quantize(np.ones((16, 512), np.float32), t), t, x, o, e) for t in"
            " (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K) for e in (1 << 30, 0)];"
            "print(f'{t1 - t0:.2f} {time.perf_counter() - t1:.2f}')")
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, NUMBA_CACHE_DIR=d)
        out = []
        for _ in range(2):
            r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
            out.append(r.stdout.split())
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--quick", action="store_true", help="fewer matrices, no compile-time measurement")
    args = ap.parse_args()

    import numba
    from llampy.ggml.backends.cpu import matmul
    from llampy.models import gemma3_path, smollm2_path
    from llampy.ggml.types import GGMLType

    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (a shared machine: compare within a run)")
    print(f"numba {numba.__version__}, threading layer: ", end="")
    numba.set_num_threads(1)
    matmul.mul_mat(np.zeros((1, 40), np.uint8), GGMLType.Q8_0, np.ones((1, 32), np.float32),
                   np.empty((1, 1), np.float32))
    print(numba.threading_layer(), f"; NUMBA_NUM_THREADS={numba.config.NUMBA_NUM_THREADS}")

    smol = {"q 576x576 Q4_1": "blk.0.attn_q.weight", "gate 1536x576 Q4_1": "blk.0.ffn_gate.weight",
            "down 576x1536 Q4_1": "blk.0.ffn_down.weight", "output 49152x576 Q8_0": "token_embd.weight"}
    gemma = {"attn_output 640x1024 Q4_K": "blk.0.attn_output.weight",
             "ffn_down 640x2048 Q6_K": "blk.0.ffn_down.weight", "ffn_up 2048x640 Q5_0": "blk.0.ffn_up.weight"}
    if args.quick:
        smol.pop("down 576x1536 Q4_1")
        gemma.pop("ffn_up 2048x640 Q5_0")
    mats = {}
    s, rs = load(smollm2_path(), list(smol.values()) + ["blk.0.ffn_down.weight"] + [f"blk.0.{t}.weight" for t in
                                                          ("attn_k", "attn_v", "attn_output", "ffn_up")])
    g, _ = load(gemma3_path(), list(gemma.values()))
    mats.update({label: s[n] for label, n in smol.items()})
    mats.update({label: g[n] for label, n in gemma.items()})
    rng = np.random.default_rng(0)
    threads = [int(t) for t in args.threads.split(",")]

    print("\n## matvec (n=1) through mul_mat: us/call, GB/s of weights")
    for label, (w, t, k) in mats.items():
        x = rng.standard_normal((1, k)).astype(np.float32)
        out = np.empty((1, w.shape[0]), np.float32)
        cells = []
        for th in threads:
            set_threads(th)
            dt = best_time(lambda: matmul.mul_mat(w, t, x, out))
            cells.append(f"{th}T {dt * 1e6:8.1f} us {w.nbytes / dt / 1e9:5.2f} GB/s")
        print(f"{label:28s} " + " | ".join(cells))

    print("\n## n=512 (prompt batch): tok/s, BLAS path vs bit-exact integer path")
    x512 = {}
    for label, (w, t, k) in mats.items():
        if "output" in label and args.quick:
            continue
        x = x512.setdefault(k, rng.standard_normal((512, k)).astype(np.float32))
        out = np.empty((512, w.shape[0]), np.float32)
        cells = []
        for th in threads:
            set_threads(th)
            dtb = best_time(lambda: matmul.mul_mat(w, t, x, out, 0), repeats=3)
            cell = f"{th}T blas {512 / dtb:7.0f}"
            if w.shape[0] < 10000:      # the exact path on the 49152-row head takes seconds
                dte = best_time(lambda: matmul.mul_mat(w, t, x, out, 1 << 30), min_time=0.1, repeats=1)
                cell += f" exact {512 / dte:6.0f}"
            cells.append(cell)
        print(f"{label:28s} " + " | ".join(cells))

    print("\n## SmolLM2 layer stack (30 layers x q,k,v,o,gate,up,down; output head apart), n=512")
    layer = [s[f"blk.0.{t}.weight"] for t in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                                                "ffn_up", "ffn_down")]
    for _, _, k in layer:
        x512.setdefault(k, rng.standard_normal((512, k)).astype(np.float32))
    outs = [np.empty((512, w.shape[0]), np.float32) for w, _, _ in layer]

    def one_layer(limit):
        for (w, t, k), o in zip(layer, outs):
            matmul.mul_mat(w, t, x512[k], o, limit)
    for th in threads:
        set_threads(th)
        dtb = best_time(lambda: one_layer(0), repeats=3) * 30
        print(f"{th}T BLAS: {512 / dtb:7.0f} tok/s  (llama.cpp pp512, whole model: 305 tok/s; target 2.5x = 763)")
        # output head 49152x576 Q8_0 at n=512, as the last layer's logits would need (only for requested outputs)
    print("\n## crossover: integer kernels vs BLAS by n (SmolLM2 gate 1536x576 Q4_1, 2 threads)")
    set_threads(max(threads))
    w, t, k = s["blk.0.ffn_gate.weight"]
    for n in (1, 2, 4, 8, 16, 32):
        x = rng.standard_normal((n, k)).astype(np.float32)
        out = np.empty((n, w.shape[0]), np.float32)
        dte = best_time(lambda: matmul.mul_mat(w, t, x, out, 1 << 30), min_time=0.1)
        dtb = best_time(lambda: matmul.mul_mat(w, t, x, out, 0), min_time=0.1)
        print(f"n={n:3d} exact {dte * 1e6:8.1f} us  blas {dtb * 1e6:8.1f} us")

    if not args.quick:
        print("\n## Numba compile: import s / first calls of all kernels (8 types x 2 paths) s")
        (ic, fc), (iw, fw) = cold_compile_times()
        print(f"cold cache: import {ic} s, first calls {fc} s;  warm cache: import {iw} s, first calls {fw} s")


if __name__ == "__main__":
    main()
