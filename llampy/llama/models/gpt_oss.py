"""gpt-oss (llama.cpp's openai-moe): pre-norm blocks whose attention alternates sliding-window and full layers
(sliding first), NeoX RoPE, q/k/v/o biases and a learned sink logit per head in each softmax; the FFN a mixture of
experts whose router (with a bias) chooses on raw logits and weighs the chosen by a softmax over them, each expert
with biases and the clamped SwiGLU of gpt-oss (swiglu_oai: alpha 1.702, limit 7)."""
from __future__ import annotations

import math

from ...ggml import ops
from .. import arch as A
from ..hparams import MissingMetadata, load_swa_pattern, md_float, md_int
from ._common import load_qkv


def load_hparams(hp, md):
    a = hp.arch
    hp.rope_type = 2  # NEOX
    if not hp.n_expert:
        raise MissingMetadata(f"{a} needs {a}.expert_count and {a}.expert_used_count")
    if not hp.n_ff_exp:
        raise MissingMetadata(f"missing metadata key '{a}.expert_feed_forward_length'")
    if f"{a}.attention.sliding_window" not in md:
        raise MissingMetadata(f"missing metadata key '{a}.attention.sliding_window'")
    hp.n_swa = md_int(md, f"{a}.attention.sliding_window", lo=0)
    load_swa_pattern(hp, md, 2)
    # the sliding layers rope as the others unless the file says otherwise
    hp.rope_freq_base_swa = md_float(md, f"{a}.rope.freq_base_swa", hp.rope_freq_base, positive=True)
    hp.rope_freq_scale_swa = hp.rope_freq_scale


def load_tensors(model, ld):
    hp = model.hparams
    n_ff, n_exp = hp.n_ff_exp, hp.n_expert
    model.tok_embd = ld.create(A.TOKEN_EMBD, (hp.n_embd, hp.n_vocab))
    model.output_norm = ld.create(A.OUTPUT_NORM, (hp.n_embd,))
    model.output = ld.create(A.OUTPUT, (hp.n_embd, hp.n_vocab))
    for il, layer in enumerate(model.layers):
        layer.attn_norm = ld.create("attn_norm", (hp.n_embd,), il)
        layer.attn_post_norm = ld.create("attn_post_norm", (hp.n_embd,), il)
        load_qkv(model, ld, layer, il, bias=True)
        layer.wo_b = ld.create("attn_output", (hp.n_embd,), il, suffix="bias")
        layer.attn_sinks = ld.create("attn_sinks", (hp.n_head(il),), il)
        layer.ffn_gate_inp = ld.create("ffn_gate_inp", (hp.n_embd, n_exp), il)
        layer.ffn_gate_inp_b = ld.create("ffn_gate_inp", (n_exp,), il, suffix="bias")
        layer.ffn_gate_exps = ld.create("ffn_gate_exps", (hp.n_embd, n_ff, n_exp), il)
        layer.ffn_up_exps = ld.create("ffn_up_exps", (hp.n_embd, n_ff, n_exp), il)
        layer.ffn_down_exps = ld.create("ffn_down_exps", (n_ff, hp.n_embd, n_exp), il)
        layer.ffn_gate_exps_b = ld.create("ffn_gate_exps", (n_ff, n_exp), il, suffix="bias")
        layer.ffn_up_exps_b = ld.create("ffn_up_exps", (n_ff, n_exp), il, suffix="bias")
        layer.ffn_down_exps_b = ld.create("ffn_down_exps", (hp.n_embd, n_exp), il, suffix="bias")


def build_graph(model, g):
    hp = model.hparams
    kq_scale = 1.0 / math.sqrt(hp.n_rot)
    inpL = g.inp_embd(model.tok_embd)
    pos = g.inp_pos()
    out_ids = g.inp_out_ids()
    for il, layer in enumerate(model.layers):
        inpSA = inpL
        cur = g.cb(g.norm(inpL, layer.attn_norm, il=il), "attn_norm", il)
        q, k, v = g.qkv(layer, cur, il)
        q = g.cb(g.rope(q, pos, il), "Qcur", il)
        k = g.cb(g.rope(k, pos, il), "Kcur", il)
        cur = g.cb(g.attn(il, layer.wo, layer.wo_b, q, k, v, kq_scale, sinks=layer.attn_sinks), "attn_out", il)
        if il == hp.n_layer - 1:
            cur, inpSA = g.select_outputs(cur, inpSA, out_ids=out_ids)
        ffn_inp = g.cb(ops.add(cur, inpSA), "ffn_inp", il)
        cur = g.cb(g.norm(ffn_inp, layer.attn_post_norm, il=il), "attn_post_norm", il)
        cur = g.moe_ffn(cur, layer.ffn_gate_inp, layer.ffn_up_exps, layer.ffn_gate_exps, layer.ffn_down_exps,
                        hp.n_expert, hp.n_expert_used, False, il, gating="softmax_weight",
                        gate_inp_b=layer.ffn_gate_inp_b, up_b=layer.ffn_up_exps_b, gate_b=layer.ffn_gate_exps_b,
                        down_b=layer.ffn_down_exps_b, act="swiglu_oai")
        inpL = g.cb(ops.add(cur, ffn_inp), "l_out", il)
    cur = g.norm(inpL, model.output_norm)
    return g.finish(cur, g.lm_head(model.output, cur))
