"""The image encoder on the CUDA backend (llama.cpp's mmproj offload): with GPU layers the projector's weights and
its graph go to the model's GPU (the vision rope of qwen2-VL included), an op the backend refuses runs on the CPU
through the scheduler, and the embeddings are the CPU backend's. Tiny projectors of tests/fixtures/tiny_vision, one image each.

Tolerance: the GPU's F16-weight products keep the activations in float32 on the interpreter's CPU device and round
the results to F16 on a GPU (ggml-cuda's cuBLAS path), where the CPU rounds the activations to F16 (ggml-cpu's
vec_dot_f16); measured 5e-4 relative in the interpreter; the bound leaves room for a GPU's F16 results.
"""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("PIL")

from llampy.ggml import ops
from llampy.ggml.backend import backend_init, tensor_get
from llampy.ggml.graph import Graph
from llampy.ggml.sched import Scheduler
from llampy.ggml.tensor import VIEW_OPS, Op
from llampy.ggml.types import GGMLType
from llampy.llama.model import Model
from llampy.mtmd import MtmdContext, bitmap_from_file
from llampy.mtmd.clip import Projector
from llampy.mtmd.images import preprocess
from llampy.mtmd.vision import Encoder
from tests.ggml.helpers import leaf
from tests.paths import ROOT, TINY

from .helpers import REF, device_leaf

HERE = ROOT / "tests" / "fixtures" / "tiny_vision"
F32 = GGMLType.F32
TOL = 5e-3


def _placement(enc: Encoder, g) -> dict:
    """{backend name: set of ops} over the graph's compute nodes, as the scheduler placed them."""
    enc.sched.alloc_graph(g.graph)
    on: dict = {}
    for n in g.graph.nodes:
        if n.op not in VIEW_OPS:
            on.setdefault(enc.sched.get_backend(n, g.graph).name, set()).add(n.op)
    return on


def _rel(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_gemma3_encoder_runs_on_the_models_gpu():
    lm = TINY / "gemma3-Q8_0.gguf"
    if not lm.exists():
        pytest.skip(f"{lm} not found (the shared tiny models)")
    model = Model(lm, n_gpu_layers=-1)
    gpu = model.devices[0]
    mctx = MtmdContext(HERE / "gemma3-mmproj.gguf", model)
    assert mctx.proj.backend is gpu
    assert all(gpu.supports_buffer(t.storage.buffer) for t in mctx.proj.tensors.values())
    bm = bitmap_from_file(HERE / "wide45x27.png")          # letterboxed to the encoder's 32 px
    got = mctx.encode(bm)
    g = next(iter(mctx.encoder._graphs.values()))
    on = _placement(mctx.encoder, g)
    # every op of the gemma3 graph has a kernel here: the patch convolution (im2col), the blocks' norms,
    # products, non-causal flash attention and GELU, the 2-D average pool and the RMS norm of the projector
    assert set(on) == {"cuda"}, on
    assert {Op.IM2COL, Op.POOL_2D, Op.FLASH_ATTN_EXT, Op.NORM, Op.GELU, Op.MUL_MAT} <= on["cuda"]
    assert mctx.encoder.sched.n_splits == 1

    # --no-mmproj-offload: the same model, the encoder on the CPU
    cpu_ctx = MtmdContext(HERE / "gemma3-mmproj.gguf", model, use_gpu=False)
    assert cpu_ctx.proj.backend is cpu_ctx.proj.cpu
    want = cpu_ctx.encode(bm)
    assert set(_placement(cpu_ctx.encoder, next(iter(cpu_ctx.encoder._graphs.values())))) == {"cpu"}
    assert got.shape == want.shape == (16, 64)
    assert _rel(got, want) <= TOL, _rel(got, want)
    # a model without GPU layers keeps its projector on the CPU
    assert MtmdContext(HERE / "gemma3-mmproj.gguf", Model(lm)).proj.backend.name == "cpu"


def test_qwen2vl_encoder_on_the_gpu_and_an_op_it_refuses_on_the_cpu(monkeypatch):
    gpu = backend_init("cuda")
    proj = Projector(HERE / "qwen2vl-mmproj.gguf", backend=gpu)
    px = preprocess(bitmap_from_file(HERE / "rect64x32.png"), proj.hparams).images[0]
    want = Encoder(Projector(HERE / "qwen2vl-mmproj.gguf")).encode(px)
    enc = Encoder(proj)
    assert [b.name for b in enc.sched.backends] == ["cuda", "cpu"]
    got = enc.encode(px)
    on = _placement(enc, enc.graph_for(px.shape[1], px.shape[0]))
    assert set(on) == {"cuda"}, on                  # the 2-D vision rope (ggml_rope_multi) included
    assert {Op.ROPE, Op.IM2COL, Op.FLASH_ATTN_EXT, Op.MUL_MAT, Op.GELU_QUICK} <= on["cuda"]
    assert _rel(got, want) <= TOL, _rel(got, want)
    # an op the backend refuses runs on the CPU, op by op, through the scheduler (ggml's fallback)
    refuses = type(gpu).supports_op
    monkeypatch.setattr(type(gpu), "supports_op", lambda self, n: n.op != Op.ROPE and refuses(self, n))
    enc = Encoder(proj)
    got = enc.encode(px)
    on = _placement(enc, enc.graph_for(px.shape[1], px.shape[0]))
    assert on["cpu"] == {Op.ROPE} and Op.FLASH_ATTN_EXT in on["cuda"]
    assert _rel(got, want) <= TOL, _rel(got, want)


def test_vision_rope_matches_the_reference():
    """ggml_rope_multi's vision mode: pairs (i, i + n_dims), each section's angle from its own row of positions."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 3, 24)).astype(np.float32)              # tokens, heads, head size
    pos = rng.integers(0, 40, 4 * 5).astype(np.int32)
    out = {}
    for be in (backend_init("cuda"), REF):
        place = device_leaf if be is not REF else leaf
        xt, pt = place(be, F32, x.shape, x), place(be, GGMLType.I32, pos.shape, pos)
        node = ops.rope_multi(xt, pt, None, 12, (3, 3, 3, 3), ops.ROPE_TYPE_VISION, 32768, 10000.0, 1.0, 0.0, 1.0,
                              32.0, 1.0).set_output()
        if be is not REF:
            assert be.supports_op(node)
        Scheduler([be]).graph_compute(Graph.build(node))
        out[be.name] = tensor_get(node)
    np.testing.assert_allclose(out["cuda"], out["reference"], rtol=0, atol=2e-5 * np.abs(x).max())
