"""The real models against llama.cpp's greedy continuations and perplexity (../shared/fixtures/llamacpp, DESIGN.md)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from llampy.llama.batch import Batch
from llampy.llama.context import Context
from llampy.llama.model import Model
from llampy.llama.perplexity import perplexity

from tests.paths import LLAMACPP, SEEDS

pytestmark = pytest.mark.slow

CASES = {"smollm2": ("smollm2-135m-q4_1.json", 52.0007), "gemma3": ("gemma3-270m-q4_k_m.json", 55.2268)}
# Both run bit-identical to llama.cpp when fed as its server fed them (server_prompt_batches); what is left
# (~1e-3) is the server's float32 softmax over the vocabulary.
TOLS = {"smollm2": (0.1, 0.1), "gemma3": (0.1, 0.1)}   # (log-prob tolerance, near-tie margin)

# llama-server's defaults when the fixtures were recorded (common.h: n_batch 2048, n_ubatch 512)
SERVER_N_BATCH, SERVER_N_UBATCH = 2048, 512


def server_prompt_batches(ids, n_swa):
    """The prompt cut into the batches llama-server decoded it in. For a model with sliding-window layers it
    makes context checkpoints, so it stops filling a batch 4 + n_ubatch and 4 tokens before the prompt's end
    (server-context.cpp, ``checkpoint_offsets``). The cut matters for exactness: llama.cpp's arithmetic depends
    on a batch's size (Q4_K's repacked gemm takes rows in fours, gemv the rest; k-quants from 8 rows run the
    tiled kernel), so Gemma 3's last prompt tokens must come as the batch of 4 the server made."""
    if n_swa <= 0:
        return [ids]
    cuts = sorted({c for c in (len(ids) - min(SERVER_N_BATCH, off) for off in (4 + SERVER_N_UBATCH, 4))
                   if 0 < c < len(ids)})
    return [ids[a:b] for a, b in zip([0] + cuts, cuts + [len(ids)])]


def decode_prompt(ctx, model, ids):
    pos = 0
    for part in server_prompt_batches(ids, model.hparams.n_swa):
        ctx.decode(Batch.from_tokens(part, pos0=pos))
        pos += len(part)


def log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


@pytest.fixture(scope="module", params=list(CASES))
def real(request):
    from llampy.models import resolve_model
    name = request.param
    ref = json.loads((LLAMACPP / CASES[name][0]).read_text())
    return name, Model(resolve_model(name)), ref, CASES[name][1]


def test_server_prompt_batches():
    assert server_prompt_batches(list(range(6)), 0) == [list(range(6))]
    assert server_prompt_batches(list(range(6)), 512) == [[0, 1], [2, 3, 4, 5]]
    assert server_prompt_batches(list(range(4)), 512) == [[0, 1, 2, 3]]
    assert [len(b) for b in server_prompt_batches(list(range(600)), 512)] == [84, 512, 4]


def test_tokenize_fixture(real):
    name, model, ref, _ = real
    for case in ref["tokenize"]:
        got = model.vocab.tokenize(case["text"], add_special=case.get("add_special", False),
                                   parse_special=case["parse_special"])
        assert got == case["ids"], case["text"]


def test_greedy_matches_llamacpp(real):
    """Free-running greedy: the same ids up to the first step where llama.cpp's own top-1 and top-2 are within
    0.1; at the steps compared, top-5 log-probs within 0.1."""
    name, model, ref, _ = real
    tol, margin = TOLS[name]
    matched = compared = 0
    worst = 0.0
    for g in ref["greedy"]:
        ctx = Context(model, n_ctx=512)
        decode_prompt(ctx, model, g["prompt_ids"])
        pos = len(g["prompt_ids"])
        for k, step in enumerate(g["steps"]):
            top = step["top"]
            if top[0][1] - top[1][1] <= margin:
                break
            lp = log_softmax(ctx.get_logits_ith(-1))
            for tid, ref_lp in top:
                worst = max(worst, abs(lp[tid] - ref_lp))
            tok = int(np.argmax(lp))
            compared += 1
            assert tok == g["ids"][k], f"{name}: prompt {g['prompt'][:30]!r} step {k}: {tok} != {g['ids'][k]}"
            matched += 1
            ctx.decode(Batch.from_tokens([tok], pos0=pos))
            pos += 1
    print(f"{name}: greedy {matched}/{compared} tokens, max |dlogprob| {worst:.4f}")
    assert worst <= tol
    assert compared >= 20


def test_perplexity_within_1pct(real):
    name, model, ref, ppl_ref = real
    text = (SEEDS / "003_d54e3c86b7c7a32c.txt").read_text(encoding="utf-8")
    res = perplexity(model, text, n_ctx=256, n_batch=256)
    print(f"{name}: PPL {res.ppl:.4f} (llama.cpp {ppl_ref})")
    assert abs(res.ppl / ppl_ref - 1) <= 0.01
