"""The tiny random-weight models of ../shared/fixtures/tiny against llama.cpp's own outputs on them
(README there: teacher-forced log-probs are the main check; greedy ids up to the first near-tie; perplexity)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from llampy.llama.batch import Batch
from llampy.llama.context import Context
from llampy.llama.model import Model
from llampy.llama.perplexity import perplexity

from tests.paths import TINY

MODELS = ["llama-F32", "qwen2-Q8_0", "qwen3-Q8_0", "gemma2-Q8_0", "gemma3-Q8_0", "phi3-Q8_0", "qwen3moe-Q8_0",
          "granite-Q8_0", "starcoder2-Q8_0"]
# llampy mirrors llama.cpp's CPU arithmetic (8-bit activations, its integer dot-product lanes, F16 KV cache and
# flash-attention rounding), so the Q8_0 models agree to ~6e-5, far inside the README's 1e-3. The F32 model's
# matrix products go through BLAS rather than llama.cpp's sgemm, which leaves 4.5e-3 (README: 0.05 for an
# engine that does not mirror them).
TOLS = {"llama-F32": 1e-2}
TOL = 1e-3
MARGIN = 0.05


def log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


@pytest.fixture(scope="module", params=MODELS)
def tiny(request):
    name = request.param
    ref = json.loads((TINY / f"{name}.json").read_text())
    model = Model(TINY / f"{name}.gguf")
    return name, model, ref


def test_tokenize_prompts(tiny):
    name, model, ref = tiny
    for p in ref["prompts"]:
        assert model.vocab.tokenize(p["prompt"], add_special=True, parse_special=True) == p["prompt_ids"]


def test_teacher_forced_logprobs(tiny):
    name, model, ref = tiny
    worst = 0.0
    for p in ref["prompts"]:
        toks = p["prompt_ids"] + p["ids"]
        ctx = Context(model, n_ctx=256, n_batch=256, n_ubatch=256)
        b = Batch.from_tokens(toks, logits_all=True)
        ctx.decode(b)
        lp = log_softmax(ctx.get_logits())
        n_p = len(p["prompt_ids"])
        for k, step in enumerate(p["steps"]):
            row = lp[n_p - 1 + k]
            for tid, ref_lp in step["top"]:
                worst = max(worst, abs(row[tid] - ref_lp))
            top = step["top"]
            if top[0][1] - top[1][1] > max(MARGIN, 2 * TOLS.get(name, TOL)):
                assert int(np.argmax(row)) == step["id"], f"{name} step {k}: argmax differs"
    print(f"{name}: max |dlogprob| = {worst:.2e}")
    tol = TOLS.get(name, TOL)
    assert worst <= tol, f"{name}: max |dlogprob| {worst:.4f} > {tol}"


def test_greedy_free_running(tiny):
    name, model, ref = tiny
    for p in ref["prompts"]:
        ctx = Context(model, n_ctx=256)
        ctx.decode(Batch.from_tokens(p["prompt_ids"]))
        pos = len(p["prompt_ids"])
        for k, step in enumerate(p["steps"]):
            top = step["top"]
            if top[0][1] - top[1][1] <= MARGIN:
                break  # a near-tie: beyond it the two continuations may rightly part
            tok = int(np.argmax(ctx.get_logits_ith(-1)))
            assert tok == p["ids"][k], f"{name} prompt {p['prompt'][:20]!r} step {k}"
            ctx.decode(Batch.from_tokens([tok], pos0=pos))
            pos += 1


def test_perplexity(tiny):
    name, model, ref = tiny
    pp = ref["perplexity"]
    text = (TINY / "seed004_first6000.txt").read_text(encoding="utf-8")
    res = perplexity(model, text, n_ctx=pp["n_ctx"], n_batch=pp["n_batch"])
    assert len(res.chunks) == len(pp["chunks"])
    assert abs(res.nll - np.log(pp["ppl"])) <= 0.005, f"{name}: ln PPL {res.nll:.5f} vs {np.log(pp['ppl']):.5f}"
