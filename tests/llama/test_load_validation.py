"""Model files whose metadata no model can have are refused at load with one clean llampy error each, before
anything is allocated from them; and a bounded run of fuzzed files (tests/fuzz_gguf.py) ends in llampy's errors or
a working model, never another exception, a hang or a crash."""
from __future__ import annotations

import collections
import random
import time
import tracemalloc

import numpy as np
import pytest

from llampy.ggml.types import GGMLType
from llampy.gguf import GGUFValueType as VT
from llampy.llama.hparams import InvalidMetadata, MissingMetadata
from llampy.llama.model import Model, ModelLoadError
from llampy.llama.vocab import VocabError

from tests.fuzz_gguf import fixture_paths, make_files, run_files, write_variant
from tests.paths import TINY

QWEN2 = TINY / "qwen2-Q8_0.gguf"         # byte-level BPE


def variant(tmp_path, src=QWEN2, **kw):
    return write_variant(src, tmp_path / "v.gguf", **kw)


@pytest.mark.parametrize("n_layer", [33_554_462, 2**32 - 1, 513])
def test_a_huge_block_count_is_refused_at_once(tmp_path, n_layer):
    p = variant(tmp_path, set={"qwen2.block_count": (n_layer, VT.UINT32)})
    tracemalloc.start()
    t0 = time.perf_counter()
    with pytest.raises(InvalidMetadata, match="qwen2.block_count"):
        Model(p)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert time.perf_counter() - t0 < 10 and peak < 200 << 20


@pytest.mark.parametrize("key,value,words", [
    ("qwen2.block_count", (3, VT.UINT32), "tensors for 2 layers"),      # more layers than the file has
    ("qwen2.block_count", (1, VT.UINT32), "tensors for 2 layers"),      # fewer
    ("qwen2.block_count", ("two", VT.STRING), "must be an integer"),
    ("qwen2.rope.freq_base", (0.0, VT.FLOAT32), "qwen2.rope.freq_base"),
    ("qwen2.rope.freq_base", (float("inf"), VT.FLOAT32), "qwen2.rope.freq_base"),
    ("qwen2.attention.layer_norm_rms_epsilon", (float("nan"), VT.FLOAT32), "layer_norm_rms_epsilon"),
    ("qwen2.attention.layer_norm_rms_epsilon", (-1e-6, VT.FLOAT32), "layer_norm_rms_epsilon"),
    ("qwen2.rope.dimension_count", (3, VT.UINT32), "rope.dimension_count"),          # odd
    ("qwen2.rope.dimension_count", (128, VT.UINT32), "rope.dimension_count"),        # more than a head has
    ("qwen2.attention.head_count_kv", (3, VT.UINT32), "not a multiple"),
    ("qwen2.attention.head_count", (0, VT.UINT32), "head_count"),
    ("qwen2.attention.head_count", ([4, 4, 4], (VT.ARRAY, VT.INT32)), "3 values for 2 layers"),
    ("qwen2.rope.scaling.type", ("sideways", VT.STRING), "rope.scaling.type"),
    ("qwen2.rope.scaling.factor", (-2.0, VT.FLOAT32), "rope.scaling.factor"),
    ("qwen2.expert_count", (100000, VT.UINT32), "expert_count"),
])
def test_impossible_hyper_parameters_are_one_clean_error(tmp_path, key, value, words):
    with pytest.raises(InvalidMetadata, match=words.replace(".", r"\.")):
        Model(variant(tmp_path, set={key: value}))


def test_architecture_keys_of_the_wrong_type(tmp_path):
    p = write_variant(TINY / "gemma2-Q8_0.gguf", tmp_path / "g.gguf",
                      set={"gemma2.attention.sliding_window": ("wide", VT.STRING)})
    with pytest.raises(InvalidMetadata, match="gemma2.attention.sliding_window"):
        Model(p)
    p = write_variant(TINY / "qwen3moe-Q8_0.gguf", tmp_path / "m.gguf", delete=("qwen3moe.expert_count",))
    with pytest.raises(MissingMetadata, match="expert_count"):
        Model(p)


def test_a_weight_of_an_integer_type_is_refused(tmp_path):
    with pytest.raises(ModelLoadError, match="blk.0.ffn_down.weight.*I32"):
        Model(variant(tmp_path, retype={"blk.0.ffn_down.weight": GGMLType.I32}))


def test_tokenizer_metadata_of_the_wrong_shape(tmp_path):
    for kw, words in [(dict(set={"tokenizer.ggml.pre": (["a", "b"], (VT.ARRAY, VT.STRING))}), "tokenizer.ggml.pre"),
                      (dict(set={"tokenizer.ggml.merges": ([1, 2], (VT.ARRAY, VT.INT32))}), "tokenizer.ggml.merges"),
                      (dict(set={"tokenizer.ggml.eos_token_id": ([2], (VT.ARRAY, VT.INT32))}), "eos_token_id"),
                      (dict(set={"tokenizer.ggml.add_bos_token": ("yes", VT.STRING)}), "add_bos_token"),
                      (dict(set={"tokenizer.ggml.model": ([1], (VT.ARRAY, VT.INT32))}), "tokenizer.ggml.model")]:
        with pytest.raises(VocabError, match=words.replace(".", r"\.")):
            Model(variant(tmp_path, **kw))


def test_an_spm_vocabulary_without_byte_tokens(tmp_path):
    """A byte-level BPE vocabulary read as SentencePiece's: no <0xNN> tokens to fall back on. It loads (as in
    llama.cpp); text it has no token for is a VocabError when tokenized."""
    m = Model(variant(tmp_path, set={"tokenizer.ggml.model": ("llama", VT.STRING)}))
    assert m.vocab.type == "spm" and not any(t.startswith("<0x") for t in m.vocab.tokens)
    with pytest.raises(VocabError, match="SPM vocabulary has no byte token for 0x"):
        m.vocab.tokenize("Hello\nworld")


def test_a_malformed_rwkv_vocabulary_does_not_loop(tmp_path):
    """A BPE vocabulary read as RWKV's: byte paths with no token on them (llama.cpp loops for ever there)."""
    m = Model(variant(tmp_path, set={"tokenizer.ggml.model": ("rwkv", VT.STRING)}))
    t0 = time.perf_counter()
    ids = m.vocab.tokenize("Hello world, Ünïcödé")
    assert ids and time.perf_counter() - t0 < 5


def test_a_byte_token_whose_text_is_no_byte(tmp_path):
    """token_to_piece reads a BYTE token's text as llama.cpp's strtol does: leading hex digits, else 0."""
    from llampy.gguf import GGUFReader
    with GGUFReader(QWEN2) as r:
        toks = r.metadata["tokenizer.ggml.tokens"]
        types = np.array(r.metadata["tokenizer.ggml.token_type"], dtype=np.int32)
    hexd = "0123456789abcdef"
    one = next(i for i, t in enumerate(toks) if len(t) > 5 and t[3] in hexd and t[4] not in hexd)  # 'Ġcabin': b
    none = next(i for i, t in enumerate(toks) if len(t) > 5 and t[3] not in hexd and i > 300)
    types[[one, none]] = 6                                 # normal tokens marked BYTE
    m = Model(variant(tmp_path, set={"tokenizer.ggml.model": ("llama", VT.STRING), "tokenizer.ggml.token_type": types}))
    assert m.vocab.token_to_piece(one) == bytes([int(toks[one][3], 16)])
    assert m.vocab.token_to_piece(none) == b"\x00"


def _fuzz(tmp_path, n, seed):
    made = make_files(tmp_path / "fuzz", n, seed=seed)
    desc = {str(p): d for p, d in made}
    res = run_files([p for p, _ in made], n_workers=2, timeout=120)
    assert len(res) == n
    bad = [f"{r['result']} on {desc[r['path']]}: {r['detail'][-600:]}" for r in res
           if not (r["result"] == "ok" or r["result"].startswith("llampy:"))]
    assert not bad, "\n".join(bad)
    counts = collections.Counter(r["result"].split(":")[0] for r in res)
    assert counts["ok"] > 0 and counts["llampy"] > 0        # the run did both: loaded some, refused some
    return res


def test_fuzzed_files_end_in_llampy_errors_or_a_working_model(tmp_path):
    _fuzz(tmp_path, 12, seed=22)


@pytest.mark.slow
def test_fuzzed_files_longer_run(tmp_path):
    _fuzz(tmp_path, 400, seed=2022)


def test_fuzz_mutations_are_reproducible_and_varied():
    src = fixture_paths()[0]
    a = [mutate_desc(src, i) for i in range(6)]
    assert a == [mutate_desc(src, i) for i in range(6)] and len(set(a)) > 3


def mutate_desc(src, i):
    from tests.fuzz_gguf import mutate
    return mutate(src, random.Random(f"x:{i}"))[1]
