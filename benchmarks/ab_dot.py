"""The 32-value formats' matrix products (cpu/dot_q32.py) against the same file at another git revision, in one
process: calls of the two alternate, so the machine's swings (up to 2x within minutes here) hit both alike, and the
median of the per-pair time ratios is what to read. Separate processes timed a few minutes apart could not resolve
5-10% changes on this machine; this can (repeat runs agreed within ~1% when it was written, 59b301f).

    python benchmarks/ab_dot.py [REV] [-t 1 2] [-n 512] [--pairs 30]

REV (default HEAD) is any git revision; its dot_q32.py and simd.py are imported as sibling modules of the working
tree's (the old dot_q32 on the old simd), both with the working tree's act_quant.py. Prints, per format and thread
count, both medians, the median ratio new / old and whether the outputs are bit-identical.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numba
import numpy as np

from llampy.ggml.backends.cpu import dot_q32 as new
from llampy.ggml.backends.cpu.act_quant import act_split
from llampy.ggml.quants import quantize
from llampy.ggml.types import TYPE_TRAITS, GGMLType as T

ROOT = Path(__file__).resolve().parent.parent
# (format, rows, k): SmolLM2's Q4_1 ffn_gate, Gemma 3's Q5_0 ffn_gate, a Q8_0 matrix with long rows
SHAPES = [("q4_1", T.Q4_1, 1536, 576), ("q5_0", T.Q5_0, 2048, 640), ("q8_0", T.Q8_0, 576, 1536)]


def _old_module(rev: str):
    """dot_q32.py at rev, imported as a sibling module; with it simd.py at rev (its dot_q32 imports that copy), so that a
    change to the SIMD layer is measured too."""
    def show(name, old_name=None):
        # a revision from before the rename of qdot.py to dot_q32.py has it under its old name
        for n in (name, old_name) if old_name else (name,):
            r = subprocess.run(["git", "show", f"{rev}:llampy/ggml/backends/cpu/{n}.py"], cwd=ROOT,
                               capture_output=True, text=True)
            if r.returncode == 0:
                return r.stdout
        raise SystemExit(f"{rev} has no llampy/ggml/backends/cpu/{name}.py")
    here = ROOT / "llampy/ggml/backends/cpu"
    src = show("dot_q32", "qdot").replace("from .simd import", "from ._simd_ab_old import")
    paths = [(here / "_simd_ab_old.py", show("simd")), (here / "_qdot_ab_old.py", src)]
    for path, text in paths:
        path.write_text(text)
    try:
        return importlib.import_module("llampy.ggml.backends.cpu._qdot_ab_old")
    finally:
        for path, _ in paths:
            path.unlink()


def _digest(a: np.ndarray) -> str:
    return hashlib.sha256(a.tobytes()).hexdigest()[:12]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rev", nargs="?", default="HEAD")
    ap.add_argument("-t", "--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("-n", "--rows", type=int, default=512, help="activation rows per call")
    ap.add_argument("--pairs", type=int, default=30, help="alternating (old, new) call pairs per measurement")
    args = ap.parse_args(argv)
    old = _old_module(args.rev)
    rng = np.random.default_rng(0)
    print(f"dot_q32.py at {args.rev} (old) vs the working tree (new), n = {args.rows}")
    for name, wt, rows, k in SHAPES:
        w = np.frombuffer(quantize(rng.standard_normal((rows, k)).astype(np.float32), wt), np.uint8).reshape(rows, -1)
        s = act_split(rng.standard_normal((args.rows, k)).astype(np.float32), TYPE_TRAITS[wt].vec_dot_type)
        fo, fn = getattr(old, "mv_" + name), getattr(new, "mv_" + name)
        outs = []
        for f in (fo, fn):             # the first calls compile (or load) the kernels
            out = np.empty((args.rows, rows), np.float32)
            f(w, s.xq, s.xd, s.xs, out, new.F16_TABLE)
            outs.append(_digest(out))
        out = np.empty((args.rows, rows), np.float32)
        for t in args.threads:
            numba.set_num_threads(t)
            to, tn = [], []
            for i in range(args.pairs):
                order = ((fo, to), (fn, tn)) if i % 2 == 0 else ((fn, tn), (fo, to))
                for f, acc in order:
                    t0 = time.perf_counter()
                    f(w, s.xq, s.xd, s.xs, out, new.F16_TABLE)
                    acc.append(time.perf_counter() - t0)
            ratio = statistics.median(b / a for a, b in zip(to, tn))
            print(f"{name} {rows}x{k} threads {t}: old {statistics.median(to) * 1e3:.2f} ms, "
                  f"new {statistics.median(tn) * 1e3:.2f} ms, new/old {ratio:.3f}, "
                  f"{'bit-identical' if outs[0] == outs[1] else 'outputs DIFFER'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
