"""The tokenizer against llama.cpp: its recorded tokenizations (fixtures), libllama itself on random text where a
built llama.cpp is at hand, and llama.cpp's rules for loading, special tokens, detokenization and streaming."""
from __future__ import annotations

import json
import random
import subprocess

import numpy as np
import pytest

from llampy.gguf import GGUFReader
from llampy.llama.vocab import StreamDecoder, Vocab
from llampy.llama.vocab_bpe import (BYTE_TO_UNICODE, PRE_TYPES, BpeMerger, bpe_merge_word, byte_encode,
                                    pre_tokenizer)

from tests.paths import LLAMACPP, TINY

FIXTURES = {"smollm2": "smollm2-135m-q4_1.json", "gemma3": "gemma3-270m-q4_k_m.json"}


def _model_path(name):
    from llampy.models import gemma3_path, smollm2_path
    return {"smollm2": smollm2_path, "gemma3": gemma3_path}[name]()


_MD: dict = {}


def metadata(name) -> dict:
    if name not in _MD:
        _MD[name] = GGUFReader(_model_path(name)).metadata
    return _MD[name]


@pytest.fixture(scope="module", params=list(FIXTURES))
def vocab_and_ref(request):
    name = request.param
    return Vocab.from_metadata(metadata(name)), json.loads((LLAMACPP / FIXTURES[name]).read_text())


# ------------------------------------------------------------------------------------------ llama.cpp's fixtures
def test_fixture_tokenizations(vocab_and_ref):
    v, ref = vocab_and_ref
    for case in ref["tokenize"]:
        got = v.tokenize(case["text"], add_special=case.get("add_special", False), parse_special=case["parse_special"])
        assert got == case["ids"], case["text"]
    for g in ref["greedy"]:
        assert v.tokenize(g["prompt"], add_special=True, parse_special=True) == g["prompt_ids"]


def test_tiny_fixture_prompts():
    paths = sorted(TINY.glob("*.json"))
    assert len(paths) == 9
    n = 0
    for path in paths:
        ref = json.loads(path.read_text())
        v = Vocab.from_metadata(GGUFReader(TINY / (path.stem + ".gguf")).metadata)
        for p in ref["prompts"]:
            assert v.tokenize(p["prompt"], add_special=True, parse_special=True) == p["prompt_ids"], path.stem
            n += 1
    assert n == 27


def test_round_trip(vocab_and_ref):
    """Neither vocabulary cleans spaces or adds a space prefix, so detokenize(tokenize(x)) gives x back; with
    BOS added, remove_special drops it again."""
    v, ref = vocab_and_ref
    assert not v.clean_spaces and not v.add_space_prefix
    for case in ref["tokenize"]:
        text = case["text"]
        assert v.detokenize(v.tokenize(text, parse_special=True)) == text
        assert v.detokenize(v.tokenize(text, add_special=True, parse_special=True), remove_special=True) == text
        assert v.detokenize(v.tokenize(text)) == text            # special-looking text stays text


def test_stream_decoder(vocab_and_ref):
    v, ref = vocab_and_ref
    text = "naïve café 日本語 🤖🎉🦙 done \U000F0001\U0010FFFD ẞ ∑ — " + ref["tokenize"][8]["text"]
    ids = v.tokenize(text, parse_special=True)
    # some characters really do span several tokens (byte tokens), so the decoder has something to hold back
    split = [i for i in ids if len(v.token_to_piece(i)) and not _whole_utf8(v.token_to_piece(i))]
    assert split
    for special in (True, False):
        dec = StreamDecoder(v, special=special)
        pieces = [dec.feed(i) for i in ids] + [dec.flush()]
        assert all("\ufffd" not in p for p in pieces)
        assert "".join(pieces) == v.detokenize(ids, special=special)
    assert v.detokenize(ids) == text


def _whole_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_stream_decoder_invalid_bytes():
    """A sequence that can never complete is replaced, once, when the next byte shows it."""
    v = Vocab.from_metadata(metadata("gemma3"))
    ids = [v.token_to_id["<0xE6>"], v.token_to_id["<0x97>"], v.token_to_id["A"], v.token_to_id["<0xF0>"]]
    dec = StreamDecoder(v)
    out = [dec.feed(i) for i in ids]
    assert out == ["", "", "\ufffdA", ""] and dec.flush() == "\ufffd"


# ------------------------------------------------------------------------------------------ loading and special ids
def test_special_ids_and_eog():
    s = Vocab.from_metadata(metadata("smollm2"))
    assert (s.type, s.pre, s.bos, s.eos, s.add_bos, s.add_eos) == ("bpe", "smollm", 1, 2, False, False)
    # <|endoftext|>, <|im_end|>, and <reponame> (found as the FIM "repo" token, which llama.cpp also ends on)
    assert s.eog == {0, 2, 4} and s.eot == 0 and s.fim["fim_rep"] == 4
    assert s.is_eog(s.token_to_id["<|im_end|>"]) and not s.is_eog(1)
    assert all(s.is_control(i) for i in range(17)) and not s.is_control(17)
    g = Vocab.from_metadata(metadata("gemma3"))
    assert (g.type, g.bos, g.eos, g.add_bos, g.add_space_prefix) == ("spm", 2, 1, True, False)
    assert g.eog == {1, g.token_to_id["<end_of_turn>"], g.token_to_id["</s>"]}
    assert g.eot == g.token_to_id["<end_of_turn>"]
    assert g.token_to_piece(g.token_to_id["<start_of_turn>"], special=False) == b""
    assert g.token_to_piece(g.token_to_id["<0x41>"]) == b"A"
    assert g.token_to_piece(g.token_to_id["\u2581the"]) == b" the"


def test_errors():
    md = dict(metadata("smollm2"))
    for bad_model in ("wordpiece-9000", "no_vocab"):
        with pytest.raises(ValueError, match="unsupported tokenizer model"):
            Vocab.from_metadata({**md, "tokenizer.ggml.model": bad_model})
    no_model = {k: v for k, v in md.items() if k != "tokenizer.ggml.model"}
    with pytest.raises(ValueError, match="tokenizer.ggml.model"):
        Vocab.from_metadata(no_model)
    # this llama.cpp refuses an unknown pre-tokenizer ("unknown pre-tokenizer type"); an empty one means default
    with pytest.raises(ValueError, match="unknown pre-tokenizer type 'not-a-pre'"):
        Vocab.from_metadata({**md, "tokenizer.ggml.pre": "not-a-pre"})
    assert all(Vocab.from_metadata({**md, "tokenizer.ggml.pre": p}).pre == p for p in ("kimi-k2", "whitespace"))
    assert Vocab.from_metadata({**md, "tokenizer.ggml.pre": ""}).pre == "default"
    with pytest.raises(ValueError, match="tokenizer.ggml.merges"):
        Vocab.from_metadata({k: v for k, v in md.items() if k != "tokenizer.ggml.merges"})
    with pytest.raises(ValueError, match="tokenizer.ggml.tokens"):
        Vocab.from_metadata({k: v for k, v in md.items() if k != "tokenizer.ggml.tokens"})
    v = Vocab.from_metadata(md)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        v.token_to_piece(v.n_tokens)


# ------------------------------------------------------------------------------------------ rules on small vocabs
def _tiny_bpe(specials, types=None, **extra) -> Vocab:
    """A byte-level vocabulary: the 256 byte characters, a few merges, and the given special tokens."""
    tokens = list(BYTE_TO_UNICODE.values()) + ["ab", "abc"] + list(specials)
    tt = [1] * 258 + (types or [3] * len(specials))
    md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.token_type": np.array(tt, np.int32), "tokenizer.ggml.merges": ["a b", "ab c"]}
    md.update(extra)
    return Vocab.from_metadata(md)


def test_partition_is_sequential_longest_first():
    """llama.cpp splits on the longest special token everywhere first, then the next: not a leftmost match."""
    v = _tiny_bpe(["Xab", "abcY"])
    xab, abcy = v.token_to_id["Xab"], v.token_to_id["abcY"]
    assert v.tokenize("XabcY", parse_special=True) == [v.token_to_id["X"], abcy]
    assert v.tokenize("Xab Xab", parse_special=True) == [xab, v.token_to_id["Ġ"], xab]
    assert v.tokenize("Xab", parse_special=False) == [v.token_to_id["X"], v.token_to_id["ab"]]
    # user-defined tokens are split out even without parse_special
    u = _tiny_bpe(["Xab"], types=[4])
    assert u.tokenize("cXab", parse_special=False) == [u.token_to_id["c"], u.token_to_id["Xab"]]


def test_phi3_rstrip_and_clean_spaces():
    v = _tiny_bpe(["<|end|>", "<|user|>"], **{"general.name": "Phi-3 mini"})
    end = v.token_to_id["<|end|>"]
    assert v.tokenize("a<|end|> \n\tb", parse_special=True) == [v.token_to_id["a"], end, v.token_to_id["b"]]
    # gpt-2 pre-tokenizer: clean_spaces on, as llama.cpp's detokenizer tidies " ," " 's" " ' "
    ids = v.tokenize("x , y 's z ' w 't")
    assert v.clean_spaces and v.detokenize(ids) == "x, y's z'w 't"


def test_pre_tokenizer_splits():
    """A few splits worked out from llama.cpp's regexes and hand-written matchers."""
    assert pre_tokenizer("llama3").split("Hello  world\n\n  x 12345 I'M ok?!\n") == \
        ["Hello", " ", " world", "\n\n", " ", " x", " ", "123", "45", " I", "'M", " ok", "?!\n"]
    assert pre_tokenizer("qwen2").split("ab 123") == ["ab", " ", "1", "2", "3"]
    assert pre_tokenizer("gpt-2").split("a  b\n c's") == ["a", " ", " b", "\n", " c", "'s"]
    assert pre_tokenizer("smollm").split("x1,000 日本語 café") == ["x", "1", ",", "0", "0", "0", " 日本語", " café"]
    # categories come from llama.cpp's Unicode tables: U+0378 is unassigned, U+3000 is whitespace (and
    # only ASCII space may lead a word)
    assert pre_tokenizer("gpt-2").split("a\u0378b\u3000\u3000c") == ["a", "\u0378", "b", "\u3000", "\u3000",
                                                                          "c"]
    assert pre_tokenizer("deepseek-llm").split("abc  \n") == ["abc", "  ", "\n"]


def test_python_bpe_matches_hf_engine():
    v = Vocab.from_metadata(metadata("smollm2"))
    m = v._bpe
    assert m.hf is not None
    text = (LLAMACPP.parent / "tiny" / "seed004_first6000.txt").read_text()[:3000] + " ½ 🦙 \x04x ab\u3000"
    words = [byte_encode(w) for w in v._pre.split(text)]
    py = [i for w in words for i in bpe_merge_word(w, m.ranks, v.token_to_id, False)]
    assert py == m.merge(words) == v.tokenize(text)


def test_long_text_round_trip():
    """12 kB of text with a special token through Gemma 3's vocabulary and back (its speed: benchmarks/sampler_step.py)."""
    g = Vocab.from_metadata(metadata("gemma3"))
    text = (LLAMACPP.parent / "tiny" / "seed004_first6000.txt").read_text() * 2 + "<start_of_turn>user\nhi"
    assert len(text.encode()) > 12000
    ids = g.tokenize(text, add_special=True, parse_special=True)
    assert g.token_to_id["<start_of_turn>"] in ids
    assert g.detokenize(ids, remove_special=True) == text


# ------------------------------------------------------------------------------------------ libllama, differential
_ORACLE = r'''
import ctypes, json, sys
import llama_cpp as L
L.llama_backend_init()
mp = L.llama_model_default_params(); mp.vocab_only = True
def job(req):
    model = L.llama_model_load_from_file(req["model"].encode(), mp)
    if not model:
        return {"error": "load failed"}
    vocab = L.llama_model_get_vocab(model)
    def tok(text, add, parse):
        b = text.encode("utf-8"); n = len(b) + 8; buf = (L.llama_token * n)()
        r = L.llama_tokenize(vocab, b, len(b), buf, n, add, parse)
        return list(buf[:r])
    def detok(ids, rs, us):
        arr = (L.llama_token * max(1, len(ids)))(*ids); n = 64 * len(ids) + 64
        buf = ctypes.create_string_buffer(n)
        r = L.llama_detokenize(vocab, arr, len(ids), buf, n, rs, us)
        return buf.raw[:r].hex()
    nv = L.llama_vocab_n_tokens(vocab)
    return {"tok": [[tok(t, a, p) for a, p in ((False, False), (False, True), (True, True))] for t in req["texts"]],
            "detok": [[detok(i, rs, us) for rs, us in ((False, True), (False, False), (True, True))] for i in req["ids"]],
            "eog": [i for i in range(nv) if L.llama_vocab_is_eog(vocab, i)],
            "attr": [int(L.llama_vocab_get_attr(vocab, i)) for i in range(nv)],
            "bos": L.llama_vocab_bos(vocab), "eos": L.llama_vocab_eos(vocab), "eot": L.llama_vocab_eot(vocab),
            "add_bos": L.llama_vocab_get_add_bos(vocab)}
json.dump([job(r) for r in json.load(sys.stdin)], sys.stdout)
'''


def _llamacpp_python():
    from tests import llamacpp
    return llamacpp.python()


def _random_texts(seed: int, n: int) -> list[str]:
    rnd = random.Random(seed)
    parts = (list("abcXYZ  \t\n\r019'.,!?-_<>|/\\\"#$%&*()[]{}^~`@+=;:éüñßÆ—“”…€日本語中文한국어ไทยعربيहिन्दी²½Ⅻ٣")
             + ["'s", "'S", "'LL", "'re", "'ve", "'d", "\u00a0", "\u3000", "\x85", "\u2028", "\u200b", "\x04", "\x1c",
                "\u0301", "\u0378", "\U000F0000", "\U0001F999", "\U0001F44D\U0001F3FD", "<|im_start|>", "<|im_end|>",
                "<|endoftext|>", "<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<unused5>", "<|im_",
                "<reponame>", "  ", "   ", "\n\n", "\n\n\n", "\t\t", "    ", "\r\n", "▁", "<0x41>", "Hello",
                " world", "12345678", "3.14", "ǅ", "ﬁ", "ẞ"])
    texts = ["".join(rnd.choice(parts) for _ in range(rnd.randint(1, 30))) for _ in range(n)]
    seeds = (TINY / "seed004_first6000.txt").read_text()
    for _ in range(20):
        a = rnd.randrange(len(seeds) - 300)
        texts.append(seeds[a:a + rnd.randint(1, 300)])
    return texts + ["", " ", "a ' b 's", "hello , world . ok ? no !"]


_PRES = ["default", "llama3", "qwen2", "qwen35", "gpt-2", "starcoder", "deepseek-llm", "deepseek-coder", "deepseek-v3",
         "falcon", "tekken", "gpt-4o", "poro-chat", "chatglm-bpe", "exaone-moe", "bailingmoe", "jais-2", "youtu"]


@pytest.mark.slow
def test_matches_libllama(tmp_path):
    """Random text through llama.cpp and through us: both real vocabularies, and SmolLM2's vocabulary under
    18 other pre-tokenizers; tokenize (3 ways), detokenize (3 ways), EOG set and token attributes."""
    py = _llamacpp_python()
    if py is None:
        from tests import llamacpp
        llamacpp.missing("a Python with llama_cpp")
    from llampy.gguf.writer import GGUFWriter
    src = GGUFReader(TINY / "llama-F32.gguf")
    models = {"smollm2": str(_model_path("smollm2")), "gemma3": str(_model_path("gemma3"))}
    for pre in _PRES:
        assert pre in PRE_TYPES
        path = tmp_path / f"vocab-{pre}.gguf"
        w = GGUFWriter(path)
        for k, val in src.metadata.items():
            if k != "tokenizer.ggml.add_bos_token":      # let the pre-tokenizer's default decide
                w.add(k, pre if k == "tokenizer.ggml.pre" else val, src.value_types[k])
        w.write()
        models[pre] = str(path)
    texts = _random_texts(7, 120)
    jobs, vocabs = [], {}
    for name, path in models.items():
        v = vocabs[name] = Vocab.from_metadata(GGUFReader(path).metadata)
        rnd = random.Random(name)
        ids = [[rnd.randrange(v.n_tokens) for _ in range(rnd.randint(1, 10))] for _ in range(40)]
        ids += [v.tokenize(t, add_special=True, parse_special=True) for t in texts[:40]]
        jobs.append({"model": path, "texts": texts if name != "gemma3" else texts[:80], "ids": ids})
    r = subprocess.run([py, "-c", _ORACLE], input=json.dumps(jobs), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    for (name, v), job, ref in zip(vocabs.items(), jobs, json.loads(r.stdout)):
        assert "error" not in ref, name
        assert (v.bos, v.eos, v.eot if v.eot is not None else -1, v.add_bos) == \
            (ref["bos"], ref["eos"], ref["eot"], ref["add_bos"]), name
        assert sorted(v.eog) == ref["eog"], name
        assert np.array_equal(v.attr, ref["attr"]), name
        for t, want in zip(job["texts"], ref["tok"]):
            got = [v.tokenize(t, add_special=a, parse_special=p) for a, p in ((False, False), (False, True), (True, True))]
            assert got == want, (name, t)
        for ids, want in zip(job["ids"], ref["detok"]):
            got = [v.detokenize_bytes(ids, special=us, remove_special=rs).hex()
                   for rs, us in ((False, True), (False, False), (True, True))]
            assert got == want, (name, ids)


def test_tokenizer_tables_made_on_first_tokenize():
    """Loading keeps neither the text -> id map nor the BPE merger (llampy bench never tokenizes); the first
    tokenize makes them, with the same ids as a map built from all tokens (a repeated text: its last id)."""
    v = Vocab.from_metadata(metadata("smollm2"))
    assert v._token_to_id is None and v._bpe_merger is None
    assert v.tokenize("Hello world", add_special=True) == [19556, 905]
    assert v._bpe_merger is not None
    assert v.token_to_id == {t: i for i, t in enumerate(v.tokens)}
