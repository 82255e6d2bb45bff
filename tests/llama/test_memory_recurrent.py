"""The recurrent memory behind the context, on the tiny Mamba models: llama.cpp's answers to the sequence
operations, copy on write after seq_cp, batching that does not change results, state save and restore."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from llampy.llama.batch import Batch
from llampy.llama.context import Context, ContextError
from llampy.llama.memory_recurrent import RecurrentMemory
from llampy.llama.model import Model
from llampy.llama import state as st

from tests.paths import ROOT, TINY

HERE = ROOT / "tests" / "fixtures" / "tiny_recurrent"
PROMPT = [504, 3575, 282, 4649, 314, 1695, 30]


@pytest.fixture(scope="module", params=["mamba2-s16-g2-Q8_0", "mamba-s16-F32", "jamba-hybrid-Q8_0"])
def model(request, tmp_path_factory):
    if not (TINY / "qwen2-Q8_0.gguf").exists():
        pytest.skip("the shared tiny fixtures (their vocabulary) are not here")
    spec = importlib.util.spec_from_file_location("make_fixtures", HERE / "make_fixtures.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    path = tmp_path_factory.mktemp("rs") / f"{request.param}.gguf"
    mod.build(request.param, path)
    return Model(path)


def _alone(model, tokens) -> np.ndarray:
    """Logits of every position, the tokens decoded one at a time in a fresh context."""
    ctx = Context(model, n_ctx=64)
    rows = []
    for i, t in enumerate(tokens):
        ctx.decode(Batch.from_tokens([t], pos0=i))
        rows.append(ctx.get_logits_ith(-1).copy())
    return np.array(rows)


def test_memory_is_recurrent_and_sized_as_llama_cpp(model):
    ctx = Context(model, n_ctx=64, n_seq_max=3)
    hp = model.hparams
    n_recurrent = sum(hp.is_recurrent(il) for il in range(hp.n_layer))
    mem = ctx.kv.recr if n_recurrent < hp.n_layer else ctx.kv           # a hybrid's recurrent side
    assert isinstance(mem, RecurrentMemory)
    per_seq = n_recurrent * 4 * (hp.n_embd_r() + hp.n_embd_s())       # llama.cpp's state size, F32 rows
    assert mem.state_bytes_per_seq() == per_seq
    assert mem.nbytes >= 3 * per_seq
    assert [t is None for t in mem.s] == [not hp.is_recurrent(il) for il in range(hp.n_layer)]


def test_one_batch_equals_token_by_token(model):
    ctx = Context(model, n_ctx=64)
    ctx.decode(Batch.from_tokens(PROMPT, logits_all=True))
    np.testing.assert_allclose(ctx.get_logits(), _alone(model, PROMPT), atol=2e-4)


def test_small_ubatches_equal_one_batch(model):
    ctx = Context(model, n_ctx=64, n_batch=64, n_ubatch=3)
    ctx.decode(Batch.from_tokens(PROMPT, logits_all=True))
    ref = Context(model, n_ctx=64)
    ref.decode(Batch.from_tokens(PROMPT, logits_all=True))
    np.testing.assert_allclose(ctx.get_logits(), ref.get_logits(), atol=2e-4)


def test_two_sequences_in_one_batch_equal_each_alone(model):
    a, b = PROMPT[:5], [7, 8, 9, 10, 11]
    ctx = Context(model, n_ctx=64, n_seq_max=2)
    batch = Batch.empty()
    for i in range(5):                              # interleaved, as a server's batch can have them
        batch.add(a[i], i, 0, True)
        batch.add(b[i], i, 1, True)
    ctx.decode(batch)
    got = np.array([ctx.get_logits_ith(i) for i in range(10)])
    np.testing.assert_allclose(got[0::2], _alone(model, a), atol=2e-4)
    np.testing.assert_allclose(got[1::2], _alone(model, b), atol=2e-4)
    # then one step each, together
    step = Batch.empty()
    step.add(100, 5, 0, True)
    step.add(200, 5, 1, True)
    ctx.decode(step)
    np.testing.assert_allclose(ctx.get_logits_ith(0), _alone(model, a + [100])[-1], atol=2e-4)
    np.testing.assert_allclose(ctx.get_logits_ith(1), _alone(model, b + [200])[-1], atol=2e-4)


def test_uneven_sequences_split_into_equal_ubatches(model):
    ctx = Context(model, n_ctx=64, n_seq_max=2)
    batch = Batch.empty()
    for i, t in enumerate(PROMPT):
        batch.add(t, i, 0, True)
    batch.add(42, 0, 1, True)
    ctx.decode(batch)
    np.testing.assert_allclose(ctx.get_logits_ith(len(PROMPT) - 1), _alone(model, PROMPT)[-1], atol=2e-4)
    np.testing.assert_allclose(ctx.get_logits_ith(len(PROMPT)), _alone(model, [42])[-1], atol=2e-4)


def test_seq_cp_then_two_diverging_continuations(model):
    ctx = Context(model, n_ctx=64, n_seq_max=3)
    ctx.decode(Batch.from_tokens(PROMPT))
    ctx.seq_cp(0, 1)
    ctx.seq_cp(0, 2)
    assert ctx.seq_pos_max(1) == ctx.seq_pos_max(2) == len(PROMPT) - 1
    n = len(PROMPT)
    b = Batch.empty()
    b.add(11, n, 0, True)
    b.add(22, n, 1, True)
    ctx.decode(b)
    np.testing.assert_allclose(ctx.get_logits_ith(0), _alone(model, PROMPT + [11])[-1], atol=2e-4)
    np.testing.assert_allclose(ctx.get_logits_ith(1), _alone(model, PROMPT + [22])[-1], atol=2e-4)
    # sequence 2 still holds the prompt's state, untouched by the others' steps
    ctx.decode(Batch.from_tokens([33], pos0=n, seq_id=2))
    np.testing.assert_allclose(ctx.get_logits_ith(-1), _alone(model, PROMPT + [33])[-1], atol=2e-4)


def test_seq_rm_answers_as_llama_cpp(model):
    ctx = Context(model, n_ctx=64, n_seq_max=2)
    n = len(PROMPT)
    ctx.decode(Batch.from_tokens(PROMPT))
    assert ctx.seq_rm(0, 3, -1) is False                        # a suffix: a state cannot forget it
    assert ctx.seq_pos_max(0) == n - 1
    assert ctx.seq_rm(0, n + 5, -1) is True                     # past the end: nothing to remove
    assert ctx.seq_rm(-1, 2, 4) is False                        # every sequence, a partial range
    if not hasattr(ctx.kv, "recr"):        # (a hybrid's KV cache would drop those cells: llama.cpp's too)
        assert ctx.seq_rm(0, 0, 2) is True and ctx.seq_pos_max(0) == n - 1   # misses the last position
    ctx.decode(Batch.from_tokens([5], pos0=n))                   # nothing changed: it continues
    np.testing.assert_allclose(ctx.get_logits_ith(-1), _alone(model, PROMPT + [5])[-1], atol=2e-4)
    assert ctx.seq_rm(0, -1, -1) is True                        # the whole sequence
    assert ctx.seq_pos_max(0) == -1
    ctx.decode(Batch.from_tokens(PROMPT[:3]))                   # starts again from zeros
    np.testing.assert_allclose(ctx.get_logits_ith(-1), _alone(model, PROMPT[:3])[-1], atol=2e-4)


def test_seq_keep_and_seq_add(model):
    ctx = Context(model, n_ctx=64, n_seq_max=2)
    ctx.decode(Batch.from_tokens(PROMPT))
    ctx.seq_cp(0, 1)
    ctx.seq_keep(1)
    assert ctx.seq_pos_max(0) == -1 and ctx.seq_pos_max(1) == len(PROMPT) - 1
    ctx.seq_add(1, 0, -1, 10)                                   # only the last position moves
    assert ctx.seq_pos_max(1) == len(PROMPT) + 9
    ctx.decode(Batch.from_tokens([5], pos0=len(PROMPT) + 10, seq_id=1))
    np.testing.assert_allclose(ctx.get_logits_ith(-1), _alone(model, PROMPT + [5])[-1], atol=2e-4)


def test_bad_input_is_refused(model):
    ctx = Context(model, n_ctx=64, n_seq_max=2)
    with pytest.raises(ContextError, match="n_seq_max"):
        ctx.decode(Batch.from_tokens([1, 2], seq_id=2))
    ctx.decode(Batch.from_tokens(PROMPT))
    with pytest.raises(ContextError, match="continue its state"):
        ctx.decode(Batch.from_tokens([1], pos0=3))              # behind the state
    with pytest.raises(ContextError, match="one sequence"):
        b = Batch.empty()
        b.add(1, len(PROMPT), (0, 1), True)
        ctx.decode(b)


def test_save_restore_continue_equals_never_stopping(model):
    ctx = Context(model, n_ctx=64, n_seq_max=2)
    ctx.decode(Batch.from_tokens(PROMPT))
    data = ctx.state_save()
    ctx.decode(Batch.from_tokens([9, 10], pos0=len(PROMPT), logits_all=True))
    want = ctx.get_logits().copy()
    other = Context(model, n_ctx=64, n_seq_max=2)
    other.state_load(data)
    other.decode(Batch.from_tokens([9, 10], pos0=len(PROMPT), logits_all=True))
    np.testing.assert_array_equal(other.get_logits(), want)
    # one sequence, into another sequence id of another context
    third = Context(model, n_ctx=64, n_seq_max=2)
    st.seq_set(third, 1, st.seq_get(other, 0))
    assert third.seq_pos_max(1) == len(PROMPT) + 1
    third.decode(Batch.from_tokens([3], pos0=len(PROMPT) + 2, seq_id=1))
    other.decode(Batch.from_tokens([3], pos0=len(PROMPT) + 2))
    np.testing.assert_array_equal(third.get_logits_ith(-1), other.get_logits_ith(-1))


def test_state_of_another_model_is_refused_and_nothing_loaded(model, tmp_path):
    ctx = Context(model, n_ctx=64, n_seq_max=2)
    ctx.decode(Batch.from_tokens(PROMPT))
    small = Context(model, n_ctx=64, n_seq_max=1)
    with pytest.raises(ContextError):
        small.state_load(ctx.state_save())
    assert small.seq_pos_max(0) == -1
    # a file of this model's sequence checked against a context of another model
    path = tmp_path / "slot.bin"
    st.save_seqs(path, ctx, {"0": (PROMPT, 0)})
    states, _ = st.read_seqs(path, ctx)
    fresh = Context(model, n_ctx=64, n_seq_max=2)
    assert st.load_seq(states["0"], fresh, 1) == PROMPT
    assert fresh.seq_pos_max(1) == len(PROMPT) - 1
