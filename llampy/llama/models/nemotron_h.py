"""nemotron_h: NVIDIA's Nemotron-H, whose layers are each one of three kinds, told apart by the file's per-layer
counts: a Mamba-2 mixer (head_count_kv 0 and feed_forward_length 0), attention without positions
(feed_forward_length 0), or a feed-forward of squared ReLU (up, relu², down); each is RMS-normed and added to the
residual (llama.cpp's nemotron_h graph). nemotron_h_moe (Nemotron 3): the feed-forward layers are mixtures of
experts of squared ReLU (up, relu², down) chosen by sigmoid scores plus a choice-only bias (exp_probs_b), the
chosen weights optionally renormalised (expert_weights_norm) and scaled (expert_weights_scale); the router reads the
layer's input, the experts a latent projection of it (ffn_latent_down, moe_latent_size wide) whose result
ffn_latent_up takes back; a squared-ReLU shared expert beside them. The rows that return outputs are chosen after
the final norm, as llama.cpp's graph does."""
from __future__ import annotations

import math

from ...ggml import ops
from ..hparams import Meta, MissingMetadata, md_float
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
    if hp.arch == "nemotron_h_moe" and not hp.n_expert:
        raise MissingMetadata(f"{hp.arch} needs {hp.arch}.expert_count and {hp.arch}.expert_used_count")
    hp.n_ff_shexp = m.get_int("expert_shared_feed_forward_length", 0, lo=0)
    hp.expert_weights_norm = bool(m.get("expert_weights_norm", False))
    hp.expert_weights_scale = md_float(md, m.key("expert_weights_scale"), 0.0, nonneg=True)
    hp.moe_latent_size = m.get_int("moe_latent_size", 0, lo=0)
    if hp.n_expert and not hp.n_ff_shexp:
        raise MissingMetadata(f"missing metadata key {m.key('expert_shared_feed_forward_length')!r}")
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
        elif hp.n_expert:
            load_moe(hp, ld, layer, il)
        else:
            n_ff = hp.n_ff(il)
            layer.ffn_up = ld.create("ffn_up", (E, n_ff), il)
            layer.ffn_down = ld.create("ffn_down", (n_ff, E), il)
            layer.ffn_up_b = ld.create("ffn_up", (n_ff,), il, required=False, suffix="bias")
            layer.ffn_down_b = ld.create("ffn_down", (E,), il, required=False, suffix="bias")


def load_moe(hp, ld, layer, il: int):
    E, X = hp.n_embd, hp.n_expert
    n_ff_exp = hp.n_ff_exp or hp.n_ff(il) // hp.n_expert_used
    lat = hp.moe_latent_size or E
    c = lambda name, ne, **kw: ld.create(name, ne, il, **kw)                          # noqa: E731
    layer.ffn_gate_inp = c("ffn_gate_inp", (E, X))
    layer.ffn_exp_probs_b = ld.create(f"blk.{il}.exp_probs_b", (X,), suffix="bias")
    layer.ffn_latent_down = ld.create(f"blk.{il}.ffn_latent_down", (E, lat), required=False)
    layer.ffn_latent_up = ld.create(f"blk.{il}.ffn_latent_up", (lat, E), required=False)
    layer.ffn_up_exps = c("ffn_up_exps", (lat, n_ff_exp, X))
    layer.ffn_down_exps = c("ffn_down_exps", (n_ff_exp, lat, X))
    layer.ffn_up_shexp = c("ffn_up_shexp", (E, hp.n_ff_shexp))
    layer.ffn_down_shexp = c("ffn_down_shexp", (hp.n_ff_shexp, E))


def moe(g, layer, cur, il: int):
    hp = g.hp
    router = g.cb(g.mm(layer.ffn_gate_inp, cur), "ffn_moe_logits", il)
    x = cur if layer.ffn_latent_down is None else ops.mul_mat(layer.ffn_latent_down, cur)
    out = g.moe_ffn(x, layer.ffn_gate_inp, layer.ffn_up_exps, None, layer.ffn_down_exps, hp.n_expert,
                    hp.n_expert_used, hp.expert_weights_norm, il, gating="sigmoid", w_scale=hp.expert_weights_scale,
                    exp_probs_b=layer.ffn_exp_probs_b, act="relu_sqr", router_logits=router)
    if layer.ffn_latent_up is not None:
        out = ops.mul_mat(layer.ffn_latent_up, out)
    shared = g.mm(layer.ffn_down_shexp, ops.sqr(ops.relu(g.mm(layer.ffn_up_shexp, cur))))
    return g.cb(ops.add(out, g.cb(shared, "ffn_shexp", il)), "ffn_out", il)


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
        elif hp.n_expert:
            cur = moe(g, layer, cur, il)
        else:
            up = g.mm(layer.ffn_up, cur, layer.ffn_up_b)
            cur = g.cb(g.mm(layer.ffn_down, ops.sqr(ops.relu(up)), layer.ffn_down_b), "ffn_out", il)
        inpL = g.cb(ops.add(cur, inpL), "l_out", il)
    cur = g.norm(inpL, model.output_norm)
    (cur,) = g.select_outputs(cur, out_ids=out_ids)
    return g.finish(cur, g.lm_head(model.output, cur))
