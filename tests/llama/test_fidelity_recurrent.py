"""The tiny random-weight recurrent and hybrid models of tests/fixtures/tiny_recurrent against llama.cpp's outputs on
them: teacher-forced log-probs of the top 10 at every step, greedy continuations token by token, perplexity. The
GGUFs are built again by the fixture script (deterministic: their sha256 must be the one the JSON was recorded
on)."""
from __future__ import annotations

import hashlib
import importlib.util
import json

import numpy as np
import pytest

from llampy.llama.batch import Batch
from llampy.llama.context import Context
from llampy.llama.model import Model
from llampy.llama.perplexity import perplexity

from tests.paths import ROOT, TINY

HERE = ROOT / "tests" / "fixtures" / "tiny_recurrent"
MODELS = ["mamba-s16-F32", "mamba-s128-Q8_0", "falcon-mamba-s16-Q8_0", "mamba2-s128-g1-F32", "mamba2-s16-g2-Q8_0",
          "jamba-hybrid-Q8_0", "rwkv6-h16-F32", "rwkv6-h64-Q8_0", "rwkv7-h32-Q8_0", "rwkv7-h64-F32",
          "lfm2-c3-Q8_0", "lfm2-c4-Q8_0", "granitehybrid-s64-Q8_0", "granitehybrid-moe-Q8_0", "falcon-h1-s32-Q8_0",
          "falcon-h1-s128-Q8_0", "nemotron_h-s64-Q8_0"]
# the later architectures' files (the suite's time budget): every prompt teacher-forced, the first prompt token by
# token, the first two chunks of perplexity
LIGHT = set(MODELS[6:])
TOL = 1e-3
MARGIN = 0.05


def _fixtures():
    spec = importlib.util.spec_from_file_location("make_fixtures", HERE / "make_fixtures.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


@pytest.fixture(scope="session")
def recurrent_dir(tmp_path_factory):
    if not (TINY / "qwen2-Q8_0.gguf").exists():
        pytest.skip("the shared tiny fixtures (their vocabulary) are not here")
    return tmp_path_factory.mktemp("tiny_recurrent")


@pytest.fixture(scope="module", params=MODELS)
def tiny(request, recurrent_dir):
    name = request.param
    ref = json.loads((HERE / f"{name}.json").read_text())
    path = recurrent_dir / f"{name}.gguf"
    if not path.exists():
        _fixtures().build(name, path)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == ref["sha256"], f"{name}: the built GGUF changed"
    return name, Model(path), ref


def test_tokenize_prompts(tiny):
    name, model, ref = tiny
    for p in ref["prompts"]:
        assert model.vocab.tokenize(p["prompt"], add_special=True, parse_special=True) == p["prompt_ids"]


def test_teacher_forced_logprobs(tiny):
    name, model, ref = tiny
    worst = 0.0
    for p in ref["prompts"]:
        ctx = Context(model, n_ctx=256, n_batch=256, n_ubatch=256)
        ctx.decode(Batch.from_tokens(p["prompt_ids"] + p["ids"], logits_all=True))
        lp = log_softmax(ctx.get_logits())
        n_p = len(p["prompt_ids"])
        for k, step in enumerate(p["steps"]):
            row = lp[n_p - 1 + k]
            worst = max(worst, max(abs(row[tid] - ref_lp) for tid, ref_lp in step["top"]))
            top = step["top"]
            if top[0][1] - top[1][1] > MARGIN:
                assert int(np.argmax(row)) == step["id"], f"{name} step {k}: argmax differs"
    assert worst <= TOL, f"{name}: max |dlogprob| {worst:.2e} > {TOL}"


def test_greedy_token_by_token(tiny):
    """As llama.cpp was run: the prompt in one batch, then one token per decode, the state carried."""
    name, model, ref = tiny
    for p in ref["prompts"][:1] if name in LIGHT else ref["prompts"]:
        ctx = Context(model, n_ctx=256)
        ctx.decode(Batch.from_tokens(p["prompt_ids"]))
        pos = len(p["prompt_ids"])
        for k, step in enumerate(p["steps"]):
            row = log_softmax(ctx.get_logits_ith(-1))
            for tid, ref_lp in step["top"]:
                assert abs(row[tid] - ref_lp) <= TOL, f"{name} step {k}"
            if step["top"][0][1] - step["top"][1][1] <= MARGIN:
                break
            tok = int(np.argmax(row))
            assert tok == p["ids"][k], f"{name} prompt {p['prompt'][:20]!r} step {k}"
            ctx.decode(Batch.from_tokens([tok], pos0=pos))
            pos += 1


@pytest.mark.slow
def test_perplexity(tiny):
    name, model, ref = tiny
    pp = ref["perplexity"]
    text = (TINY / pp["text_file"]).read_text(encoding="utf-8")
    n = 2 if name in LIGHT else None
    res = perplexity(model, text, n_ctx=pp["n_ctx"], n_batch=pp["n_batch"], max_chunks=n)
    assert len(res.chunks) == (n or len(pp["chunks"]))
    want = np.log(pp["chunks"][n - 1] if n else pp["ppl"])
    assert abs(res.nll - want) <= 0.005, f"{name}: ln PPL {res.nll:.5f} vs {want:.5f}"
