"""The fusion pass: the same results within float tolerance, fewer nodes, only where it is allowed."""
from __future__ import annotations

import numpy as np
import pytest

from llampy.ggml import ops
from llampy.ggml.backend import tensor_data
from llampy.ggml.fusion import fuse
from llampy.ggml.graph import Graph
from llampy.ggml.sched import Scheduler
from llampy.ggml.tensor import Op, Tensor
from llampy.ggml.types import GGMLType as T

from .fakes import Block, NumpyBackend, weight

FUSED = {Op.RMS_NORM_MUL, Op.SWIGLU, Op.FLASH_ATTN_EXT}


def run(backend, g, b, seed=1):
    Scheduler([backend]).alloc_graph(g)
    b.set_inputs(seed)
    Scheduler([backend]).graph_compute(g)
    return b.result()


@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_block_fuses_and_keeps_results(softcap):
    dev = NumpyBackend("np")
    b = Block([dev, dev], softcap=softcap)
    n_before = len(b.graph.compute_nodes())
    ref = run(dev, b.graph, b)
    g, n = fuse(b.graph, dev)
    ops_after = {x.op for x in g.nodes}
    assert FUSED <= ops_after and not ({Op.RMS_NORM, Op.SILU, Op.SOFT_MAX, Op.SOFTCAP, Op.TANH} & ops_after)
    # per layer: 2 rms_norm·w, 1 swiglu, 1 attention (+1 softcap folded into it)
    assert n == 2 * (4 + (softcap > 0))
    # per layer: rms_norm x2, silu, and kq, soft_max, kqv for one flash attention; scale, tanh, scale with softcap
    assert len(g.compute_nodes()) == n_before - 2 * (2 + 1 + 2 + 3 * (softcap > 0))
    assert g.find("l_out-1") is b.out
    np.testing.assert_allclose(run(dev, g, b), ref, rtol=1e-5, atol=1e-5)


def test_supports_is_asked_and_private_intermediates_only():
    dev = NumpyBackend("np", refuse={Op.FLASH_ATTN_EXT})
    b = Block([dev])
    g, n = fuse(b.graph, dev)
    assert Op.FLASH_ATTN_EXT not in {x.op for x in g.nodes} and n == 3
    g, n = fuse(Block([dev]).graph, lambda node: node.op is Op.SWIGLU)
    assert n == 1
    # an intermediate with a second reader, or marked as an output, is not fused away
    x = Tensor(T.F32, (8, 2), name="x").set_input()
    w = weight(dev, (8,), np.random.default_rng(0))
    r = ops.rms_norm(x, 1e-5)
    y = ops.add(ops.mul(r, w), r).set_output()
    s = ops.silu(x).set_output()
    z = ops.mul(s, x).set_output()
    g, n = fuse(Graph.build(y, z))
    assert n == 0 and {Op.RMS_NORM, Op.SILU} <= {t.op for t in g.nodes}


def test_softcap_and_geglu_alone():
    dev = NumpyBackend("np")
    rng = np.random.default_rng(0)
    x = Tensor(T.F32, (16, 3), name="x").set_input()
    up = weight(dev, (16, 3), rng)
    y = ops.scale(ops.tanh(ops.scale(ops.mul(ops.gelu(x), up), 0.1)), 10.0).set_output().set_name("y")
    g0 = Graph.build(y)
    xs = rng.standard_normal((3, 16)).astype(np.float32)

    def compute(g):
        out = g.find("y")
        s = Scheduler([dev])
        s.alloc_graph(g)
        tensor_data(x)[...] = xs
        s.graph_compute(g)
        return np.array(tensor_data(out))
    ref = compute(g0)
    g, n = fuse(g0, dev)
    assert n == 2 and [t.op for t in g.nodes] == [Op.GEGLU, Op.SOFTCAP]
    np.testing.assert_allclose(compute(g), ref, rtol=1e-6, atol=1e-6)


def test_attention_shapes_must_match():
    # a kq·v pattern whose "v" does not line up with k (different n_kv) is left alone
    q = Tensor(T.F32, (8, 4, 2), name="q").set_input()
    k = Tensor(T.F32, (8, 5, 2), name="k").set_input()
    vt = Tensor(T.F32, (5, 8, 1), name="vt").set_input()        # one kv head for v, two for k
    kq = ops.soft_max_ext(ops.mul_mat(k, q), None, 0.3)
    out = ops.cont(ops.permute(ops.mul_mat(vt, kq), 0, 2, 1, 3)).set_output()
    g, n = fuse(Graph.build(out))
    assert n == 0


def test_reference_backend_fused_block():
    from llampy.ggml.backend import backend_init
    ref_be = backend_init("reference")
    b = Block([ref_be, ref_be], n_embd=64, n_head=4, n_head_kv=2, n_ff=96, n_tok=5)
    ref = run(ref_be, b.graph, b)
    n_before = len(b.graph.compute_nodes())
    g, n = fuse(b.graph, ref_be)
    assert n == 10 and len(g.compute_nodes()) < n_before      # per layer: 4 as test_block_fuses, 1 MUL_MAT_GLU
    # flash attention rounds Q, K and V to F16 as llama.cpp's CPU kernel does
    np.testing.assert_allclose(run(ref_be, g, b), ref, rtol=0, atol=2e-2)


def test_post_norm_and_residual_add_fuse():
    # Gemma's block ends: rms_norm(x)·w, then + the residual, in either operand order
    dev = NumpyBackend("np")
    rng = np.random.default_rng(0)
    x = Tensor(T.F32, (16, 5), name="x").set_input()
    r = Tensor(T.F32, (16, 5), name="r").set_input()
    w = weight(dev, (16,), rng)
    y1 = ops.add(ops.mul(ops.rms_norm(x, 1e-6), w), r)
    y2 = ops.add(r, ops.rms_norm_mul(y1, w, 1e-6)).set_output()
    g0 = Graph.build(y2)
    Scheduler([dev]).alloc_graph(g0)
    xv, rv = rng.standard_normal((5, 16)), rng.standard_normal((5, 16))
    for t, v in ((x, xv), (r, rv)):
        tensor_data(t)[...] = v
    Scheduler([dev]).graph_compute(g0)
    ref = np.array(tensor_data(y2))
    g, n = fuse(Graph.build(y2), dev)
    assert n == 3          # rms_norm·w, then two adds into it
    assert [t.op for t in g.compute_nodes()] == [Op.RMS_NORM_MUL, Op.RMS_NORM_MUL]
    assert all(len(t.src) == 3 for t in g.compute_nodes())
    Scheduler([dev]).alloc_graph(g)
    for t, v in ((x, xv), (r, rv)):
        tensor_data(t)[...] = v
    Scheduler([dev]).graph_compute(g)
    np.testing.assert_allclose(tensor_data(g.nodes[-1]), ref, rtol=1e-6, atol=1e-6)
    # a norm whose result is read again is not fused into the add
    z = ops.rms_norm_mul(x, w, 1e-6)
    g, n = fuse(Graph.build(ops.mul(ops.add(z, r), z).set_output()), dev)
    assert n == 0


def test_feed_forward_products_and_gated_unit_fuse():
    dev = NumpyBackend("np")
    dev.OPS = NumpyBackend.OPS | {Op.MUL_MAT_GLU}
    b = Block([dev, dev])
    ref = run(dev, b.graph, b)
    g, n = fuse(b.graph, dev)
    fused = [t for t in g.nodes if t.op is Op.MUL_MAT_GLU]
    assert len(fused) == 2 and all(t.op_params["glu"] == "swiglu" for t in fused)
    assert Op.SWIGLU not in {t.op for t in g.nodes}
    assert [t.src[0].name for t in fused] == ["blk.0.ffn_gate", "blk.1.ffn_gate"]
    np.testing.assert_allclose(run(dev, g, b), ref, rtol=1e-5, atol=1e-5)
    # gate and up reading different inputs, or a product read elsewhere, stay as they are
    rng = np.random.default_rng(0)
    x = Tensor(T.F32, (8, 3), name="x").set_input()
    y = Tensor(T.F32, (8, 3), name="y").set_input()
    wg, wu = weight(dev, (8, 16), rng), weight(dev, (8, 16), rng)
    gx = ops.mul_mat(wg, x)
    for out in (ops.geglu(gx, ops.mul_mat(wu, y)), ops.add(ops.geglu(gx, ops.mul_mat(wu, x)), gx)):
        g, n = fuse(Graph.build(out.set_output()), dev)
        assert Op.MUL_MAT_GLU not in {t.op for t in g.nodes}
