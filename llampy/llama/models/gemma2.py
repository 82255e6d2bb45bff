"""gemma2: embeddings scaled by sqrt(n_embd), post-attention and post-FFN norms, GELU FFN, sliding-window attention
on every other layer, attention and final logit soft-caps."""
from __future__ import annotations

import math

from ...ggml import ops
from ..hparams import md_float, md_int
from ._common import load_embd_and_output, load_ffn, load_qkv


def load_hparams(hp, md):
    a = hp.arch
    hp.rope_type = 2  # NEOX
    hp.n_swa = md_int(md, f"{a}.attention.sliding_window", 4096, lo=0)
    hp.set_swa_pattern(md_int(md, f"{a}.attention.sliding_window_pattern", 2, lo=0))
    hp.rope_freq_base_swa = md_float(md, f"{a}.rope.freq_base_swa", hp.rope_freq_base, positive=True)
    hp.rope_freq_scale_swa = hp.rope_freq_scale
    hp.attn_soft_cap = md_float(md, f"{a}.attn_logit_softcapping", 50.0, nonneg=True)
    hp.final_logit_softcap = md_float(md, f"{a}.final_logit_softcapping", 30.0, nonneg=True)
    hp.f_attention_scale = 1.0 / math.sqrt(hp.n_embd_head_k)


def load_tensors(model, ld, qk_norm: bool = False):
    hp = model.hparams
    load_embd_and_output(model, ld)
    for il, layer in enumerate(model.layers):
        layer.attn_norm = ld.create("attn_norm", (hp.n_embd,), il)
        load_qkv(model, ld, layer, il)
        layer.attn_post_norm = ld.create("attn_post_norm", (hp.n_embd,), il)
        if qk_norm:
            layer.attn_q_norm = ld.create("attn_q_norm", (hp.n_embd_head_k,), il)
            layer.attn_k_norm = ld.create("attn_k_norm", (hp.n_embd_head_k,), il)
        layer.ffn_norm = ld.create("ffn_norm", (hp.n_embd,), il)
        load_ffn(model, ld, layer, il)
        layer.ffn_post_norm = ld.create("ffn_post_norm", (hp.n_embd,), il)


def build_graph(model, g, qk_norm: bool = False):
    hp = model.hparams
    # gemma3 scales token embeddings only: an image's embeddings enter as they are (llama.cpp's gemma3.cpp)
    scale = 1.0 if qk_norm and g.embd_input else math.sqrt(hp.n_embd)
    inpL = g.cb(ops.scale(g.inp_embd(model.tok_embd), scale), "inp_scaled")
    pos = g.inp_pos()
    out_ids = g.inp_out_ids()
    for il, layer in enumerate(model.layers):
        cur = g.cb(g.norm(inpL, layer.attn_norm, il=il), "attn_norm", il)
        q, k, v = g.qkv(layer, cur, il)
        if qk_norm:
            q = g.cb(g.norm(q, layer.attn_q_norm, il=il), "Qcur_normed", il)
            k = g.cb(g.norm(k, layer.attn_k_norm, il=il), "Kcur_normed", il)
        q = g.cb(g.rope(q, pos, il), "Qcur", il)
        k = g.cb(g.rope(k, pos, il), "Kcur", il)
        q = ops.scale(q, hp.f_attention_scale)
        cur = g.attn(il, layer.wo, None, q, k, v, 1.0, softcap=hp.attn_soft_cap)
        if il == hp.n_layer - 1:
            cur, inpL = g.select_outputs(cur, inpL, out_ids=out_ids)
        cur = g.cb(g.norm(cur, layer.attn_post_norm, il=il), "attn_post_norm", il)
        sa_out = g.cb(ops.add(cur, inpL), "sa_out", il)
        cur = g.cb(g.norm(sa_out, layer.ffn_norm, il=il), "ffn_norm", il)
        cur = g.cb(g.ffn(cur, layer.ffn_up, None, layer.ffn_gate, None, layer.ffn_down, None, "gelu", il=il),
                   "ffn_out", il)
        cur = g.cb(g.norm(cur, layer.ffn_post_norm, il=il), "ffn_post_norm", il)
        inpL = g.cb(ops.add(cur, sa_out), "l_out", il)
    cur = g.norm(inpL, model.output_norm)
    logits = g.lm_head(model.output, cur)
    if hp.final_logit_softcap:
        c = hp.final_logit_softcap
        logits = ops.scale(ops.tanh(ops.scale(logits, 1.0 / c)), c)
    return g.finish(cur, logits)
