"""jamba: a hybrid of Mamba-1 mixers (with RMS-normed dt, B and C) and attention without RoPE, chosen per layer by
attention.head_count_kv (0: recurrent); after each mixer a SwiGLU feed-forward, a mixture of experts on the layers
that have a router. Its memory is a KV cache for the attention layers beside the recurrent state (llama.cpp's
jamba graph)."""
from __future__ import annotations

import math

from ...ggml import ops
from ._common import load_embd_and_output, load_ffn, load_qkv
from .mamba import load_mamba_layer, load_ssm_hparams, mamba_layer


def load_hparams(hp, md):
    load_ssm_hparams(hp, md, group=False)
    hp.rope_type = -1       # LLAMA_ROPE_TYPE_NONE: its attention has no positions but the mask's
    hp.recurrent_layers = [hp.n_head_kv(il) == 0 for il in range(hp.n_layer)]


def load_tensors(model, ld):
    from ..model import ModelLoadError
    hp = model.hparams
    if 2 * hp.n_embd != hp.ssm_d_inner:
        raise ModelLoadError("only an expansion factor of 2 is supported for now")
    load_embd_and_output(model, ld)
    for il, layer in enumerate(model.layers):
        layer.attn_norm = ld.create("attn_norm", (hp.n_embd,), il)
        if hp.is_recurrent(il):
            load_mamba_layer(hp, ld, layer, il, bcdt_norms=True)
        else:
            load_qkv(model, ld, layer, il)
        layer.ffn_norm = ld.create("ffn_norm", (hp.n_embd,), il)
        layer.ffn_gate_inp = ld.create("ffn_gate_inp", (hp.n_embd, hp.n_expert), il, required=False) \
            if hp.n_expert else None
        if layer.ffn_gate_inp is not None:
            n_ff = hp.n_ff(il)
            layer.ffn_gate_exps = ld.create("ffn_gate_exps", (hp.n_embd, n_ff, hp.n_expert), il)
            layer.ffn_down_exps = ld.create("ffn_down_exps", (n_ff, hp.n_embd, hp.n_expert), il)
            layer.ffn_up_exps = ld.create("ffn_up_exps", (hp.n_embd, n_ff, hp.n_expert), il)
        else:
            load_ffn(model, ld, layer, il)


def build_graph(model, g):
    hp = model.hparams
    kq_scale = 1.0 / math.sqrt(hp.n_embd_head_v)
    inpL = g.inp_embd(model.tok_embd)
    out_ids = g.inp_out_ids()
    for il, layer in enumerate(model.layers):
        cur = g.cb(g.norm(inpL, layer.attn_norm, il=il), "attn_norm", il)
        if hp.is_recurrent(il):
            cur = mamba_layer(g, layer, cur, il)
        else:
            q, k, v = g.qkv(layer, cur, il)
            cur = g.attn(il, layer.wo, None, q, k, v, kq_scale)
        if il == hp.n_layer - 1:
            cur, inpL = g.select_outputs(cur, inpL, out_ids=out_ids)
        ffn_inp = g.cb(ops.add(inpL, cur), "ffn_inp", il)
        cur = g.cb(g.norm(ffn_inp, layer.ffn_norm, il=il), "ffn_norm", il)
        if layer.ffn_gate_inp is not None:
            cur = g.moe_ffn(cur, layer.ffn_gate_inp, layer.ffn_up_exps, layer.ffn_gate_exps, layer.ffn_down_exps,
                            hp.n_expert, hp.n_expert_used, False, il=il)
        else:
            cur = g.ffn(cur, layer.ffn_up, None, layer.ffn_gate, None, layer.ffn_down, None, "silu", il=il)
        inpL = g.cb(ops.add(ffn_inp, cur), "l_out", il)
    cur = g.norm(inpL, model.output_norm)
    return g.finish(cur, g.lm_head(model.output, cur))
