"""The gemma3 projector against llama.cpp's libmtmd on a tiny random-weight projector (tests/fixtures/tiny_vision):
the image embeddings, the chunk layout of prompts with images, and the greedy continuation with its top log-probs
after the image chunks are decoded (non-causally) into the shared tiny gemma3 language model.

Tolerances: the image at the encoder's size and the one letterboxed (resized as llama.cpp's resize_pillow, in the
same integers) are exact (target: 1e-4 relative, 1e-3 in log-probs; measured 0 in both): the encoder's 64 patches
take ggml's tiled flash attention, which llampy runs in its float order (cpu/attention_tiled.py), as it does at a
realistic patch count (1024, gemma3-large.json). A JPEG is decoded by libjpeg (Pillow) here and stb_image there,
whose IDCT and chroma upsampling differ by a level or two per pixel: 3e-3 relative in the embeddings, the first
tokens equal.
"""
from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import struct
import zlib

import numpy as np
import pytest

pytest.importorskip("PIL")

from llampy.llama.batch import Batch
from llampy.llama.context import Context
from llampy.llama.model import Model
from llampy.mtmd import ImageError, MediaError, MtmdContext, ProjectorError, bitmap_from_bytes, bitmap_from_file
from tests.paths import ROOT, SHARED

HERE = ROOT / "tests" / "fixtures" / "tiny_vision"
REF = json.loads((HERE / "gemma3.json").read_text())

LM = SHARED / REF["model"]

# name -> (embeddings relative tolerance, log-prob tolerance, greedy tokens that must agree)
# llampy reproduces the AVX-512 build's float order by default (simd.F16_VEC_LANES); against these references,
# recorded on an AVX2 host, that order's last-bit differences in the encoder's sums grow to ~1.5e-5 in the
# embeddings and ~0.25 in a log-prob of the continuation, and the tolerances cover that (both 0 with
# LLAMPY_FLOAT_ORDER=host on the recording host).
TOL = {"square32.png": (5e-4, 0.3, 8), "wide45x27.png": (5e-4, 0.3, 8), "photo40x36.jpg": (1e-2, None, 3)}


def _gen_module():
    spec = importlib.util.spec_from_file_location("make_tiny_vision", HERE / "make_tiny_vision.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def lm():
    if not LM.exists():
        pytest.skip(f"{LM} not found (the shared tiny models)")
    assert hashlib.sha256(LM.read_bytes()).hexdigest() == REF["model_sha256"]
    return Model(LM)


@pytest.fixture(scope="module")
def mctx(lm):
    path = HERE / REF["mmproj"]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == REF["mmproj_sha256"]
    return MtmdContext(path, lm)


def _log_softmax(x):
    x = x.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


@pytest.mark.parametrize("name", list(TOL))
def test_image_embeddings_match_llamacpp(mctx, name):
    ent = REF["images"][name]
    assert hashlib.sha256((HERE / name).read_bytes()).hexdigest() == ent["sha256"]
    got = mctx.encode(bitmap_from_file(HERE / name))
    want = np.array(ent["embeddings"], np.float32)
    assert got.shape == want.shape == (16, 64)
    rel = np.abs(got - want).max() / np.abs(want).max()
    assert rel <= TOL[name][0], f"{name}: embeddings differ by {rel:.2e} relative"


@pytest.mark.parametrize("gen", REF["generations"], ids=lambda g: "+".join(g["images"]))
def test_chunk_layout_matches_llamacpp(mctx, gen):
    chunks = mctx.tokenize(gen["prompt"], [bitmap_from_file(HERE / n) for n in gen["images"]])
    layout = [{"type": "text", "tokens": c.tokens} if c.type == "text" else
              {"type": "image", "n_tokens": c.n_tokens, "n_pos": c.n_tokens} for c in chunks]
    assert layout == gen["chunks"]
    assert sum(c.n_tokens for c in chunks) == gen["n_past"]


@pytest.fixture(scope="module")
def lm_ctx(lm):
    rt = REF["runtime"]
    return Context(lm, n_ctx=rt["n_ctx"], n_batch=rt["n_batch"], n_ubatch=rt["n_ubatch"])


# the exact image, and the letterboxed one (the JPEG's and the two-image prompt's tokens: the CLI and server tests)
@pytest.mark.parametrize("gen", REF["generations"][:2], ids=lambda g: "+".join(g["images"]))
def test_greedy_continuation_matches_llamacpp(lm_ctx, mctx, gen):
    ctx = lm_ctx
    ctx.kv_clear()
    chunks = mctx.tokenize(gen["prompt"], [bitmap_from_file(HERE / n) for n in gen["images"]])
    n_past = mctx.eval_chunks(ctx, chunks, 0, 0)
    assert n_past == gen["n_past"]
    assert ctx.causal_attn                 # restored after the image chunks
    _, lp_tol, n_equal = max((TOL[n] for n in gen["images"]), key=lambda t: t[0])
    worst = 0.0
    for k, step in enumerate(gen["steps"]):
        lp = _log_softmax(ctx.get_logits_ith(-1))
        if k < n_equal:
            assert int(np.argmax(lp)) == step["id"], f"step {k}"
        worst = max(worst, max(abs(lp[t] - v) for t, v in step["top"]))
        ctx.decode(Batch.from_tokens([step["id"]], n_past + k))       # llama.cpp's token, so the steps stay aligned
    assert worst <= lp_tol, f"top log-probs differ by {worst:.2e}"


def test_1024_patches_match_llamacpp(lm, tmp_path):
    """A realistic patch count (1024, as in a 512-px SmolVLM tile) and head size (72, SigLIP's): the encoder's
    attention takes ggml's tiled path (16 x 16 tiles of 64 queries and 64 cells), which llampy runs in ggml's float
    order, with clip.cpp's float32 kq_scale: libmtmd's embeddings bit for bit."""
    ref = json.loads((HERE / "gemma3-large.json").read_text())
    path = tmp_path / "gemma3-large-mmproj.gguf"
    _gen_module().write_mmproj(path, **ref["spec"])
    assert hashlib.sha256(path.read_bytes()).hexdigest() == ref["mmproj_sha256"]
    assert hashlib.sha256((HERE / ref["image"]).read_bytes()).hexdigest() == ref["sha256"]
    m = MtmdContext(path, lm)
    try:
        got = m.encode(bitmap_from_file(HERE / ref["image"]))
    finally:
        m.close()
    want = np.frombuffer(base64.b64decode(ref["embeddings"]), "<f4").reshape(got.shape)
    rel = np.abs(got - want).max() / np.abs(want).max()
    # 0 in the recording build's float order; the default (AVX-512) order leaves ~1.5e-4 (TOL's comment)
    assert rel <= 5e-4, f"embeddings differ by {rel:.2e} relative"


def test_same_image_bytes_are_encoded_once(lm):
    m = MtmdContext(HERE / REF["mmproj"], lm)
    a = m.encode(bitmap_from_file(HERE / "square32.png"))
    b = m.encode(bitmap_from_bytes((HERE / "square32.png").read_bytes()))
    assert m.n_encoded == 1 and a is b


def test_markers_and_images_must_agree(mctx):
    bm = bitmap_from_file(HERE / "square32.png")
    with pytest.raises(MediaError, match=r"number of media markers in text \(2\) does not match number of images \(1\)"):
        mctx.tokenize("a <__media__> b <__media__>", [bm])
    with pytest.raises(MediaError, match=r"\(0\) does not match number of images \(1\)"):
        mctx.tokenize("no marker", [bm])


def test_image_larger_than_the_batch_is_refused(lm, mctx):
    chunks = mctx.tokenize("<__media__>", [bitmap_from_file(HERE / "square32.png")])
    ctx = Context(lm, n_ctx=64, n_batch=8, n_ubatch=8)
    with pytest.raises(MediaError, match="an image of 16 tokens does not fit in one batch"):
        mctx.eval_chunks(ctx, chunks, 0, 0)
    assert ctx.causal_attn


def _png_header(w, h) -> bytes:
    """A PNG that declares w x h pixels and holds almost none."""
    def chunk(t, d):
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))


def test_bad_image_bytes():
    with pytest.raises(ImageError, match="failed to decode image"):
        bitmap_from_bytes(b"this is not an image at all")
    with pytest.raises(ImageError, match="failed to decode image"):
        bitmap_from_bytes((HERE / "square32.png").read_bytes()[:60])          # a truncated PNG
    with pytest.raises(ImageError, match=r"image too large: 9000x9000 pixels declared"):
        bitmap_from_bytes(_png_header(9000, 9000))                           # decompression bombs: 243 MB of RGB
    with pytest.raises(ImageError, match=r"image too large: its declared size exceeds"):
        bitmap_from_bytes(_png_header(100000, 100000))


def test_projector_for_another_model_or_type(lm, tmp_path):
    gen = _gen_module()
    wrong = tmp_path / "wrong-width.gguf"
    gen.write_mmproj(wrong, n_text=32)
    with pytest.raises(ProjectorError, match=r"mismatch between text model \(n_embd = 64\) and mmproj \(n_embd = 32\)"):
        MtmdContext(wrong, lm)
    other = tmp_path / "pixtral.gguf"
    gen.write_mmproj(other, proj_type="pixtral")
    with pytest.raises(ProjectorError, match="unknown projector type: pixtral"):
        MtmdContext(other, lm)
    with pytest.raises(ProjectorError, match="projector file not found: .*absent.gguf"):
        MtmdContext(tmp_path / "absent.gguf", lm)
    with pytest.raises(ProjectorError, match="clip.projector_type"):
        MtmdContext(LM, lm)
