"""Vision encoder speed beside llama.cpp's libmtmd: a random-weight SigLIP-400M-shaped gemma3 projector (Gemma 3's:
27 blocks, width 1152, feed-forward 4304, 16 heads, 896 px images in patches of 14, F16 matrices), one image,
the same file on both sides, the same threads.

    .venv/bin/python benchmarks/vision_encode.py [--image-size 896] [--blocks 27] [--threads 2] [--repeat 2]

Writes the projector and a PNG under --dir (default /tmp/llampy-vision-bench; ~820 MB at full size), then times
``mtmd_encode_chunk`` in llama.cpp (the llama-cpp-python 0.3.36 build, ``$LLAMACPP_PY``) and llampy's
``mtmd.vision.Encoder.encode`` (after one untimed run that compiles and plans), best of --repeat. The text
projection goes to the shared tiny gemma3's width (64) instead of Gemma 3 4B's 2560, so that the tiny model can
stand in for the language model libmtmd insists on: that product is under 0.1% of the work.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("LLAMPY_SHARED", ROOT.parent / "shared"))
LM = SHARED / "fixtures" / "tiny" / "gemma3-Q8_0.gguf"
LLAMACPP_PY = os.environ.get("LLAMACPP_PY", str(Path.home() / ".cache/llampy/llamacpp-0.3.36-98260d3815e1/bin/python"))


def write_projector(path: Path, image_size: int, n_layer: int, n_embd=1152, n_ff=4304, n_head=16, patch=14,
                    n_text=64) -> None:
    sys.path.insert(0, str(ROOT))
    from llampy.gguf.constants import GGUFValueType as VT
    from llampy.gguf.writer import GGUFWriter
    from llampy.ggml.types import GGMLType as T
    w = GGUFWriter(str(path))
    u32 = lambda k, v: w.add(k, int(v), VT.UINT32)
    w.add("general.architecture", "clip")
    w.add("clip.projector_type", "gemma3")
    w.add("clip.has_vision_encoder", True)
    w.add("clip.use_gelu", True)
    v = "clip.vision"
    u32(f"{v}.embedding_length", n_embd)
    u32(f"{v}.feed_forward_length", n_ff)
    u32(f"{v}.attention.head_count", n_head)
    u32(f"{v}.block_count", n_layer)
    w.add(f"{v}.attention.layer_norm_epsilon", 1e-6)
    u32(f"{v}.image_size", image_size)
    u32(f"{v}.patch_size", patch)
    u32(f"{v}.projection_dim", n_text)
    w.add(f"{v}.image_mean", [0.5, 0.5, 0.5])
    w.add(f"{v}.image_std", [0.5, 0.5, 0.5])
    n_pos = (image_size // patch) ** 2

    def rnd(name, ne, type, scale, mean=0.0):
        def make():
            rng = np.random.RandomState(zlib.crc32(name.encode()))
            a = (mean + scale * rng.standard_normal(int(np.prod(ne)))).astype(np.float32)
            return a.astype(np.float16) if type == T.F16 else a
        w.add_tensor_lazy(name, type, ne, make)

    rnd("v.patch_embd.weight", (patch, patch, 3, n_embd), T.F16, 1 / math.sqrt(3 * patch * patch))
    rnd("v.patch_embd.bias", (n_embd,), T.F32, 0.1)
    rnd("v.position_embd.weight", (n_embd, n_pos), T.F32, 0.3)
    for il in range(n_layer):
        b = f"v.blk.{il}"
        for nm in ("attn_q", "attn_k", "attn_v", "attn_out"):
            rnd(f"{b}.{nm}.weight", (n_embd, n_embd), T.F16, 1 / math.sqrt(n_embd))
            rnd(f"{b}.{nm}.bias", (n_embd,), T.F32, 0.1)
        for nm in ("ln1", "ln2"):
            rnd(f"{b}.{nm}.weight", (n_embd,), T.F32, 0.1, 1.0)
            rnd(f"{b}.{nm}.bias", (n_embd,), T.F32, 0.1)
        rnd(f"{b}.ffn_up.weight", (n_embd, n_ff), T.F16, 1 / math.sqrt(n_embd))
        rnd(f"{b}.ffn_up.bias", (n_ff,), T.F32, 0.1)
        rnd(f"{b}.ffn_down.weight", (n_ff, n_embd), T.F16, 1 / math.sqrt(n_ff))
        rnd(f"{b}.ffn_down.bias", (n_embd,), T.F32, 0.1)
    rnd("v.post_ln.weight", (n_embd,), T.F32, 0.1, 1.0)
    rnd("v.post_ln.bias", (n_embd,), T.F32, 0.1)
    rnd("mm.soft_emb_norm.weight", (n_embd,), T.F32, 0.1, 1.0)
    rnd("mm.input_projection.weight", (n_text, n_embd), T.F16, 1 / math.sqrt(n_embd))
    w.write()


def write_image(path: Path, size: int) -> None:
    from PIL import Image
    rng = np.random.RandomState(7)
    Image.fromarray(rng.randint(0, 256, (size, size, 3), dtype=np.uint8), "RGB").save(path)


def run_llamacpp(mmproj: Path, image: Path, threads: int, repeat: int) -> dict:
    import ctypes
    import llama_cpp as L
    import llama_cpp.mtmd_cpp as M
    quiet = L.llama_log_callback(lambda level, text, data: None)
    L.llama_log_set(quiet, ctypes.c_void_p(0))
    L.llama_backend_init()
    model = L.llama_model_load_from_file(str(LM).encode(), L.llama_model_default_params())
    mp = M.mtmd_context_params_default()
    mp.use_gpu, mp.n_threads, mp.print_timings, mp.warmup = False, threads, False, False
    mctx = M.mtmd_init_from_file(str(mmproj).encode(), model, mp)
    bm = M.mtmd_helper_bitmap_init_from_file(mctx, str(image).encode(), False)
    raw = b"<__media__>"
    txt = M.mtmd_input_text(text=raw, text_len=len(raw), add_special=False, parse_special=True)
    chunks = M.mtmd_input_chunks_init()
    assert M.mtmd_tokenize(mctx, chunks, ctypes.byref(txt), (M.mtmd_bitmap_p_ctypes * 1)(bm), 1) == 0
    ch = next(c for c in (M.mtmd_input_chunks_get(chunks, i) for i in range(M.mtmd_input_chunks_size(chunks)))
              if M.mtmd_input_chunk_get_type(c) == M.MTMD_INPUT_CHUNK_TYPE_IMAGE)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        assert M.mtmd_encode_chunk(mctx, ch) == 0
        times.append(time.perf_counter() - t0)
    n = M.mtmd_input_chunk_get_n_tokens(ch)
    out = np.ctypeslib.as_array(M.mtmd_get_output_embd(mctx), shape=(n * 64,)).reshape(n, 64)
    return {"times": times, "n_tokens": int(n), "embd_head": out[:2, :8].tolist(), "embd": out.tolist()}


def run_llampy(mmproj: Path, image: Path, threads: int, repeat: int) -> dict:
    sys.path.insert(0, str(ROOT))
    from llampy import tuning
    tuning.size_numba_pool(threads)
    tuning.install()
    from llampy.mtmd.clip import Projector
    from llampy.mtmd.images import bitmap_from_file, preprocess
    from llampy.mtmd.vision import Encoder
    proj = Projector(mmproj, n_threads=threads)
    enc = Encoder(proj)
    px = preprocess(bitmap_from_file(image), proj.hparams).images[0]
    t0 = time.perf_counter()
    enc.encode(px)                       # compiles the kernels it needs, plans the graph
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = enc.encode(px)
        times.append(time.perf_counter() - t0)
    return {"times": times, "first": first, "n_tokens": len(out), "embd": out.tolist()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--image-size", type=int, default=896)
    ap.add_argument("--blocks", type=int, default=27)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--dir", default="/tmp/llampy-vision-bench")
    ap.add_argument("--side", choices=("both", "llamacpp", "llampy"), default="both")
    ap.add_argument("--json-out", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    d = Path(a.dir)
    d.mkdir(parents=True, exist_ok=True)
    mmproj = d / f"siglip-{a.image_size}-{a.blocks}.gguf"
    image = d / f"noise-{a.image_size}.png"
    if a.side == "llamacpp" and a.json_out:           # the llama.cpp half, in its own Python
        Path(a.json_out).write_text(json.dumps(run_llamacpp(mmproj, image, a.threads, a.repeat)))
        return 0
    if not mmproj.exists():
        print(f"writing {mmproj} ...", file=sys.stderr, flush=True)
        write_projector(mmproj, a.image_size, a.blocks)
    if not image.exists():
        write_image(image, a.image_size)
    res = {}
    if a.side in ("both", "llamacpp"):
        out = d / "llamacpp.json"
        subprocess.run([LLAMACPP_PY, __file__, "--side", "llamacpp", "--json-out", str(out), "--image-size",
                        str(a.image_size), "--blocks", str(a.blocks), "--threads", str(a.threads), "--repeat",
                        str(a.repeat), "--dir", str(d)], check=True)
        res["llama.cpp"] = json.loads(out.read_text())
    if a.side in ("both", "llampy"):
        res["llampy"] = run_llampy(mmproj, image, a.threads, a.repeat)
    n_patch = (a.image_size // 14) ** 2
    print(f"image slice of {a.image_size} px ({n_patch} patches), {a.blocks} blocks of width 1152, {a.threads} threads")
    for k, r in res.items():
        extra = f" (first run {r['first']:.1f} s: compiling and planning)" if "first" in r else ""
        print(f"  {k:10s} encoded in {min(r['times']) * 1000:.0f} ms, {r['n_tokens']} tokens{extra}")
    if len(res) == 2:
        a_, b_ = np.array(res["llama.cpp"]["embd"]), np.array(res["llampy"]["embd"])
        print(f"  llampy / llama.cpp: {min(res['llampy']['times']) / min(res['llama.cpp']['times']):.2f}x; "
              f"embeddings differ by {np.abs(a_ - b_).max() / np.abs(a_).max():.2e} relative")
    return 0


if __name__ == "__main__":
    sys.exit(main())
