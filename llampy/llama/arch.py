"""Architectures: the registry from ``general.architecture`` to the module that builds it, and the GGUF tensor names.

A model file is found lazily (``llampy.llama.models.<module>``), as vLLM's registry does, so an architecture costs
nothing until it is used. Each module defines ``load_hparams(hp, md)``, ``load_tensors(loader)`` and
``build_graph(g)`` (see models/llama.py).
"""
from __future__ import annotations

import importlib

# general.architecture -> module in llampy.llama.models
ARCHITECTURES = {
    "llama": "llama",
    "mistral": "llama",
    "granite": "granite",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3moe": "qwen3moe",
    "gemma2": "gemma2",
    "gemma3": "gemma3",
    "phi3": "phi3",
    "starcoder2": "starcoder2",
}

class UnknownArchitecture(ValueError):
    pass


def arch_module(arch: str):
    if arch not in ARCHITECTURES:
        raise UnknownArchitecture(
            f"unknown model architecture {arch!r} (general.architecture); supported: {', '.join(sorted(ARCHITECTURES))}")
    return importlib.import_module(f"llampy.llama.models.{ARCHITECTURES[arch]}")


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
}
