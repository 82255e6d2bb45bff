"""bert and nomic-bert: encoders. Token (+ token-type + learned position) embeddings and a LayerNorm; each layer
attends over the whole micro-batch without a cache (non-causal), then LayerNorm after the attention and after the
FFN (post-norm). bert: biased GELU MLP; nomic-bert: RoPE (NeoX) instead of position embeddings, SwiGLU FFN.
With pooling 'rank', the classification head (``cls`` dense + tanh, ``cls.output``) scores each sequence."""
from __future__ import annotations

import math

from ...ggml import ops
from ._common import load_qkv

USES_KV_CACHE = False
RANK_HEAD = True

# llama.cpp's enum llama_pooling_type
POOLING_TYPES = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}


def load_hparams(hp, md):
    a = hp.arch
    hp.rope_type = 2  # NEOX (nomic-bert; bert has no RoPE)
    hp.causal_attn = bool(md.get(f"{a}.attention.causal", True))
    hp.pooling_type = POOLING_TYPES.get(int(md.get(f"{a}.pooling_type", -1)))
    labels = md.get(f"{a}.classifier.output_labels")
    hp.n_cls_out = len(labels) if labels is not None and len(labels) else 1
    hp.n_token_types = int(md.get("tokenizer.ggml.token_type_count", 0))
    if hp.n_token_types <= 0:
        raise ValueError(f"{a} model needs to define token type count (tokenizer.ggml.token_type_count)")


def load_tensors(model, ld):
    hp = model.hparams
    nomic = hp.arch == "nomic-bert"
    model.tok_embd = ld.create("token_embd", (hp.n_embd, hp.n_vocab))
    model.type_embd = ld.create("token_types", (hp.n_embd, hp.n_token_types), required=False)
    model.pos_embd = None if nomic else ld.create("position_embd", (hp.n_embd, hp.n_ctx_train))
    model.cls = ld.create("cls", (hp.n_embd, hp.n_embd), required=False)
    model.cls_b = ld.create("cls", (hp.n_embd,), required=False, suffix="bias")
    model.cls_out = ld.create("cls.output", (hp.n_embd, hp.n_cls_out), required=False)
    model.cls_out_b = ld.create("cls.output", (hp.n_cls_out,), required=False, suffix="bias")
    model.tok_norm = ld.create("token_embd_norm", (hp.n_embd,))
    model.tok_norm_b = ld.create("token_embd_norm", (hp.n_embd,), suffix="bias")
    for il, layer in enumerate(model.layers):
        load_qkv(model, ld, layer, il, bias=True)
        layer.wo_b = ld.create("attn_output", (hp.n_embd,), il, required=False, suffix="bias")
        layer.attn_out_norm = ld.create("attn_out_norm", (hp.n_embd,), il)
        layer.attn_out_norm_b = ld.create("attn_out_norm", (hp.n_embd,), il, suffix="bias")
        layer.ffn_up = ld.create("ffn_up", (hp.n_embd, hp.n_ff(il)), il)
        layer.ffn_up_b = ld.create("ffn_up", (hp.n_ff(il),), il, required=False, suffix="bias")
        layer.ffn_down = ld.create("ffn_down", (hp.n_ff(il), hp.n_embd), il)
        layer.ffn_down_b = ld.create("ffn_down", (hp.n_embd,), il, required=False, suffix="bias")
        layer.ffn_gate = ld.create("ffn_gate", (hp.n_embd, hp.n_ff(il)), il) if nomic else None
        layer.layer_out_norm = ld.create("layer_out_norm", (hp.n_embd,), il)
        layer.layer_out_norm_b = ld.create("layer_out_norm", (hp.n_embd,), il, suffix="bias")


def build_graph(model, g):
    hp = model.hparams
    nomic = hp.arch == "nomic-bert"
    pos = g.inp_pos()
    inpL = g.inp_embd(model.tok_embd)
    if model.type_embd is not None:          # token types are all 0 ("sentence A"), as in llama.cpp
        inpL = ops.add(inpL, ops.view_1d(model.type_embd, hp.n_embd, 0))
    if model.pos_embd is not None:
        inpL = ops.add(ops.get_rows(model.pos_embd, pos), inpL)
    inpL = g.cb(g.norm(inpL, model.tok_norm, model.tok_norm_b, kind="layer"), "inp_norm", 0)
    out_ids = g.inp_out_ids()
    kq_scale = 1.0 / math.sqrt(hp.n_embd_head_k)
    for il, layer in enumerate(model.layers):
        q, k, v = g.qkv(layer, inpL, il)
        if nomic:
            q, k = g.rope(q, pos, il), g.rope(k, pos, il)
        cur = g.attn_no_cache(il, layer.wo, layer.wo_b, q, k, v, kq_scale, causal=hp.causal_attn)
        if il == hp.n_layer - 1:
            cur, inpL = g.select_outputs(cur, inpL, out_ids=out_ids)
        cur = ops.add(cur, inpL)
        ffn_inp = g.cb(g.norm(cur, layer.attn_out_norm, layer.attn_out_norm_b, kind="layer", il=il), "ffn_inp", il)
        if nomic:
            cur = g.ffn(ffn_inp, layer.ffn_up, None, layer.ffn_gate, None, layer.ffn_down, None, "silu", il=il)
        else:
            cur = g.ffn(ffn_inp, layer.ffn_up, layer.ffn_up_b, None, None, layer.ffn_down, layer.ffn_down_b,
                        "gelu", il=il)
        cur = ops.add(cur, ffn_inp)
        inpL = g.cb(g.norm(cur, layer.layer_out_norm, layer.layer_out_norm_b, kind="layer", il=il), "l_out", il)
    cur = inpL
    if g.pooling == "rank":
        cur = rank_head(model, cur)
    return g.finish(cur, None)


# [n_embd, n_tokens] -> [n_cls_out, n_tokens]: llama.cpp's classification head (build_pooling, RANK), applied to every
# row; the context keeps the first token's row of each sequence, the row llama.cpp selects before applying it
def rank_head(model, cur):
    if model.cls is None and model.cls_out is None:
        raise ValueError(f"pooling 'rank': this {model.hparams.arch} model has no classification head "
                         f"(cls, cls.output)")
    if model.cls is not None:
        cur = ops.mul_mat(model.cls, cur)
        if model.cls_b is not None:
            cur = ops.add(cur, model.cls_b)
        cur = ops.tanh(cur)
    if model.cls_out is not None:
        cur = ops.mul_mat(model.cls_out, cur)
        if model.cls_out_b is not None:
            cur = ops.add(cur, model.cls_out_b)
    return cur
