"""exaone (EXAONE 3.x): the llama block with NeoX RoPE and optional rope frequency factors (``rope_freqs``,
llama 3-style scaling), optional q/k/v/o biases."""
from __future__ import annotations

from . import llama


def load_hparams(hp, md):
    llama.load_hparams(hp, md)
    hp.rope_type = 2  # NEOX


load_tensors = llama.load_tensors     # tensors as llama's: rope_freqs, biases and the tied head optional
build_graph = llama.build_graph
