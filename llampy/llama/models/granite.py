"""granite (and granitemoe): the llama graph with an embedding multiplier, a residual multiplier, a fixed attention
scale and logits divided by logit_scale; granitemoe's layers are llama's mixture of experts, with a shared expert
beside them when expert_shared_feed_forward_length is set (Granite MoE Shared)."""
from __future__ import annotations

from ..hparams import md_float, md_int
from . import llama


def load_hparams(hp, md):
    llama.load_hparams(hp, md)
    g = lambda k, d=0.0: md_float(md, f"{hp.arch}.{k}", d, nonneg=True)     # noqa: E731
    hp.f_embedding_scale = g("embedding_scale")
    hp.f_residual_scale = g("residual_scale")
    hp.f_attention_scale = g("attention.scale")
    hp.f_logit_scale = g("logit_scale")
    hp.n_ff_shexp = md_int(md, f"{hp.arch}.expert_shared_feed_forward_length", 0, lo=0)


load_tensors = llama.load_tensors


def build_graph(model, g):
    hp = model.hparams
    return llama.build_graph(model, g, hp.f_embedding_scale, hp.f_residual_scale, hp.f_logit_scale)
