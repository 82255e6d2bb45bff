"""deepseek2 (DeepSeek V2/V3, Kimi K2, GigaChat 3, GLM 4.7 Lite, Mistral Large 3 and the like; mistral4, llama.cpp's
name for Mistral's models of this shape, is the same model with its own YaRN attention factor): multi-head latent
attention (MLA) and a mixture of experts with shared experts after n leading dense layers.

MLA, as llama.cpp runs it with the absorption optimisation (the GGUF's attn_kv_b split into attn_k_b / attn_v_b by
the converter): Q comes from a low-rank pair (attn_q_a, RMS-normed, attn_q_b; or one attn_q in the lite models),
each head split into a no-position part and a roped part. K and V come from one compressed vector per token,
attn_kv_a_mqa's first kv_lora_rank values (RMS-normed), plus a roped part shared by all heads. A head's no-position
query is turned into the compressed space by attn_k_b, so attention is one K/V head of
kv_lora_rank + n_rot values (MQA) whose V is the compressed part of K (the cache keeps K alone); attn_v_b then turns
each head's output back into its value head. RoPE (adjacent pairs) with YaRN scaling: the scores' scale carries
the YaRN mscale squared (rope.scaling.yarn_log_multiplier). Optional llama 4 attention temperature (mistral-large).
Files of older converters (one attn_kv_b, no attention.key_length_mla) run as llama.cpp runs them: multi-head
attention whose keys are each head's decompressed no-position part followed by the shared roped part.

deepseek2-ocr (DeepSeek-OCR's language model, llama.cpp's same graph without MLA): plain multi-head attention (attn_q,
attn_k, attn_v of n_embd, as many K/V heads as heads) roped NEOX over the whole head with base 10000, the rest as
deepseek2.

The FFN of layers >= leading_dense_block_count: routed experts (softmax or sigmoid gating, expert_gating_func; a
choice bias exp_probs_b; optionally only among the best expert groups; weights renormalised and scaled by
expert_weights_scale) plus expert_shared_count shared experts as one FFN.
"""
from __future__ import annotations

import math

from ...ggml import ops
from ...ggml.tensor import Tensor
from ...ggml.types import GGMLType
from ..hparams import InvalidMetadata, MissingMetadata, md_float, md_int
from ._common import f32 as _f32, load_embd_and_output, load_qkv

GATING = {1: "softmax", 2: "sigmoid", 3: "softmax_weight"}   # llama_expert_gating_func_type
F32_T = GGMLType.F32


def _logf(x: float) -> float:
    return _f32(math.log(x))


def load_hparams(hp, md):
    a = hp.arch
    hp.rope_type = 0  # NORM
    hp.is_ocr = a == "deepseek2-ocr"

    def need(k):
        if f"{a}.{k}" not in md:
            raise MissingMetadata(f"missing metadata key '{a}.{k}'")
        return md_int(md, f"{a}.{k}", lo=0)

    # multi-token prediction layers (GLM 4.7 Flash and others) follow the trunk in block_count; llama.cpp runs the
    # trunk alone unless asked for them, and so does llampy (their tensors stay unread)
    n_nextn = md_int(md, f"{a}.nextn_predict_layers", 0, lo=0, hi=hp.n_layer - 1)
    hp.n_layer -= n_nextn
    hp.n_layer_dense_lead = md_int(md, f"{a}.leading_dense_block_count", 0, lo=0, hi=hp.n_layer)
    if hp.is_ocr:
        load_ocr_attention(hp)
    else:
        load_mla_hparams(hp, md, need)
    load_moe_hparams(hp, md, need)


def load_ocr_attention(hp):
    """deepseek2-ocr's attention: llama.cpp's graph ropes NEOX over the whole head with base 10000 (it asserts the
    base), scale 1, no YaRN, whatever else the file says; one K/V head per head."""
    a = hp.arch
    hp.is_mla = False
    hp.n_lora_q = hp.n_lora_kv = 0
    head = hp.n_embd // hp.n_head()
    if hp.n_embd_head_k != head or hp.n_embd_head_v != head:
        raise InvalidMetadata(f"{a}: the key and value heads ({hp.n_embd_head_k}, {hp.n_embd_head_v}) must be "
                              f"embedding_length / head_count ({head})")
    if any(hp.n_head_kv(il) != hp.n_head(il) for il in range(hp.n_layer)):
        raise InvalidMetadata(f"{a}: attention.head_count_kv must equal head_count (llama.cpp's graph reads as "
                              f"many K/V heads as heads)")
    if abs(hp.rope_freq_base - 10000.0) >= 1e-4:
        raise InvalidMetadata(f"{a}: rope.freq_base is {hp.rope_freq_base}; llama.cpp's deepseek2-ocr graph "
                              f"requires 10000")
    hp.n_embd_head_k_mla, hp.n_embd_head_v_mla = head, head
    hp.rope_type, hp.n_rot = 2, head     # NEOX
    hp.rope_freq_scale, hp.yarn_ext_factor, hp.yarn_attn_factor = 1.0, 0.0, 1.0
    hp.rope_yarn_log_mul = 0.0
    hp.f_attn_temp_scale, hp.n_attn_temp_floor_scale = 0.0, 0


def load_mla_hparams(hp, md, need):
    a = hp.arch
    hp.n_lora_q = md_int(md, f"{a}.attention.q_lora_rank", 0, lo=0)
    hp.n_lora_kv = need("attention.kv_lora_rank")
    k_mla = md_int(md, f"{a}.attention.key_length_mla", 0, lo=0)
    v_mla = md_int(md, f"{a}.attention.value_length_mla", 0, lo=0)
    if bool(k_mla) != bool(v_mla):
        raise InvalidMetadata(f"{a}: attention.key_length_mla and value_length_mla go together (one is missing)")
    # without them: a file of older converters, one attn_kv_b, run as multi-head attention (llama.cpp's !is_mla)
    hp.is_mla = bool(k_mla)
    if hp.is_mla:
        hp.n_embd_head_k_mla, hp.n_embd_head_v_mla = k_mla, v_mla
        if hp.n_embd_head_k != hp.n_lora_kv + hp.n_rot or hp.n_embd_head_v != hp.n_lora_kv:
            raise InvalidMetadata(f"{a}: attention.key_length {hp.n_embd_head_k} / value_length {hp.n_embd_head_v}"
                                  f" must be kv_lora_rank + rope.dimension_count ({hp.n_lora_kv + hp.n_rot}) / "
                                  f"kv_lora_rank ({hp.n_lora_kv}), as the converter writes them for MLA")
        if any(hp.n_head_kv(il) != 1 for il in range(hp.n_layer)):
            raise InvalidMetadata(f"{a}: MLA attends with one K/V head: attention.head_count_kv must be 1")
        hp.v_in_k = True
    else:
        hp.n_embd_head_k_mla, hp.n_embd_head_v_mla = hp.n_embd_head_k, hp.n_embd_head_v
    if hp.n_embd_head_k_mla - hp.n_rot < 1:
        raise InvalidMetadata(f"{a}: the key head ({hp.n_embd_head_k_mla}) must exceed rope.dimension_count "
                              f"({hp.n_rot}): its no-position part would be empty")
    hp.k_rope_offset = hp.n_embd_head_k - hp.n_rot      # the roped values end each cached K row

    # YaRN as llama.cpp's context sets it for deepseek2 (float32 arithmetic as there): the rope's attn_factor is
    # 1 / (1 + 0.1 ln s), the scores' scale (1 + 0.1 log_mul ln s)^2 / sqrt(key_length_mla)
    log_mul = md_float(md, f"{a}.rope.scaling.yarn_log_multiplier", 0.0)
    tenth = _f32(0.1)
    hp.rope_yarn_log_mul = _f32(_f32(log_mul) / tenth) if log_mul else 0.0
    if hp.yarn_ext_factor:
        s = _f32(1.0 / _f32(hp.rope_freq_scale))
        def mscale(m):      # llama.cpp's get_mscale
            return 1.0 if s <= 1 else _f32(_f32(_f32(tenth * _f32(m)) * _logf(s)) + 1.0)
        if hp.rope_yarn_log_mul:
            # deepseek2 (not mistral4) takes mscale = mscale_all_dims: the ratio is then 1
            m = hp.rope_yarn_log_mul if a == "deepseek2" and hp.rope_yarn_log_mul != 1.0 else 1.0
            att = _f32(mscale(m) / mscale(hp.rope_yarn_log_mul))
        else:
            att = mscale(1.0)
        att = _f32(att * _f32(1.0 / _f32(1.0 + _f32(tenth * _logf(s)))))
        hp.yarn_attn_factor = _f32(att * _f32(hp.rope_attn_factor))

    # llama 4's attention temperature (mistral-large)
    hp.f_attn_temp_scale = md_float(md, f"{a}.attention.temperature_scale", 0.0)
    hp.n_attn_temp_floor_scale = md_int(md, f"{a}.attention.temperature_length", 0, lo=0)
    if hp.f_attn_temp_scale and not hp.n_attn_temp_floor_scale:
        raise InvalidMetadata(f"{a}: attention.temperature_scale needs attention.temperature_length > 0")


def load_moe_hparams(hp, md, need):
    a = hp.arch
    if hp.n_layer_dense_lead < hp.n_layer and not hp.n_expert:
        raise MissingMetadata(f"{a} needs {a}.expert_count and {a}.expert_used_count")
    if not hp.n_ff_exp and hp.n_layer_dense_lead < hp.n_layer:
        raise MissingMetadata(f"missing metadata key '{a}.expert_feed_forward_length'")
    hp.n_expert_shared = need("expert_shared_count")
    hp.expert_weights_scale = md_float(md, f"{a}.expert_weights_scale", 0.0, nonneg=True)
    hp.expert_weights_norm = bool(md.get(f"{a}.expert_weights_norm", False))
    func = md_int(md, f"{a}.expert_gating_func", 0, lo=0)
    if func == 0:   # files from before the key: DeepSeek V2 (softmax), GLM 4.7 Lite (sigmoid)
        func = 2 if hp.n_layer in (47, 48) and hp.n_vocab == 154880 else 1
    if func not in GATING:
        raise InvalidMetadata(f"metadata '{a}.expert_gating_func' is {func}; llampy knows "
                              f"{', '.join(f'{k} ({v})' for k, v in GATING.items())}")
    hp.expert_gating = GATING[func]
    hp.n_expert_groups = md_int(md, f"{a}.expert_group_count", 0, lo=0)
    hp.n_group_used = md_int(md, f"{a}.expert_group_used_count", 0, lo=0)
    if hp.n_expert_groups > 1 and not (hp.n_expert_groups < hp.n_expert and hp.n_expert % hp.n_expert_groups == 0
                                       and 0 < hp.n_group_used < hp.n_expert_groups):
        raise InvalidMetadata(f"{a}: {hp.n_expert} experts cannot be cut into expert_group_count "
                              f"{hp.n_expert_groups} groups with expert_group_used_count {hp.n_group_used} of them")
    if hp.n_expert_groups > 1 and hp.n_expert // hp.n_expert_groups < 2:
        raise InvalidMetadata(f"{a}: a group's score sums its two best experts: each of the {hp.n_expert_groups} "
                              f"groups needs at least 2 of the {hp.n_expert} experts")


def kq_scale(hp) -> float:
    """llama.cpp's pre-scaled score scale: mscale^2 / sqrt(key_length_mla), mscale from the original attn_factor."""
    tenth = _f32(0.1)
    ls = _logf(_f32(1.0 / _f32(hp.rope_freq_scale)))
    attn_org = _f32(_f32(hp.yarn_attn_factor) * _f32(1.0 + _f32(tenth * ls)))
    mscale = _f32(attn_org * _f32(1.0 + _f32(_f32(tenth * _f32(hp.rope_yarn_log_mul)) * ls)))
    return _f32(_f32(mscale * mscale) / _f32(math.sqrt(hp.n_embd_head_k_mla)))


def load_tensors(model, ld):
    hp = model.hparams
    E = hp.n_embd
    load_embd_and_output(model, ld)
    for il, layer in enumerate(model.layers):
        p = f"blk.{il}."
        layer.attn_norm = ld.create("attn_norm", (E,), il)
        if hp.is_ocr:
            load_qkv(model, ld, layer, il)
        else:
            load_mla(model, ld, layer, il)
        layer.ffn_norm = ld.create("ffn_norm", (E,), il)
        if il < hp.n_layer_dense_lead:
            layer.ffn_gate = ld.create("ffn_gate", (E, hp.n_ff(il)), il)
            layer.ffn_up = ld.create("ffn_up", (E, hp.n_ff(il)), il)
            layer.ffn_down = ld.create("ffn_down", (hp.n_ff(il), E), il)
            continue
        n_ff, n_exp, n_sh = hp.n_ff_exp, hp.n_expert, hp.n_ff_exp * hp.n_expert_shared
        layer.ffn_gate_inp = ld.create("ffn_gate_inp", (E, n_exp), il)
        layer.ffn_exp_probs_b = ld.create(p + "exp_probs_b", (n_exp,), required=False, suffix="bias")
        # gate and up of the experts in one matrix where the converter fused them (fuse_gate_up_exps)
        layer.ffn_gate_up_exps = ld.create(p + "ffn_gate_up_exps", (E, 2 * n_ff, n_exp), required=False)
        fused = layer.ffn_gate_up_exps is not None
        layer.ffn_gate_exps = None if fused else ld.create("ffn_gate_exps", (E, n_ff, n_exp), il)
        layer.ffn_up_exps = None if fused else ld.create("ffn_up_exps", (E, n_ff, n_exp), il)
        layer.ffn_down_exps = ld.create("ffn_down_exps", (n_ff, E, n_exp), il)
        layer.ffn_gate_shexp = ld.create("ffn_gate_shexp", (E, n_sh), il)
        layer.ffn_up_shexp = ld.create("ffn_up_shexp", (E, n_sh), il)
        layer.ffn_down_shexp = ld.create("ffn_down_shexp", (n_sh, E), il)


def load_mla(model, ld, layer, il):
    hp = model.hparams
    E, H, kv_rank = hp.n_embd, hp.n_head(), hp.n_lora_kv
    d_k, d_v, n_rot = hp.n_embd_head_k_mla, hp.n_embd_head_v_mla, hp.n_rot
    p = f"blk.{il}."
    if hp.n_lora_q:
        layer.attn_q_a_norm = ld.create(p + "attn_q_a_norm", (hp.n_lora_q,))
        layer.wq_a = ld.create(p + "attn_q_a", (E, hp.n_lora_q))
        layer.wq_b = ld.create(p + "attn_q_b", (hp.n_lora_q, H * d_k))
        layer.wq = None
    else:
        layer.wq = ld.create("attn_q", (E, H * d_k), il)
    layer.attn_kv_a_norm = ld.create(p + "attn_kv_a_norm", (kv_rank,))
    layer.wkv_a_mqa = ld.create(p + "attn_kv_a_mqa", (E, kv_rank + n_rot))
    if hp.is_mla:
        layer.wk_b = ld.create(p + "attn_k_b", (d_k - n_rot, kv_rank, H))
        layer.wv_b = ld.create(p + "attn_v_b", (kv_rank, d_v, H))
    else:
        layer.wkv_b = ld.create(p + "attn_kv_b", (kv_rank, H * (d_k - n_rot + d_v)))
    layer.wo = ld.create("attn_output", (H * d_v, E), il)


def build_graph(model, g):
    hp = model.hparams
    scale = kq_scale(hp)
    inpL = g.inp_embd(model.tok_embd)
    attn_scale = (g.inp_attn_scale(hp.f_attn_temp_scale, hp.n_attn_temp_floor_scale)
                  if hp.f_attn_temp_scale else None)
    pos = g.inp_pos()
    out_ids = g.inp_out_ids()
    for il, layer in enumerate(model.layers):
        inpSA = inpL
        cur = g.cb(g.norm(inpL, layer.attn_norm, il=il), "attn_norm", il)
        if hp.is_ocr:
            q, k, v = g.qkv(layer, cur, il)
            q, k = g.rope(q, pos, il), g.rope(k, pos, il)
            cur = g.cb(g.attn(il, layer.wo, None, q, k, v, scale), "attn_out", il)
        else:
            cur = mla_attention(model, g, layer, cur, pos, attn_scale, scale, il)
        if il == hp.n_layer - 1:
            cur, inpSA = g.select_outputs(cur, inpSA, out_ids=out_ids)
        ffn_inp = g.cb(ops.add(cur, inpSA), "ffn_inp", il)
        cur = g.cb(g.norm(ffn_inp, layer.ffn_norm, il=il), "ffn_norm", il)
        if il < hp.n_layer_dense_lead:
            cur = g.ffn(cur, layer.ffn_up, None, layer.ffn_gate, None, layer.ffn_down, None, "silu", il=il)
        else:
            moe = g.moe_ffn(cur, layer.ffn_gate_inp, layer.ffn_up_exps, layer.ffn_gate_exps, layer.ffn_down_exps,
                            hp.n_expert, hp.n_expert_used, hp.expert_weights_norm, il, gating=hp.expert_gating,
                            w_scale=hp.expert_weights_scale, exp_probs_b=layer.ffn_exp_probs_b,
                            n_groups=hp.n_expert_groups, n_group_used=hp.n_group_used,
                            gate_up_exps=layer.ffn_gate_up_exps)
            shexp = g.cb(g.ffn(cur, layer.ffn_up_shexp, None, layer.ffn_gate_shexp, None, layer.ffn_down_shexp,
                               None, "silu", il=il), "ffn_shexp", il)
            cur = ops.add(moe, shexp)
        inpL = g.cb(ops.add(cur, ffn_inp), "l_out", il)
    cur = g.norm(inpL, model.output_norm)
    return g.finish(cur, g.lm_head(model.output, cur))


# cur: [n_embd, n_tokens] -> the attention's output (after attn_output)
def mla_attention(model, g, layer, cur, pos, attn_scale, scale, il):
    hp = model.hparams
    n_rot, kv_rank = hp.n_rot, hp.n_lora_kv
    d_k = hp.n_embd_head_k_mla
    d_nope = d_k - n_rot
    n_head, n_tokens = hp.n_head(il), cur.ne[1]
    if layer.wq is None:
        q = g.norm(ops.mul_mat(layer.wq_a, cur), layer.attn_q_a_norm, il=il)
        q = ops.mul_mat(layer.wq_b, q)
    else:
        q = ops.mul_mat(layer.wq, cur)
    q = ops.reshape(q, d_k, n_head, n_tokens)
    kv_pe = g.cb(ops.mul_mat(layer.wkv_a_mqa, cur), "kv_cmpr_pe", il)      # [kv_rank + n_rot, n_tokens]
    row = kv_pe.nb[1]
    kv_cmpr = ops.view_2d(kv_pe, kv_rank, n_tokens, row, 0)
    k_pe = g.rope(ops.view_3d(kv_pe, n_rot, 1, n_tokens, row, row, kv_rank * kv_pe.nb[0]), pos, il)
    kv_cmpr = g.cb(g.norm(kv_cmpr, layer.attn_kv_a_norm, il=il), "kv_cmpr", il)
    q_nope = ops.view_3d(q, d_nope, n_head, n_tokens, q.nb[1], q.nb[2], 0)
    q_pe = g.rope(ops.view_3d(q, n_rot, n_head, n_tokens, q.nb[1], q.nb[2], d_nope * q.nb[0]), pos, il)
    if hp.is_mla:
        # each head's no-position query into the compressed space: [kv_rank, n_tokens, n_head], then back to
        # [kv_rank, n_head, n_tokens]
        q_abs = ops.permute(ops.mul_mat(layer.wk_b, ops.permute(q_nope, 0, 2, 1, 3)), 0, 2, 1, 3)
        qcur = g.cb(ops.concat(q_abs, q_pe, 0), "Qcur", il)                # [kv_rank + n_rot, n_head, n_tokens]
        kv_cmpr = ops.reshape(kv_cmpr, kv_rank, 1, n_tokens)
        kcur = g.cb(ops.concat(kv_cmpr, k_pe, 0), "Kcur", il)              # [kv_rank + n_rot, 1, n_tokens]
        vcur, v_mla = kv_cmpr, layer.wv_b
    else:
        # the compressed KV decompressed into every head's no-position key and its value; the roped key part
        # shared by all heads (llama.cpp ropes Q's trailing values in place: the same values as the concat)
        d_v = hp.n_embd_head_v_mla
        kv = ops.mul_mat(layer.wkv_b, kv_cmpr)                             # [n_head * (d_nope + d_v), n_tokens]
        es = kv.nb[0]
        k_nope = ops.view_3d(kv, d_nope, n_head, n_tokens, (d_nope + d_v) * es, kv.nb[1], 0)
        vcur = ops.cont(ops.view_3d(kv, d_v, n_head, n_tokens, (d_nope + d_v) * es, kv.nb[1], d_nope * es))
        qcur = g.cb(ops.concat(q_nope, q_pe, 0), "Qcur", il)
        k_pe = ops.repeat(k_pe, Tensor(F32_T, (n_rot, n_head, n_tokens)))
        kcur = g.cb(ops.concat(k_nope, k_pe, 0), "Kcur", il)
        v_mla = None
    if attn_scale is not None:
        qcur = ops.mul(qcur, attn_scale)
    return g.cb(g.attn(il, layer.wo, None, qcur, kcur, vcur, scale, v_mla=v_mla), "attn_out", il)

