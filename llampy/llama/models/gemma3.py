"""gemma3: gemma2's block with a per-head RMS norm of Q and K, 5 of every 6 layers on a sliding window with their
own RoPE base (10000), no attention soft-cap."""
from __future__ import annotations

import math

from ..hparams import md_float, md_int
from . import gemma2


def load_hparams(hp, md):
    a = hp.arch
    hp.rope_type = 2  # NEOX
    hp.n_swa = md_int(md, f"{a}.attention.sliding_window", 0, lo=0)
    if hp.n_swa > 0:
        hp.set_swa_pattern(md_int(md, f"{a}.attention.sliding_window_pattern", 6, lo=0))
        hp.rope_freq_base_swa = md_float(md, f"{a}.rope.freq_base_swa", 10000.0, positive=True)
        hp.rope_freq_scale_swa = 1.0
    hp.attn_soft_cap = 0.0
    hp.final_logit_softcap = md_float(md, f"{a}.final_logit_softcapping", 0.0, nonneg=True)
    hp.f_attention_scale = 1.0 / math.sqrt(hp.n_embd_head_k)


def load_tensors(model, ld):
    gemma2.load_tensors(model, ld, qk_norm=True)


def build_graph(model, g):
    return gemma2.build_graph(model, g, qk_norm=True)
