"""The fusion pass: same results within float tolerance, fewer nodes."""
from __future__ import annotations

import numpy as np

from llampy.ggml import ops
from llampy.ggml.backend import backend_init, tensor_data
from llampy.ggml.fusion import fuse
from llampy.ggml.graph import Graph
from llampy.ggml.sched import Scheduler
from llampy.ggml.tensor import Op
from llampy.ggml.types import GGMLType as T

from .helpers import leaf

CPU = backend_init("cpu")


def build(seed=0):
    rng = np.random.default_rng(seed)
    B = lambda ty, shape, value=None: leaf(CPU, ty, shape, value, rng)
    x = B(T.F32, (6, 32))
    h = ops.mul(ops.rms_norm(x, 1e-5), B(T.F32, (32,)))
    f = ops.mul(ops.silu(ops.mul_mat(B(T.F32, (48, 32)), h)), ops.mul_mat(B(T.F32, (48, 32)), h))
    capped = ops.scale(ops.tanh(ops.scale(ops.mul_mat(B(T.F32, (10, 48)), f), 1 / 5.0)), 5.0)
    # llama.cpp's attention without flash attention: q, k, v [d, n, heads]
    q = ops.reshape(ops.cont(B(T.F32, (2, 6, 16))), 16, 6, 2)
    k = ops.reshape(ops.cont(B(T.F32, (2, 6, 16))), 16, 6, 2)
    v = ops.cont(B(T.F32, (2, 6, 16)))
    v3 = ops.reshape(v, 16, 6, 2)
    kq = ops.soft_max_ext(ops.mul_mat(k, q), None, 0.25)
    kqv2 = ops.mul_mat(ops.transpose(v3), kq)
    attn = ops.cont(ops.permute(kqv2, 0, 2, 1, 3))
    return [capped.set_output().set_name("capped"), attn.set_output().set_name("attn")]


def run(g, outs):
    Scheduler([CPU]).graph_compute(g)
    return [np.array(tensor_data(o)) for o in outs]


def test_fusion_keeps_results_and_removes_nodes():
    outs = build()
    g = Graph.build(*outs)
    before = run(g, outs)
    n_before = len(g.compute_nodes())
    outs2 = build()
    g2, n_fused = fuse(Graph.build(*outs2), CPU)
    ops_after = {n.op for n in g2.nodes}
    assert {Op.RMS_NORM_MUL, Op.SWIGLU, Op.SOFTCAP, Op.FLASH_ATTN_EXT} <= ops_after
    assert n_fused >= 4 and len(g2.compute_nodes()) < n_before
    after = run(g2, [g2.find("capped"), g2.find("attn")])
    np.testing.assert_allclose(after[0], before[0], atol=1e-4)
    np.testing.assert_allclose(after[1].reshape(-1), before[1].reshape(-1), atol=5e-3)   # F16 rounding in FA


def test_fusion_respects_supports():
    outs = build()
    g, n_fused = fuse(Graph.build(*outs), lambda node: node.op != Op.FLASH_ATTN_EXT)
    assert Op.FLASH_ATTN_EXT not in {n.op for n in g.nodes}
    assert n_fused >= 3
