"""Grammars and JSON schemas as a sampler (llampy.llama.grammar): compiling, failing closed, the mask's effect on
candidates, and a corpus of grammars and schemas sampled on the real SmolLM2 at temperature 1 with several seeds,
every reply checked by a checker independent of llguidance (tests/llama/grammar_corpus.py)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from llampy.llama.grammar import Grammar, GrammarError, LlamaGrammar, constraint, gbnf_to_lark, tokenizer_for
from llampy.llama.sampling import Candidates, Chain, Dist, Greedy, TopK

from .grammar_corpus import BAD_GBNF, BAD_SCHEMAS, GBNF, SCHEMA_PROMPT, SCHEMAS, check_schema

SEEDS = (0, 1, 2)


@pytest.fixture(scope="module")
def vocab(smollm2_path):
    from llampy.gguf import GGUFReader
    from llampy.llama.vocab import Vocab
    return Vocab.from_metadata(GGUFReader(smollm2_path).metadata)


# ------------------------------------------------------------------------------------------------ compiling
@pytest.mark.parametrize("name", sorted(GBNF))
def test_corpus_grammars_compile(name):
    g = LlamaGrammar.from_string(GBNF[name][0])
    assert g.kind == "gbnf" and "start" in g.definition


@pytest.mark.parametrize("name", sorted(BAD_GBNF))
def test_bad_grammar_is_an_error(name):
    with pytest.raises(GrammarError, match="invalid") as e:
        LlamaGrammar.from_string(BAD_GBNF[name])
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("name", sorted(BAD_SCHEMAS))
def test_bad_schema_is_an_error(name):
    with pytest.raises(GrammarError, match="schema"):
        LlamaGrammar.from_json_schema(BAD_SCHEMAS[name])


def test_gbnf_conversion_keeps_escapes_and_token_terminals():
    lark = gbnf_to_lark('root ::= "\\u00e9\\x41" [\\u0430-\\u044f]+ <|im_end|> <[2]>')
    assert '"é\\x41"' in lark and "/[а-я]/+" in lark and "<|im_end|> <[2]>" in lark
    with pytest.raises(GrammarError, match="not valid JSON"):
        LlamaGrammar.from_json_schema("{nope")
    with pytest.raises(GrammarError, match="empty"):
        LlamaGrammar.from_string("  ")


def test_response_format_and_grammar_coercion():
    assert constraint(None, None) is None and constraint(None, {"type": "text"}) is None
    assert constraint(None, {"type": "json_object"}).kind == "json_schema"
    g = constraint(None, {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}})
    assert g.source == {"type": "integer"}
    assert constraint('root ::= "a"').kind == "gbnf"

    class Foreign:                       # llama-cpp-python's LlamaGrammar keeps its GBNF in _grammar
        _grammar = 'root ::= "b"'
    assert constraint(Foreign()).source == 'root ::= "b"'
    for bad in ({"type": "yaml"}, {"type": "json_schema"}, "json", {"type": "json_schema", "json_schema": {}}):
        with pytest.raises(GrammarError):
            constraint(None, bad)
    with pytest.raises(GrammarError, match="not both"):
        constraint('root ::= "a"', {"type": "json_object"})
    with pytest.raises(GrammarError, match="GBNF text or a LlamaGrammar"):
        constraint(42)


# ------------------------------------------------------------------------------------------------ the sampler
def test_tokenizer_is_built_once_per_vocabulary(vocab):
    tk = tokenizer_for(vocab)
    assert tokenizer_for(vocab) is tk and tk.vocab_size == vocab.n_tokens
    assert sorted(tk.eos_tokens) == sorted(vocab.eog)
    im_end = vocab.token_to_id["<|im_end|>"]
    assert tk.is_special_token(im_end) and not tk.is_special_token(vocab.token_to_id["Hello"])


def _run_on_random_logits(vocab, grammar, seed, n=40, overlap=False):
    """Sample under the grammar from random logits (no model): the tokens and the text."""
    rng = np.random.default_rng(seed)
    g = Grammar(vocab, grammar, overlap=overlap)
    chain = Chain([g, TopK(50), Dist(seed)])
    toks = []
    for _ in range(n):
        t = chain.sample(rng.standard_normal(vocab.n_tokens).astype(np.float32) * 3)
        chain.accept(t)
        if vocab.is_eog(t):
            break
        toks.append(t)
    return toks, vocab.detokenize(toks, special=True)


@pytest.mark.parametrize("name", ["arithmetic", "chess", "non_ascii"])
def test_random_logits_under_a_grammar_give_sentences_of_it(vocab, name):
    src, _, check = GBNF[name]
    g = LlamaGrammar.from_string(src)
    for seed in SEEDS:
        toks, text = _run_on_random_logits(vocab, g, seed, n=200)
        assert check(text), (seed, text)


def test_overlapped_mask_is_the_same_as_computed_in_apply(vocab):
    g = LlamaGrammar.from_string(GBNF["c_like"][0])
    assert _run_on_random_logits(vocab, g, 5, overlap=True) == _run_on_random_logits(vocab, g, 5, overlap=False)


def test_special_tokens_only_through_token_terminals(vocab):
    im_end = vocab.token_to_id["<|im_end|>"]
    as_text = Grammar(vocab, 'root ::= "<|im_end|>"')
    c = Candidates(np.zeros(vocab.n_tokens, np.float32))
    as_text.apply(c)
    assert im_end not in set(c.ids.tolist()) and c.size > 0          # spelled out by ordinary tokens only
    as_token = Grammar(vocab, 'root ::= "ok" <|im_end|>')
    for t in vocab.tokenize("ok"):
        as_token.accept(t)
    c = Candidates(np.zeros(vocab.n_tokens, np.float32))
    as_token.apply(c)
    assert c.ids.tolist() == [im_end]


def test_a_complete_sentence_allows_only_end_of_generation(vocab):
    g = Grammar(vocab, 'root ::= "yes" | "no"')
    c = Candidates(np.zeros(vocab.n_tokens, np.float32))
    g.apply(c)
    assert {vocab.detokenize([i]) for i in c.ids} <= {"y", "ye", "yes", "n", "no"}
    g.accept(vocab.tokenize("yes")[0])
    if not g.is_stopped():
        c = Candidates(np.zeros(vocab.n_tokens, np.float32))
        g.apply(c)
        g.accept(int(c.ids[0]))
    assert g.is_accepting() and g.is_stopped()
    c = Candidates(np.zeros(vocab.n_tokens, np.float32))
    g.apply(c)
    assert set(c.ids.tolist()) == set(vocab.eog)
    eog = min(vocab.eog)
    g.accept(eog)
    g.accept(eog)                   # a caller ignoring end of generation may go on: only EOG stays allowed
    c = Candidates(np.zeros(vocab.n_tokens, np.float32))
    g.apply(c)
    assert set(c.ids.tolist()) == set(vocab.eog)
    with pytest.raises(GrammarError, match="does not match"):
        g.accept(vocab.tokenize("x")[0])


def test_mask_on_candidates_already_narrowed(vocab):
    """After another sampler the candidates are no longer the whole vocabulary: the mask is looked up by id."""
    g = Grammar(vocab, 'root ::= [0-9]+')
    logits = np.zeros(vocab.n_tokens, np.float32)
    digits = [vocab.tokenize(d)[0] for d in "0123456789"]
    c = Candidates(logits)
    c.take(np.array(digits[:3] + [vocab.tokenize("a")[0]] + digits[3:5]))
    g.apply(c)
    assert c.ids.tolist() == digits[:3] + digits[3:5]
    c = Candidates(logits)
    c.take(np.array([vocab.tokenize("a")[0]]))
    with pytest.raises(GrammarError, match="allows none of the candidates"):
        g.apply(c)


@pytest.mark.parametrize("density", [0.0005, 0.1, 0.5, 0.999, 1.0])
def test_mask_kernels_against_numpy(density):
    from llampy.llama.grammar import _mask_count, _mask_disallow, _mask_ids
    rng = np.random.default_rng(1)
    for n in (49152, 49157, 1000):
        bits = rng.random(((n + 31) // 32) * 32) < density
        words = np.packbits(bits, bitorder="little").view(np.int32)
        ids = np.flatnonzero(bits[:n])
        assert _mask_count(words, n) == ids.size
        assert np.array_equal(_mask_ids(words, n, ids.size), ids)
        logits = rng.standard_normal(n + 7).astype(np.float32)      # past the mask: disallowed
        allowed = np.r_[bits, np.zeros(64, bool)][:n + 7]
        want = np.where(allowed, logits, -np.inf).astype(np.float32)
        _mask_disallow(words, logits)
        assert np.array_equal(logits, want)


def test_dense_mask_sets_minus_inf_sparse_keeps_only_allowed(vocab):
    g = Grammar(vocab, r'root ::= "\"" [^"]{0,30} "\""')
    g.accept(vocab.tokenize('"')[0])
    c = Candidates(np.zeros(vocab.n_tokens, np.float32))
    g.apply(c)
    assert c.size == vocab.n_tokens and np.isinf(c.logits).sum() > 0 and np.isfinite(c.logits).sum() > 40000
    g = Grammar(vocab, 'root ::= [0-9]')
    c = Candidates(np.zeros(vocab.n_tokens, np.float32))
    g.apply(c)
    assert c.size == 10 and np.isfinite(c.logits).all()


def test_reset_starts_the_grammar_again(vocab):
    g = Grammar(vocab, 'root ::= "ab"')
    chain = Chain([g, Greedy()])
    first = chain.sample(np.zeros(vocab.n_tokens, np.float32))
    chain.accept(first)
    chain.reset()
    assert chain.sample(np.zeros(vocab.n_tokens, np.float32)) == first


# ------------------------------------------------------------------------------------------------ real model
@pytest.fixture(scope="module")
def llm():
    from llampy.llama.api import Llama
    return Llama(None, n_ctx=512)


def _chat(llm, prompt, **kw):
    r = llm.create_chat_completion([{"role": "user", "content": prompt}], temperature=1.0, max_tokens=64, **kw)
    return r["choices"][0]["message"]["content"], r["choices"][0]["finish_reason"]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(GBNF))
def test_gbnf_corpus_on_smollm2(llm, name):
    src, prompt, check = GBNF[name]
    g = LlamaGrammar.from_string(src)
    for seed in SEEDS:
        text, finish = _chat(llm, prompt, seed=seed, grammar=g)
        assert finish == "stop" and check(text), (seed, text)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_schema_corpus_on_smollm2(llm, name):
    rf = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}}
    for seed in SEEDS:
        text, finish = _chat(llm, SCHEMA_PROMPT, seed=seed, response_format=rf)
        assert finish == "stop", (seed, text)
        check_schema(SCHEMAS[name], text)


@pytest.mark.slow
def test_api_json_object_grammar_text_and_streaming(llm):
    r = llm.create_chat_completion([{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
                                   temperature=0,
                                   max_tokens=160, response_format={"type": "json_object"})
    assert r["choices"][0]["finish_reason"] == "stop"
    assert isinstance(json.loads(r["choices"][0]["message"]["content"]), dict)
    g = 'root ::= ("yes" | "no") "."'
    r = llm.create_completion("Is water wet? Answer:", max_tokens=8, temperature=1.0, seed=1, grammar=g)
    assert r["choices"][0]["text"] in ("yes.", "no.")
    chunks = list(llm.create_completion("Is water wet? Answer:", max_tokens=8, temperature=1.0, seed=1, grammar=g,
                                        stream=True))
    assert "".join(c["choices"][0]["text"] for c in chunks) == r["choices"][0]["text"]
    import llampy
    g2 = llampy.LlamaGrammar.from_json_schema({"type": "integer", "minimum": 1, "maximum": 9})
    r = llm.create_completion("Pick a digit:", max_tokens=8, temperature=1.0, seed=2, grammar=g2)
    assert 1 <= int(r["choices"][0]["text"]) <= 9


def test_api_fails_closed_before_generating(llm):
    with pytest.raises(ValueError, match="invalid GBNF grammar.*foo"):
        llm.create_completion("x", max_tokens=4, grammar='root ::= foo')
    with pytest.raises(ValueError, match="invalid json schema"):
        llm.create_chat_completion([{"role": "user", "content": "x"}], max_tokens=4,
                                   response_format={"type": "json_schema", "json_schema": {"schema": {"type": "x"}}})
    with pytest.raises(ValueError, match="response_format"):
        llm.create_chat_completion([{"role": "user", "content": "x"}], response_format={"type": "xml"})


# ------------------------------------------------------------------------------------------------ CLI
@pytest.mark.slow
def test_cli_run_grammar_and_json_schema(capsys, tmp_path):
    from llampy.cli import main
    src, prompt, check = GBNF["chess"]
    chat = f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
    assert main(["run", "-p", chat, "-n", "48", "--temp", "1", "--seed", "2", "--grammar", src]) == 0
    assert check(capsys.readouterr().out.rstrip("\n"))
    f = tmp_path / "list.gbnf"
    f.write_text(GBNF["list"][0])
    chat = f"<|im_start|>user\n{GBNF['list'][1]}<|im_end|>\n<|im_start|>assistant\n"
    assert main(["run", "-p", chat, "-n", "48", "--temp", "1", "--seed", "1", "--grammar-file", str(f)]) == 0
    assert GBNF["list"][2](capsys.readouterr().out[:-1])
    schema = SCHEMAS["enum_const"]
    chat = f"<|im_start|>user\n{SCHEMA_PROMPT}<|im_end|>\n<|im_start|>assistant\n"
    assert main(["run", "-p", chat, "-n", "48", "--temp", "1", "--seed", "3", "-j", json.dumps(schema)]) == 0
    check_schema(schema, capsys.readouterr().out)
    f = tmp_path / "s.json"
    f.write_text(json.dumps(SCHEMAS["pattern"]))
    assert main(["run", "-p", chat, "-n", "48", "--temp", "1", "--seed", "3", "--json-schema-file", str(f),
                 "--json"]) == 0
    check_schema(SCHEMAS["pattern"], json.loads(capsys.readouterr().out)["text"])


@pytest.mark.parametrize("args, says", [
    (["--grammar", 'root ::= "a" | foo'], "Rule 'foo' not found"),
    (["--grammar-file", "/nonexistent/g.gbnf"], "cannot read the grammar file"),
    (["--json-schema", '{"type": "nope"}'], "Invalid type: nope"),
    (["--json-schema", "{nope"], "not valid JSON"),
    (["--json-schema-file", "/nonexistent/s.json"], "cannot read the JSON schema file"),
])
def test_cli_bad_grammar_is_one_error_line(args, says):
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "llampy.cli", "run", "-p", "x", "-n", "2", *args],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith("llampy: error:") and says in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_cli_grammar_flags_exclude_each_other():
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "llampy.cli", "run", "-p", "x", "--grammar", 'root ::= "a"', "-j", "{}"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "not allowed with" in r.stderr
