"""Hugging Face checkpoints (config.json, *.safetensors, tokenizer.json, tokenizer_config.json) to GGUF, with
llama.cpp's tensor names, metadata keys and type rules (convert_hf_to_gguf.py and conversion/*.py), so that
llama.cpp and llampy load the result.

    convert_hf("SmolLM2-135M/", "out.gguf", outtype="q8_0")

Architectures: LlamaForCausalLM (Q and K rows permuted back to ggml's rope layout), Qwen2ForCausalLM,
Qwen3ForCausalLM, Gemma2ForCausalLM and Gemma3ForCausalLM (norm weights + 1), Phi3ForCausalLM (fused QKV and
gate+up; no long-context rope factors yet), Qwen3MoeForCausalLM (experts stacked) and GraniteForCausalLM (its
multipliers as scales), Starcoder2ForCausalLM (LayerNorm with biases, plain GELU MLP), MistralForCausalLM and
MixtralForCausalLM (as llama), SmolLM3ForCausalLM, Olmo2ForCausalLM, PhiForCausalLM (phi2),
CohereForCausalLM (command-r), Cohere2ForCausalLM. Tokenizers: vocab.py.
PEFT adapters of these models: peft.py.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from ..ggml.quants import quantize
from ..ggml.types import GGMLType
from ..gguf import GGUFWriter
from ..gguf.constants import GGUFValueType as VT
from .files import ConvertError, SafeTensors, load_json as _load_json
from .vocab import spm_vocab_metadata, vocab_metadata


# llama.cpp's LlamaFileType for each --outtype, and the tensor type a matrix gets under it
OUTTYPES = {"f32": (0, GGMLType.F32), "f16": (1, GGMLType.F16), "q8_0": (7, GGMLType.Q8_0),
            "bf16": (32, GGMLType.BF16)}
QUANT_VERSION = 2      # GGML_QNT_VERSION

# HF name (after "model.layers.N.") -> GGUF name (after "blk.N."): llama.cpp's TensorNameMap for these families
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
    # a mixture of experts' weights, stacked from mlp.experts.E.*_proj by the converter
    "mlp.experts.gate_proj": "ffn_gate_exps", "mlp.experts.up_proj": "ffn_up_exps",
    "mlp.experts.down_proj": "ffn_down_exps",
}
GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
                "model.final_layernorm": "output_norm"}

# per-architecture renames on top of LAYER_NAMES: Gemma's four norms per block, Phi-3's fused projections
ARCH_LAYER_NAMES = {
    "gemma2": {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"},
    "phi3": {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"},
}
ARCH_LAYER_NAMES["gemma3"] = ARCH_LAYER_NAMES["gemma2"]
ARCH_LAYER_NAMES["starcoder2"] = {"mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
ARCH_LAYER_NAMES["phi2"] = {"self_attn.dense": "attn_output", "mlp.fc1": "ffn_up", "mlp.fc2": "ffn_down"}
ARCH_LAYER_NAMES["olmo2"] = {"post_attention_layernorm": "post_attention_norm",
                             "post_feedforward_layernorm": "post_ffw_norm"}

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                 "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3", "Phi3ForCausalLM": "phi3",
                 "Qwen3MoeForCausalLM": "qwen3moe", "GraniteForCausalLM": "granite",
                 "Starcoder2ForCausalLM": "starcoder2", "MistralForCausalLM": "llama", "MixtralForCausalLM": "llama",
                 "SmolLM3ForCausalLM": "smollm3", "Olmo2ForCausalLM": "olmo2",
                 "PhiForCausalLM": "phi2", "CohereForCausalLM": "command-r",
                 "Cohere2ForCausalLM": "cohere2"}
# head_dim as transformers' configuration classes fill it in when config.json leaves it out (convert_hf_to_gguf.py
# reads the configuration through them, AutoConfig, and writes attention.key_length from it): 0 for
# hidden_size / num_attention_heads (LlamaConfig, Cohere2Config)
HEAD_DIM_DEFAULT = {"LlamaForCausalLM": 0, "Cohere2ForCausalLM": 0, "Qwen3ForCausalLM": 128, "Gemma2ForCausalLM": 256}
PERMUTED = ("llama", "granite", "smollm3")   # LlamaModel and its subclasses undo HF's Q/K permutation


def _checkpoint_tensors(d: Path) -> dict[str, tuple]:
    """name -> (shape, loader) over the checkpoint's safetensors files (one, or the shards of an index)."""
    index = d / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in d.glob("*.safetensors"))
    if not files:
        raise ConvertError(f"{d}: no *.safetensors files")
    out: dict[str, tuple] = {}
    for f in files:
        st = SafeTensors(d / f)
        for n in st.names():
            out[n] = (st.shape(n), lambda st=st, n=n: st.load(n))
    return out


# ---------------------------------------------------------------------------------------------- tensors
def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """LlamaModel.permute: HF's rotate-half Q/K rows back to ggml's interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str, arch: str = "llama") -> str | None:
    """llama.cpp's name for an HF tensor name, or None when it is not one of the mapped tensors."""
    stem, _, suffix = hf.rpartition(".")
    if stem in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[stem]}.{suffix}"
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", stem)
    if m:
        names = {**LAYER_NAMES, **ARCH_LAYER_NAMES.get(arch, {})}
        if m.group(2) in names:
            return f"blk.{m.group(1)}.{names[m.group(2)]}.{suffix}"
    return None


def _tensor_type(name: str, shape: tuple, matrix_type: GGMLType) -> GGMLType:
    """convert_hf_to_gguf's prepare_tensors: 1-D tensors and norms in F32, every other .weight in the file type;
    a row that is not whole Q8_0 blocks falls back to F16."""
    if (len(shape) <= 1 or name.endswith(("_norm.weight", "ffn_gate_inp.weight"))
            or not name.endswith((".weight", ".lora_a", ".lora_b"))):
        return GGMLType.F32
    if matrix_type == GGMLType.Q8_0 and shape[-1] % 32:
        return GGMLType.F16
    return matrix_type


def _encode(data: np.ndarray, t: GGMLType) -> np.ndarray:
    x = np.asarray(data, np.float32)
    if t == GGMLType.F32:
        return x
    if t == GGMLType.F16:
        return np.asarray(data).astype(np.float16) if data.dtype == np.float16 else x.astype(np.float16)
    q = quantize(x, t)
    return q.view(np.uint16) if t == GGMLType.BF16 else q


# ---------------------------------------------------------------------------------------------- the model
def _hparams_metadata(arch: str, cfg: dict, n_layer: int, file_type: int) -> list[tuple[str, object, tuple]]:
    """TextModel.set_gguf_parameters (and LlamaModel's additions) for these families."""
    a, U32, F32 = arch, (VT.UINT32,), (VT.FLOAT32,)
    kv = [(f"{a}.block_count", n_layer, U32)]
    for key, hf in (("context_length", "max_position_embeddings"), ("embedding_length", "hidden_size"),
                    ("feed_forward_length", "intermediate_size"), ("attention.head_count", "num_attention_heads"),
                    ("attention.head_count_kv", "num_key_value_heads")):
        if cfg.get(hf) is not None:
            kv.append((f"{a}.{key}", int(cfg[hf]), U32))
    rope = cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type"))
    if rope_type == "linear" and rope.get("factor") is not None:
        kv += [(f"{a}.rope.scaling.type", "linear", (VT.STRING,)),
               (f"{a}.rope.scaling.factor", float(rope["factor"]), F32)]
    elif rope_type == "yarn" and rope.get("factor") is not None:
        kv += [(f"{a}.rope.scaling.type", "yarn", (VT.STRING,)),
               (f"{a}.rope.scaling.factor", float(rope["factor"]), F32),
               (f"{a}.rope.scaling.original_context_length", int(rope["original_max_position_embeddings"]), U32)]
    elif rope_type not in (None, "default", "llama3"):
        raise ConvertError(f"rope_scaling {rope_type!r} is not converted by llampy")
    theta = cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta"))
    if theta is not None:
        kv.append((f"{a}.rope.freq_base", float(theta), F32))
    if cfg.get("rms_norm_eps") is not None:
        kv.append((f"{a}.attention.layer_norm_rms_epsilon", float(cfg["rms_norm_eps"]), F32))
    eps = next((cfg[k] for k in ("layer_norm_eps", "layer_norm_epsilon", "norm_epsilon") if cfg.get(k) is not None),
               None)
    if eps is not None:
        kv.append((f"{a}.attention.layer_norm_epsilon", float(eps), F32))
    if cfg.get("head_dim") is not None:
        kv += [(f"{a}.attention.key_length", int(cfg["head_dim"]), U32),
               (f"{a}.attention.value_length", int(cfg["head_dim"]), U32)]
    kv.append(("general.file_type", file_type, U32))
    n_expert = cfg.get("num_local_experts", cfg.get("num_experts"))
    if n_expert is not None:
        kv += [(f"{a}.expert_count", int(n_expert), U32),
               (f"{a}.expert_used_count", int(cfg["num_experts_per_tok"]), U32)]
    if arch == "qwen3moe" and cfg.get("moe_intermediate_size") is not None:
        kv.append((f"{a}.expert_feed_forward_length", int(cfg["moe_intermediate_size"]), U32))
    if arch == "granite":        # GraniteModel: the multipliers, named as scales
        for key, hf in (("attention.scale", "attention_multiplier"), ("embedding_scale", "embedding_multiplier"),
                        ("residual_scale", "residual_multiplier"), ("logit_scale", "logits_scaling")):
            if cfg.get(hf):
                kv.append((f"{a}.{key}", float(cfg[hf]), F32))
    if arch == "command-r":      # CommandR2Model: the logit scale, no rope scaling
        kv += [(f"{a}.logit_scale", float(cfg["logit_scale"]), F32),
               (f"{a}.rope.scaling.type", "none", (VT.STRING,))]
    if arch == "cohere2":        # Cohere2Model
        head_dim = int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])
        kv += [(f"{a}.logit_scale", float(cfg["logit_scale"]), F32),
               (f"{a}.attention.sliding_window", int(cfg["sliding_window"]), U32),
               (f"{a}.vocab_size", int(cfg["vocab_size"]), U32),
               (f"{a}.rope.dimension_count", int(cfg.get("rotary_pct", 1.0) * head_dim), U32),
               (f"{a}.rope.scaling.type", "none", (VT.STRING,))]
    if arch in PERMUTED:
        kv.append((f"{a}.vocab_size", int(cfg["vocab_size"]), U32))
        kv.append((f"{a}.rope.dimension_count",
                   int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]), U32))
    elif arch == "gemma2":       # Gemma2Model.set_gguf_parameters replaces the generic keys
        kv = [(f"{a}.{k}", v, sig) for k, v, sig in (
            ("context_length", int(cfg["max_position_embeddings"]), U32),
            ("embedding_length", int(cfg["hidden_size"]), U32), ("block_count", n_layer, U32),
            ("feed_forward_length", int(cfg["intermediate_size"]), U32),
            ("attention.head_count", int(cfg["num_attention_heads"]), U32),
            ("attention.head_count_kv", int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]), U32),
            ("attention.layer_norm_rms_epsilon", float(cfg["rms_norm_eps"]), F32),
            ("attention.key_length", int(cfg["head_dim"]), U32), ("attention.value_length", int(cfg["head_dim"]), U32))]
        kv.append(("general.file_type", file_type, U32))
        kv += [(f"{a}.attn_logit_softcapping", float(cfg["attn_logit_softcapping"]), F32),
               (f"{a}.final_logit_softcapping", float(cfg["final_logit_softcapping"]), F32),
               (f"{a}.attention.sliding_window", int(cfg["sliding_window"]), U32)]
    elif arch == "gemma3":       # Gemma3Model's defaults for keys its configs leave out
        kv += [(f"{a}.context_length", int(cfg.get("max_position_embeddings", 131072)), U32),
               (f"{a}.attention.head_count", int(cfg.get("num_attention_heads", 8)), U32),
               (f"{a}.attention.layer_norm_rms_epsilon", float(cfg.get("rms_norm_eps", 1e-6)), F32),
               (f"{a}.attention.key_length", int(cfg.get("head_dim", 256)), U32),
               (f"{a}.attention.value_length", int(cfg.get("head_dim", 256)), U32),
               (f"{a}.rope.freq_base", float(cfg.get("rope_theta", 1_000_000.0)), F32)]
        if cfg.get("rope_local_base_freq") is not None:
            kv.append((f"{a}.rope.freq_base_swa", float(cfg["rope_local_base_freq"]), F32))
        if cfg.get("attn_logit_softcapping") is not None:
            raise ConvertError("gemma3 has no attention soft-capping (attn_logit_softcapping is set)")
        if cfg.get("final_logit_softcapping"):
            kv.append((f"{a}.final_logit_softcapping", float(cfg["final_logit_softcapping"]), F32))
        if cfg.get("sliding_window_pattern") != 1:
            kv.append((f"{a}.attention.sliding_window", int(cfg["sliding_window"]), U32))
        kv.append((f"{a}.attention.head_count_kv", int(cfg.get("num_key_value_heads", 4)), U32))
    elif arch == "phi2":         # Phi2Model.set_gguf_parameters (its add_bos False: convert_hf)
        n_embd, n_head = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        kv = [(f"{a}.context_length", int(cfg.get("n_positions", cfg.get("max_position_embeddings"))), U32),
              (f"{a}.embedding_length", n_embd, U32), (f"{a}.feed_forward_length", 4 * n_embd, U32),
              (f"{a}.block_count", n_layer, U32), (f"{a}.attention.head_count", n_head, U32),
              (f"{a}.attention.head_count_kv", n_head, U32),
              (f"{a}.attention.layer_norm_epsilon",
               float(cfg.get("layer_norm_epsilon", cfg.get("layer_norm_eps"))), F32),
              (f"{a}.rope.dimension_count", int(cfg["partial_rotary_factor"] * n_embd) // n_head, U32),
              ("general.file_type", file_type, U32)]
    elif arch == "phi3":         # Phi3MiniModel.set_gguf_parameters
        if (cfg.get("rope_scaling") or {}).get("long_factor"):
            raise ConvertError("phi3 with long-context rope factors (rope_scaling.long_factor) is not converted yet")
        n_embd, n_head = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        rope_dims = int(cfg.get("partial_rotary_factor", 1.0) * n_embd) // n_head
        kv = [(f"{a}.{k}", v, sig) for k, v, sig in (
            ("context_length", int(cfg["max_position_embeddings"]), U32),
            ("rope.scaling.original_context_length",
             int(cfg.get("original_max_position_embeddings", cfg["max_position_embeddings"])), U32),
            ("embedding_length", n_embd, U32), ("feed_forward_length", int(cfg["intermediate_size"]), U32),
            ("block_count", n_layer, U32), ("attention.head_count", n_head, U32),
            ("attention.head_count_kv", int(cfg.get("num_key_value_heads") or n_head), U32),
            ("attention.layer_norm_rms_epsilon", float(cfg["rms_norm_eps"]), F32),
            ("rope.dimension_count", rope_dims, U32), ("rope.freq_base", float(cfg.get("rope_theta", 10000.0)), F32))]
        kv += [("general.file_type", file_type, U32),
               (f"{a}.attention.sliding_window", int(cfg.get("sliding_window") or 0), U32)]
    # gguf-py's writer keeps a key's first place and its last value when a key is added again
    out: dict[str, tuple] = {}
    for k, v, sig in kv:
        out[k] = (v, sig)
    return [(k, v, sig) for k, (v, sig) in out.items()]


def _llama3_rope_factors(cfg: dict) -> np.ndarray | None:
    """LlamaModel.generate_extra_tensors: rope_freqs for rope_scaling type llama3."""
    rope = cfg.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type")) != "llama3":
        return None
    base = cfg.get("rope_theta", 10000.0)
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_ctx = rope.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    out = []
    for f in freqs:
        wavelen = 2 * np.pi / f
        if wavelen < high_wavelen:
            out.append(1)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def _stack_experts(tensors: dict[str, tuple]) -> dict[str, tuple]:
    """Qwen2MoeModel.modify_tensors (and LlamaModel's for Mixtral's block_sparse_moe.experts.E.w1/w2/w3):
    model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight stacked over E into
    model.layers.N.mlp.experts.{gate,up,down}_proj.weight [n_expert, rows, cols] (read when written)."""
    groups: dict[str, dict[int, tuple]] = {}
    out: dict[str, tuple] = {}
    mixtral = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}     # LlamaModel's names for Mixtral's
    for hf, (shape, load) in tensors.items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                         r"(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight", hf)
        if m is None:
            out[hf] = (shape, load)
            continue
        w = mixtral.get(m.group(3), m.group(3))
        groups.setdefault(f"model.layers.{m.group(1)}.mlp.experts.{w}.weight", {})[int(m.group(2))] = (shape, load)
    for name, experts in groups.items():
        if sorted(experts) != list(range(len(experts))):
            raise ConvertError(f"experts of {name} are not numbered 0..{len(experts) - 1}")
        parts = [experts[e] for e in range(len(experts))]
        shape = (len(parts),) + tuple(parts[0][0])
        out[name] = (shape, lambda parts=parts: np.stack([np.asarray(load()) for _, load in parts]))
    return out


def convert_hf(src, dst, outtype: str = "f16", name: str | None = None, log=None, progress=None) -> Path:
    """Writes the GGUF of the checkpoint in directory ``src`` to ``dst``; returns ``dst``. One tensor at a time is
    read, converted and written; ``progress(i, n, name)`` is called before each."""
    log = log or (lambda s: None)
    d, dst = Path(src), Path(dst)
    if outtype not in OUTTYPES:
        raise ConvertError(f"--outtype must be one of {', '.join(OUTTYPES)}, not {outtype!r}")
    file_type, matrix_type = OUTTYPES[outtype]
    cfg = _load_json(d / "config.json")
    if cfg is None:
        raise ConvertError(f"{d}: no config.json")
    hf_arch = (cfg.get("architectures") or [None])[0]
    arch = ARCHITECTURES.get(hf_arch)
    if arch is None:
        raise ConvertError(f"{d}: architecture {hf_arch!r} is not converted by llampy "
                           f"(supported: {', '.join(ARCHITECTURES)})")
    if cfg.get("head_dim") is None and hf_arch in HEAD_DIM_DEFAULT:
        cfg = {**cfg, "head_dim": HEAD_DIM_DEFAULT[hf_arch]
               or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])}
    if arch == "granite":
        cfg = {k: v for k, v in cfg.items() if k != "head_dim"}     # GraniteModel ignores it
    if arch == "command-r":      # trained on model_max_length, whatever max_position_embeddings says
        cfg = {**cfg, "max_position_embeddings": cfg.get("model_max_length", cfg["max_position_embeddings"])}
    n_layer = int(cfg["num_hidden_layers"])
    n_head = int(cfg["num_attention_heads"])
    n_head_kv = int(cfg.get("num_key_value_heads") or n_head)
    tensors = _stack_experts(_checkpoint_tensors(d))

    w = GGUFWriter(dst)
    w.add("general.architecture", arch)
    w.add("general.type", "model")
    w.add("general.name", name or d.resolve().name)
    w.add("general.quantization_version", QUANT_VERSION, VT.UINT32)
    for k, v, sig in _hparams_metadata(arch, cfg, n_layer, file_type):
        w.add(k, v, sig)
    vocab = vocab_metadata
    if (d / "tokenizer.model").is_file():
        tc = _load_json(d / "tokenizer_config.json") or {}
        if not (arch == "phi3" and tc.get("tokenizer_class") == "GPT2Tokenizer"):
            vocab = lambda d, n: spm_vocab_metadata(d, n, arch)    # noqa: E731  (llama.cpp tries SentencePiece first)
    vkv = vocab(d, cfg.get("vocab_size"))
    # Phi2Model, and LlamaModel for granite's small models: no BOS
    if arch == "phi2" or (arch in PERMUTED and cfg.get("vocab_size") == 49152):
        vkv = [x for x in vkv if x[0] != "tokenizer.ggml.add_bos_token"]
        vkv.append(("tokenizer.ggml.add_bos_token", False, (VT.BOOL,)))
    for k, v, sig in vkv:
        w.add(k, v, sig)

    factors = _llama3_rope_factors(cfg) if arch in PERMUTED else None
    if factors is not None:
        w.add_tensor("rope_freqs.weight", factors)
    n_vocab_real = None
    if arch == "gemma3":      # Gemma3Model drops the embedding's rows past the tokenizer's tokens
        tj = _load_json(d / "tokenizer.json") or {}
        n_vocab_real = len(tj.get("model", {}).get("vocab", {})) + len(tj.get("added_tokens", []))
    for hf, (shape, load) in tensors.items():
        if hf == "lm_head.weight" and (cfg.get("tie_word_embeddings") or arch in ("gemma2", "gemma3")):
            continue
        if arch == "cohere2" and hf.endswith(".bias"):
            continue        # Cohere2Model skips its biases (all zero; llama.cpp's graph has none)
        if re.search(r"\.rotary_emb\.inv_freq$", hf):
            continue
        gn = gguf_name(hf, arch)
        if gn is None:
            raise ConvertError(f"{d}: cannot map tensor {hf!r} to a llama.cpp name")
        if n_vocab_real is not None and hf == "model.embed_tokens.weight":
            shape = (min(shape[0], n_vocab_real),) + tuple(shape[1:])
        t = _tensor_type(gn, shape, matrix_type)
        w.add_tensor_lazy(gn, t, tuple(reversed(shape)),
                          lambda hf=hf, load=load, shape=shape, t=t: _encode(_prepare(hf, load(), shape), t))
        log(f"{gn:32s} -> {t.name}, shape = {{{', '.join(map(str, reversed(shape)))}}}")

    def _prepare(hf: str, data: np.ndarray, shape: tuple) -> np.ndarray:
        """modify_tensors: the rows kept, Gemma's norm shift, llama's Q/K permutation."""
        data = data[:shape[0]] if data.shape != shape else data
        if arch in ("gemma2", "gemma3") and hf.endswith("norm.weight"):
            data = np.asarray(data, np.float32) + 1.0      # Gemma's RMSNorm multiplies by (1 + weight)
        if arch in PERMUTED:
            if hf.endswith(("q_proj.weight", "q_proj.bias")):
                data = _permute(np.asarray(data), n_head)
            elif hf.endswith(("k_proj.weight", "k_proj.bias")):
                data = _permute(np.asarray(data), n_head_kv)
        return data
    w.write(progress=progress)
    return dst
