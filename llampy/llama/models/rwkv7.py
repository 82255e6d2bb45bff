"""rwkv7: RWKV-7 ("Goose") blocks, laid out as RWKV-6's (layer norm, time mix, residual, layer norm, channel mix,
residual, with token shift). The time mix's state follows the generalised delta rule (rwkv_wkv7): per token a decay
w, an in-context learning rate a that removes part of the state along the normalised key kk, and a value mixed
with the first layer's value by a low-rank gate; a per-head bonus r.(k * r_k) v is added after the group norm
(llama.cpp's rwkv7 graph)."""
from __future__ import annotations

from ...ggml import ops
from ...ggml.tensor import Tensor
from ..hparams import Meta
from .mamba import _positive
from .rwkv6 import build_blocks, group_norm, load_norms, load_wkv_hparams, wkv_split, wkv_state

W_SCALE = -0.606531           # exp(-0.5): the decay is exp(-e^-0.5 sigmoid(.)), as llama.cpp writes it
L2_EPS = 1e-12


def load_hparams(hp, md):
    load_wkv_hparams(hp, md)
    m = Meta(md, hp.arch)
    hp.n_lora_decay = _positive(m, "attention.decay_lora_rank")
    hp.n_lora_iclr = _positive(m, "attention.iclr_lora_rank")
    hp.n_lora_value_res_mix = _positive(m, "attention.value_residual_mix_lora_rank")
    hp.n_lora_gate = _positive(m, "attention.gate_lora_rank", required=False)


def load_tensors(model, ld):
    hp = model.hparams
    E, F = hp.n_embd, hp.n_ff()
    load_norms(model, ld)
    for il, layer in enumerate(model.layers):
        c = lambda name, ne, **kw: ld.create(name, ne, il, **kw)
        v_rank = hp.n_lora_iclr if il == 0 else hp.n_lora_value_res_mix     # layer 0's value gate is unused
        for x, rank in (("w", hp.n_lora_decay), ("a", hp.n_lora_iclr), ("v", v_rank)):
            setattr(layer, f"time_mix_{x}0", c(f"time_mix_{x}0", (E,)))
            setattr(layer, f"time_mix_{x}1", c(f"time_mix_{x}1", (E, rank)))
            setattr(layer, f"time_mix_{x}2", c(f"time_mix_{x}2", (rank, E)))
        layer.time_mix_g1 = c("time_mix_g1", (E, hp.n_lora_gate))
        layer.time_mix_g2 = c("time_mix_g2", (hp.n_lora_gate, E))
        layer.time_mix_lerp_fused = c("time_mix_lerp_fused", (E, 1, 1, 6))
        for name in ("time_mix_k_k", "time_mix_k_a", "time_mix_r_k"):
            setattr(layer, name, c(name, (E,)))
        for name in ("time_mix_key", "time_mix_value", "time_mix_receptance", "time_mix_output"):
            setattr(layer, name, c(name, (E, E)))
        layer.time_mix_ln = c("time_mix_ln", (E,))
        layer.time_mix_ln_b = c("time_mix_ln", (E,), suffix="bias")
        layer.channel_mix_lerp_k = c("channel_mix_lerp_k", (E, 1, 1))
        layer.channel_mix_key = c("channel_mix_key", (E, F))
        layer.channel_mix_value = c("channel_mix_value", (F, E))


def time_mix(g, layer, cur, x_prev, il: int, carry: dict):
    hp = g.hp
    E, n_tokens, S = hp.n_embd, g.n_tokens, hp.wkv_head_size
    H = E // S
    n_parts = layer.time_mix_lerp_fused.ne[3]
    sx = ops.sub(x_prev, cur)                                            # [E, n_seq_tokens, n_seqs]
    sx = ops.repeat(sx, Tensor(sx.type, (E, sx.ne[1], sx.ne[2], n_parts)))     # the shape to tile to
    xxx = ops.add(ops.mul(sx, layer.time_mix_lerp_fused), cur)          # [E, n_seq_tokens, n_seqs, 6]
    xr, xw, xk, xv, xa, *xg = (ops.view_2d(xxx, E, n_tokens, xxx.nb[1], i * E * n_tokens * 4)
                               for i in range(n_parts))
    r = g.mm(layer.time_mix_receptance, xr)
    w = ops.add(ops.mul_mat(layer.time_mix_w2, ops.tanh(ops.mul_mat(layer.time_mix_w1, xw))), layer.time_mix_w0)
    w = ops.exp(ops.scale(ops.sigmoid(w), W_SCALE))
    k = g.mm(layer.time_mix_key, xk)
    v = g.mm(layer.time_mix_value, xv)
    if "v_first" not in carry:
        carry["v_first"] = v
    else:                          # the first layer's value as a residual, through a low-rank gate
        gate = ops.sigmoid(ops.add(ops.mul_mat(layer.time_mix_v2, ops.mul_mat(layer.time_mix_v1, xv)),
                                   layer.time_mix_v0))
        v = ops.add(v, ops.mul(ops.sub(carry["v_first"], v), gate))
    gate = None         # ARWKV-7's files may have no gate (five interpolations) and no group norm
    if layer.time_mix_g1 is not None and layer.time_mix_g2 is not None:
        gate = ops.mul_mat(layer.time_mix_g2, ops.sigmoid(ops.mul_mat(layer.time_mix_g1, xg[0])))
    a = ops.sigmoid(ops.add(ops.mul_mat(layer.time_mix_a2, ops.mul_mat(layer.time_mix_a1, xa)), layer.time_mix_a0))
    kk = ops.l2_norm(ops.reshape(ops.mul(k, layer.time_mix_k_k), S, H, n_tokens), L2_EPS)
    ka = ops.mul(k, layer.time_mix_k_a)
    k = ops.add(k, ops.sub(ops.mul(a, ka), ka))
    r, w, k, v, a = (ops.reshape(t, S, H, n_tokens) for t in (r, w, k, v, a))
    out = ops.rwkv_wkv7(r, w, k, v, ops.neg(kk), ops.mul(kk, a), wkv_state(g, il))
    cur = wkv_split(g, il, out)
    if layer.time_mix_ln is not None and layer.time_mix_ln_b is not None:
        cur = group_norm(g, cur, layer.time_mix_ln, layer.time_mix_ln_b)
    rk = ops.sum_rows(ops.mul(ops.mul(k, r), ops.reshape(layer.time_mix_r_k, S, H)))     # [1, H, n_tokens]
    cur = ops.add(cur, ops.reshape(ops.mul(v, rk), E, n_tokens))
    return g.mm(layer.time_mix_output, ops.mul(cur, gate) if gate is not None else cur)


def channel_mix(g, layer, cur, x_prev):
    sx = ops.sub(x_prev, cur)
    xk = ops.add(ops.mul(sx, layer.channel_mix_lerp_k), cur)
    return g.mm(layer.channel_mix_value, ops.sqr(ops.relu(g.mm(layer.channel_mix_key, xk))))


def build_graph(model, g):
    return build_blocks(model, g, time_mix, channel_mix)
