"""gemma3n (llama.cpp's llm_build_gemma3n_iswa): gemma3's attention block inside four "AltUp" streams of the hidden
state, of which one (the active stream) runs the layer and the others are predicted and corrected from it; a
low-rank "Laurel" branch beside attention; per-layer embeddings (a second token table, 256 values per layer per
token, mixed with a projection of the embedding) gating each layer's output into the other streams; the first 10
layers' FFN gate sparsified (values below mean + 1.645 std dropped); and layers past the twentieth keeping no K/V
of their own: each reads layer 18's (sliding window) or 19's (global) cache.

The stream count, the per-layer width, the Laurel rank, the sparse layer count and the KV-sharing start are
llama.cpp's fixed values (it reads none of them from the file), as is the final logit soft-cap of 30.
"""
from __future__ import annotations

import math

from ...ggml import ops
from ...ggml.tensor import Tensor
from ...ggml.types import GGMLType
from ..hparams import InvalidMetadata, MissingMetadata, md_int
from ._common import f32, load_embd_and_output

N_ALTUP = 4                 # altup_num_inputs
I_ALTUP_ACT = 0             # altup_active_idx
LAUREL_RANK = 64
N_EMBD_ALTUP = 256          # hidden_size_per_layer_input
N_LAYER_KV_FROM_START = 20  # layers from here on read an earlier layer's K/V
N_LAYER_SPARSITY = 10       # layers whose FFN gate is sparsified
SPARSITY_STD_MUL = f32(1.6448533535003662)   # the standard normal's 95th percentile
FINAL_LOGIT_SOFTCAP = 30.0


def load_hparams(hp, md):
    a = hp.arch
    hp.rope_type = 2  # NEOX
    if f"{a}.attention.sliding_window" not in md:
        raise MissingMetadata(f"missing metadata key '{a}.attention.sliding_window'")
    hp.n_swa = md_int(md, f"{a}.attention.sliding_window", lo=0)
    pattern = md.get(f"{a}.attention.sliding_window_pattern")
    if pattern is not None and not isinstance(pattern, int):      # a per-layer bool array (the converter's)
        if len(pattern) != hp.n_layer:
            raise InvalidMetadata(f"{a}.attention.sliding_window_pattern has {len(pattern)} values for "
                                  f"{hp.n_layer} layers")
        hp.swa_layers = [bool(x) for x in pattern]
    else:
        hp.set_swa_pattern(5 if pattern is None else md_int(md, f"{a}.attention.sliding_window_pattern", lo=0))
    hp.rope_freq_scale_swa = 1.0
    hp.f_attention_scale = 1.0
    hp.final_logit_softcap = FINAL_LOGIT_SOFTCAP
    # llama.cpp's reuse callback: the last sliding-window and the last global layer of those with a cache
    hp.kv_reuse = [-1 if il < N_LAYER_KV_FROM_START else N_LAYER_KV_FROM_START - (2 if hp.is_swa(il) else 1)
                   for il in range(hp.n_layer)]


def load_tensors(model, ld):
    hp = model.hparams
    E, L, D = hp.n_embd, hp.n_layer, hp.n_embd_head_k
    load_embd_and_output(model, ld)
    model.altup_proj = ld.create("altup_proj", (E, E, N_ALTUP - 1))
    model.altup_unembd_proj = ld.create("altup_unembd_proj", (E, E, N_ALTUP - 1))
    model.per_layer_tok_embd = ld.create("per_layer_token_embd", (N_EMBD_ALTUP * L, hp.n_vocab))
    model.per_layer_model_proj = ld.create("per_layer_model_proj", (E, N_EMBD_ALTUP * L))
    model.per_layer_proj_norm = ld.create("per_layer_proj_norm", (N_EMBD_ALTUP,))
    for il, layer in enumerate(model.layers):
        p = f"blk.{il}."
        n_q, n_k, n_v = D * hp.n_head(il), hp.n_embd_k_gqa(il), hp.n_embd_v_gqa(il)
        layer.attn_norm = ld.create(p + "attn_norm", (E,))
        layer.wqkv = ld.create(p + "attn_qkv", (E, n_q + n_k + n_v), required=False)
        if layer.wqkv is None:
            layer.wq = ld.create(p + "attn_q", (E, n_q))
            layer.wk = ld.create(p + "attn_k", (E, n_k))
            layer.wv = ld.create(p + "attn_v", (E, n_v))
        layer.wo = ld.create(p + "attn_output", (n_q, E))
        layer.attn_q_norm = ld.create(p + "attn_q_norm", (D,))
        layer.attn_k_norm = ld.create(p + "attn_k_norm", (D,))
        layer.attn_post_norm = ld.create(p + "post_attention_norm", (E,))
        layer.ffn_norm = ld.create(p + "ffn_norm", (E,))
        layer.ffn_gate = ld.create(p + "ffn_gate", (E, hp.n_ff(il)))
        layer.ffn_up = ld.create(p + "ffn_up", (E, hp.n_ff(il)))
        layer.ffn_down = ld.create(p + "ffn_down", (hp.n_ff(il), E))
        layer.ffn_post_norm = ld.create(p + "post_ffw_norm", (E,))
        layer.per_layer_inp_gate = ld.create(p + "inp_gate", (E, N_EMBD_ALTUP))
        layer.per_layer_proj = ld.create(p + "proj", (N_EMBD_ALTUP, E))
        layer.per_layer_post_norm = ld.create(p + "post_norm", (E,))
        layer.altup_correct_coef = ld.create(p + "altup_correct_coef", (N_ALTUP, N_ALTUP))
        layer.altup_correct_scale = ld.create(p + "altup_correct_scale", (E,))
        layer.altup_predict_coef = ld.create(p + "altup_predict_coef", (N_ALTUP, N_ALTUP * N_ALTUP))
        layer.altup_router = ld.create(p + "altup_router", (E, N_ALTUP))
        layer.altup_router_norm = ld.create(p + "altup_router_norm", (E,))
        layer.laurel_l = ld.create(p + "laurel_l", (E, LAUREL_RANK))
        layer.laurel_r = ld.create(p + "laurel_r", (LAUREL_RANK, E))
        layer.laurel_post_norm = ld.create(p + "laurel_post_norm", (E,))


# x: [ne0, ne1, n] -> its idx-th [ne0, ne1] slice (a view)
def _slice(x: Tensor, idx: int) -> Tensor:
    return ops.view_2d(x, x.ne[0], x.ne[1], x.nb[1], idx * x.nb[2])


# x: [ne0, ne1, n] -> slices 1..n-1 (a view)
def _rest(x: Tensor) -> Tensor:
    return ops.view_3d(x, x.ne[0], x.ne[1], x.ne[2] - 1, x.nb[1], x.nb[2], x.nb[2])


# -> [1, ...]: each row's L2 norm
def _magnitude(x: Tensor) -> Tensor:
    return ops.sqrt(ops.sum_rows(ops.sqr(x)))


def _f32_recip_sqrt(n: float) -> float:
    return f32(1.0 / f32(math.sqrt(n)))


# -> [N_EMBD_ALTUP, n_tokens, n_layer]: each layer's per-layer input, its token's row of the per-layer table
# mixed with a projection of the (scaled) embedding
def per_layer_inputs(model, g, inp: Tensor) -> Tensor:
    hp = model.hparams
    E, L, T = hp.n_embd, hp.n_layer, inp.ne[1]
    if g.embd_input:
        raise ValueError("gemma3n: embeddings as input (an image or audio chunk) are not supported")
    rows = ops.get_rows(model.per_layer_tok_embd, g.inp_tokens())               # [256 L, T]
    rows = ops.scale(ops.reshape(rows, N_EMBD_ALTUP, L, T), f32(math.sqrt(N_EMBD_ALTUP)))
    g.cb(rows, "inp_per_layer_selected")
    proj = ops.scale(ops.mul_mat(model.per_layer_model_proj, inp), _f32_recip_sqrt(E))
    proj = g.cb(g.norm(ops.reshape(proj, N_EMBD_ALTUP, L, T), model.per_layer_proj_norm), "per_layer_proj")
    cur = g.cb(ops.scale(ops.add(proj, rows), _f32_recip_sqrt(2)), "inp_per_layer")
    return ops.cont(ops.permute(cur, 0, 2, 1, 3))


# x: [n_embd, n_tokens] -> [N_ALTUP, n_tokens]
def router_modalities(g, layer, x: Tensor) -> Tensor:
    r = ops.scale(g.norm(x, layer.altup_router_norm), f32(1.0 / x.ne[0]))
    return ops.tanh(ops.mul_mat(layer.altup_router, r))


# cur: [n_embd, n_tokens, N_ALTUP] -> the streams predicted from the active one, same shape
def altup_predict(g, layer, cur: Tensor, il: int) -> Tensor:
    T = cur.ne[1]
    modalities = g.cb(router_modalities(g, layer, _slice(cur, I_ALTUP_ACT)), "modalities", il)
    coefs = g.cb(g.mm(layer.altup_predict_coef, modalities), "all_coefs", il)
    coefs = ops.reshape(coefs, N_ALTUP, N_ALTUP, T)
    streams = ops.cont(ops.permute(cur, 1, 2, 0, 3))                  # [N_ALTUP, n_embd, n_tokens]
    pred = ops.cont(ops.permute(ops.mul_mat(streams, coefs), 0, 2, 1, 3))
    return g.cb(ops.add(pred, cur), "predictions", il)


# pred: [n_embd, n_tokens, N_ALTUP], activated: [n_embd, n_tokens] (the layer's output) -> corrected streams
def altup_correct(g, layer, pred: Tensor, activated: Tensor, il: int) -> Tensor:
    E, T = activated.ne[0], activated.ne[1]
    modalities = router_modalities(g, layer, activated)
    innovation = g.cb(ops.sub(activated, _slice(pred, I_ALTUP_ACT)), "innovation", il)
    coefs = ops.scale(g.mm(layer.altup_correct_coef, modalities), 1.0, 1.0)        # + 1
    coefs = ops.cont(ops.transpose(coefs), 1, T, N_ALTUP)                          # [1, n_tokens, N_ALTUP]
    innovation = ops.repeat(innovation, Tensor(GGMLType.F32, (E, T, N_ALTUP)))
    return g.cb(ops.add(ops.mul(innovation, coefs), pred), "corrected", il)


def laurel(g, layer, cur: Tensor, il: int) -> Tensor:
    t = g.mm(layer.laurel_r, g.mm(layer.laurel_l, cur))
    return g.cb(ops.add(g.norm(t, layer.laurel_post_norm), cur), "laurel_out", il)


# x: [n, n_tokens] -> relu(x - (mean + SPARSITY_STD_MUL * std)) per token (std with n - 1)
def gaussian_topk(x: Tensor) -> Tensor:
    mean = ops.mean(x)
    var = ops.scale(ops.sum_rows(ops.sqr(ops.sub(x, mean))), f32(1.0 / f32(x.ne[0] - 1)))
    cutoff = ops.add(mean, ops.scale(ops.sqrt(var), SPARSITY_STD_MUL))
    return ops.relu(ops.sub(x, cutoff))


def attention(model, g, layer, cur: Tensor, pos: Tensor, il: int) -> Tensor:
    hp = model.hparams
    D, T = hp.n_embd_head_k, cur.ne[1]
    if hp.kv_source(il) == il:
        q, k, v = g.qkv(layer, cur, il)
        k = g.cb(g.rope(g.cb(g.norm(k, layer.attn_k_norm, il=il), "Kcur_normed", il), pos, il), "Kcur_pos", il)
        v = g.cb(ops.rms_norm(v, hp.f_norm_rms_eps), "Vcur_normed", il)
    else:       # K and V are an earlier layer's: only Q is computed
        if layer.wqkv is not None:
            qkv = g.mm(layer.wqkv, cur)
            q = ops.cont(ops.view_2d(qkv, D * hp.n_head(il), T, qkv.nb[1], 0))
        else:
            q = g.mm(layer.wq, cur)
        q, k, v = ops.reshape(q, D, hp.n_head(il), T), None, None
    q = g.cb(g.rope(g.cb(g.norm(q, layer.attn_q_norm, il=il), "Qcur_normed", il), pos, il), "Qcur_pos", il)
    return g.attn(il, layer.wo, None, q, k, v, hp.f_attention_scale)


def build_graph(model, g):
    hp = model.hparams
    E = hp.n_embd
    inp = g.inp_embd(model.tok_embd)
    T = inp.ne[1]
    inp = g.cb(ops.scale(inp, f32(math.sqrt(E))), "inp_scaled")
    pos = g.inp_pos()
    out_ids = g.inp_out_ids()
    per_layer = per_layer_inputs(model, g, inp)                        # [256, n_tokens, n_layer]

    # the other streams: projections of the embedding, each rescaled to the embedding's magnitude
    target = _magnitude(inp)
    added = ops.mul_mat(model.altup_proj, ops.repeat(inp, Tensor(GGMLType.F32, (E, T, N_ALTUP - 1))))
    added = ops.div(ops.mul(added, target), _magnitude(added))
    inpL = g.cb(ops.concat(inp, added, 2), "inp_stacked")               # [n_embd, n_tokens, N_ALTUP]

    for il, layer in enumerate(model.layers):
        pred = altup_predict(g, layer, inpL, il)
        active = g.cb(_slice(pred, I_ALTUP_ACT), "active_prediction", il)
        cur = g.cb(g.norm(active, layer.attn_norm, il=il), "attn_norm", il)
        laurel_out = laurel(g, layer, cur, il)
        cur = attention(model, g, layer, cur, pos, il)
        cur = g.cb(g.norm(cur, layer.attn_post_norm, il=il), "attn_post_norm", il)
        cur = ops.add(cur, active)
        attn_laurel = g.cb(ops.scale(ops.add(cur, laurel_out), _f32_recip_sqrt(2)), "attn_laurel", il)

        cur = g.cb(g.norm(attn_laurel, layer.ffn_norm, il=il), "ffn_norm", il)
        up = g.mm(layer.ffn_up, cur)
        gate = g.mm(layer.ffn_gate, cur)
        if il < N_LAYER_SPARSITY:
            gate = gaussian_topk(gate)
        cur = g.cb(g.mm(layer.ffn_down, ops.mul(up, ops.gelu(gate))), "ffn_out", il)
        cur = g.cb(g.norm(cur, layer.ffn_post_norm), "ffn_post_norm", il)
        out = g.cb(ops.add(cur, attn_laurel), "attn_ffw_laurel_gated", il)

        corrected = altup_correct(g, layer, pred, out, il)
        # the active stream, gated by this layer's per-layer input, added to the other streams
        first = ops.mul(_slice(corrected, I_ALTUP_ACT), layer.altup_correct_scale)
        first = ops.gelu(g.mm(layer.per_layer_inp_gate, first))                   # [256, n_tokens]
        first = g.cb(ops.mul(first, _slice(per_layer, il)), "first_prediction_scaled", il)
        first = g.norm(g.mm(layer.per_layer_proj, first), layer.per_layer_post_norm, il=il)
        rest = ops.add(_rest(corrected), g.cb(first, "first_prediction_out", il))
        inpL = g.cb(ops.concat(_slice(corrected, 0), rest, 2), "l_out", il)

    # back to one stream: the others projected back, rescaled to the active one's magnitude, and averaged
    target = _magnitude(_slice(inpL, I_ALTUP_ACT))
    unembd = ops.mul_mat(model.altup_unembd_proj, _rest(inpL))
    unembd = g.cb(ops.div(ops.mul(unembd, target), _magnitude(unembd)), "altup_unembd")
    cur = _slice(inpL, 0)
    for i in range(N_ALTUP - 1):
        cur = ops.add(cur, _slice(unembd, i))
    cur = g.cb(ops.scale(cur, f32(1.0 / N_ALTUP)), "unembd_merged")
    (cur,) = g.select_outputs(cur, out_ids=out_ids)
    cur = g.norm(cur, model.output_norm)
    logits = g.lm_head(model.output, cur)
    c = hp.final_logit_softcap
    logits = ops.scale(ops.tanh(ops.scale(logits, f32(1.0 / c))), c)
    return g.finish(cur, logits)
