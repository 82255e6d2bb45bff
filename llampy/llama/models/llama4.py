"""llama4 (Llama 4 Scout/Maverick text model): the llama block with

- chunked attention: three layers of four attend only within their chunk of 8192 positions (llama.cpp fixes the
  chunk size; a sliding_window of 0 in the file turns chunking off), the fourth over everything;
- no RoPE on every fourth layer (the chunked layers are the roped ones), whose Q gets the attention temperature
  log(floor((pos + 1) / 8192) + 1) * 0.1 + 1 instead;
- Q and K RMS-normed without a weight after RoPE (Llama4TextL2Norm), except in the 128-expert model;
- every interleave_moe_layer_step-th layer a mixture of experts chosen by raw router logits, each chosen expert's
  input scaled by the sigmoid of its logit (weight before the FFN), plus a shared expert; the others dense.
"""
from __future__ import annotations

import math

from ...ggml import ops
from ..hparams import InvalidMetadata, MissingMetadata, md_float, md_int
from ._common import load_embd_and_output, load_ffn, load_qkv

CHUNK = 8192                # llama.cpp's n_swa for llama4, whatever the file says
N_NO_ROPE_LAYER_STEP = 4


def load_hparams(hp, md):
    a = hp.arch
    hp.rope_type = 0  # NORM
    if not hp.n_expert:
        raise InvalidMetadata(f"{a}: a llama4 model cannot have zero experts ({a}.expert_count)")
    if not hp.n_ff_exp:
        raise MissingMetadata(f"missing metadata key '{a}.expert_feed_forward_length'")
    if f"{a}.interleave_moe_layer_step" not in md:
        raise MissingMetadata(f"missing metadata key '{a}.interleave_moe_layer_step'")
    hp.n_moe_layer_step = md_int(md, f"{a}.interleave_moe_layer_step", lo=0)
    if f"{a}.attention.sliding_window" in md and md_int(md, f"{a}.attention.sliding_window", lo=0) == 0:
        hp.n_swa = 0
        hp.swa_layers = []
        hp.n_no_rope_layer_step = hp.n_layer    # as llama.cpp: the last layer then goes without RoPE
        hp.f_attn_temp_scale = 0.0
    else:
        hp.n_swa = CHUNK
        hp.swa_chunked = True
        hp.n_no_rope_layer_step = N_NO_ROPE_LAYER_STEP
        hp.n_attn_temp_floor_scale, hp.f_attn_temp_scale, hp.f_attn_temp_offset = CHUNK, 0.1, 1.0
        pattern = md.get(f"{a}.attention.sliding_window_pattern")
        if pattern is not None and not isinstance(pattern, int):      # a per-layer bool array
            if len(pattern) != hp.n_layer:
                raise InvalidMetadata(f"{a}.attention.sliding_window_pattern has {len(pattern)} values for "
                                      f"{hp.n_layer} layers")
            hp.swa_layers = [bool(x) for x in pattern]
        else:
            hp.set_swa_pattern(4 if pattern is None else md_int(md, f"{a}.attention.sliding_window_pattern", lo=0))
        hp.rope_freq_base_swa = md_float(md, f"{a}.rope.freq_base_swa", hp.rope_freq_base, positive=True)
        hp.rope_freq_scale_swa = hp.rope_freq_scale
    hp.use_kq_norm = hp.n_expert != 128
    if hp.n_rot != hp.n_embd_head_k or hp.n_embd_head_k != hp.n_embd_head_v:
        raise InvalidMetadata(f"{a}: rope.dimension_count ({hp.n_rot}) must equal the head size "
                              f"({hp.n_embd_head_k}, values {hp.n_embd_head_v})")


def is_moe_layer(hp, il: int) -> bool:
    return hp.n_moe_layer_step > 0 and (il + 1) % hp.n_moe_layer_step == 0


def load_tensors(model, ld):
    hp = model.hparams
    load_embd_and_output(model, ld)
    model.rope_freqs = ld.create("rope_freqs", (hp.n_rot // 2,), required=False)
    for il, layer in enumerate(model.layers):
        layer.attn_norm = ld.create("attn_norm", (hp.n_embd,), il)
        load_qkv(model, ld, layer, il)
        layer.ffn_norm = ld.create("ffn_norm", (hp.n_embd,), il)
        if not is_moe_layer(hp, il):
            load_ffn(model, ld, layer, il)
            continue
        n_ff, n_exp = hp.n_ff_exp, hp.n_expert
        layer.ffn_gate_inp = ld.create("ffn_gate_inp", (hp.n_embd, n_exp), il)
        layer.ffn_gate_exps = ld.create("ffn_gate_exps", (hp.n_embd, n_ff, n_exp), il)
        layer.ffn_up_exps = ld.create("ffn_up_exps", (hp.n_embd, n_ff, n_exp), il)
        layer.ffn_down_exps = ld.create("ffn_down_exps", (n_ff, hp.n_embd, n_exp), il)
        layer.ffn_gate_shexp = ld.create("ffn_gate_shexp", (hp.n_embd, n_ff), il)
        layer.ffn_up_shexp = ld.create("ffn_up_shexp", (hp.n_embd, n_ff), il)
        layer.ffn_down_shexp = ld.create("ffn_down_shexp", (n_ff, hp.n_embd), il)


def build_graph(model, g):
    hp = model.hparams
    kq_scale = hp.f_attention_scale or 1.0 / math.sqrt(hp.n_embd_head_v)
    inpL = g.inp_embd(model.tok_embd)
    pos = g.inp_pos()
    attn_scale = (g.inp_attn_scale(hp.f_attn_temp_scale, hp.n_attn_temp_floor_scale, hp.f_attn_temp_offset)
                  if hp.f_attn_temp_scale else None)
    out_ids = g.inp_out_ids()
    for il, layer in enumerate(model.layers):
        inpSA = inpL
        use_rope = hp.n_no_rope_layer_step > 0 and (il + 1) % hp.n_no_rope_layer_step != 0
        cur = g.cb(g.norm(inpL, layer.attn_norm, il=il), "attn_norm", il)
        q, k, v = g.qkv(layer, cur, il)
        if use_rope:
            q, k = g.rope(q, pos, il, model.rope_freqs), g.rope(k, pos, il, model.rope_freqs)
            if hp.use_kq_norm:
                q, k = g.norm(q, None, il=il), g.norm(k, None, il=il)
        elif attn_scale is not None:
            q = ops.mul(q, attn_scale)
        cur = g.cb(g.attn(il, layer.wo, None, q, k, v, kq_scale), "attn_out", il)
        if il == hp.n_layer - 1:
            cur, inpSA = g.select_outputs(cur, inpSA, out_ids=out_ids)
        ffn_inp = g.cb(ops.add(cur, inpSA), "ffn_inp", il)
        cur = g.cb(g.norm(ffn_inp, layer.ffn_norm, il=il), "ffn_norm", il)
        if not is_moe_layer(hp, il):
            cur = g.ffn(cur, layer.ffn_up, None, layer.ffn_gate, None, layer.ffn_down, None, "silu", il=il)
        else:
            moe = g.moe_ffn(cur, layer.ffn_gate_inp, layer.ffn_up_exps, layer.ffn_gate_exps, layer.ffn_down_exps,
                            hp.n_expert, hp.n_expert_used, False, il, gating="sigmoid", weight_before_ffn=True)
            shexp = g.cb(g.ffn(cur, layer.ffn_up_shexp, None, layer.ffn_gate_shexp, None, layer.ffn_down_shexp,
                               None, "silu", il=il), "ffn_moe_shexp", il)
            cur = ops.add(moe, shexp)
        inpL = g.cb(ops.add(cur, ffn_inp), "l_out", il)
    cur = g.norm(inpL, model.output_norm)
    return g.finish(cur, g.lm_head(model.output, cur))
