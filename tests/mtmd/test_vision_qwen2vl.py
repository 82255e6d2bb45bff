"""The qwen2-VL projector (``qwen2vl_merger``) against llama.cpp's libmtmd on a tiny random-weight projector
(tests/fixtures/tiny_vision, make_tiny_qwen2vl.py): the image resized to whole 2x2 blocks of patches within the token
limits (letterboxed), the two patch kernels, the encoder's 2-D rope (ops.rope_multi, VISION), the merger; the chunk
layout (``<|vision_start|>`` ... ``<|vision_end|>``) beside the shared tiny qwen2; and the language model's side with
M-RoPE (a qwen2vl model: the image's tokens share one position and take their row and column, the text after it
continues max(rows, columns) on), its greedy continuation against llama.cpp's.

Tolerances: the PNGs are exact (the one that is letterboxed included; measured 0); the JPEG differs by its decoder
(libjpeg here, stb_image there): 6e-3 relative measured, 3e-2 allowed. Log-probs: measured 0.
"""
from __future__ import annotations

import base64
import hashlib
import json

import numpy as np
import pytest

pytest.importorskip("PIL")

from llampy.llama.batch import Batch
from llampy.llama.context import Context
from llampy.llama.model import Model
from llampy.mtmd import MtmdContext, ProjectorError, bitmap_from_file
from tests.paths import ROOT, SHARED

HERE = ROOT / "tests" / "fixtures" / "tiny_vision"
REF = json.loads((HERE / "qwen2vl.json").read_text())
LM = SHARED / REF["model"]
MMPROJ = HERE / REF["mmproj"]
TOL = {"photo40x36.jpg": 3e-2}


@pytest.fixture(scope="module")
def mctx():
    if not LM.exists():
        pytest.skip(f"{LM} not found (the shared tiny models)")
    assert hashlib.sha256(LM.read_bytes()).hexdigest() == REF["model_sha256"]
    assert hashlib.sha256(MMPROJ.read_bytes()).hexdigest() == REF["mmproj_sha256"]
    return MtmdContext(MMPROJ, Model(LM))


@pytest.mark.parametrize("name", list(REF["images"]))
def test_embeddings_and_layout_match_llamacpp(mctx, name):
    ent = REF["images"][name]
    assert hashlib.sha256((HERE / name).read_bytes()).hexdigest() == ent["sha256"]
    bm = bitmap_from_file(HERE / name)
    chunks = mctx.tokenize(ent["prompt"], [bm])
    layout = [{"type": "text", "tokens": c.tokens} if c.type == "text" else
              {"type": "image", "n_tokens": c.n_tokens, "n_pos": c.n_tokens} for c in chunks]
    assert layout == ent["chunks"]
    want = np.frombuffer(base64.b64decode(ent["embeddings"]), "<f4").reshape(-1, 64)
    got = mctx.encode(bm)
    assert got.shape == want.shape
    rel = np.abs(got - want).max() / np.abs(want).max()
    assert rel <= TOL.get(name, 0.0), f"{name}: embeddings differ by {rel:.2e} relative"


def test_other_types_and_odd_heads_are_refused(mctx, tmp_path):
    from llampy.gguf.reader import GGUFReader
    from llampy.gguf.writer import GGUFWriter

    def variant(path, **changes):
        r = GGUFReader(str(MMPROJ))
        w = GGUFWriter(str(path), r.alignment, r.version)
        for k, v in r.metadata.items():
            w.add(k, changes.get(k, v), r.value_types[k])
        for t in r.tensors.values():
            w.add_tensor_raw(t.name, t.type, t.ne, t.data)
        w.write()
        r.close()
        return path

    with pytest.raises(ProjectorError, match=r"unknown projector type: qwen3vl_merger \(a type llampy does not"):
        MtmdContext(variant(tmp_path / "q3.gguf", **{"clip.projector_type": "qwen3vl_merger"}), mctx.model)
    with pytest.raises(ProjectorError, match="'clip.vision.n_wa_pattern' is missing"):
        MtmdContext(variant(tmp_path / "q25.gguf", **{"clip.projector_type": "qwen2.5vl_merger"}), mctx.model)
    with pytest.raises(ProjectorError, match="head size 6 does not split"):
        MtmdContext(variant(tmp_path / "h2.gguf", **{"clip.vision.attention.head_count": 8}), mctx.model)


def test_qwen25vl_window_attention_matches_llamacpp(mctx, tmp_path):
    """qwen2.5-VL: RMS norms, gated SiLU FFN, block 0 within windows of 112 px (here 2x2 merged tokens: the 4x3
    image spans four windows, two cut short; its tokens regrouped window by window and back), block 1 full."""
    import importlib.util
    ent = REF["qwen25"]
    spec = importlib.util.spec_from_file_location("make_tiny_qwen2vl", HERE / "make_tiny_qwen2vl.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    path = tmp_path / "qwen25vl-mmproj.gguf"
    gen.write_mmproj(path, v25=True)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == ent["mmproj_sha256"]
    assert hashlib.sha256((HERE / ent["image"]).read_bytes()).hexdigest() == ent["sha256"]
    m = MtmdContext(path, mctx.model)
    try:
        bm = bitmap_from_file(HERE / ent["image"])
        chunks = m.tokenize(ent["prompt"], [bm])
        layout = [{"type": "text", "tokens": c.tokens} if c.type == "text" else
                  {"type": "image", "n_tokens": c.n_tokens, "n_pos": c.n_tokens} for c in chunks]
        assert layout == ent["chunks"]
        want = np.frombuffer(base64.b64decode(ent["embeddings"]), "<f4").reshape(-1, 64)
        got = m.encode(bm)
        assert got.shape == want.shape and np.abs(got - want).max() == 0.0
    finally:
        m.close()


def _greedy(mctx, gen):
    lm = mctx.model
    rt = REF["runtime"]
    ctx = Context(lm, n_ctx=rt["n_ctx"], n_batch=rt["n_batch"], n_ubatch=rt["n_ubatch"])
    chunks = mctx.tokenize(gen["prompt"], [bitmap_from_file(HERE / n) for n in gen["images"]])
    layout = [{"type": "text", "tokens": c.tokens} if c.type == "text" else
              {"type": "image", "n_tokens": c.n_tokens, "n_pos": c.n_pos} for c in chunks]
    assert layout == gen["chunks"]
    n_past = mctx.eval_chunks(ctx, chunks, 0, 0)
    assert n_past == gen["n_past"]
    worst = 0.0
    for k, step in enumerate(gen["steps"]):
        x = ctx.get_logits_ith(-1).astype(np.float64)
        lp = x - x.max() - np.log(np.exp(x - x.max()).sum())
        assert int(np.argmax(lp)) == step["id"], f"step {k}"
        worst = max(worst, max(abs(lp[t] - v) for t, v in step["top"]))
        ctx.decode(Batch.from_tokens([step["id"]], n_past + k))
    assert worst <= 1e-3, f"top log-probs differ by {worst:.2e}"


def test_greedy_continuation_with_normal_positions(mctx):
    _greedy(mctx, REF["generations"][0])


@pytest.fixture(scope="module")
def lm_vl_path(tmp_path_factory):
    import importlib.util
    if not LM.exists():
        pytest.skip(f"{LM} not found (the shared tiny models)")
    spec = importlib.util.spec_from_file_location("make_tiny_qwen2vl", HERE / "make_tiny_qwen2vl.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    path = tmp_path_factory.mktemp("qwen2vl") / "lm.gguf"
    gen.write_lm_vl(path)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == REF["model_vl_sha256"]
    return path, tuple(gen.SECTIONS)


@pytest.fixture(scope="module")
def mctx_vl(lm_vl_path):
    path, sections = lm_vl_path
    lm = Model(path)
    assert lm.hparams.n_pos_per_embd == 4 and lm.hparams.rope_sections == sections
    # llama.cpp 0.3.36's qwen2vl reads only the rope sections in load_arch_hparams (qwen2's reads the RMS norm's
    # epsilon): it runs with epsilon 0. llampy reads the file's; the comparison runs llampy as llama.cpp ran
    lm.hparams.f_norm_rms_eps = 0.0
    return MtmdContext(MMPROJ, lm)


@pytest.mark.parametrize("i", [0, 1], ids=["rect64x32", "wide45x27"])
def test_mrope_continuation_matches_llamacpp(mctx_vl, i):
    _greedy(mctx_vl, REF["generations_vl"][i])


def test_mrope_through_the_python_api(lm_vl_path):
    """Llama places a flat prompt's items by position (an image's tokens share one, the text after goes on from
    max(rows, columns)): llama.cpp's greedy tokens, and again with the image's cells reused from the cache."""
    from llampy.llama.api import Llama
    gen = REF["generations_vl"][0]
    rt = REF["runtime"]
    llm = Llama(str(lm_vl_path[0]), mmproj_path=str(MMPROJ), n_ctx=rt["n_ctx"], n_batch=rt["n_batch"],
                n_ubatch=rt["n_ubatch"], tune_process=False)
    llm.model.hparams.f_norm_rms_eps = 0.0          # as llama.cpp 0.3.36 runs qwen2vl (mctx_vl says why)
    chunks = llm.mtmd.tokenize(gen["prompt"], [bitmap_from_file(HERE / n) for n in gen["images"]])
    tokens = llm.mtmd.flatten(chunks)
    assert llm.mtmd.seq_pos(tokens, len(tokens)) == gen["n_past"]
    want = llm.vocab.detokenize(gen["ids"])
    for _ in range(2):
        out = llm.create_completion(tokens, max_tokens=len(gen["ids"]), temperature=0)
        assert out["choices"][0]["text"] == want
    assert llm.mtmd.n_encoded == 1


def test_mrope_through_the_server(lm_vl_path, monkeypatch):
    """The server's slots place their items by position as Llama does (an image's 12 tokens take 4 positions here):
    llama.cpp's greedy reply and log-probs for a chat request with an image through /v1/chat/completions, again
    with the slot's cells reused (the image not encoded again), and the raw prompt's through /completion's
    multimodal_data."""
    import httpx

    import llampy.server.app as app_mod
    from llampy.server.app import Server, create_app
    from tests.server.conftest import serve_in_thread

    def model_as_llamacpp_runs_it(*a, **kw):       # RMS epsilon 0, as llama.cpp 0.3.36 runs qwen2vl (mctx_vl)
        m = Model(*a, **kw)
        m.hparams.f_norm_rms_eps = 0.0
        return m

    monkeypatch.setattr(app_mod, "Model", model_as_llamacpp_runs_it)
    ref = REF["chat_vl"]
    server = Server(lm_vl_path[0], n_parallel=1, n_ctx=REF["runtime"]["n_ctx"], mmproj=MMPROJ, tune_process=False)
    url, uv, t = serve_in_thread(create_app(server))
    try:
        data = base64.b64encode((HERE / ref["images"][0]).read_bytes()).decode()
        data_url = "data:image/png;base64," + data
        msgs = [{"role": "user", "content": [{"type": "text", "text": "Look:"},
                                             {"type": "image_url", "image_url": {"url": data_url}},
                                             {"type": "text", "text": "What is it?"}]}]
        body = {"messages": msgs, "max_tokens": len(ref["ids"]), "temperature": 0, "logprobs": True, "top_logprobs": 1}
        want = server.model.vocab.detokenize(ref["ids"])
        n_prompt = sum(c["n_tokens"] if c["type"] == "image" else len(c["tokens"]) for c in ref["chunks"])
        for turn in range(2):
            j = httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()
            assert j["choices"][0]["message"]["content"] == want, f"turn {turn}"
            got_lp = [c["logprob"] for c in j["choices"][0]["logprobs"]["content"]]
            assert np.allclose(got_lp, [s["logprob"] for s in ref["steps"]], atol=1e-3), f"turn {turn}"
            assert j["usage"]["prompt_tokens"] == n_prompt
        assert j["usage"]["prompt_tokens_details"]["cached_tokens"] == n_prompt - 1
        assert server.mtmd.n_encoded == 1
        gen = REF["generations_vl"][0]
        png = base64.b64encode((HERE / gen["images"][0]).read_bytes()).decode()
        body = {"prompt": {"prompt_string": gen["prompt"], "multimodal_data": [png]}, "n_predict": len(gen["ids"]),
                "temperature": 0, "n_probs": 1}
        j = httpx.post(url + "/completion", json=body, timeout=120).json()
        assert [p["id"] for p in j["completion_probabilities"]] == gen["ids"]
        got_lp = [p["logprob"] for p in j["completion_probabilities"]]
        assert np.allclose(got_lp, [s["logprob"] for s in gen["steps"]], atol=1e-3)
    finally:
        uv.should_exit = True
        t.join(timeout=5)
        server.engine.stop()


def test_mrope_position_shift_is_refused(mctx_vl):
    from llampy.llama.context import ContextError
    ctx = Context(mctx_vl.model, n_ctx=64, n_batch=64, n_ubatch=64)
    ctx.decode(Batch.from_tokens([1, 2, 3], 0))
    with pytest.raises(ContextError, match="not supported with M-RoPE"):
        ctx.seq_add(0, 1, 3, -1)
