"""command-r (Cohere Command R) and cohere2 (Command R7B): LayerNorm without bias, attention and FFN in parallel
from the same normed input, RoPE on adjacent pairs, the head tied to the embedding and its logits multiplied by
``logit_scale``. command-r: per-head LayerNorm of Q and K where the file has them. cohere2: sliding-window
attention on three layers of four, RoPE only on those (the dense layers have none), the global base for both."""
from __future__ import annotations

import math

from ...ggml import ops
from .. import arch as A
from ..hparams import MissingMetadata, load_swa_pattern
from ._common import load_ffn, load_qkv


def load_hparams(hp, md):
    a = hp.arch
    hp.rope_type = 0  # NORM
    if a == "cohere2":
        for key in ("logit_scale", "attention.sliding_window"):
            if f"{a}.{key}" not in md:
                raise MissingMetadata(f"missing metadata key '{a}.{key}'")
        hp.f_logit_scale = float(md[f"{a}.logit_scale"])
        hp.n_swa = int(md[f"{a}.attention.sliding_window"])
        load_swa_pattern(hp, md, 4)
        # the graph ropes the sliding-window layers with the global base and scale (rope.freq_base_swa unused)
        hp.rope_freq_base_swa, hp.rope_freq_scale_swa = hp.rope_freq_base, hp.rope_freq_scale
    else:
        hp.f_logit_scale = float(md.get(f"{a}.logit_scale", 0.0))


def load_tensors(model, ld):
    hp = model.hparams
    model.tok_embd = ld.create(A.TOKEN_EMBD, (hp.n_embd, hp.n_vocab))
    model.output_norm = ld.create(A.OUTPUT_NORM, (hp.n_embd,))
    model.output = ld.tied(A.TOKEN_EMBD)
    qk_norm = hp.arch == "command-r" and hp.n_layer >= 64    # llama.cpp reads them only for the 104B model
    for il, layer in enumerate(model.layers):
        layer.attn_norm = ld.create("attn_norm", (hp.n_embd,), il)
        layer.attn_q_norm = ld.create("attn_q_norm", (hp.n_embd_head_k, hp.n_head(il)), il) if qk_norm else None
        layer.attn_k_norm = ld.create("attn_k_norm", (hp.n_embd_head_k, hp.n_head_kv(il)), il) if qk_norm else None
        load_qkv(model, ld, layer, il, bias=True)
        layer.wo_b = ld.create("attn_output", (hp.n_embd,), il, required=False, suffix="bias")
        load_ffn(model, ld, layer, il)


def build_graph(model, g):
    hp = model.hparams
    kq_scale = 1.0 / math.sqrt(hp.n_embd_head_k)
    rope_all = hp.arch != "cohere2"
    inpL = g.inp_embd(model.tok_embd)
    pos = g.inp_pos()
    out_ids = g.inp_out_ids()
    for il, layer in enumerate(model.layers):
        cur = g.cb(g.norm(inpL, layer.attn_norm, kind="layer", il=il), "attn_norm", il)
        ffn_inp = cur
        q, k, v = g.qkv(layer, cur, il)
        if layer.attn_q_norm is not None:
            q = g.norm(q, layer.attn_q_norm, kind="layer", il=il)
            k = g.norm(k, layer.attn_k_norm, kind="layer", il=il)
        if rope_all or hp.is_swa(il):
            q, k = g.rope(q, pos, il), g.rope(k, pos, il)
        cur = g.attn(il, layer.wo, layer.wo_b, q, k, v, kq_scale)
        if il == hp.n_layer - 1:
            cur, inpL, ffn_inp = g.select_outputs(cur, inpL, ffn_inp, out_ids=out_ids)
        attn_out = cur
        cur = g.cb(g.ffn(ffn_inp, layer.ffn_up, None, layer.ffn_gate, None, layer.ffn_down, None, "silu", il=il),
                   "ffn_out", il)
        inpL = g.cb(ops.add(ops.add(cur, inpL), attn_out), "l_out", il)
    cur = g.norm(inpL, model.output_norm, kind="layer")
    logits = g.lm_head(model.output, cur)
    if hp.f_logit_scale:
        logits = ops.scale(logits, hp.f_logit_scale)
    return g.finish(cur, logits)
