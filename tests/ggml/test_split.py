"""Weights split by rows across devices (llampy/ggml/split.py, split_mode 'row'): the split buffer scatters and
gathers the matrix's rows through the devices' own buffers, and the scheduler runs each device's share of a product
where those rows live, gathering the rows on the main device; the result equals one device's product bit for bit."""
from __future__ import annotations

import numpy as np
import pytest

from llampy.ggml import ops
from llampy.ggml.backend import BufferUsage, tensor_alloc, tensor_get, tensor_get_bytes, tensor_set, tensor_set_bytes
from llampy.ggml.backends.cpu.backend import CPUBackend
from llampy.ggml.graph import Graph
from llampy.ggml.quants import quantize
from llampy.ggml.sched import Scheduler
from llampy.ggml.split import SplitBufferType
from llampy.ggml.tensor import Flags, Tensor
from llampy.ggml.types import GGMLType as T


def _weight(buft, t, rows):
    w = Tensor(t, (64, rows.shape[0]), name="w")
    w.flags |= Flags.WEIGHT
    data = rows if t == T.F32 else quantize(rows, t)
    tensor_alloc(buft.buffer_from_host(np.ascontiguousarray(data).view(np.uint8), BufferUsage.WEIGHTS), w, 0)
    return w, np.ascontiguousarray(data).reshape(-1).view(np.uint8)


def _product(backends, w, x_rows):
    x = Tensor(T.F32, (64, x_rows.shape[0]), name="x")
    x.flags |= Flags.INPUT
    y = ops.mul_mat(w, x)
    y.name = "y"
    y.set_output()
    g = Graph.build(y)
    sched = Scheduler(backends)
    sched.alloc_graph(g)
    tensor_set(x, x_rows)
    sched.graph_compute(g)
    return tensor_get(y), sched, g


@pytest.mark.parametrize("t", [T.F32, T.Q8_0])
def test_rows_split_over_three_devices_give_one_devices_product(t):
    rng = np.random.default_rng(1)
    rows, x = rng.standard_normal((40, 64)).astype(np.float32), rng.standard_normal((3, 64)).astype(np.float32)
    one = CPUBackend("dev0")
    want, _, _ = _product([one], _weight(one.get_default_buffer_type(), t, rows)[0], x)
    devs = [CPUBackend("dev0"), CPUBackend("dev1"), CPUBackend("dev2")]
    buft = SplitBufferType(devs, [1, 2, 1], main=devs[1])
    w, raw = _weight(buft, t, rows)
    parts = w.buffer.parts_of(w)
    assert [(b.device, r0, r1) for b, _, r0, r1 in parts] == [("dev0", 0, 10), ("dev1", 10, 30), ("dev2", 30, 40)]
    assert all(p.buffer.buft.device == b.device for b, p, _, _ in parts)        # each slice in its device's memory
    assert np.array_equal(tensor_get_bytes(w), raw)                             # the rows gather back
    got, sched, g = _product(devs, w, x)
    assert np.array_equal(got, want)
    p = sched._last
    where = {n.name: (sp.backend.device, p.causes[n.id]) for sp in p.splits for n in sp.nodes}
    assert where["y[0:10]@dev0"][0] == "dev0" and where["y[10:30]@dev1"][0] == "dev1"
    assert where["y[30:40]@dev2"][0] == "dev2"
    assert where["y"] == ("dev1", "0.rows")                                     # gathered on the main device
    # the gathering is the scheduler's copies of each device's rows into y (ggml's copies into dst), no kernel:
    # its split copies nothing in, the only copies are x's to the other devices, no backend runs a concatenation
    gather = p.splits[-1]
    assert [n.name for n in gather.nodes] == ["y"] and gather.inputs == [] and sched.n_copies_made == 2
    assert [(v.ne[0], v.view_offs) for _, v in gather.gathers] == [(10, 0), (20, 40), (10, 120)]
    ran = []        # what each backend was given to run
    for d in devs:
        d.graph_compute = lambda nodes, run=d.graph_compute: (ran.append(nodes), run(nodes))[1]
        d.graph_plan_compute = lambda plan, run=d.graph_plan_compute: (ran.append(plan), run(plan))[1]
    x2 = x[::-1].copy()
    tensor_set(next(leaf for leaf in g.leafs if leaf.name == "x"), x2)
    sched.graph_compute(g)
    assert len(ran) == 3 and all(r is sp.plan for r, sp in zip(ran, p.splits[:3]))     # the products only
    assert np.array_equal(tensor_get(g.nodes[-1]), _product([one], _weight(one.get_default_buffer_type(), t, rows)[0],
                                                            x2)[0])
    tensor_set_bytes(w, raw[:7] ^ 0xFF, 3 * w.nb[1])                            # a write inside one device's rows
    back = tensor_get_bytes(w)
    assert np.array_equal(back[3 * w.nb[1]:3 * w.nb[1] + 7], raw[:7] ^ 0xFF)
    assert np.array_equal(np.delete(back, np.arange(3 * w.nb[1], 3 * w.nb[1] + 7)),
                          np.delete(raw, np.arange(3 * w.nb[1], 3 * w.nb[1] + 7)))


def test_only_a_product_may_read_a_split_weight():
    devs = [CPUBackend("dev0"), CPUBackend("dev1")]
    w, _ = _weight(SplitBufferType(devs), T.F32, np.ones((8, 64), np.float32))
    idx = Tensor(T.I32, (2,), name="idx")
    idx.flags |= Flags.INPUT
    g = Graph.build(ops.get_rows(w, idx).set_output())
    with pytest.raises(RuntimeError, match="reads a weight split by rows .w.: only a matrix product"):
        Scheduler(devs).alloc_graph(g)
    with pytest.raises(ValueError, match="does not share rows over 2 devices"):
        SplitBufferType(devs, [1, 1, 1])


class _Tiled(CPUBackend):
    """A device whose product kernels take rows in tiles of ``row_tile``."""

    def __init__(self, device, row_tile):
        super().__init__(device)
        self.row_tile = row_tile


def test_shares_are_rounded_to_the_devices_tiles():
    """ggml's get_row_split: each device's first row is n_rows times its cumulative share, rounded down to the
    largest tile of the devices that get rows (a device with no share does not count); the last ends at n_rows."""
    a, b, c = _Tiled("dev0", 8), CPUBackend("dev1"), _Tiled("dev2", 32)
    assert SplitBufferType([a, b], [1, 1.5]).row_ranges(40) == [(0, 16), (16, 40)]        # 16 = 40 * 0.4
    assert SplitBufferType([a, b], [1, 2]).row_ranges(40) == [(0, 8), (8, 40)]            # 13.33 -> 8
    assert SplitBufferType([b, b], [1, 2]).row_ranges(40) == [(0, 13), (13, 40)]          # no tiles
    assert SplitBufferType([c, a, b], [0, 1, 2]).row_ranges(40) == [(0, 0), (0, 8), (8, 40)]
    assert SplitBufferType([a, c], [1, 2]).row_ranges(40) == [(0, 0), (0, 40)]            # 13.33 -> 0
    rng = np.random.default_rng(2)
    rows, x = rng.standard_normal((40, 64)).astype(np.float32), rng.standard_normal((2, 64)).astype(np.float32)
    devs = [_Tiled("dev0", 8), CPUBackend("dev1")]
    w, _ = _weight(SplitBufferType(devs, [1, 2], main=devs[1]), T.Q8_0, rows)
    assert [(r0, r1) for _, _, r0, r1 in w.buffer.parts_of(w)] == [(0, 8), (8, 40)]
    one = CPUBackend("dev0")
    want, _, _ = _product([one], _weight(one.get_default_buffer_type(), T.Q8_0, rows)[0], x)
    assert np.array_equal(_product(devs, w, x)[0], want)
