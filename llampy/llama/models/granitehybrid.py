"""granitehybrid: IBM's Granite 4.0-H, Mamba-2 mixers and attention layers chosen per layer by
attention.head_count_kv (0: recurrent), each followed by a SwiGLU feed-forward or a mixture of experts (with a
shared expert when expert_shared_feed_forward_length is set), with Granite's multipliers: embedding_scale,
residual_scale on both residual branches, attention.scale, logits divided by logit_scale. Attention uses RoPE
unless rope.scaling.finetuned is false (llama.cpp's granite-hybrid graph)."""
from __future__ import annotations

import math

from ...ggml import ops
from ..hparams import md_float, md_int
from ._common import load_embd_and_output, load_ffn, load_qkv
from .mamba import load_ssm_hparams
from .mamba2 import check_mamba2_hparams, load_mamba2_layer, mamba2_layer


def load_hparams(hp, md):
    load_ssm_hparams(hp, md, group=True)
    check_mamba2_hparams(hp)
    g = lambda k: md_float(md, f"{hp.arch}.{k}", 0.0, nonneg=True)      # noqa: E731
    hp.f_embedding_scale = g("embedding_scale")
    hp.f_residual_scale = g("residual_scale")
    hp.f_attention_scale = g("attention.scale")
    hp.f_logit_scale = g("logit_scale")
    hp.n_ff_shexp = md_int(md, f"{hp.arch}.expert_shared_feed_forward_length", 0, lo=0)
    if not md.get(f"{hp.arch}.rope.scaling.finetuned", True):
        hp.rope_type = -1       # LLAMA_ROPE_TYPE_NONE: Granite 4.0-H's attention has no positions
    hp.recurrent_layers = [hp.n_head_kv(il) == 0 for il in range(hp.n_layer)]


def load_tensors(model, ld):
    from ..model import ModelLoadError
    hp = model.hparams
    if 2 * hp.n_embd != hp.ssm_d_inner:
        raise ModelLoadError("only an expansion factor of 2 is supported for now")
    E = hp.n_embd
    load_embd_and_output(model, ld)
    for il, layer in enumerate(model.layers):
        layer.attn_norm = ld.create("attn_norm", (E,), il)
        if hp.is_recurrent(il):
            load_mamba2_layer(hp, ld, layer, il, conv_bias_required=False)
        else:
            load_qkv(model, ld, layer, il)
            layer.wo_b = ld.create("attn_output", (E,), il, required=False, suffix="bias")
        layer.ffn_norm = ld.create("ffn_norm", (E,), il)
        layer.ffn_gate_inp = None
        if hp.n_expert:
            n_ff = hp.n_ff(il)
            layer.ffn_gate_inp = ld.create("ffn_gate_inp", (E, hp.n_expert), il)
            layer.ffn_gate_exps = ld.create("ffn_gate_exps", (E, n_ff, hp.n_expert), il, required=False)
            layer.ffn_down_exps = ld.create("ffn_down_exps", (n_ff, E, hp.n_expert), il)
            layer.ffn_up_exps = ld.create("ffn_up_exps", (E, n_ff, hp.n_expert), il)
            if hp.n_ff_shexp:
                layer.ffn_gate_shexp = ld.create("ffn_gate_shexp", (E, hp.n_ff_shexp), il)
                layer.ffn_up_shexp = ld.create("ffn_up_shexp", (E, hp.n_ff_shexp), il)
                layer.ffn_down_shexp = ld.create("ffn_down_shexp", (hp.n_ff_shexp, E), il)
        else:
            load_ffn(model, ld, layer, il, bias=True)
            layer.ffn_gate_b = ld.create("ffn_gate", (hp.n_ff(il),), il, required=False, suffix="bias")


def attention(g, layer, cur, pos, il: int):
    hp = g.hp
    q, k, v = g.qkv(layer, cur, il)
    if pos is not None:
        q, k = g.rope(q, pos, il), g.rope(k, pos, il)
    kq_scale = hp.f_attention_scale or 1.0 / math.sqrt(hp.n_embd_head_v)
    return g.cb(g.attn(il, layer.wo, layer.wo_b, q, k, v, kq_scale), "attn_out", il)


def ffn(g, layer, cur, il: int):
    hp = g.hp
    if layer.ffn_gate_inp is None:
        return g.ffn(cur, layer.ffn_up, layer.ffn_up_b, layer.ffn_gate, layer.ffn_gate_b, layer.ffn_down,
                     layer.ffn_down_b, "silu", il=il)
    moe = g.moe_ffn(cur, layer.ffn_gate_inp, layer.ffn_up_exps, layer.ffn_gate_exps, layer.ffn_down_exps,
                    hp.n_expert, hp.n_expert_used, True, il=il)
    if not hp.n_ff_shexp:
        return moe
    shared = g.ffn(cur, layer.ffn_up_shexp, None, layer.ffn_gate_shexp, None, layer.ffn_down_shexp, None, "silu",
                   il=il)
    return ops.add(moe, shared)


def build_graph(model, g):
    hp = model.hparams
    res = hp.f_residual_scale
    inpL = g.inp_embd(model.tok_embd)
    if hp.f_embedding_scale:
        inpL = ops.scale(inpL, hp.f_embedding_scale)
    pos = g.inp_pos() if hp.rope_type != -1 else None
    out_ids = g.inp_out_ids()
    for il, layer in enumerate(model.layers):
        inpSA = inpL
        cur = g.cb(g.norm(inpL, layer.attn_norm, il=il), "attn_norm", il)
        cur = mamba2_layer(g, layer, cur, il) if hp.is_recurrent(il) else attention(g, layer, cur, pos, il)
        if il == hp.n_layer - 1:
            cur, inpSA = g.select_outputs(cur, inpSA, out_ids=out_ids)
        if res:
            cur = ops.scale(cur, res)
        ffn_inp = g.cb(ops.add(cur, inpSA), "ffn_inp", il)
        cur = ffn(g, layer, g.cb(g.norm(ffn_inp, layer.ffn_norm, il=il), "ffn_norm", il), il)
        if res:
            cur = ops.scale(cur, res)
        inpL = g.cb(ops.add(cur, ffn_inp), "l_out", il)
    cur = g.norm(inpL, model.output_norm)
    logits = g.lm_head(model.output, cur)
    if hp.f_logit_scale:
        logits = ops.scale(logits, 1.0 / hp.f_logit_scale)
    return g.finish(cur, logits)
