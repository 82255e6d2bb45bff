"""olmo2: no pre-norms; RMS norms after attention and after the FFN (post-norm on each branch), RMS norm of Q and K
over all heads at once (before the split into heads), NeoX RoPE, an untied output matrix. With
attention.sliding_window (OLMo 3): sliding-window layers (pattern 4, or the file's per-layer array) roped with the
global base and without the file's rope scaling (llama.cpp's graph: rope.freq_base_swa is read but only its K-shift
uses it), the others as configured."""
from __future__ import annotations

import math

from ...ggml import ops
from .. import arch as A
from ..hparams import load_swa_pattern, md_float, md_int
from ._common import load_ffn, load_qkv


def load_hparams(hp, md):
    a = hp.arch
    hp.rope_type = 2  # NEOX
    hp.n_swa = md_int(md, f"{a}.attention.sliding_window", 0, lo=0)
    if hp.n_swa:
        load_swa_pattern(hp, md, 4)
        hp.rope_freq_base_swa = md_float(md, f"{a}.rope.freq_base_swa", hp.rope_freq_base, positive=True)
        hp.rope_freq_scale_swa = 1.0


def load_tensors(model, ld):
    hp = model.hparams
    model.tok_embd = ld.create(A.TOKEN_EMBD, (hp.n_embd, hp.n_vocab))
    model.output_norm = ld.create(A.OUTPUT_NORM, (hp.n_embd,))
    model.output = ld.create(A.OUTPUT, (hp.n_embd, hp.n_vocab))
    for il, layer in enumerate(model.layers):
        load_qkv(model, ld, layer, il, bias=True)
        layer.attn_q_norm = ld.create("attn_q_norm", (hp.n_embd_head_k * hp.n_head(il),), il)
        layer.attn_k_norm = ld.create("attn_k_norm", (hp.n_embd_k_gqa(il),), il)
        layer.attn_post_norm = ld.create("attn_post_norm", (hp.n_embd,), il)
        load_ffn(model, ld, layer, il)
        layer.ffn_post_norm = ld.create("ffn_post_norm", (hp.n_embd,), il)


# cur: [n_embd, n_tokens] -> the attention's output (olmoe's too)
def attn_block(g, layer, cur, pos, il):
    hp = g.hp
    q, k, v = g.qkv(layer, cur, il)
    n_tokens = q.ne[2]
    # the norms span all heads: [head_dim, n_head, n_tokens] viewed as [head_dim * n_head, n_tokens]
    q = g.cb(g.norm(ops.reshape(q, q.ne[0] * q.ne[1], n_tokens), layer.attn_q_norm, il=il), "Qcur_normed", il)
    k = g.cb(g.norm(ops.reshape(k, k.ne[0] * k.ne[1], n_tokens), layer.attn_k_norm, il=il), "Kcur_normed", il)
    q = ops.reshape(q, hp.n_embd_head_k, hp.n_head(il), n_tokens)
    k = ops.reshape(k, hp.n_embd_head_k, hp.n_head_kv(il), n_tokens)
    if hp.is_swa(il):       # OLMo 3's window layers: plain RoPE (no scaling, no YaRN)
        def rope(x):
            return ops.rope_ext(x, pos, None, hp.n_rot, hp.rope_type, hp.n_ctx_orig_yarn, hp.rope_freq_base, 1.0,
                                0.0, 1.0, hp.yarn_beta_fast, hp.yarn_beta_slow)
        q, k = rope(q), rope(k)
    else:
        q, k = g.rope(q, pos, il), g.rope(k, pos, il)
    return g.attn(il, layer.wo, None, q, k, v, 1.0 / math.sqrt(hp.n_embd_head_k))


def build_graph(model, g):
    hp = model.hparams
    inpL = g.inp_embd(model.tok_embd)
    pos = g.inp_pos()
    out_ids = g.inp_out_ids()
    for il, layer in enumerate(model.layers):
        inpSA = inpL
        cur = attn_block(g, layer, inpL, pos, il)
        if il == hp.n_layer - 1:
            cur, inpSA = g.select_outputs(cur, inpSA, out_ids=out_ids)
        cur = g.cb(g.norm(cur, layer.attn_post_norm, il=il), "attn_post_norm", il)
        ffn_inp = g.cb(ops.add(cur, inpSA), "ffn_inp", il)
        cur = g.ffn(ffn_inp, layer.ffn_up, None, layer.ffn_gate, None, layer.ffn_down, None, "silu", il=il)
        cur = g.cb(g.norm(cur, layer.ffn_post_norm, il=il), "ffn_post_norm", il)
        inpL = g.cb(ops.add(cur, ffn_inp), "l_out", il)
    cur = g.norm(inpL, model.output_norm)
    return g.finish(cur, g.lm_head(model.output, cur))
