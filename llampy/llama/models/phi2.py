"""phi2: LayerNorm with bias, attention and FFN in parallel from the same normed input (their sums added to the
residual), partial NeoX RoPE (rope.dimension_count < head size), Q scaled before attention, biased GELU MLP,
an untied output matrix with a bias."""
from __future__ import annotations

import math

from ...ggml import ops
from .. import arch as A
from ._common import load_ffn, load_qkv


def load_hparams(hp, md):
    hp.rope_type = 2  # NEOX


def load_tensors(model, ld):
    hp = model.hparams
    model.tok_embd = ld.create(A.TOKEN_EMBD, (hp.n_embd, hp.n_vocab))
    model.output_norm = ld.create(A.OUTPUT_NORM, (hp.n_embd,))
    model.output_norm_b = ld.create(A.OUTPUT_NORM, (hp.n_embd,), suffix="bias")
    model.output = ld.create(A.OUTPUT, (hp.n_embd, hp.n_vocab))
    model.output_b = ld.create(A.OUTPUT, (hp.n_vocab,), suffix="bias")
    for il, layer in enumerate(model.layers):
        layer.attn_norm = ld.create("attn_norm", (hp.n_embd,), il)
        layer.attn_norm_b = ld.create("attn_norm", (hp.n_embd,), il, suffix="bias")
        load_qkv(model, ld, layer, il, bias=True)
        layer.wo_b = ld.create("attn_output", (hp.n_embd,), il, suffix="bias")
        load_ffn(model, ld, layer, il, gate=False, bias=True)


def build_graph(model, g):
    hp = model.hparams
    inpL = g.inp_embd(model.tok_embd)
    pos = g.inp_pos()
    out_ids = g.inp_out_ids()
    for il, layer in enumerate(model.layers):
        attn_norm = g.cb(g.norm(inpL, layer.attn_norm, layer.attn_norm_b, kind="layer", il=il), "attn_norm", il)
        q, k, v = g.qkv(layer, attn_norm, il)
        q, k = g.rope(q, pos, il), g.rope(k, pos, il)
        q = ops.scale(q, 1.0 / math.sqrt(hp.n_embd_head_k))   # phi2 scales Q first, for precision
        cur = g.attn(il, layer.wo, layer.wo_b, q, k, v, 1.0)
        if il == hp.n_layer - 1:
            cur, inpL, attn_norm = g.select_outputs(cur, inpL, attn_norm, out_ids=out_ids)
        ffn_out = g.cb(g.ffn(attn_norm, layer.ffn_up, layer.ffn_up_b, None, None, layer.ffn_down, layer.ffn_down_b,
                             "gelu", il=il), "ffn_out", il)
        inpL = g.cb(ops.add(ops.add(cur, ffn_out), inpL), "l_out", il)
    cur = g.norm(inpL, model.output_norm, model.output_norm_b, kind="layer")
    return g.finish(cur, g.lm_head(model.output, cur, model.output_b))
