"""The Python API (llama-cpp-python style) and the CLI on the default model."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import llampy
from llampy.cli import main
from llampy.llama.api import PromptTooLong

from tests.paths import LLAMACPP

REF = json.loads((LLAMACPP / "smollm2-135m-q4_1.json").read_text())


@pytest.fixture(scope="module")
def llm():
    return llampy.Llama(n_ctx=256, seed=1)


def test_greedy_completion_is_llamacpps(llm):
    g = REF["greedy"][0]
    res = llm.create_completion(g["prompt"], max_tokens=8, temperature=0, logprobs=2)
    want = llm.detokenize(g["ids"][:8]).decode()
    assert res["choices"][0]["text"] == want
    assert res["usage"] == {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}
    assert res["choices"][0]["finish_reason"] == "length"
    assert len(res["choices"][0]["logprobs"]["token_logprobs"]) == 8


def test_stream_equals_non_stream_and_prefix_reuse(llm):
    g = REF["greedy"][1]
    full = llm.create_completion(g["prompt"], max_tokens=6, temperature=0)["choices"][0]["text"]
    builds = llm.ctx.n_graph_builds
    chunks = list(llm.create_completion(g["prompt"], max_tokens=6, temperature=0, stream=True))
    assert "".join(c["choices"][0]["text"] for c in chunks) == full
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert llm.ctx.n_graph_builds - builds <= 1      # the prompt's KV was reused


def test_stop_strings_and_seeded_sampling(llm):
    out = llm.create_completion("The capital of France is", max_tokens=12, temperature=0, stop=["."])
    assert out["choices"][0]["text"] == " Paris" and out["choices"][0]["finish_reason"] == "stop"
    a = llm.create_completion("Once upon a time", max_tokens=8, temperature=0.9, seed=5)["choices"][0]["text"]
    b = llm.create_completion("Once upon a time", max_tokens=8, temperature=0.9, seed=5)["choices"][0]["text"]
    assert a == b


def test_chat_and_embeddings(llm):
    res = llm.create_chat_completion([{"role": "user", "content": "Name three primary colors."}], max_tokens=12,
                                     temperature=0)
    msg = res["choices"][0]["message"]
    assert msg["role"] == "assistant" and len(msg["content"]) > 0
    e = llm.embed(["red", "a red car", "quantum chromodynamics"])
    e = np.array(e)
    assert e.shape == (3, 576) and np.allclose(np.linalg.norm(e, axis=1), 1, atol=1e-5)


def test_prompt_too_long(llm):
    with pytest.raises(PromptTooLong, match="n_ctx"):
        llm.create_completion("word " * 400, max_tokens=2)


def test_cli_run_json_tokenize_inspect(capsys):
    assert main(["run", "-p", "The capital of France is", "-n", "4", "--temp", "0", "--json", "--n-probs", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_tokens"] == REF["greedy"][0]["prompt_ids"] and out["tokens"] == REF["greedy"][0]["ids"][:4]
    assert len(out["probs"]) == 4 and len(out["probs"][0]) == 2
    assert main(["tokenize", "smollm2", "Hello world"]) == 0
    assert json.loads(capsys.readouterr().out) == {"ids": [19556, 905]}
    assert main(["inspect", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["totals"]["Q4_1"]["count"] > 100 and "tokenizer.ggml.tokens" in rep["metadata"]


def test_cli_errors_are_one_line(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x07\x00\x00\x00" + b"\0" * 32)
    for args in (["inspect", str(bad)], ["run", str(bad), "-p", "x"], ["inspect", str(tmp_path / "missing.gguf")]):
        r = subprocess.run([sys.executable, "-m", "llampy.cli", *args], capture_output=True, text=True)
        assert r.returncode == 1
        assert r.stderr.startswith("llampy: error:") and len(r.stderr.strip().splitlines()) == 1
        assert "Traceback" not in r.stderr


def test_cli_chat_through_a_pipe():
    r = subprocess.run([sys.executable, "-m", "llampy.cli", "chat", "-n", "8", "--temp", "0"],
                       input="Hi there\n", capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and len(r.stdout.strip()) > 0
