"""qwen3next: Qwen3-Next, gated DeltaNet (linear attention) layers and gated attention layers, every one followed by
a mixture of experts with a sigmoid-gated shared expert. Each layer: RMS norm, the mixer, residual,
post_attention_norm, the MoE, residual.

- Gated DeltaNet (attention.recurrent_layers, else every layer but each full_attention_interval-th): q, k, v from
  one projection (attn_qkv, with attn_gate giving z; older files: ssm_in giving q, k, v, z interleaved per key
  head), a causal convolution over the sequence's last ssm.conv_kernel inputs (the rolling row of the recurrent
  memory) and SiLU; q and k L2-normed per head (as RMS norm with eps / n, times 1 / sqrt(n)) and repeated to the
  value heads (key head h serves value heads h * r .. h * r + r - 1); beta = sigmoid(b) and the log-decay
  softplus(a + dt_bias) * ssm_a from ssm_ba; the delta rule (gated_delta_net) on the state kept per sequence; an
  RMS norm per head gated by SiLU(z); the out-projection.
- Gated attention: attn_q gives each head's query and a gate side by side; Q and K RMS-normed per head, NeoX RoPE on
  the first rope.dimension_count dimensions; the attention's output times sigmoid(gate) before attn_output.
- MoE: softmax router, the chosen weights renormalised; the shared expert times sigmoid(ffn_gate_inp_shexp . x).
(llama.cpp's qwen3next graph with its fused gated delta net.)"""
from __future__ import annotations

import math

from ...ggml import ops
from ...ggml.tensor import Tensor
from .. import arch as A
from ..hparams import InvalidMetadata, Meta, MissingMetadata
from ._common import f32
from .mamba import conv_input, load_ssm_hparams


def _f32_inv_sqrt(n: int) -> float:
    """1.0f / sqrtf(n) as the C code computes it, in float32."""
    return f32(1.0 / f32(math.sqrt(n)))


def load_hparams(hp, md):
    load_gdn_hparams(hp, md)
    if not hp.n_expert:
        raise MissingMetadata(f"{hp.arch} needs {hp.arch}.expert_count and {hp.arch}.expert_used_count "
                              f"(llama.cpp: model cannot have zero experts)")


def load_gdn_hparams(hp, md):
    """What Qwen3-Next and Qwen 3.5 share: the gated DeltaNet's sizes, checked, and which layers are recurrent."""
    m = Meta(md, hp.arch)
    n_nextn = m.get_int("nextn_predict_layers", 0, lo=0)
    if n_nextn and hp.arch in ("qwen35", "qwen35moe") and n_nextn < hp.n_layer:
        # Qwen 3.5's multi-token-prediction blocks follow the trunk; llama.cpp skips them unless it drafts with them
        # (load_mtp), so the model is the first block_count - nextn_predict_layers layers
        n = hp.n_layer = hp.n_layer - n_nextn
        hp.n_ff_arr, hp.n_head_arr, hp.n_head_kv_arr = hp.n_ff_arr[:n], hp.n_head_arr[:n], hp.n_head_kv_arr[:n]
    elif n_nextn:
        raise InvalidMetadata(f"{hp.arch}: multi-token prediction layers (nextn_predict_layers) are not supported")
    load_ssm_hparams(hp, md, group=True)
    hp.n_ff_shexp = m.get_int("expert_shared_feed_forward_length", 0, lo=0)
    hp.rope_type = 2        # NEOX
    n_v, n_k = hp.ssm_dt_rank, hp.ssm_n_group
    if hp.ssm_d_inner % n_v or hp.ssm_d_inner // n_v != hp.ssm_d_state or n_v % n_k:
        raise InvalidMetadata(f"{hp.arch}: ssm.inner_size {hp.ssm_d_inner} must be ssm.time_step_rank ({n_v}) value "
                              f"heads of ssm.state_size ({hp.ssm_d_state}), a multiple of ssm.group_count ({n_k})")
    key = m.key("attention.recurrent_layers")
    if key in md:
        v = md[key]
        if isinstance(v, (str, bytes)) or not hasattr(v, "__len__") or len(v) != hp.n_layer + n_nextn:
            raise InvalidMetadata(f"{key} must hold one value per layer ({hp.n_layer + n_nextn})")
        hp.recurrent_layers = [bool(x) for x in v][:hp.n_layer]
    else:
        interval = m.get_int("full_attention_interval", 4, lo=1)
        hp.recurrent_layers = [(il + 1) % interval != 0 for il in range(hp.n_layer)]


def load_tensors(model, ld):
    hp = model.hparams
    E = hp.n_embd
    model.tok_embd = ld.create(A.TOKEN_EMBD, (E, hp.n_vocab))
    model.output_norm = ld.create(A.OUTPUT_NORM, (E,))
    model.output = ld.create(A.OUTPUT, (E, hp.n_vocab), required=False) or ld.tied(A.TOKEN_EMBD)
    d_k, n_k, n_v = hp.ssm_d_state, hp.ssm_n_group, hp.ssm_dt_rank
    key_dim, value_dim = d_k * n_k, hp.ssm_d_inner
    conv_dim = 2 * key_dim + value_dim
    n_ff_exp = hp.n_ff_exp or hp.n_ff() // hp.n_expert_used
    for il, layer in enumerate(model.layers):
        c = lambda name, ne, **kw: ld.create(name, ne, il, **kw)         # noqa: E731
        layer.attn_norm = c("attn_norm", (E,))
        layer.attn_post_norm = c("attn_post_norm", (E,))
        if hp.is_recurrent(il):
            layer.wqkv = c("attn_qkv", (E, conv_dim), required=False)
            if layer.wqkv is not None:
                layer.wqkv_gate = c("attn_gate", (E, value_dim))
                layer.ssm_in = None
            else:               # the older layout: q, k, v, z interleaved per key head in one matrix
                layer.ssm_in = c("ssm_in", (E, conv_dim + value_dim))
            layer.ssm_conv1d = c("ssm_conv1d", (hp.ssm_d_conv, conv_dim))
            layer.ssm_dt_b = c("ssm_dt", (n_v,), suffix="bias")
            layer.ssm_a = c("ssm_a", (n_v,), suffix=None)
            layer.ssm_beta_alpha = c("ssm_ba", (E, 2 * n_v))
            layer.ssm_norm = c("ssm_norm", (d_k,))
            layer.ssm_out = c("ssm_out", (value_dim, E))
        else:
            hd, n_head = hp.n_embd_head_k, hp.n_head(il)
            if hp.n_embd_head_v != hd:
                raise InvalidMetadata(f"{hp.arch}: attention.key_length {hd} and value_length "
                                      f"{hp.n_embd_head_v} must be equal")
            n_kv = hp.n_embd_k_gqa(il)
            layer.wqkv = c("attn_qkv", (E, 2 * hd * n_head + 2 * n_kv), required=False)
            if layer.wqkv is None:
                layer.wq = c("attn_q", (E, 2 * hd * n_head))
                layer.wk = c("attn_k", (E, n_kv))
                layer.wv = c("attn_v", (E, n_kv))
            layer.wo = c("attn_output", (hd * n_head, E))
            layer.attn_q_norm = c("attn_q_norm", (hd,))
            layer.attn_k_norm = c("attn_k_norm", (hd,))
        layer.ffn_gate_inp = c("ffn_gate_inp", (E, hp.n_expert))
        layer.ffn_gate_exps = c("ffn_gate_exps", (E, n_ff_exp, hp.n_expert))
        layer.ffn_up_exps = c("ffn_up_exps", (E, n_ff_exp, hp.n_expert))
        layer.ffn_down_exps = c("ffn_down_exps", (n_ff_exp, E, hp.n_expert))
        n_sh = hp.n_ff_shexp or hp.n_ff(il)
        layer.ffn_gate_inp_shexp = c("ffn_gate_inp_shexp", (E,))
        layer.ffn_gate_shexp = c("ffn_gate_shexp", (E, n_sh))
        layer.ffn_up_shexp = c("ffn_up_shexp", (E, n_sh))
        layer.ffn_down_shexp = c("ffn_down_shexp", (n_sh, E))


def l2_norm(x: Tensor, eps: float) -> Tensor:
    """build_gdn_l2_norm: x / sqrt(sum x^2 + eps) per row, as RMS norm with eps / n, then times 1 / sqrt(n)."""
    n = x.ne[0]
    return ops.scale(ops.rms_norm(x, f32(f32(eps) / n)), _f32_inv_sqrt(n))


# cur: [n_embd, n_tokens] -> (qkv [conv_dim, n_seq_tokens, n_seqs], z [d_state, n_v, n_seq_tokens, n_seqs])
def _qkvz(g, layer, cur, n_seq_tokens: int, n_seqs: int):
    hp = g.hp
    d, n_k, n_v = hp.ssm_d_state, hp.ssm_n_group, hp.ssm_dt_rank
    if layer.ssm_in is None:
        qkv = ops.reshape(g.mm(layer.wqkv, cur), 2 * d * n_k + d * n_v, n_seq_tokens, n_seqs)
        return qkv, ops.reshape(g.mm(layer.wqkv_gate, cur), d, n_v, n_seq_tokens, n_seqs)
    per_k = d * n_v // n_k                              # each key head's value (and z) width
    mixed = g.mm(layer.ssm_in, cur)
    mixed = ops.reshape(mixed, 2 * d + 2 * per_k, n_k, n_seq_tokens, n_seqs)
    nb1, nb2, nb3 = mixed.nb[1], mixed.nb[2], mixed.nb[3]
    part = lambda w, off: ops.view_4d(mixed, w, n_k, n_seq_tokens, n_seqs, nb1, nb2, nb3, off * 4)   # noqa: E731
    q, k, v, z = part(d, 0), part(d, d), part(per_k, 2 * d), part(per_k, 2 * d + per_k)
    flat = lambda t, w: ops.cont(t, w, n_seq_tokens, n_seqs)                                          # noqa: E731
    qkv = ops.concat(ops.concat(flat(q, d * n_k), flat(k, d * n_k), 0), flat(v, d * n_v), 0)
    return qkv, ops.reshape(ops.cont(z), d, n_v, n_seq_tokens, n_seqs)


def linear_attn(g, layer, cur, il: int):
    hp = g.hp
    d, n_k, n_v = hp.ssm_d_state, hp.ssm_n_group, hp.ssm_dt_rank
    n_seqs = g.n_seqs
    T = g.n_tokens // n_seqs
    qkv, z = _qkvz(g, layer, cur, T, n_seqs)
    ba = ops.reshape(g.mm(layer.ssm_beta_alpha, cur), 2 * n_v // n_k, n_k, T, n_seqs)
    r = n_v // n_k
    b = ops.view_4d(ba, r, n_k, T, n_seqs, ba.nb[1], ba.nb[2], ba.nb[3], 0)
    a = ops.view_4d(ba, r, n_k, T, n_seqs, ba.nb[1], ba.nb[2], ba.nb[3], r * 4)
    beta = ops.reshape(ops.sigmoid(ops.cont(b)), 1, n_v, T, n_seqs)
    alpha = ops.softplus(ops.add(ops.cont(a, n_v, T, n_seqs), layer.ssm_dt_b))
    gate = ops.reshape(ops.mul(alpha, layer.ssm_a), 1, n_v, T, n_seqs)     # -exp(A_log) * softplus
    conv_dim = 2 * d * n_k + d * n_v
    conv = ops.silu(ops.ssm_conv(conv_input(g, il, qkv, conv_dim), layer.ssm_conv1d))   # [conv_dim, T, n_seqs]
    conv = g.cb(conv, "conv_output_silu", il)
    nb1, nb2 = conv.nb[1], conv.nb[2]
    q = ops.view_4d(conv, d, n_k, T, n_seqs, d * 4, nb1, nb2, 0)
    k = ops.view_4d(conv, d, n_k, T, n_seqs, d * 4, nb1, nb2, d * n_k * 4)
    v = ops.view_4d(conv, d, n_v, T, n_seqs, d * 4, nb1, nb2, 2 * d * n_k * 4)
    q, k = l2_norm(q, hp.f_norm_rms_eps), l2_norm(k, hp.f_norm_rms_eps)
    if n_k != n_v:          # key head h serves value heads h * r .. h * r + r - 1
        rep = lambda t: ops.reshape(ops.repeat(ops.reshape(t, d, 1, n_k, T * n_seqs),        # noqa: E731
                                               Tensor(t.type, (d, r, n_k, T * n_seqs))), d, n_v, T, n_seqs)
        q, k = rep(q), rep(k)
    states, src = g.rs_s(il)
    state = ops.reshape(ops.get_rows(states, src), d, d, n_v, n_seqs)
    out = ops.gated_delta_net(q, k, v, gate, beta, state)
    n_y, n_s = d * n_v * T * n_seqs, hp.n_embd_s()
    g.rs_store_s(il, ops.view_2d(out, n_s, n_seqs, n_s * 4, n_y * 4))
    y = ops.reshape(ops.view_1d(out, n_y, 0), d, n_v, T, n_seqs)
    y = ops.mul(g.norm(y, layer.ssm_norm, il=il), ops.silu(z))
    y = g.cb(ops.reshape(y, d * n_v, g.n_tokens), "final_output", il)
    return g.mm(layer.ssm_out, y)


def attention(g, layer, cur, pos, il: int):
    hp = g.hp
    hd, n_head, n_head_kv = hp.n_embd_head_k, hp.n_head(il), hp.n_head_kv(il)
    n_tokens = cur.ne[1]
    if layer.wqkv is not None:
        qkv = g.mm(layer.wqkv, cur)
        n_q, n_kv = 2 * hd * n_head, hd * n_head_kv
        qg = ops.view_2d(qkv, n_q, n_tokens, qkv.nb[1], 0)
        k = ops.cont(ops.view_2d(qkv, n_kv, n_tokens, qkv.nb[1], n_q * 4))
        v = ops.cont(ops.view_2d(qkv, n_kv, n_tokens, qkv.nb[1], (n_q + n_kv) * 4))
        qg = ops.cont(qg)
    else:
        qg, k, v = g.mm(layer.wq, cur), g.mm(layer.wk, cur), g.mm(layer.wv, cur)
    qg = ops.reshape(qg, 2 * hd, n_head, n_tokens)
    q = ops.view_3d(qg, hd, n_head, n_tokens, qg.nb[1], qg.nb[2], 0)
    gate = ops.view_3d(qg, hd, n_head, n_tokens, qg.nb[1], qg.nb[2], hd * 4)
    k = ops.reshape(k, hd, n_head_kv, n_tokens)
    v = ops.reshape(v, hd, n_head_kv, n_tokens)
    q = g.cb(g.norm(q, layer.attn_q_norm, il=il), "Qcur_normed", il)
    k = g.cb(g.norm(k, layer.attn_k_norm, il=il), "Kcur_normed", il)
    q, k = g.cb(g.rope(q, pos, il), "Qcur", il), g.cb(g.rope(k, pos, il), "Kcur", il)
    kq_scale = hp.f_attention_scale or _f32_inv_sqrt(hd)
    cur = g.cb(g.attn(il, None, None, q, k, v, kq_scale), "attn_pregate", il)
    cur = ops.mul(cur, g.cb(ops.sigmoid(ops.cont(gate, hd * n_head, n_tokens)), "gate_sigmoid", il))
    return g.mm(layer.wo, g.cb(cur, "attn_gated", il))


def ffn(g, layer, cur, il: int):
    hp = g.hp
    moe = g.moe_ffn(cur, layer.ffn_gate_inp, layer.ffn_up_exps, layer.ffn_gate_exps, layer.ffn_down_exps,
                    hp.n_expert, hp.n_expert_used, True, il)
    shared = g.ffn(cur, layer.ffn_up_shexp, None, layer.ffn_gate_shexp, None, layer.ffn_down_shexp, None, "silu",
                   il=il)
    shared = ops.mul(shared, ops.sigmoid(g.mm(layer.ffn_gate_inp_shexp, cur)))
    return g.cb(ops.add(moe, shared), "ffn_out", il)


def build_graph(model, g):
    hp = model.hparams
    inpL = g.inp_embd(model.tok_embd)
    pos = g.inp_pos()
    out_ids = g.inp_out_ids()
    for il, layer in enumerate(model.layers):
        cur = g.cb(g.norm(inpL, layer.attn_norm, il=il), "attn_norm", il)
        cur = linear_attn(g, layer, cur, il) if hp.is_recurrent(il) else attention(g, layer, cur, pos, il)
        cur = g.cb(ops.add(cur, inpL), "attn_residual", il)
        ffn_out = ffn(g, layer, g.cb(g.norm(cur, layer.attn_post_norm, il=il), "attn_post_norm", il), il)
        inpL = g.cb(ops.add(ffn_out, cur), "l_out", il)
    cur = g.norm(inpL, model.output_norm)
    # the rows that return outputs are chosen after the final norm: the last layer runs on every token, as
    # llama.cpp's graph has it (batch-size dependent sums in the experts' products stay the same)
    (cur,) = g.select_outputs(cur, out_ids=out_ids)
    return g.finish(cur, g.lm_head(model.output, cur))
