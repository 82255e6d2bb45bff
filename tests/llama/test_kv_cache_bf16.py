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


def _bf16_as_f32(raw):
    return (np.asarray(raw).view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def test_bf16_cache_k_shift():
    """seq_add over a BF16 cache re-rotates its K (the shift graph widens the rows to F32, ropes them and stores them
    back rounded). llama.cpp cannot be the reference here (its CPU rope has no BF16 and aborts), so: the layer-0 K
    rows of the shifted cells equal a fresh BF16 cache's at the new positions to two BF16 steps (they are rounded
    twice), and the next token's logits are within 0.35 of an F32 cache's after the same shift (0.12 here; an F16
    cache is 0.014 off; the shift skipped puts them 13 off, a shift by 2 instead of 3 puts them 5 off)."""
    from llampy.ggml.backend import tensor_data
    model = Model(TINY / "llama-F32.gguf")
    toks = [1, 5, 9, 13, 2, 7, 11, 3]
    n = len(toks)
    logits, k0 = {}, {}
    for t in (T.F32, T.BF16):
        ctx = Context(model, n_ctx=64, type_k=t, type_v=t)
        ctx.decode(Batch.from_tokens(toks))
        before = np.array(tensor_data(ctx.kv.k[0]))[..., :n, :]       # the last one kept: the BF16 cache's
        ctx.seq_add(0, 2, -1, 3)
        assert list(ctx.kv.pos[:n]) == [0, 1] + list(range(5, n + 3))
        k0[t] = np.array(tensor_data(ctx.kv.k[0]))[..., :n, :]
        ctx.decode(Batch.from_tokens([4], pos0=n + 3))
        logits[t] = ctx.get_logits_ith(-1).copy()
    fresh = Context(model, n_ctx=64, type_k=T.BF16, type_v=T.BF16)
    b = Batch.empty()
    for i, tok in enumerate(toks):
        b.add(tok, i if i < 2 else i + 3, [0], i == n - 1)
    fresh.decode(b)
    want = _bf16_as_f32(np.array(tensor_data(fresh.kv.k[0]))[..., :n, :])
    got = _bf16_as_f32(k0[T.BF16])
    tol = 2 * 2.0 ** -8 * np.abs(want).max()
    assert np.abs(_bf16_as_f32(before)[..., 2:, :] - want[..., 2:, :]).max() > 20 * tol   # the shift moves them
    np.testing.assert_allclose(got, want, rtol=0, atol=tol)
    np.testing.assert_array_equal(got[..., :2, :], want[..., :2, :])     # the cells before p0 stay as they were
    assert np.abs(logits[T.BF16] - logits[T.F32]).max() <= 0.35
