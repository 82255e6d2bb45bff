"""Qwen 3.5 (qwen35, qwen35moe) against llama.cpp: its log-probs on the tiny files of tests/fixtures/tiny_recurrent
(recorded by make_fixtures.py with llama.cpp 0.3.36), the longest prompt teacher-forced (the other two agree as
well: worth their time in the suite only if these files change); and the M-RoPE sections llampy cannot run refused
by name."""
from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from llampy.gguf import GGUFReader
from llampy.gguf.constants import GGUFValueType as VT
from llampy.gguf.writer import GGUFWriter
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


def _teacher_forced_worst(model, ref, prompts):
    worst = 0.0
    for p in prompts:
        ctx = Context(model, n_ctx=128, n_batch=128, n_ubatch=128)
        ctx.decode(Batch.from_tokens(p["prompt_ids"] + p["ids"], logits_all=True))
        lp = _log_softmax(ctx.get_logits())
        n_p = len(p["prompt_ids"])
        for k, step in enumerate(p["steps"]):
            row = lp[n_p - 1 + k]
            assert np.isfinite(row).all(), f"step {k}: non-finite log-probs"
            worst = max(worst, max(abs(row[tid] - ref_lp) for tid, ref_lp in step["top"]))
            if step["top"][0][1] - step["top"][1][1] > MARGIN:
                assert int(np.argmax(row)) == step["id"], f"step {k}: argmax differs"
    return worst


# qwen35: two key heads for four value heads (value head h reads key head h % 2), a SwiGLU feed-forward;
# qwen35moe: Qwen3-Next's experts, attention every fourth layer (the default interval)
@pytest.mark.parametrize("name", ["qwen35-s32-Q8_0", "qwen35moe-s16-Q8_0"])
def test_teacher_forced_logprobs_equal_llamacpps(name, tmp_path_factory):
    ref = json.loads((HERE / f"{name}.json").read_text())
    path = gguf(name, tmp_path_factory)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == ref["sha256"], f"{name}: the built GGUF changed"
    worst = _teacher_forced_worst(Model(path), ref, ref["prompts"][1:2])
    assert worst <= TOL, f"{name}: max |dlogprob| {worst:.2e} > {TOL}"


def test_perplexity_first_chunk_equals_llamacpps(tmp_path_factory):
    # 128 tokens in one batch: the decay's softplus must be the C library's logf(1 + expf(x)) to the last bit (NumPy's
    # float32 log and exp were one ulp away on 200 of 512 inputs, and the chunk's ln PPL 0.018 away)
    name = "qwen35-s32-Q8_0"
    pp = json.loads((HERE / f"{name}.json").read_text())["perplexity"]
    text = (TINY / pp["text_file"]).read_text(encoding="utf-8")
    res = perplexity(Model(gguf(name, tmp_path_factory)), text, n_ctx=pp["n_ctx"], n_batch=pp["n_batch"], max_chunks=1)
    assert abs(res.nll - np.log(pp["chunks"][0])) <= 1e-4


def _with_mtp_block(src, dst):
    """The file plus one multi-token-prediction block after its 4 layers (blk.4: a full-attention block and the
    nextn projections; block_count 5, nextn_predict_layers 1). llama.cpp, which skips the block when it does not
    draft with it, gives this file's logits equal to the plain file's to the last bit (checked when written)."""
    r = GGUFReader(src)
    w = GGUFWriter(dst)
    for k, v in r.metadata.items():
        if k != "general.alignment":
            w.add(k, 5 if k == "qwen35.block_count" else v, r.value_types[k])
    w.add("qwen35.nextn_predict_layers", 1, VT.UINT32)
    for name, t in r.tensors.items():
        w.add_tensor_raw(name, t.type, t.ne, t.data)
    rng = np.random.RandomState(5)
    E, hd, H, F = 64, 16, 2, 96
    for name, shape in [("attn_norm", (E,)), ("post_attention_norm", (E,)), ("attn_q", (2 * hd * H, E)),
                        ("attn_k", (hd, E)), ("attn_v", (hd, E)), ("attn_output", (E, hd * H)), ("attn_q_norm", (hd,)),
                        ("attn_k_norm", (hd,)), ("ffn_gate", (F, E)), ("ffn_up", (F, E)), ("ffn_down", (E, F)),
                        ("nextn.eh_proj", (E, 2 * E)), ("nextn.enorm", (E,)), ("nextn.hnorm", (E,)),
                        ("nextn.shared_head_norm", (E,))]:
        w.add_tensor(f"blk.4.{name}.weight", rng.normal(0, 0.1, shape).astype(np.float32))
    w.write()
    r.close()
    return dst


def test_multi_token_prediction_block_is_skipped(tmp_path, tmp_path_factory):
    name = "qwen35-s32-Q8_0"
    ref = json.loads((HERE / f"{name}.json").read_text())
    model = Model(_with_mtp_block(gguf(name, tmp_path_factory), tmp_path / "mtp.gguf"))
    assert model.hparams.n_layer == 4 and len(model.layers) == 4
    assert _teacher_forced_worst(model, ref, ref["prompts"][:1]) <= TOL


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
