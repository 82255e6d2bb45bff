"""The remote backend: buffers and compute in a stage process (another host), reached through a transport.

Its buffers are not host memory: they live in the stage (``StageExecutor``), so the model's placement (a device's
layers, their KV cache) and the scheduler's copies work as for any device. Weights never travel: a weight buffer is
made by the stage from its own copy of the model file (``buffer_from_file``). A split's graph is described once
(tensors as records: type, shape, strides, op, params, sources, and where their memory is), keyed by a digest of
that description, so one shape's graph is sent once and the stage keeps its bound plan; each run sends only the
key. Writes (the split's inputs: hidden state, positions, cells, mask) and runs are queued and go with the next read
(the split's output), one round trip per step.

The transport is any callable taking a list of operations and returning the results of its reads in order (a Ray
actor's method in llampy/cluster/stage.py; a direct call in tests). This module imports no transport.

Operations, as tuples: ("alloc", bid, size), ("alloc_weight", bid, name, nbytes), ("free", bid),
("write", bid, offset, bytes), ("memset", bid, offset, size, value), ("plan", key, records), ("run", key),
("read", bid, offset, size), ("push", bid, offset, size, transport, dst_bid, dst_offset): bytes sent by this stage
to another one (a split's output that the next stage reads), not through the caller.
"""
from __future__ import annotations

import hashlib
import itertools
import pickle
import weakref
from collections import OrderedDict

import numpy as np

from ..backend import Backend, Buffer, BufferType, BufferUsage, HostBuffer
from ..tensor import Flags, Op, Tensor

FLUSH_BYTES = 8 << 20       # queued writes are sent once they reach this, without waiting for a read
MAX_PLANS = 256             # plans a stage keeps (least recently used dropped)


class RemoteBufferType(BufferType):
    def __init__(self, backend: "RemoteBackend"):
        super().__init__(backend.device, backend.device, is_host=False)
        self.backend = backend

    def alloc_buffer(self, size: int, usage: str = BufferUsage.ANY) -> "RemoteBuffer":
        buf = RemoteBuffer(self, max(int(size), 1), usage)
        self.backend._queue(("alloc", buf.bid, buf.size))
        return buf

    def buffer_from_file(self, name: str, nbytes: int, usage: str = BufferUsage.WEIGHTS) -> "RemoteBuffer":
        """The file's tensor ``name``, read by the stage from its own copy of the model: no bytes cross."""
        buf = RemoteBuffer(self, nbytes, usage)
        self.backend._queue(("alloc_weight", buf.bid, name, nbytes))
        return buf


class RemoteBuffer(Buffer):
    _ids = itertools.count(1)

    def __init__(self, buft: RemoteBufferType, size: int, usage: str):
        super().__init__(buft, size, usage)
        self.bid = next(self._ids)
        weakref.finalize(self, buft.backend._queue, ("free", self.bid))

    def write(self, offset, data):
        self.buft.backend._queue(("write", self.bid, int(offset), np.ascontiguousarray(data).tobytes()))

    def read(self, offset, size):
        return np.frombuffer(self.buft.backend._read(self.bid, int(offset), int(size)), np.uint8).copy()

    def memset(self, offset, size, value):
        self.buft.backend._queue(("memset", self.bid, int(offset), int(size), int(value)))

    def cpy_tensor(self, src: Tensor, dst: Tensor) -> bool:
        sb = src.storage.buffer
        if not (src.is_contiguous() and dst.is_contiguous()):
            return False
        if sb.is_host:
            self.write(dst.data_offs, sb.data[src.data_offs:src.data_offs + src.nbytes])
            return True
        if isinstance(sb, RemoteBuffer) and sb.buft.backend is not self.buft.backend:
            # stage to stage: the source's stage sends the bytes to this one itself, after its queued runs
            me, other = self.buft.backend, sb.buft.backend
            if any(op[0] in ("alloc", "alloc_weight") for op in me._ops):
                me.flush()      # the destination buffer must exist there first
            other._queue(("push", sb.bid, src.data_offs, src.nbytes, me.transport, self.bid, dst.data_offs))
            other.flush()
            return True
        return False


class RemotePlan:
    __slots__ = ("key", "records", "nodes")

    def __init__(self, key, records, nodes):
        self.key, self.records, self.nodes = key, records, nodes


class RemoteBackend(Backend):
    """A device in a stage. ``transport(ops) -> [read results]``; ``local``: a backend of the same kind as the
    stage's (the CPU backend), asked which ops run and how a split fuses, so the stage runs what the scheduler saw."""

    name = "remote"

    def __init__(self, transport, device: str = "remote:0", local: Backend | None = None):
        super().__init__(device)
        self.transport = transport
        if local is None:
            from .cpu.backend import CPUBackend
            local = CPUBackend()
        self.local = local
        self._buft = RemoteBufferType(self)
        self._ops: list = []
        self._queued_bytes = 0
        self._sent: OrderedDict = OrderedDict()     # plan keys the stage holds
        self.n_calls = 0                            # round trips (for benchmarks and tests)
        self.bytes_sent = 0

    # ------------------------------------------------------------ transport
    def _queue(self, op) -> None:
        self._ops.append(op)
        if op[0] == "write":
            self._queued_bytes += len(op[3])
            if self._queued_bytes >= FLUSH_BYTES:
                self.flush()

    def flush(self) -> list:
        if not self._ops:
            return []
        ops, self._ops, self._queued_bytes = self._ops, [], 0
        self.n_calls += 1
        self.bytes_sent += sum(len(o[3]) for o in ops if o[0] == "write")
        return self.transport(ops)

    def _read(self, bid: int, offset: int, size: int) -> bytes:
        self._ops.append(("read", bid, offset, size))
        return self.flush()[-1]

    def synchronize(self) -> None:
        pass        # queued work goes with the next read: the split's output is always read

    # ------------------------------------------------------------ ops
    def supports_op(self, node: Tensor) -> bool:
        return self.local.supports_op(node)

    def supports_kv_type(self, t) -> bool:
        f = getattr(self.local, "supports_kv_type", None)
        return f(t) if f else True

    def graph_optimize(self, graph_nodes, nodes):
        return self.local.graph_optimize(graph_nodes, nodes)

    def graph_plan_create(self, nodes: list[Tensor]) -> RemotePlan:
        records = describe(nodes, self._buft)
        key = hashlib.sha1(pickle.dumps(records, protocol=4)).hexdigest()
        return RemotePlan(key, records, nodes)

    def graph_plan_compute(self, plan: RemotePlan) -> None:
        if plan.key in self._sent:
            self._sent.move_to_end(plan.key)
        else:
            self._queue(("plan", plan.key, plan.records))
            self._sent[plan.key] = True
            while len(self._sent) > MAX_PLANS:      # the stage drops the same ones (same order, same bound)
                self._sent.popitem(last=False)
        self._queue(("run", plan.key))

    def graph_compute(self, nodes: list[Tensor]) -> None:
        self.graph_plan_compute(self.graph_plan_create(nodes))


def describe(nodes: list[Tensor], buft: BufferType) -> tuple:
    """The split as records in dependency order, numbered from 0 (so equal shapes give equal descriptions):
    (type, ne, nb, op, op_params, src indices, view_src index, view_offs, name, flags, (bid, offs) or None,
    is_node)."""
    index: dict[int, int] = {}
    records: list = []
    node_ids = {id(n) for n in nodes}

    def visit(t: Tensor) -> int:
        k = index.get(id(t))
        if k is not None:
            return k
        is_node = id(t) in node_ids
        # an input of the split (a weight, a cache view, the scheduler's copy of another device's tensor) is
        # memory the stage holds: its own sources stay behind
        srcs = [visit(s) if s is not None else -1 for s in t.src] if is_node else []
        vs = visit(t.view_src) if t.view_src is not None else -1
        mem = None
        if t.view_src is None:
            buf = t.buffer
            if buf is None or buf.buft is not buft:
                raise ValueError(f"{t!r} is not in the stage's memory ({buf!r}): the scheduler places a split's "
                                 f"tensors in its backend's buffers")
            mem = (buf.bid, int(t.offs))
        records.append((int(t.type), tuple(t.ne), tuple(t.nb), t.op if is_node else Op.NONE, dict(t.op_params),
                        tuple(srcs), vs, int(t.view_offs), t.name, int(t.flags), mem, is_node))
        index[id(t)] = len(records) - 1
        return index[id(t)]

    for n in nodes:
        visit(n)
    return tuple(records)


class StageExecutor:
    """The stage's side: its buffers (host memory here), plans bound on its own backend, the ops applied in order.
    ``weights(name) -> uint8 array``: the tensor's bytes from the stage's own copy of the model file."""

    def __init__(self, backend: Backend, weights):
        self.backend = backend
        self.weights = weights
        self.buffers: dict[int, HostBuffer] = {}
        self.plans: OrderedDict = OrderedDict()
        self.buft = backend.get_default_buffer_type()

    def apply(self, ops: list) -> list:
        out = []
        for op in ops:
            kind = op[0]
            if kind == "write":
                _, bid, off, data = op
                self.buffers[bid].data[off:off + len(data)] = np.frombuffer(data, np.uint8)
            elif kind == "run":
                self.backend.graph_plan_compute(self.plans[op[1]])
                self.plans.move_to_end(op[1])
            elif kind == "read":
                _, bid, off, size = op
                out.append(self.buffers[bid].data[off:off + size].tobytes())
            elif kind == "push":       # to another stage, through its transport: stage to stage
                _, bid, off, size, transport, dst_bid, dst_off = op
                transport([("write", dst_bid, dst_off, self.buffers[bid].data[off:off + size].tobytes())])
            elif kind == "memset":
                _, bid, off, size, value = op
                self.buffers[bid].data[off:off + size] = value
            elif kind == "alloc":
                self.buffers[op[1]] = self.buft.alloc_buffer(op[2], BufferUsage.COMPUTE)
            elif kind == "alloc_weight":
                _, bid, name, nbytes = op
                data = self.weights(name)
                if data.nbytes != nbytes:
                    raise ValueError(f"the stage's copy of {name} has {data.nbytes} bytes, the model's {nbytes}")
                self.buffers[bid] = self.buft.buffer_from_host(data, BufferUsage.WEIGHTS)
            elif kind == "free":
                self.buffers.pop(op[1], None)
            elif kind == "plan":
                self.plans[op[1]] = self.backend.graph_plan_create(self._build(op[2]))
                while len(self.plans) > MAX_PLANS:
                    self.plans.popitem(last=False)
            else:
                raise ValueError(f"unknown stage operation {kind!r}")
        return out

    def _build(self, records) -> list[Tensor]:
        ts: list[Tensor] = []
        nodes = []
        for (ty, ne, nb, op, params, srcs, vs, voffs, name, flags, mem, is_node) in records:
            t = Tensor(ty, ne, nb, op=op, src=[ts[i] if i >= 0 else None for i in srcs], op_params=params,
                       view_src=ts[vs] if vs >= 0 else None, view_offs=voffs, name=name)
            t.flags = Flags(flags)
            if mem is not None:
                t.buffer, t.offs = self.buffers[mem[0]], mem[1]
            ts.append(t)
            if is_node:
                nodes.append(t)
        return nodes
