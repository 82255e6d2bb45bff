"""gemma3n against llama.cpp: the tiny random-weight model of tests/fixtures/tiny_more (gemma3n.gguf, 22 layers: KV
sharing starts at layer 20 in llama.cpp whatever the file says) and llama.cpp 0.3.36's outputs on it.

The steps are decoded as llama.cpp recorded them, the prompt in one batch and then one token at a time: this random
model is chaotic (its activation sparsity keeps only the tail of each gate row, so a difference in the last bits of
an attention output grows ~35x in a layer, and the AltUp streams grow layer after layer), and llama.cpp itself
moves by up to 18 in a log-prob between one batch of 66 tokens (tiled attention, float32 accumulators) and the
same tokens one by one (F16 accumulators). Along llama.cpp's own path llampy is within a few 1e-6."""
from __future__ import annotations

import numpy as np
import pytest

from llampy.llama.batch import Batch
from llampy.llama.context import Context
from llampy.llama.model import Model

from tests.llama.test_fidelity_tiny_more import log_softmax, tiny_more_model

TOL = 1e-3
MARGIN = 0.05


@pytest.fixture(scope="module")
def gemma3n():
    path, ref = tiny_more_model("gemma3n")
    return Model(path), ref


def _steps(model, p, n_steps=None):
    """llama.cpp's recorded decoding of prompt p: -> the worst |dlogprob| over each step's top 10, and the steps."""
    ctx = Context(model, n_ctx=256, n_batch=256, n_ubatch=256)
    ids = p["prompt_ids"]
    ctx.decode(Batch.from_tokens(ids))
    worst = []
    for k, step in enumerate(p["steps"][:n_steps]):
        row = log_softmax(ctx.get_logits_ith(-1))
        worst.append(max(abs(row[t] - want) for t, want in step["top"]))
        top = step["top"]
        if top[0][1] - top[1][1] > MARGIN:
            assert int(np.argmax(row)) == step["id"], f"prompt {p['prompt'][:20]!r} step {k}: argmax differs"
        ctx.decode(Batch.from_tokens([p["ids"][k]], pos0=len(ids) + k))
    return max(worst)


# (prompt, steps) within the CI budget: the short prompt's 16 steps, the chat prompt's first 4 (every prompt
# matches over all 16 steps: make_tiny_more.py's README row)
STEPS = ((0, 16), (2, 4))


def test_tokens_and_logprobs_step_by_step(gemma3n):
    model, ref = gemma3n
    for p in ref["prompts"]:
        assert model.vocab.tokenize(p["prompt"], add_special=True, parse_special=True) == p["prompt_ids"]
    for i, n in STEPS:
        p = ref["prompts"][i]
        worst = _steps(model, p, n)
        assert worst <= TOL, f"prompt {p['prompt'][:20]!r}: max |dlogprob| {worst:.2e} > {TOL}"


def test_layers_past_twenty_share_earlier_caches(gemma3n):
    model, ref = gemma3n
    hp = model.hparams
    assert hp.n_layer == 22 and hp.kv_reuse[:20] == [-1] * 20
    assert hp.kv_reuse[20:] == [19, 18] and not hp.is_swa(20) and hp.is_swa(21)     # global 19, window 18
    ctx = Context(model, n_ctx=256)
    kv = ctx.kv
    assert kv.k[20] is None and kv.v[20] is None and kv.k[21] is None and kv.v[21] is None
    assert kv.view_k(20, 256).view_src is kv.k[19] and kv.view_v(21, 256).view_src is kv.v[18]
    own = sum(t.nbytes for t in kv.k + kv.v if t is not None)
    assert own == 20 * 2 * hp.n_embd_k_gqa() * 256 * 2            # 20 layers' K and V, F16
    # a sequence's saved state holds the 20 caches, and restores bit for bit
    ctx.decode(Batch.from_tokens(ref["prompts"][0]["prompt_ids"]))
    saved = ctx.kv.state_write()
    assert {f"k{il}" for il in range(20)} <= set(saved) and "k20" not in saved and "v21" not in saved


def test_sharing_is_what_llama_cpp_runs(gemma3n):
    # every layer on a cache of its own: the same weights give other log-probs (the shared caches are exercised)
    model, ref = gemma3n
    hp = model.hparams
    p = ref["prompts"][0]
    saved = hp.kv_reuse
    hp.kv_reuse = []
    try:
        worst = _steps(model, p, n_steps=2)
    except AssertionError:       # an argmax that differs already
        worst = float("inf")
    finally:
        hp.kv_reuse = saved
    assert worst > 0.05, f"own caches on layers 20-21 still match llama.cpp ({worst:.2e})"


def test_embeddings_input_is_refused(gemma3n):
    # llama.cpp feeds an image's embeddings with the padding token's per-layer row; llampy has no gemma3n
    # projector, so such a batch is refused by name rather than run half-way
    model, _ = gemma3n
    ctx = Context(model, n_ctx=64)
    with pytest.raises(ValueError, match="gemma3n"):
        ctx.decode(Batch.from_embd(np.zeros((2, model.hparams.n_embd), np.float32)))
