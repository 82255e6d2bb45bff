"""The graph allocator (ggml-alloc): one buffer per buffer type, offsets by lifetime.

Walking the nodes in execution order, each tensor that needs memory gets a best-fit block from a free list when it
is produced and gives it back after its last reader (a view's readers count for the tensor that owns the
memory). Element-wise results may take over their first source's block when that source dies at this node.
INPUT tensors and storage-less leafs are placed first and live for the whole graph; OUTPUT tensors are never
freed; tensors that already have storage (weights, the KV cache) are left alone. The planned size is reported
against the naive sum. With ``debug`` (or LLAMPY_ALLOC_DEBUG=1), the regions freed after each node are filled
with NaN bytes while the graph runs, so a plan that overwrote a live tensor shows up as a wrong result.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from .backend import BufferType, BufferUsage, Buffer, tensor_alloc
from .tensor import Flags, Op, Tensor, VIEW_OPS, UNARY_OPS, BINARY_OPS

# ops whose result may overwrite their first source (same size, element-wise or row-wise)
INPLACE_OPS = frozenset(UNARY_OPS | BINARY_OPS | {Op.SCALE, Op.CLAMP, Op.SOFTCAP, Op.RMS_NORM, Op.RMS_NORM_MUL,
                                                   Op.NORM, Op.L2_NORM, Op.SOFT_MAX, Op.ROPE, Op.SWIGLU, Op.GEGLU})


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


class _FreeList:
    """Best-fit allocator over one growing address space."""

    def __init__(self, alignment: int):
        self.alignment = alignment
        self.blocks: list[list[int]] = []   # [offset, size], sorted by offset
        self.top = 0

    def alloc(self, size: int) -> int:
        size = _align(max(size, 1), self.alignment)
        best = None
        for i, (off, sz) in enumerate(self.blocks):
            if sz >= size and (best is None or sz < self.blocks[best][1]):
                best = i
        if best is not None:
            off, sz = self.blocks[best]
            if sz == size:
                self.blocks.pop(best)
            else:
                self.blocks[best] = [off + size, sz - size]
            return off
        off = self.top
        self.top += size
        return off

    def free(self, off: int, size: int) -> None:
        size = _align(max(size, 1), self.alignment)
        self.blocks.append([off, size])
        self.blocks.sort()
        merged = []
        for b in self.blocks:
            if merged and merged[-1][0] + merged[-1][1] == b[0]:
                merged[-1][1] += b[1]
            else:
                merged.append(b)
        if merged and merged[-1][0] + merged[-1][1] == self.top:
            self.top = merged[-1][0]
            merged.pop()
        self.blocks = merged


@dataclass
class AllocPlan:
    offsets: dict = field(default_factory=dict)      # tensor id -> offset
    size: int = 0
    naive_size: int = 0
    frees: dict = field(default_factory=dict)        # node index -> [(offset, nbytes)] freed after it runs
    n_inplace: int = 0


def needs_alloc(t: Tensor) -> bool:
    return t.view_src is None and t.buffer is None and t.op not in VIEW_OPS


class GraphAllocator:
    def __init__(self, buft: BufferType, debug: bool | None = None):
        self.buft = buft
        self.debug = bool(int(os.environ.get("LLAMPY_ALLOC_DEBUG", "0"))) if debug is None else debug
        self.buffer: Buffer | None = None
        self.plan_: AllocPlan | None = None
        self.n_plans = 0

    def plan(self, nodes: list[Tensor], leafs: list[Tensor] = (), keep_ids=frozenset()) -> AllocPlan:
        """Offsets for every tensor of ``nodes``/``leafs`` that needs memory (see module doc)."""
        p = AllocPlan()
        fl = _FreeList(self.buft.alignment)
        owned = {}
        last_use: dict[int, int] = {}
        for i, n in enumerate(nodes):
            for s in n.src:
                if s is not None:
                    last_use[s.storage.id] = i
            if n.view_src is not None:
                last_use[n.view_src.id] = max(last_use.get(n.view_src.id, -1), i)
        keep = lambda t: bool(t.flags & (Flags.INPUT | Flags.OUTPUT | Flags.WEIGHT)) or t.id in keep_ids

        def place(t):
            off = fl.alloc(t.nbytes)
            p.offsets[t.id] = off
            owned[t.id] = (t, off)
            p.naive_size += _align(max(t.nbytes, 1), self.buft.alignment)

        for t in list(leafs) + [n for n in nodes if n.flags & Flags.INPUT]:
            if needs_alloc(t) and t.id not in p.offsets:
                place(t)
        for i, n in enumerate(nodes):
            if needs_alloc(n) and n.id not in p.offsets:
                src0 = n.src[0] if n.src else None
                if (n.op in INPLACE_OPS and src0 is not None and src0.view_src is None and src0.id in owned
                        and last_use.get(src0.id) == i and not keep(src0) and src0.nbytes == n.nbytes
                        and src0.type == n.type):
                    off = owned.pop(src0.id)[1]
                    p.offsets[n.id] = off
                    owned[n.id] = (n, off)
                    p.naive_size += _align(max(n.nbytes, 1), self.buft.alignment)
                    p.n_inplace += 1
                    last_use.setdefault(n.id, i)
                else:
                    place(n)
            freed = []
            for s in {s.storage.id: s.storage for s in n.src if s is not None}.values():
                if last_use.get(s.id) == i and s.id in owned and not keep(s):
                    t, off = owned.pop(s.id)
                    fl.free(off, t.nbytes)
                    freed.append((off, t.nbytes))
            # a result nobody reads (and not an output) dies at once
            if n.id in owned and n.id not in last_use and not keep(n):
                t, off = owned.pop(n.id)
                fl.free(off, t.nbytes)
                freed.append((off, t.nbytes))
            if freed:
                p.frees[i] = freed
        p.size = max(fl.top, max((off + _align(t.nbytes, self.buft.alignment) for t, off in owned.values()), default=0))
        p.size = max(p.size, max((o + _align(max(t.nbytes, 1), self.buft.alignment)
                                  for t, o in ((t, p.offsets[t.id]) for t in _all(nodes, leafs) if t.id in p.offsets)),
                                 default=0))
        return p

    def alloc_graph(self, nodes: list[Tensor], leafs: list[Tensor] = (), keep_ids=frozenset()) -> AllocPlan:
        """Plan the nodes and place their tensors in this allocator's buffer. ``keep_ids``: tensors read later
        by another device's split (never freed here)."""
        p = self.plan(nodes, leafs, keep_ids)
        self.n_plans += 1
        if self.buffer is None or self.buffer.size < p.size:
            self.buffer = self.buft.alloc_buffer(max(p.size, 1), BufferUsage.COMPUTE)
        for t in _all(nodes, leafs):
            if t.id in p.offsets:
                tensor_alloc(self.buffer, t, p.offsets[t.id])
        self.plan_ = p
        return p

    def poison_after(self, node_index: int) -> None:
        """Debug: fill the regions freed after node ``node_index`` with NaN bytes."""
        if self.plan_ is None or self.buffer is None:
            return
        for off, n in self.plan_.frees.get(node_index, ()):
            self.buffer.data[off:off + n] = 0xFF


def _all(nodes, leafs):
    return list(leafs) + list(nodes)
