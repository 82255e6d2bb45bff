"""Model quantization as llama.cpp's src/llama-quant.cpp does it (what ``llama-quantize`` runs).

A file type (``LLAMA_FTYPE_MOSTLY_Q4_K_M``, ...) names a default tensor type and a mixture: per tensor category
(attn_v, ffn_down, output, ...) and layer, ``tensor_get_type`` picks a type exactly as ``llama_tensor_get_type``
does, including the shape fallbacks. ``quantize_model`` then writes the file llama-quantize writes: the input's
metadata in order, ``general.quantization_version`` and ``general.file_type`` moved to the end (gguf_set_val
removes and appends), the imatrix keys after them, tensors sorted as llama_model_loader's weights_map sorts them
(layer number, then name), each at the next multiple of 32.
"""
from __future__ import annotations

import os
import re
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from ..ggml.types import GGMLType, TYPE_TRAITS

T = GGMLType
GGML_QNT_VERSION = 2


class QuantizeError(ValueError):
    pass


# name, LLAMA_FTYPE id, default tensor type (llama_ftype_get_default_type), description (tools/quantize's table)
FTYPES = [
    ("Q1_0", 40, T.Q1_0, " 1.125 bpw quantization"),
    ("Q2_0", 41, T.Q2_0, " 2.25 bpw quantization (group 64)"),
    ("Q4_0", 2, T.Q4_0, " 4.34G, +0.4685 ppl @ Llama-3-8B"),
    ("Q4_1", 3, T.Q4_1, " 4.78G, +0.4511 ppl @ Llama-3-8B"),
    ("MXFP4_MOE", 38, T.MXFP4, " MXFP4 MoE"),
    ("Q5_0", 8, T.Q5_0, " 5.21G, +0.1316 ppl @ Llama-3-8B"),
    ("Q5_1", 9, T.Q5_1, " 5.65G, +0.1062 ppl @ Llama-3-8B"),
    ("IQ2_XXS", 19, T.IQ2_XXS, " 2.06 bpw quantization"),
    ("IQ2_XS", 20, T.IQ2_XS, " 2.31 bpw quantization"),
    ("IQ2_S", 28, T.IQ2_XS, " 2.5  bpw quantization"),
    ("IQ2_M", 29, T.IQ2_S, " 2.7  bpw quantization"),
    ("IQ1_S", 24, T.IQ1_S, " 1.56 bpw quantization"),
    ("IQ1_M", 31, T.IQ1_M, " 1.75 bpw quantization"),
    ("TQ1_0", 36, T.TQ1_0, " 1.69 bpw ternarization"),
    ("TQ2_0", 37, T.TQ2_0, " 2.06 bpw ternarization"),
    ("Q2_K", 10, T.Q2_K, " 2.96G, +3.5199 ppl @ Llama-3-8B"),
    ("Q2_K_S", 21, T.Q2_K, " 2.96G, +3.1836 ppl @ Llama-3-8B"),
    ("IQ3_XXS", 23, T.IQ3_XXS, " 3.06 bpw quantization"),
    ("IQ3_S", 26, T.IQ3_S, " 3.44 bpw quantization"),
    ("IQ3_M", 27, T.IQ3_S, " 3.66 bpw quantization mix"),
    ("Q3_K", 12, T.Q3_K, "alias for Q3_K_M"),
    ("IQ3_XS", 22, T.IQ3_S, " 3.3 bpw quantization"),
    ("Q3_K_S", 11, T.Q3_K, " 3.41G, +1.6321 ppl @ Llama-3-8B"),
    ("Q3_K_M", 12, T.Q3_K, " 3.74G, +0.6569 ppl @ Llama-3-8B"),
    ("Q3_K_L", 13, T.Q3_K, " 4.03G, +0.5562 ppl @ Llama-3-8B"),
    ("IQ4_NL", 25, T.IQ4_NL, " 4.50 bpw non-linear quantization"),
    ("IQ4_XS", 30, T.IQ4_XS, " 4.25 bpw non-linear quantization"),
    ("Q4_K", 15, T.Q4_K, "alias for Q4_K_M"),
    ("Q4_K_S", 14, T.Q4_K, " 4.37G, +0.2689 ppl @ Llama-3-8B"),
    ("Q4_K_M", 15, T.Q4_K, " 4.58G, +0.1754 ppl @ Llama-3-8B"),
    ("Q5_K", 17, T.Q5_K, "alias for Q5_K_M"),
    ("Q5_K_S", 16, T.Q5_K, " 5.21G, +0.1049 ppl @ Llama-3-8B"),
    ("Q5_K_M", 17, T.Q5_K, " 5.33G, +0.0569 ppl @ Llama-3-8B"),
    ("Q6_K", 18, T.Q6_K, " 6.14G, +0.0217 ppl @ Llama-3-8B"),
    ("Q8_0", 7, T.Q8_0, " 7.96G, +0.0026 ppl @ Llama-3-8B"),
    ("F16", 1, T.F16, "14.00G, +0.0020 ppl @ Mistral-7B"),
    ("BF16", 32, T.BF16, "14.00G, -0.0050 ppl @ Mistral-7B"),
    ("F32", 0, T.F32, "26.00G              @ 7B"),
    ("COPY", 0, T.F32, "only copy tensors, no quantizing"),
]
_CANON = {}
for _n, _i, _t, _d in FTYPES:
    if not _d.startswith("alias"):
        _CANON.setdefault(_i, _n)
FTYPE_DEFAULT = {i: t for _, i, t, _ in FTYPES}


class F:
    """LLAMA_FTYPE_MOSTLY_* ids under short names, for the rules below."""
    F32, F16, Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q2_K, Q3_K_S, Q3_K_M, Q3_K_L = 0, 1, 2, 3, 7, 8, 9, 10, 11, 12, 13
    Q4_K_S, Q4_K_M, Q5_K_S, Q5_K_M, Q6_K, IQ2_XXS, IQ2_XS, Q2_K_S, IQ3_XS, IQ3_XXS = 14, 15, 16, 17, 18, 19, 20, 21, 22, 23
    IQ1_S, IQ4_NL, IQ3_S, IQ3_M, IQ2_S, IQ2_M, IQ4_XS, IQ1_M, BF16 = 24, 25, 26, 27, 28, 29, 30, 31, 32
    TQ1_0, TQ2_0, MXFP4_MOE, NVFP4, Q1_0, Q2_0 = 36, 37, 38, 39, 40, 41


def parse_ftype(s: str) -> tuple[int, str]:
    """try_parse_ftype: a name (any case) or a number -> (ftype id, canonical name)."""
    u = s.upper()
    for name, i, _, _ in FTYPES:
        if name == u:
            return i, name
    try:
        n = int(s)
    except ValueError:
        n = None
    for name, i, _, _ in FTYPES:
        if i == n:
            return i, name
    raise QuantizeError(f"invalid file type {s!r}")


def ggml_type_name(t: GGMLType) -> str:
    """ggml_type_name: lower case but for the K of k-quants ("q4_K")."""
    n = T(t).name.lower()
    return n[:-2] + "_K" if n.endswith("_k") else n


def parse_ggml_type(s: str) -> GGMLType:
    for t in T:
        if t.name.lower() == s.lower():
            return t
    raise QuantizeError(f"invalid ggml_type {s!r}")


# ------------------------------------------------------------------------------------------------ categories

def tensor_category(name: str) -> str:
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for key, cat in (("attn_qkv.weight", "attn_qkv"), ("attn_kv_b.weight", "attn_kv_b"), ("attn_v.weight", "attn_v"),
                     ("attn_k.weight", "attn_k"), ("attn_q.weight", "attn_q"),
                     ("attn_output.weight", "attn_output"), ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"),
                     ("ffn_down", "ffn_down")):
        if key in name:
            return cat
    return "other"


def _is_attn_v(cat: str) -> bool:
    return cat in ("attn_v", "attn_qkv", "attn_kv_b")


_NO_QUANT = ("ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel", "per_layer_model_proj",
             "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight", "indexer.q_proj.weight",
             "time_mix_first.weight", "time_mix_w0.weight", "time_mix_w1.weight", "time_mix_w2.weight",
             "time_mix_v0.weight", "time_mix_v1.weight", "time_mix_v2.weight", "time_mix_a0.weight",
             "time_mix_a1.weight", "time_mix_a2.weight", "time_mix_g1.weight", "time_mix_g2.weight",
             "time_mix_decay_w1.weight", "time_mix_decay_w2.weight", "time_mix_lerp_fused.weight",
             "attn_rel_b.weight", ".position_embd", "sam.pos_embd", "sam.neck.", "sam.net_", ".rel_pos",
             ".patch_embd", ".patch_merger", "a.rvq.codebook", "mm.a.code_embd")
_NO_QUANT_GLM5 = ("hc_", "indexer.attn_q_b", "indexer.attn_k", "indexer.proj", "indexer_compressor_gate",
                  "indexer_compressor_ape", "ssm_f_a.weight", "ssm_f_b.weight", "ssm_g_a.weight", "ssm_g_b.weight",
                  "ssm_beta.weight", "attn_kv_a_mqa.weight", "attn_k_b.weight", "attn_v_b.weight")


def n_dims(ne) -> int:
    """ggml_n_dims: trailing dimensions of 1 do not count."""
    n = len(ne)
    while n > 1 and ne[n - 1] == 1:
        n -= 1
    return n


@dataclass
class QuantizeParams:
    """llama_model_quantize_params."""
    ftype: int = F.Q8_0
    nthread: int = 0
    output_tensor_type: GGMLType | None = None
    token_embedding_type: GGMLType | None = None
    allow_requantize: bool = False
    quantize_output_tensor: bool = True
    only_copy: bool = False
    pure: bool = False
    dry_run: bool = False
    imatrix: dict | None = None                        # name -> float32 [ne0 * n_expert], already normalised
    kv_overrides: list = field(default_factory=list)   # (key, value, GGUFValueType)
    tensor_types: list = field(default_factory=list)   # (regex pattern, GGMLType), first match wins


def tensor_allows_quantization(params: QuantizeParams, arch: str, name: str, ne) -> bool:
    if params.only_copy or n_dims(ne) < 2:
        return False
    q = name.endswith("weight") and "_norm.weight" not in name
    q &= params.quantize_output_tensor or name != "output.weight"
    q &= not any(s in name for s in _NO_QUANT)
    q &= name not in ("position_embd.weight", "token_types.weight")
    if arch == "glm5-next":
        q &= not any(s in name for s in _NO_QUANT_GLM5)
    return q


class QuantizeState:
    """quantize_state_impl: the counters the mixtures use, and the model facts they look at."""

    def __init__(self, meta: dict, params: QuantizeParams, names: list):
        arch = meta.get("general.architecture", "")
        self.arch, self.params = arch, params

        def hp(key, default=0):
            v = meta.get(f"{arch}.{key}", default)
            return int(np.asarray(v).reshape(-1)[0]) if np.size(v) else default
        self.n_layer = hp("block_count")
        n_head, n_head_kv = hp("attention.head_count"), hp("attention.head_count_kv", None)
        n_head_kv = n_head if n_head_kv is None else n_head_kv
        self.n_gqa = n_head // n_head_kv if n_head_kv else 0
        self.n_expert = hp("expert_count")
        self.is_70b = arch == "llama" and self.n_layer == 80 and n_head != n_head_kv
        self.has_imatrix = bool(params.imatrix)
        self.patterns = [(re.compile(p), t) for p, t in params.tensor_types]
        cats = [tensor_category(n) for n in names]
        self.n_attention_wv = sum(_is_attn_v(c) for c in cats)
        self.has_tied_embeddings = "output" not in cats
        self.n_ffn_down = self.n_ffn_gate = self.n_ffn_up = self.n_layer
        self.i_attention_wv = self.i_ffn_down = self.i_ffn_gate = self.i_ffn_up = 0
        self.n_fallback = 0
        self.warnings: list[str] = []


def _use_more_bits(i, n):
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _layer_info(qs: QuantizeState, i_layer: int, n_layer: int, name: str):
    if max(1, qs.n_expert) > 1:
        m = re.match(r"blk\.(-?\d+)\.", name)
        if not m:
            raise QuantizeError(f"Failed to determine layer for tensor {name}")
        i_layer = int(m.group(1))
        if not 0 <= i_layer < n_layer:
            raise QuantizeError(f"Bad layer {i_layer} for tensor {name}. Must be in [0, {n_layer})")
    return i_layer, n_layer


def _type_impl(qs: QuantizeState, new_type, name: str, ne, ftype: int, cat: str):
    """llama_tensor_get_type_impl, rule for rule."""
    arch = qs.arch
    if arch == "glm5-next" and any(s in name for s in ("attn_q_a", "attn_q_b", "nextn.eh_proj")):
        if new_type not in (T.F32, T.BF16, T.F16):
            return T.Q8_0
    IQ_LOW = (F.IQ2_XXS, F.IQ2_XS, F.IQ1_S, F.IQ2_S, F.IQ2_M, F.IQ1_M)
    if cat == "output" or (qs.has_tied_embeddings and cat == "token_embd"):
        if qs.params.output_tensor_type is not None:
            new_type = qs.params.output_tensor_type
        else:
            qk_k = TYPE_TRAITS[new_type].blck_size
            if ftype == F.MXFP4_MOE:
                new_type = T.Q8_0
            elif arch == "falcon" or ne[0] % qk_k:
                new_type = T.Q8_0
            elif ftype in (F.IQ2_XXS, F.IQ2_XS, F.IQ3_XXS, F.IQ1_S, F.IQ2_S, F.IQ2_M, F.IQ1_M):
                new_type = T.Q5_K
            elif new_type != T.Q8_0:
                new_type = T.Q6_K
    elif ftype == F.MXFP4_MOE:
        expert = arch != "bailingmoe3" or cat in ("ffn_up", "ffn_gate", "ffn_down")
        new_type = T.MXFP4 if len(ne) > 2 and ne[2] > 1 and expert else T.Q8_0
    elif cat == "token_embd":
        if qs.params.token_embedding_type is not None:
            new_type = qs.params.token_embedding_type
        elif ftype in (F.IQ2_XXS, F.IQ2_XS, F.IQ1_S, F.IQ1_M):
            new_type = T.Q2_K
        elif ftype in (F.IQ2_S, F.IQ2_M, F.IQ3_XXS):
            new_type = T.IQ3_S
        elif ftype in (F.TQ1_0, F.TQ2_0, F.Q2_0):
            new_type = T.Q4_K
    elif ftype in IQ_LOW:
        iq2sm = ftype in (F.IQ2_S, F.IQ2_M)
        if _is_attn_v(cat):
            if qs.n_gqa >= 4 or qs.n_expert >= 4:
                new_type = T.Q4_K
            else:
                new_type = T.IQ3_S if iq2sm else T.Q2_K
            qs.i_attention_wv += 1
        elif qs.n_expert == 8 and cat == "attn_k":
            new_type = T.Q4_K
        elif cat == "ffn_down":
            if qs.i_ffn_down < qs.n_ffn_down // 8:
                new_type = T.IQ3_S if iq2sm else T.Q2_K
            qs.i_ffn_down += 1
        elif cat == "attn_output":
            if qs.n_expert == 8:
                new_type = T.Q5_K
            elif ftype in (F.IQ1_S, F.IQ1_M):
                new_type = T.IQ2_XXS
            elif iq2sm:
                new_type = T.IQ3_S
    elif _is_attn_v(cat):
        g4 = qs.n_gqa >= 4
        if ftype == F.Q2_K:
            new_type = T.Q4_K if g4 else T.Q3_K
        elif ftype == F.Q2_K_S and g4:
            new_type = T.Q4_K
        elif ftype == F.IQ3_XXS:
            new_type = T.Q4_K if g4 else (T.IQ3_S if not qs.has_imatrix else T.IQ3_XXS)
        elif ftype in (F.IQ3_XS, F.IQ3_S) and g4:
            new_type = T.Q4_K
        elif ftype == F.IQ3_M:
            new_type = T.Q4_K
        elif ftype == F.Q3_K_M:
            new_type = T.Q5_K if qs.i_attention_wv < 2 else T.Q4_K
        elif ftype == F.Q3_K_L:
            new_type = T.Q5_K
        elif ftype in (F.IQ4_NL, F.IQ4_XS) and g4:
            new_type = T.Q5_K
        elif ftype in (F.Q4_K_M, F.Q5_K_M) and _use_more_bits(qs.i_attention_wv, qs.n_attention_wv):
            new_type = T.Q6_K
        elif ftype == F.Q4_K_S and qs.i_attention_wv < 4:
            new_type = T.Q5_K
        if qs.is_70b and new_type in (T.Q3_K, T.Q4_K):
            new_type = T.Q5_K
        if qs.n_expert == 8:
            new_type = T.Q8_0
        qs.i_attention_wv += 1
    elif cat == "attn_k":
        if qs.n_expert == 8:
            new_type = T.Q8_0
        elif ftype == F.IQ3_XS:
            new_type = T.IQ3_XXS
        elif ftype == F.IQ3_XXS:
            new_type = T.IQ2_S
    elif cat == "attn_q":
        if ftype == F.IQ3_XS:
            new_type = T.IQ3_XXS
        elif ftype == F.IQ3_XXS:
            new_type = T.IQ2_S
    elif cat == "ffn_down":
        i_layer, n_layer = _layer_info(qs, qs.i_ffn_down, qs.n_ffn_down, name)
        falcon = arch == "falcon"
        if ftype == F.Q2_K:
            new_type = T.Q3_K
        elif ftype == F.Q2_K_S:
            if i_layer < n_layer // 8:
                new_type = T.Q4_K
        elif ftype == F.IQ3_XXS and not qs.has_imatrix:
            new_type = T.Q4_K if i_layer < n_layer // 8 else T.Q3_K
        elif ftype == F.Q3_K_M:
            new_type = (T.Q5_K if i_layer < n_layer // 16 else
                        T.Q4_K if not falcon or _use_more_bits(i_layer, n_layer) else T.Q3_K)
        elif ftype == F.IQ3_M and (i_layer < n_layer // 8 or
                                   (qs.n_expert == 8 and _use_more_bits(i_layer, n_layer))):
            new_type = T.Q4_K
        elif ftype == F.Q3_K_L:
            new_type = T.Q4_K if falcon else T.Q5_K
        elif ftype == F.Q4_K_M:
            if falcon:
                new_type = (T.Q6_K if i_layer < n_layer // 16 else
                            T.Q5_K if _use_more_bits(i_layer, n_layer) else T.Q4_K)
            elif _use_more_bits(i_layer, n_layer):
                new_type = T.Q6_K
        elif i_layer < n_layer // 8 and ftype in (F.IQ4_NL, F.IQ4_XS) and not qs.has_imatrix:
            new_type = T.Q5_K
        elif ftype == F.Q5_K_M and _use_more_bits(i_layer, n_layer):
            new_type = T.Q6_K
        elif ftype == F.Q4_K_S and not falcon and i_layer < n_layer // 8:
            new_type = T.Q5_K
        elif ftype in (F.Q4_0, F.Q5_0) and qs.has_imatrix and i_layer < n_layer // 8:
            new_type = T.Q4_1 if ftype == F.Q4_0 else T.Q5_1
        qs.i_ffn_down += 1
    elif cat == "attn_output":
        if arch != "falcon":
            if qs.n_expert == 8:
                if ftype in (F.Q2_K, F.IQ3_XS, F.IQ3_XXS, F.Q3_K_S, F.Q3_K_M, F.IQ4_NL, F.Q4_K_S, F.Q4_K_M,
                             F.IQ3_S, F.IQ3_M, F.IQ4_XS):
                    new_type = T.Q5_K
            else:
                new_type = {F.Q2_K: T.Q3_K, F.IQ3_XXS: T.IQ3_S, F.Q3_K_M: T.Q4_K, F.Q3_K_L: T.Q5_K,
                            F.IQ3_M: T.Q4_K}.get(ftype, new_type)
        elif ftype == F.Q3_K_L:
            new_type = T.Q4_K
    elif cat == "attn_qkv":
        if ftype in (F.Q3_K_M, F.Q3_K_L, F.IQ3_M):
            new_type = T.Q4_K
        elif ftype == F.Q4_K_M:
            new_type = T.Q5_K
        elif ftype == F.Q5_K_M:
            new_type = T.Q6_K
    elif cat in ("ffn_gate", "ffn_up"):
        attr = "i_ffn_gate" if cat == "ffn_gate" else "i_ffn_up"
        i_layer, n_layer = _layer_info(qs, getattr(qs, attr), qs.n_ffn_gate, name)
        if ftype == F.IQ3_XS and n_layer // 8 <= i_layer < 7 * n_layer // 8:
            new_type = T.IQ3_XXS
        setattr(qs, attr, getattr(qs, attr) + 1)
    return new_type


_FALLBACK = {T.IQ1_S: T.IQ4_NL, T.IQ1_M: T.IQ4_NL, T.IQ2_XXS: T.IQ4_NL, T.IQ2_XS: T.IQ4_NL, T.IQ2_S: T.IQ4_NL,
             T.IQ3_XXS: T.IQ4_NL, T.IQ3_S: T.IQ4_NL, T.IQ4_XS: T.IQ4_NL, T.Q2_0: T.Q4_0, T.Q2_K: T.Q4_0,
             T.Q3_K: T.Q4_0, T.TQ1_0: T.Q4_0, T.TQ2_0: T.Q4_0, T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}


def _fallback(qs: QuantizeState, name: str, ne, target):
    """tensor_type_fallback: a row that is not whole blocks of ``target`` takes a type with smaller blocks."""
    qk = TYPE_TRAITS[target].blck_size
    if ne[0] % qk == 0:
        return target
    qs.n_fallback += 1
    ret = _FALLBACK.get(target)
    if ret is None:
        if qk > 32:
            raise QuantizeError(f"no tensor type fallback is defined for type {ggml_type_name(target)}")
        ret = target
    if ne[0] % TYPE_TRAITS[ret].blck_size:
        ret = T.F16
    qs.warnings.append(f"{name}: ncols {ne[0]} not divisible by {qk} (required for type "
                       f"{ggml_type_name(target)}) -> falling back to {ggml_type_name(ret)}")
    return ret


def tensor_get_type(qs: QuantizeState, name: str, cur_type, ne, default_type) -> GGMLType:
    """llama_tensor_get_type: the type this tensor is written in."""
    p = qs.params
    if not tensor_allows_quantization(p, qs.arch, name, ne):
        return T(cur_type)
    cat = tensor_category(name)
    if p.token_embedding_type is not None and cat == "token_embd":
        named = name == "per_layer_token_embd.weight" and any(r.search(name) for r, _ in qs.patterns)
        if not named:
            return p.token_embedding_type
    if p.output_tensor_type is not None and cat == "output":
        return p.output_tensor_type
    new_type = default_type
    if TYPE_TRAITS[default_type].is_quantized:
        manual = False
        for r, t in qs.patterns:
            if r.search(name):
                new_type, manual = t, True
                break
        if not manual and not p.pure:
            new_type = _type_impl(qs, new_type, name, ne, p.ftype, cat)
        new_type = _fallback(qs, name, ne, new_type)
    return T(new_type)


# llama_model_loader's guess of a file's type when general.file_type is missing (what a COPY writes then): the
# tensor type that is the most frequent first, in weights_map's order, to this LLAMA_FTYPE_*, or'ed with GUESSED
_GUESS = {T.F32: F.F32, T.F16: F.F16, T.BF16: F.BF16, T.Q4_0: F.Q4_0, T.Q4_1: F.Q4_1, T.Q5_0: F.Q5_0,
          T.Q5_1: F.Q5_1, T.Q8_0: F.Q8_0, T.Q2_K: F.Q2_K, T.Q3_K: F.Q3_K_M, T.Q4_K: F.Q4_K_M, T.Q5_K: F.Q5_K_M,
          T.Q6_K: F.Q6_K, T.TQ1_0: F.TQ1_0, T.TQ2_0: F.TQ2_0, T.IQ2_XXS: F.IQ2_XXS, T.IQ2_XS: F.IQ2_XS,
          T.IQ2_S: F.IQ2_S, T.IQ3_XXS: F.IQ3_XXS, T.IQ1_S: F.IQ1_S, T.IQ1_M: F.IQ1_M, T.IQ4_NL: F.IQ4_NL,
          T.IQ4_XS: F.IQ4_XS, T.IQ3_S: F.IQ3_S, T.NVFP4: F.NVFP4, T.Q1_0: F.Q1_0, T.Q2_0: F.Q2_0}
LLAMA_FTYPE_GUESSED = 1024


def _guessed_ftype(tensors: dict) -> int:
    count: dict = {}
    n_max, t_max = 0, T.F32
    for name in weights_order(list(tensors)):
        t = T(tensors[name].type)
        count[t] = count.get(t, 0) + 1
        if n_max < count[t]:
            n_max, t_max = count[t], t
    return _GUESS.get(t_max, F.F32) | LLAMA_FTYPE_GUESSED


def tensor_requires_imatrix(name: str, t, ftype: int) -> bool:
    if name in ("token_embd.weight", "per_layer_token_embd.weight", "output.weight"):
        return False
    if t in (T.IQ3_XXS, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ1_M, T.IQ1_S):
        return True
    return t == T.Q2_K and ftype == F.Q2_K_S


def weights_order(names) -> list:
    """llama_model_loader's weight_name_comparer: by layer number (-1 outside blocks), then by name (bytes)."""
    def key(n):
        m = re.match(r"blk\.(-?\d+)\.", n)
        return (int(m.group(1)) if m else -1, n.encode())
    return sorted(names, key=key)


# ------------------------------------------------------------------------------------------------ the driver

@dataclass
class QuantizeResult:
    types: dict                 # name -> GGMLType written
    size_org: int
    size_new: int
    n_elements: int
    n_fallback: int
    seconds: float


def _rows_to_f32(raw: np.ndarray, t: GGMLType, ne0: int) -> np.ndarray:
    if t == T.F32:
        return raw.view(np.float32).reshape(-1, ne0)
    if t == T.BF16:
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32).reshape(-1, ne0)
    from ..ggml.quants import dequantize
    return dequantize(raw, t, ne0).reshape(-1, ne0)


_TLS = threading.local()


def _f32_rows(x: np.ndarray, f16_to_f32) -> np.ndarray:
    """Rows as float32: fp16 bit patterns (uint16) converted by ``f16_to_f32`` (the Numba kernel or NumPy's table
    lookup: same values) into this thread's scratch buffer (reused: a chunk of rows stays in cache between the
    conversion and the quantizer, and no tensor-sized array is faulted in)."""
    if x.dtype != np.uint16:
        return x
    n = x.size
    buf = getattr(_TLS, "buf", None)
    if buf is None or buf.size < n:
        buf = _TLS.buf = np.empty(n, np.float32)
    f = buf[:n]
    f16_to_f32(np.ascontiguousarray(x).reshape(-1), f)
    return f.reshape(x.shape)


def quantize_rows(x: np.ndarray, t: GGMLType, imatrix: np.ndarray | None, pool=None, rows_per_chunk=None,
                  out: np.ndarray | None = None, kernels: bool = True) -> np.ndarray:
    """x [nrows, ne0] float32, or uint16 fp16 bit patterns -> uint8 [nrows, row_bytes] (into ``out``, C-contiguous
    uint8 of that size, when given); rows in chunks of at most ~256K values (converted to float32 chunk by chunk)
    over ``pool`` (NumPy and Numba release the GIL). Every format's rows are independent, so the chunking does not
    change a byte. ``kernels=False`` (types of ``quants_np.NUMPY_TYPES`` only, without an importance matrix): NumPy
    alone, without importing Numba."""
    nrows, ne0 = x.shape
    tt = TYPE_TRAITS[t]
    shape = (nrows, ne0 // tt.blck_size * tt.type_size)
    out = np.empty(shape, np.uint8) if out is None else out.reshape(shape)
    if kernels:
        # only the modules this type needs: each kernel module's dispatchers cost milliseconds to make, the grid
        # searches' (imported with the importance-matrix quantizers) ~35 ms
        from ..ggml.quants import QUANTIZE_TYPES, quantize
        from ..ggml.quants_rows import f16_to_f32, quantize_rows_ref
        if imatrix is not None:
            from ..ggml.quants_imatrix import quantize_weighted
        elif t not in QUANTIZE_TYPES and t != T.F32:
            from ..ggml.quants_iq_search import quantize_iq
    else:
        from ..ggml.quants_np import NUMPY_TYPES, f16_to_f32, quantize_rows as quantize_rows_np
        if t not in NUMPY_TYPES:
            raise ValueError(f"{T(t).name} needs the Numba kernels")

    # F16 rows to F32 or BF16: converted straight into the output's bytes, one pass (no float32 chunk between)
    direct = x.dtype == np.uint16 and t in (T.F32, T.BF16)
    if direct:
        from ..ggml.quants_np import f16_to_bf16

    def run(a, b):
        if direct:
            o = out[a:b].reshape(-1)
            h = np.ascontiguousarray(x[a:b]).reshape(-1)
            if t == T.BF16:
                f16_to_bf16(h, o.view(np.uint16))
            else:
                f16_to_f32(h, o.view(np.float32))
            return
        if not kernels:
            quantize_rows_np(_f32_rows(x[a:b], f16_to_f32), t, out[a:b])
            return
        if pool is not None and not getattr(_TLS, "one_thread", False):
            # each pool thread runs the Numba searches on its own rows (set_num_threads is per thread, set once a
            # thread): the pool, not prange, spreads the work, and the NumPy packing runs in parallel too
            import numba
            numba.set_num_threads(1)
            _TLS.one_thread = True
        xa = _f32_rows(x[a:b], f16_to_f32)
        if t == T.F32:
            y = xa.view(np.uint8)
        elif imatrix is not None:
            y = quantize_weighted(xa, t, imatrix)
        elif t not in QUANTIZE_TYPES:
            y = quantize_iq(xa, t)
        elif quantize_rows_ref(xa, t, out[a:b]) is not None:       # written in place
            return
        else:
            y = quantize(xa, t)
        out[a:b] = y.reshape(b - a, -1)
    workers = pool._max_workers if pool is not None else 1
    step = rows_per_chunk or max(1, min(-(-nrows // (4 * workers)), (1 << 18) // ne0))
    starts = range(0, nrows, step)
    if pool is None or len(starts) < 2:
        for a in starts:
            run(a, min(nrows, a + step))
    else:
        list(pool.map(lambda a: run(a, min(nrows, a + step)), starts))
    return out


def quantize_model(inp, out, params: QuantizeParams, log=None, progress=None,
                   own_process: bool = False) -> QuantizeResult:
    """llama_model_quantize: ``inp`` a GGUF path, ``out`` the path written (nothing with ``dry_run``). ``log(line)``
    gets llama-quantize's per-tensor lines; ``progress(i, n, name)`` after each tensor. ``own_process``: the caller
    is the quantize command in a process of its own (it asks for this), where Numba's start-up may be shortened:
    while this process imports Numba and loads its kernels, a forked process converts the first tensors NumPy can
    (``_Helper``), and Numba is imported without what the kernels never use (``_import_numba``)."""
    from ..gguf.reader import GGUFReader
    t0 = time.perf_counter()
    r = GGUFReader(inp, decode_string_arrays=False)     # the vocabulary is copied as bytes
    try:
        return _quantize(r, out, params, log or (lambda s: None), progress, t0, own_process)
    finally:
        r.close()


class _Helper:
    """A forked process that converts tensors with NumPy (``quants_np``, the same bytes) while this one imports
    Numba and loads its kernels (~0.25-0.35 s on one thread, when the second core had nothing to do: the kernel
    loader thread tried before gained nothing, as Numba's import and NumPy's rows both hold the GIL; a process has
    its own). It writes each tensor into the output file at its place (pwrite; the writer moves past it,
    ``WRITTEN_ELSEWHERE``) and exits when no tensor is left for it.

    Which of the two converts a tensor is settled through a pipe that holds the candidates' indices in file order,
    4 bytes each, its write end closed before the fork: whoever reads an index converts that tensor (a pipe read of
    4 bytes takes one whole record, atomically). The helper takes them in turn; this process, on reaching a
    candidate, reads indices until it reads that one (its own) or a later one (the candidate was the helper's, and
    the later one is now this process's). After the first tensor this process converts itself (its kernels
    loaded), it reads all the indices left, so that the helper stops where NumPy's slower rows would only take
    the cores from the kernels'."""

    def __init__(self, jobs, cands: list, f, offsets: list, scratch: np.ndarray):
        self.cands, self.mine, self.drained = set(cands), set(), False
        self.last = -1                  # the last index read here: every candidate before it is taken
        rfd, wfd = os.pipe()
        try:
            os.write(wfd, b"".join(i.to_bytes(4, "little") for i in cands))     # (a pipe holds 64 KiB)
        finally:
            os.close(wfd)
        self.rfd = rfd
        f.flush()
        self.pid = os.fork()
        if self.pid == 0:                # the helper: converts what it reads, then ends without Python's exit
            code = 1
            try:
                _helper_run(rfd, f.fileno(), jobs, offsets, scratch)
                code = 0
            except BaseException as e:  # noqa: BLE001 -- any failure ends the helper with status 1
                try:
                    os.write(2, f"llampy quantize: helper process: {type(e).__name__}: {e}\n".encode())
                except BaseException:   # noqa: BLE001
                    pass
            finally:
                os._exit(code)

    def _read(self) -> int | None:
        rec = os.read(self.rfd, 4)
        return int.from_bytes(rec, "little") if len(rec) == 4 else None

    def takes(self, i: int) -> bool:
        """Whether the helper converts tensor ``i`` (claimed now if neither has it yet)."""
        if i not in self.cands or i in self.mine:
            return False
        self._claim(i)
        return i not in self.mine

    def stop(self) -> None:
        """Takes every index the helper has not read: it ends after the tensor it is converting."""
        self._claim()

    def _claim(self, upto: int | None = None) -> None:
        """Reads indices (each one read here is this process's) until one at or past ``upto``, or until none is left."""
        while not self.drained and (upto is None or self.last < upto):
            j = self._read()
            if j is None:
                self.drained = True
            else:
                self.mine.add(j)
                self.last = j

    def wait(self) -> None:
        """Waits for the helper to end: its tensors are in the file once this returns."""
        pid, self.pid = self.pid, 0
        os.close(self.rfd)
        _, status = os.waitpid(pid, 0)
        if status:
            raise QuantizeError(f"the helper process failed (wait status {status})")

    def kill(self) -> None:
        if self.pid:
            import signal
            try:
                os.kill(self.pid, signal.SIGKILL)
            finally:
                pid, self.pid = self.pid, 0
                os.close(self.rfd)
                os.waitpid(pid, 0)


def _helper_run(rfd: int, fd: int, jobs, offsets: list, scratch: np.ndarray) -> None:
    """The helper process's loop (``_Helper``)."""
    while True:
        rec = os.read(rfd, 4)
        if len(rec) < 4:
            return
        i = int.from_bytes(rec, "little")
        _, ti, ne, new_type, nbytes, _ = jobs[i]
        data = memoryview(_quantize_tensor(ti, ne, new_type, None, None, scratch[:nbytes], kernels=False))
        done, at = 0, offsets[i]
        while done < nbytes:
            done += os.pwrite(fd, data[done:], at + done)


def _import_numba(lean: bool):
    """Numba, imported; ``lean``: as the quantize command's own process imports it (``tuning.lean_numba``)."""
    if lean:
        from .. import tuning
        return tuning.lean_numba()
    import numba
    return numba


def _helper_candidates(jobs) -> list:
    """The tensors a helper process may convert: those NumPy converts to the kernels' bytes (``_numpy_converts``)."""
    return [i for i, (_, ti, _, new_type, _, im) in enumerate(jobs)
            if new_type != ti.type and _numpy_converts(ti, new_type, im)]


def _quantize(r, out, params: QuantizeParams, log, progress, t0, own_process=False) -> QuantizeResult:
    from ..ggml.quants_np import NUMPY_TYPES
    from ..gguf.writer import WRITTEN_ELSEWHERE, FileRange, GGUFWriter
    ftype = params.ftype
    if ftype not in FTYPE_DEFAULT:
        raise QuantizeError(f"invalid output file type {ftype}")
    default_type = FTYPE_DEFAULT[ftype]
    if params.only_copy:
        ftype = int(r.get("general.file_type", _guessed_ftype(r.tensors)))
    if params.imatrix:
        for k, v in params.imatrix.items():
            if not np.isfinite(v).all():
                raise QuantizeError(f"imatrix contains non-finite values ({k})")
    w = GGUFWriter(None)
    for k in r.metadata:                # the input's bytes for each value: not decoded and encoded again
        w.add_encoded(k, r.value_bytes(k), r.value_types[k])
    from ..gguf.constants import GGUFValueType as VT

    def set_val(key, value, vt):
        w.kv = [kv for kv in w.kv if kv[0] != key]
        w.add(key, value, vt)
    set_val("general.quantization_version", GGML_QNT_VERSION, VT.UINT32)
    set_val("general.file_type", ftype, VT.UINT32)
    for key in ("split.no", "split.count", "split.tensors.count"):
        w.kv = [kv for kv in w.kv if kv[0] != key]
    for key, value, vt in params.kv_overrides:
        set_val(key, value, vt)

    names = weights_order(list(r.tensors))
    qs = QuantizeState(r.metadata, params, names)
    plan = []
    for name in names:
        ti = r.tensors[name]
        ne = tuple(ti.ne)
        allows = tensor_allows_quantization(params, qs.arch, name, ne)
        new_type = tensor_get_type(qs, name, ti.type, ne, default_type) if allows else T(ti.type)
        if not params.imatrix and allows and tensor_requires_imatrix(name, new_type, ftype) and not params.dry_run:
            raise QuantizeError(f"this quantization requires an importance matrix (tensor {name}, "
                                f"type {ggml_type_name(new_type)})")
        plan.append((name, ti, ne, new_type))

    nthread = params.nthread if params.nthread > 0 else (os.cpu_count() or 1)
    types, size_org, size_new, n_el = {}, 0, 0, 0
    jobs = []                           # (name, ti, ne, new_type, output bytes, imatrix or None): checked up front
    for name, ti, ne, new_type in plan:
        n_el += ti.n_elements
        size_org += ti.nbytes
        nbytes = ti.nbytes
        im = None
        if new_type != ti.type:
            tt = TYPE_TRAITS[new_type]
            nbytes = ti.n_elements // tt.blck_size * tt.type_size
            if not params.dry_run:
                if TYPE_TRAITS[ti.type].is_quantized and not params.allow_requantize:
                    raise QuantizeError(f"requantizing from type {ggml_type_name(ti.type)} is disabled")
                done_by, needs_im = (True, False) if new_type in NUMPY_TYPES else _kernel_support(new_type)
                if not done_by:
                    raise QuantizeError(f"quantizing to {ggml_type_name(new_type)} is not implemented in llampy")
                im = _imatrix_for(params, name, ne, new_type, ftype)
                if im is None and needs_im:
                    # ggml asserts here; say it instead
                    raise QuantizeError(f"quantizing {name} to {ggml_type_name(new_type)} needs an importance "
                                        f"matrix entry for it")
        size_new += nbytes
        types[name] = new_type
        jobs.append((name, ti, ne, new_type, nbytes, im))

    def line(i, name, ti, ne, new_type, nbytes):
        shape = "[" + ", ".join(f"{x:5d}" for x in (tuple(ne) + (1,) * 4)[:4]) + "]"
        head = f"[{i + 1:4d}/{len(plan):4d}] {name:<36s} - {shape}, type = {ggml_type_name(ti.type):>6s}, "
        if new_type == ti.type:
            return head + f"size = {ti.nbytes / 1048576:8.3f} MiB"
        if params.dry_run:
            return (head + f"size = {ti.nbytes / 1048576:8.2f} MiB -> {nbytes / 1048576:8.2f} MiB "
                           f"({ggml_type_name(new_type)})")
        return (head + f"converting to {ggml_type_name(new_type)} .. size = {ti.nbytes / 1048576:8.2f} MiB -> "
                       f"{nbytes / 1048576:8.2f} MiB")

    if params.dry_run:
        for i, (name, ti, ne, new_type, nbytes, _) in enumerate(jobs):
            log(line(i, name, ti, ne, new_type, nbytes))
            if progress:
                progress(i + 1, len(plan), name)
    else:
        kernels = _needs_kernels(jobs, nthread)
        # each tensor is quantized when the writer reaches it, into one buffer reused for all of them (written out
        # before the next is made): memory holds one output tensor, not the file, as llama-quantize
        sizes = [j[4] for j in jobs if j[3] != j[1].type]
        scratch = np.empty(max(sizes, default=0), np.uint8)
        pool = helper = None

        def make(i):
            name, ti, ne, new_type, nbytes, im = jobs[i]
            if new_type == ti.type:
                data = FileRange(r.fileno(), ti.offset, ti.nbytes)     # copied by the kernel
            elif helper is not None and helper.takes(i):
                data = WRITTEN_ELSEWHERE
            else:
                data = _quantize_tensor(ti, ne, new_type, im, pool, scratch[:nbytes], kernels)
                if helper is not None:
                    helper.stop()       # the kernels are loaded: the rest is theirs
            log(line(i, name, ti, ne, new_type, nbytes))
            if progress:
                progress(i + 1, len(plan), name)
            return data

        for i, (name, ti, ne, new_type, _, _) in enumerate(jobs):
            w.add_tensor_lazy(name, new_type, ne[:n_dims(ne)], lambda i=i: make(i))
        f = None
        try:
            if (own_process and kernels and nthread > 1 and "numba" not in sys.modules and hasattr(os, "fork")
                    and isinstance(out, (str, os.PathLike)) and threading.active_count() == 1):
                # forked before Numba's import, while this process runs no other thread (a fork copies only the
                # calling one)
                cands = _helper_candidates(jobs)
                if cands:
                    f = open(out, "wb")
                    helper = _Helper(jobs, cands, f, w.data_offsets(), scratch)
            if kernels:
                # the searches are Numba loops over blocks (prange); NumPy's packing runs in the pool's threads
                numba = _import_numba(own_process)
                numba.set_num_threads(max(1, min(nthread, numba.config.NUMBA_NUM_THREADS)))
            if nthread > 1 and any(j[3] != j[1].type for j in jobs):
                # imported here: concurrent.futures (logging, queue...) is ~8 ms of a COPY or F16 run's ~0.3 s
                from concurrent.futures import ThreadPoolExecutor
                pool = ThreadPoolExecutor(nthread)
            w.target = out if f is None else f
            w.write()
            if helper is not None:
                helper.wait()
        except BaseException:
            if helper is not None:
                helper.kill()
            if f is not None:
                f.close()
            if isinstance(out, (str, os.PathLike)) and os.path.exists(out):
                os.remove(out)          # no half-written file left behind
            raise
        finally:
            if pool:
                pool.shutdown()
        if f is not None:
            f.close()
    for msg in qs.warnings:
        log("warning: " + msg)
    return QuantizeResult(types, size_org, size_new, n_el, qs.n_fallback, time.perf_counter() - t0)


def _kernel_support(t: GGMLType) -> tuple[bool, bool]:
    """(the kernels quantize ``t``, ``t`` needs an importance matrix), without importing them (quants_np's names)."""
    from ..ggml.quants_np import KERNEL_NEEDS_IMATRIX, KERNEL_TYPES
    return t in KERNEL_TYPES, t in KERNEL_NEEDS_IMATRIX


# Numba's import, its first cached kernel and the file's further kernels cost ~0.4 s of CPU before the first tensor;
# NumPy's conversions cost more per value than the kernels (per value and thread, from fp16 rows: ~0.6 ns more to
# F32 (the table lookup against Numba's arithmetic), ~5 ns to Q8_0, Q4_0 and Q5_0, ~9 ns to Q4_1 and Q5_1; one
# "unit" below each ~1.5 ns; BF16 is the same table lookup either way), so NumPy alone converts a file while it has
# at most this many units of work per thread (SmolLM2-135M's F16 on 2 threads, CPU seconds, NumPy against the
# kernels: to F32 0.76 / 1.15, BF16 0.65 / 1.01, Q8_0 1.26 / 1.06, Q4_0 1.35 / 1.11)
_NUMPY_UNITS_PER_THREAD = 250_000_000
_NUMPY_UNITS = {T.BF16: 0, T.Q8_0: 4, T.Q4_0: 4, T.Q5_0: 4, T.Q4_1: 7, T.Q5_1: 7}


def _numpy_converts(ti, new_type, im) -> bool:
    """Whether NumPy (``quants_np``) converts tensor ``ti`` to ``new_type`` with the kernels' bytes: its type and input
    are NumPy's, and an importance matrix, if any, is one ggml does not weigh this type by."""
    from ..ggml.quants_np import NUMPY_TYPES
    if new_type not in NUMPY_TYPES or ti.type not in (T.F32, T.F16, T.BF16):
        return False
    return im is None or new_type in (T.F32, T.F16, T.BF16, T.Q8_0)     # ggml weighs the others by it


def _needs_kernels(jobs, nthread: int) -> bool:
    """Whether the Numba kernels quantize this file: a type, input or importance matrix only they handle, or enough
    work that their speed pays for their start-up (the bytes are the same either way)."""
    units = 0
    for _, ti, _, new_type, _, im in jobs:
        if new_type == ti.type:
            continue
        if not _numpy_converts(ti, new_type, im):
            return True
        units += ti.n_elements * _NUMPY_UNITS.get(new_type, 1 if ti.type == T.F16 else 0)
    return units > _NUMPY_UNITS_PER_THREAD * max(1, nthread)


def _imatrix_for(params, name, ne, new_type, ftype):
    if not params.imatrix:
        if tensor_requires_imatrix(name, new_type, ftype):
            raise QuantizeError(f"Missing importance matrix for tensor {name} in a very low-bit quantization")
        return None
    v = params.imatrix.get(name)
    n_expert = ne[2] if len(ne) > 2 else 1
    if v is None or len(v) != ne[0] * n_expert:
        if v is not None and name not in ("token_embd.weight", "per_layer_token_embd.weight"):
            raise QuantizeError(f"imatrix size {len(v)} is different from tensor size {ne[0] * n_expert} for {name}")
        if tensor_requires_imatrix(name, new_type, ftype):
            raise QuantizeError(f"Missing importance matrix for tensor {name} in a very low-bit quantization")
        return None
    return np.asarray(v, np.float32).reshape(n_expert, ne[0])


def _quantize_tensor(ti, ne, new_type, im, pool, out: np.ndarray, kernels: bool = True) -> np.ndarray:
    ne0 = ne[0]
    n_expert = 1
    for x in ne[2:]:
        n_expert *= x
    rows_per_expert = ne[1] if len(ne) > 1 else 1
    # F16 rows go to quantize_rows as they are (converted chunk by chunk there)
    x = ti.data.view("<u2").reshape(-1, ne0) if ti.type == T.F16 else _rows_to_f32(ti.data, T(ti.type), ne0)
    if im is None or not kernels:           # no kernels: no tensor has a matrix ggml would use (_needs_kernels)
        return quantize_rows(x, new_type, None, pool, out=out, kernels=kernels).reshape(-1)
    per = out.nbytes // n_expert
    for e in range(n_expert):
        quantize_rows(x[e * rows_per_expert:(e + 1) * rows_per_expert], new_type, im[e], pool,
                      out=out[e * per:(e + 1) * per])
    return out
