"""GPU benchmark: 7B-shaped random-weight models on the CUDA backend, beside llama.cpp's CUDA build where given.

    python benchmarks/gpu_bench.py [--shapes llama2-7b,qwen2.5-7b] [--types Q4_K_M,Q4_0,Q8_0,F16]
                                   [-p 512] [-n 128] [-r 3] [--dir /tmp/gpu_bench] [--llama-bench PATH]
                                   [--partial] [--json OUT]

Each model is written with llampy's GGUF writer: every matrix holds rows quantized by llampy's quantizer from
random values, repeated to the full shape (speed does not depend on the values). Q4_K_M follows llama-quantize's
mix in spirit: Q6_K for attn_v, ffn_down and the output head, Q4_K elsewhere. For each file it reports llampy's
pp and tg tok/s with every layer on the GPU (``llampy.llama.bench``, llama-bench's method), the HBM roofline of
decode (bytes of weights read per token / the device's measured copy bandwidth, counting bytes read and
written), and llama-bench's figures on the same file when ``--llama-bench`` names a CUDA build of it.
``--partial`` adds half the layers offloaded against CPU-only decode on the first file (short runs).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llampy.ggml.quants import quantize                     # noqa: E402
from llampy.ggml.types import GGMLType, TYPE_TRAITS, row_size  # noqa: E402
from llampy.gguf import GGUFWriter                           # noqa: E402
from llampy.gguf.constants import GGUFValueType as VT         # noqa: E402
from llampy.llama.warmup import add_spm_vocab                # noqa: E402

T = GGMLType
SHAPES = {   # n_embd, n_layer, n_head, n_head_kv, n_ff, n_vocab, rope base
    "llama2-7b": (4096, 32, 32, 32, 11008, 32000, 10000.0),
    "qwen2.5-7b": (3584, 28, 28, 4, 18944, 152064, 1000000.0),
    "1b": (2048, 16, 32, 8, 8192, 128256, 500000.0),     # Llama 3.2 1B's (benchmarks/compare_llamacpp.py --shape 1b)
    "tiny": (256, 2, 4, 2, 512, 1024, 10000.0),          # a smoke test of the script (TRITON_INTERPRET=1 on a CPU)
}
MIXES = {
    "Q4_K_M": {"default": T.Q4_K, "attn_v": T.Q6_K, "ffn_down": T.Q6_K, "output": T.Q6_K, "token_embd": T.Q4_K},
    "Q4_0": {"default": T.Q4_0, "output": T.Q6_K},
    "Q8_0": {"default": T.Q8_0},
    "F16": {"default": T.F16},
}


def _rows(t: GGMLType, ncols: int, nrows: int, rng, cache: dict) -> np.ndarray:
    """nrows rows of ncols values of type t: 64 quantized random rows, repeated."""
    key = (t, ncols)
    if key not in cache:
        v = (rng.standard_normal((64, ncols)) * 0.02).astype(np.float32)
        cache[key] = v.astype(np.float16).view(np.uint8) if t == T.F16 else quantize(v, t).reshape(64, -1)
    base = cache[key]
    reps = (nrows + 63) // 64
    return np.tile(base, (reps, 1))[:nrows]


def write_model(path: Path, shape: str, mix: str) -> int:
    n_embd, n_layer, n_head, n_head_kv, n_ff, n_vocab, base = SHAPES[shape]
    head_dim = n_embd // n_head
    types = MIXES[mix]
    rng = np.random.default_rng(0)
    cache: dict = {}
    w = GGUFWriter(path)
    a = "llama"
    for k, v in (("general.architecture", a), ("general.name", f"{shape}-random-{mix}"),
                 (f"{a}.block_count", n_layer), (f"{a}.context_length", 4096), (f"{a}.embedding_length", n_embd),
                 (f"{a}.feed_forward_length", n_ff), (f"{a}.attention.head_count", n_head),
                 (f"{a}.attention.head_count_kv", n_head_kv), (f"{a}.rope.dimension_count", head_dim),
                 (f"{a}.rope.freq_base", base), (f"{a}.attention.layer_norm_rms_epsilon", 1e-5)):
        w.add(k, v, VT.UINT32 if isinstance(v, int) else None)     # llama.cpp reads these counts as u32
    add_spm_vocab(w, n_vocab)

    def mat(name, key, ncols, nrows):
        t = types.get(key, types["default"])
        w.add_tensor_raw(name, t, (ncols, nrows), _rows(t, ncols, nrows, rng, cache))

    def norm(name, n):
        w.add_tensor_raw(name, T.F32, (n,), np.ones(n, np.float32).view(np.uint8))

    mat("token_embd.weight", "token_embd", n_embd, n_vocab)
    norm("output_norm.weight", n_embd)
    mat("output.weight", "output", n_embd, n_vocab)
    for il in range(n_layer):
        b = f"blk.{il}."
        norm(b + "attn_norm.weight", n_embd)
        norm(b + "ffn_norm.weight", n_embd)
        mat(b + "attn_q.weight", "attn_q", n_embd, n_head * head_dim)
        mat(b + "attn_k.weight", "attn_k", n_embd, n_head_kv * head_dim)
        mat(b + "attn_v.weight", "attn_v", n_embd, n_head_kv * head_dim)
        mat(b + "attn_output.weight", "attn_output", n_head * head_dim, n_embd)
        mat(b + "ffn_gate.weight", "ffn_gate", n_embd, n_ff)
        mat(b + "ffn_up.weight", "ffn_up", n_embd, n_ff)
        mat(b + "ffn_down.weight", "ffn_down", n_ff, n_embd)
    w.write()
    return path.stat().st_size


def decode_bytes(model) -> int:
    """Bytes of weights one decode step reads: every matrix but the token embedding (one row of it)."""
    n = 0
    for name, t in model.tensors.items():
        n += row_size(t.type, t.ne[0]) if name == "token_embd.weight" else t.nbytes
    out = getattr(model, "output", None)
    if out is not None and out.name not in model.tensors:
        n += out.nbytes
    return n


def copy_bandwidth() -> float:
    """Device copy bandwidth in bytes/s, counting bytes read and written (as KINDS.md reports it)."""
    import torch
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    n = 20
    for _ in range(n):
        b.copy_(a)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    del a, b
    return 2 * (1 << 30) * n / dt


def llama_bench(exe: str, path: Path, n_prompt: int, n_gen: int, reps: int, ngl: int = 99, ctk: str = "f16",
                ctv: str = "f16") -> dict:
    cmd = [exe, "-m", str(path), "-ngl", str(ngl), "-p", str(n_prompt), "-n", str(n_gen), "-r", str(reps), "-o",
           "json", "-fa", "1", "-ctk", ctk, "-ctv", ctv]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True).stdout
    except (subprocess.SubprocessError, OSError) as e:
        return {"error": str(e)[:300]}
    res = {}
    for r in json.loads(out):
        key = "pp" if r["n_prompt"] and not r["n_gen"] else "tg"
        res[key] = r["avg_ts"]
    return res


def profile_decode(model, steps: int = 16) -> None:
    """Where a decode step's time goes: torch's profiler over a few steps, kernels by GPU time, and the step's
    wall time against its GPU time."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from llampy.llama.batch import Batch
    from llampy.llama.context import Context
    ctx = Context(model, n_ctx=256)
    ctx.decode(Batch.from_tokens([1, 2, 3, 4]))
    for i in range(3):
        ctx.decode(Batch.from_tokens([5], pos0=4 + i))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            ctx.decode(Batch.from_tokens([5], pos0=7 + i))
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / steps
    print(f"decode step: {wall * 1e3:.2f} ms wall (under the profiler)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=24, max_name_column_width=60))
    # the host's share: the step's wall time alone, then where Python spends it (cProfile, by own time)
    import cProfile
    import pstats
    pos = 7 + steps
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(steps):
        ctx.decode(Batch.from_tokens([5], pos0=pos + i))
    wall = (time.perf_counter() - t0) / steps
    pos += steps
    print(f"decode step: {wall * 1e3:.3f} ms wall (no profiler)")
    pr = cProfile.Profile()
    pr.enable()
    for i in range(steps):
        ctx.decode(Batch.from_tokens([5], pos0=pos + i))
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(22)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="llama2-7b")
    ap.add_argument("--types", default="Q4_K_M,Q4_0,Q8_0,F16")
    ap.add_argument("-p", "--n-prompt", type=int, default=512)
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument("-r", "--reps", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/gpu_bench")
    ap.add_argument("--llama-bench", default=None, help="a llama-bench built with -DGGML_CUDA=ON")
    ap.add_argument("--partial", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the GGUF files")
    ap.add_argument("--reuse", action="store_true", help="use a file an earlier --keep run left (same shape and mix)")
    ap.add_argument("-ctk", "--cache-type-k", default="f16", help="the KV cache's K type (both sides)")
    ap.add_argument("-ctv", "--cache-type-v", default="f16", help="the KV cache's V type (both sides)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", action="store_true", help="the GPU kernels of 16 decode steps, by time (first file)")
    ap.add_argument("--mmvq-shapes", default=None, help="launch shapes of the integer decode kernels to try instead "
                    "of the backend's table (a JSON written by gpu_matvec.py --json): for tuning that table")
    ap.add_argument("--dequant", choices=("fast", "values"), default="fast", help="prompts' dequantization of "
                    "Q4_0/Q8_0/Q4_K/Q6_K weights: the wide-load kernel (default) or the per-element value rules")
    ap.add_argument("--half-shape", default=None, help="BN,BK,warps of the F16/BF16 decode kernel to use instead "
                    "of kernels.HALF_SHAPE (gpu_matvec.py --half prints the best)")
    args = ap.parse_args(argv)
    if args.mmvq_shapes and Path(args.mmvq_shapes).exists():
        from llampy.ggml.backends.cuda import mmvq as MMVQ
        for name, shape in json.loads(Path(args.mmvq_shapes).read_text()).items():
            MMVQ.choose(T[name], shape)
        print("integer decode kernels' launch shapes:", {t.name: v for t, v in MMVQ.SHAPES.items()},
              {t.name: k.fn.__name__ for t, (k, g) in MMVQ.KERNELS.items()}, flush=True)

    if args.dequant == "values":
        from llampy.ggml.backends.cuda import kernels as KK
        KK.FAST_DEQUANT_ON = False
    if args.half_shape:
        from llampy.ggml.backends.cuda import kernels as KK
        KK.HALF_SHAPE = tuple(int(v) for v in args.half_shape.split(","))
        print("F16/BF16 decode kernel's launch shape:", KK.HALF_SHAPE, flush=True)
    import torch
    from llampy.llama.bench import bench
    from llampy.llama.model import Model

    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    on_gpu = torch.cuda.is_available()
    bw = copy_bandwidth() if on_gpu else float("nan")
    dev = torch.cuda.get_device_name(0) if on_gpu else "Triton interpreter (CPU)"
    print(f"device: {dev}; copy bandwidth {bw / 1e9:.0f} GB/s (read + written)", flush=True)
    rows = []
    for shape in args.shapes.split(","):
        for mix in args.types.split(","):
            path = d / f"{shape}-{mix}.gguf"
            t0 = time.perf_counter()
            size = path.stat().st_size if args.reuse and path.exists() else write_model(path, shape, mix)
            t_write = time.perf_counter() - t0
            t0 = time.perf_counter()
            m = Model(path, n_gpu_layers=-1)
            t_load = time.perf_counter() - t0
            kv = dict(type_k=T[args.cache_type_k.upper()], type_v=T[args.cache_type_v.upper()])
            res = {r.test[:2]: r.avg_ts for r in bench(m, args.n_prompt, args.n_gen, args.reps, **kv)}
            if args.profile and not rows and on_gpu:
                profile_decode(m)
            nbytes = decode_bytes(m)
            roof = bw / nbytes
            row = {"shape": shape, "type": mix, "size_gib": size / 2**30, "pp": res.get("pp"), "tg": res.get("tg"),
                   "roofline_tg": roof, "tg_of_roofline": (res.get("tg") or 0) / roof, "write_s": t_write,
                   "load_s": t_load}
            del m
            if on_gpu:
                torch.cuda.empty_cache()
            if args.llama_bench:
                lc = llama_bench(args.llama_bench, path, args.n_prompt, args.n_gen, args.reps,
                                 ctk=args.cache_type_k, ctv=args.cache_type_v)
                row["llamacpp"] = lc
                if "tg" in lc and row["tg"]:
                    row["tg_ratio"] = row["tg"] / lc["tg"]
                if "pp" in lc and row["pp"]:
                    row["pp_ratio"] = row["pp"] / lc["pp"]
            print(json.dumps(row), flush=True)
            rows.append(row)
            if args.partial and len(rows) == 1:
                for ngl in (SHAPES[shape][1] // 2, 0):
                    mm = Model(path, n_gpu_layers=ngl)
                    r = {x.test[:2]: x.avg_ts for x in bench(mm, 0, 8, 1, n_threads=os.cpu_count() or 1)}
                    print(json.dumps({"shape": shape, "type": mix, "n_gpu_layers": ngl, "tg8": r.get("tg")}),
                          flush=True)
                    del mm
            if not args.keep:
                path.unlink()
    print()
    print(f"| shape | type | GiB | pp{args.n_prompt} t/s | tg{args.n_gen} t/s | roofline tg | % of roofline "
          f"| llama.cpp pp / tg | ratio pp / tg |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        lc = r.get("llamacpp", {})
        lcs = f"{lc.get('pp', 0):.0f} / {lc.get('tg', 0):.1f}" if lc and "error" not in lc else "-"
        rs = f"{r.get('pp_ratio', 0):.2f} / {r.get('tg_ratio', 0):.2f}" if "tg_ratio" in r else "-"
        print(f"| {r['shape']} | {r['type']} | {r['size_gib']:.2f} | {r['pp']:.0f} | {r['tg']:.1f} | "
              f"{r['roofline_tg']:.0f} | {100 * r['tg_of_roofline']:.0f}% | {lcs} | {rs} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": dev, "copy_bw": bw, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
