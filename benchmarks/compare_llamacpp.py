#!/usr/bin/env python3
"""llampy against llama.cpp, side by side in one run, on the same GGUF files.

    python benchmarks/compare_llamacpp.py [MODEL ...] [-t 2] [-r 3] [-p 512] [-n 128]
    python benchmarks/compare_llamacpp.py --types F16 Q2_K IQ4_XS ... [--shape 1b] [--no-start]
    python benchmarks/compare_llamacpp.py --shape mamba2-370m lfm2-350m --shape-mixes Q8_0 --no-start

MODEL: a path, or 'smollm2' / 'gemma3' (default: both, unless --types or --shape name the models).
``--types``: the default model requantized by llama-quantize (``$LLAMPY_LLAMACPP/bin/llama-quantize``,
--allow-requantize) to each llama-quantize type (F16, Q3_K_M, IQ2_XXS, TQ1_0, ...; MXFP4: MXFP4_MOE with --pure,
as that mix gives a dense model's matrices Q8_0; the IQ1-IQ3 types with an importance matrix made once by
``llampy imatrix``), cached in ~/.cache/llampy/requant. ``--shape 1b``: a random model of Llama 3.2 1B's shape
written by llampy's own writer and quantizer (benchmarks/gpu_bench.py's ``write_model``) in each of
``--shape-mixes`` (Q4_K_M Q4_0 Q8_0), cached in ~/.cache/llampy/shapes; the recurrent and hybrid shapes
(mamba2-370m, lfm2-350m, lfm2-1.2b, granite-4.0-h-350m) come from benchmarks/recurrent_shapes.py the same way.
``--no-start``: pp and tg only. ``--bandwidth`` (the default with ``--shape``): the machine's DRAM read bandwidth
measured in the run (benchmarks/stream_read.py, same thread count, before the first row and after the last; the
better of the two, as STREAM reports its best) and a second table: per model the weight bytes one decode step
reads (``stream_read.decode_bytes``: every matrix once, one row of the token embedding) and each side's tg as GB/s
(bytes per token / time per token) and as a fraction of that bandwidth. The KV cache's reads (under 1% of a 1B
model's at tg128) are not counted.

For each model, llampy's bench and llama.cpp's (through llama-cpp-python's low-level llama_decode, the same pp/tg
tests) run interleaved, and the table gives pp and tg tok/s with the ratio llampy/llama.cpp, time from process
start to first token (cold: empty kernel cache; warm), and peak RSS (llampy's with its kernel cache filled by an
untimed run first). llama.cpp comes from llama-cpp-python, built for this machine (no AMX; see
../shared/DESIGN.md) into its own environment, benchmarks/.llamacpp-venv, once; the wheel is cached in
~/.cache/llampy/wheels; where ``LLAMPY_LLAMACPP`` names a llama.cpp environment already built (its bin/python
imports llama_cpp), that one is used.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
VENV = HERE / ".llamacpp-venv"
WHEELS = Path.home() / ".cache" / "llampy" / "wheels"
# No AVX-VNNI (-DGGML_AVX_VNNI): these AMD cores have AVX512-VNNI only, and llama-cpp-python 0.3.36's ggml emits the
# VEX-encoded vpdpbusd under it (SIGILL in ggml_vec_dot_q4_1_q8_1); with AVX512_VNNI + AVX512VL it uses the EVEX form.
_CMAKE_AVX512 = ("-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON "
                 "-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF "
                 "-DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF")
# AVX2-only cores (no avx512f in /proc/cpuinfo): the same build without the AVX-512 flags, which would SIGILL there.
_CMAKE_AVX2 = ("-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF "
               "-DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF")


def _has_avx512() -> bool:
    try:
        return " avx512f " in open("/proc/cpuinfo").read().replace("\n", " ")
    except OSError:
        return False


CMAKE_ARGS = _CMAKE_AVX512 if _has_avx512() else _CMAKE_AVX2

# Runs inside the llama.cpp environment: the pp and tg tests through llama_decode, as llama-bench does.
LLAMACPP_BENCH = r'''
import json, sys, time, random, ctypes
import llama_cpp as L
path, n_prompt, n_gen, reps, n_threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
L.llama_backend_init()
mp = L.llama_model_default_params()
model = L.llama_model_load_from_file(path.encode(), mp)
cp = L.llama_context_default_params()
cp.n_ctx = max(n_prompt, n_gen) + 1
cp.n_batch = 2048
cp.n_ubatch = 512
cp.n_threads = n_threads
cp.n_threads_batch = n_threads
ctx = L.llama_init_from_model(model, cp)
vocab = L.llama_model_get_vocab(model)
n_vocab = L.llama_vocab_n_tokens(vocab)
mem = L.llama_get_memory(ctx)
rnd = random.Random(1234)
def pp():
    L.llama_memory_clear(mem, True)
    toks = (L.llama_token * n_prompt)(*[rnd.randrange(n_vocab) for _ in range(n_prompt)])
    assert L.llama_decode(ctx, L.llama_batch_get_one(toks, n_prompt)) == 0
    L.llama_synchronize(ctx)
def tg():
    L.llama_memory_clear(mem, True)
    for i in range(n_gen):
        t = (L.llama_token * 1)(rnd.randrange(n_vocab))
        assert L.llama_decode(ctx, L.llama_batch_get_one(t, 1)) == 0
    L.llama_synchronize(ctx)
out = []
for name, fn, n in (("pp", pp, n_prompt), ("tg", tg, n_gen)):
    if n <= 0:
        continue
    fn()
    ns = []
    for _ in range(reps):
        t0 = time.perf_counter_ns(); fn(); ns.append(time.perf_counter_ns() - t0)
    ts = [n * 1e9 / x for x in ns]
    out.append({"test": f"{name}{n}", "n_prompt": n if name == "pp" else 0, "n_gen": n if name == "tg" else 0,
                "n_threads": n_threads, "avg_ts": sum(ts) / len(ts), "samples_ts": ts})
print(json.dumps(out))
'''

# Runs inside the llama.cpp environment: load, evaluate a short prompt, sample one token (start to first token).
LLAMACPP_FIRST = r'''
import sys, llama_cpp as L
L.llama_backend_init()
model = L.llama_model_load_from_file(sys.argv[1].encode(), L.llama_model_default_params())
cp = L.llama_context_default_params(); cp.n_ctx = 512; cp.n_threads = int(sys.argv[2]); cp.n_threads_batch = cp.n_threads
ctx = L.llama_init_from_model(model, cp)
vocab = L.llama_model_get_vocab(model)
text = b"The capital of France is"
buf = (L.llama_token * 64)()
n = L.llama_tokenize(vocab, text, len(text), buf, 64, True, True)
assert L.llama_decode(ctx, L.llama_batch_get_one(buf, n)) == 0
logits = L.llama_get_logits_ith(ctx, -1)
nv = L.llama_vocab_n_tokens(vocab)
best = max(range(nv), key=lambda i: logits[i])
print(best)
'''


def die(msg: str) -> None:
    print(f"compare_llamacpp: {msg}", file=sys.stderr)
    sys.exit(2)


def ensure_llamacpp() -> Path:
    given = os.environ.get("LLAMPY_LLAMACPP")
    if given:
        py = Path(given) / "bin" / "python"
        if subprocess.run([py, "-c", "import llama_cpp"], capture_output=True).returncode == 0:
            return py
        die(f"LLAMPY_LLAMACPP={given}: its bin/python cannot import llama_cpp")
    py = VENV / "bin" / "python"
    if py.exists() and subprocess.run([py, "-c", "import llama_cpp"], capture_output=True).returncode == 0:
        return py
    print("compare_llamacpp: setting up llama.cpp (llama-cpp-python) in benchmarks/.llamacpp-venv; "
          "a first build takes about 15 minutes on 2 cores", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", VENV], check=True)
    WHEELS.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, CMAKE_ARGS=CMAKE_ARGS)
    r = subprocess.run([py, "-m", "pip", "install", "-q", "--find-links", WHEELS, "--prefer-binary",
                        "llama-cpp-python"], env=env)
    if r.returncode != 0:
        die("could not install llama-cpp-python (it builds llama.cpp from source: needs a C++ compiler, cmake "
            "and PyPI); llama.cpp is not available for comparison")
    return py


def popen_rss(cmd, env=None) -> tuple[str, float, float]:
    """Run a command; return (stdout, wall seconds, its own peak RSS in MiB, read with wait4). stderr goes to a file
    so that a chatty child (llama.cpp logs a lot) can never block on a full pipe."""
    with tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=env, text=True)
        out = p.stdout.read()
        _, status, ru = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
        if p.returncode != 0:
            err.seek(0)
            why = ""
            if p.returncode < 0:
                sig = signal.Signals(-p.returncode).name
                why = f" (killed by {sig}" + (": an instruction this CPU lacks; see CMAKE_ARGS" if sig == "SIGILL"
                                              else "") + ")"
            die(f"{' '.join(map(str, cmd[:2]))} ... failed{why}:\n{err.read().decode(errors='replace')[-2000:]}")
    return out, wall, ru.ru_maxrss / 1024.0


CACHE = Path.home() / ".cache" / "llampy"
# recurrent_shapes.SHAPES' names (kept here so that --help needs no import of llampy)
SHAPE_NAMES = ("mamba2-370m", "lfm2-350m", "lfm2-1.2b", "granite-4.0-h-350m")
# llama-quantize refuses these without an importance matrix (llama-quant.cpp); IQ3_XXS/IQ3_S/IQ2_S use one if given
NEEDS_IMATRIX = {"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS", "IQ3_XS", "IQ3_S", "IQ3_M"}
# types llama-quantize names only as a MoE mix (MXFP4_MOE: Q8_0 for a dense model's matrices): --pure with it
PURE = {"MXFP4": "MXFP4_MOE"}


def _imatrix(src: Path, env) -> Path:
    """An importance matrix of the default model (llampy imatrix over the project's docs), made once."""
    out = CACHE / "requant" / f"{src.stem}.imatrix.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    text = out.with_suffix(".txt")
    text.write_text("\n\n".join(p.read_text() for p in (ROOT / "README.md", ROOT / "docs" / "architecture.md")))
    tmp = out.with_suffix(".part.gguf")
    popen_rss([sys.executable, "-m", "llampy.cli", "imatrix", str(src), "-f", str(text), "-o", str(tmp), "-c", "256",
               "--chunks", "16", "--progress", "off"], env)
    tmp.rename(out)
    return out


def requantized(src: Path, tname: str, lc_py: Path, env) -> Path:
    """src requantized by llama-quantize to the llama-quantize type tname (cached)."""
    out = CACHE / "requant" / f"{src.stem.split('.')[0]}.{tname}.gguf"
    if out.exists():
        return out
    exe = lc_py.parent / "llama-quantize"
    if not exe.exists():
        die(f"{exe} not found: --types needs llama.cpp's llama-quantize beside the llama.cpp environment's python")
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [str(exe), "--allow-requantize"]
    if tname.upper() in NEEDS_IMATRIX:
        cmd += ["--imatrix", str(_imatrix(src, env))]
    qname = tname
    if tname.upper() in PURE:
        cmd.append("--pure")
        qname = PURE[tname.upper()]
    tmp = out.with_suffix(".part")
    print(f"compare_llamacpp: llama-quantize {' '.join(cmd[1:])} {src.name} -> {qname}", file=sys.stderr)
    popen_rss(cmd + [str(src), str(tmp), qname, "2"], env)
    tmp.rename(out)
    return out


def shaped(shape: str, mix: str) -> Path:
    """A random model of the named shape in the named tensor-type mix, written by llampy (cached)."""
    sys.path.insert(0, str(HERE))
    import gpu_bench
    import recurrent_shapes
    out = CACHE / "shapes" / f"{shape}-random-{mix}.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".part")
        print(f"compare_llamacpp: writing {out.name}", file=sys.stderr)
        (recurrent_shapes if shape in recurrent_shapes.SHAPES else gpu_bench).write_model(tmp, shape, mix)
        tmp.rename(out)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*")
    ap.add_argument("--types", nargs="+", default=[], metavar="TYPE",
                    help="the default model requantized by llama-quantize to each of these types")
    ap.add_argument("--shape", nargs="+", default=[], choices=["1b", *SHAPE_NAMES],
                    help="also random models of these shapes (llampy's writer)")
    ap.add_argument("--shape-mixes", nargs="+", default=["Q4_K_M", "Q4_0", "Q8_0"], metavar="MIX")
    ap.add_argument("--no-start", action="store_true", help="skip the start-to-first-token and RSS columns")
    ap.add_argument("--no-warmup", action="store_true",
                    help="skip llampy's untimed run per model (its kernel cache already filled, e.g. by a run before): "
                         "each bench still warms up per test; the RSS column may then include compiling")
    ap.add_argument("--bandwidth", action=argparse.BooleanOptionalAction, default=None,
                    help="measure the DRAM read bandwidth and give decode's bytes per token against it "
                         "(default: with --shape)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-r", "--reps", type=int, default=3)
    ap.add_argument("-p", "--n-prompt", type=int, default=512)
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds of (llampy, llama.cpp)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    # the environment as given: llama.cpp's processes get it untouched; llampy's CLI processes install their own
    # process tuning (llampy.tuning: GOMP_SPINCOUNT among it) when they start
    given = dict(os.environ)
    sys.path.insert(0, str(ROOT))
    from llampy.models import resolve_model
    lc_py = ensure_llamacpp()
    # llampy's bytecode up to date, as an installed package has it (timings below include every start)
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "llampy")], check=True)
    env = dict(given, OMP_NUM_THREADS=str(args.threads))
    if args.shape:
        sys.path.insert(0, str(HERE))
        import gpu_bench
        bad = [m for m in args.shape_mixes if m not in gpu_bench.MIXES]
        if bad:
            die(f"unknown --shape-mixes {bad}: one of {sorted(gpu_bench.MIXES)}")
    paths = [resolve_model(m) for m in (args.models or ([] if args.types or args.shape else ["smollm2", "gemma3"]))]
    paths += [requantized(resolve_model(None), t, lc_py, env) for t in args.types]
    if args.shape:
        paths += [shaped(shape, mix) for shape in args.shape for mix in args.shape_mixes]
    for p in paths:
        if not Path(p).is_file():
            die(f"{p}: no such model file")
    bandwidth = args.bandwidth if args.bandwidth is not None else bool(args.shape)
    read_gbps = [read_bandwidth(args.threads, env)] if bandwidth else []
    rows = []
    for path in map(str, paths):
        ours = {"pp": [], "tg": []}
        theirs = {"pp": [], "tg": []}
        rss_ours = rss_theirs = 0.0
        # an untimed run first fills the kernel cache if a source change left it stale: a process that compiles
        # holds ~70 MiB more at its peak, which is the cold start's cost (its own column below), not a run's. It
        # generates as many tokens as the timed runs: kernels that only a longer cache reaches compile in the first
        # timed rep otherwise (the first row of a run read tg 90 then 129 tok/s in its two reps)
        bench = [sys.executable, "-m", "llampy.cli", "bench", path, "-p", str(args.n_prompt), "-t", str(args.threads)]
        if not args.no_warmup:
            popen_rss(bench + ["-n", str(args.n_gen), "-r", "1"], env)
        for _ in range(args.rounds):
            out, _, rss = popen_rss(bench + ["-n", str(args.n_gen), "-r", str(args.reps), "--json"], env)
            for r in json.loads(out):
                ours["pp" if r["n_prompt"] else "tg"].extend(r["samples_ts"])
            rss_ours = max(rss_ours, rss)
            out, _, rss = popen_rss([lc_py, "-c", LLAMACPP_BENCH, path, str(args.n_prompt), str(args.n_gen),
                                     str(args.reps), str(args.threads)], env)
            for r in json.loads(out):
                theirs["pp" if r["n_prompt"] else "tg"].extend(r["samples_ts"])
            rss_theirs = max(rss_theirs, rss)
        mean = lambda xs: statistics.mean(xs) if xs else float("nan")
        row = {"model": Path(path).name, "pp_llampy": mean(ours["pp"]), "pp_llamacpp": mean(theirs["pp"]),
               "tg_llampy": mean(ours["tg"]), "tg_llamacpp": mean(theirs["tg"]),
               "rss_llampy_mib": rss_ours, "rss_llamacpp_mib": rss_theirs}
        rows.append(row)
        # each row as it is measured (stderr): a long --types run interrupted keeps what it measured
        print(f"compare_llamacpp: {row['model']}: pp {row['pp_llampy']:.1f} vs {row['pp_llamacpp']:.1f}, "
              f"tg {row['tg_llampy']:.1f} vs {row['tg_llamacpp']:.1f}", file=sys.stderr, flush=True)
        if args.no_start:
            continue
        # start to first token: cold (empty Numba cache) and warm, and llama.cpp's
        first_cmd = [sys.executable, "-m", "llampy.cli", "run", path, "-p", "The capital of France is", "-n", "1",
                     "--temp", "0", "-t", str(args.threads)]
        with tempfile.TemporaryDirectory() as cache:
            _, cold, _ = popen_rss(first_cmd, dict(env, NUMBA_CACHE_DIR=cache))
            _, warm, _ = popen_rss(first_cmd, dict(env, NUMBA_CACHE_DIR=cache))
        _, lc_first, _ = popen_rss([lc_py, "-c", LLAMACPP_FIRST, path, str(args.threads)], env)
        row.update(first_cold_s=cold, first_warm_s=warm, first_llamacpp_s=lc_first)
    if bandwidth:
        read_gbps.append(read_bandwidth(args.threads, env))
        sys.path.insert(0, str(HERE))
        from stream_read import decode_bytes
        for r, path in zip(rows, map(str, paths)):
            r["decode_bytes"] = decode_bytes(path)
            r["read_gbps"] = max(read_gbps)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"threads {args.threads}, pp{args.n_prompt} / tg{args.n_gen}, {args.rounds} interleaved rounds x {args.reps} reps\n")
    start = not args.no_start
    print("| model | pp llampy | pp llama.cpp | pp ratio | tg llampy | tg llama.cpp | tg ratio |"
          + (" first token cold / warm (llama.cpp) | peak RSS MiB llampy / llama.cpp (ratio) |" if start else ""))
    print("| --- " * (9 if start else 7) + "|")
    for r in rows:
        line = (f"| {r['model']} | {r['pp_llampy']:.1f} | {r['pp_llamacpp']:.1f} | {r['pp_llampy'] / r['pp_llamacpp']:.2f} "
                f"| {r['tg_llampy']:.1f} | {r['tg_llamacpp']:.1f} | {r['tg_llampy'] / r['tg_llamacpp']:.2f} |")
        if start:
            line += (f" {r['first_cold_s']:.2f} s / {r['first_warm_s']:.2f} s ({r['first_llamacpp_s']:.2f} s) "
                     f"| {r['rss_llampy_mib']:.0f} / {r['rss_llamacpp_mib']:.0f} "
                     f"({r['rss_llampy_mib'] / r['rss_llamacpp_mib']:.2f}) |")
        print(line)
    if bandwidth:
        bw = max(read_gbps)
        print(f"\nDRAM read bandwidth (stream_read.py, {args.threads} threads, before / after the rows): "
              + " / ".join(f"{g:.2f}" for g in read_gbps) + f" GB/s; decode against the best, {bw:.2f} GB/s:\n")
        print("| model | MB read per token | tg llampy GB/s | of the bandwidth | tg llama.cpp GB/s | of the bandwidth |")
        print("| --- " * 6 + "|")
        for r in rows:
            mb = r["decode_bytes"] / 1e6
            ours, theirs = mb * r["tg_llampy"] / 1e3, mb * r["tg_llamacpp"] / 1e3
            print(f"| {r['model']} | {mb:.1f} | {ours:.2f} | {ours / bw:.0%} | {theirs:.2f} | {theirs / bw:.0%} |")
    return 0


def read_bandwidth(threads: int, env) -> float:
    """The machine's DRAM read bandwidth in GB/s now (benchmarks/stream_read.py in its own process)."""
    out, _, _ = popen_rss([sys.executable, str(HERE / "stream_read.py"), "-t", str(threads), "--json"], env)
    return json.loads(out)["read_gbps"]


if __name__ == "__main__":
    sys.exit(main())
