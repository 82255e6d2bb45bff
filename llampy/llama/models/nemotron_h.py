"""nemotron_h: NVIDIA's Nemotron-H, whose layers are each one of three kinds, told apart by the file's per-layer
counts: a Mamba-2 mixer (head_count_kv 0 and feed_forward_length 0), attention without positions
(feed_forward_length 0), or a feed-forward of squared ReLU (up, relu², down); each is RMS-normed and added to the
residual (llama.cpp's nemotron_h graph). The mixture-of-experts variant (Nemotron 3) is not built."""
from __future__ import annotations

import math

from ...ggml import ops
from ..hparams import Meta, MissingMetadata
from ._common import load_embd_and_output, load_qkv
from .mamba import load_ssm_hparams
from .mamba2 import check_mamba2_hparams, load_mamba2_layer, mamba2_layer


def load_hparams(hp, md):
    m = Meta(md, hp.arch)
    if not m.has("attention.layer_norm_epsilon"):        # llama.cpp requires it; the RMS epsilon defaults to it
        raise MissingMetadata(f"missing metadata key {m.key('attention.layer_norm_epsilon')!r}")
    if not m.has("attention.layer_norm_rms_epsilon"):
        hp.f_norm_rms_eps = hp.f_norm_eps
    load_ssm_hparams(hp, md, group=True, rms_eps_required=False)
    check_mamba2_hparams(hp)
    if hp.n_expert:
        raise ValueError("nemotron_h with experts (expert_count > 0) is not supported")
    hp.rope_type = -1       # LLAMA_ROPE_TYPE_NONE: its attention has no positions but the mask's
    hp.recurrent_layers = [hp.n_head_kv(il) == 0 and hp.n_ff(il) == 0 for il in range(hp.n_layer)]
    hp.kv_layers = [hp.n_head_kv(il) > 0 and hp.n_ff(il) == 0 for il in range(hp.n_layer)]


def load_tensors(model, ld):
    hp = model.hparams
    E = hp.n_embd
    load_embd_and_output(model, ld)
    for il, layer in enumerate(model.layers):
        layer.attn_norm = ld.create("attn_norm", (E,), il)
        if hp.is_recurrent(il):
            load_mamba2_layer(hp, ld, layer, il, conv_bias_required=False)
        elif hp.has_kv(il):
            load_qkv(model, ld, layer, il)
            layer.wo_b = ld.create("attn_output", (E,), il, required=False, suffix="bias")
        else:
            n_ff = hp.n_ff(il)
            layer.ffn_up = ld.create("ffn_up", (E, n_ff), il)
            layer.ffn_down = ld.create("ffn_down", (n_ff, E), il)
            layer.ffn_up_b = ld.create("ffn_up", (n_ff,), il, required=False, suffix="bias")
            layer.ffn_down_b = ld.create("ffn_down", (E,), il, required=False, suffix="bias")


def build_graph(model, g):
    hp = model.hparams
    kq_scale = hp.f_attention_scale or 1.0 / math.sqrt(hp.n_embd_head_v)
    inpL = g.inp_embd(model.tok_embd)
    out_ids = g.inp_out_ids()
    for il, layer in enumerate(model.layers):
        cur = g.cb(g.norm(inpL, layer.attn_norm, il=il), "attn_norm", il)
        if hp.is_recurrent(il):
            cur = mamba2_layer(g, layer, cur, il)
        elif hp.has_kv(il):
            q, k, v = g.qkv(layer, cur, il)
            cur = g.cb(g.attn(il, layer.wo, layer.wo_b, q, k, v, kq_scale), "attn_out", il)
        else:
            up = g.mm(layer.ffn_up, cur, layer.ffn_up_b)
            cur = g.cb(g.mm(layer.ffn_down, ops.sqr(ops.relu(up)), layer.ffn_down_b), "ffn_out", il)
        inpSA = inpL
        if il == hp.n_layer - 1:
            cur, inpSA = g.select_outputs(cur, inpSA, out_ids=out_ids)
        inpL = g.cb(ops.add(cur, inpSA), "l_out", il)
    cur = g.norm(inpL, model.output_norm)
    return g.finish(cur, g.mm(model.output, cur))
