"""Scheduler and allocator: two cpu devices, a backend that refuses ops, plan reuse, memory planning, poisoning."""
from __future__ import annotations

import numpy as np

from llampy.ggml import ops
from llampy.ggml.alloc import GraphAllocator
from llampy.ggml.backend import backend_init, tensor_alloc, tensor_data
from llampy.ggml.backends.cpu import CPUBackend
from llampy.ggml.graph import Graph
from llampy.ggml.sched import Scheduler
from llampy.ggml.tensor import Flags, Op, Tensor
from llampy.ggml.types import GGMLType as T

N_EMBD, N_FF, N_TOK = 64, 128, 5


def weight(backend, shape_np, rng, type=T.F32):
    t = Tensor(type, tuple(reversed(shape_np)))
    t.flags |= Flags.WEIGHT
    buf = backend.alloc_buffer(t.nbytes)
    tensor_alloc(buf, t, 0)
    tensor_data(t)[...] = rng.standard_normal(shape_np).astype(np.float32) * 0.2
    return t


def two_layer_graph(dev0, dev1, seed=0):
    """A transformer-ish 2-layer graph; layer 0's weights on dev0, layer 1's on dev1."""
    rng = np.random.default_rng(seed)
    x = Tensor(T.F32, (N_EMBD, N_TOK), name="x").set_input()
    cur = x
    for il, dev in enumerate((dev0, dev1)):
        w_norm = weight(dev, (N_EMBD,), rng)
        w_gate, w_up = weight(dev, (N_FF, N_EMBD), rng), weight(dev, (N_FF, N_EMBD), rng)
        w_down = weight(dev, (N_EMBD, N_FF), rng)
        h = ops.mul(ops.rms_norm(cur, 1e-5), w_norm)
        a = ops.soft_max_ext(ops.mul_mat(h, h), None, 0.125)         # [n_tok, n_tok]
        h = ops.add(h, ops.mul_mat(ops.cont(ops.transpose(h)), a))
        f = ops.mul_mat(w_down, ops.mul(ops.silu(ops.mul_mat(w_gate, h)), ops.mul_mat(w_up, h)))
        cur = ops.add(cur, f).set_name(f"l_out-{il}")
    cur.set_output()
    return Graph.build(cur), x, cur


def compute(backends, dev0, dev1, xval, seed=0):
    g, x, out = two_layer_graph(dev0, dev1, seed)
    s = Scheduler(backends)
    s.alloc_graph(g)
    tensor_data(x)[...] = xval
    s.graph_compute(g)
    return s, g, x, out, np.array(tensor_data(out))


def test_two_devices_split_and_copy_and_match_single():
    xval = np.random.default_rng(1).standard_normal((N_TOK, N_EMBD)).astype(np.float32)
    single = backend_init("cpu", device="cpu")
    _, _, _, _, ref = compute([single], single, single, xval)
    d0, d1 = backend_init("cpu", device="cpu0"), backend_init("cpu", device="cpu1")
    s, g, x, out, got = compute([d0, d1], d0, d1, xval)
    np.testing.assert_array_equal(got, ref)
    p = s.alloc_graph(g)
    assert len(p.splits) == 2
    assert [sp.backend for sp in p.splits] == [d0, d1]
    # layer 0's output crosses to dev1 twice: as the residual, and through layer 1's rms_norm, which the
    # downward expansion (pass 2) leaves on dev0 next to its producer
    assert p.n_copies == 2
    assert s.n_replans == 1
    # a second call with new input values does not re-plan and gives the new answer
    x2 = xval * 0.5
    tensor_data(x)[...] = x2
    s.graph_compute(g)
    assert s.n_replans == 1
    _, _, _, _, ref2 = compute([single], single, single, x2)
    np.testing.assert_array_equal(np.array(tensor_data(out)), ref2)


class Refusing(CPUBackend):
    name = "refusing"

    def supports_op(self, node):
        return node.op not in (Op.SOFT_MAX, Op.RMS_NORM) and super().supports_op(node)


def test_backend_refusing_ops_falls_back():
    xval = np.random.default_rng(2).standard_normal((N_TOK, N_EMBD)).astype(np.float32)
    single = backend_init("cpu", device="cpu")
    _, _, _, _, ref = compute([single], single, single, xval)
    acc = Refusing(device="acc")
    cpu = backend_init("cpu", device="host")
    s, g, _, _, got = compute([acc, cpu], acc, acc, xval)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5)
    p = s.alloc_graph(g)
    refused = [n for n in g.nodes if n.op in (Op.SOFT_MAX, Op.RMS_NORM)]
    assert all(s.backends[p.assignment[n.id]] is cpu for n in refused)
    # rms_norm (x2) and soft_max (x2) run on the cpu, everything else on acc: 8 alternating splits
    assert len(p.splits) == 8
    assert p.n_copies >= 4


def test_allocator_plans_less_than_naive_and_poisoning_keeps_results():
    xval = np.random.default_rng(3).standard_normal((N_TOK, N_EMBD)).astype(np.float32)
    cpu = backend_init("cpu")
    s, g, _, _, ref = compute([cpu], cpu, cpu, xval)
    ap = s.alloc_graph(g).alloc_plans[0]
    assert 0 < ap.size < ap.naive_size
    assert ap.n_inplace > 0
    # debug mode: freed regions are filled with NaN bytes after each node; the result must not change
    g2, x2, out2 = two_layer_graph(cpu, cpu)
    s2 = Scheduler([cpu])
    for al in s2._allocators:
        al.debug = True
    s2.alloc_graph(g2)
    tensor_data(x2)[...] = xval
    s2.graph_compute(g2)
    np.testing.assert_array_equal(np.array(tensor_data(out2)), ref)


def test_poisoning_catches_a_broken_plan():
    cpu = backend_init("cpu")
    a = Tensor(T.F32, (8,), name="a").set_input()
    b = ops.scale(a, 2.0)
    c = ops.scale(b, 3.0)
    d = ops.add(c, b).set_output()       # b must live until d
    g = Graph.build(d)
    al = GraphAllocator(cpu.get_default_buffer_type(), debug=True)
    p = al.alloc_graph(g.nodes, g.leafs)
    # break the plan: pretend b dies right after c, and make the poison hit it
    idx = g.nodes.index(c)
    p.frees[idx] = [(b.offs, b.nbytes)]
    tensor_data(a)[...] = 1.0
    for i, n in enumerate(g.nodes):
        cpu.graph_compute([n])
        al.poison_after(i)
    assert np.isnan(np.array(tensor_data(d))).all()


def test_dot_dump_names_backends():
    d0, d1 = backend_init("cpu", device="cpu0"), backend_init("cpu", device="cpu1")
    g, x, out = two_layer_graph(d0, d1)
    s = Scheduler([d0, d1])
    dot = s.dump_dot(g)
    assert dot.startswith("digraph") and "@cpu0" in dot and "@cpu1" in dot
    assert "mul_mat" in g.dump_text()
