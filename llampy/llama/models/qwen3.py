"""qwen3: the llama block with a per-head RMS norm of Q and K before RoPE (NeoX), no biases. A reranker (Qwen3
Reranker converted with ``cls.output``) scores with rank pooling: the softmax of cls.output over the last token."""
from __future__ import annotations

import math

from ...ggml import ops
from ._common import load_embd_and_output, load_ffn, load_qkv

RANK_HEAD = True    # when the file has cls.output


def load_hparams(hp, md):
    hp.rope_type = 2  # NEOX
    labels = md.get(f"{hp.arch}.classifier.output_labels")
    hp.n_cls_out = len(labels) if labels is not None and len(labels) else 1


def load_attn(model, ld, layer, il):
    hp = model.hparams
    layer.attn_norm = ld.create("attn_norm", (hp.n_embd,), il)
    load_qkv(model, ld, layer, il)
    layer.attn_q_norm = ld.create("attn_q_norm", (hp.n_embd_head_k,), il)
    layer.attn_k_norm = ld.create("attn_k_norm", (hp.n_embd_head_k,), il)
    layer.ffn_norm = ld.create("ffn_norm", (hp.n_embd,), il)


def load_tensors(model, ld):
    load_embd_and_output(model, ld)
    model.cls_out = ld.create("cls.output", (model.hparams.n_embd, model.hparams.n_cls_out), required=False)
    for il, layer in enumerate(model.layers):
        load_attn(model, ld, layer, il)
        load_ffn(model, ld, layer, il)


# the attention half of a qwen3 block: norm -> qkv -> q/k norm -> rope -> attention; returns (attn out, residual)
def attn_block(model, g, layer, inpL, pos, il):
    hp = model.hparams
    cur = g.cb(g.norm(inpL, layer.attn_norm, il=il), "attn_norm", il)
    q, k, v = g.qkv(layer, cur, il)
    q = g.cb(g.norm(q, layer.attn_q_norm, il=il), "Qcur_normed", il)
    k = g.cb(g.norm(k, layer.attn_k_norm, il=il), "Kcur_normed", il)
    q, k = g.rope(q, pos, il), g.rope(k, pos, il)
    return g.attn(il, layer.wo, None, q, k, v, 1.0 / math.sqrt(hp.n_embd_head_k))


def build_graph(model, g, ffn=None):
    hp = model.hparams
    inpL = g.inp_embd(model.tok_embd)
    pos = g.inp_pos()
    out_ids = g.inp_out_ids()
    for il, layer in enumerate(model.layers):
        inpSA = inpL
        cur = attn_block(model, g, layer, inpL, pos, il)
        if il == hp.n_layer - 1:
            cur, inpSA = g.select_outputs(cur, inpSA, out_ids=out_ids)
        ffn_inp = g.cb(ops.add(cur, inpSA), "ffn_inp", il)
        cur = g.cb(g.norm(ffn_inp, layer.ffn_norm, il=il), "ffn_norm", il)
        if ffn is None:
            cur = g.ffn(cur, layer.ffn_up, None, layer.ffn_gate, None, layer.ffn_down, None, "silu", il=il)
        else:
            cur = ffn(g, layer, cur, il)
        inpL = g.cb(ops.add(cur, ffn_inp), "l_out", il)
    cur = g.norm(inpL, model.output_norm)
    if g.pooling == "rank":
        if getattr(model, "cls_out", None) is None:
            raise ValueError(f"pooling 'rank': this {hp.arch} model has no classification head (cls.output)")
        return g.finish(ops.soft_max(ops.mul_mat(model.cls_out, cur)), None)
    return g.finish(cur, g.lm_head(model.output, cur))
