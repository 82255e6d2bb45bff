"""The tokenizer against llama.cpp's tokenizations (fixtures), detokenization and streaming-safe UTF-8."""
from __future__ import annotations

import json

import pytest

from llampy.gguf import GGUFReader
from llampy.llama.vocab import StreamDecoder, Vocab

from tests.paths import LLAMACPP, TINY


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def vocab_and_ref(request):
    from llampy.models import resolve_model
    name = request.param
    fn = {"smollm2": "smollm2-135m-q4_1.json", "gemma3": "gemma3-270m-q4_k_m.json"}[name]
    return Vocab.from_metadata(GGUFReader(resolve_model(name)).metadata), json.loads((LLAMACPP / fn).read_text())


def test_fixture_tokenizations(vocab_and_ref):
    v, ref = vocab_and_ref
    for case in ref["tokenize"]:
        got = v.tokenize(case["text"], add_special=case.get("add_special", False), parse_special=case["parse_special"])
        assert got == case["ids"], case["text"]
    for g in ref["greedy"]:
        assert v.tokenize(g["prompt"], add_special=True, parse_special=True) == g["prompt_ids"]


def test_round_trip_and_stream(vocab_and_ref):
    v, ref = vocab_and_ref
    for case in ref["tokenize"]:
        if case["parse_special"]:
            ids = v.tokenize(case["text"], parse_special=True)
            text = v.detokenize(ids)
            assert text == case["text"]
            dec = StreamDecoder(v)
            pieces = [dec.feed(i) for i in ids] + [dec.flush()]
            assert "".join(pieces) == text
            assert all("\ufffd" not in p for p in pieces)


def test_stream_never_splits_a_character():
    from llampy.models import resolve_model
    v = Vocab.from_metadata(GGUFReader(resolve_model("smollm2")).metadata)
    text = "naïve café 日本語 🤖🎉 done"
    ids = v.tokenize(text)
    assert len(ids) > len(text.split())          # some characters span several byte tokens
    dec = StreamDecoder(v)
    out = []
    for i in ids:
        piece = dec.feed(i)
        piece.encode("utf-8")                    # every piece is whole characters
        assert "\ufffd" not in piece
        out.append(piece)
    assert "".join(out) + dec.flush() == text


def test_tiny_fixture_prompts():
    for path in sorted(TINY.glob("*.json"))[:3]:
        ref = json.loads(path.read_text())
        v = Vocab.from_metadata(GGUFReader(TINY / (path.stem + ".gguf")).metadata)
        for p in ref["prompts"]:
            assert v.tokenize(p["prompt"], add_special=True, parse_special=True) == p["prompt_ids"]


def test_eog_and_errors():
    from llampy.models import resolve_model
    md = dict(GGUFReader(resolve_model("smollm2")).metadata)
    v = Vocab.from_metadata(md)
    assert v.is_eog(v.token_to_id["<|im_end|>"]) and v.is_eog(v.eos)
    bad = dict(md)
    bad["tokenizer.ggml.model"] = "wordpiece-9000"
    with pytest.raises(ValueError, match="unsupported tokenizer model"):
        Vocab.from_metadata(bad)
    del bad["tokenizer.ggml.model"]
    with pytest.raises(ValueError, match="tokenizer.ggml.model"):
        Vocab.from_metadata(bad)
