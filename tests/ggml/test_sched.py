"""Scheduler: placement passes and causes, splits and copies counted exactly, results equal to one backend,
plan reuse, n_copies sets, with the fake backends (over host memory, and over device memory that only the buffer
interface reaches) and with real cpu backends."""
from __future__ import annotations

import numpy as np
import pytest

from llampy.ggml import ops
from llampy.ggml.backend import BufferUsage, tensor_alloc, tensor_data, tensor_get
from llampy.ggml.fusion import fuse_nodes
from llampy.ggml.graph import Graph
from llampy.ggml.sched import Scheduler, is_sched_copy
from llampy.ggml.tensor import Op, Tensor
from llampy.ggml.types import GGMLType as T

from .fakes import Block, DeviceBackend, DeviceBuffer, NullBackend, NumpyBackend

MEMORY = ["host", "device"]


def numpy_backend(memory, name, **kw):
    """A NumpyBackend over host memory, or the same kernels over device memory (tensor_data raises there)."""
    return NumpyBackend(name, **kw) if memory == "host" else DeviceBackend(name, **kw)


def run(sched, block, seed=1):
    sched.alloc_graph(block.graph)
    block.set_inputs(seed)
    sched.graph_compute(block.graph)
    return block.result()


def single(seed_inputs=1, **kw):
    one = NumpyBackend("one")
    return run(Scheduler([one]), Block([one, one], **kw), seed_inputs)


@pytest.mark.parametrize("memory", MEMORY)
def test_two_devices_layer_split(memory):
    d0, d1 = numpy_backend(memory, "np0"), numpy_backend(memory, "np1")
    b = Block([d0, d1])
    s = Scheduler([d0, d1])
    got = run(s, b)
    np.testing.assert_array_equal(got, single())
    p = s.alloc_graph(b.graph)
    # layer 0 and the rms_norm that starts layer 1 (expanded down from dev0's last node) on dev0; the rest on dev1
    assert s.n_splits == 2 and [sp.backend for sp in p.splits] == [d0, d1]
    if memory == "host":
        # dev1 reads three things from dev0: the rms_norm result, the residual l_out-0 and the mask (an input
        # lives with its first reader)
        assert s.n_copies_made == 3
        assert sorted(t.name for t in p.splits[1].inputs) == sorted([p.splits[0].nodes[-1].name, "kq_mask",
                                                                     "l_out-0"])
        assert d1.n_copies_in == 3 and d0.n_copies_in == 0
    else:
        # inputs whose first reader is device memory live on the last backend: dev0 reads x and the mask from dev1,
        # dev1 reads the rms_norm result and l_out-0 from dev0
        assert s.n_copies_made == 4
        assert sorted(t.name for t in p.splits[0].inputs) == ["inp_embd", "kq_mask"]
        assert sorted(t.name for t in p.splits[1].inputs) == sorted([p.splits[0].nodes[-1].name, "l_out-0"])
        assert d1.n_copies_in == 2 and d0.n_copies_in == 2
        assert p.causes[b.x.id] == "inp.last" and b.x.buffer.buft is d1.get_default_buffer_type()
        with pytest.raises(TypeError, match="not host memory"):
            tensor_data(b.out)
    # the nodes of split 1 read the copies, which live in dev1's buffer
    for n in p.splits[1].nodes:
        for src in n.src:
            if is_sched_copy(src):
                assert src.buffer.buft is d1.get_default_buffer_type()
    assert s.n_replans == 1
    # new input values: no re-plan, the new right answer, the copies refreshed again
    got2 = run(s, b, seed=7)
    assert s.n_replans == 1 and d0.n_copies_in + d1.n_copies_in == 2 * s.n_copies_made
    np.testing.assert_array_equal(got2, single(7))
    assert not np.array_equal(got, got2)


@pytest.mark.parametrize("memory", MEMORY)
def test_backend_refusing_ops_falls_back_to_the_next(memory):
    acc = numpy_backend(memory, "acc", refuse={Op.SOFT_MAX, Op.RMS_NORM})
    cpu = NumpyBackend("cpu")
    b = Block([acc, acc])
    s = Scheduler([acc, cpu])
    got = run(s, b)
    np.testing.assert_array_equal(got, single())
    p = s.alloc_graph(b.graph)
    for n in b.graph.nodes:
        want = cpu if n.op in (Op.SOFT_MAX, Op.RMS_NORM) else acc
        if n.op not in (Op.RESHAPE, Op.PERMUTE, Op.VIEW, Op.TRANSPOSE):
            assert s.get_backend(n) is want, n
            if want is cpu:
                assert p.causes[n.id] == "3.prio"
    # per layer: rms_norm | attn.. | soft_max | ..attn, ffn_inp | rms_norm | ffn: cpu and acc alternate, 12 splits
    assert s.n_splits == 12
    assert [sp.backend for sp in p.splits] == [cpu, acc] * 6
    # inputs live with their first reader, on the cpu (x: rms_norm, the mask: soft_max). Copies:
    #   to cpu: the residual stream into the three other rms_norms (3), kq into each soft_max (2)
    #   to acc: each rms_norm result (4), each soft_max result (2), x for the first residual add (1)
    assert s.n_copies_made == 12
    assert sum(len(sp.inputs) for sp in p.splits if sp.backend is cpu) == 5
    assert sum(len(sp.inputs) for sp in p.splits if sp.backend is acc) == 7


@pytest.mark.parametrize("memory", MEMORY)
def test_plan_kept_until_the_structure_changes_and_forget_restores_sources(memory):
    d0, d1 = numpy_backend(memory, "np0"), numpy_backend(memory, "np1")
    b = Block([d0, d1])
    s = Scheduler([d0, d1])
    run(s, b)
    run(s, b, seed=3)
    assert s.n_replans == 1
    srcs_before = {n.id: list(n.src) for n in b.graph.nodes}
    assert any(is_sched_copy(x) for v in srcs_before.values() for x in v)
    s.forget(b.graph)
    assert not any(is_sched_copy(x) for n in b.graph.nodes for x in n.src)
    # a fresh scheduler (or this one) plans the restored graph again and gets the same answer
    got = run(Scheduler([d0, d1]), b, seed=3)
    np.testing.assert_array_equal(got, single(3))
    # a graph that grows is planned again
    extra = ops.scale(b.out, 2.0).set_output()
    b.graph.expand(extra)
    s2 = Scheduler([d0, d1])
    s2.alloc_graph(b.graph)
    b.graph.expand(ops.scale(extra, 0.5))
    s2.alloc_graph(b.graph)
    assert s2.n_replans == 2


@pytest.mark.parametrize("memory", MEMORY)
def test_two_graphs_share_the_buffers_and_stay_correct(memory):
    d0, d1 = numpy_backend(memory, "np0"), numpy_backend(memory, "np1")
    small, big = Block([d0, d1], n_tok=3, seed=0), Block([d0, d1], n_tok=9, seed=0)
    s = Scheduler([d0, d1])
    r_small = run(s, small)
    r_big = run(s, big)                  # grows the buffers: the small graph's tensors must follow
    r_small2 = run(s, small)
    assert s.n_replans == 2
    np.testing.assert_array_equal(r_small, r_small2)
    np.testing.assert_array_equal(r_big, single(n_tok=9))
    assert small.out.buffer is s._allocators[1].buffer


@pytest.mark.parametrize("memory", MEMORY)
def test_pipeline_copy_sets(memory):
    d0, d1 = numpy_backend(memory, "np0"), numpy_backend(memory, "np1")
    b = Block([d0, d1])
    s = Scheduler([d0, d1], n_copies=2)
    seen = set()
    for seed in (1, 2, 3):
        np.testing.assert_array_equal(run(s, b, seed), single(seed))
        seen.add(tuple(src.id for n in b.graph.nodes for src in n.src if is_sched_copy(src)))
    assert s.n_replans == 1 and len(seen) == 2


class FusingNumpy(NumpyBackend):
    def graph_optimize(self, graph_nodes, nodes):
        return fuse_nodes(graph_nodes, nodes, self)[0]


class FusingDevice(DeviceBackend):
    graph_optimize = FusingNumpy.graph_optimize


@pytest.mark.parametrize("memory", MEMORY)
def test_fusion_after_placement_stays_within_each_split(memory, capsys):
    d0, d1 = (FusingNumpy("np0"), FusingNumpy("np1")) if memory == "host" else (FusingDevice("np0"), FusingDevice("np1"))
    b = Block([d0, d1])
    s = Scheduler([d0, d1], debug=True)
    np.testing.assert_allclose(run(s, b), single(), rtol=1e-5, atol=1e-5)
    p = s.alloc_graph(b.graph)
    count = lambda op: sum(n.op is op for n in b.graph.nodes)
    # each layer's norms, attention and gated unit fuse on their own device, except the rms_norm that starts layer 1:
    # it runs on dev0 (expanded down), its mul by the weight on dev1
    assert (count(Op.RMS_NORM_MUL), count(Op.RMS_NORM), count(Op.FLASH_ATTN_EXT), count(Op.SWIGLU)) == (3, 1, 2, 2)
    assert s.n_splits == 2 and s.n_copies_made == (3 if memory == "host" else 4)   # as without fusion
    for sp in p.splits:
        assert all(p.assignment[n.id] == sp.backend_id for n in sp.nodes if n.op not in (Op.VIEW, Op.RESHAPE,
                                                                                        Op.PERMUTE, Op.TRANSPOSE))
    fused = [n for n in b.graph.nodes if n.op in (Op.RMS_NORM_MUL, Op.FLASH_ATTN_EXT, Op.SWIGLU)]
    assert all(p.causes[n.id].endswith("+f") for n in fused)
    assert b.out in b.graph and b.out is b.graph.nodes[-1]
    assert "+f" in capsys.readouterr().err
    np.testing.assert_allclose(run(s, b, seed=7), single(7), rtol=1e-5, atol=1e-5)
    assert s.n_replans == 1


def test_null_backend_structure_and_debug_print(capsys):
    d0, d1 = NullBackend("gpu"), NullBackend("cpu")
    rng = np.random.default_rng(0)
    # a KV-cache-like tensor with storage on the gpu: the set_rows that writes it must run there
    cache = Tensor(T.F32, (8, 16), name="cache_k")
    tensor_alloc(d0.alloc_buffer(cache.nbytes, BufferUsage.ANY), cache, 0)
    x = Tensor(T.F32, (8, 4), name="x").set_input()
    idx = Tensor(T.I32, (4,), name="idx").set_input()
    w = ops.mul(ops.silu(x), x)
    st = ops.set_rows(cache, w, idx)
    kv = ops.view_2d(st, 8, 16, cache.nb[1])
    y = ops.scale(ops.mul_mat(kv, x), 0.5).set_output()
    g = Graph.build(y)
    s = Scheduler([d0, d1], debug=True)
    s.graph_compute(g)
    p = s.alloc_graph(g)
    assert p.causes[st.id] == "1.vsrc" and s.get_backend(st) is d0
    assert p.causes[kv.id] == "view" and s.get_backend(kv) is d0
    # the rest expands from the set_rows (gpu) up and down: one split, no copies
    assert s.n_splits == 1 and s.n_copies_made == 0
    assert [len(c) for c in d0.computed] == [5] and d1.computed == []
    err = capsys.readouterr().err
    assert "## SPLIT #0: gpu" in err and "1.vsrc" in err and "2.gpu-up" in err
    dot = s.dump_dot(g)
    assert dot.startswith("digraph") and "@gpu" in dot


def test_inputs_go_to_the_last_backend_when_the_reader_is_not_host_memory():
    gpu, cpu = NullBackend("gpu", host=False), NullBackend("cpu")
    x = Tensor(T.F32, (8, 4), name="x").set_input()
    w = Tensor(T.F32, (8, 8), name="w")
    w.flags |= 4
    tensor_alloc(gpu.alloc_buffer(w.nbytes, BufferUsage.WEIGHTS), w, 0)
    y = ops.mul_mat(w, x).set_output()
    g = Graph.build(y)
    s = Scheduler([gpu, cpu])
    p = s.alloc_graph(g)
    assert p.causes[x.id] == "inp.last" and p.causes[y.id] == "1.wgt0"
    assert s.n_splits == 1 and s.n_copies_made == 1 and p.splits[0].inputs == [x]


# ---------------------------------------------------------------------------------------------- real backends
cpu_mod = pytest.importorskip("llampy.ggml.backends.cpu")


class Refusing(cpu_mod.CPUBackend):
    name = "refusing"

    def supports_op(self, node):
        return node.op not in (Op.SOFT_MAX, Op.RMS_NORM) and super().supports_op(node)


def _cpu(device):
    from llampy.ggml.backend import backend_init
    return backend_init("cpu", device=device)


def test_two_cpu_devices_match_one():
    one = _cpu("cpu")
    ref = run(Scheduler([one]), Block([one, one]))
    d0, d1 = _cpu("cpu0"), _cpu("cpu1")
    b = Block([d0, d1])
    s = Scheduler([d0, d1])
    np.testing.assert_array_equal(run(s, b), ref)
    assert (s.n_splits, s.n_copies_made) == (2, 3)
    ref7 = run(Scheduler([one]), Block([one, one]), seed=7)
    np.testing.assert_array_equal(run(s, b, seed=7), ref7)
    assert s.n_replans == 1


def test_cpu_with_a_backend_refusing_ops():
    # the acc cannot fuse the attention (its soft_max runs on the host) and the flash-attention kernel rounds
    # differently, so the reference fuses nothing; what the acc does fuse (the feed-forward) gives the same bits
    one = _cpu("cpu")
    one.graph_optimize = lambda graph_nodes, nodes: nodes
    ref = run(Scheduler([one]), Block([one, one]))
    acc, host = Refusing(device="acc"), _cpu("host")
    b = Block([acc, acc])
    s = Scheduler([acc, host])
    np.testing.assert_array_equal(run(s, b), ref)
    assert (s.n_splits, s.n_copies_made) == (12, 12)
