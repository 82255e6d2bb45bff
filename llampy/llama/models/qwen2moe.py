"""qwen2moe: qwen2 attention (q/k/v biases, NeoX RoPE) with a mixture of experts (softmax router, the top-k weights
not renormalised) plus a shared expert weighed per token by sigmoid(ffn_gate_inp_shexp . x)."""
from __future__ import annotations

from ...ggml import ops
from .. import arch as A
from ..hparams import InvalidMetadata, MissingMetadata, md_int
from . import qwen2
from ._common import load_qkv


def load_hparams(hp, md):
    hp.rope_type = 2  # NEOX
    if not hp.n_expert:
        raise MissingMetadata(f"{hp.arch} needs {hp.arch}.expert_count and {hp.arch}.expert_used_count")
    if hp.n_embd_head_k != hp.n_rot:
        raise InvalidMetadata(f"{hp.arch}: rope.dimension_count {hp.n_rot} must be the head size {hp.n_embd_head_k}")
    hp.n_ff_shexp = md_int(md, f"{hp.arch}.expert_shared_feed_forward_length", 0, lo=0)


def load_tensors(model, ld):
    hp = model.hparams
    model.tok_embd = ld.create(A.TOKEN_EMBD, (hp.n_embd, hp.n_vocab))
    model.output_norm = ld.create(A.OUTPUT_NORM, (hp.n_embd,))
    model.output = ld.create(A.OUTPUT, (hp.n_embd, hp.n_vocab))
    n_ff_exp = hp.n_ff_exp or hp.n_ff() // hp.n_expert_used
    n_ff_sh = hp.n_ff_shexp or hp.n_ff()
    for il, layer in enumerate(model.layers):
        layer.attn_norm = ld.create("attn_norm", (hp.n_embd,), il)
        load_qkv(model, ld, layer, il, bias=True)
        layer.wo_b = ld.create("attn_output", (hp.n_embd,), il, required=False, suffix="bias")
        layer.ffn_norm = ld.create("ffn_norm", (hp.n_embd,), il)
        layer.ffn_gate_inp = ld.create("ffn_gate_inp", (hp.n_embd, hp.n_expert), il)
        layer.ffn_gate_exps = ld.create("ffn_gate_exps", (hp.n_embd, n_ff_exp, hp.n_expert), il)
        layer.ffn_up_exps = ld.create("ffn_up_exps", (hp.n_embd, n_ff_exp, hp.n_expert), il)
        layer.ffn_down_exps = ld.create("ffn_down_exps", (n_ff_exp, hp.n_embd, hp.n_expert), il)
        layer.ffn_gate_inp_shexp = ld.create("ffn_gate_inp_shexp", (hp.n_embd,), il)
        layer.ffn_gate_shexp = ld.create("ffn_gate_shexp", (hp.n_embd, n_ff_sh), il)
        layer.ffn_up_shexp = ld.create("ffn_up_shexp", (hp.n_embd, n_ff_sh), il)
        layer.ffn_down_shexp = ld.create("ffn_down_shexp", (n_ff_sh, hp.n_embd), il)


def _moe(g, layer, cur, il):
    hp = g.hp
    moe = g.moe_ffn(cur, layer.ffn_gate_inp, layer.ffn_up_exps, layer.ffn_gate_exps, layer.ffn_down_exps,
                    hp.n_expert, hp.n_expert_used, False, il)
    return g.cb(ops.add(moe, g.shexp_ffn(cur, layer, il)), "ffn_out", il)


def build_graph(model, g):
    return qwen2.build_graph(model, g, ffn=_moe)
