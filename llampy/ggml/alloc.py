"""The graph allocator (ggml-alloc): one buffer per buffer type, offsets by lifetime.

Lifetimes: walking the nodes in execution order, a tensor that owns memory lives from the node that produces it
to the last node that reads it or a view of it (a view's readers count for the tensor that owns the memory).
INPUT tensors and leafs without storage are placed first and live for the whole graph; OUTPUT tensors (and the
``keep_ids`` a caller names) are never freed; tensors that already have storage (weights, the KV cache) are not
touched. Offsets come from a best-fit free list over one growing address space (ggml's dynamic tallocr), with the
buffer type's alignment. Element-wise and row-wise results may take over a source's block when that source dies at
this node (same layout, not a view, not INPUT/OUTPUT/WEIGHT): ggml's in-place reuse.

A plan is kept: ``alloc_graph`` on a graph with the same structure places the tensors at the planned offsets
again without planning (``n_plans`` counts real plans). With ``debug`` (or LLAMPY_ALLOC_DEBUG=1) the caller runs
the graph node by node and calls ``poison_after(i)``, which fills the regions that died at node i with 0xFF
bytes (NaN as F32): a plan that let a live tensor be overwritten then shows up as a wrong result.
"""
from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field

from .backend import Buffer, BufferType, BufferUsage, tensor_alloc
from .tensor import BINARY_OPS, Flags, Op, Tensor, UNARY_OPS, VIEW_OPS

# ops whose result may overwrite a source of the same layout: each output element depends only on the same
# element (or the same row) of the sources, and every kernel reads a row before it writes it (ggml_op_can_inplace)
INPLACE_OPS = frozenset(UNARY_OPS | BINARY_OPS | {
    Op.SCALE, Op.CLAMP, Op.SOFTCAP, Op.RMS_NORM, Op.RMS_NORM_MUL, Op.NORM, Op.L2_NORM, Op.SOFT_MAX, Op.ROPE,
    Op.SWIGLU, Op.GEGLU})
# of those, the ones where any source (not only the first) may give its memory: purely element-wise in all sources
_ANY_SRC_INPLACE = frozenset(BINARY_OPS | {Op.SWIGLU, Op.GEGLU})

_KEEP = Flags.INPUT | Flags.OUTPUT | Flags.WEIGHT

# compute buffers made by graph allocators: a tensor placed in one by an earlier plan may be placed again, while a
# tensor in any other buffer (weights, KV cache, a user's buffer) has storage of its own and is left alone
_COMPUTE_BUFFERS: "weakref.WeakSet[Buffer]" = weakref.WeakSet()


def _align(n: int, a: int) -> int:
    return (max(n, 1) + a - 1) // a * a


def owner(t: Tensor) -> Tensor:
    return t.view_src if t.view_src is not None else t


def has_own_storage(t: Tensor) -> bool:
    """The memory owner of t was placed by someone other than a graph allocator (weights, KV cache)."""
    buf = owner(t).buffer
    return buf is not None and buf not in _COMPUTE_BUFFERS


def needs_alloc(t: Tensor) -> bool:
    """t owns its memory and nobody but a graph allocator placed it."""
    if t.view_src is not None or t.op in VIEW_OPS:
        return False
    return t.buffer is None or t.buffer in _COMPUTE_BUFFERS


class _FreeList:
    """Best-fit over free blocks of one address space that grows at the top; ``high`` is the size reached."""

    def __init__(self, alignment: int):
        self.alignment = alignment
        self.blocks: list[list[int]] = []     # [offset, size], sorted by offset, never adjacent
        self.top = 0
        self.high = 0

    def alloc(self, nbytes: int) -> int:
        size = _align(nbytes, self.alignment)
        best = None
        for i, (_, sz) in enumerate(self.blocks):
            if sz >= size and (best is None or sz < self.blocks[best][1]):
                best = i
        if best is None:
            off = self.top
            self.top += size
            self.high = max(self.high, self.top)
            return off
        off, sz = self.blocks[best]
        if sz == size:
            self.blocks.pop(best)
        else:
            self.blocks[best] = [off + size, sz - size]
        return off

    def free(self, off: int, nbytes: int) -> None:
        size = _align(nbytes, self.alignment)
        self.blocks.append([off, size])
        self.blocks.sort()
        merged: list[list[int]] = []
        for b in self.blocks:
            if merged and merged[-1][0] + merged[-1][1] == b[0]:
                merged[-1][1] += b[1]
            else:
                merged.append(b)
        if merged and merged[-1][0] + merged[-1][1] == self.top:   # a free block at the top shrinks the top
            self.top = merged.pop()[0]
        self.blocks = merged


@dataclass
class AllocPlan:
    signature: tuple = ()
    placements: list = field(default_factory=list)   # (position in the collected tensor order, offset)
    offsets: dict = field(default_factory=dict)      # tensor id -> offset, for the tensors planned
    lifetimes: dict = field(default_factory=dict)    # tensor id -> (first node, last node); -1 = before the nodes
    frees: dict = field(default_factory=dict)        # node index -> [(offset, nbytes)] that die after it runs
    size: int = 0                                    # the buffer this plan needs
    naive_size: int = 0                              # every tensor its own (aligned) memory
    n_inplace: int = 0


def collect(nodes, leafs=()) -> list[Tensor]:
    """Leafs, then for each node its not-yet-seen sources and itself: the order positions refer to."""
    order: list[Tensor] = []
    seen: set[int] = set()

    def add(t):
        if t.id not in seen:
            seen.add(t.id)
            order.append(t)
    for t in leafs:
        add(t)
    for n in nodes:
        for s in n.src:
            if s is not None:
                add(owner(s))
                add(s)
        if n.view_src is not None:
            add(n.view_src)
        add(n)
    return order


def signature(order: list[Tensor], node_ids, owns, keep_ids) -> tuple:
    """What the plan depends on: each tensor's layout, flags, placement duty and sources, by position."""
    pos = {t.id: i for i, t in enumerate(order)}
    sig = []
    for t in order:
        srcs = tuple(pos.get(s.id, -1) if s is not None else -2 for s in t.src) if t.id in node_ids else ()
        sig.append((t.op, t.type, t.ne, t.nb, int(t.flags), t.view_offs, pos.get(owner(t).id, -1),
                    needs_alloc(t) and owns(t), t.id in node_ids, t.id in keep_ids, srcs))
    return tuple(sig)


class GraphAllocator:
    """Plans and places a graph's intermediate tensors in one buffer of ``buft``.

    ``break_lifetimes`` is a test hook: it frees each tensor after its *first* reader, a wrong plan that the
    debug poisoning must catch.
    """

    def __init__(self, buft: BufferType, debug: bool | None = None, break_lifetimes: bool = False):
        self.buft = buft
        self.debug = bool(int(os.environ.get("LLAMPY_ALLOC_DEBUG", "0") or 0)) if debug is None else debug
        self.break_lifetimes = break_lifetimes
        self.buffer: Buffer | None = None
        self.plan_: AllocPlan | None = None
        self.n_plans = 0         # real plans made
        self.n_reuses = 0        # alloc_graph calls answered by the kept plan

    # ------------------------------------------------------------------ planning
    def plan(self, nodes, leafs=(), keep_ids=frozenset(), owns=None) -> AllocPlan:
        """Offsets for every tensor of ``nodes``/``leafs`` (and their sources) that needs memory and that ``owns``
        accepts (the scheduler plans one buffer per device over the whole graph's order this way)."""
        nodes = list(nodes)
        owns = owns or (lambda t: True)
        order = collect(nodes, leafs)
        node_ids = {n.id for n in nodes}
        p = AllocPlan(signature=signature(order, node_ids, owns, keep_ids))
        align = self.buft.get_alignment()
        mine = lambda t: needs_alloc(t) and owns(t)
        kept = lambda t: bool(t.flags & _KEEP) or t.id in keep_ids

        # when each memory owner is read for the last (or, broken on purpose, the first) time
        end: dict[int, int] = {}
        for i, n in enumerate(nodes):
            reads = [owner(s) for s in n.src if s is not None]
            if n.view_src is not None:
                reads.append(n.view_src)
            for o in reads:
                if not (self.break_lifetimes and o.id in end):
                    end[o.id] = i

        fl = _FreeList(align)
        live: dict[int, Tensor] = {}
        pinned: set[int] = set()
        position = {t.id: i for i, t in enumerate(order)}

        def place(t, off=None):
            if off is None:
                off = fl.alloc(t.nbytes)
            p.offsets[t.id] = off
            p.placements.append((position[t.id], off))
            p.naive_size += _align(t.nbytes, align)
            live[t.id] = t

        # inputs and storage-less leafs (and sources from outside the node list) first, for the whole graph
        for t in order:
            if mine(t) and (t.id not in node_ids or t.flags & Flags.INPUT):
                place(t)
                pinned.add(t.id)
                p.lifetimes[t.id] = (-1, len(nodes) - 1)
        for i, n in enumerate(nodes):
            if mine(n) and n.id not in p.offsets:
                parent = self._inplace_parent(n, i, live, pinned, end, kept)
                if parent is not None:
                    off = p.offsets[parent.id]
                    del live[parent.id]
                    place(n, off)
                    p.n_inplace += 1
                else:
                    place(n)
                p.lifetimes[n.id] = (i, i)
            freed = []
            dying = {o.id: o for o in (owner(s) for s in n.src if s is not None)}
            if n.view_src is not None:
                dying[n.view_src.id] = n.view_src
            if n.id not in end:          # a result nobody reads dies at once (unless kept)
                dying[n.id] = n
            for o in dying.values():
                if o.id in live and end.get(o.id, i) == i and o.id not in pinned and not kept(o):
                    del live[o.id]
                    fl.free(p.offsets[o.id], o.nbytes)
                    freed.append((p.offsets[o.id], o.nbytes))
                    p.lifetimes[o.id] = (p.lifetimes[o.id][0], i)
            if freed:
                p.frees[i] = freed
        for tid in live:
            if tid not in pinned:
                p.lifetimes[tid] = (p.lifetimes[tid][0], len(nodes) - 1)
        p.size = fl.high
        return p

    def _inplace_parent(self, n: Tensor, i: int, live, pinned, end, kept) -> Tensor | None:
        if n.op not in INPLACE_OPS:
            return None
        cands = n.src if n.op in _ANY_SRC_INPLACE else n.src[:1]
        for s in cands:
            if (s is None or s.view_src is not None or s.id not in live or s.id in pinned or kept(s)
                    or end.get(s.id) != i or (s.type, s.ne, s.nb) != (n.type, n.ne, n.nb)):
                continue
            # a second source that is a view of the same memory (at another offset) would be overwritten under it
            if any(o is not s and o is not None and owner(o) is s for o in n.src):
                continue
            return s
        return None

    # ------------------------------------------------------------------ placing
    def alloc_graph(self, graph_or_nodes, leafs=None, keep_ids=frozenset(), owns=None) -> AllocPlan:
        """Plan (or reuse the kept plan of a graph with the same structure) and place the tensors."""
        if hasattr(graph_or_nodes, "nodes"):
            nodes, leafs = graph_or_nodes.nodes, graph_or_nodes.leafs if leafs is None else leafs
        else:
            nodes, leafs = list(graph_or_nodes), leafs or ()
        owns_ = owns or (lambda t: True)
        order = collect(nodes, leafs)
        sig = signature(order, {n.id for n in nodes}, owns_, keep_ids)
        if self.plan_ is not None and self.plan_.signature == sig:
            self.n_reuses += 1
            p = self.plan_
        else:
            p = self.plan(nodes, leafs, keep_ids, owns)
            self.n_plans += 1
            self.plan_ = p
        self.place(p, order)
        return p

    def place(self, p: AllocPlan, order: list[Tensor]) -> Buffer:
        """Put the plan's tensors (``order`` as ``collect`` gives it) in this allocator's buffer, growing it."""
        if self.buffer is None or self.buffer.size < p.size:
            self.buffer = self.buft.alloc_buffer(max(p.size, 1), BufferUsage.COMPUTE)
            _COMPUTE_BUFFERS.add(self.buffer)
        for pos, off in p.placements:
            tensor_alloc(self.buffer, order[pos], off)
        return self.buffer

    def poison_after(self, node_index: int, p: AllocPlan | None = None) -> None:
        """Debug: fill the regions that died after node ``node_index`` with 0xFF bytes (NaN as F32)."""
        p = p or self.plan_
        if p is None or self.buffer is None:
            return
        for off, n in p.frees.get(node_index, ()):
            self.buffer.memset(off, n, 0xFF)


def plan_summary(p: AllocPlan) -> str:
    saved = 1 - p.size / p.naive_size if p.naive_size else 0.0
    return (f"planned {p.size} bytes vs naive {p.naive_size} ({saved:.0%} saved), "
            f"{len(p.placements)} tensors, {p.n_inplace} in place")
