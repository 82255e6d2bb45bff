"""llama (also Mistral, SmolLM, and Mixtral: llama with experts): RMSNorm, RoPE (adjacent pairs), GQA attention,
SwiGLU FFN or a mixture of experts (softmax router, the top-k weights renormalised)."""
from __future__ import annotations

import math

from ...ggml import ops
from ..hparams import InvalidMetadata
from ._common import load_embd_and_output, load_ffn, load_qkv


def load_hparams(hp, md):
    hp.rope_type = 0  # NORM
    if hp.n_rot != hp.n_embd_head_k:
        raise InvalidMetadata(f"invalid n_rot {hp.n_rot} ({hp.arch}.rope.dimension_count): llama needs n_rot == "
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
        if hp.n_expert == 0:
            load_ffn(model, ld, layer, il, bias=True)
            layer.ffn_gate_b = ld.create("ffn_gate", (hp.n_ff(il),), il, required=False, suffix="bias")
        else:
            # experts as wide as feed_forward_length (llama.cpp's llama and granite read no expert width);
            # without ffn_gate_exps each expert is SiLU(up) alone
            n_ff = hp.n_ff(il)
            layer.ffn_gate_inp = ld.create("ffn_gate_inp", (hp.n_embd, hp.n_expert), il)
            layer.ffn_gate_exps = ld.create("ffn_gate_exps", (hp.n_embd, n_ff, hp.n_expert), il, required=False)
            layer.ffn_up_exps = ld.create("ffn_up_exps", (hp.n_embd, n_ff, hp.n_expert), il)
            layer.ffn_down_exps = ld.create("ffn_down_exps", (n_ff, hp.n_embd, hp.n_expert), il)
            if hp.n_ff_shexp:        # granite MoE shared: a plain FFN beside the experts
                layer.ffn_gate_shexp = ld.create("ffn_gate_shexp", (hp.n_embd, hp.n_ff_shexp), il)
                layer.ffn_up_shexp = ld.create("ffn_up_shexp", (hp.n_embd, hp.n_ff_shexp), il)
                layer.ffn_down_shexp = ld.create("ffn_down_shexp", (hp.n_ff_shexp, hp.n_embd), il)


def build_graph(model, g, embd_scale: float = 0.0, residual_scale: float = 0.0, logit_scale: float = 0.0):
    hp = model.hparams
    kq_scale = hp.f_attention_scale or 1.0 / math.sqrt(hp.n_embd_head_v)
    inpL = g.inp_embd(model.tok_embd)
    if embd_scale:
        inpL = ops.scale(inpL, embd_scale)
    pos = g.inp_pos()
    out_ids = g.inp_out_ids()
    for il, layer in enumerate(model.layers):
        inpSA = inpL
        cur = g.cb(g.norm(inpL, layer.attn_norm, il=il), "attn_norm", il)
        q, k, v = g.qkv(layer, cur, il)
        q = g.cb(g.rope(q, pos, il, model.rope_freqs), "Qcur", il)
        k = g.cb(g.rope(k, pos, il, model.rope_freqs), "Kcur", il)
        cur = g.cb(g.attn(il, layer.wo, layer.wo_b, q, k, v, kq_scale), "attn_out", il)
        if il == hp.n_layer - 1:
            cur, inpSA = g.select_outputs(cur, inpSA, out_ids=out_ids)
        if residual_scale:
            cur = ops.scale(cur, residual_scale)
        ffn_inp = g.cb(ops.add(cur, inpSA), "ffn_inp", il)
        cur = g.cb(g.norm(ffn_inp, layer.ffn_norm, il=il), "ffn_norm", il)
        if hp.n_expert == 0:
            cur = g.ffn(cur, layer.ffn_up, layer.ffn_up_b, layer.ffn_gate, layer.ffn_gate_b,
                        layer.ffn_down, layer.ffn_down_b, "silu", il=il)
        else:
            moe = g.moe_ffn(cur, layer.ffn_gate_inp, layer.ffn_up_exps, layer.ffn_gate_exps, layer.ffn_down_exps,
                            hp.n_expert, hp.n_expert_used, True, il)
            cur = ops.add(moe, g.shexp_ffn(cur, layer, il)) if hp.n_ff_shexp else moe
        if residual_scale:
            cur = ops.scale(cur, residual_scale)
        inpL = g.cb(ops.add(cur, ffn_inp), "l_out", il)
    cur = g.norm(inpL, model.output_norm)
    logits = g.lm_head(model.output, cur)
    if logit_scale:
        logits = ops.scale(logits, 1.0 / logit_scale)
    return g.finish(cur, logits)
