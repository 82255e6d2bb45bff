"""The later recurrent and hybrid architectures (RWKV-7, Falcon-H1, Qwen3-Next) behind the memory
interface: two sequences in one batch equal each alone, and a saved state restored into another context continues
as the first (the memory's own rules are test_memory_recurrent's, on Mamba and Jamba)."""
from __future__ import annotations

import numpy as np
import pytest

from llampy.llama.batch import Batch
from llampy.llama.context import Context
from llampy.llama.model import Model

from tests.llama.tiny_recurrent import gguf

A = [504, 3575, 282, 4649, 314]
B = [7, 8, 9, 10, 11]


# the recurrent memory alone (RWKV-7), both memories in one layer (Falcon-H1), the gated DeltaNet's state with two
# sequences in one op (Qwen3-Next; Qwen 3.5, whose key heads broadcast to the value heads); hybrids by layer are
# otherwise test_memory_recurrent's (Jamba)
@pytest.fixture(scope="module", params=["rwkv7-h32-Q8_0", "falcon-h1-s32-Q8_0", "qwen3next-s32-Q8_0",
                                        "qwen35-s32-Q8_0"])
def model(request, tmp_path_factory):
    return Model(gguf(request.param, tmp_path_factory))


def _alone(model, tokens):
    ctx = Context(model, n_ctx=64)
    ctx.decode(Batch.from_tokens(tokens, logits_all=True))
    return ctx.get_logits().copy()


def test_two_sequences_together_then_save_and_restore(model):
    ctx = Context(model, n_ctx=64, n_seq_max=2)
    batch = Batch.empty()
    for i in range(5):                              # interleaved, as a server's batch can have them
        batch.add(A[i], i, 0, True)
        batch.add(B[i], i, 1, True)
    ctx.decode(batch)
    got = np.array([ctx.get_logits_ith(i) for i in range(10)])
    a_then = _alone(model, A + [100])
    np.testing.assert_allclose(got[0::2], a_then[:5], atol=2e-4)
    np.testing.assert_allclose(got[1::2], _alone(model, B), atol=2e-4)
    data = ctx.state_save()
    step = Batch.empty()
    step.add(100, 5, 0, True)
    step.add(200, 5, 1, True)
    ctx.decode(step)
    other = Context(model, n_ctx=64, n_seq_max=2)
    other.state_load(data)
    other.decode(step)
    for i in range(2):
        np.testing.assert_array_equal(other.get_logits_ith(i), ctx.get_logits_ith(i))
    np.testing.assert_allclose(ctx.get_logits_ith(0), a_then[5], atol=2e-4)     # one token on a carried state
