"""A BF16 KV cache on the CPU (llama.cpp's -ctk bf16 -ctv bf16) against libllama's logits with the same cache: the
store rounds to BF16 as ggml_cpu_fp32_to_bf16, the attention takes ggml's one_chunk path (Q rounded to BF16,
ggml_vec_dot_bf16, a float32 accumulator over the widened V)."""
from __future__ import annotations

import numpy as np

from llampy.ggml.types import GGMLType as T
from llampy.llama.batch import Batch
from llampy.llama.context import Context
from llampy.llama.model import Model
from tests.paths import TINY


def _logits(model, toks, type_k, type_v):
    ctx = Context(model, n_ctx=64, n_batch=64, n_ubatch=8, type_k=type_k, type_v=type_v)
    ctx.decode(Batch.from_tokens(toks, 0, 0, logits_all=True))
    return ctx.get_logits().copy()


def test_bf16_cache_gives_llamacpps_logits():
    """17 tokens in micro-batches of 8 (llama.cpp's n_ubatch too): two prompt-sized attentions over a growing cache,
    then a single-token step. The cache type matters (libllama's F16 and BF16 caches differ by ~0.7 in a logit
    here); llampy reproduces libllama's BF16 cache as closely as its F16 one (bit for bit on the hosts where the
    F16 one is: the heads of 16 values are all ggml_vec_dot_bf16's leftovers, summed in double in every build)."""
    from tests.llamacpp_run import llamacpp_logits
    path = TINY / "qwen2-Q8_0.gguf"
    toks = [int(t) for t in np.random.default_rng(0).integers(3, 200, 17)]
    model = Model(path)
    want = {t: llamacpp_logits(path, toks, n_ctx=64, type_k=t.value, type_v=t.value, n_ubatch=8)
            for t in (T.F16, T.BF16)}
    got = {t: _logits(model, toks, t, t) for t in (T.F16, T.BF16)}
    assert np.abs(want[T.BF16] - want[T.F16]).max() > 0.1
    err = {t: np.abs(got[t] - want[t]).max() for t in got}
    assert err[T.BF16] <= err[T.F16] + 1e-6, err
    # a BF16 K beside an F16 V: the F16 accumulator with the BF16 dot
    mixed = llamacpp_logits(path, toks, n_ctx=64, type_k=T.BF16.value, type_v=T.F16.value, n_ubatch=8)
    assert np.abs(_logits(model, toks, T.BF16, T.F16) - mixed).max() <= err[T.F16] + 1e-6
