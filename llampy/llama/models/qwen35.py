"""qwen35, qwen35moe: Qwen 3.5, Qwen3-Next's hybrid (gated DeltaNet layers, gated attention every
full_attention_interval-th layer) with three changes (llama.cpp's qwen35 and qwen35moe graphs):

- beta and the decay's input come from two projections, ssm_beta and ssm_alpha, one value per value head;
- q and k are not repeated to the value heads: the delta rule's op pairs value head h with key head h % n_k (the
  broadcast of ggml_gated_delta_net, which llama.cpp's CPU build runs fused), not Qwen3-Next's h // r;
- positions by interleaved M-RoPE (``rope.dimension_sections``). A text token's t, h and w positions are equal, so
  on text it is NeoX RoPE when the sections give every rotated pair one of those three (Qwen 3.5's 11, 11, 10 over
  32 pairs); a file whose sections leave pairs to the fourth row is refused. Images (mtmd) are not supported.

qwen35 follows each mixer with a SwiGLU feed-forward, qwen35moe with Qwen3-Next's experts and gated shared expert.
Multi-token-prediction blocks (nextn_predict_layers, after the trunk) are skipped, as llama.cpp does when it does not
draft with them."""
from __future__ import annotations

from ...ggml import ops
from .. import arch as A
from ..hparams import InvalidMetadata, Meta
from . import qwen3next
from .mamba import conv_input


def _imrope_text_is_neox(sections, n_rot: int) -> bool:
    """Whether every rotated pair takes its angle from row t, h or w under ggml's interleaved M-RoPE (pair j's sector
    j % sum: t where sector % 3 == 0 and sector < 3 * s_t, likewise h and w; else the fourth row, 0 for text)."""
    s0, s1, s2, s3 = sections
    total = s0 + s1 + s2 + s3
    for j in range(n_rot // 2):
        sector = j % total
        if not ((sector % 3 == 0 and sector < 3 * s0) or (sector % 3 == 1 and sector < 3 * s1)
                or (sector % 3 == 2 and sector < 3 * s2)):
            return False
    return True


def load_hparams(hp, md):
    m = Meta(md, hp.arch)
    key = m.key("rope.dimension_sections")
    sect = md.get(key)
    if sect is None:
        raise InvalidMetadata(f"metadata {key!r} is missing (Qwen 3.5's M-RoPE needs it)")
    sect = [int(x) for x in list(sect)[:4]] + [0] * max(0, 4 - len(sect))
    if any(x < 0 for x in sect) or not any(sect[:3]):
        raise InvalidMetadata(f"metadata {key!r} is {sect}")
    if not _imrope_text_is_neox(sect, hp.n_rot):
        raise InvalidMetadata(f"{hp.arch}: rope.dimension_sections {sect} leave some of the {hp.n_rot // 2} rotated "
                              f"pairs to the fourth position row; llampy runs Qwen 3.5's M-RoPE on text only, where "
                              f"the sections must cover every pair")
    if hp.arch == "qwen35moe":
        qwen3next.load_hparams(hp, md)          # the experts are Qwen3-Next's
    else:
        if hp.n_expert:
            raise InvalidMetadata(f"{hp.arch} is the dense Qwen 3.5 (expert_count {hp.n_expert}): a mixture of "
                                  f"experts is qwen35moe")
        qwen3next.load_gdn_hparams(hp, md)
    hp.rope_sections = tuple(sect)
    hp.rope_type = 2        # NEOX: the M-RoPE of text (above)


def load_tensors(model, ld):
    hp = model.hparams
    moe = hp.arch == "qwen35moe"
    E = hp.n_embd
    model.tok_embd = ld.create(A.TOKEN_EMBD, (E, hp.n_vocab))
    model.output_norm = ld.create(A.OUTPUT_NORM, (E,))
    model.output = ld.create(A.OUTPUT, (E, hp.n_vocab), required=False) or ld.tied(A.TOKEN_EMBD)
    d_k, n_k, n_v = hp.ssm_d_state, hp.ssm_n_group, hp.ssm_dt_rank
    key_dim, value_dim = d_k * n_k, hp.ssm_d_inner
    conv_dim = 2 * key_dim + value_dim
    for il, layer in enumerate(model.layers):
        c = lambda name, ne, **kw: ld.create(name, ne, il, **kw)         # noqa: E731
        layer.attn_norm = c("attn_norm", (E,))
        layer.attn_post_norm = c("attn_post_norm", (E,))
        if hp.is_recurrent(il):
            layer.wqkv = c("attn_qkv", (E, conv_dim))
            layer.wqkv_gate = c("attn_gate", (E, value_dim))
            layer.ssm_conv1d = c("ssm_conv1d", (hp.ssm_d_conv, conv_dim))
            layer.ssm_dt_b = c("ssm_dt", (n_v,), suffix="bias")
            layer.ssm_a = c("ssm_a", (n_v,), suffix=None)
            layer.ssm_beta = c("ssm_beta", (E, n_v))
            layer.ssm_alpha = c("ssm_alpha", (E, n_v))
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
        if moe:
            n_ff_exp = hp.n_ff_exp or hp.n_ff() // hp.n_expert_used
            layer.ffn_gate_inp = c("ffn_gate_inp", (E, hp.n_expert))
            layer.ffn_gate_exps = c("ffn_gate_exps", (E, n_ff_exp, hp.n_expert))
            layer.ffn_up_exps = c("ffn_up_exps", (E, n_ff_exp, hp.n_expert))
            layer.ffn_down_exps = c("ffn_down_exps", (n_ff_exp, E, hp.n_expert))
            n_sh = hp.n_ff_shexp or hp.n_ff(il)
            layer.ffn_gate_inp_shexp = c("ffn_gate_inp_shexp", (E,))
            layer.ffn_gate_shexp = c("ffn_gate_shexp", (E, n_sh))
            layer.ffn_up_shexp = c("ffn_up_shexp", (E, n_sh))
            layer.ffn_down_shexp = c("ffn_down_shexp", (n_sh, E))
        else:
            layer.ffn_gate = c("ffn_gate", (E, hp.n_ff(il)))
            layer.ffn_up = c("ffn_up", (E, hp.n_ff(il)))
            layer.ffn_down = c("ffn_down", (hp.n_ff(il), E))


def linear_attn(g, layer, cur, il: int):
    hp = g.hp
    d, n_k, n_v = hp.ssm_d_state, hp.ssm_n_group, hp.ssm_dt_rank
    n_seqs = g.n_seqs
    T = g.n_tokens // n_seqs
    qkv = ops.reshape(g.mm(layer.wqkv, cur), 2 * d * n_k + d * n_v, T, n_seqs)
    z = ops.reshape(g.mm(layer.wqkv_gate, cur), d, n_v, T, n_seqs)
    beta = g.cb(ops.sigmoid(ops.reshape(g.mm(layer.ssm_beta, cur), 1, n_v, T, n_seqs)), "beta_sigmoid", il)
    alpha = ops.reshape(g.mm(layer.ssm_alpha, cur), n_v, T, n_seqs)
    alpha = g.cb(ops.softplus(ops.add(alpha, layer.ssm_dt_b)), "a_softplus", il)
    gate = ops.reshape(g.cb(ops.mul(alpha, layer.ssm_a), "gate", il), 1, n_v, T, n_seqs)   # -exp(A_log) * softplus
    conv_dim = 2 * d * n_k + d * n_v
    conv = ops.silu(ops.ssm_conv(conv_input(g, il, qkv, conv_dim), layer.ssm_conv1d))   # [conv_dim, T, n_seqs]
    conv = g.cb(conv, "conv_output_silu", il)
    nb1, nb2 = conv.nb[1], conv.nb[2]
    q = ops.view_4d(conv, d, n_k, T, n_seqs, d * 4, nb1, nb2, 0)
    k = ops.view_4d(conv, d, n_k, T, n_seqs, d * 4, nb1, nb2, d * n_k * 4)
    v = ops.view_4d(conv, d, n_v, T, n_seqs, d * 4, nb1, nb2, 2 * d * n_k * 4)
    q = g.cb(qwen3next.l2_norm(q, hp.f_norm_rms_eps), "q_conv_predelta", il)
    k = g.cb(qwen3next.l2_norm(k, hp.f_norm_rms_eps), "k_conv_predelta", il)
    states, src = g.rs_s(il)
    state = ops.reshape(ops.get_rows(states, src), d, d, n_v, n_seqs)
    out = ops.gated_delta_net(q, k, v, gate, beta, state)      # value head h reads key head h % n_k
    n_y, n_s = d * n_v * T * n_seqs, hp.n_embd_s()
    g.rs_store_s(il, ops.view_2d(out, n_s, n_seqs, n_s * 4, n_y * 4))
    y = ops.reshape(ops.view_1d(out, n_y, 0), d, n_v, T, n_seqs)
    y = ops.mul(g.norm(y, layer.ssm_norm, il=il), ops.silu(z))
    y = g.cb(ops.reshape(y, d * n_v, g.n_tokens), "final_output", il)
    return g.mm(layer.ssm_out, y)


def ffn(g, layer, cur, il: int):
    if g.hp.arch == "qwen35moe":
        return qwen3next.ffn(g, layer, cur, il)
    return g.cb(g.ffn(cur, layer.ffn_up, None, layer.ffn_gate, None, layer.ffn_down, None, "silu", il=il),
                "ffn_out", il)


def build_graph(model, g):
    hp = model.hparams
    inpL = g.inp_embd(model.tok_embd)
    pos = g.inp_pos()
    out_ids = g.inp_out_ids()
    for il, layer in enumerate(model.layers):
        cur = g.cb(g.norm(inpL, layer.attn_norm, il=il), "attn_norm", il)
        if hp.is_recurrent(il):
            cur = linear_attn(g, layer, cur, il)
        else:
            cur = qwen3next.attention(g, layer, cur, pos, il)
        cur = g.cb(ops.add(cur, inpL), "attn_residual", il)
        ffn_out = ffn(g, layer, g.cb(g.norm(cur, layer.attn_post_norm, il=il), "attn_post_norm", il), il)
        inpL = g.cb(ops.add(ffn_out, cur), "l_out", il)
    cur = g.norm(inpL, model.output_norm)
    # output rows chosen after the final norm, as llama.cpp's graph (without MTP) has it
    (cur,) = g.select_outputs(cur, out_ids=out_ids)
    return g.finish(cur, g.lm_head(model.output, cur))
