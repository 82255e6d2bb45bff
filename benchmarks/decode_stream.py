#!/usr/bin/env python3
"""Decode-shaped matrix products streaming their weights from DRAM, one process, no model file.

    python benchmarks/decode_stream.py [--types F16 Q4_1 Q3_K ...] [--shape smollm2|1b] [-t 2] [--reps 5]

Per type: one "token" of products, as a decode step runs them (q, k, v, o, gate, up, down per layer, distinct
weights per layer, and the output head), on random weights (speed does not depend on their values), so the
weights are read from DRAM as in a real decode; the best of --reps tokens, its time and the weight bytes read per
second. Beside benchmarks/stream_read.py's figure (the machine's read bandwidth) it says how close each type's
decode kernel comes to the bound a model larger than the cache sets, without llama.cpp and without a model file.
256-value formats take 256-divisible widths only, as llama-quantize gives them (576-wide rows fall back to Q4_0).
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
SHAPES = {   # n_embd, n_ff, n_kv (k/v rows), n_layer, n_vocab
    "smollm2": (576, 1536, 192, 30, 49152),
    "1b": (2048, 8192, 512, 16, 128256),
}


def weights(t, rows, k, rng):
    src = rng.standard_normal((min(rows, 256), k)).astype(np.float32)
    q = lq.quantize(src, t)
    if t == T.F16:
        q = q.view(np.float16).reshape(src.shape[0], k)
    elif t == T.BF16:
        q = q.view(np.uint16).reshape(src.shape[0], k)
    else:
        q = q.reshape(src.shape[0], -1)
    reps = -(-rows // q.shape[0])
    return np.ascontiguousarray(np.tile(q, (reps, 1))[:rows])     # distinct memory, values repeated


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", nargs="+", default=["Q4_1", "Q4_0", "Q8_0", "F16", "BF16", "Q3_K", "Q2_K",
                                                    "IQ4_NL", "IQ4_XS"])
    ap.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-head", action="store_true", help="leave out the output head")
    a = ap.parse_args(argv)
    from llampy import tuning
    tuning.install()
    import numba
    numba.set_num_threads(a.threads)
    e, f, kv, nl, nv = SHAPES[a.shape]
    rng = np.random.default_rng(0)
    print(f"| type | shape | ms/token | GB/s | tok/s |")
    print("| --- | --- | --- | --- | --- |")
    for name in a.types:
        t = T[name]
        bk = TYPE_TRAITS[t].blck_size
        fb = T.Q4_0 if bk == 256 and e % 256 else t        # llama-quantize's fallback for 576-wide rows
        mats = []
        for _ in range(nl):
            for rows, k in ((e, e), (kv, e), (kv, e), (e, e), (f, e), (f, e), (e, f)):
                wt = t if k % bk == 0 and (k != e or fb == t) else fb
                mats.append((weights(wt, rows, k, rng), wt, rows, k))
        if not a.no_head:
            mats.append((weights(fb, nv, e, rng), fb, nv, e))
        xs = {k: rng.standard_normal((1, k)).astype(np.float32) for k in (e, f)}
        outs = [np.empty((1, rows), np.float32) for _, _, rows, _ in mats]
        nbytes = sum(w.nbytes for w, *_ in mats)

        def token():
            for (w, wt, rows, k), o in zip(mats, outs):
                mm.mul_mat(w, wt, xs[k], o)
        token()
        best = min(_timed(token) for _ in range(a.reps))
        print(f"| {name} | {a.shape} | {best * 1e3:.2f} | {nbytes / best / 1e9:.1f} | {1 / best:.1f} |", flush=True)
        del mats
    return 0


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    sys.exit(main())
