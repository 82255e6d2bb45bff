"""The tiny random-weight recurrent and hybrid models of tests/fixtures/tiny_recurrent against llama.cpp's outputs on
them: teacher-forced log-probs of the top 10 at every step, greedy continuations token by token, perplexity. The
GGUFs are built again by the fixture script (deterministic: their sha256 must be the one the JSON was recorded
on)."""
from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from llampy.llama.batch import Batch
from llampy.llama.context import Context
from llampy.llama.model import Model
from llampy.llama.perplexity import perplexity

from tests.llama.tiny_recurrent import HERE, gguf
from tests.paths import TINY

FULL = ["mamba-s16-F32", "mamba-s128-Q8_0", "falcon-mamba-s16-Q8_0", "mamba2-s128-g1-F32", "mamba2-s16-g2-Q8_0",
        "jamba-hybrid-Q8_0"]
# the later architectures' files, within the suite's time budget: the longest prompt teacher-forced (its greedy
# continuation scored at every step), one chunk of perplexity for two of them; token by token and two sequences
# at once in test_recurrent_more
LATER = ["rwkv6-h16-F32", "rwkv6-h64-Q8_0", "rwkv7-h32-Q8_0", "rwkv7-h64-F32", "lfm2-c3-Q8_0", "lfm2-c4-Q8_0",
         "granitehybrid-s64-Q8_0", "granitehybrid-moe-Q8_0", "falcon-h1-s32-Q8_0", "falcon-h1-s128-Q8_0",
         "nemotron_h-s64-Q8_0", "qwen3next-s32-Q8_0", "qwen3next-s64-legacy-Q8_0", "nemotron_h_moe-lat32-Q8_0",
         "rwkv6qwen2-h32-Q8_0", "rwkv6qwen2-h16-Q8_0", "arwkv7-h32-Q8_0", "arwkv7-h64-gate-Q8_0"]
PPL_LATER = ["rwkv7-h32-Q8_0", "lfm2-c4-Q8_0"]
TOL = 1e-3
MARGIN = 0.05


def log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


@pytest.fixture(scope="module")
def tiny(request, tmp_path_factory):
    name = request.param
    ref = json.loads((HERE / f"{name}.json").read_text())
    path = gguf(name, tmp_path_factory)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == ref["sha256"], f"{name}: the built GGUF changed"
    return name, Model(path), ref


@pytest.mark.parametrize("tiny", FULL, indirect=True)
def test_tokenize_prompts(tiny):
    name, model, ref = tiny
    for p in ref["prompts"]:
        assert model.vocab.tokenize(p["prompt"], add_special=True, parse_special=True) == p["prompt_ids"]


@pytest.mark.parametrize("tiny", FULL + LATER, indirect=True)
def test_teacher_forced_logprobs(tiny):
    name, model, ref = tiny
    worst = 0.0
    for p in ref["prompts"] if name in FULL else ref["prompts"][1:2]:
        ctx = Context(model, n_ctx=256, n_batch=256, n_ubatch=256)
        ctx.decode(Batch.from_tokens(p["prompt_ids"] + p["ids"], logits_all=True))
        lp = log_softmax(ctx.get_logits())
        n_p = len(p["prompt_ids"])
        for k, step in enumerate(p["steps"]):
            row = lp[n_p - 1 + k]
            assert np.isfinite(row).all(), f"{name} step {k}: non-finite log-probs"     # max() would skip a NaN
            worst = max(worst, max(abs(row[tid] - ref_lp) for tid, ref_lp in step["top"]))
            top = step["top"]
            if top[0][1] - top[1][1] > MARGIN:
                assert int(np.argmax(row)) == step["id"], f"{name} step {k}: argmax differs"
    assert worst <= TOL, f"{name}: max |dlogprob| {worst:.2e} > {TOL}"


@pytest.mark.parametrize("tiny", FULL, indirect=True)
def test_greedy_token_by_token(tiny):
    """As llama.cpp was run: the prompt in one batch, then one token per decode, the state carried."""
    name, model, ref = tiny
    for p in ref["prompts"]:
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
@pytest.mark.parametrize("tiny", FULL + PPL_LATER, indirect=True)
def test_perplexity(tiny):
    name, model, ref = tiny
    pp = ref["perplexity"]
    text = (TINY / pp["text_file"]).read_text(encoding="utf-8")
    n = 1 if name in LATER else None
    res = perplexity(model, text, n_ctx=pp["n_ctx"], n_batch=pp["n_batch"], max_chunks=n)
    assert len(res.chunks) == (n or len(pp["chunks"]))
    want = np.log(pp["chunks"][n - 1] if n else pp["ppl"])
    assert abs(res.nll - want) <= 0.005, f"{name}: ln PPL {res.nll:.5f} vs {want:.5f}"


# a file of each architecture the issue names, and a hybrid by layer (jamba), through the commands a user runs
CLI = ["mamba-s16-F32", "mamba2-s128-g1-F32", "jamba-hybrid-Q8_0", "rwkv6-h16-F32", "rwkv7-h32-Q8_0", "lfm2-c4-Q8_0",
       "granitehybrid-s64-Q8_0", "falcon-h1-s32-Q8_0", "nemotron_h-s64-Q8_0", "qwen3next-s32-Q8_0"]


@pytest.mark.parametrize("name", CLI)
def test_llampy_run_and_perplexity_give_llama_cpps_outputs(name, tmp_path_factory, capsys):
    """`llampy run` (greedy, --json with the top log-probs) gives llama.cpp's prompt tokens, greedy tokens and top
    log-probs on the first prompt, up to its first near tie; `llampy perplexity` its first chunk's perplexity."""
    from llampy.cli import main
    from tests.llama.tiny_recurrent import gguf
    ref = json.loads((HERE / f"{name}.json").read_text())
    path = str(gguf(name, tmp_path_factory))
    p = ref["prompts"][0]
    ties = [k for k, s in enumerate(p["steps"]) if s["top"][0][1] - s["top"][1][1] <= MARGIN]
    n = ties[0] + 1 if ties else len(p["steps"])
    assert main(["run", path, "-p", p["prompt"], "-n", str(n), "--temp", "0", "--json", "--n-probs", "10",
                 "-c", str(ref["context"]["n_ctx"])]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["prompt_tokens"] == p["prompt_ids"]
    assert got["tokens"][:n - 1] == p["ids"][:n - 1], name
    for k, (step, probs) in enumerate(zip(p["steps"][:n], got["probs"])):
        top = {e["id"]: e["logprob"] for e in probs}
        for tid, lp in step["top"][:5]:
            assert abs(top[tid] - lp) <= TOL, f"{name} step {k} token {tid}"
    pp = ref["perplexity"]
    assert main(["perplexity", path, "-f", str(TINY / pp["text_file"]), "-c", str(pp["n_ctx"]), "-b",
                 str(pp["n_batch"]), "--chunks", "1"]) == 0
    out = capsys.readouterr().out
    ppl = float(out.split("Final estimate: PPL = ")[1].split()[0])
    assert abs(np.log(ppl) - np.log(pp["chunks"][0])) <= 0.005, f"{name}: PPL {ppl} vs {pp['chunks'][0]}"


@pytest.mark.parametrize("name", ["mamba2-s128-g1-F32", "granitehybrid-s64-Q8_0"])
def test_python_api_and_chat_on_a_recurrent_model(name, tmp_path_factory, capsys, monkeypatch):
    """The Python API's greedy completion gives llama.cpp's tokens, again on the same prompt (the state cannot drop
    the last run's generated tokens: the prompt is decoded anew) and on another, and `llampy chat` holds two
    turns."""
    import io
    import llampy
    from llampy.cli import main
    from tests.llama.tiny_recurrent import gguf
    ref = json.loads((HERE / f"{name}.json").read_text())
    path = str(gguf(name, tmp_path_factory))
    llm = llampy.Llama(path, n_ctx=ref["context"]["n_ctx"])
    for p in (ref["prompts"][0], ref["prompts"][0], ref["prompts"][1]):
        ties = [k for k, s in enumerate(p["steps"]) if s["top"][0][1] - s["top"][1][1] <= MARGIN]
        n = ties[0] if ties else len(p["steps"])
        res = llm.create_completion(p["prompt"], max_tokens=n, temperature=0)
        assert res["choices"][0]["text"] == llm.detokenize(p["ids"][:n]).decode(errors="replace"), name
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\nand then?\n"))
    assert main(["chat", path, "-n", "4", "--temp", "0"]) == 0
    assert "Traceback" not in capsys.readouterr().err
