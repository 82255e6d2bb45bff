"""olmo2: no pre-norms; RMS norms after attention and after the FFN (post-norm on each branch), RMS norm of Q and K
over all heads at once (before the split into heads), NeoX RoPE, an untied output matrix."""
from __future__ import annotations

import math

from ...ggml import ops
from .. import arch as A
from ._common import load_ffn, load_qkv


def load_hparams(hp, md):
    hp.rope_type = 2  # NEOX
    if int(md.get(f"{hp.arch}.attention.sliding_window", 0)):
        raise ValueError(f"{hp.arch}.attention.sliding_window: olmo2 with sliding-window layers (OLMo 3) is "
                              f"not supported")


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
