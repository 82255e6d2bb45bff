"""arwkv7: ARWKV-7, Qwen2-style blocks whose attention is RWKV-7's time mix (the generalised delta rule of
rwkv_wkv7, the first layer's value as a residual), the gate and the per-head group norm optional (files without
them run the time mix without). Each layer: RMS norm, time mix over the previous token's normed input (one
token-shift row per sequence), residual, RMS norm, SwiGLU feed-forward, residual (llama.cpp's arwkv7 graph)."""
from __future__ import annotations

from .. import arch as A
from ..hparams import Meta
from .mamba import _positive
from .rwkv6 import load_wkv_hparams
from .rwkv6qwen2 import build_blocks
from .rwkv7 import time_mix


def load_hparams(hp, md):
    load_wkv_hparams(hp, md, shift_rows=1)
    m = Meta(md, hp.arch)
    hp.n_lora_decay = _positive(m, "attention.decay_lora_rank")
    hp.n_lora_iclr = _positive(m, "attention.iclr_lora_rank")
    hp.n_lora_value_res_mix = _positive(m, "attention.value_residual_mix_lora_rank")
    hp.n_lora_gate = int(m.get("attention.gate_lora_rank", 0) or 0)


def load_tensors(model, ld):
    hp = model.hparams
    E, F = hp.n_embd, hp.n_ff()
    model.tok_embd = ld.create(A.TOKEN_EMBD, (E, hp.n_vocab))
    model.output_norm = ld.create(A.OUTPUT_NORM, (E,))
    model.output = ld.create(A.OUTPUT, (E, hp.n_vocab))
    for il, layer in enumerate(model.layers):
        c = lambda name, ne, **kw: ld.create(name, ne, il, **kw)         # noqa: E731
        layer.attn_norm = c("attn_norm", (E,))
        v_rank = hp.n_lora_iclr if il == 0 else hp.n_lora_value_res_mix     # layer 0's value gate is unused
        for x, rank in (("w", hp.n_lora_decay), ("a", hp.n_lora_iclr), ("v", v_rank)):
            setattr(layer, f"time_mix_{x}0", c(f"time_mix_{x}0", (E,)))
            setattr(layer, f"time_mix_{x}1", c(f"time_mix_{x}1", (E, rank)))
            setattr(layer, f"time_mix_{x}2", c(f"time_mix_{x}2", (rank, E)))
        layer.time_mix_g1 = c("time_mix_g1", (E, hp.n_lora_gate), required=False) if hp.n_lora_gate else None
        layer.time_mix_g2 = c("time_mix_g2", (hp.n_lora_gate, E), required=False) if hp.n_lora_gate else None
        gated = layer.time_mix_g1 is not None and layer.time_mix_g2 is not None
        layer.time_mix_lerp_fused = c("time_mix_lerp_fused", (E, 1, 1, 6 if gated else 5))
        for name in ("time_mix_k_k", "time_mix_k_a", "time_mix_r_k"):
            setattr(layer, name, c(name, (E,)))
        for name in ("time_mix_key", "time_mix_value", "time_mix_receptance", "time_mix_output"):
            setattr(layer, name, c(name, (E, E)))
        layer.time_mix_ln = c("time_mix_ln", (E,), required=False)
        layer.time_mix_ln_b = c("time_mix_ln", (E,), required=False, suffix="bias")
        layer.ffn_norm = c("ffn_norm", (E,))
        layer.ffn_gate = c("ffn_gate", (E, F))
        layer.ffn_up = c("ffn_up", (E, F))
        layer.ffn_down = c("ffn_down", (F, E))


def build_graph(model, g):
    return build_blocks(model, g, time_mix)
