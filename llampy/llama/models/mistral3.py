"""mistral3 (Ministral 3, Mistral Small 3.x text model): the llama block with optional biases on the output
projection and the FFN, optional rope frequency factors, and llama 4's attention temperature: Q scaled per position
by log(floor(pos / n_ctx_orig) + 1) * attention.temperature_scale + 1 when that key is given."""
from __future__ import annotations

import math

from ...ggml import ops
from ._common import load_embd_and_output, load_ffn, load_qkv


def load_hparams(hp, md):
    a = hp.arch
    hp.rope_type = 0  # NORM
    hp.f_attn_temp_scale = float(md.get(f"{a}.attention.temperature_scale", 0.0))
    hp.yarn_beta_fast = float(md.get(f"{a}.rope.scaling.yarn_beta_fast", hp.yarn_beta_fast))
    hp.yarn_beta_slow = float(md.get(f"{a}.rope.scaling.yarn_beta_slow", hp.yarn_beta_slow))
    if hp.f_attn_temp_scale and hp.n_ctx_orig_yarn == 0:
        raise ValueError(f"{a}: attention temperature scaling needs rope.scaling.original_context_length > 0")
    if hp.n_rot != hp.n_embd_head_k:
        raise ValueError(f"invalid n_rot {hp.n_rot} ({a}.rope.dimension_count): mistral3 needs n_rot == "
                              f"head size {hp.n_embd_head_k}")


def load_tensors(model, ld):
    hp = model.hparams
    load_embd_and_output(model, ld)
    model.rope_freqs = ld.create("rope_freqs", (hp.n_rot // 2,), required=False)
    for il, layer in enumerate(model.layers):
        layer.attn_norm = ld.create("attn_norm", (hp.n_embd,), il)
        load_qkv(model, ld, layer, il, bias=True)
        layer.wo_b = ld.create("attn_output", (hp.n_embd,), il, required=False, suffix="bias")
        layer.ffn_norm = ld.create("ffn_norm", (hp.n_embd,), il)
        load_ffn(model, ld, layer, il, bias=True)
        layer.ffn_gate_b = ld.create("ffn_gate", (hp.n_ff(il),), il, required=False, suffix="bias")


def build_graph(model, g):
    hp = model.hparams
    kq_scale = hp.f_attention_scale or 1.0 / math.sqrt(hp.n_embd_head_v)
    inpL = g.inp_embd(model.tok_embd)
    pos = g.inp_pos()
    attn_scale = g.inp_attn_scale(hp.f_attn_temp_scale, hp.n_ctx_orig_yarn) if hp.f_attn_temp_scale else None
    out_ids = g.inp_out_ids()
    for il, layer in enumerate(model.layers):
        inpSA = inpL
        cur = g.cb(g.norm(inpL, layer.attn_norm, il=il), "attn_norm", il)
        q, k, v = g.qkv(layer, cur, il)
        q = g.rope(q, pos, il, model.rope_freqs)
        k = g.rope(k, pos, il, model.rope_freqs)
        if attn_scale is not None:
            q = ops.mul(q, attn_scale)
        cur = g.cb(g.attn(il, layer.wo, layer.wo_b, q, k, v, kq_scale), "attn_out", il)
        if il == hp.n_layer - 1:
            cur, inpSA = g.select_outputs(cur, inpSA, out_ids=out_ids)
        ffn_inp = g.cb(ops.add(cur, inpSA), "ffn_inp", il)
        cur = g.cb(g.norm(ffn_inp, layer.ffn_norm, il=il), "ffn_norm", il)
        cur = g.ffn(cur, layer.ffn_up, layer.ffn_up_b, layer.ffn_gate, layer.ffn_gate_b, layer.ffn_down,
                    layer.ffn_down_b, "silu", il=il)
        inpL = g.cb(ops.add(cur, ffn_inp), "l_out", il)
    cur = g.norm(inpL, model.output_norm)
    return g.finish(cur, g.lm_head(model.output, cur))
