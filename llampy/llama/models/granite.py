"""granite: the llama graph with an embedding multiplier, a residual multiplier, a fixed attention scale and logits
divided by logit_scale."""
from __future__ import annotations

from ..hparams import md_float
from . import llama


def load_hparams(hp, md):
    llama.load_hparams(hp, md)
    g = lambda k, d=0.0: md_float(md, f"{hp.arch}.{k}", d, nonneg=True)     # noqa: E731
    hp.f_embedding_scale = g("embedding_scale")
    hp.f_residual_scale = g("residual_scale")
    hp.f_attention_scale = g("attention.scale")
    hp.f_logit_scale = g("logit_scale")


load_tensors = llama.load_tensors


def build_graph(model, g):
    hp = model.hparams
    return llama.build_graph(model, g, hp.f_embedding_scale, hp.f_residual_scale, hp.f_logit_scale)
