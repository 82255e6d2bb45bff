"""falcon-h1: TII's Falcon-H1, whose every layer runs attention (NeoX RoPE) and a Mamba-2 mixer side by side on the
same normed input and adds both to the residual, then a SwiGLU feed-forward. Each layer is in both memories: the
KV cache for its attention, the recurrent state for its mixer (llama.cpp's falcon-h1 graph; the converter folds
the model's multipliers into the weights)."""
from __future__ import annotations

import math

from ...ggml import ops
from ._common import load_embd_and_output, load_ffn, load_qkv
from .mamba import load_ssm_hparams
from .mamba2 import check_mamba2_hparams, load_mamba2_layer, mamba2_layer


def load_hparams(hp, md):
    load_ssm_hparams(hp, md, group=True)
    check_mamba2_hparams(hp)
    hp.rope_type = 2        # NEOX
    hp.kv_layers = [True] * hp.n_layer


def load_tensors(model, ld):
    hp = model.hparams
    load_embd_and_output(model, ld)
    for il, layer in enumerate(model.layers):
        layer.attn_norm = ld.create("attn_norm", (hp.n_embd,), il)
        load_mamba2_layer(hp, ld, layer, il, conv_bias_required=False, norm_required=False)
        load_qkv(model, ld, layer, il)
        # llama.cpp's loader names it without ".weight"; a file that has the suffix is taken too
        layer.ffn_norm = ld.create("ffn_norm", (hp.n_embd,), il, suffix=None, required=False) or \
            ld.create("ffn_norm", (hp.n_embd,), il)
        load_ffn(model, ld, layer, il, bias=True)
        layer.ffn_gate_b = ld.create("ffn_gate", (hp.n_ff(il),), il, required=False, suffix="bias")


def build_graph(model, g):
    hp = model.hparams
    kq_scale = hp.f_attention_scale or 1.0 / math.sqrt(hp.n_embd_head_v)
    inpL = g.inp_embd(model.tok_embd)
    pos = g.inp_pos()
    out_ids = g.inp_out_ids()
    for il, layer in enumerate(model.layers):
        cur = g.cb(g.norm(inpL, layer.attn_norm, il=il), "attn_norm", il)
        q, k, v = g.qkv(layer, cur, il)
        q, k = g.rope(q, pos, il), g.rope(k, pos, il)
        attn_out = g.cb(g.attn(il, layer.wo, None, q, k, v, kq_scale), "attn_out", il)
        ssm_out = g.cb(mamba2_layer(g, layer, g.norm(inpL, layer.attn_norm, il=il), il), "ssm_out", il)
        cur = g.cb(ops.add(attn_out, ssm_out), "layer_out", il)
        ffn_inp = ops.add(cur, inpL)
        if il == hp.n_layer - 1:
            (ffn_inp,) = g.select_outputs(ffn_inp, out_ids=out_ids)
        ffn_inp = g.cb(ffn_inp, "ffn_inp", il)
        cur = g.ffn(g.cb(g.norm(ffn_inp, layer.ffn_norm, il=il), "ffn_norm", il), layer.ffn_up, layer.ffn_up_b,
                    layer.ffn_gate, layer.ffn_gate_b, layer.ffn_down, layer.ffn_down_b, "silu", il=il)
        inpL = g.cb(ops.add(cur, ffn_inp), "l_out", il)
    cur = g.norm(inpL, model.output_norm)
    return g.finish(cur, g.lm_head(model.output, cur))
