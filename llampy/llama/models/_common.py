"""Tensor-loading pieces shared by the architecture files (llama.cpp's create_tensor_qkv and the output head)."""
from __future__ import annotations

import struct

from .. import arch as A


def f32(x: float) -> float:
    """x rounded to float32, as a float: the C code's float arithmetic without numpy (model files import none).
    One double operation rounded to float32 gives the float32 operation's result for +, -, *, / and sqrt."""
    return struct.unpack("f", struct.pack("f", x))[0]


def load_embd_and_output(model, ld, norm_bias: bool = False):
    hp = model.hparams
    model.tok_embd = ld.create(A.TOKEN_EMBD, (hp.n_embd, hp.n_vocab))
    model.output_norm = ld.create(A.OUTPUT_NORM, (hp.n_embd,))
    model.output_norm_b = ld.create(A.OUTPUT_NORM, (hp.n_embd,), suffix="bias") if norm_bias else None
    # a missing output matrix is tied to the token embedding (a copy of it on the output head's device, as
    # llama.cpp's TENSOR_DUPLICATED, when that is not the CPU)
    model.output = ld.create(A.OUTPUT, (hp.n_embd, hp.n_vocab), required=False) or ld.tied(A.TOKEN_EMBD)


def load_qkv(model, ld, layer, il: int, bias: bool = False, bias_required: bool = False):
    hp = model.hparams
    n_q = hp.n_embd_head_k * hp.n_head(il)
    n_k, n_v = hp.n_embd_k_gqa(il), hp.n_embd_v_gqa(il)
    layer.wqkv = ld.create("attn_qkv", (hp.n_embd, n_q + n_k + n_v), il, required=False)
    layer.wo = ld.create("attn_output", (n_q, hp.n_embd), il)
    if layer.wqkv is not None:
        layer.bqkv = ld.create("attn_qkv", (n_q + n_k + n_v,), il, required=bias_required, suffix="bias") if bias else None
        return
    layer.wq = ld.create("attn_q", (hp.n_embd, n_q), il)
    layer.wk = ld.create("attn_k", (hp.n_embd, n_k), il)
    layer.wv = ld.create("attn_v", (hp.n_embd, n_v), il)
    if bias:
        layer.bq = ld.create("attn_q", (n_q,), il, required=bias_required, suffix="bias")
        layer.bk = ld.create("attn_k", (n_k,), il, required=bias_required, suffix="bias")
        layer.bv = ld.create("attn_v", (n_v,), il, required=bias_required, suffix="bias")


def load_ffn(model, ld, layer, il: int, n_ff: int | None = None, gate: bool = True, bias: bool = False):
    hp = model.hparams
    n_ff = n_ff or hp.n_ff(il)
    layer.ffn_gate = ld.create("ffn_gate", (hp.n_embd, n_ff), il) if gate else None
    layer.ffn_up = ld.create("ffn_up", (hp.n_embd, n_ff), il)
    layer.ffn_down = ld.create("ffn_down", (n_ff, hp.n_embd), il)
    layer.ffn_up_b = ld.create("ffn_up", (n_ff,), il, required=False, suffix="bias") if bias else None
    layer.ffn_down_b = ld.create("ffn_down", (hp.n_embd,), il, required=False, suffix="bias") if bias else None
