"""llampy quantize against llama-quantize: wall and CPU time per file type with the same thread count, and whether
the two outputs are byte-identical.

    python benchmarks/quantize_bench.py [--threads 2] [--types Q4_0,Q8_0,Q4_K_M,Q6_K] [--layers 4] [--vocab 32000]
                                        [--src smollm2|1b|FILE] [--imatrix] [--dir DIR] [--repeat N]

The input: by default a random-weight F16 llama of TinyLlama's layer shapes (n_embd 2048, n_ff 5632, 16 heads, 4 KV
heads) with ``--layers`` layers and a ``--vocab``-token vocabulary, written once with llampy's writer (``--layers 4
--vocab 32000``: 311 M parameters, where the kernels decide; ``--layers 1 --vocab 4096``: 62 M, where the fixed
start-up of a process counts as much). ``--src smollm2``: the default model, SmolLM2-135M (its bundled Q4_1 file
turned into F16 once by ``llampy quantize --allow-requantize ... F16``: what a user of the default model would
quantize; its 576-wide rows are no whole k-quant blocks, so llama-quantize's fallbacks pick most tensors' types);
``--src 1b``: Llama 3.2 1B's shape in F16 (2048 wide, 16 layers, n_ff 8192, a 128256-token vocabulary and an
untied output matrix: 1.50 G parameters, 3.0 GB; compare_llamacpp.py's ``--shape 1b`` file, cached in
~/.cache/llampy/shapes), the size users quantize; ``--src FILE``: any F32/F16/BF16 GGUF.

``--types all``: every file type llama-quantize offers (COPY included), those that need an importance matrix
(IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ2_M, IQ3_XXS, IQ3_XS, Q2_K_S: some tensor of theirs gets a type that
llama-quantize quantizes only with one) left out unless ``--imatrix``; ``--types imatrix``: those nine.
``--imatrix``: both tools get the same random importance matrix.

llama-quantize is found as the tests find it (LLAMPY_LLAMA_QUANTIZE, or bin/llama-quantize of LLAMPY_LLAMACPP:
``bash scripts/llamacpp.sh`` builds it). Before timing, llampy quantizes a small random model (its weights F16
when the input's are, else F32) once to every listed type (untimed), so that no timed run compiles a kernel; then
each tool runs once per type, the input already in the page cache and the dirty pages written back (sync) before
each run; each output is hashed (SHA-256) and removed right after its run, and after a large one the next run waits
3 s (``SETTLE_S``: no run gets the pages another output has just freed). llampy's .pyc files are brought up to
date first (``compileall``, as installing the package does; with
PYTHONDONTWRITEBYTECODE set, a module edited since its last .pyc would compile from source at every start: ~0.25 s
for llama/quant.py). Wall time is the whole command's (start-up included); CPU is its user + system time, which a
loaded machine disturbs less than wall time. ``--repeat N``: each tool runs N times per type (taking turns); the
table gives each tool's fastest wall and least CPU of the N (a run of about a second moves by a quarter between
runs on a quiet machine), and the outputs of every run are compared (by their hashes).
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

NEEDS_IMATRIX = ["IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ1_S", "IQ1_M", "IQ3_XXS", "IQ3_XS", "Q2_K_S"]


def _timed(cmd) -> tuple[subprocess.CompletedProcess, float, float]:
    """Run cmd; (result, wall seconds, CPU seconds of the child: user + system)."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return p, wall, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)


# Memory that stays free a while goes back to the host here (a VM with free page reporting: 8 MiB blocks, 2 s after
# they are freed), and the first write to such a page costs a fault in the host (filling a fresh 3 GB array: 3.2-11.4 s,
# filling it again: 0.15 s). An output of gigabytes removed right before a run hands that run pages still backed:
# llama-quantize's COPY of the 1B file, run right after the F16 row's two outputs were removed, took 2.6-4.3 s where
# the F16 before it took 4.4-10.7, and llampy's run after it found those pages given back. So each output is hashed
# and removed right after its run, and the next run waits until the freed pages have gone back
SETTLE_BYTES, SETTLE_S = 256 << 20, 3.0


def _digest_and_remove(path: Path) -> str:
    """The file's SHA-256, then the file removed (and, for a large one, the time for its freed pages to settle)."""
    import hashlib
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    size = path.stat().st_size
    path.unlink()
    if size >= SETTLE_BYTES:
        time.sleep(SETTLE_S)
    return h.hexdigest()


def _source(a, d: Path, py: list) -> tuple[Path, str]:
    """The input file and a line describing it."""
    import numpy as np
    from tests.llama.test_quantize import write_random_llama
    if a.src == "smollm2":
        from llampy.models import smollm2_path
        src = d / "smollm2-135m-f16.gguf"
        if not src.exists():
            subprocess.run(py + ["--allow-requantize", str(smollm2_path()), str(src), "F16"], capture_output=True,
                           check=True)
        return src, "SmolLM2-135M (the bundled Q4_1 as F16)"
    if a.src == "1b":
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from compare_llamacpp import shaped
        return shaped("1b", "F16"), ("Llama 3.2 1B's shape (compare_llamacpp.py --shape 1b: 64 random rows a matrix, "
                                     "repeated; output not tied), F16, 1498 M parameters")
    if a.src:
        return Path(a.src), a.src
    src = d / (f"rand-2048-L{a.layers}-f16.gguf" if a.vocab == 32000 else f"rand-2048-L{a.layers}-V{a.vocab}-f16.gguf")
    if not src.exists():
        write_random_llama(src, n_embd=2048, n_ff=5632, n_layer=a.layers, n_head=16, n_head_kv=4, n_vocab=a.vocab,
                           dtype=np.float16)
    n_params = (2 * a.vocab * 2048 + a.layers * (2 * 2048 * 2048 + 2 * 512 * 2048 + 3 * 2048 * 5632)) / 1e6
    return src, f"random llama ({a.layers} TinyLlama-shaped layers, vocabulary {a.vocab}), F16, {n_params:.0f} M parameters"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--types", default="Q4_0,Q8_0,Q4_K_M,Q5_K_M,Q6_K,IQ4_XS")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000, help="vocabulary size (token_embd and output rows)")
    ap.add_argument("--src", default=None,
                    help="'smollm2', '1b' or an F32/F16/BF16 GGUF instead of the random llama")
    ap.add_argument("--imatrix", action="store_true", help="a random importance matrix for both tools")
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "llampy-quant-bench"))
    ap.add_argument("--repeat", type=int, default=1, help="runs of each tool per type (the best of them shown)")
    a = ap.parse_args()
    import numpy as np
    from tests import llamacpp
    from tests.llama.test_quantize import write_random_imatrix, write_random_llama
    from llampy.llama.quant import FTYPES
    if a.types == "all":
        a.types = ",".join(n for n, _, _, d in FTYPES
                           if not d.startswith("alias") and (a.imatrix or n not in NEEDS_IMATRIX))
    elif a.types == "imatrix":
        a.types = ",".join(NEEDS_IMATRIX)
    types = a.types.split(",")
    tool = llamacpp.llama_quantize()
    if tool is None:
        print("llama-quantize not found: bash scripts/llamacpp.sh, then LLAMPY_LLAMACPP=<its output>")
        return 1
    d = Path(a.dir)
    d.mkdir(parents=True, exist_ok=True)
    py = [sys.executable, "-m", "llampy", "quantize", "--progress", "off"]
    src, what = _source(a, d, py)
    # the warm-up file holds its weights in the input's type: Numba compiles a kernel per argument type, and
    # F32 weights reach some kernels as read-only views of the mapping where F16 ones arrive converted
    from llampy.gguf import GGUFReader
    with GGUFReader(src, decode_string_arrays=False) as r:
        f16 = max(r.tensors.values(), key=lambda ti: ti.nbytes).type.name == "F16"
    small = d / ("small-f16.gguf" if f16 else "small.gguf")
    small_im = small.with_name(small.stem + "-imatrix.gguf")
    if not small.exists():
        write_random_llama(small, n_layer=1, dtype=np.float16 if f16 else np.float32)
        write_random_imatrix(small, small_im)
    # every module's bytecode cached and every kernel compiled (Numba's cache) before anything is timed
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "llampy")], capture_output=True, check=True,
                   env={k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"})
    for t in types:
        subprocess.run(py + (["--imatrix", str(small_im)] if a.imatrix else []) + [str(small), str(d / "warm.gguf"),
                       t, str(a.threads)], capture_output=True, check=True)
    opts = []
    if a.imatrix:
        im = d / f"{src.stem}-imatrix.gguf"
        if not im.exists():
            write_random_imatrix(src, im)
        opts = ["--imatrix", str(im)]
    with open(src, "rb") as f:          # the input in the page cache before the first timed run
        while f.read(1 << 24):
            pass
    print(f"{what}, {a.threads} threads{', random imatrix' if a.imatrix else ''}"
          f"{f', best of {a.repeat} runs' if a.repeat > 1 else ''}\n")
    print("| type | llama-quantize wall (s) | llampy wall (s) | wall ratio | llama-quantize CPU (s) | llampy CPU (s) "
          "| CPU ratio | identical |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for t in types:
        ref, ours = d / f"ref-{t}.gguf", d / f"ours-{t}.gguf"
        w1 = w2 = c1 = c2 = float("inf")
        same = True
        for _ in range(max(1, a.repeat)):
            # the page cache's dirty pages written back before each run: a file of gigabytes (the 1B shape) is
            # still being written out when the next command starts, and would slow whichever tool runs second;
            # and no run starts right after an output's pages were freed (_settle)
            os.sync()
            r1, w, c = _timed([tool, *opts, str(src), str(ref), t, str(a.threads)])
            w1, c1 = min(w1, w), min(c1, c)
            h1 = _digest_and_remove(ref) if not r1.returncode else None
            os.sync()
            r2, w, c = _timed(py + [*opts, str(src), str(ours), t, str(a.threads)])
            w2, c2 = min(w2, w), min(c2, c)
            h2 = _digest_and_remove(ours) if not r2.returncode else None
            if r1.returncode or r2.returncode:
                break
            same = same and h1 == h2
        if r1.returncode or r2.returncode:
            why = (r1.stderr if r1.returncode else r2.stderr).strip().splitlines()[-1:]
            print(f"| {t} | {'failed' if r1.returncode else f'{w1:.2f}'} | "
                  f"{'failed' if r2.returncode else f'{w2:.2f}'} | | | | | {why[0] if why else ''} |", flush=True)
        else:
            print(f"| {t} | {w1:.2f} | {w2:.2f} | {w2 / w1:.2f} | {c1:.2f} | {c2:.2f} | {c2 / max(c1, 1e-3):.2f} "
                  f"| {'yes' if same else 'NO'} |", flush=True)
        ref.unlink(missing_ok=True)
        ours.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
