"""mamba2: Mamba-2 blocks, laid out as Mamba-1's (norm, mixer, residual). The mixer's in-projection gives z, the
convolution's input xBC (x, then B and C for n_group groups) and dt per head; A and D are one number per head;
the gated output is RMS-normed per group before the out-projection (llama.cpp's build_mamba2_layer)."""
from __future__ import annotations

from ...ggml import ops
from ._common import load_embd_and_output
from .mamba import build_blocks, conv_input, load_ssm_hparams


def check_mamba2_hparams(hp):
    if hp.ssm_d_inner % hp.ssm_dt_rank or hp.ssm_d_inner % hp.ssm_n_group or hp.ssm_dt_rank % hp.ssm_n_group:
        raise ValueError(f"ssm.inner_size {hp.ssm_d_inner} does not split into {hp.ssm_dt_rank} heads "
                         f"(ssm.time_step_rank) in {hp.ssm_n_group} groups (ssm.group_count)")


def load_hparams(hp, md):
    load_ssm_hparams(hp, md, group=True)
    check_mamba2_hparams(hp)


def load_mamba2_layer(hp, ld, layer, il: int, conv_bias_required: bool = True, norm_required: bool = True):
    """A Mamba-2 mixer's tensors (the convolution's bias optional in the hybrids' files, the grouped norm in
    Falcon-H1's)."""
    d_conv, d_inner, d_state, n_group, n_head = hp.ssm_d_conv, hp.ssm_d_inner, hp.ssm_d_state, hp.ssm_n_group, \
        hp.ssm_dt_rank
    conv_dim = d_inner + 2 * n_group * d_state
    layer.ssm_in = ld.create("ssm_in", (hp.n_embd, d_inner + conv_dim + n_head), il)
    layer.ssm_conv1d = ld.create("ssm_conv1d", (d_conv, conv_dim), il)
    layer.ssm_conv1d_b = ld.create("ssm_conv1d", (conv_dim,), il, suffix="bias", required=conv_bias_required)
    layer.ssm_dt_b = ld.create("ssm_dt", (n_head,), il, suffix="bias")
    layer.ssm_a = ld.create("ssm_a", (1, n_head), il, suffix=None)
    layer.ssm_d = ld.create("ssm_d", (1, n_head), il, suffix=None)
    layer.ssm_norm = ld.create("ssm_norm", (d_inner // n_group, n_group), il, required=norm_required)
    layer.ssm_out = ld.create("ssm_out", (d_inner, hp.n_embd), il)


def load_tensors(model, ld):
    hp = model.hparams
    load_embd_and_output(model, ld)
    for il, layer in enumerate(model.layers):
        layer.attn_norm = ld.create("attn_norm", (hp.n_embd,), il)
        load_mamba2_layer(hp, ld, layer, il)


def mamba2_layer(g, layer, cur, il: int):
    hp = g.hp
    d_inner, d_state, n_group, n_head = hp.ssm_d_inner, hp.ssm_d_state, hp.ssm_n_group, hp.ssm_dt_rank
    head_dim = d_inner // n_head
    conv_dim = d_inner + 2 * n_group * d_state
    n_seqs = g.n_seqs
    n_seq_tokens = g.n_tokens // n_seqs
    zxBCdt = g.mm(layer.ssm_in, cur)
    zxBCdt = ops.reshape(zxBCdt, zxBCdt.ne[0], n_seq_tokens, n_seqs)
    nb1, nb2 = zxBCdt.nb[1], zxBCdt.nb[2]
    z = ops.view_4d(zxBCdt, head_dim, n_head, n_seq_tokens, n_seqs, head_dim * 4, nb1, nb2, 0)
    xBC = ops.view_3d(zxBCdt, conv_dim, n_seq_tokens, n_seqs, nb1, nb2, d_inner * 4)
    dt = ops.view_3d(zxBCdt, n_head, n_seq_tokens, n_seqs, nb1, nb2, (d_inner + conv_dim) * 4)
    xBC = ops.ssm_conv(conv_input(g, il, xBC, conv_dim), layer.ssm_conv1d)    # [conv_dim, n_seq_tokens, n_seqs]
    if layer.ssm_conv1d_b is not None:
        xBC = ops.add(xBC, layer.ssm_conv1d_b)
    xBC = g.cb(ops.silu(xBC), "ssm_conv", il)
    nb1, nb2 = xBC.nb[1], xBC.nb[2]
    x = ops.view_4d(xBC, head_dim, n_head, n_seq_tokens, n_seqs, head_dim * 4, nb1, nb2, 0)
    B = ops.view_4d(xBC, d_state, n_group, n_seq_tokens, n_seqs, d_state * 4, nb1, nb2, d_inner * 4)
    C = ops.view_4d(xBC, d_state, n_group, n_seq_tokens, n_seqs, d_state * 4, nb1, nb2, (d_inner + n_group * d_state) * 4)
    dt = ops.add(ops.cont(dt), layer.ssm_dt_b)
    states, src = g.rs_s(il)
    ssm = ops.reshape(states, d_state, head_dim, n_head, states.ne[1])
    y_ssm = ops.ssm_scan(ssm, x, dt, layer.ssm_a, B, C, src)
    n_s = d_state * d_inner
    g.rs_store_s(il, ops.view_2d(y_ssm, n_s, n_seqs, n_s * 4, x.nelements * 4))
    row = head_dim * 4
    y = ops.view_4d(y_ssm, head_dim, n_head, n_seq_tokens, n_seqs, row, n_head * row, n_seq_tokens * n_head * row, 0)
    y = g.cb(ops.add(y, ops.mul(x, layer.ssm_d)), "mamba2_y_add_d", il)
    y = ops.swiglu(ops.cont(z), y)
    if layer.ssm_norm is not None:                                              # grouped RMS norm
        y = g.norm(ops.reshape(y, d_inner // n_group, n_group, n_seq_tokens, n_seqs), layer.ssm_norm, il=il)
    return g.mm(layer.ssm_out, ops.reshape(y, d_inner, g.n_tokens))


def build_graph(model, g):
    return build_blocks(model, g, mamba2_layer)
