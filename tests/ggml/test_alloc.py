"""Graph allocator: free list, lifetimes (no two live tensors share bytes), in-place reuse, storage left alone,
plan reuse, planned vs naive bytes, and debug poisoning that keeps right plans right and catches a broken one."""
from __future__ import annotations

import numpy as np

from llampy.ggml import ops
from llampy.ggml.alloc import GraphAllocator, _FreeList, owner, plan_summary
from llampy.ggml.backend import BufferType, tensor_data
from llampy.ggml.graph import Graph
from llampy.ggml.sched import Scheduler
from llampy.ggml.tensor import Tensor
from llampy.ggml.types import GGMLType as T

from .fakes import Block, NullBackend, NumpyBackend

BUFT = BufferType("host", "host", alignment=64)


def test_free_list_best_fit_alignment_and_coalescing():
    fl = _FreeList(64)
    a, b, c, d = fl.alloc(100), fl.alloc(10), fl.alloc(300), fl.alloc(64)
    assert (a, b, c, d) == (0, 128, 192, 512) and fl.high == 576
    fl.free(a, 100)
    fl.free(c, 300)
    assert fl.alloc(200) == c                  # best fit: the 320-byte hole, not the 128-byte one
    assert fl.alloc(60) == 448                 # the exact 64-byte rest of that hole
    assert fl.alloc(100) == a
    fl.free(b, 10)
    fl.free(d, 64)                             # frees at the top shrink it
    assert fl.top == 512 and fl.high == 576


def check_no_overlap(nodes, p):
    """Every two planned tensors whose lifetimes overlap occupy disjoint bytes."""
    ts = {t.id: t for n in nodes for t in [n] + [owner(s) for s in n.src if s is not None]}
    spans = [(p.lifetimes[i], p.offsets[i], p.offsets[i] + ts[i].nbytes, i) for i in p.offsets]
    for (l1, a1, b1, i1) in spans:
        for (l2, a2, b2, i2) in spans:
            if i1 < i2 and l1[0] <= l2[1] and l2[0] <= l1[1] and a1 < b2 and a2 < b1:
                raise AssertionError(f"{ts[i1]!r} {l1} and {ts[i2]!r} {l2} overlap at bytes {a1}:{b1} / {a2}:{b2}")


def test_lifetimes_never_overlap_on_a_transformer_graph():
    dev = NullBackend("null")
    b = Block([dev, dev])
    p = GraphAllocator(BUFT).alloc_graph(b.graph)
    check_no_overlap(b.graph.nodes, p)
    assert 0 < p.size < p.naive_size / 2
    assert p.lifetimes[b.x.id] == (-1, len(b.graph.nodes) - 1)          # inputs live for the whole graph
    assert p.lifetimes[b.out.id][1] == len(b.graph.nodes) - 1           # outputs to the end
    # the weights (storage of their own) were not touched
    for t in b.graph.leafs:
        if t.name.startswith("blk."):
            assert t.id not in p.offsets and t.buffer.buft is not BUFT


def test_in_place_reuse_rules():
    x = Tensor(T.F32, (16, 4), name="x").set_input()
    a = ops.mul_mat(Tensor(T.F32, (16, 16), name="w").set_input(), x)
    b = ops.silu(a)                    # a dies here: b takes its memory
    c = ops.scale(b, 2.0)              # b is read again below: no reuse
    d = ops.add(c, b)                  # c and b die: d takes c's memory (first source)
    e = ops.mul(ops.cont(d), d)        # any source of an element-wise op may give its memory
    f = ops.rms_norm(e, 1e-5).set_output()
    g = Graph.build(f)
    p = GraphAllocator(BUFT).alloc_graph(g)
    assert b.offs == a.offs and d.offs == c.offs and c.offs != b.offs
    assert e.offs in (d.offs, g.nodes[-3].offs) and f.offs == e.offs
    assert p.n_inplace == 4                     # a->b, c->d, cont(d)->e, e->f
    # never into an input, an output, or a view
    y = Tensor(T.F32, (8,), name="y").set_input()
    z = ops.silu(y)
    out = ops.scale(z, 1.0).set_output()
    last = ops.silu(ops.reshape(out, 2, 4))
    g2 = Graph.build(last)
    GraphAllocator(BUFT).alloc_graph(g2)
    assert z.offs != y.offs and last.offs != out.offs and out.offs == z.offs


def test_plan_kept_for_the_same_structure():
    dev = NullBackend("null")
    al = GraphAllocator(BUFT)
    b1 = Block([dev, dev], seed=0)
    p1 = al.alloc_graph(b1.graph)
    al.alloc_graph(b1.graph)
    b2 = Block([dev, dev], seed=5)             # other tensors, the same structure: the same offsets
    p2 = al.alloc_graph(b2.graph)
    assert (al.n_plans, al.n_reuses) == (1, 2) and p2 is p1
    assert [n.offs for n in b1.graph.nodes] == [n.offs for n in b2.graph.nodes]
    assert b2.out.buffer is al.buffer
    al.alloc_graph(Block([dev, dev], n_tok=7).graph)
    assert al.n_plans == 2


def _run_with(al_debug, break_lifetimes=False, seed=1):
    dev = NumpyBackend("np")
    b = Block([dev, dev])
    s = Scheduler([dev])
    s._allocators[0] = GraphAllocator(dev.get_default_buffer_type(), debug=al_debug, break_lifetimes=break_lifetimes)
    s.alloc_graph(b.graph)
    b.set_inputs(seed)
    s.graph_compute(b.graph)
    return b.result(), s


def test_poisoning_keeps_a_right_plan_right():
    ref, _ = _run_with(False)
    got, s = _run_with(True)
    np.testing.assert_array_equal(got, ref)
    assert s._allocators[0].plan_.frees          # something was poisoned


def test_poisoning_catches_a_broken_plan():
    ref, _ = _run_with(False)
    broken, s = _run_with(True, break_lifetimes=True)
    assert np.isnan(broken).any() or not np.allclose(broken, ref)


def test_poison_after_fills_nan_bytes():
    a = Tensor(T.F32, (8,), name="a").set_input()
    b = ops.scale(a, 2.0)
    c = ops.scale(b, 3.0).set_output()
    al = GraphAllocator(BUFT, debug=True)
    p = al.alloc_graph(Graph.build(c))
    tensor_data(a)[...] = 1.0
    tensor_data(b)[...] = 2.0
    assert p.frees == {}                         # b dies into c in place: nothing is freed
    p.frees[0] = [(b.offs, b.nbytes)]
    al.poison_after(0)
    assert np.isnan(tensor_data(b)).all() and (tensor_data(a) == 1.0).all()


def test_smollm2_sized_block_planned_vs_naive():
    """One SmolLM2-135M-sized layer (n_embd 576, 9 heads, 3 kv heads, n_ff 1536) over 32 tokens."""
    dev = NullBackend("null")
    b = Block([dev], n_embd=576, n_head=9, n_head_kv=3, n_ff=1536, n_tok=32)
    p = GraphAllocator(BUFT).alloc_graph(b.graph)
    check_no_overlap(b.graph.nodes, p)
    print("\nSmolLM2-sized block, 32 tokens:", plan_summary(p))
    assert p.size < 0.35 * p.naive_size
