"""rwkv6qwen2: RWKV-6 Qwen2 ("QRWKV6"), Qwen2 blocks whose attention is RWKV-6's time mix in its QRWKV form (no
time_mix_first: gated_linear_attn, a sigmoid gate, grouped key/value heads, r/k/v biases). Each layer: RMS norm,
the time mix over the previous token's normed input (one token-shift row per sequence in the recurrent memory, with
the wkv state), residual, RMS norm, SwiGLU feed-forward, residual (llama.cpp's rwkv6qwen2 graph)."""
from __future__ import annotations

from ...ggml import ops
from .. import arch as A
from .mamba import _positive
from .rwkv6 import last_token, load_wkv_hparams, time_mix, token_shift


def load_hparams(hp, md):
    m = load_wkv_hparams(hp, md, shift_rows=1)
    hp.time_mix_extra_dim = _positive(m, "time_mix_extra_dim")
    hp.time_decay_extra_dim = _positive(m, "time_decay_extra_dim")
    n_head, n_kv = hp.n_embd // hp.wkv_head_size, hp.n_head_kv()
    if n_kv and n_head % n_kv:
        raise ValueError(f"attention.head_count_kv {n_kv} does not divide the {n_head} heads of wkv.head_size "
                         f"{hp.wkv_head_size}")


def load_tensors(model, ld):
    hp = model.hparams
    E, S, F = hp.n_embd, hp.wkv_head_size, hp.n_ff()
    n_kv = hp.n_head_kv()
    kv = E if n_kv in (0, E // S) else n_kv * S
    model.tok_embd = ld.create(A.TOKEN_EMBD, (E, hp.n_vocab))
    model.output_norm = ld.create(A.OUTPUT_NORM, (E,))
    model.output_norm_b = ld.create(A.OUTPUT_NORM, (E,), required=False, suffix="bias")
    model.output = ld.create(A.OUTPUT, (E, hp.n_vocab))
    for il, layer in enumerate(model.layers):
        c = lambda name, ne, **kw: ld.create(name, ne, il, **kw)         # noqa: E731
        layer.attn_norm = c("attn_norm", (E,))
        layer.time_mix_w1 = c("time_mix_w1", (E, hp.time_mix_extra_dim * 5))
        layer.time_mix_w2 = c("time_mix_w2", (hp.time_mix_extra_dim, E, 5))
        layer.time_mix_lerp_x = c("time_mix_lerp_x", (E, 1, 1))
        layer.time_mix_lerp_fused = c("time_mix_lerp_fused", (E, 1, 1, 5))
        layer.time_mix_first = c("time_mix_first", (S, E // S), required=False)
        layer.time_mix_decay = c("time_mix_decay", (E,))
        layer.time_mix_decay_w1 = c("time_mix_decay_w1", (E, hp.time_decay_extra_dim))
        layer.time_mix_decay_w2 = c("time_mix_decay_w2", (hp.time_decay_extra_dim, E))
        layer.time_mix_key = c("time_mix_key", (E, kv))
        layer.time_mix_value = c("time_mix_value", (E, kv))
        layer.time_mix_receptance = c("time_mix_receptance", (E, E))
        layer.time_mix_gate = c("time_mix_gate", (E, E))
        layer.time_mix_key_b = c("time_mix_key", (kv,), required=False, suffix="bias")
        layer.time_mix_value_b = c("time_mix_value", (kv,), required=False, suffix="bias")
        layer.time_mix_receptance_b = c("time_mix_receptance", (E,), required=False, suffix="bias")
        layer.time_mix_output = c("time_mix_output", (E, E))
        if layer.time_mix_first is not None:      # RWKV-6's form needs its group norm (llama.cpp loads none here)
            from ..model import ModelLoadError
            raise ModelLoadError(f"{hp.arch}: blk.{il}.time_mix_first is present; only the QRWKV time mix is built")
        layer.ffn_norm = c("ffn_norm", (E,))
        layer.ffn_gate = c("ffn_gate", (E, F))
        layer.ffn_up = c("ffn_up", (E, F))
        layer.ffn_down = c("ffn_down", (F, E))


def build_blocks(model, g, time_mix_fn):
    """Per layer: the token-shift row in, RMS norm, time mix, residual, RMS norm, SwiGLU, residual (llama.cpp's
    rwkv6qwen2 and arwkv7 graphs)."""
    hp = model.hparams
    E, n_seqs = hp.n_embd, g.n_seqs
    T = g.n_tokens // n_seqs
    inpL = g.inp_embd(model.tok_embd)
    out_ids = g.inp_out_ids()
    carry = {}                      # what a time mix hands the next layer's (ARWKV-7's first-layer value)
    for il, layer in enumerate(model.layers):
        inpL = ops.reshape(inpL, E, T, n_seqs)
        shift = ops.reshape(g.rs_get_r(il), E, 1, n_seqs)
        att_norm = g.cb(g.norm(inpL, layer.attn_norm, il=il), "attn_norm", il)
        cur = time_mix_fn(g, layer, att_norm, token_shift(att_norm, shift), il, carry)
        g.rs_store_r(il, ops.cont(last_token(att_norm), E, n_seqs))
        ffn_inp = g.cb(ops.reshape(ops.add(ops.reshape(cur, E, T, n_seqs), inpL), E, g.n_tokens), "ffn_inp", il)
        if il == hp.n_layer - 1:
            (ffn_inp,) = g.select_outputs(ffn_inp, out_ids=out_ids)
        cur = g.cb(g.norm(ffn_inp, layer.ffn_norm, il=il), "ffn_norm", il)
        cur = g.ffn(cur, layer.ffn_up, None, layer.ffn_gate, None, layer.ffn_down, None, "silu", il=il)
        inpL = g.cb(ops.add(cur, ffn_inp), "l_out", il)
    cur = g.norm(inpL, model.output_norm, getattr(model, "output_norm_b", None))
    return g.finish(cur, g.lm_head(model.output, cur))


def build_graph(model, g):
    return build_blocks(model, g, lambda g, layer, cur, x_prev, il, _: time_mix(g, layer, cur, x_prev, il))
