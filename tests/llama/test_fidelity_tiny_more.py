"""More architectures against llama.cpp: the tiny random-weight models of tests/fixtures/tiny_more (README there).
Each GGUF is written by make_tiny_more.py when absent (deterministic; its sha256 must be the one llama.cpp ran on).
Decoders: teacher-forced log-probs, greedy ids up to the first near-tie, perplexity. Encoders: embeddings under
each pooling type."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest

from llampy.ggml.backends.cpu import simd
from llampy.llama.batch import Batch
from llampy.llama.context import Context
from llampy.llama.model import Model
from llampy.llama.perplexity import perplexity

from tests.paths import TINY

HERE = Path(__file__).resolve().parents[1] / "fixtures" / "tiny_more"
# mixtures of experts, within the CI budget: teacher-forced log-probs on every prompt, greedy decoding on the first
# (its first steps: the one-row decode path);
# perplexity (128-token batches: ggml's tiled attention) on the first chunk of each listed in MOE_PPL, against
# llama.cpp's running value
MOE = ["mixtral", "qwen2moe", "qwen3moe", "olmoe", "granitemoe", "gpt-oss", "deepseek2", "deepseek2-legacy",
       "deepseek2-ocr",
       "mistral4", "llama4"]
# second configurations (make_tiny_more.py's SECOND): teacher-forced log-probs on every prompt; no greedy run or
# perplexity (CI time). Their heads are under 32: there ggml's F16 Q·K order is the same in AVX2 and AVX-512 builds
# (the records come from an AVX2 build; llampy keeps AVX-512's order by default)
SECOND = ["phi2-b", "olmo2-b", "smollm3-b", "exaone-b", "internlm2-b", "command-r-b", "cohere2-b", "mistral3-b",
          "mixtral-b", "qwen2moe-b", "olmoe-b", "granitemoe-b", "gpt-oss-b", "llama4-b"]
# records llampy matches only in the float order of the build that recorded them (these: AVX2; llampy's default is
# AVX-512's, LLAMPY_FLOAT_ORDER=avx2 gives AVX2's; run them so, with a NUMBA_CACHE_DIR of their own): heads of 32 (see
# SECOND), and the 128-token batches (perplexity) of gemma3n and mistral4 -- measured exact under avx2, 0.017 and
# 0.0024 off in ln PPL under the default
ORDER_ONLY = ["gpt-oss-h32"]
ORDER_ONLY_PPL = ["gemma3n", "mistral4"]
DECODERS = ["phi2", "olmo2", "smollm3", "exaone", "internlm2", "command-r", "cohere2", "mistral3"] + MOE + SECOND \
    + ORDER_ONLY
SHORT = set(MOE) | set(SECOND) | set(ORDER_ONLY)
MOE_PPL = {"mixtral", "qwen2moe", "qwen3moe", "olmoe", "granitemoe", "gpt-oss", "deepseek2", "llama4", "gpt-oss-h32"}
MOE_PPL_CHUNKS = 1
MOE_GREEDY_STEPS = 4
ENCODERS = ["bert", "nomic-bert", "jina-bert-v2", "bert-b", "nomic-bert-b", "jina-bert-v2-b"]
TOL = 1e-3
MARGIN = 0.05


def _maker():
    spec = importlib.util.spec_from_file_location("make_tiny_more", HERE / "make_tiny_more.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tiny_more_model(name: str) -> tuple[Path, dict]:
    """The model's path (written now if absent) and llama.cpp's references on it."""
    ref = json.loads((HERE / f"{name}.json").read_text())
    path = HERE / f"{name}.gguf"
    if not path.exists():
        fd, tmp = tempfile.mkstemp(suffix=".gguf", dir=HERE)
        os.close(fd)
        _maker().write_model(name, Path(tmp))
        os.replace(tmp, path)      # atomic: a concurrent test sees the whole file or none
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == ref["sha256"], (f"{path.name} is not the file llama.cpp's outputs were recorded on: delete it, or "
                                     f"re-record with make_tiny_more.py")
    return path, ref


def skip_unless_recorded_order(name: str) -> None:
    """Skip unless llampy sums in the float order of the llama.cpp build that recorded ``name`` (its system_info)."""
    info = json.loads((HERE / f"{name}.json").read_text())["runtime"]["system_info"]
    lanes = 16 if "AVX512 = 1" in info else 8
    if simd.F16_VEC_LANES != lanes:
        pytest.skip(f"recorded in the float order of {lanes}-lane F16 vectors; llampy sums in {simd.F16_VEC_LANES} "
                    f"(LLAMPY_FLOAT_ORDER={'avx2' if lanes == 8 else 'avx512'} runs it)")


def log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


@pytest.fixture(scope="module", params=DECODERS)
def decoder(request):
    if request.param in ORDER_ONLY:
        skip_unless_recorded_order(request.param)
    path, ref = tiny_more_model(request.param)
    return request.param, Model(path), ref


def test_tokenize_prompts(decoder):
    name, model, ref = decoder
    for p in ref["prompts"]:
        assert model.vocab.tokenize(p["prompt"], add_special=True, parse_special=True) == p["prompt_ids"]


def test_teacher_forced_logprobs(decoder):
    name, model, ref = decoder
    worst = 0.0
    ctx = Context(model, n_ctx=256, n_batch=256, n_ubatch=256)
    for p in ref["prompts"]:
        ctx.kv_clear()
        ctx.decode(Batch.from_tokens(p["prompt_ids"] + p["ids"], logits_all=True, pos0=ref.get("pos0", 0)))
        lp = log_softmax(ctx.get_logits())
        n_p = len(p["prompt_ids"])
        for k, step in enumerate(p["steps"]):
            row = lp[n_p - 1 + k]
            worst = max(worst, max(abs(row[tid] - ref_lp) for tid, ref_lp in step["top"]))
            top = step["top"]
            if top[0][1] - top[1][1] > MARGIN:
                assert int(np.argmax(row)) == step["id"], f"{name} step {k}: argmax differs"
    assert worst <= TOL, f"{name}: max |dlogprob| {worst:.4f} > {TOL}"


def test_greedy_free_running(decoder):
    name, model, ref = decoder
    if name in SECOND:
        pytest.skip("teacher-forced log-probs check this second configuration (CI time)")
    for p in ref["prompts"][:1] if name in SHORT else ref["prompts"]:
        steps = p["steps"][:MOE_GREEDY_STEPS] if name in SHORT else p["steps"]
        ctx = Context(model, n_ctx=256)
        pos0 = ref.get("pos0", 0)      # llama4's prompts start before its chunk boundary at 8192
        ctx.decode(Batch.from_tokens(p["prompt_ids"], pos0=pos0))
        pos = pos0 + len(p["prompt_ids"])
        for k, step in enumerate(steps):
            top = step["top"]
            if top[0][1] - top[1][1] <= MARGIN:
                break  # a near-tie: beyond it the two continuations may rightly part
            tok = int(np.argmax(ctx.get_logits_ith(-1)))
            assert tok == p["ids"][k], f"{name} prompt {p['prompt'][:20]!r} step {k}"
            ctx.decode(Batch.from_tokens([tok], pos0=pos))
            pos += 1


@pytest.mark.slow
def test_perplexity(decoder):
    name, model, ref = decoder
    pp = ref["perplexity"]
    text = (TINY / "seed004_first6000.txt").read_text(encoding="utf-8")
    if name in SHORT and name not in MOE_PPL:
        pytest.skip("teacher-forced log-probs check this model (CI time)")
    if name in SHORT:    # llama.cpp's running perplexity after the first chunks
        res = perplexity(model, text, n_ctx=pp["n_ctx"], n_batch=pp["n_batch"], max_chunks=MOE_PPL_CHUNKS)
        want = np.log(pp["chunks"][MOE_PPL_CHUNKS - 1])
        assert len(res.chunks) == MOE_PPL_CHUNKS
        assert abs(res.nll - want) <= 0.005, f"{name}: ln PPL {res.nll:.5f} vs {want:.5f}"
        return
    res = perplexity(model, text, n_ctx=pp["n_ctx"], n_batch=pp["n_batch"])
    assert len(res.chunks) == len(pp["chunks"])
    assert abs(res.nll - pp["nll"]) <= 0.005, f"{name}: ln PPL {res.nll:.5f} vs {pp['nll']:.5f}"


@pytest.mark.slow
@pytest.mark.parametrize("name", ORDER_ONLY_PPL)
def test_perplexity_in_the_recorded_order(name):
    skip_unless_recorded_order(name)
    path, ref = tiny_more_model(name)
    pp = ref["perplexity"]
    text = (TINY / "seed004_first6000.txt").read_text(encoding="utf-8")
    res = perplexity(Model(path), text, n_ctx=pp["n_ctx"], n_batch=pp["n_batch"], max_chunks=MOE_PPL_CHUNKS)
    want = np.log(pp["chunks"][MOE_PPL_CHUNKS - 1])
    assert abs(res.nll - want) <= 0.005, f"{name}: ln PPL {res.nll:.5f} vs {want:.5f}"


# ------------------------------------------------------------------------------------------------ encoders
@pytest.fixture(scope="module", params=ENCODERS)
def encoder(request):
    path, ref = tiny_more_model(request.param)
    return request.param, Model(path), ref


def _cos(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize("pooling", ["none", "mean", "cls", "last", "rank"])
def test_encoder_embeddings(encoder, pooling):
    name, model, ref = encoder
    if pooling == "rank" and ref["arch"] == "nomic-bert":
        pytest.skip("nomic-bert has no classification head")
    ctx = Context(model, n_ctx=256, n_batch=256, n_ubatch=256, embeddings=True, pooling=pooling)
    for p in ref["prompts"]:
        assert model.vocab.tokenize(p["prompt"], add_special=True, parse_special=True) == p["prompt_ids"]
        ctx.decode(Batch.from_tokens(p["prompt_ids"], logits_all=True))
        want = p["embeddings"][pooling]
        if pooling == "none":
            got = [ctx.get_embeddings_ith(i) for i in range(len(p["prompt_ids"]))]
            for g, w in zip(got, want):
                assert 1 - _cos(g, w) <= 1e-3 and np.allclose(g, w, atol=1e-4), name
        elif pooling == "rank":
            got = ctx.get_embeddings_seq(0)
            assert np.allclose(got, want, atol=1e-3), f"{name}: score {got} vs llama.cpp {want}"
        else:
            got = ctx.get_embeddings_seq(0)
            assert 1 - _cos(got, want) <= 1e-3 and np.allclose(got, want, atol=1e-4), name


def test_encoder_rerank_pairs(encoder):
    """llama-server's rerank pairs ([CLS] query [SEP] document) scored by rank pooling, as llama.cpp scored them."""
    name, model, ref = encoder
    if "rerank" not in ref:
        pytest.skip("no classification head")
    ctx = Context(model, n_ctx=256, n_batch=256, n_ubatch=256, embeddings=True, pooling="rank")
    for toks, want in zip(ref["rerank"]["tokens"], ref["rerank"]["scores"]):
        ctx.decode(Batch.from_tokens(toks, logits_all=True))
        assert abs(float(ctx.get_embeddings_seq(0)[0]) - want) <= 1e-3


def test_encoder_sequences_in_one_batch_do_not_see_each_other(encoder):
    """Two prompts decoded together give each its own embedding (the mask keeps sequences apart)."""
    name, model, ref = encoder
    ctx = Context(model, n_ctx=256, n_batch=256, n_ubatch=256, n_seq_max=2, embeddings=True, pooling="mean")
    a, b = ref["prompts"][0]["prompt_ids"], ref["prompts"][1]["prompt_ids"]
    batch = Batch(np.array(a + b, np.int32), np.array(list(range(len(a))) + list(range(len(b))), np.int32),
                  [[0]] * len(a) + [[1]] * len(b), np.ones(len(a) + len(b), bool))
    ctx.decode(batch)
    for s, p in enumerate(ref["prompts"][:2]):
        assert 1 - _cos(ctx.get_embeddings_seq(s), p["embeddings"]["mean"]) <= 1e-3


def test_encoder_needs_embeddings_context(encoder):
    name, model, ref = encoder
    with pytest.raises(ValueError, match="embeddings=True"):
        Context(model, n_ctx=64)


def test_rank_needs_a_classification_head():
    path, _ = tiny_more_model("olmo2")
    with pytest.raises(ValueError, match="classification head"):
        Context(Model(path), n_ctx=64, embeddings=True, pooling="rank")


def test_llama_api_embeds_with_the_files_pooling():
    """Llama(embedding=True) on an encoder: the file's pooling_type (bert: mean, nomic-bert: cls) unless asked."""
    from llampy.llama.api import Llama
    for name, pooling in (("bert", "mean"), ("nomic-bert", "cls")):
        path, ref = tiny_more_model(name)
        texts = [p["prompt"] for p in ref["prompts"]]
        for asked, want_pool in ((None, pooling), ("last", "last")):
            llm = Llama(str(path), n_ctx=128, embedding=True, pooling=asked, tune_process=False)
            for e, p in zip(llm.embed(texts), ref["prompts"]):
                assert abs(np.linalg.norm(e) - 1) < 1e-6
                assert _cos(e, p["embeddings"][want_pool]) >= 1 - 1e-3, (name, asked)


def test_cli_embed(capsys):
    """`llampy embed` (llama-embedding): the file's pooling, euclidean-normalised, OpenAI's JSON; rank scores."""
    from llampy.cli import main
    path, ref = tiny_more_model("bert")
    texts = [p["prompt"] for p in ref["prompts"]]
    assert main(["embed", str(path), "-p", "\n".join(texts), "--embd-output-format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)["data"]
    assert len(data) == len(texts)
    for d, p in zip(data, ref["prompts"]):
        assert abs(np.linalg.norm(d["embedding"]) - 1) < 1e-9
        assert _cos(d["embedding"], p["embeddings"]["mean"]) >= 1 - 1e-3
    assert main(["embed", str(path), "-p", texts[0], "--pooling", "rank"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("rerank score 0:") and abs(float(line.split()[-1]) - ref["prompts"][0]["embeddings"]["rank"][0]) < 1e-3


@pytest.mark.parametrize("name, drop, add, match", [
    ("cohere2", "cohere2.logit_scale", {}, "cohere2.logit_scale"),
    ("cohere2", "cohere2.attention.sliding_window", {}, "cohere2.attention.sliding_window"),
    ("bert", "tokenizer.ggml.token_type_count", {}, "token type count"),
    ("deepseek2", "deepseek2.attention.key_length_mla", {}, "key_length_mla and value_length_mla"),
    ("deepseek2", "deepseek2.expert_group_used_count", {"deepseek2.expert_group_used_count": 4},
     "expert_group_count"),
    ("llama4", "llama4.interleave_moe_layer_step", {}, "interleave_moe_layer_step"),
    ("deepseek2-ocr", "deepseek2-ocr.rope.freq_base", {"deepseek2-ocr.rope.freq_base": 500000.0}, "requires 10000"),
])
def test_load_refuses_what_llama_cpp_refuses(tmp_path, name, drop, add, match):
    from llampy.gguf import GGUFReader
    from llampy.gguf.writer import GGUFWriter
    path, _ = tiny_more_model(name)
    r = GGUFReader(path)
    w = GGUFWriter(tmp_path / "m.gguf")
    for k, v in r.metadata.items():
        if k != drop:
            w.add(k, v, r.value_types[k])
    for k, v in add.items():
        w.add(k, v)
    for t in r.tensors.values():
        w.add_tensor_raw(t.name, t.type, t.ne, t.data)
    w.write()
    with pytest.raises(ValueError, match=match):
        Model(tmp_path / "m.gguf")


def test_decoder_reranker():
    """A Qwen3 Reranker-shaped model: rank pooling is the softmax of cls.output over the last token of each pair
    (laid out by the file's rerank template), as llama.cpp computes it."""
    from llampy.server.rerank import rerank_tokens
    path, ref = tiny_more_model("qwen3-rerank")
    model = Model(path)
    rr = ref["rerank"]
    ctx = Context(model, n_ctx=256, n_batch=256, n_ubatch=256, embeddings=True, pooling="rank")
    for doc, toks, probs in zip(rr["documents"], rr["tokens"], rr["probs"]):
        assert rerank_tokens(model.vocab, model.metadata, rr["query"], doc) == toks
        ctx.kv_clear()
        ctx.decode(Batch.from_tokens(toks, logits_all=True))
        assert np.allclose(ctx.get_embeddings_seq(0), probs, atol=1e-4)
