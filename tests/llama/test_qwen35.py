"""Qwen 3.5 (qwen35, qwen35moe) against llama.cpp: its log-probs on the tiny files of tests/fixtures/tiny_recurrent
(recorded by make_fixtures.py with llama.cpp 0.3.36), the longest prompt teacher-forced (the other two agree as
well: worth their time in the suite only if these files change); and the M-RoPE sections llampy cannot run refused
by name."""
from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from llampy.llama.batch import Batch
from llampy.llama.context import Context
from llampy.llama.model import Model
from llampy.llama.perplexity import perplexity

from tests.llama.test_load_recurrent import _rewrite
from tests.llama.tiny_recurrent import HERE, gguf
from tests.paths import TINY

# llama.cpp's numbers to the last bit where recorded (max |d| = 0 on the recording machine); a build whose SIMD
# width differs sums some products in another order
TOL = 1e-5
MARGIN = 0.05


def _log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


# qwen35: two key heads for four value heads (value head h reads key head h % 2), a SwiGLU feed-forward;
# qwen35moe: Qwen3-Next's experts, attention every fourth layer (the default interval)
@pytest.mark.parametrize("name", ["qwen35-s32-Q8_0", "qwen35moe-s16-Q8_0"])
def test_teacher_forced_logprobs_equal_llamacpps(name, tmp_path_factory):
    ref = json.loads((HERE / f"{name}.json").read_text())
    path = gguf(name, tmp_path_factory)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == ref["sha256"], f"{name}: the built GGUF changed"
    model = Model(path)
    worst = 0.0
    for p in ref["prompts"][1:2]:
        ctx = Context(model, n_ctx=128, n_batch=128, n_ubatch=128)
        ctx.decode(Batch.from_tokens(p["prompt_ids"] + p["ids"], logits_all=True))
        lp = _log_softmax(ctx.get_logits())
        n_p = len(p["prompt_ids"])
        for k, step in enumerate(p["steps"]):
            row = lp[n_p - 1 + k]
            assert np.isfinite(row).all(), f"{name} step {k}: non-finite log-probs"
            worst = max(worst, max(abs(row[tid] - ref_lp) for tid, ref_lp in step["top"]))
            if step["top"][0][1] - step["top"][1][1] > MARGIN:
                assert int(np.argmax(row)) == step["id"], f"{name} step {k}: argmax differs"
    assert worst <= TOL, f"{name}: max |dlogprob| {worst:.2e} > {TOL}"


def test_perplexity_first_chunk_equals_llamacpps(tmp_path_factory):
    # 128 tokens in one batch: the decay's softplus must be the C library's logf(1 + expf(x)) to the last bit (NumPy's
    # float32 log and exp were one ulp away on 200 of 512 inputs, and the chunk's ln PPL 0.018 away)
    name = "qwen35-s32-Q8_0"
    pp = json.loads((HERE / f"{name}.json").read_text())["perplexity"]
    text = (TINY / pp["text_file"]).read_text(encoding="utf-8")
    res = perplexity(Model(gguf(name, tmp_path_factory)), text, n_ctx=pp["n_ctx"], n_batch=pp["n_batch"], max_chunks=1)
    assert abs(res.nll - np.log(pp["chunks"][0])) <= 1e-4


def test_sections_leaving_pairs_to_the_fourth_row_are_refused(tmp_path, tmp_path_factory):
    src = gguf("qwen35-s32-Q8_0", tmp_path_factory)
    # 6 rotated pairs; sections 1, 1, 1 give pairs 0-2 to t, h, w and leave 3-5 to the fourth row
    path = _rewrite(src, tmp_path / "m.gguf", set_={"qwen35.rope.dimension_sections": np.array([1, 1, 1, 3],
                                                                                               np.int32)})
    with pytest.raises(ValueError, match=r"rope.dimension_sections \[1, 1, 1, 3\] leave some of the 6"):
        Model(path)
    path = _rewrite(src, tmp_path / "n.gguf", drop=("qwen35.rope.dimension_sections",))
    with pytest.raises(ValueError, match="qwen35.rope.dimension_sections' is missing"):
        Model(path)
