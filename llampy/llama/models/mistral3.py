"""mistral3 (Ministral 3, Mistral Small 3.x text model): the llama block with optional biases on the output
projection and the FFN, optional rope frequency factors, and llama 4's attention temperature: Q scaled per position
by log(floor(pos / n_ctx_orig) + 1) * attention.temperature_scale + 1 when that key is given. YaRN's attention
factor takes rope.scaling.yarn_log_multiplier (the converter's mscale_all_dim) when the file has one. With
expert_count set, each FFN is a mixture of experts (softmax router, the chosen weights renormalised)."""
from __future__ import annotations

import math

from ...ggml import ops
from ..hparams import md_float, yarn_attn_factor
from ._common import load_embd_and_output, load_ffn, load_qkv


def load_hparams(hp, md):
    a = hp.arch
    hp.rope_type = 0  # NORM
    hp.f_attn_temp_scale = float(md.get(f"{a}.attention.temperature_scale", 0.0))
    hp.yarn_beta_fast = float(md.get(f"{a}.rope.scaling.yarn_beta_fast", hp.yarn_beta_fast))
    hp.yarn_beta_slow = float(md.get(f"{a}.rope.scaling.yarn_beta_slow", hp.yarn_beta_slow))
    log_mul = md_float(md, f"{a}.rope.scaling.yarn_log_multiplier", 0.0)
    if hp.yarn_ext_factor and log_mul:
        hp.yarn_attn_factor = yarn_attn_factor(hp.rope_freq_scale, hp.rope_attn_factor, log_mul)
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
        if hp.n_expert:      # experts as wide as feed_forward_length, ffn_gate_exps optional (as llama.cpp)
            n_ff = hp.n_ff(il)
            layer.ffn_gate_inp = ld.create("ffn_gate_inp", (hp.n_embd, hp.n_expert), il)
            layer.ffn_gate_exps = ld.create("ffn_gate_exps", (hp.n_embd, n_ff, hp.n_expert), il, required=False)
            layer.ffn_up_exps = ld.create("ffn_up_exps", (hp.n_embd, n_ff, hp.n_expert), il)
            layer.ffn_down_exps = ld.create("ffn_down_exps", (n_ff, hp.n_embd, hp.n_expert), il)
            continue
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
        if hp.n_expert:
            cur = g.moe_ffn(cur, layer.ffn_gate_inp, layer.ffn_up_exps, layer.ffn_gate_exps, layer.ffn_down_exps,
                            hp.n_expert, hp.n_expert_used, True, il)
        else:
            cur = g.ffn(cur, layer.ffn_up, layer.ffn_up_b, layer.ffn_gate, layer.ffn_gate_b, layer.ffn_down,
                        layer.ffn_down_b, "silu", il=il)
        inpL = g.cb(ops.add(cur, ffn_inp), "l_out", il)
    cur = g.norm(inpL, model.output_norm)
    return g.finish(cur, g.lm_head(model.output, cur))
