"""olmoe: pre-norm blocks with RMS norms of Q and K over all heads at once (as olmo2), NeoX RoPE, and a mixture of
experts (softmax router, the top-k weights not renormalised; experts as wide as feed_forward_length)."""
from __future__ import annotations

from ...ggml import ops
from .. import arch as A
from ..hparams import InvalidMetadata, MissingMetadata
from . import olmo2
from ._common import load_qkv


def load_hparams(hp, md):
    hp.rope_type = 2  # NEOX
    if not hp.n_expert:
        raise MissingMetadata(f"{hp.arch} needs {hp.arch}.expert_count and {hp.arch}.expert_used_count")
    if hp.n_embd_head_k != hp.n_rot:
        raise InvalidMetadata(f"{hp.arch}: rope.dimension_count {hp.n_rot} must be the head size {hp.n_embd_head_k}")


def load_tensors(model, ld):
    hp = model.hparams
    model.tok_embd = ld.create(A.TOKEN_EMBD, (hp.n_embd, hp.n_vocab))
    model.output_norm = ld.create(A.OUTPUT_NORM, (hp.n_embd,))
    model.output = ld.create(A.OUTPUT, (hp.n_embd, hp.n_vocab))
    for il, layer in enumerate(model.layers):
        n_ff = hp.n_ff(il)
        layer.attn_norm = ld.create("attn_norm", (hp.n_embd,), il)
        load_qkv(model, ld, layer, il, bias=True)
        # llama.cpp sizes both norms n_embd: OLMoE has as many KV heads as heads
        layer.attn_q_norm = ld.create("attn_q_norm", (hp.n_embd,), il)
        layer.attn_k_norm = ld.create("attn_k_norm", (hp.n_embd,), il)
        layer.ffn_norm = ld.create("ffn_norm", (hp.n_embd,), il)
        layer.ffn_gate_inp = ld.create("ffn_gate_inp", (hp.n_embd, hp.n_expert), il)
        layer.ffn_gate_exps = ld.create("ffn_gate_exps", (hp.n_embd, n_ff, hp.n_expert), il)
        layer.ffn_up_exps = ld.create("ffn_up_exps", (hp.n_embd, n_ff, hp.n_expert), il)
        layer.ffn_down_exps = ld.create("ffn_down_exps", (n_ff, hp.n_embd, hp.n_expert), il)


def build_graph(model, g):
    hp = model.hparams
    inpL = g.inp_embd(model.tok_embd)
    pos = g.inp_pos()
    out_ids = g.inp_out_ids()
    for il, layer in enumerate(model.layers):
        inpSA = inpL
        cur = g.cb(g.norm(inpL, layer.attn_norm, il=il), "attn_norm", il)
        cur = olmo2.attn_block(g, layer, cur, pos, il)
        if il == hp.n_layer - 1:
            cur, inpSA = g.select_outputs(cur, inpSA, out_ids=out_ids)
        ffn_inp = g.cb(ops.add(cur, inpSA), "ffn_inp", il)
        cur = g.cb(g.norm(ffn_inp, layer.ffn_norm, il=il), "ffn_norm", il)
        cur = g.moe_ffn(cur, layer.ffn_gate_inp, layer.ffn_up_exps, layer.ffn_gate_exps, layer.ffn_down_exps,
                        hp.n_expert, hp.n_expert_used, False, il)
        inpL = g.cb(ops.add(cur, ffn_inp), "l_out", il)
    cur = g.norm(inpL, model.output_norm)
    return g.finish(cur, g.lm_head(model.output, cur))
