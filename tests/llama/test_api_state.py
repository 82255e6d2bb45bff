"""The Python API's saved state (llama-cpp-python's save_state/load_state, state files), log-probabilities in
streamed chunks with text_offset, and the samplers' settings beyond llama-cpp-python's, on the default model."""
from __future__ import annotations

import numpy as np
import pytest

import llampy
from llampy.llama.context import ContextError
from llampy.llama.state import LlamaState

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"


@pytest.fixture(scope="module")
def llm():
    return llampy.Llama(n_ctx=256, seed=1)


def test_state_restores_the_cache_into_another_llama(llm, tmp_path):
    toks = llm.tokenize(PROMPT)
    llm.reset()
    llm.eval_prompt(toks)
    st = llm.save_state()
    assert st.n_tokens == len(toks) and list(st.input_ids) == toks and st.llama_state_size == len(st.llama_state)
    want = llm.eval_token(toks[0]).copy()           # the next step's logits, from the cache as saved
    st.save(tmp_path / "s.bin")
    other = llampy.Llama(n_ctx=256, seed=1)
    other.load_state(LlamaState.load(tmp_path / "s.bin"))
    assert other._cached == toks
    got = other.eval_token(toks[0])                 # only this token is decoded: the rest comes from the state
    np.testing.assert_array_equal(got, want)
    # and a completion reuses it: the same greedy text as from scratch
    other.load_state(st)
    a = other.create_completion(PROMPT, max_tokens=6, temperature=0)["choices"][0]["text"]
    llm.reset()
    assert a == llm.create_completion(PROMPT, max_tokens=6, temperature=0)["choices"][0]["text"]


def test_state_of_another_cache_size_is_refused(llm, tmp_path):
    llm.reset()
    llm.eval_prompt(llm.tokenize("Hello"))
    small = llampy.Llama(n_ctx=128)
    with pytest.raises(ContextError):
        small.load_state(llm.save_state())
    (tmp_path / "junk.bin").write_bytes(b"not a state")
    with pytest.raises(ContextError):
        LlamaState.load(tmp_path / "junk.bin")


def test_streamed_chunks_carry_logprobs_and_text_offset(llm):
    full = llm.create_completion(PROMPT, max_tokens=6, temperature=0, logprobs=2)["choices"][0]
    lp = full["logprobs"]
    assert lp["text_offset"][0] == 0 and all(b - a == len(t) for a, b, t in
                                             zip(lp["text_offset"], lp["text_offset"][1:], lp["tokens"]))
    chunks = list(llm.create_completion(PROMPT, max_tokens=6, temperature=0, logprobs=2, stream=True))
    got = {k: [x for c in chunks for x in c["choices"][0]["logprobs"][k]] for k in lp}
    assert all(len(c["choices"][0]["logprobs"]["tokens"]) == 1 for c in chunks)
    assert got == lp
    # with echo, offsets count from the prompt's start and the first chunk is the prompt
    echo = list(llm.create_completion(PROMPT, max_tokens=3, temperature=0, logprobs=1, stream=True, echo=True))
    assert echo[0]["choices"][0]["text"] == PROMPT and echo[0]["choices"][0]["logprobs"] is None
    assert echo[1]["choices"][0]["logprobs"]["text_offset"] == [len(PROMPT)]
    one = llm.create_completion(PROMPT, max_tokens=3, temperature=0, logprobs=1, echo=True)["choices"][0]
    assert one["text"].startswith(PROMPT) and one["logprobs"]["text_offset"][0] == len(PROMPT)


def test_chat_logprobs_in_the_chat_shape(llm):
    msgs = [{"role": "user", "content": "Say hi."}]
    res = llm.create_chat_completion(msgs, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = res["choices"][0]["logprobs"]["content"]
    assert len(content) == res["usage"]["completion_tokens"]
    assert all(set(e) == {"token", "logprob", "bytes", "top_logprobs"} and len(e["top_logprobs"]) == 2
               for e in content)
    chunks = list(llm.create_chat_completion(msgs, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2,
                                             stream=True))
    streamed = [e for c in chunks if c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]]
    assert streamed == content


def test_more_samplers_through_the_api(llm):
    """DRY, XTC, top-n-sigma and the samplers order reach the chain; an unknown setting is a TypeError."""
    s = llm.make_sampler(temperature=0.7, dry_multiplier=0.8, xtc_probability=0.5, top_n_sigma=1.5,
                         samplers=["penalties", "dry", "top_n_sigma", "xtc", "temperature"])
    assert [type(x).__name__ for x in s.samplers] == ["DRY", "TopNSigma", "XTC", "TempExt", "Dist"]
    assert s.samplers[0].breakers          # llama.cpp's default breakers, read from the vocabulary
    # DRY stops a greedy loop: the text without it repeats itself, with it does not repeat as much
    prompt = "one two three one two three one two three"
    plain = llm.create_completion(prompt, max_tokens=24, temperature=0)["choices"][0]["text"]
    dry = llm.create_completion(prompt, max_tokens=24, temperature=0, dry_multiplier=2.0,
                                dry_allowed_length=2)["choices"][0]["text"]
    assert plain.count("one two three") > dry.count("one two three")
    with pytest.raises(TypeError):
        llm.create_completion(prompt, max_tokens=2, dry_multiplyer=1.0)


def test_cli_run_prompt_cache(tmp_path, capsys):
    """llampy run --prompt-cache: the second run finds the prompt in the file (says how much of it), and its greedy
    text is the first run's."""
    import json

    from llampy.cli import main
    f = tmp_path / "prompt.cache"
    argv = ["run", "-p", PROMPT, "-n", "5", "--temp", "0", "--json", "--prompt-cache", str(f), "-c", "256"]
    assert main(argv) == 0
    first = capsys.readouterr()
    assert f.is_file() and "reused" not in first.err
    assert main(argv) == 0
    second = capsys.readouterr()
    n = len(json.loads(second.out)["prompt_tokens"])
    assert f"{n} of the prompt's {n} tokens reused" in second.err
    assert json.loads(second.out)["text"] == json.loads(first.out)["text"]
    assert main(argv[:-2] + ["-c", "128"]) == 0            # another context size: passed over, with a warning
    assert "not used" in capsys.readouterr().err
