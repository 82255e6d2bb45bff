"""internlm2: the llama block (RMSNorm, RoPE on adjacent pairs, SwiGLU) with an untied output matrix."""
from __future__ import annotations

import math

from ...ggml import ops
from .. import arch as A
from ._common import load_ffn, load_qkv


def load_hparams(hp, md):
    hp.rope_type = 0  # NORM


def load_tensors(model, ld):
    hp = model.hparams
    model.tok_embd = ld.create(A.TOKEN_EMBD, (hp.n_embd, hp.n_vocab))
    model.output_norm = ld.create(A.OUTPUT_NORM, (hp.n_embd,))
    model.output = ld.create(A.OUTPUT, (hp.n_embd, hp.n_vocab))
    for il, layer in enumerate(model.layers):
        layer.attn_norm = ld.create("attn_norm", (hp.n_embd,), il)
        load_qkv(model, ld, layer, il, bias=True)
        layer.wo_b = ld.create("attn_output", (hp.n_embd,), il, required=False, suffix="bias")
        layer.ffn_norm = ld.create("ffn_norm", (hp.n_embd,), il)
        load_ffn(model, ld, layer, il)


def build_graph(model, g):
    hp = model.hparams
    kq_scale = 1.0 / math.sqrt(hp.n_embd_head_k)
    inpL = g.inp_embd(model.tok_embd)
    pos = g.inp_pos()
    out_ids = g.inp_out_ids()
    for il, layer in enumerate(model.layers):
        inpSA = inpL
        cur = g.cb(g.norm(inpL, layer.attn_norm, il=il), "attn_norm", il)
        q, k, v = g.qkv(layer, cur, il)
        q, k = g.rope(q, pos, il), g.rope(k, pos, il)
        cur = g.attn(il, layer.wo, layer.wo_b, q, k, v, kq_scale)
        if il == hp.n_layer - 1:
            cur, inpSA = g.select_outputs(cur, inpSA, out_ids=out_ids)
        ffn_inp = g.cb(ops.add(cur, inpSA), "ffn_inp", il)
        cur = g.cb(g.norm(ffn_inp, layer.ffn_norm, il=il), "ffn_norm", il)
        cur = g.ffn(cur, layer.ffn_up, None, layer.ffn_gate, None, layer.ffn_down, None, "silu", il=il)
        inpL = g.cb(ops.add(cur, ffn_inp), "l_out", il)
    cur = g.norm(inpL, model.output_norm)
    return g.finish(cur, g.lm_head(model.output, cur))
