"""lfm2: Liquid's LFM2, a hybrid of gated short convolutions and attention, chosen per layer by
attention.head_count_kv (0: a convolution layer). Every layer: RMS norm, the operator (convolution or attention),
residual, RMS norm, SwiGLU feed-forward, residual. The short convolution: an in-projection to B, C and x, the
product B * x convolved over the sequence's last shortconv.l_cache inputs (the rolling row it keeps in the
recurrent memory), gated by C, then the out-projection. Attention has RMS-normed Q and K and NeoX RoPE. The final
norm is the file's token_embd_norm (llama.cpp's lfm2 graph)."""
from __future__ import annotations

import math

from ...ggml import ops
from ..hparams import Meta, MissingMetadata
from ._common import load_ffn, load_qkv
from .. import arch as A
from .mamba import _positive


def load_hparams(hp, md):
    m = Meta(md, hp.arch)
    hp.n_shortconv_l_cache = _positive(m, "shortconv.l_cache")
    if hp.n_shortconv_l_cache < 2:
        raise ValueError(f"shortconv.l_cache is {hp.n_shortconv_l_cache}; the convolution needs at least 2")
    if not m.has("attention.layer_norm_rms_epsilon"):
        raise MissingMetadata(f"missing metadata key {m.key('attention.layer_norm_rms_epsilon')!r}")
    hp.rope_type = 2        # NEOX
    hp.recurrent_layers = [hp.n_head_kv(il) == 0 for il in range(hp.n_layer)]
    n_swa = int(m.get("attention.sliding_window", 0) or 0)
    if n_swa > 0:           # a window on every attention layer
        hp.n_swa = n_swa
        hp.swa_layers = [not r for r in hp.recurrent_layers]


def load_tensors(model, ld):
    hp = model.hparams
    E = hp.n_embd
    model.tok_embd = ld.create(A.TOKEN_EMBD, (E, hp.n_vocab))
    model.output_norm = ld.create("token_embd_norm", (E,))          # the name llama.cpp's converter gives it
    model.output = ld.create(A.OUTPUT, (E, hp.n_vocab), required=False) or ld.tied(A.TOKEN_EMBD)
    for il, layer in enumerate(model.layers):
        layer.attn_norm = ld.create("attn_norm", (E,), il)
        layer.ffn_norm = ld.create("ffn_norm", (E,), il)
        load_ffn(model, ld, layer, il)
        if hp.is_recurrent(il):
            layer.shortconv_conv = ld.create("shortconv_conv", (hp.n_shortconv_l_cache, E), il)
            layer.shortconv_in_proj = ld.create("shortconv_in_proj", (E, 3 * E), il)
            layer.shortconv_out_proj = ld.create("shortconv_out_proj", (E, E), il)
        else:
            if hp.n_embd_k_gqa(il) != hp.n_embd_v_gqa(il):
                raise ValueError(f"layer {il}: keys of {hp.n_embd_k_gqa(il)} and values of {hp.n_embd_v_gqa(il)}; "
                                 f"lfm2 needs them equal")
            layer.attn_q_norm = ld.create("attn_q_norm", (hp.n_embd_head_k,), il)
            layer.attn_k_norm = ld.create("attn_k_norm", (hp.n_embd_head_k,), il)
            load_qkv(model, ld, layer, il)


def shortconv(g, layer, cur, il: int):
    hp = g.hp
    E, n_seqs = hp.n_embd, g.n_seqs
    n_seq_tokens = g.n_tokens // n_seqs
    d_conv = hp.n_shortconv_l_cache - 1
    bcx = g.mm(layer.shortconv_in_proj, ops.reshape(cur, E, n_seq_tokens, n_seqs))     # [3 E, n_seq_tokens, n_seqs]
    part = lambda i: ops.view_3d(bcx, E, n_seq_tokens, n_seqs, bcx.nb[1], bcx.nb[2], i * E * 4)
    b, c, x = part(0), part(1), part(2)
    bx = ops.transpose(ops.mul(b, x))                                              # [n_seq_tokens, E, n_seqs]
    conv = ops.reshape(g.rs_get_r(il), d_conv, E, n_seqs)
    bx = ops.concat(conv, bx, 0)                                                   # [d_conv + n_seq_tokens, E, n_seqs]
    last = ops.view_3d(bx, d_conv, E, n_seqs, bx.nb[1], bx.nb[2], n_seq_tokens * 4)
    g.rs_store_r(il, ops.cont(last, hp.n_embd_r(), n_seqs))
    y = ops.mul(c, g.cb(ops.ssm_conv(bx, layer.shortconv_conv), "shortconv", il))
    return g.mm(layer.shortconv_out_proj, ops.reshape(y, E, g.n_tokens))


def attn(g, layer, cur, pos, il: int):
    hp = g.hp
    q, k, v = g.qkv(layer, cur, il)
    q = g.rope(g.norm(q, layer.attn_q_norm, il=il), pos, il)
    k = g.rope(g.norm(k, layer.attn_k_norm, il=il), pos, il)
    return g.attn(il, layer.wo, None, q, k, v, 1.0 / math.sqrt(hp.n_embd_head_v))


def build_graph(model, g):
    hp = model.hparams
    cur = g.inp_embd(model.tok_embd)
    pos = g.inp_pos()
    out_ids = g.inp_out_ids()
    for il, layer in enumerate(model.layers):
        prev = cur
        cur = g.cb(g.norm(cur, layer.attn_norm, il=il), "operator_norm", il)
        cur = shortconv(g, layer, cur, il) if hp.is_recurrent(il) else attn(g, layer, cur, pos, il)
        if il == hp.n_layer - 1:
            cur, prev = g.select_outputs(cur, prev, out_ids=out_ids)
        cur = ops.add(prev, cur)
        ffn = g.ffn(g.cb(g.norm(cur, layer.ffn_norm, il=il), "ffn_norm", il), layer.ffn_up, None, layer.ffn_gate,
                    None, layer.ffn_down, None, "silu", il=il)
        cur = g.cb(ops.add(cur, ffn), "l_out", il)
    cur = g.norm(cur, model.output_norm)
    return g.finish(cur, g.lm_head(model.output, cur))
