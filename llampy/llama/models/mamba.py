"""mamba: Mamba-1 blocks. Each layer is RMS norm, the selective state-space mixer, a residual add; no attention
and no feed-forward. The mixer: in-projection to x and z, a causal depthwise convolution over the sequence's last
d_conv inputs (its rolling row in the recurrent memory), SiLU, a data-dependent scan whose state is carried per
sequence, the skip term D * x, a SiLU gate by z, the out-projection (llama.cpp's build_mamba_layer)."""
from __future__ import annotations

import numbers

from ...ggml import ops
from ...ggml.tensor import Tensor
from ..hparams import Meta, MissingMetadata
from ._common import load_embd_and_output


def _positive(m, k: str, required: bool = True) -> int:
    v = m.get(k, None, required=required)
    if v is None:
        return 0
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
        raise MissingMetadata(f"metadata {m.key(k)!r} is {v!r}; it must be a positive integer")
    return int(v)


def load_ssm_hparams(hp, md, group: bool, rms_eps_required: bool = True):
    m = Meta(md, hp.arch)
    hp.ssm_d_conv = _positive(m, "ssm.conv_kernel")
    hp.ssm_d_inner = _positive(m, "ssm.inner_size")
    hp.ssm_d_state = _positive(m, "ssm.state_size")
    hp.ssm_dt_rank = _positive(m, "ssm.time_step_rank")
    hp.ssm_n_group = _positive(m, "ssm.group_count") if group else 0
    hp.ssm_dt_b_c_rms = bool(m.get("ssm.dt_b_c_rms", False))
    if rms_eps_required and not m.has("attention.layer_norm_rms_epsilon"):
        raise MissingMetadata(f"missing metadata key {m.key('attention.layer_norm_rms_epsilon')!r}")
    hp.recurrent_layers = [True] * hp.n_layer


def load_hparams(hp, md):
    load_ssm_hparams(hp, md, group=False)


def load_tensors(model, ld):
    from ..model import ModelLoadError
    hp = model.hparams
    if 2 * hp.n_embd != hp.ssm_d_inner:
        raise ModelLoadError("only an expansion factor of 2 is supported for now")
    load_embd_and_output(model, ld)
    for il, layer in enumerate(model.layers):
        layer.attn_norm = ld.create("attn_norm", (hp.n_embd,), il)
        load_mamba_layer(hp, ld, layer, il)


def load_mamba_layer(hp, ld, layer, il: int, bcdt_norms: bool = False):
    """A Mamba-1 mixer's tensors; with ``bcdt_norms`` the RMS-norm weights of dt, B and C (Jamba)."""
    d_conv, d_inner, d_state, dt_rank = hp.ssm_d_conv, hp.ssm_d_inner, hp.ssm_d_state, hp.ssm_dt_rank
    layer.ssm_in = ld.create("ssm_in", (hp.n_embd, 2 * d_inner), il)
    layer.ssm_conv1d = ld.create("ssm_conv1d", (d_conv, d_inner), il)
    layer.ssm_conv1d_b = ld.create("ssm_conv1d", (d_inner,), il, suffix="bias")
    layer.ssm_x = ld.create("ssm_x", (d_inner, dt_rank + 2 * d_state), il)
    if bcdt_norms:
        layer.ssm_dt_norm = ld.create("ssm_dt_norm", (dt_rank,), il)
        layer.ssm_b_norm = ld.create("ssm_b_norm", (d_state,), il)
        layer.ssm_c_norm = ld.create("ssm_c_norm", (d_state,), il)
    layer.ssm_dt = ld.create("ssm_dt", (dt_rank, d_inner), il)
    layer.ssm_dt_b = ld.create("ssm_dt", (d_inner,), il, suffix="bias")
    layer.ssm_a = ld.create("ssm_a", (d_state, d_inner), il, suffix=None)
    layer.ssm_d = ld.create("ssm_d", (d_inner,), il, suffix=None)
    layer.ssm_out = ld.create("ssm_out", (d_inner, hp.n_embd), il)


# cur: [width, n_tokens] -> conv_x [d_conv - 1 + n_seq_tokens, width, n_seqs]: each sequence's rolling row
# followed by its new inputs; the last d_conv - 1 columns go back to the memory
def conv_input(g, il: int, x: Tensor, width: int) -> Tensor:
    hp = g.hp
    n_seqs = g.n_seqs
    n_seq_tokens = g.n_tokens // n_seqs
    conv = ops.reshape(g.rs_get_r(il), hp.ssm_d_conv - 1, width, n_seqs)
    conv_x = ops.concat(conv, ops.transpose(x), 0)
    last = ops.view_3d(conv_x, hp.ssm_d_conv - 1, width, n_seqs, conv_x.nb[1], conv_x.nb[2], n_seq_tokens * 4)
    g.rs_store_r(il, ops.cont(last, hp.n_embd_r(), n_seqs))
    return conv_x


def mamba_layer(g, layer, cur, il: int):
    hp = g.hp
    d_inner, d_state, dt_rank = hp.ssm_d_inner, hp.ssm_d_state, hp.ssm_dt_rank
    n_seqs = g.n_seqs
    n_seq_tokens = g.n_tokens // n_seqs
    xz = ops.reshape(g.mm(layer.ssm_in, cur), 2 * d_inner, n_seq_tokens, n_seqs)
    x = ops.view_3d(xz, d_inner, n_seq_tokens, n_seqs, xz.nb[1], xz.nb[2], 0)
    z = ops.view_3d(xz, d_inner, n_seq_tokens, n_seqs, xz.nb[1], xz.nb[2], d_inner * 4)
    x = ops.ssm_conv(conv_input(g, il, x, d_inner), layer.ssm_conv1d)      # [d_inner, n_seq_tokens, n_seqs]
    x = g.cb(ops.silu(ops.add(x, layer.ssm_conv1d_b)), "ssm_conv", il)
    x_db = g.mm(layer.ssm_x, ops.reshape(x, d_inner, g.n_tokens))
    x_db = ops.reshape(x_db, x_db.ne[0], n_seq_tokens, n_seqs)
    dt = ops.view_3d(x_db, dt_rank, n_seq_tokens, n_seqs, x_db.nb[1], x_db.nb[2], 0)
    B = ops.view_4d(x_db, d_state, 1, n_seq_tokens, n_seqs, d_state * 4, x_db.nb[1], x_db.nb[2], dt_rank * 4)
    C = ops.view_4d(x_db, d_state, 1, n_seq_tokens, n_seqs, d_state * 4, x_db.nb[1], x_db.nb[2],
                    (dt_rank + d_state) * 4)
    dt_norm = getattr(layer, "ssm_dt_norm", None)
    if hp.ssm_dt_b_c_rms or dt_norm is not None:    # FalconMamba (no weights), Jamba: RMS norm of dt, B and C
        dt = g.norm(dt, dt_norm, il=il)
        B = g.norm(B, getattr(layer, "ssm_b_norm", None), il=il)
        C = g.norm(C, getattr(layer, "ssm_c_norm", None), il=il)
    else:
        dt = ops.cont(dt)
    dt = g.mm(layer.ssm_dt, ops.reshape(dt, dt_rank, g.n_tokens), layer.ssm_dt_b)
    dt = ops.reshape(dt, d_inner, n_seq_tokens, n_seqs)
    x4 = ops.reshape(x, 1, d_inner, n_seq_tokens, n_seqs)                   # head_dim 1, d_inner heads
    states, src = g.rs_s(il)
    ssm = ops.reshape(states, d_state, 1, d_inner, states.ne[1])
    y_ssm = ops.ssm_scan(ssm, x4, dt, layer.ssm_a, B, C, src)
    n_s = d_state * d_inner
    g.rs_store_s(il, ops.view_2d(y_ssm, n_s, n_seqs, n_s * 4, x4.nelements * 4))
    y = ops.view_3d(y_ssm, d_inner, n_seq_tokens, n_seqs, x4.nb[2], x4.nb[3], 0)
    y = ops.add(y, ops.mul(x, layer.ssm_d))
    y = ops.swiglu(ops.cont(z), y)
    return g.mm(layer.ssm_out, ops.reshape(y, d_inner, g.n_tokens))


def build_blocks(model, g, layer_fn):
    """token embedding -> per layer: norm, mixer, residual -> output norm -> head (llama.cpp's mamba graph)."""
    hp = model.hparams
    inpL = g.inp_embd(model.tok_embd)
    out_ids = g.inp_out_ids()
    for il, layer in enumerate(model.layers):
        cur = g.cb(g.norm(inpL, layer.attn_norm, il=il), "attn_norm", il)
        cur = g.cb(layer_fn(g, layer, cur, il), "mamba_out", il)
        if il == hp.n_layer - 1:
            cur, inpL = g.select_outputs(cur, inpL, out_ids=out_ids)
        inpL = g.cb(ops.add(cur, inpL), "l_out", il)
    cur = g.norm(inpL, model.output_norm)
    return g.finish(cur, g.lm_head(model.output, cur))


def build_graph(model, g):
    return build_blocks(model, g, mamba_layer)
