"""Random-weight recurrent and hybrid GGUFs of real models' shapes, written by llampy's writer and quantizer, for
speed comparisons beside llama.cpp (``compare_llamacpp.py --shape mamba2-370m`` etc.).

    python benchmarks/recurrent_shapes.py OUT_DIR [--shapes mamba2-370m,lfm2-350m] [--mix Q8_0] [--layers N]

Shapes (from the models' published configurations): Mamba-2 370M (width 1024, 48 layers, state 128 in one group,
32 heads of 64), LFM2-350M and LFM2-1.2B (16 layers, attention at layers 2, 5, 8, 10, 12, 14 and gated short
convolutions of width 3 elsewhere; 1024 / 2048 wide, feed-forward 4608 / 8192, 16 / 32 heads over 8 KV heads, a
65536-token vocabulary), Granite-4.0-H-350M (width 768, 32 layers: Mamba-2 with 48 heads of 32 and state 128, and
attention with 12 heads over 4 at layers 10, 13, 17, 27, no positions; a dense 2048 SwiGLU after each; 100352
tokens). Metadata and tensor names as llama.cpp's loader reads them (the tiny fixtures' writers in
tests/fixtures/tiny_recurrent/ use the same). Matrices: 64 rows quantized from random values, repeated, as
gpu_bench.py's; the vocabulary a placeholder SPM one. The small per-channel tensors (convolution kernels, A, D,
dt bias, norms) hold values of the trained models' ranges, so that neither side meets overflows or denormals a
real model would not give. ``--layers`` cuts the stack (a quick check that llama.cpp loads a file).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from gpu_bench import MIXES, T, _rows                         # noqa: E402
from llampy.gguf import GGUFWriter                              # noqa: E402
from llampy.gguf.constants import GGUFValueType as VT            # noqa: E402
from llampy.llama.warmup import add_spm_vocab                   # noqa: E402

_LFM2_ATTN = (2, 5, 8, 10, 12, 14)
SHAPES = {
    "mamba2-370m": dict(arch="mamba2", n_embd=1024, n_layer=48, d_state=128, n_group=1, ssm_heads=32, d_conv=4,
                        n_vocab=50288),
    "lfm2-350m": dict(arch="lfm2", n_embd=1024, n_layer=16, n_ff=4608, n_head=16, n_head_kv=8, attn=_LFM2_ATTN,
                      l_cache=3, n_vocab=65536),
    "lfm2-1.2b": dict(arch="lfm2", n_embd=2048, n_layer=16, n_ff=8192, n_head=32, n_head_kv=8, attn=_LFM2_ATTN,
                      l_cache=3, n_vocab=65536),
    "granite-4.0-h-350m": dict(arch="granitehybrid", n_embd=768, n_layer=32, n_ff=2048, n_head=12, n_head_kv=4,
                               attn=(10, 13, 17, 27), d_state=128, n_group=1, ssm_heads=48, d_conv=4,
                               n_vocab=100352),
}


def write_model(path, shape: str, mix: str, n_layer: int | None = None) -> int:
    """Write the random model ``shape`` with the matrix types of gpu_bench's ``mix``; returns the file's size."""
    cfg = dict(SHAPES[shape])
    if n_layer is not None:
        cfg["n_layer"] = n_layer
    arch, E, L = cfg["arch"], cfg["n_embd"], cfg["n_layer"]
    types = MIXES[mix]
    rng = np.random.default_rng(0)
    cache: dict = {}
    w = GGUFWriter(path)
    w.add("general.architecture", arch)
    w.add("general.name", f"{shape}-random-{mix}")
    u32 = lambda k, v: w.add(f"{arch}.{k}", int(v), VT.UINT32)       # noqa: E731
    f32 = lambda k, v: w.add(f"{arch}.{k}", float(v), VT.FLOAT32)    # noqa: E731
    u32("context_length", 32768)
    u32("embedding_length", E)
    u32("block_count", L)
    f32("attention.layer_norm_rms_epsilon", 1e-5)
    attn = [il in cfg.get("attn", ()) for il in range(L)]
    if arch == "mamba2":
        u32("feed_forward_length", 0)
        u32("attention.head_count", 0)
    else:
        u32("feed_forward_length", cfg["n_ff"])
        u32("attention.head_count", cfg["n_head"])
        w.add(f"{arch}.attention.head_count_kv", np.array([cfg["n_head_kv"] if a else 0 for a in attn], np.uint32),
              (VT.ARRAY, VT.UINT32))
    if arch == "lfm2":
        f32("rope.freq_base", 1e6)
        u32("shortconv.l_cache", cfg["l_cache"])
    if "d_state" in cfg:
        u32("ssm.conv_kernel", cfg["d_conv"])
        u32("ssm.inner_size", 2 * E)
        u32("ssm.state_size", cfg["d_state"])
        u32("ssm.time_step_rank", cfg["ssm_heads"])
        u32("ssm.group_count", cfg["n_group"])
    if arch == "granitehybrid":
        w.add(f"{arch}.rope.scaling.finetuned", False, VT.BOOL)      # Granite 4.0-H: no positions
        f32("rope.freq_base", 10000.0)
        for k, v in (("embedding_scale", 12.0), ("residual_scale", 0.246), ("attention.scale", 0.0078125),
                     ("logit_scale", 3.0)):
            f32(k, v)
    add_spm_vocab(w, cfg["n_vocab"])

    def mat(name, key, ncols, nrows):
        t = types.get(key, types["default"])
        w.add_tensor_raw(name, t, (ncols, nrows), _rows(t, ncols, nrows, rng, cache))

    def f32t(name, arr, ne=None):
        arr = np.ascontiguousarray(arr, np.float32)
        w.add_tensor_raw(name, T.F32, ne or tuple(reversed(arr.shape)), arr.view(np.uint8))

    near1 = lambda *sh: 1 + 0.1 * rng.standard_normal(sh)            # noqa: E731
    mat("token_embd.weight", "token_embd", E, cfg["n_vocab"])
    f32t("token_embd_norm.weight" if arch == "lfm2" else "output_norm.weight", near1(E))
    for il in range(L):
        p = f"blk.{il}."
        f32t(p + "attn_norm.weight", near1(E))
        if attn[il]:
            H, KV = cfg["n_head"], cfg["n_head_kv"]
            D = E // H
            mat(p + "attn_q.weight", "attn_q", E, H * D)
            mat(p + "attn_k.weight", "attn_k", E, KV * D)
            mat(p + "attn_v.weight", "attn_v", E, KV * D)
            mat(p + "attn_output.weight", "attn_output", H * D, E)
            if arch == "lfm2":
                f32t(p + "attn_q_norm.weight", near1(D))
                f32t(p + "attn_k_norm.weight", near1(D))
        elif arch == "lfm2":
            f32t(p + "shortconv.conv.weight", rng.standard_normal((E, cfg["l_cache"])) / np.sqrt(cfg["l_cache"]))
            mat(p + "shortconv.in_proj.weight", "attn_q", E, 3 * E)
            mat(p + "shortconv.out_proj.weight", "attn_output", E, E)
        else:
            d_inner, d_state, n_group, n_head = 2 * E, cfg["d_state"], cfg["n_group"], cfg["ssm_heads"]
            conv_dim = d_inner + 2 * n_group * d_state
            mat(p + "ssm_in.weight", "attn_q", E, d_inner + conv_dim + n_head)
            f32t(p + "ssm_conv1d.weight", rng.standard_normal((conv_dim, cfg["d_conv"])) / np.sqrt(cfg["d_conv"]))
            f32t(p + "ssm_conv1d.bias", 0.1 * rng.standard_normal(conv_dim))
            dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), n_head))
            f32t(p + "ssm_dt.bias", dt + np.log(-np.expm1(-dt)))                # softplus^-1 of dt in [1e-3, 0.1]
            f32t(p + "ssm_a", -rng.uniform(1, 16, (n_head, 1)))
            f32t(p + "ssm_d", near1(n_head, 1))
            f32t(p + "ssm_norm.weight", near1(n_group, d_inner // n_group))
            mat(p + "ssm_out.weight", "attn_output", d_inner, E)
        if arch != "mamba2":
            F = cfg["n_ff"]
            f32t(p + "ffn_norm.weight", near1(E))
            mat(p + "ffn_gate.weight", "ffn_gate", E, F)
            mat(p + "ffn_up.weight", "ffn_up", E, F)
            mat(p + "ffn_down.weight", "ffn_down", F, E)
    w.write()
    return Path(path).stat().st_size


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--mix", default="Q8_0", choices=sorted(MIXES))
    ap.add_argument("--layers", type=int, default=None, help="only the first N layers")
    args = ap.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for s in args.shapes.split(","):
        if s not in SHAPES:
            print(f"recurrent_shapes: unknown shape {s!r}: one of {', '.join(SHAPES)}", file=sys.stderr)
            return 2
        tail = f"-{args.layers}l" if args.layers else ""
        path = out / f"{s}{tail}-random-{args.mix}.gguf"
        n = write_model(path, s, args.mix, args.layers)
        print(f"{path} {n / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
