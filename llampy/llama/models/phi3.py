"""phi3: fused attn_qkv, fused gate+up in ffn_up (gate first), NeoX RoPE, Q scaled before attention.
llama.cpp ignores phi3's sliding_window (it logs "Phi SWA is currently disabled"), and so does llampy."""
from __future__ import annotations

import math

from ...ggml import ops
from ._common import load_embd_and_output


def load_hparams(hp, md):
    hp.rope_type = 2  # NEOX
    hp.n_swa = 0


def load_tensors(model, ld):
    hp = model.hparams
    load_embd_and_output(model, ld)
    model.rope_freqs = None
    for il, layer in enumerate(model.layers):
        n_q = hp.n_embd_head_k * hp.n_head(il)
        layer.attn_norm = ld.create("attn_norm", (hp.n_embd,), il)
        layer.wqkv = ld.create("attn_qkv", (hp.n_embd, n_q + 2 * hp.n_embd_k_gqa(il)), il)
        layer.wo = ld.create("attn_output", (n_q, hp.n_embd), il)
        layer.ffn_norm = ld.create("ffn_norm", (hp.n_embd,), il)
        layer.ffn_up = ld.create("ffn_up", (hp.n_embd, 2 * hp.n_ff(il)), il)
        layer.ffn_down = ld.create("ffn_down", (hp.n_ff(il), hp.n_embd), il)


def build_graph(model, g):
    hp = model.hparams
    inpL = g.inp_embd(model.tok_embd)
    pos = g.inp_pos()
    out_ids = g.inp_out_ids()
    for il, layer in enumerate(model.layers):
        residual = inpL
        cur = g.cb(g.norm(inpL, layer.attn_norm, il=il), "attn_norm", il)
        q, k, v = g.qkv(layer, cur, il)
        q, k = g.rope(q, pos, il), g.rope(k, pos, il)
        q = ops.scale(q, 1.0 / math.sqrt(hp.n_embd_head_k))
        cur = g.attn(il, layer.wo, None, q, k, v, 1.0)
        if il == hp.n_layer - 1:
            cur, residual = g.select_outputs(cur, residual, out_ids=out_ids)
        cur = ops.add(cur, residual)
        residual = cur
        cur = g.cb(g.norm(cur, layer.ffn_norm, il=il), "ffn_norm", il)
        cur = g.ffn(cur, layer.ffn_up, None, None, None, layer.ffn_down, None, "silu", fused_gate_up=True, il=il)
        inpL = g.cb(ops.add(residual, cur), "l_out", il)
    cur = g.norm(inpL, model.output_norm)
    return g.finish(cur, g.lm_head(model.output, cur))
