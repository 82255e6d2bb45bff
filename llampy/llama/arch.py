"""Architectures: the registry from ``general.architecture`` to the module that builds it, and the GGUF tensor names.

A model file is found lazily (``llampy.llama.models.<module>``), as vLLM's registry does, so an architecture costs
nothing until it is used. Each module defines ``load_hparams(hp, md)``, ``load_tensors(model, loader)`` and
``build_graph(model, g)`` (see models/llama.py).

Another package adds architectures without editing llampy: an entry point in the group ``llampy.architectures``
whose name is the ``general.architecture`` string and whose value is the module (docs/architectures.md). A
built-in name wins over a plugin's.
"""
from __future__ import annotations

import importlib
from importlib import metadata

# general.architecture -> module in llampy.llama.models
ARCHITECTURES = {
    "llama": "llama",
    "mistral": "llama",
    "granite": "granite",
    "qwen2": "qwen2",
    "qwen2vl": "qwen2vl",
    "qwen3": "qwen3",
    "qwen3moe": "qwen3moe",
    "gemma2": "gemma2",
    "gemma3": "gemma3",
    "phi3": "phi3",
    "starcoder2": "starcoder2",
    "mamba": "mamba",
    "mamba2": "mamba2",
    "jamba": "jamba",
    "rwkv6": "rwkv6",
    "rwkv7": "rwkv7",
    "rwkv6qwen2": "rwkv6qwen2",
    "arwkv7": "arwkv7",
    "lfm2": "lfm2",
    "granitehybrid": "granitehybrid",
    "falcon-h1": "falconh1",
    "nemotron_h": "nemotron_h",
    "nemotron_h_moe": "nemotron_h",
    "qwen3next": "qwen3next",
    "qwen35": "qwen35",
    "qwen35moe": "qwen35",
    "phi2": "phi2",
    "olmo2": "olmo2",
    "smollm3": "smollm3",
    "exaone": "exaone",
    "internlm2": "internlm2",
    "command-r": "command_r",
    "cohere2": "cohere2",
    "mistral3": "mistral3",
    "bert": "bert",
    "nomic-bert": "bert",
    "jina-bert-v2": "bert",
    "qwen2moe": "qwen2moe",
    "olmoe": "olmoe",
    "granitemoe": "granite",
    "gpt-oss": "gpt_oss",
    "deepseek2": "deepseek2",
    "mistral4": "deepseek2",
    "deepseek2-ocr": "deepseek2",
    "llama4": "llama4",
    "gemma3n": "gemma3n",
}

ENTRY_POINT_GROUP = "llampy.architectures"

class UnknownArchitecture(ValueError):
    pass


def plugin_architectures() -> dict:
    """general.architecture -> entry point, for the architectures installed packages add (read each call: a package
    installed while the process runs is seen)."""
    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def supported_architectures() -> list[str]:
    return sorted(set(ARCHITECTURES) | set(plugin_architectures()))


def arch_module(arch: str):
    if arch in ARCHITECTURES:
        return importlib.import_module(f"llampy.llama.models.{ARCHITECTURES[arch]}")
    ep = plugin_architectures().get(arch)
    if ep is None:
        raise UnknownArchitecture(f"unknown model architecture {arch!r} (general.architecture); supported: "
                                  f"{', '.join(supported_architectures())}")
    try:
        module = ep.load()
    except Exception as e:
        raise UnknownArchitecture(f"architecture {arch!r}: its entry point {ep.value!r} ({ENTRY_POINT_GROUP}) "
                                  f"failed to load: {type(e).__name__}: {e}") from e
    missing = [f for f in ("load_hparams", "load_tensors", "build_graph") if not callable(getattr(module, f, None))]
    if missing:
        raise UnknownArchitecture(f"architecture {arch!r}: module {ep.value!r} does not define {', '.join(missing)}")
    return module


# GGUF tensor names (llama.cpp's LLM_TENSOR_NAMES); "{}" is the layer index
TOKEN_EMBD = "token_embd"
OUTPUT_NORM = "output_norm"
OUTPUT = "output"
LAYER = {
    "attn_norm": "blk.{}.attn_norm",
    "attn_q": "blk.{}.attn_q",
    "attn_k": "blk.{}.attn_k",
    "attn_v": "blk.{}.attn_v",
    "attn_qkv": "blk.{}.attn_qkv",
    "attn_output": "blk.{}.attn_output",
    "attn_q_norm": "blk.{}.attn_q_norm",
    "attn_k_norm": "blk.{}.attn_k_norm",
    "attn_post_norm": "blk.{}.post_attention_norm",
    "ffn_norm": "blk.{}.ffn_norm",
    "ffn_gate": "blk.{}.ffn_gate",
    "ffn_up": "blk.{}.ffn_up",
    "ffn_down": "blk.{}.ffn_down",
    "ffn_post_norm": "blk.{}.post_ffw_norm",
    "ffn_gate_inp": "blk.{}.ffn_gate_inp",
    "ffn_gate_exps": "blk.{}.ffn_gate_exps",
    "ffn_up_exps": "blk.{}.ffn_up_exps",
    "ffn_down_exps": "blk.{}.ffn_down_exps",
    "ffn_gate_inp_shexp": "blk.{}.ffn_gate_inp_shexp",
    "ffn_gate_shexp": "blk.{}.ffn_gate_shexp",
    "ffn_up_shexp": "blk.{}.ffn_up_shexp",
    "ffn_down_shexp": "blk.{}.ffn_down_shexp",
    "attn_sinks": "blk.{}.attn_sinks",
    "ssm_in": "blk.{}.ssm_in",
    "ssm_conv1d": "blk.{}.ssm_conv1d",
    "ssm_x": "blk.{}.ssm_x",
    "ssm_dt": "blk.{}.ssm_dt",
    "ssm_a": "blk.{}.ssm_a",
    "ssm_d": "blk.{}.ssm_d",
    "ssm_norm": "blk.{}.ssm_norm",
    "ssm_dt_norm": "blk.{}.ssm_dt_norm",
    "ssm_b_norm": "blk.{}.ssm_b_norm",
    "ssm_c_norm": "blk.{}.ssm_c_norm",
    "ssm_out": "blk.{}.ssm_out",
    "ssm_ba": "blk.{}.ssm_ba",                 # Qwen3-Next: beta and alpha of the gated DeltaNet
    "ssm_beta": "blk.{}.ssm_beta",             # Qwen 3.5: the same two, apart
    "ssm_alpha": "blk.{}.ssm_alpha",
    "attn_gate": "blk.{}.attn_gate",
    "attn_out_norm": "blk.{}.attn_output_norm",
    "layer_out_norm": "blk.{}.layer_output_norm",
    "attn_norm_2": "blk.{}.attn_norm_2",
    # RWKV-6/7
    "time_mix_w0": "blk.{}.time_mix_w0",
    "time_mix_w1": "blk.{}.time_mix_w1",
    "time_mix_w2": "blk.{}.time_mix_w2",
    "time_mix_a0": "blk.{}.time_mix_a0",
    "time_mix_a1": "blk.{}.time_mix_a1",
    "time_mix_a2": "blk.{}.time_mix_a2",
    "time_mix_v0": "blk.{}.time_mix_v0",
    "time_mix_v1": "blk.{}.time_mix_v1",
    "time_mix_v2": "blk.{}.time_mix_v2",
    "time_mix_g1": "blk.{}.time_mix_g1",
    "time_mix_g2": "blk.{}.time_mix_g2",
    "time_mix_k_k": "blk.{}.time_mix_k_k",
    "time_mix_k_a": "blk.{}.time_mix_k_a",
    "time_mix_r_k": "blk.{}.time_mix_r_k",
    "time_mix_lerp_x": "blk.{}.time_mix_lerp_x",
    "time_mix_lerp_w": "blk.{}.time_mix_lerp_w",
    "time_mix_lerp_k": "blk.{}.time_mix_lerp_k",
    "time_mix_lerp_v": "blk.{}.time_mix_lerp_v",
    "time_mix_lerp_r": "blk.{}.time_mix_lerp_r",
    "time_mix_lerp_g": "blk.{}.time_mix_lerp_g",
    "time_mix_lerp_fused": "blk.{}.time_mix_lerp_fused",
    "time_mix_first": "blk.{}.time_mix_first",
    "time_mix_decay": "blk.{}.time_mix_decay",
    "time_mix_decay_w1": "blk.{}.time_mix_decay_w1",
    "time_mix_decay_w2": "blk.{}.time_mix_decay_w2",
    "time_mix_key": "blk.{}.time_mix_key",
    "time_mix_value": "blk.{}.time_mix_value",
    "time_mix_receptance": "blk.{}.time_mix_receptance",
    "time_mix_gate": "blk.{}.time_mix_gate",
    "time_mix_ln": "blk.{}.time_mix_ln",
    "time_mix_output": "blk.{}.time_mix_output",
    "channel_mix_lerp_k": "blk.{}.channel_mix_lerp_k",
    "channel_mix_lerp_r": "blk.{}.channel_mix_lerp_r",
    "channel_mix_key": "blk.{}.channel_mix_key",
    "channel_mix_value": "blk.{}.channel_mix_value",
    "channel_mix_receptance": "blk.{}.channel_mix_receptance",
    # LFM2's short convolution
    "shortconv_conv": "blk.{}.shortconv.conv",
    "shortconv_in_proj": "blk.{}.shortconv.in_proj",
    "shortconv_out_proj": "blk.{}.shortconv.out_proj",
}
