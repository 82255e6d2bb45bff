"""The CLI keeps its promise: a mistake of the user's (a bad option value, a text too short, a chat template that
does not parse or runs away, a model file with impossible metadata) is one line on stderr and a non-zero status,
never a traceback."""
from __future__ import annotations

import subprocess
import sys

import pytest

from llampy.gguf import GGUFValueType as VT

from tests.fuzz_gguf import write_variant
from tests.paths import TINY

TINY_MODEL = TINY / "qwen2-Q8_0.gguf"


def llampy(*args, stdin: str = "", timeout: float = 300):
    return subprocess.run([sys.executable, "-m", "llampy", *map(str, args)], input=stdin, capture_output=True,
                          text=True, timeout=timeout)


def assert_one_line(r, status: int, words: str) -> None:
    assert r.returncode == status, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("llampy: error:") and words in last, r.stderr[-2000:]


@pytest.mark.parametrize("args", [
    ["run", TINY_MODEL, "-p", "hi", "-t", "-3"],
    ["bench", TINY_MODEL, "-t", "0"],
    ["perplexity", TINY_MODEL, "-f", "x.txt", "--threads", "-1"],
    ["chat", TINY_MODEL, "-t", "-2"],
])
def test_a_negative_thread_count_is_a_usage_error(args):
    assert_one_line(llampy(*args), 2, "--threads must be at least 1")


def test_other_option_values(tmp_path):
    assert_one_line(llampy("serve", TINY_MODEL, "--port", "70000"), 2, "--port must be in 0..65535")
    assert_one_line(llampy("bench", TINY_MODEL, "-r", "0"), 2, "--reps must be at least 1")


def test_a_text_shorter_than_one_chunk(tmp_path):
    f = tmp_path / "short.txt"
    f.write_text("Just a few words.")
    assert_one_line(llampy("perplexity", TINY_MODEL, "-f", f, "-c", "128"), 1, "need at least n_ctx=128")


def test_chat_with_a_template_that_does_not_parse():
    assert_one_line(llampy("chat", TINY_MODEL, "--chat-template", "{% for %}", stdin="hi\n"), 1,
                    "chat template does not parse")


@pytest.mark.parametrize("template,words", [
    ("{% for %}", "chat template does not parse"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "chat template is refused"),
])
def test_serve_refuses_a_model_whose_template_does_not_parse_or_runs_away(tmp_path, template, words):
    p = write_variant(TINY_MODEL, tmp_path / "t.gguf", set={"tokenizer.chat_template": (template, VT.STRING)})
    assert_one_line(llampy("serve", p, "--port", "0", "--ctx-size", "256"), 1, words)


def test_a_model_with_impossible_metadata(tmp_path):
    p = write_variant(TINY_MODEL, tmp_path / "m.gguf", set={"qwen2.block_count": (2**32 - 1, VT.UINT32)})
    assert_one_line(llampy("run", p, "-p", "hi", "-n", "1"), 1, "qwen2.block_count")
    p = write_variant(TINY_MODEL, tmp_path / "e.gguf",
                      set={"qwen2.attention.layer_norm_rms_epsilon": (float("nan"), VT.FLOAT32)})
    assert_one_line(llampy("run", p, "-p", "hi", "-n", "1"), 1, "layer_norm_rms_epsilon")
    p = write_variant(TINY_MODEL, tmp_path / "v.gguf", set={"tokenizer.ggml.model": ("llama", VT.STRING)})
    assert_one_line(llampy("run", p, "-p", "hi\nthere", "-n", "1"), 1, "no byte token")


def test_cache_type_flags_reach_the_kv_cache(tmp_path):
    """-ctk/-ctv set the KV cache's types (llama.cpp's flags, bf16 included): bench reports them as llama-bench does,
    a quantized cache moves perplexity a little (and does move it); a type llama.cpp does not offer is a usage
    error."""
    import json
    r = llampy("bench", TINY_MODEL, "-p", "8", "-n", "2", "-r", "1", "-ctk", "q8_0")     # heads of 16
    assert_one_line(r, 1, "a Q8_0 K cache needs heads of a multiple of 32 values; this model's K heads have 16")
    r = llampy("bench", "-p", "8", "-n", "2", "-r", "1", "-ctk", "q8_0", "-ctv", "q4_0", "--json")  # SmolLM2
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(r.stdout)
    assert {(x["type_k"], x["type_v"]) for x in rows} == {("q8_0", "q4_0")}
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    ppl = {}
    for kt in ("f16", "q4_0"):
        r = llampy("perplexity", "-f", text, "-c", "64", "--chunks", "2", "-ctk", kt, "-ctv", kt)
        assert r.returncode == 0, r.stderr[-2000:]
        ppl[kt] = float(r.stdout.split("PPL = ")[1].split()[0])
    assert ppl["f16"] != ppl["q4_0"] and abs(ppl["q4_0"] / ppl["f16"] - 1) < 0.2
    # bf16 reaches the cache from every engine command (its logits: tests/llama/test_kv_cache_bf16.py)
    from llampy.cli import build_parser
    from llampy.cli_engine import cache_kw
    from llampy.ggml.types import GGMLType
    for cmd, extra in (("run", ["-p", "x"]), ("chat", []), ("serve", []), ("bench", []), ("perplexity", ["-f", "x"])):
        args = build_parser(cmd).parse_args([cmd, "-ctk", "bf16", "-ctv", "BF16"] + extra)
        assert cache_kw(args) == dict(type_k=GGMLType.BF16, type_v=GGMLType.BF16), cmd
    r = llampy("serve", TINY_MODEL, "-ctv", "q3_k")
    assert r.returncode == 2 and "invalid choice: 'q3_k'" in r.stderr
