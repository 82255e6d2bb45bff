"""llampy quantize against llama-quantize: wall time per file type with the same thread count, on a random-weight
F16 llama of 2048-wide layers (written once with llampy's writer), and whether the two outputs are byte-identical.

    python benchmarks/quantize_bench.py [--threads 2] [--types Q4_0,Q8_0,Q4_K_M,Q6_K] [--layers 4] [--vocab 32000]
                                        [--imatrix]

``--types all``: every file type llama-quantize offers (COPY included), those that need an importance matrix
(IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ2_M, IQ3_XXS, IQ3_XS, Q2_K_S: some tensor of theirs gets a type that
llama-quantize quantizes only with one) left out unless ``--imatrix``; ``--types imatrix``: those nine.

``--imatrix``: both tools get the same random importance matrix (the IQ1/IQ2/IQ3 types need one); llampy's
warm-up then runs each type once on a small model first, so that no timed run compiles.

llama-quantize is found as the tests find it (LLAMPY_LLAMA_QUANTIZE, or bin/llama-quantize of LLAMPY_LLAMACPP:
``bash scripts/llamacpp.sh`` builds it). Each tool runs once per type after one untimed warm-up run of llampy (Numba's
compile cache), the input file already in the page cache.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--types", default="Q4_0,Q8_0,Q4_K_M,Q5_K_M,Q6_K,IQ4_XS")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000, help="vocabulary size (token_embd and output rows)")
    ap.add_argument("--imatrix", action="store_true", help="a random importance matrix for both tools")
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "llampy-quant-bench"))
    a = ap.parse_args()
    from tests import llamacpp
    from tests.llama.test_quantize import write_random_imatrix, write_random_llama
    import numpy as np
    from llampy.llama.quant import FTYPES
    needs_im = ["IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ1_S", "IQ1_M", "IQ3_XXS", "IQ3_XS", "Q2_K_S"]
    if a.types == "all":
        a.types = ",".join(n for n, _, _, d in FTYPES if not d.startswith("alias") and (a.imatrix or n not in needs_im))
    elif a.types == "imatrix":
        a.types = ",".join(needs_im)
    tool = llamacpp.llama_quantize()
    if tool is None:
        print("llama-quantize not found: bash scripts/llamacpp.sh, then LLAMPY_LLAMACPP=<its output>")
        return 1
    d = Path(a.dir)
    d.mkdir(parents=True, exist_ok=True)
    src = d / (f"rand-2048-L{a.layers}-f16.gguf" if a.vocab == 32000 else f"rand-2048-L{a.layers}-V{a.vocab}-f16.gguf")
    if not src.exists():
        write_random_llama(src, n_embd=2048, n_ff=5632, n_layer=a.layers, n_head=16, n_head_kv=4, n_vocab=a.vocab,
                           dtype=np.float16)
    n_params = (2 * a.vocab * 2048 + a.layers * (2 * 2048 * 2048 + 2 * 512 * 2048 + 3 * 2048 * 5632)) / 1e6
    py = [sys.executable, "-m", "llampy", "quantize", "--progress", "off"]
    subprocess.run(py + [str(src), str(d / "warm.gguf"), "Q4_K_M", str(a.threads)], capture_output=True, check=True)
    opts = []
    if a.imatrix:
        im, small, small_im = d / f"{src.stem}-imatrix.gguf", d / "small.gguf", d / "small-imatrix.gguf"
        if not im.exists():
            write_random_imatrix(src, im)
        if not small.exists():
            write_random_llama(small, n_layer=1)
            write_random_imatrix(small, small_im)
        for t in a.types.split(","):
            subprocess.run(py + ["--imatrix", str(small_im), str(small), str(d / "warm.gguf"), t, str(a.threads)],
                           capture_output=True, check=True)
        opts = ["--imatrix", str(im)]
    print(f"random llama, F16 in, {n_params:.0f} M parameters, {a.threads} threads"
          f"{', random imatrix' if a.imatrix else ''}\n")
    print("| type | llama-quantize (s) | llampy (s) | ratio | identical |")
    print("| --- | --- | --- | --- | --- |")
    for t in a.types.split(","):
        ref, ours = d / f"ref-{t}.gguf", d / f"ours-{t}.gguf"
        t0 = time.perf_counter()
        r1 = subprocess.run([tool, *opts, str(src), str(ref), t, str(a.threads)], capture_output=True, text=True)
        t_ref = time.perf_counter() - t0
        t0 = time.perf_counter()
        r2 = subprocess.run(py + [*opts, str(src), str(ours), t, str(a.threads)], capture_output=True, text=True)
        t_ours = time.perf_counter() - t0
        if r1.returncode or r2.returncode:
            why = (r1.stderr if r1.returncode else r2.stderr).strip().splitlines()[-1:]
            print(f"| {t} | {'failed' if r1.returncode else f'{t_ref:.2f}'} | "
                  f"{'failed' if r2.returncode else f'{t_ours:.2f}'} | | {why[0] if why else ''} |", flush=True)
        else:
            same = ref.read_bytes() == ours.read_bytes()
            print(f"| {t} | {t_ref:.2f} | {t_ours:.2f} | {t_ours / t_ref:.2f} | {'yes' if same else 'NO'} |",
                  flush=True)
        ref.unlink(missing_ok=True)
        ours.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
