"""qwen3moe: qwen3 attention with a mixture-of-experts FFN (softmax gating, top-k weights renormalised)."""
from __future__ import annotations

from ..hparams import MissingMetadata
from . import qwen3
from ._common import load_embd_and_output


def load_hparams(hp, md):
    qwen3.load_hparams(hp, md)
    if not hp.n_expert:
        raise MissingMetadata("qwen3moe needs qwen3moe.expert_count and qwen3moe.expert_used_count")
    # without expert_feed_forward_length llama.cpp splits feed_forward_length between the used experts
    hp.n_ff_exp = hp.n_ff_exp or hp.n_ff() // hp.n_expert_used


def load_tensors(model, ld):
    hp = model.hparams
    load_embd_and_output(model, ld)
    for il, layer in enumerate(model.layers):
        qwen3.load_attn(model, ld, layer, il)
        n_ff = hp.n_ff_exp
        layer.ffn_gate_inp = ld.create("ffn_gate_inp", (hp.n_embd, hp.n_expert), il)
        layer.ffn_gate_exps = ld.create("ffn_gate_exps", (hp.n_embd, n_ff, hp.n_expert), il)
        layer.ffn_up_exps = ld.create("ffn_up_exps", (hp.n_embd, n_ff, hp.n_expert), il)
        layer.ffn_down_exps = ld.create("ffn_down_exps", (n_ff, hp.n_embd, hp.n_expert), il)


def _moe(g, layer, cur, il):
    hp = g.hp
    return g.moe_ffn(cur, layer.ffn_gate_inp, layer.ffn_up_exps, layer.ffn_gate_exps, layer.ffn_down_exps,
                     hp.n_expert, hp.n_expert_used, True, il)


def build_graph(model, g):
    return qwen3.build_graph(model, g, ffn=_moe)
