"""Context: micro-batches, several sequences in one cache, sequence edits, state, errors, embeddings."""
from __future__ import annotations

import numpy as np
import pytest

from llampy.llama.batch import Batch
from llampy.llama.context import CacheFull, Context, ContextError
from llampy.llama.model import Model, ModelLoadError

from tests.llama.padded_steps import PADDED_SHAPES, assert_same_bits, run_steps
from tests.paths import TINY


@pytest.fixture(scope="module")
def model():
    return Model(TINY / "qwen2-Q8_0.gguf")


TOKS = [504, 3575, 282, 4649, 314, 1980, 253, 655, 28, 281]


def last_logits(model, toks, **kw):
    ctx = Context(model, n_ctx=64, **kw)
    ctx.decode(Batch.from_tokens(toks))
    return ctx.get_logits_ith(-1).copy()


def test_micro_batches_and_graph_reuse(model):
    a = last_logits(model, TOKS)
    ctx = Context(model, n_ctx=64, n_batch=64, n_ubatch=3)
    ctx.decode(Batch.from_tokens(TOKS))
    np.testing.assert_allclose(ctx.get_logits_ith(-1), a, atol=1e-4)
    builds = ctx.n_graph_builds
    for i in range(4):
        ctx.decode(Batch.from_tokens([TOKS[i]], pos0=len(TOKS) + i))
    assert ctx.n_graph_builds == builds              # the single-token graph of the last micro-batch, reused
    assert ctx.sched.n_replans == ctx.n_graph_builds


def test_two_sequences_in_one_batch_equal_separate_runs(model):
    a, b = TOKS[:6], TOKS[4:]
    batch = Batch.empty()
    for i, t in enumerate(a):
        batch.add(t, i, [0], i == len(a) - 1)
    for i, t in enumerate(b):
        batch.add(t, i, [1], i == len(b) - 1)
    ctx = Context(model, n_ctx=64, n_seq_max=2)
    ctx.decode(batch)
    np.testing.assert_allclose(ctx.get_logits_ith(len(a) - 1), last_logits(model, a), atol=1e-4)
    np.testing.assert_allclose(ctx.get_logits_ith(len(batch) - 1), last_logits(model, b), atol=1e-4)


def test_seq_rm_and_re_decode(model):
    ctx = Context(model, n_ctx=64)
    ctx.decode(Batch.from_tokens(TOKS))
    ctx.seq_rm(0, 5, -1)
    assert ctx.seq_pos_max(0) == 4
    ctx.decode(Batch.from_tokens(TOKS[5:], pos0=5))
    np.testing.assert_allclose(ctx.get_logits_ith(-1), last_logits(model, TOKS), atol=1e-4)


def test_seq_cp_keep_and_state_round_trip(model):
    ctx = Context(model, n_ctx=64, n_seq_max=2)
    ctx.decode(Batch.from_tokens(TOKS[:6]))
    ctx.seq_cp(0, 1)
    ctx.seq_keep(1)
    b = Batch.empty()
    b.add(TOKS[6], 6, [1], True)
    ctx.decode(b)
    want = last_logits(model, TOKS[:7])
    np.testing.assert_allclose(ctx.get_logits_ith(0), want, atol=1e-4)
    state = ctx.state_save()
    ctx2 = Context(model, n_ctx=64, n_seq_max=2)
    ctx2.state_load(state)
    b2 = Batch.empty()
    b2.add(TOKS[7], 7, [1], True)
    ctx.decode(b2)
    ctx2.decode(b2)
    np.testing.assert_array_equal(ctx.get_logits_ith(0), ctx2.get_logits_ith(0))
    with pytest.raises(ContextError, match="invalid state"):
        ctx2.state_load(b"garbage")


def test_seq_add_shifts_keys(model):
    """seq_add re-rotates the cached K by the shift (llama.cpp's K-shift): layer 0's K rows, which depend on the
    token and its position only, then equal a fresh computation at the new positions (to F16 rounding)."""
    from llampy.ggml.backend import tensor_data
    ctx = Context(model, n_ctx=64)
    ctx.decode(Batch.from_tokens(TOKS))
    ctx.seq_rm(0, 0, 2)
    ctx.seq_add(0, 2, -1, -2)
    assert list(ctx.kv.pos[2:10]) == list(range(8))
    fresh = Context(model, n_ctx=64)
    fresh.decode(Batch.from_tokens(TOKS[2:]))
    k_shifted = np.array(tensor_data(ctx.kv.k[0]))[0, :, 2:10].astype(np.float32)
    k_fresh = np.array(tensor_data(fresh.kv.k[0]))[0, :, 0:8].astype(np.float32)
    np.testing.assert_allclose(k_shifted, k_fresh, atol=2e-3 * np.abs(k_fresh).max())


def test_errors(model):
    ctx = Context(model, n_ctx=8)
    with pytest.raises(ContextError, match="exceed"):
        ctx.decode(Batch.from_tokens(TOKS))
    ctx.decode(Batch.from_tokens(TOKS[:6]))
    with pytest.raises(CacheFull, match="full"):
        ctx.decode(Batch.from_tokens(TOKS[6:10], pos0=6))
    assert ctx.kv.n_used() == 6                       # nothing was half-written
    with pytest.raises(ContextError, match="outside the vocabulary"):
        ctx.decode(Batch.from_tokens([10**6]))
    with pytest.raises(ContextError, match="empty"):
        ctx.decode(Batch.empty())


def test_embeddings_pooling(model):
    ctx = Context(model, n_ctx=64, embeddings=True, pooling="mean")
    ctx.decode(Batch.from_tokens(TOKS, logits_all=True))
    e = ctx.get_embeddings_seq(0)
    assert e.shape == (64,)
    last = Context(model, n_ctx=64, embeddings=True, pooling="last")
    last.decode(Batch.from_tokens(TOKS, logits_all=True))
    np.testing.assert_allclose(last.get_embeddings_seq(0), ctx.get_embeddings_ith(len(TOKS) - 1), atol=1e-6)


def test_model_errors(tmp_path):
    from llampy.gguf import GGUFReader, GGUFWriter
    from llampy.llama.arch import UnknownArchitecture
    r = GGUFReader(TINY / "qwen2-Q8_0.gguf")
    w = GGUFWriter.from_reader(r, tmp_path / "m.gguf")
    w.kv = [(k, "mamba9" if k == "general.architecture" else v, t) for k, v, t in w.kv]
    w.write()
    with pytest.raises(UnknownArchitecture, match="mamba9"):
        Model(tmp_path / "m.gguf")
    w = GGUFWriter.from_reader(r, tmp_path / "n.gguf")
    w.tensors = [t for t in w.tensors if t[0] != "blk.1.attn_q.weight"]
    w.write()
    with pytest.raises(ModelLoadError, match="blk.1.attn_q.weight"):
        Model(tmp_path / "n.gguf")


@pytest.mark.slow
def test_q8_0_kv_cache_end_to_end(smollm2_path):
    """SmolLM2 with K and V cached in Q8_0 (llama.cpp's --cache-type-k/v q8_0): the cache takes 34/64 of the F16
    bytes, and a greedy continuation keeps the F16 cache's tokens, each chosen token's log-probability within 0.25
    (measured: up to 0.13, the 8-bit rounding of K and V through SmolLM2's sensitive layers)."""
    import numpy as np
    from llampy.ggml.types import GGMLType
    from llampy.llama.batch import Batch
    from llampy.llama.context import Context
    from llampy.llama.model import Model
    model = Model(smollm2_path)
    prompt = [1, 504, 3458, 282, 4649, 314]

    def greedy(tk):
        ctx = Context(model, n_ctx=128, type_k=tk, type_v=tk)
        assert ctx.kv.k[0].type == tk and ctx.kv.v[0].type == tk
        ctx.decode(Batch.from_tokens(prompt))
        pos, toks, lps = len(prompt), [], []
        for _ in range(8):
            lg = ctx.get_logits_ith(-1).astype(np.float64)
            lp = lg - lg.max()
            lp -= np.log(np.exp(lp).sum())
            t = int(np.argmax(lp))
            toks.append(t)
            lps.append(lp[t])
            ctx.decode(Batch.from_tokens([t], pos0=pos))
            pos += 1
        return toks, np.array(lps), sum(x.nbytes for x in ctx.kv.k + ctx.kv.v)

    t16, lp16, b16 = greedy(GGMLType.F16)
    t8, lp8, b8 = greedy(GGMLType.Q8_0)
    assert b8 * 64 == b16 * 34
    assert t8 == t16
    assert np.abs(lp8 - lp16).max() < 0.25


def test_reserve_builds_the_graph_before_its_first_batch(model):
    ctx = Context(model, n_ctx=64, n_seq_max=2, kv_pad=16, kv_pad_decode=64)
    ctx.decode(Batch.from_tokens(TOKS[:4]))
    assert ctx.reserve(2, 2) and not ctx.reserve(2, 2)       # built once, then found
    builds = ctx.n_graph_builds
    batch = Batch.empty()
    batch.add(TOKS[4], 4, [0], True)
    batch.add(TOKS[0], 0, [1], True)
    ctx.decode(batch)
    assert ctx.n_graph_builds == builds
    # with the cache padded to its whole size, growing the cache does not ask for new graphs
    for i in range(5, 9):
        ctx.decode(Batch.from_tokens([TOKS[i]], pos0=i))
    one = ctx.n_graph_builds
    for i in range(9, 40):
        ctx.decode(Batch.from_tokens([TOKS[i % 10]], pos0=i))
    assert ctx.n_graph_builds == one


def test_split_streams_make_a_sequence_independent_of_its_neighbours(model):
    """kv_unified=False: a sequence's logits are the same bits whatever the others did before (cells left in the
    cache) or send in the same batch (a 70-token prompt beside it would take flash attention's tiled path, from 64
    queries, for both if they shared a micro-batch)."""
    alone = Context(model, n_ctx=256, n_batch=128, n_ubatch=128, n_seq_max=2, kv_unified=False)
    alone.decode(Batch.from_tokens(TOKS, 0, 0))
    want = alone.get_logits_ith(-1).copy()
    busy = Context(model, n_ctx=256, n_batch=128, n_ubatch=128, n_seq_max=2, kv_unified=False)
    busy.decode(Batch.from_tokens(TOKS[:4], 0, 0))
    busy.decode(Batch.from_tokens(list(range(300, 340)), 0, 1))
    busy.seq_rm(0, 1, -1)                          # a restart keeps one cell of sequence 0
    b = Batch.from_tokens(TOKS[1:], 1, 0)
    for j in range(70):                            # another sequence's prompt in the same batch
        b.add(400 + j, 40 + j, [1], j == 69)
    busy.decode(b)
    assert np.array_equal(busy.get_logits_ith(len(TOKS) - 2), want)
    assert np.array_equal(busy.get_logits(), np.stack([want, busy.get_logits_ith(len(b) - 1)]))
    with pytest.raises(ContextError):
        busy.seq_cp(0, 1)


def test_a_cache_type_the_backend_cannot_hold_is_a_clear_error(model, monkeypatch):
    """A cache type the layers' backend does not hold (the CUDA backend's IQ4_NL; here the CPU backend told to
    refuse BF16) is refused at creation, naming what can be used, instead of failing at the first decode; a cache
    of heads that are not whole blocks likewise."""
    from llampy.ggml.types import GGMLType as T
    Context(model, n_ctx=64, type_k=T.BF16, type_v=T.BF16)  # the CPU holds every type llama.cpp offers
    held = model.cpu.supports_kv_type
    monkeypatch.setattr(model.cpu, "supports_kv_type", lambda t: t != T.BF16 and held(t))
    with pytest.raises(ContextError, match="a BF16 KV cache is not supported on cpu, where layers of this model run: "
                                           "use f32, f16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1$"):
        Context(model, n_ctx=64, type_v=T.BF16)
    with pytest.raises(ContextError, match="a Q4_0 K cache needs heads of a multiple of 32 values"):
        Context(model, n_ctx=64, type_k=T.Q4_0)             # heads of 16


@pytest.mark.parametrize("ftype", ["IQ4_NL", "MXFP4_MOE"])
def test_padded_prompt_pieces_of_repacked_formats_keep_their_bits(tmp_path, ftype):
    """IQ4_NL and MXFP4 weights whose rows llama.cpp repacks (the tiny llama's, all a multiple of 8) compute each row
    apart at every batch size, so the server's context pads their short prompt pieces too (pad_ubatch): each step's
    logits are bit for bit the unpadded decode's, on the padded graphs."""
    from llampy.llama.quant import QuantizeParams, parse_ftype, quantize_model
    path = tmp_path / f"tiny-{ftype}.gguf"
    quantize_model(TINY / "llama-F32.gguf", path, QuantizeParams(ftype=parse_ftype(ftype)[0], pure=True))
    m = Model(path)
    plain, _ = run_steps(m, False, 256)
    padded, c1 = run_steps(m, True, 256)
    assert {k[:2] for k in c1._graphs} == PADDED_SHAPES     # the padded shapes ran
    assert_same_bits(plain, padded)


def test_place_moves_a_graph_placed_before_a_buffer_grew(model):
    """A graph reserved before a larger one made the compute buffer grow points into the old buffer (its first
    decode would move it and bind its plans again); Context.place moves it ahead of use, and it decodes as before."""
    ctx = Context(model, n_ctx=64, n_seq_max=2, kv_pad=16, kv_pad_decode=64)
    ctx.reserve(1, 1)
    small = ctx.kept_shapes()[-1]
    ctx.reserve(32, 32)

    def stale():
        p = ctx.sched._plans[id(ctx._graphs[small].graph)][1]
        return any(al.buffer is not b for al, b in zip(p.allocators, p.buffers))
    assert stale()
    ctx.place(small)
    assert not stale()
    ref = Context(model, n_ctx=64, n_seq_max=2, kv_pad=16, kv_pad_decode=64)
    for c in (ctx, ref):
        c.decode(Batch.from_tokens([TOKS[0]]))
    assert ctx.n_graph_builds == 2 and np.array_equal(ctx.get_logits(), ref.get_logits())


def test_warm_runs_each_graph_once_and_leaves_the_cache_as_it_was(model):
    """Context.warm (the server's idle work before its first request): each kept graph runs once on placeholder
    tokens and its plan is bound for its fast run, while the cache's cells and where the next ones land stay as
    they were: the steps after it build no graph and give the same bits as a context that was not warmed. Only on
    an empty cache."""
    ctx = Context(model, n_ctx=256, n_batch=128, n_ubatch=96, n_seq_max=4, kv_pad_decode=256, kv_unified=False,
                  pad_ubatch=True)
    ctx.reserve(4, 4)
    ctx.reserve(16, 2)
    heads = ctx.kv.heads.copy()
    keys = ctx.kept_shapes()
    assert all(ctx.warm(k) for k in keys)
    assert ctx.kv.n_used() == 0 and np.array_equal(ctx.kv.heads, heads)
    plans = [sp.plan for k in keys for sp in ctx.sched._plans[id(ctx._graphs[k].graph)][1].splits]
    assert plans and all(isinstance(getattr(p, "fast", None), list) for p in plans)
    ctx.decode(Batch.from_tokens(TOKS[:3]))
    assert not ctx.warm(keys[0]) and ctx.kv.n_used() == 3       # a cache in use is left alone
    warmed, c1 = run_steps(model, True, 256, warm=True)
    plain, c0 = run_steps(model, True, 256)
    assert_same_bits(plain, warmed)
    assert {k[:2] for k in c1._graphs} == {k[:2] for k in c0._graphs} == PADDED_SHAPES
