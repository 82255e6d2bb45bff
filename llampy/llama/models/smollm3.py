"""smollm3: the llama block (RMSNorm, SwiGLU, RoPE on adjacent pairs) where every fourth layer has no RoPE
(NoPE: layers 3, 7, 11, ...), with optional biases on q/k/v/o and the FFN."""
from __future__ import annotations

import math

from ...ggml import ops
from ._common import load_embd_and_output, load_ffn, load_qkv

N_NO_ROPE_LAYER_STEP = 4   # llama.cpp's hparams.n_no_rope_layer_step for smollm3 (no GGUF key)


def load_hparams(hp, md):
    hp.rope_type = 0  # NORM


def load_tensors(model, ld):
    hp = model.hparams
    load_embd_and_output(model, ld)
    for il, layer in enumerate(model.layers):
        layer.attn_norm = ld.create("attn_norm", (hp.n_embd,), il)
        load_qkv(model, ld, layer, il, bias=True)
        layer.wo_b = ld.create("attn_output", (hp.n_embd,), il, required=False, suffix="bias")
        layer.ffn_norm = ld.create("ffn_norm", (hp.n_embd,), il)
        load_ffn(model, ld, layer, il, bias=True)
        layer.ffn_gate_b = ld.create("ffn_gate", (hp.n_ff(il),), il, required=False, suffix="bias")


def build_graph(model, g):
    hp = model.hparams
    kq_scale = hp.f_attention_scale or 1.0 / math.sqrt(hp.n_embd_head_v)
    inpL = g.inp_embd(model.tok_embd)
    pos = g.inp_pos()
    out_ids = g.inp_out_ids()
    for il, layer in enumerate(model.layers):
        inpSA = inpL
        cur = g.cb(g.norm(inpL, layer.attn_norm, il=il), "attn_norm", il)
        q, k, v = g.qkv(layer, cur, il)
        if (il + 1) % N_NO_ROPE_LAYER_STEP != 0:
            q, k = g.rope(q, pos, il), g.rope(k, pos, il)
        cur = g.cb(g.attn(il, layer.wo, layer.wo_b, q, k, v, kq_scale), "attn_out", il)
        if il == hp.n_layer - 1:
            cur, inpSA = g.select_outputs(cur, inpSA, out_ids=out_ids)
        ffn_inp = g.cb(ops.add(cur, inpSA), "ffn_inp", il)
        cur = g.cb(g.norm(ffn_inp, layer.ffn_norm, il=il), "ffn_norm", il)
        cur = g.ffn(cur, layer.ffn_up, layer.ffn_up_b, layer.ffn_gate, layer.ffn_gate_b, layer.ffn_down,
                    layer.ffn_down_b, "silu", il=il)
        inpL = g.cb(ops.add(cur, ffn_inp), "l_out", il)
    cur = g.norm(inpL, model.output_norm)
    return g.finish(cur, g.lm_head(model.output, cur))
