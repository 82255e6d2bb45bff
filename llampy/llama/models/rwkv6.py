"""rwkv6: RWKV-6 ("Finch") blocks. Each layer is a layer norm, the time mix (a linear recurrence over a per-head
matrix state, with data-dependent decay and token shift interpolations from low-rank "lerp" projections), a
residual add, a layer norm, the channel mix (a squared-ReLU feed-forward gated by a receptance, its inputs shifted
by one token), a residual add. Each sequence keeps, per layer, the previous token's two normed inputs (the token
shift row) and the wkv state (llama.cpp's rwkv6 graph)."""
from __future__ import annotations


from ...ggml import ops
from ...ggml.tensor import Tensor
from ..hparams import Meta
from ._common import f32, load_embd_and_output
from .mamba import _positive

GROUP_NORM_EPS = 64e-5        # the time mix's per-head norm (as llama.cpp writes it)


def load_wkv_hparams(hp, md, shift_rows: int = 2):
    m = Meta(md, hp.arch)
    hp.wkv_head_size = _positive(m, "wkv.head_size")
    hp.token_shift_count = int(m.get("token_shift_count", 2))
    if hp.token_shift_count != shift_rows:
        raise ValueError(f"token_shift_count is {hp.token_shift_count}; {hp.arch}'s graph shifts {shift_rows} "
                         f"row{'s' if shift_rows > 1 else ''} ({shift_rows})")
    if hp.n_embd % hp.wkv_head_size:
        raise ValueError(f"embedding_length {hp.n_embd} is not a multiple of wkv.head_size {hp.wkv_head_size}")
    hp.recurrent_layers = [True] * hp.n_layer
    return m


def load_hparams(hp, md):
    m = load_wkv_hparams(hp, md)
    hp.time_mix_extra_dim = _positive(m, "time_mix_extra_dim")
    hp.time_decay_extra_dim = _positive(m, "time_decay_extra_dim")
    hp.rescale_every_n_layers = int(m.get("rescale_every_n_layers", 0))


def load_norms(model, ld):
    """token_embd, its layer norm (LN0), the output norm and head, each layer's two layer norms."""
    hp = model.hparams
    load_embd_and_output(model, ld, norm_bias=True)
    model.tok_norm = ld.create("token_embd_norm", (hp.n_embd,))
    model.tok_norm_b = ld.create("token_embd_norm", (hp.n_embd,), suffix="bias")
    for il, layer in enumerate(model.layers):
        for name in ("attn_norm", "attn_norm_2"):
            setattr(layer, name, ld.create(name, (hp.n_embd,), il))
            setattr(layer, name + "_b", ld.create(name, (hp.n_embd,), il, suffix="bias"))


def load_tensors(model, ld):
    hp = model.hparams
    n_embd, n_ff, S = hp.n_embd, hp.n_ff(), hp.wkv_head_size
    load_norms(model, ld)
    for il, layer in enumerate(model.layers):
        c = lambda name, ne, **kw: ld.create(name, ne, il, **kw)
        layer.time_mix_w1 = c("time_mix_w1", (n_embd, hp.time_mix_extra_dim * 5))
        layer.time_mix_w2 = c("time_mix_w2", (hp.time_mix_extra_dim, n_embd, 5))
        layer.time_mix_lerp_x = c("time_mix_lerp_x", (n_embd, 1, 1))
        layer.time_mix_lerp_fused = c("time_mix_lerp_fused", (n_embd, 1, 1, 5), required=False)
        for x in "wkvrg":       # older files: one interpolation per branch instead of the fused five
            setattr(layer, f"time_mix_lerp_{x}",
                    c(f"time_mix_lerp_{x}", (n_embd, 1, 1), required=layer.time_mix_lerp_fused is None))
        layer.time_mix_first = c("time_mix_first", (S, n_embd // S))
        layer.time_mix_decay = c("time_mix_decay", (n_embd,))
        layer.time_mix_decay_w1 = c("time_mix_decay_w1", (n_embd, hp.time_decay_extra_dim))
        layer.time_mix_decay_w2 = c("time_mix_decay_w2", (hp.time_decay_extra_dim, n_embd))
        for name in ("time_mix_key", "time_mix_value", "time_mix_receptance", "time_mix_gate", "time_mix_output"):
            setattr(layer, name, c(name, (n_embd, n_embd)))
        layer.time_mix_ln = c("time_mix_ln", (n_embd,))
        layer.time_mix_ln_b = c("time_mix_ln", (n_embd,), suffix="bias")
        layer.channel_mix_lerp_k = c("channel_mix_lerp_k", (n_embd, 1, 1))
        layer.channel_mix_lerp_r = c("channel_mix_lerp_r", (n_embd, 1, 1))
        layer.channel_mix_key = c("channel_mix_key", (n_embd, n_ff))
        layer.channel_mix_value = c("channel_mix_value", (n_ff, n_embd))
        layer.channel_mix_receptance = c("channel_mix_receptance", (n_embd, n_embd))


# x: [n_embd, n_seq_tokens, n_seqs], shift: [n_embd, 1, n_seqs] -> each token's predecessor in its sequence (the
# first token's is the saved row)
def token_shift(x: Tensor, shift: Tensor) -> Tensor:
    n_seq_tokens = x.ne[1]
    if n_seq_tokens == 1:
        return shift
    prev = ops.view_3d(x, x.ne[0], n_seq_tokens - 1, x.ne[2], x.nb[1], x.nb[2], 0)
    return ops.concat(shift, prev, 1)


# a: [n_embd, n_seq_tokens, n_seqs] -> [n_embd, 1, n_seqs]: each sequence's last token
def last_token(a: Tensor) -> Tensor:
    return ops.view_3d(a, a.ne[0], 1, a.ne[2], a.nb[1], a.nb[2], (a.ne[1] - 1) * a.nb[1])


# -> the wkv state rows [n_embd_s, n_seqs] the micro-batch's sequences start from
def wkv_state(g, il: int) -> Tensor:
    states, src = g.rs_s(il)
    return ops.get_rows(states, src)


# out: the wkv op's result -> the outputs [n_embd, n_tokens]; the new states go back to the memory
def wkv_split(g, il: int, out: Tensor) -> Tensor:
    hp = g.hp
    n_s, n = hp.n_embd_s(), hp.n_embd * g.n_tokens
    g.rs_store_s(il, ops.view_2d(out, n_s, g.n_seqs, n_s * 4, n * 4))
    return ops.reshape(ops.view_1d(out, n, 0), hp.n_embd, g.n_tokens)


def group_norm(g, cur: Tensor, w: Tensor, b: Tensor) -> Tensor:
    """A layer norm per head (groups of wkv.head_size), then the affine weights."""
    hp = g.hp
    S = hp.wkv_head_size
    cur = ops.norm(ops.reshape(cur, S, hp.n_embd // S, g.n_tokens), GROUP_NORM_EPS)
    return ops.add(ops.mul(ops.reshape(cur, hp.n_embd, g.n_tokens), w), b)


def time_mix(g, layer, cur: Tensor, x_prev: Tensor, il: int) -> Tensor:
    """RWKV-6's time mix; without time_mix_first (RWKV-6 Qwen2, "QRWKV"): optional r/k/v biases, a sigmoid gate,
    k and v repeated from attention.head_count_kv heads, k * (1 - w), gated_linear_attn with q scaled by
    1/sqrt(head), no group norm (llama.cpp's build_rwkv6_time_mix)."""
    hp = g.hp
    qrwkv = layer.time_mix_first is None
    n_embd, n_tokens, S = hp.n_embd, g.n_tokens, hp.wkv_head_size
    n_head = n_embd // S
    sx = ops.reshape(ops.sub(x_prev, cur), n_embd, n_tokens)
    cur = ops.reshape(cur, n_embd, n_tokens)
    xxx = ops.add(ops.mul(sx, layer.time_mix_lerp_x), cur)
    w1 = layer.time_mix_w1
    xxx = ops.reshape(ops.tanh(ops.mul_mat(w1, xxx)), w1.ne[1] // 5, 1, 5, n_tokens)
    xxx = ops.cont(ops.permute(xxx, 0, 1, 3, 2))                        # [extra, 1, n_tokens, 5]
    w2 = layer.time_mix_w2
    xxx = ops.mul_mat(ops.reshape(w2, w2.ne[0], w2.ne[1], 1, 5), xxx)   # [n_embd, 1, n_tokens, 5]
    part = lambda i: ops.view_2d(xxx, n_embd, n_tokens, xxx.nb[1], i * n_embd * n_tokens * 4)
    if layer.time_mix_lerp_fused is not None:
        xxx = ops.add(ops.mul(ops.add(xxx, layer.time_mix_lerp_fused), ops.reshape(sx, n_embd, 1, n_tokens)),
                      ops.reshape(cur, n_embd, 1, n_tokens))
        xw, xk, xv, xr, xg = (part(i) for i in range(5))
    else:
        xw, xk, xv, xr, xg = (ops.add(ops.mul(ops.add(part(i), getattr(layer, f"time_mix_lerp_{x}")), sx), cur)
                              for i, x in enumerate("wkvrg"))
    bias = lambda name: getattr(layer, name + "_b", None)                # noqa: E731
    r = ops.reshape(g.mm(layer.time_mix_receptance, xr, bias("time_mix_receptance")), S, n_head, n_tokens)
    k = g.mm(layer.time_mix_key, xk, bias("time_mix_key"))
    v = g.mm(layer.time_mix_value, xv, bias("time_mix_value"))
    gate = g.mm(layer.time_mix_gate, xg)
    gate = ops.sigmoid(gate) if qrwkv else ops.silu(gate)
    n_kv = hp.n_head_kv(il)
    if n_kv and n_kv != n_head:         # key/value head h serves heads h * r .. h * r + r - 1
        shape = Tensor(k.type, (S, n_head // n_kv, n_kv, n_tokens))
        k = ops.repeat(ops.reshape(k, S, 1, n_kv, n_tokens), shape)
        v = ops.repeat(ops.reshape(v, S, 1, n_kv, n_tokens), shape)
    k, v = ops.reshape(k, S, n_head, n_tokens), ops.reshape(v, S, n_head, n_tokens)
    w = ops.mul_mat(layer.time_mix_decay_w2, ops.tanh(ops.mul_mat(layer.time_mix_decay_w1, xw)))
    w = ops.add(w, layer.time_mix_decay)
    w = ops.exp(ops.neg(ops.exp(w)))                                   # exp(-exp(w)), the decay in (0, 1)
    w = ops.reshape(w, S, n_head, n_tokens)
    if qrwkv:
        k = ops.sub(k, ops.mul(k, w))
        out = ops.gated_linear_attn(k, v, r, w, wkv_state(g, il), f32(float(S) ** -0.5))
        cur = wkv_split(g, il, out)
    else:
        out = ops.rwkv_wkv6(k, v, r, layer.time_mix_first, w, wkv_state(g, il))
        cur = group_norm(g, wkv_split(g, il, out), layer.time_mix_ln, layer.time_mix_ln_b)
    return g.mm(layer.time_mix_output, ops.mul(cur, gate))


def channel_mix(g, layer, cur: Tensor, x_prev: Tensor) -> Tensor:
    sx = ops.sub(x_prev, cur)
    xk = ops.add(ops.mul(sx, layer.channel_mix_lerp_k), cur)
    xr = ops.add(ops.mul(sx, layer.channel_mix_lerp_r), cur)
    r = ops.sigmoid(g.mm(layer.channel_mix_receptance, xr))
    k = ops.sqr(ops.relu(g.mm(layer.channel_mix_key, xk)))
    return ops.mul(r, g.mm(layer.channel_mix_value, k))


def build_blocks(model, g, time_mix_fn, channel_mix_fn, rescale: int = 0):
    """LN0 -> per layer: token shift rows in, layer norm, time mix, residual, layer norm, channel mix, residual,
    token shift rows out -> output norm -> head (llama.cpp's rwkv6 and rwkv7 graphs)."""
    hp = model.hparams
    n_embd, n_seqs = hp.n_embd, g.n_seqs
    n_seq_tokens = g.n_tokens // n_seqs
    inpL = g.norm(g.inp_embd(model.tok_embd), model.tok_norm, model.tok_norm_b, kind="layer")
    out_ids = g.inp_out_ids()
    state = {}                      # what a time mix hands the next layer's (RWKV-7's first-layer value)
    for il, layer in enumerate(model.layers):
        inpL = ops.reshape(inpL, n_embd, n_seq_tokens, n_seqs)
        shift = ops.reshape(g.rs_get_r(il), n_embd, 2, n_seqs)
        att_shift = ops.view_3d(shift, n_embd, 1, n_seqs, shift.nb[1], shift.nb[2], 0)
        ffn_shift = ops.view_3d(shift, n_embd, 1, n_seqs, shift.nb[1], shift.nb[2], n_embd * 4)
        att_norm = g.cb(g.norm(inpL, layer.attn_norm, layer.attn_norm_b, kind="layer", il=il), "attn_norm", il)
        cur = time_mix_fn(g, layer, att_norm, token_shift(att_norm, att_shift), il, state)
        ffn_inp = g.cb(ops.add(ops.reshape(cur, n_embd, n_seq_tokens, n_seqs), inpL), "ffn_inp", il)
        ffn_norm = g.cb(g.norm(ffn_inp, layer.attn_norm_2, layer.attn_norm_2_b, kind="layer", il=il), "ffn_norm", il)
        x_prev = token_shift(ffn_norm, ffn_shift)
        g.rs_store_r(il, ops.reshape(ops.concat(last_token(att_norm), last_token(ffn_norm), 1), 2 * n_embd, n_seqs))
        ffn_inp, ffn_norm, x_prev = (ops.reshape(ops.cont(t) if not t.is_contiguous() else t, n_embd, g.n_tokens)
                                     for t in (ffn_inp, ffn_norm, x_prev))
        if il == hp.n_layer - 1:
            ffn_inp, ffn_norm, x_prev = g.select_outputs(ffn_inp, ffn_norm, x_prev, out_ids=out_ids)
        cur = ops.add(channel_mix_fn(g, layer, ffn_norm, x_prev), ffn_inp)
        if rescale and (il + 1) % rescale == 0:
            cur = ops.scale(cur, 0.5)
        inpL = g.cb(cur, "l_out", il)
    cur = g.norm(inpL, model.output_norm, model.output_norm_b, kind="layer")
    return g.finish(cur, g.lm_head(model.output, cur))


def build_graph(model, g):
    return build_blocks(model, g, lambda g, layer, cur, x_prev, il, _: time_mix(g, layer, cur, x_prev, il),
                        channel_mix, model.hparams.rescale_every_n_layers)
