"""llama.cpp's own tokenizer test vocabularies (models/ggml-vocab-*.gguf with their .inp/.out cases, as its
test-tokenizer-0 runs them: add_special and parse_special off), loaded through ``Model(vocab_only=True)`` whatever
their architecture; and each vocabulary against libllama on random text.

The .inp/.out files and the vocabularies under 2 MB are in tests/fixtures/vocab; the larger ones come from
llama-cpp-python's sdist through ``scripts/llamacpp_vocabs.sh`` (a cache outside the clone, or ``LLAMPY_VOCABS``).
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest

from llampy.llama.arch import UnknownArchitecture
from llampy.llama.model import Model

from tests.paths import ROOT

FIXTURES = ROOT / "tests" / "fixtures" / "vocab"
VERSION = "0.3.36"
CASE_VOCABS = sorted(p.name[len("ggml-vocab-"):-len(".gguf.inp")] for p in FIXTURES.glob("ggml-vocab-*.gguf.inp"))
# vocabularies llama.cpp ships without cases: checked against libllama only
EXTRA_VOCABS = ["aquila", "baichuan", "gpt-neox", "nomic-bert-moe"]


def _cache_dirs() -> list[Path]:
    base = os.environ.get("LLAMPY_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME")
                                                          or os.path.expanduser("~/.cache"), "llampy")
    return [Path(d) for d in (os.environ.get("LLAMPY_VOCABS", ""), os.path.join(base, f"llamacpp-vocab-{VERSION}"))
            if d]


def vocab_path(name: str) -> Path:
    fname = f"ggml-vocab-{name}.gguf"
    for d in [FIXTURES] + _cache_dirs():
        if (d / fname).exists():
            return d / fname
    msg = (f"{fname} is not in tests/fixtures/vocab nor the vocabulary cache: run `bash scripts/llamacpp_vocabs.sh` "
           f"(make test does; LLAMPY_VOCABS names its output)")
    if os.environ.get("CI"):
        pytest.fail(msg + " (CI must run every llama.cpp test vocabulary)")
    pytest.skip(msg)


def vocab_cases(name: str) -> list[tuple[str, list[int]]]:
    """test-tokenizer-0's reading: inputs split at '\\n__ggml_vocab_test__\\n', one line of ids each."""
    raw = (FIXTURES / f"ggml-vocab-{name}.gguf.inp").read_bytes().decode("utf-8")
    sep = "\n__ggml_vocab_test__\n"
    inp, pos = [], 0
    while pos < len(raw):
        nxt = raw.find(sep, pos)
        if nxt < 0:
            inp.append(raw[pos:])
            break
        inp.append(raw[pos:nxt])
        pos = nxt + len(sep)
    out = [[int(x) for x in line.split()] for line in
           (FIXTURES / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8").splitlines()]
    assert len(inp) == len(out), name
    return list(zip(inp, out))


_MODELS: dict = {}


def vocab_model(name: str):
    """``Llama(path, vocab_only=True)`` on the vocabulary (its ``vocab`` is the Model's)."""
    from llampy.llama.api import Llama
    if name not in _MODELS:
        _MODELS[name] = Llama(str(vocab_path(name)), vocab_only=True, tune_process=False)
    return _MODELS[name]


@pytest.mark.parametrize("name", CASE_VOCABS)
def test_llamacpp_vocab_cases(name):
    """Every case through ``Llama(vocab_only=True).tokenize`` (as test-tokenizer-0: no BOS, specials as text)."""
    llm = vocab_model(name)
    cases = vocab_cases(name)
    assert len(cases) >= 40
    bad = [(t, want, got) for t, want in cases
           if (got := llm.tokenize(t.encode("utf-8"), add_bos=False, special=False)) != want]
    assert not bad, f"{name}: {len(bad)}/{len(cases)} differ, first {bad[0]}"


def test_vocab_cases_cover_every_tokenizer_family():
    """The case vocabularies span SPM, byte-level BPE (many pre-tokenizers), gemma4's raw-UTF-8 BPE and WPM."""
    assert {"bert-bge", "gemma-4", "llama-spm", "gpt-2", "command-r", "falcon", "mpt", "refact"} <= set(CASE_VOCABS)


def test_vocab_only_any_architecture(capsys):
    """A WPM vocabulary loads without weights (Model, Llama, `llampy tokenize`); so does one of an architecture
    llampy does not build (falcon), whose weights then fail with the architecture named."""
    from llampy.cli import main
    from llampy.llama.api import Llama
    path = vocab_path("bert-bge")
    m = Model(path, vocab_only=True)
    assert m.hparams.arch == "bert" and m.vocab.type == "wpm" and m.hparams.n_vocab == 30522
    llm = Llama(str(path), vocab_only=True, tune_process=False)
    ids = llm.tokenize(b"Hello world!")
    assert ids == [101, 7592, 2088, 999, 102] and llm.ctx is None
    assert llm.detokenize(ids[1:-1]) == b" hello world !" and llm.vocab.detokenize(ids[1:-1]) == " hello world!"
    assert main(["tokenize", str(path), "Hello world!", "--add-special"]) == 0
    assert json.loads(capsys.readouterr().out) == {"ids": [101, 7592, 2088, 999, 102]}
    falcon = vocab_path("falcon")
    f = Model(falcon, vocab_only=True)
    assert f.arch is None and f.hparams.arch == "falcon" and f.vocab.n_tokens > 0
    with pytest.raises(UnknownArchitecture, match="'falcon'"):
        Model(falcon)
    # a known architecture keeps its hyper-parameters and module under vocab_only
    s = Model(vocab_path("llama-spm"), vocab_only=True)
    assert s.arch is not None and s.hparams.n_layer > 0


def test_wpm_rules():
    """BERT's normalization with llama.cpp's tables: accents stripped (first code point of the decomposition),
    lowercased, controls dropped, punctuation and CJK split out; a word with no full cut is [UNK]."""
    from llampy.llama.vocab_wpm import wpm_preprocess
    assert wpm_preprocess("Héllo, WORLD! 日本語 naïve\tx\u0301y \x00z") == \
        ["hello", ",", "world", "!", "日", "本", "語", "naive", "xy", "z"]
    assert wpm_preprocess("Héllo", lowercase=False, strip_accents=False) == ["Héllo"]
    v = vocab_model("bert-bge").vocab
    assert v.tokenize("\U0001F999") == [v.unk]
    assert (v.bos, v.sep, v.unk, v.pad, v.mask) == (101, 102, 100, 0, 103)


def test_unordered_map_order():
    """llama.cpp takes the EOT/FIM token it meets first in its std::unordered_map: libstdc++'s hash and iteration
    order, recorded from a g++ 12 program inserting these keys in order."""
    from llampy.llama.vocab_order import hash_bytes, iteration_order
    assert hash_bytes([b"", b"a", b"abcdefgh", b"abcdefghi", b"<|endoftext|>", "\u2581the".encode()]).tolist() == \
        [6142509188972423790, 4993892634952068459, 8664279048047335611, 13036955925923793583, 3113324847494305268,
         16230366170308768533]
    toks = [f"tok{i}" for i in range(60)] + ["<|endoftext|>", "<|im_end|>", "a", "abcdefghijklmnop", "\u2581the"]
    want = ("63 62 61 60 59 52 24 23 35 0 25 21 64 14 20 16 12 22 13 18 27 47 4 1 2 54 3 56 19 9 6 26 10 8 28 7 58 "
            "11 29 5 30 39 15 17 32 36 37 42 38 40 41 43 34 44 53 46 48 45 49 33 50 31 51 55 57")
    assert iteration_order(toks).tolist() == [int(x) for x in want.split()]
    # repeated texts insert one node (the first), as operator[] does
    assert iteration_order(toks + ["tok3", "a"]).tolist() == [int(x) for x in want.split()]
    # qwen2's <|im_end|> comes before <|endoftext|> in that order: llama.cpp's EOT
    q, l3 = vocab_model("qwen2").vocab, vocab_model("llama-bpe").vocab
    assert q.tokens[q.eot] == "<|im_end|>" and l3.tokens[l3.eot] == "<|eot_id|>"


# ------------------------------------------------------------------------------- llama.cpp's own tables, re-read
_C_ESCAPES = {"\\": "\\", '"': '"', "'": "'", "n": "\n", "r": "\r", "t": "\t", "?": "?"}


def _lex_cpp(src: str) -> tuple[str, list[str]]:
    """C++ source without its comments, each string literal (adjacent ones joined, as the compiler joins them)
    replaced by ``@N@``, and the strings' values."""
    out, strs, i, joined = [], [], 0, False
    while i < len(src):
        if src.startswith("//", i):
            end = src.find("\n", i)
            i = len(src) if end < 0 else end
        elif src.startswith("/*", i):
            i = src.index("*/", i) + 2
        elif src[i] in "\"'":
            q, j, buf = src[i], i + 1, []
            while src[j] != q:
                if src[j] == "\\":
                    assert src[j + 1] in _C_ESCAPES, f"escape \\{src[j + 1]} not read here: {src[i:j + 10]!r}"
                    buf.append(_C_ESCAPES[src[j + 1]])
                    j += 2
                else:
                    buf.append(src[j])
                    j += 1
            i = j + 1
            if q == "'":
                out.append("'?'")
                joined = False
            elif joined:
                strs[-1] += "".join(buf)
            else:
                strs.append("".join(buf))
                out.append(f"@{len(strs) - 1}@")
                joined = True
            continue
        else:
            joined = joined and src[i].isspace()
            out.append(src[i])
            i += 1
    return "".join(out), strs


def _llama_vocab_cpp() -> str:
    """llama.cpp's src/llama-vocab.cpp of the sdist the vocabularies come from (scripts/llamacpp_vocabs.sh)."""
    for d in _cache_dirs():
        if (d / "llama-vocab.cpp").exists():
            return (d / "llama-vocab.cpp").read_text(encoding="utf-8")
    msg = "llama-vocab.cpp is not in the vocabulary cache: run `bash scripts/llamacpp_vocabs.sh` (make test does)"
    if os.environ.get("CI"):
        pytest.fail(msg)
    pytest.skip(msg)


def _region(src: str, start: str, end: str) -> tuple[str, list[str]]:
    a = src.index(start)
    return _lex_cpp(src[a:src.index(end, a)])


def test_every_llamacpp_pre_tokenizer_is_llampys():
    """llama_vocab::impl::load's pre-tokenizer names and the options each sets, and llm_tokenizer_bpe's regexes per
    pre-tokenizer type, read from llama.cpp's source: llampy's table (PRE_TYPES) has the same names, the same
    regexes verbatim and the same options; every tokenizer model llama.cpp names is one llampy loads."""
    import re
    from types import SimpleNamespace
    from llampy.llama import vocab as V
    from llampy.llama.vocab_bpe import _REGEXES, PRE_TYPES, UNSUPPORTED_PRE
    from llampy.server.rerank import add_sep
    src = _llama_vocab_cpp()
    # llm_tokenizer_bpe's constructor: pre-tokenizer type -> (regexes, byte_encode)
    code, strs = _region(src, "struct llm_tokenizer_bpe : llm_tokenizer {", "std::vector<std::string> regex_exprs;")
    regexes, n_blocks = {}, 0
    for m in re.finditer(r"((?:case\s+LLAMA_VOCAB_PRE_TYPE_\w+\s*:\s*)+|default\s*:\s*)regex_exprs\s*=\s*"
                         r"\{([^{}]*)\}\s*;([^{}]*?)break\s*;", code):
        rx = tuple(strs[int(k)] for k in re.findall(r"@(\d+)@", m.group(2)))
        rest = dict(re.findall(r"([\w.]+)\s*=\s*(\w+)\s*;", m.group(3)))
        assert set(rest) <= {"byte_encode"}, rest
        for t in re.findall(r"LLAMA_VOCAB_PRE_TYPE_(\w+)", m.group(1)) or ["<default>"]:
            regexes[t] = (rx, rest.get("byte_encode", "true") == "true")
        n_blocks += 1
    assert n_blocks == len(re.findall(r"regex_exprs\s*=", code)) and "<default>" in regexes
    assert len(regexes) == len(re.findall(r"\bcase\b", code)) + 1
    # the load's chain of pre-tokenizer names: name -> (type, options set)
    code, strs = _region(src, "if (type == LLAMA_VOCAB_TYPE_BPE) {", "} else if (type == LLAMA_VOCAB_TYPE_SPM)")
    names = {}
    for m in re.finditer(r"if\s*\(([^{}]*)\)\s*\{([^{}]*)\}", code):
        assigns = dict(re.findall(r"([\w.]+)\s*=\s*(\w+)\s*;", m.group(2)))
        pre_type = assigns.pop("pre_type").removeprefix("LLAMA_VOCAB_PRE_TYPE_")
        for k in re.findall(r"tokenizer_pre\s*==\s*@(\d+)@", m.group(1)):
            assert strs[int(k)] not in names
            names[strs[int(k)]] = (pre_type, assigns)
    assert len(names) == len(re.findall(r"tokenizer_pre\s*==", code)) >= 90
    forced = re.search(r"if \(pre_type == LLAMA_VOCAB_PRE_TYPE_(\w+) && !add_bos\) \{\s*add_bos = true;", src)
    assert forced
    known = {"clean_spaces", "ignore_merges", "add_bos", "escape_whitespaces", "special_bos_id", "add_sep",
             "normalizer_opts.lowercase"}
    assert set(names) == set(PRE_TYPES), f"not in both: {sorted(set(names) ^ set(PRE_TYPES))}"
    assert not UNSUPPORTED_PRE & set(names)
    bad = []
    for name, (pre_type, a) in sorted(names.items()):
        assert set(a) <= known, (name, a)          # an option this test does not compare yet
        rx, byte_enc = regexes.get(pre_type, regexes["<default>"])
        key, opts = PRE_TYPES[name]
        want = dict(regexes=rx, byte_encode=byte_enc, clean_spaces=a.get("clean_spaces", "true") == "true",
                    ignore_merges=a.get("ignore_merges") == "true", add_bos=a.get("add_bos") == "true",
                    escape_whitespaces=a.get("escape_whitespaces") == "true",
                    no_bos=a.get("special_bos_id") == "LLAMA_TOKEN_NULL",
                    lowercase=a.get("normalizer_opts.lowercase", "true") == "true",
                    force_bos=pre_type == forced.group(1), add_sep=a.get("add_sep") == "true")
        got = dict(regexes=_REGEXES[key], byte_encode=opts.get("byte_encode", True),
                   clean_spaces=opts.get("clean_spaces", True), ignore_merges=opts.get("ignore_merges", False),
                   add_bos=opts.get("add_bos", False), escape_whitespaces=opts.get("escape_whitespaces", False),
                   no_bos=opts.get("no_bos", False), lowercase=opts.get("lowercase", True),
                   force_bos=opts.get("force_bos", False),
                   add_sep=add_sep(SimpleNamespace(type="bpe"), {"tokenizer.ggml.pre": name}))
        bad += [(name, k, got[k], want[k]) for k in want if got[k] != want[k]]
    assert not bad, f"{len(bad)} differ from llama.cpp, first {bad[:3]}"
    # tokenizer.ggml.model: every name llama.cpp's load compares against
    code, strs = _region(src, "ml.get_key(LLM_KV_TOKENIZER_MODEL, tokenizer_model);",
                         "// for now, only BPE models have pre-tokenizers")
    models = {strs[int(k)] for k in re.findall(r"tokenizer_model\s*==\s*@(\d+)@", code)}
    ours = set(V._MODELS) | V._KNOWN_MODELS
    assert len(models) >= 10 and models == ours, f"not in both: {sorted(models ^ ours)}"


# ------------------------------------------------------------------------------------------ libllama, differential
_ORACLE = r'''
import ctypes, json, sys
import llama_cpp as L
L.llama_backend_init()
mp = L.llama_model_default_params(); mp.vocab_only = True
req = json.load(sys.stdin)
model = L.llama_model_load_from_file(req["model"].encode(), mp)
if not model:
    json.dump({"error": "load failed"}, sys.stdout); sys.exit(0)
vocab = L.llama_model_get_vocab(model)
def tok(text, add, parse):
    b = text.encode("utf-8"); n = 2 * len(b) + 8; buf = (L.llama_token * n)()
    r = L.llama_tokenize(vocab, b, len(b), buf, n, add, parse)
    return list(buf[:r])
def detok(ids, rs, us):
    arr = (L.llama_token * max(1, len(ids)))(*ids); n = 256 * len(ids) + 64
    buf = ctypes.create_string_buffer(n)
    r = L.llama_detokenize(vocab, arr, len(ids), buf, n, rs, us)
    return buf.raw[:r].hex()
nv = L.llama_vocab_n_tokens(vocab)
json.dump({"tok": [[tok(t, a, p) for a, p in ((False, False), (False, True), (True, True))] for t in req["texts"]],
           "detok": [[detok(i, rs, us) for rs, us in ((False, True), (False, False), (True, True))]
                     for i in req["ids"]],
           "eog": [i for i in range(nv) if L.llama_vocab_is_eog(vocab, i)],
           "attr": [int(L.llama_vocab_get_attr(vocab, i)) for i in range(nv)],
           "ids": [L.llama_vocab_bos(vocab), L.llama_vocab_eos(vocab), L.llama_vocab_eot(vocab),
                   L.llama_vocab_sep(vocab), L.llama_vocab_pad(vocab)],
           "add": [L.llama_vocab_get_add_bos(vocab), L.llama_vocab_get_add_eos(vocab)]}, sys.stdout)
'''

_PARTS = (list("abcXYZ  \t\n\r019'.,!?-_<>|/\\\"#$%&*()[]{}^~`@+=;:éüñßÆ—“”…€日本語中文한국어ไทยعربيहिन्दी²½Ⅻ٣")
          + ["'s", "'LL", "'re", "\u00a0", "\u3000", "\x85", "\u2028", "\u200b", "\x04", "\x00", "\u0301", "\u0378",
             "\ufffd", "\U000F0000", "\U0001F999", "\U0001F44D\U0001F3FD", "  ", "   ", "\n\n", "\n\n\n", "\t\t",
             "    ", "\r\n", "\u2581", "<0x41>", "Hello", " world", "12345678", "3.14", "ǅ", "ﬁ", "ẞ", "İ", "Ωmega",
             "ÀÉÎÕÜ", "caféS", "Straße", "ＡＢＣ", "①"])


def _random_texts(v, seed: int, n: int) -> list[str]:
    """Random strings over characters that stress pre-tokenizers and normalizers, the vocabulary's own special
    tokens and pieces of its ordinary ones."""
    rnd = random.Random(seed)
    specials = [v.tokens[i] for i in np.flatnonzero(v.attr & (8 | 16 | 1)).tolist()]
    rnd.shuffle(specials)
    pieces = [v.tokens[rnd.randrange(v.n_tokens)] for _ in range(400)]
    parts = _PARTS + specials[:30] + [p.replace("\u2581", " ") for p in pieces]
    texts = ["".join(rnd.choice(parts) for _ in range(rnd.randint(1, 25))) for _ in range(n)]
    return texts + ["", " ", "a ' b 's", "hello , world . ok ? no !", " leading", "trailing  ", "\n"]


def _llamacpp_python():
    from tests import llamacpp
    py = llamacpp.python()
    if py is None:
        llamacpp.missing("a Python with llama_cpp")
    return py


@pytest.mark.slow
@pytest.mark.parametrize("name", CASE_VOCABS + EXTRA_VOCABS)
def test_vocab_matches_libllama(name):
    """Random text through llama.cpp and through ``Model(vocab_only=True)``: tokenize (3 ways), detokenize (3 ways),
    special ids, add_bos/add_eos, the EOG set and every token's attributes."""
    py = _llamacpp_python()
    path = vocab_path(name)
    v = vocab_model(name).vocab
    texts = _random_texts(v, zlib.crc32(name.encode()), 150)
    rnd = random.Random(name)
    ids = [[rnd.randrange(v.n_tokens) for _ in range(rnd.randint(1, 12))] for _ in range(60)]
    ids += [v.tokenize(t, add_special=True, parse_special=True) or [0] for t in texts[:60]]
    r = subprocess.run([py, "-c", _ORACLE], input=json.dumps({"model": str(path), "texts": texts, "ids": ids}),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    ref = json.loads(r.stdout)
    assert "error" not in ref, name
    got_ids = [-1 if x is None else x for x in (v.bos, v.eos, v.eot, v.sep, v.pad)]
    assert got_ids == ref["ids"], name
    assert [v.add_bos, v.add_eos] == ref["add"], name
    assert sorted(v.eog) == ref["eog"], name
    diff = np.flatnonzero(v.attr != np.array(ref["attr"]))
    assert not len(diff), (name, [(int(i), v.tokens[i], int(v.attr[i]), ref["attr"][i]) for i in diff[:5]])
    bad = []
    for t, want in zip(texts, ref["tok"]):
        got = [v.tokenize(t, add_special=a, parse_special=p) for a, p in ((False, False), (False, True), (True, True))]
        if got != want:
            bad.append((t, want, got))
    assert not bad, f"{name}: {len(bad)}/{len(texts)} tokenize differently, first {bad[0]}"
    for i, want in zip(ids, ref["detok"]):
        got = [v.detokenize_bytes(i, special=us, remove_special=rs).hex()
               for rs, us in ((False, True), (False, False), (True, True))]
        assert got == want, (name, i)


def _rewrite(src: Path, dst: Path, **overrides) -> Path:
    """``src``'s metadata with some tokenizer keys replaced (``tokenizer_ggml_pre=...`` for tokenizer.ggml.pre)."""
    from llampy.gguf import GGUFReader
    from llampy.gguf.writer import GGUFWriter
    r = GGUFReader(src)
    over = {k if "." in k else k.replace("_", ".", 2): v for k, v in overrides.items()}
    w = GGUFWriter(dst)
    for k, val in r.metadata.items():
        if k in over:
            new = over.pop(k)
            if new is not None:
                w.add(k, new, r.value_types[k] if not isinstance(new, list) else None)
        else:
            w.add(k, val, r.value_types[k])
    for k, val in over.items():
        if val is not None:
            w.add(k, val)
    w.write()
    return dst


def _rwkv_tokens(v) -> list[str]:
    """An RWKV "world"-style vocabulary: every byte, escaped as llama.cpp unescapes it, then gpt-2's tokens as
    bytes (escaped likewise, some with \\t \\n \\r escapes)."""
    def esc(b: bytes) -> str | None:
        try:
            s = b.decode("utf-8")
        except UnicodeDecodeError:
            return None
        return s.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")

    toks = [f"\\x{b:02x}" if b < 0x20 or b >= 0x7F or b == 0x5C else chr(b) for b in range(256)]
    seen = set(toks)
    for i in range(v.n_tokens):
        t = esc(v.token_to_piece(i))
        if t and len(t) > 1 and t not in seen:
            seen.add(t)
            toks.append(t)
    return toks


# pre-tokenizers no shipped vocabulary uses, run over gpt-2's vocabulary (and its merges); not "whitespace", whose
# words hold spaces that llama.cpp's merge lookup asserts against outside its own tokenizer model. With
# tests/llama/test_vocab.py's list (SmolLM2's vocabulary) every regex set of llm_tokenizer_bpe is run.
_PRES = ["afmoe", "tiny_aya", "cohere2moe", "superbpe", "kimi-k2", "granite-embed-multi-311m",
         "sarvam-moe", "gemma4", "youtu", "exaone-moe", "minicpm5", "laguna", "seed-coder",
         "chameleon", "granite-embed-multi-97m", "spark2_5", "ufakzeka", "viking"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", _PRES + ["model=whitespace", "model=rwkv", "model=plamo2", "model=hybriddna",
                                          "ugm:merge-spaces", "ugm:no-prefix", "wpm:cased"])
def test_tokenizer_kinds_match_libllama(kind, tmp_path):
    """Pre-tokenizers and tokenizer models without a llama.cpp test vocabulary, and options the shipped ones leave at
    their defaults: a shipped vocabulary rewritten to use them (gpt-2's for BPE and RWKV, llama-spm's for PLaMo-2,
    nomic-bert-moe's for UGM, bert-bge's for WPM), against libllama on random text."""
    py = _llamacpp_python()
    src = vocab_path("gpt-2")
    if kind == "model=whitespace":
        path = _rewrite(src, tmp_path / "v.gguf", tokenizer_ggml_model="whitespace", tokenizer_ggml_pre="whitespace")
    elif kind == "model=hybriddna":        # gpt-2's BPE plus the DNA tags and every ACGT 6-mer (with its marker)
        import itertools
        toks = list(Model(src, vocab_only=True).vocab.tokens) + ["<dna>", "</dna>", "<oov>"] + \
            ["".join(k) + "\ue000" for k in itertools.product("ACGT", repeat=6)] + ["CCCCCC"]
        path = _rewrite(src, tmp_path / "v.gguf", tokenizer_ggml_model="hybriddna", tokenizer_ggml_tokens=toks,
                        tokenizer_ggml_token_type=None)
    elif kind == "model=plamo2":
        path = _rewrite(vocab_path("llama-spm"), tmp_path / "v.gguf", tokenizer_ggml_model="plamo2")
    elif kind == "ugm:merge-spaces":
        path = _rewrite(vocab_path("nomic-bert-moe"), tmp_path / "v.gguf", tokenizer_ggml_remove_extra_whitespaces=True)
    elif kind == "ugm:no-prefix":
        path = _rewrite(vocab_path("nomic-bert-moe"), tmp_path / "v.gguf", tokenizer_ggml_add_space_prefix=False)
    elif kind == "wpm:cased":
        path = _rewrite(vocab_path("bert-bge"), tmp_path / "v.gguf", **{"tokenizer.ggml.normalizer.lowercase": False})
    elif kind == "model=rwkv":
        base = Model(src, vocab_only=True).vocab
        toks = _rwkv_tokens(base)
        path = _rewrite(src, tmp_path / "v.gguf", tokenizer_ggml_model="rwkv", tokenizer_ggml_pre=None,
                        tokenizer_ggml_merges=None, tokenizer_ggml_tokens=toks,
                        tokenizer_ggml_token_type=None, tokenizer_ggml_bos_token_id=None,
                        tokenizer_ggml_eos_token_id=None, tokenizer_ggml_unknown_token_id=None)
    else:
        path = _rewrite(src, tmp_path / "v.gguf", tokenizer_ggml_pre=kind)
    v = Model(path, vocab_only=True).vocab
    texts = _random_texts(v, zlib.crc32(kind.encode()), 120)
    rnd = random.Random(kind)
    if kind == "model=hybriddna":
        dna = ["<dna>", "</dna>", "ACGT", "acgt", "GGCCTA", "N", "x", "é", " ", "CCCCCC", "Hello"]
        texts += ["".join(rnd.choice(dna) for _ in range(rnd.randint(1, 20))) for _ in range(60)]
    ids = [[rnd.randrange(v.n_tokens) for _ in range(rnd.randint(1, 12))] for _ in range(40)]
    r = subprocess.run([py, "-c", _ORACLE], input=json.dumps({"model": str(path), "texts": texts, "ids": ids}),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    ref = json.loads(r.stdout)
    assert "error" not in ref, kind
    assert [v.add_bos, v.add_eos] == ref["add"], kind
    bad = []
    for t, want in zip(texts, ref["tok"]):
        got = [v.tokenize(t, add_special=a, parse_special=p) for a, p in ((False, False), (False, True), (True, True))]
        if got != want:
            bad.append((t, want, got))
    assert not bad, f"{kind}: {len(bad)}/{len(texts)} tokenize differently, first {bad[0]}"
    for i, want in zip(ids, ref["detok"]):
        got = [v.detokenize_bytes(i, special=us, remove_special=rs).hex()
               for rs, us in ((False, True), (False, False), (True, True))]
        assert got == want, (kind, i)
