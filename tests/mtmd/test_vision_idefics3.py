"""The idefics3 (SmolVLM) projector against llama.cpp's libmtmd on a tiny random-weight projector
(tests/fixtures/tiny_vision, make_tiny_idefics3.py): the image cut into tiles plus an overview, the chunk layout
around them (``<fake_token_around_image><row_r_col_c>`` before each tile, a newline between rows, the overview
between ``\\n\\n<fake_token_around_image><global-img>`` and ``<fake_token_around_image>``), every chunk's embeddings
(pixel shuffle, then the projection), and the greedy continuation with its top log-probs through the low-level
path, the Python API and the server.

The language model is the shared tiny llama with SmolVLM's image tokens added to its vocabulary, built here into the
test's temporary directory (the same bytes the references were recorded on: the sha256 is checked).

Tolerances: PNGs are exact, resized ones included (llampy's resize is llama.cpp's resize_pillow in the same
integers; measured 0 in every embedding and log-prob). A JPEG is decoded by libjpeg (Pillow) here and stb_image
there: a level or two per pixel, 7e-3 relative in the embeddings (limit 3e-2).
"""
from __future__ import annotations

import base64
import hashlib
import importlib.util
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
REF = json.loads((HERE / "idefics3.json").read_text())
MMPROJ = HERE / REF["mmproj"]
N_EMBD = 64
TOL = {"photo40x36.jpg": 3e-2}          # relative; every other image: exact


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _gen_module():
    spec = importlib.util.spec_from_file_location("make_tiny_idefics3", HERE / "make_tiny_idefics3.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    gen = _gen_module()
    if not gen.BASE_LM.exists():
        pytest.skip(f"{gen.BASE_LM} not found (the shared tiny models)")
    d = tmp_path_factory.mktemp("idefics3")
    lm_path, old = d / "lm.gguf", d / "mmproj-no-preproc.gguf"
    gen.write_lm(lm_path)
    gen.write_mmproj(old, preproc=False)
    assert _sha(lm_path) == REF["model_sha256"] and _sha(old) == REF["mmproj_no_preproc_sha256"]
    assert _sha(MMPROJ) == REF["mmproj_sha256"]
    return gen, lm_path, old


@pytest.fixture(scope="module")
def lm(built):
    return Model(built[1])


@pytest.fixture(scope="module")
def mctx(lm):
    return MtmdContext(MMPROJ, lm)


def _layout(chunks):
    return [{"type": "text", "tokens": c.tokens} if c.type == "text" else
            {"type": "image", "n_tokens": c.n_tokens, "n_pos": c.n_tokens} for c in chunks]


def _check_embeddings(m, name, ent, tol):
    bm = bitmap_from_file(HERE / name)
    chunks = m.tokenize("<__media__>", [bm])
    assert _layout(chunks) == ent["chunks"]
    images = [c for c in chunks if c.type == "image"]
    assert len(images) == len(ent["embeddings"])
    for c, b64 in zip(images, ent["embeddings"]):
        want = np.frombuffer(base64.b64decode(b64), "<f4").reshape(-1, N_EMBD)
        got = m.encode(bm, c.entry)
        rel = np.abs(got - want).max() / np.abs(want).max()
        assert rel <= tol, f"{name} chunk of entry {c.entry}: embeddings differ by {rel:.2e} relative"


@pytest.mark.parametrize("name", list(REF["images"]))
def test_tiles_layout_and_embeddings_match_llamacpp(mctx, name):
    ent = REF["images"][name]
    assert _sha(HERE / name) == ent["sha256"]
    _check_embeddings(mctx, name, ent, TOL.get(name, 0.0))


def test_projector_without_preprocessor_size(built, lm):
    """Files without clip.vision.preproc_image_size: llava-uhd's tiling (the size rounded to whole tiles,
    letterboxed, bicubic; the overview from the original image)."""
    m = MtmdContext(built[2], lm)
    try:
        for name, ent in REF["no_preproc"].items():
            _check_embeddings(m, name, ent, 0.0)
    finally:
        m.close()


def test_two_images_layout_matches_llamacpp(mctx):
    gen = REF["generations"][2]
    chunks = mctx.tokenize(gen["prompt"], [bitmap_from_file(HERE / n) for n in gen["images"]])
    assert _layout(chunks) == gen["chunks"]
    assert sum(c.n_tokens for c in chunks) == gen["n_past"]


@pytest.mark.parametrize("gen", REF["generations"][:2], ids=lambda g: "+".join(g["images"]))
def test_greedy_continuation_matches_llamacpp(lm, mctx, gen):
    rt = REF["runtime"]
    ctx = Context(lm, n_ctx=rt["n_ctx"], n_batch=rt["n_batch"], n_ubatch=rt["n_ubatch"])
    chunks = mctx.tokenize(gen["prompt"], [bitmap_from_file(HERE / n) for n in gen["images"]])
    assert _layout(chunks) == gen["chunks"]
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


def _messages():
    data = base64.b64encode((HERE / REF["chat"]["images"][0]).read_bytes()).decode()
    return [{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                         {"type": "image_url", "image_url": {"url": "data:image/png;base64," + data}}]}]


def test_python_api_and_server_chat(built):
    """The chat reference through Llama(mmproj_path=...) and through the server's /v1/chat/completions."""
    import httpx

    from llampy.llama.api import Llama
    from llampy.server.app import Server, create_app
    from tests.server.conftest import serve_in_thread

    ref = REF["chat"]
    llm = Llama(str(built[1]), mmproj_path=str(MMPROJ), n_ctx=REF["runtime"]["n_ctx"], verbose=False)
    r = llm.create_chat_completion(_messages(), max_tokens=len(ref["ids"]), temperature=0)
    want = llm.model.vocab.detokenize(ref["ids"])
    assert r["choices"][0]["message"]["content"] == want

    server = Server(built[1], n_parallel=1, n_ctx=REF["runtime"]["n_ctx"], mmproj=MMPROJ)
    url, uv, t = serve_in_thread(create_app(server))
    try:
        body = {"messages": _messages(), "max_tokens": len(ref["ids"]), "temperature": 0, "logprobs": True,
                "top_logprobs": 1}
        j = httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()
        assert j["choices"][0]["message"]["content"] == want
        got_lp = [c["logprob"] for c in j["choices"][0]["logprobs"]["content"]]
        assert np.allclose(got_lp, [s["logprob"] for s in ref["steps"]], atol=1e-3)
    finally:
        uv.should_exit = True
        t.join(timeout=5)
        server.engine.stop()


def test_vocabulary_without_the_image_tokens_is_refused(built, tmp_path):
    """A language model whose vocabulary spells no <global-img>: refused at load, naming the token (llama.cpp would
    put token -1 in the prompt)."""
    plain = Model(built[0].BASE_LM)
    with pytest.raises(ProjectorError, match="no token for '<fake_token_around_image>', '<global-img>'"):
        MtmdContext(MMPROJ, plain)


def test_missing_scale_factor_is_refused(built, lm, tmp_path):
    from llampy.gguf.reader import GGUFReader
    from llampy.gguf.writer import GGUFWriter

    r = GGUFReader(str(MMPROJ))
    w = GGUFWriter(str(tmp_path / "no-scale.gguf"), r.alignment, r.version)
    for k, v in r.metadata.items():
        if k != "clip.vision.projector.scale_factor":
            w.add(k, v, r.value_types[k])
    for t in r.tensors.values():
        w.add_tensor_raw(t.name, t.type, t.ne, t.data)
    w.write()
    r.close()
    with pytest.raises(ProjectorError, match="'clip.vision.projector.scale_factor' is missing"):
        MtmdContext(tmp_path / "no-scale.gguf", lm)


def test_cli_run_with_an_image(built, capsys):
    from llampy.cli import main
    gen = REF["generations"][0]
    args = ["run", str(built[1]), "--mmproj", str(MMPROJ), "-p", gen["prompt"], "-n", str(len(gen["ids"])),
            "--temp", "0", "-c", str(REF["runtime"]["n_ctx"]), "--json", "--image", str(HERE / gen["images"][0])]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == gen["ids"]
