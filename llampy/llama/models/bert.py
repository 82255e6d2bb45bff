"""bert, nomic-bert and jina-bert-v2: encoders. Token (+ token-type + learned position) embeddings and a LayerNorm;
each layer attends over the whole micro-batch without a cache (non-causal), then LayerNorm after the attention and
after the FFN (post-norm). bert: biased GELU MLP; nomic-bert: RoPE (NeoX) instead of position embeddings, SwiGLU
FFN; jina-bert-v2: ALiBi (max bias 8) instead of positions, optional LayerNorms of Q and K and a second attention
norm, GEGLU (gate and up fused in ffn_up, or a separate ffn_gate) or GELU MLP with biases.
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
    hp.f_max_alibi_bias = 8.0 if a == "jina-bert-v2" else 0.0
    hp.causal_attn = bool(md.get(f"{a}.attention.causal", True))
    hp.pooling_type = POOLING_TYPES.get(int(md.get(f"{a}.pooling_type", -1)))
    labels = md.get(f"{a}.classifier.output_labels")
    hp.n_cls_out = len(labels) if labels is not None and len(labels) else 1
    hp.n_token_types = int(md.get("tokenizer.ggml.token_type_count", 0))
    if hp.n_token_types <= 0:
        raise ValueError(f"{a} model needs to define token type count (tokenizer.ggml.token_type_count)")


def load_tensors(model, ld):
    hp = model.hparams
    nomic, jina = hp.arch == "nomic-bert", hp.arch == "jina-bert-v2"
    model.tok_embd = ld.create("token_embd", (hp.n_embd, hp.n_vocab))
    model.type_embd = ld.create("token_types", (hp.n_embd, hp.n_token_types), required=jina)
    model.pos_embd = ld.create("position_embd", (hp.n_embd, hp.n_ctx_train)) if hp.arch == "bert" else None
    n_cls = 1 if jina else hp.n_embd     # jina's reranker head is one row (then tanh) and no cls.output
    model.cls = ld.create("cls", (hp.n_embd, n_cls), required=False)
    model.cls_b = ld.create("cls", (n_cls,), required=False, suffix="bias")
    model.cls_out = None if jina else ld.create("cls.output", (hp.n_embd, hp.n_cls_out), required=False)
    model.cls_out_b = None if jina else ld.create("cls.output", (hp.n_cls_out,), required=False, suffix="bias")
    model.tok_norm = ld.create("token_embd_norm", (hp.n_embd,))
    model.tok_norm_b = ld.create("token_embd_norm", (hp.n_embd,), suffix="bias")
    for il, layer in enumerate(model.layers):
        load_qkv(model, ld, layer, il, bias=True)
        for n in ("attn_q_norm", "attn_k_norm", "attn_norm_2"):      # jina-bert-v2's, each optional
            w = ld.create(n, (hp.n_embd,), il, required=False) if jina else None
            setattr(layer, n, w)
            setattr(layer, n + "_b", ld.create(n, (hp.n_embd,), il, required=False, suffix="bias") if w else None)
        layer.wo_b = ld.create("attn_output", (hp.n_embd,), il, required=jina, suffix="bias")
        layer.attn_out_norm = ld.create("attn_out_norm", (hp.n_embd,), il)
        layer.attn_out_norm_b = ld.create("attn_out_norm", (hp.n_embd,), il, suffix="bias")
        n_ff = hp.n_ff(il)
        layer.ffn_gate = ld.create("ffn_gate", (hp.n_embd, n_ff), il, required=nomic) if nomic or jina else None
        # jina-bert-v2 may fuse the gate into ffn_up (2 * n_ff rows, GEGLU)
        n_up = n_ff
        if jina and layer.ffn_gate is None and ld.model.reader.tensors.get(f"blk.{il}.ffn_up.weight") is not None:
            n_up = int(ld.model.reader.tensors[f"blk.{il}.ffn_up.weight"].ne[1])
            if n_up not in (n_ff, 2 * n_ff):
                raise ValueError(f"blk.{il}.ffn_up.weight has {n_up} rows; jina-bert-v2 needs {n_ff} or {2 * n_ff}")
        layer.ffn_up = ld.create("ffn_up", (hp.n_embd, n_up), il)
        layer.ffn_up_b = ld.create("ffn_up", (n_up,), il, required=False, suffix="bias")
        layer.ffn_down = ld.create("ffn_down", (n_ff, hp.n_embd), il)
        layer.ffn_down_b = ld.create("ffn_down", (hp.n_embd,), il, required=jina, suffix="bias")
        layer.layer_out_norm = ld.create("layer_out_norm", (hp.n_embd,), il)
        layer.layer_out_norm_b = ld.create("layer_out_norm", (hp.n_embd,), il, suffix="bias")


def build_graph(model, g):
    hp = model.hparams
    nomic, jina = hp.arch == "nomic-bert", hp.arch == "jina-bert-v2"
    pos = None if jina else g.inp_pos()
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
        if jina and layer.attn_q_norm is not None:       # LayerNorms over all heads at once
            q = ops.reshape(g.norm(ops.reshape(q, q.ne[0] * q.ne[1], q.ne[2]), layer.attn_q_norm,
                                   layer.attn_q_norm_b, kind="layer", il=il), *q.ne[:3])
        if jina and layer.attn_k_norm is not None:
            k = ops.reshape(g.norm(ops.reshape(k, k.ne[0] * k.ne[1], k.ne[2]), layer.attn_k_norm,
                                   layer.attn_k_norm_b, kind="layer", il=il), *k.ne[:3])
        if nomic:
            q, k = g.rope(q, pos, il), g.rope(k, pos, il)
        cur = g.attn_no_cache(il, layer.wo, layer.wo_b, q, k, v, kq_scale, causal=hp.causal_attn,
                              max_alibi_bias=hp.f_max_alibi_bias)
        if il == hp.n_layer - 1:
            cur, inpL = g.select_outputs(cur, inpL, out_ids=out_ids)
        cur = ops.add(cur, inpL)
        cur = g.norm(cur, layer.attn_out_norm, layer.attn_out_norm_b, kind="layer", il=il)
        if jina and layer.attn_norm_2 is not None:
            cur = g.norm(ops.add(cur, inpL), layer.attn_norm_2, layer.attn_norm_2_b, kind="layer", il=il)
        ffn_inp = g.cb(cur, "ffn_inp", il)
        if nomic:
            cur = g.ffn(ffn_inp, layer.ffn_up, None, layer.ffn_gate, None, layer.ffn_down, None, "silu", il=il)
        elif jina:
            fused = layer.ffn_gate is None and layer.ffn_up.ne[1] != hp.n_ff(il)
            cur = g.ffn(ffn_inp, layer.ffn_up, layer.ffn_up_b, layer.ffn_gate, None, layer.ffn_down, layer.ffn_down_b,
                        "gelu", fused_gate_up=fused, il=il)
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
