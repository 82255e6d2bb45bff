"""Perplexity with llama.cpp's method (its llama-perplexity tool):

tokenize the whole text once (BOS first where the vocabulary adds one); cut it into chunks of n_ctx tokens; the
first token of each chunk becomes BOS when the vocabulary adds BOS; score only the second half of each chunk
(each position predicts the next token); PPL = exp(mean negative log-likelihood).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .batch import Batch
from ..ggml.types import GGMLType
from .context import Context, ContextError


@dataclass
class PerplexityResult:
    ppl: float
    nll: float
    n_scored: int
    chunks: list = field(default_factory=list)   # running PPL after each chunk


def _nll_rows(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(x - m).sum(axis=1))
    return lse - x[np.arange(len(targets)), targets]


def perplexity(model, text: str, n_ctx: int = 512, n_batch: int | None = None, max_chunks: int | None = None,
               progress=None, fast: bool = False, tokens=None, on_logits=None, loras=None, type_k=GGMLType.F16,
               type_v=GGMLType.F16) -> PerplexityResult:
    """``fast``: batched matrix products through the dequantize-and-BLAS path instead of the integer kernels (the
    mean log-likelihood moves by ~1e-3). It used to be the default; since the integer kernels' prompt tiles it is
    the slower of the two (seeds/003 at -c 256 -b 256: SmolLM2 7.1 s BLAS vs 4.6 s integer, Gemma 3 19.4 vs 17.3),
    and the integer path is llama.cpp's arithmetic (SmolLM2 52.0295 vs llama.cpp's 52.0007; BLAS 51.9299).

    ``tokens``: score these instead of tokenizing ``text`` (the KL-divergence mode reads them from the base file).
    ``on_logits(c, chunk_tokens, logits)``: each chunk's scored rows, float32 [n_ctx - 1 - n_ctx/2, n_vocab].
    ``loras``: (LoraAdapter, scale) pairs applied to every chunk (llama-perplexity --lora / --lora-scaled)."""
    vocab = model.vocab
    add_bos = bool(vocab.add_bos and vocab.bos is not None)
    if tokens is None:
        tokens = vocab.tokenize(text, add_special=add_bos, parse_special=False)
    n_chunk = len(tokens) // n_ctx
    if max_chunks:
        n_chunk = min(n_chunk, max_chunks)
    if n_chunk == 0:
        raise ContextError(f"the text has {len(tokens)} tokens: need at least n_ctx={n_ctx} for one chunk "
                           f"(a longer text, or a smaller -c)")
    n_batch = min(n_batch or n_ctx, n_ctx)
    ctx = Context(model, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, type_k=type_k, type_v=type_v)
    ctx.set_loras(loras or [])
    saved = [getattr(b, "exact_max_rows", None) for b in model.backends]
    if fast:
        for b in model.backends:
            b.exact_max_rows = 16
    try:
        return _run(model, ctx, tokens, n_chunk, n_ctx, n_batch, add_bos, vocab, progress, on_logits)
    finally:
        for b, v in zip(model.backends, saved):
            b.exact_max_rows = v


def _run(model, ctx, tokens, n_chunk, n_ctx, n_batch, add_bos, vocab, progress, on_logits=None) -> PerplexityResult:
    first = n_ctx // 2
    nll, count, chunks = 0.0, 0, []
    for c in range(n_chunk):
        chunk = np.array(tokens[c * n_ctx:(c + 1) * n_ctx], dtype=np.int32)
        inp = chunk.copy()
        if add_bos:
            inp[0] = vocab.bos
        ctx.kv_clear()
        logits = np.zeros((n_ctx, model.hparams.n_vocab), np.float32)
        for i0 in range(0, n_ctx, n_batch):
            b = Batch.from_tokens(inp[i0:i0 + n_batch], pos0=i0, logits_all=True)
            # only the scored half needs logits
            b.logits[:] = np.arange(i0, i0 + len(b)) >= first
            ctx.decode(b)
            if b.logits.any():
                rows = np.flatnonzero(b.logits)
                logits[i0 + rows] = ctx.get_logits()
        if on_logits:
            on_logits(c, chunk, logits[first:n_ctx - 1])
        nll += float(_nll_rows(logits[first:n_ctx - 1], chunk[first + 1:n_ctx]).sum())
        count += n_ctx - 1 - first
        chunks.append(math.exp(nll / count))
        if progress:
            progress(c, n_chunk, chunks[-1])
    return PerplexityResult(math.exp(nll / count), nll / count, count, chunks)
