"""The graph scheduler (ggml_backend_sched): places each node on a backend, cuts the graph into splits, copies the
tensors that cross devices, allocates one compute buffer per buffer type, and keeps all of it while the graph holds.

Backends come in priority order: the first is preferred, the last is usually the CPU. The passes are numbered as in
``_split_graph``. A split's nodes read the *copies* of their inputs from other devices: the scheduler rewrites
``node.src`` to point at the copy, a DUP tensor marked ``sched_copy`` whose source is the original, so the
rewritten graph still says what it computes, and a later plan can undo the rewrite. Copies are refreshed before
their split on every run. ``LLAMPY_SCHED_DEBUG=1`` prints each split, each node's backend and the cause of the
choice (ggml's GGML_SCHED_DEBUG); causes:
  0.rows           the gathering of a product's rows from the devices that hold a row-split weight (pass 0): no
                   kernel, the scheduler copies each device's rows into their slice of the node (a split of its own)
  1.dst / 1.vsrc   the node's own memory (a KV-cache write, a view of a weight) lives in the backend's buffer
  1.wgt<j>         source j is a weight in the backend's buffer          1.off   offloaded from the CPU (offload_op)
  2.<up|down>      expanded from a neighbour (2.gpu-*: from a non-last backend, first)
  3.prio           the highest-priority backend that supports the op
  inp.user / inp.last   an input lives with its first reader when that backend's memory is host memory, else on
                   the last backend (as ggml does: the caller's tensor_set is then a host write, and the scheduler
                   uploads the input with the split's other copies)
  leaf.user / view   a storage-less leaf goes with its first reader; a view goes with its memory's owner
  <cause>+f        the node became a fused node when its backend optimized its split (pass 5)
Data moves only through the buffer interface (``tensor_copy``): the scheduler never touches device memory itself.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

from .alloc import GraphAllocator, collect, has_own_storage, owner
from .backend import Backend, BufferUsage, tensor_copy
from . import ops
from .graph import Graph
from .tensor import Flags, Op, Tensor, VIEW_OPS


def _name(t: Tensor) -> str:
    return t.name or f"#{t.id}"


def is_sched_copy(t: Tensor) -> bool:
    return t.op is Op.DUP and bool(t.op_params.get("sched_copy"))


def is_row_gather(t: Tensor) -> bool:
    """A product's rows gathered from the devices of a row-split weight (pass 0): a CONCAT along dim 0 of its
    sources that no backend runs; the scheduler copies each source into its rows of the node."""
    return t.op is Op.CONCAT and "sched_gather" in t.op_params


@dataclass
class Split:
    backend: Backend
    backend_id: int
    nodes: list = field(default_factory=list)     # in graph order, views included
    inputs: list = field(default_factory=list)    # original tensors copied in before this split runs
    copies: list = field(default_factory=list)    # (src, copy) pairs of the current copy set
    step0: int = 0                                # index of the split's first step in the allocation order
    plan: object = None                           # graph_plan_create's result (or the node list)
    gathers: list = field(default_factory=list)   # a row gathering's split: (device's rows, their view of the node)


@dataclass
class SchedPlan:
    splits: list
    assignment: dict            # tensor id -> backend index (nodes, leafs, views, copies)
    causes: dict                # tensor id -> cause of the choice
    n_copies: int               # copy tensors per copy set
    steps: list                 # allocation order: each split's copies, then its nodes
    allocators: list            # one per distinct buffer type
    alloc_plans: list
    orders: list                # per allocator, the tensor order its plan's positions refer to
    buffers: list               # per allocator, the buffer the tensors were placed in
    copy_sets: list             # per copy index: {(src id, backend id): copy tensor}
    rewrites: list              # (node, src index, src, backend id): node.src[j] reads the copy of src
    split_plans: dict           # copy index -> [plan per split]
    signature: tuple = ()


class Scheduler:
    def __init__(self, backends: list[Backend], n_copies: int = 1, debug: bool | None = None):
        if not backends:
            raise ValueError("the scheduler needs at least one backend")
        if n_copies < 1:
            raise ValueError("n_copies must be >= 1")
        self.backends = list(backends)
        self.n_copies = int(n_copies)
        self.debug = bool(int(os.environ.get("LLAMPY_SCHED_DEBUG", "0") or 0)) if debug is None else debug
        self.bufts = [b.get_default_buffer_type() for b in self.backends]
        # one allocator per distinct buffer type: backends sharing memory share a compute buffer
        self._alloc_index: list[int] = []
        self._allocators: list[GraphAllocator] = []
        for bt in self.bufts:
            for k, al in enumerate(self._allocators):
                if al.buft is bt:
                    self._alloc_index.append(k)
                    break
            else:
                self._alloc_index.append(len(self._allocators))
                self._allocators.append(GraphAllocator(bt))
        self._plans: dict[int, tuple[Graph, SchedPlan]] = {}
        self._last: SchedPlan | None = None
        self.cur_copy = 0
        self.n_replans = 0
        # ggml_backend_sched_set_eval_callback: cb_eval(node, ask) -> bool. With ask=True it says whether it wants
        # the node; if so it is called again with ask=False once the node is computed (its sources still alive)
        self.cb_eval = None

    # ------------------------------------------------------------------ backend helpers (defaults for fakes)
    def _supports_op(self, b: int, node: Tensor) -> bool:
        return node.op in VIEW_OPS or bool(self.backends[b].supports_op(node))

    def _supports_buft(self, b: int, buft) -> bool:
        f = getattr(self.backends[b], "supports_buft", None)
        return f(buft) if f else buft is self.bufts[b] or getattr(buft, "device", None) == self.bufts[b].device

    def _backend_of_buffer(self, buf, node: Tensor | None) -> int | None:
        """The first backend that can use ``buf`` (and run ``node``, if given)."""
        for b in range(len(self.backends)):
            if self._supports_buft(b, buf.buft) and (node is None or self._supports_op(b, node)):
                return b
        return None

    # ------------------------------------------------------------------ assignment (passes 1-3)
    def _assign(self, g: Graph, pre: dict | None = None):
        nb = len(self.backends)
        last = nb - 1
        assign: dict[int, int] = dict(pre or {})
        cause: dict[int, str] = {i: "0.rows" for i in assign}
        compute = [n for n in g.nodes if n.op not in VIEW_OPS]

        # 1. pre-assign nodes whose own memory or whose weights live in a backend's buffer (if it runs the op)
        for n in compute:
            if n.id in assign:
                continue
            if has_own_storage(n):
                b = self._backend_of_buffer(owner(n).buffer, n)
                if b is None:
                    raise RuntimeError(f"{n!r} writes into {owner(n).buffer!r}, whose backends cannot run {n.op.value}")
                assign[n.id], cause[n.id] = b, "1.dst" if n.view_src is None else "1.vsrc"
                continue
            if n.op in (Op.ROPE, Op.FLASH_ATTN_EXT):   # their small side tensors say nothing about placement
                continue
            for j, s in enumerate(n.src):
                if s is None or not has_own_storage(s):
                    continue
                o = owner(s)
                if not (o.flags & Flags.WEIGHT or o.buffer.usage == BufferUsage.WEIGHTS):
                    continue
                b = self._backend_of_buffer(o.buffer, n)
                if b is None:
                    continue
                if b == last and nb > 1 and getattr(o.buffer.buft, "is_host", True):
                    for hb in range(last):
                        if self._supports_op(hb, n) and getattr(self.backends[hb], "offload_op", lambda _: False)(n):
                            b, cause[n.id] = hb, "1.off"
                            break
                assign[n.id] = b
                cause.setdefault(n.id, f"1.wgt{j}")
                break

        # 2. expand to neighbours where the backend runs the op, to keep splits few: first the non-last
        #    backends down then up (the CPU never spreads over accelerator work), then all backends
        def expand(order, tag, skip_last):
            cur = None
            for n in order:
                if n.id in assign:
                    cur = None if (skip_last and assign[n.id] == last) else assign[n.id]
                elif cur is not None and self._supports_op(cur, n):
                    assign[n.id], cause[n.id] = cur, tag
        if nb > 1:
            expand(compute, "2.gpu-down", True)
            expand(reversed(compute), "2.gpu-up", True)
        expand(compute, "2.down", False)
        expand(reversed(compute), "2.up", False)

        # 3. the rest: the highest-priority backend that supports the op
        for n in compute:
            if n.id not in assign:
                for b in range(nb):
                    if self._supports_op(b, n):
                        assign[n.id], cause[n.id] = b, "3.prio"
                        break
                else:
                    raise RuntimeError(f"no backend supports {n!r}")

        # leafs: storage decides; an input without storage lives with its first reader if that memory is host
        # memory (llampy writes inputs through host arrays), else on the last backend; other leafs with their reader
        first_reader: dict[int, int] = {}
        for n in compute:
            for s in n.src:
                if s is not None:
                    first_reader.setdefault(owner(s).id, assign[n.id])
            if n.view_src is not None:
                first_reader.setdefault(n.view_src.id, assign[n.id])
        for t in g.leafs:
            if has_own_storage(t):
                b = self._backend_of_buffer(t.buffer, None)
                assign[t.id], cause[t.id] = (last if b is None else b), "leaf.buf"
            elif t.flags & Flags.INPUT:
                b = first_reader.get(t.id, last)
                if getattr(self.bufts[b], "is_host", True):
                    assign[t.id], cause[t.id] = b, "inp.user"
                else:
                    assign[t.id], cause[t.id] = last, "inp.last"
            else:
                assign[t.id], cause[t.id] = first_reader.get(t.id, last), "leaf.user"
        # views belong to the backend of the memory they view
        for n in g.nodes:
            if n.op in VIEW_OPS:
                o = owner(n)
                if o.id not in assign:       # a view of something outside the graph
                    b = self._backend_of_buffer(o.buffer, None) if has_own_storage(o) else None
                    assign[o.id] = last if b is None else b
                assign[n.id], cause[n.id] = assign[o.id], "view"
        return assign, cause

    # ------------------------------------------------------------------ splits, copies, allocation (passes 4-6)
    def _home_buft(self, s: Tensor, assign):
        o = owner(s)
        if has_own_storage(o):
            return o.buffer.buft
        return self.bufts[assign[o.id]]

    def _expand_row_splits(self, g: Graph) -> dict:
        """0. A product over a weight split by rows across devices (split.py, split_mode 'row') becomes one
        product per device over its rows, each where its rows live (pass 1's weight rule), and their
        gathering on the split's main backend: the node itself becomes the gathering (``is_row_gather``), so its
        readers and flags stay as they were. Returns the gatherings' backends."""
        pre: dict = {}
        nodes = []
        changed = False
        for n in g.nodes:
            if is_row_gather(n):            # expanded by an earlier plan
                pre[n.id] = self.backends.index(n.op_params["sched_main"])
                nodes.append(n)
                continue
            split = [s for s in n.src if s is not None and hasattr(owner(s).buffer, "parts_of")]
            if not split:
                nodes.append(n)
                continue
            w = n.src[0]
            if n.op is not Op.MUL_MAT or split != [w] or w.view_src is not None:
                raise RuntimeError(f"{n!r} reads a weight split by rows ({_name(split[0])}): only a matrix "
                                   f"product over the whole matrix can (split_mode 'row')")
            buf = w.buffer
            main = next((b for b in range(len(self.backends)) if self.backends[b] is buf.buft.main), None)
            if main is None:
                raise RuntimeError(f"{_name(w)} is split across devices whose main backend is not scheduled here")
            changed = True
            parts = buf.parts_of(w)
            if len(parts) == 1:    # one device holds every row
                n.src[0] = parts[0][1]
                nodes.append(n)
                continue
            ys = [ops.mul_mat(p, n.src[1]) for _, p, _, _ in parts]
            for y, (b, _, r0, r1) in zip(ys, parts):
                y.name = f"{_name(n)}[{r0}:{r1}]@{b.device}"
            nodes.extend(ys)
            n.op, n.src = Op.CONCAT, ys
            n.op_params = {"dim": 0, "sched_gather": [(r0, r1) for _, _, r0, r1 in parts],
                           "sched_main": buf.buft.main}
            nodes.append(n)
            pre[n.id] = main
        if changed:
            g.nodes = nodes
            g._seen.update(t.id for t in nodes)
            # the split weights leave the leafs (nothing reads them now), their slices join them
            split = [t for t in g.leafs if hasattr(t.buffer, "parts_of")]
            g.leafs = [t for t in g.leafs if not hasattr(t.buffer, "parts_of")]
            g.leafs += [p for t in split for _, p, _, _ in t.buffer.parts_of(t)]
            g._seen.update(t.id for t in g.leafs)
        return pre

    def _split_graph(self, g: Graph) -> SchedPlan:
        self._undo_rewrites(g)
        assign, cause = self._assign(g, self._expand_row_splits(g))

        # 4. cut into splits (maximal runs of non-view nodes on one backend; views ride along)
        splits: list[Split] = []
        pending_views = []
        for n in g.nodes:
            if n.op in VIEW_OPS:
                (splits[-1].nodes if splits else pending_views).append(n)
                continue
            b = assign[n.id]
            gather = is_row_gather(n)
            if not splits or splits[-1].backend_id != b or gather or splits[-1].gathers:
                splits.append(Split(self.backends[b], b))
            if gather:      # a split of its own: the scheduler's copies into the node's rows, no kernel
                splits[-1].gathers = [(y, ops.view(n, (r1 - r0,) + n.ne[1:], n.nb[1:], r0 * n.nb[0]))
                                      for y, (r0, r1) in zip(n.src, n.op_params["sched_gather"])]
            if pending_views:
                splits[-1].nodes.extend(pending_views)
                pending_views = []
            splits[-1].nodes.append(n)
        if not splits:
            splits.append(Split(self.backends[-1], len(self.backends) - 1, pending_views))

        # 5. each backend rewrites its own splits (ggml's graph_optimize: fusion of what it runs)
        self._optimize_splits(g, splits, assign, cause)

        # then give each split a copy of every input that lives where its backend cannot read
        copy_sets: list[dict] = [{} for _ in range(self.n_copies)]
        rewrites = []
        for sp in splits:
            b = sp.backend_id
            for n in sp.nodes:
                if n.op in VIEW_OPS or sp.gathers:     # a gathering reads the devices' rows where they are
                    continue
                for j, s in enumerate(n.src):
                    if s is None:
                        continue
                    if self._supports_buft(b, self._home_buft(s, assign)):
                        continue
                    if n.view_src is not None and owner(s) is n.view_src:
                        raise RuntimeError(f"{n!r} on {self.backends[b]!r} writes into memory of another device")
                    key = (s.id, b)
                    if key not in copy_sets[0]:
                        for k in range(self.n_copies):
                            c = Tensor(s.type, s.ne, op=Op.DUP, src=[s], op_params={"sched_copy": True},
                                       name=f"{self.backends[b].device}#{_name(s)}#{k}")
                            if self.n_copies > 1:      # each set must survive until its next use
                                c.flags |= Flags.OUTPUT
                            copy_sets[k][key] = c
                            assign[c.id], cause[c.id] = b, "copy"
                        sp.inputs.append(s)
                    rewrites.append((n, j, s, b))
        n_copies = len(copy_sets[0])
        self._apply_rewrites(rewrites, copy_sets[0])
        self.cur_copy = 0

        # 6. allocate: one order of steps (each split's copies, then its nodes), one plan per buffer type over it
        steps = []
        for sp in splits:
            sp.step0 = len(steps)
            sp.copies = [(s, copy_sets[0][(s.id, sp.backend_id)]) for s in sp.inputs]
            steps.extend(c for _, c in sp.copies)
            steps.extend(sp.nodes)
        extra_copies = [c for cs in copy_sets[1:] for c in cs.values()]   # the other sets: allocated as leafs
        alloc_plans, orders, buffers = [], [], []
        for k, al in enumerate(self._allocators):
            def owns(t, k=k):
                b = assign.get(owner(t).id)
                return b is not None and self._alloc_index[b] == k
            leafs = list(g.leafs) + extra_copies
            alloc_plans.append(al.alloc_graph(steps, leafs, owns=owns))
            orders.append(collect(steps, leafs))
            buffers.append(al.buffer)
        plan = SchedPlan(splits, assign, cause, n_copies, steps, list(self._allocators), alloc_plans, orders,
                         buffers, copy_sets, rewrites, {}, self._signature(g))
        self._create_split_plans(plan)
        if self.debug:
            print(self.dump(g, plan), file=sys.stderr)
        return plan

    @staticmethod
    def _optimize_splits(g: Graph, splits: list, assign: dict, cause: dict) -> None:
        """Pass 5: a backend may rewrite the nodes of its splits (a fused node keeps the place and identity of its
        pattern's last node); the graph's node list becomes the splits' lists. New nodes (helper views) go with the
        memory they view."""
        for sp in splits:
            opt = getattr(sp.backend, "graph_optimize", None)
            if opt is None or sp.gathers:
                continue
            ops_before = {n.id: n.op for n in sp.nodes}
            new = opt(g.nodes, sp.nodes)
            if len(new) == len(sp.nodes) and all(a is b and a.op is ops_before[a.id] for a, b in zip(new, sp.nodes)):
                continue
            for n in new:
                if n.id not in ops_before:
                    assign[n.id] = assign.get(owner(n).id, sp.backend_id)
                    cause[n.id] = "view" if n.op in VIEW_OPS else "new"
                elif n.op is not ops_before[n.id]:
                    cause[n.id] = f"{cause.get(n.id, '')}+f"
            sp.nodes = list(new)
            g.nodes = [n for s in splits for n in s.nodes]
            g._seen.update(n.id for n in new)

    def _apply_rewrites(self, rewrites, copies: dict) -> None:
        for n, j, s, b in rewrites:
            n.src[j] = copies[(s.id, b)]

    @staticmethod
    def _undo_rewrites(g: Graph) -> None:
        """Point nodes back at the originals of the copies an earlier plan (of any scheduler) made them read."""
        for n in g.nodes:
            for j, s in enumerate(n.src):
                if s is not None and is_sched_copy(s):
                    n.src[j] = s.src[0]

    def _create_split_plans(self, p: SchedPlan) -> None:
        if self.n_copies > 1:      # the plans bind the sources the nodes read now: the current copy set
            self._apply_rewrites(p.rewrites, p.copy_sets[self.cur_copy])
        plans = []
        for sp in p.splits:
            create = getattr(sp.backend, "graph_plan_create", None)
            plans.append(create(sp.nodes) if create and not sp.gathers else sp.nodes)
        p.split_plans[self.cur_copy] = plans
        for sp, pl in zip(p.splits, plans):
            sp.plan = pl

    @staticmethod
    def _signature(g: Graph) -> tuple:
        # cheap: a Graph object only changes by growing (expand); a rebuilt graph is a new object
        return (len(g.nodes), len(g.leafs), g.nodes[-1].id if g.nodes else -1)

    # ------------------------------------------------------------------ public
    def alloc_graph(self, g: Graph) -> SchedPlan:
        """Plan the graph on first use (or when its structure changed) and make sure its tensors are placed."""
        entry = self._plans.get(id(g))
        if entry is None or entry[0] is not g or entry[1].signature != self._signature(g):
            p = self._split_graph(g)
            self._plans[id(g)] = (g, p)
            self.n_replans += 1
        else:
            p = entry[1]
            # another graph made an allocator's buffer grow: move this graph's tensors into the new buffer
            moved = False
            for k, al in enumerate(p.allocators):
                if al.buffer is not p.buffers[k]:
                    p.buffers[k] = al.place(p.alloc_plans[k], p.orders[k])
                    moved = True
            if moved:
                p.split_plans.clear()
                self._create_split_plans(p)
        self._last = p
        return p

    def graph_compute(self, g: Graph) -> None:
        p = self.alloc_graph(g)
        if self.n_copies > 1:
            self._next_copy_set(p)
        debug_alloc = any(al.debug for al in p.allocators)
        for sp in p.splits:
            for src, c in sp.copies:
                self._copy(sp.backend, src, c)
            if debug_alloc:
                self._run_poisoning(sp, p)
                continue
            if sp.gathers:
                self._gather(sp)
                continue
            if self.cb_eval is not None:
                self._run_observed(sp)
                continue
            run = getattr(sp.backend, "graph_plan_compute", None)
            if run is not None and sp.plan is not sp.nodes:
                run(sp.plan)
            else:
                sp.backend.graph_compute(sp.nodes)
        for b in self.backends:
            getattr(b, "synchronize", lambda: None)()

    def settle(self, g: Graph) -> None:
        """Have each split's plan ready for its fast run now, where its backend binds one after a first run
        (``graph_plan_settle``: the CPU's resolved kernel calls), rather than at its next run: for a caller with
        idle time that has run the graph once (Context.warm)."""
        entry = self._plans.get(id(g))
        if entry is None or entry[0] is not g:
            return
        for sp in entry[1].splits:
            settle = getattr(sp.backend, "graph_plan_settle", None)
            if settle is not None and sp.plan is not sp.nodes:
                settle(sp.plan)

    def _next_copy_set(self, p: SchedPlan) -> None:
        """Pipeline copies (ggml's n_copies): each run reads the next set of input copies."""
        self.cur_copy = (self.cur_copy + 1) % self.n_copies
        cs = p.copy_sets[self.cur_copy]
        self._apply_rewrites(p.rewrites, cs)
        for sp in p.splits:
            sp.copies = [(s, cs[(s.id, sp.backend_id)]) for s in sp.inputs]
        if self.cur_copy not in p.split_plans:
            self._create_split_plans(p)
        for sp, pl in zip(p.splits, p.split_plans[self.cur_copy]):
            sp.plan = pl

    @staticmethod
    def _copy(dst_backend: Backend, src: Tensor, dst: Tensor) -> None:
        """The destination backend's own copy if it has one (ggml's cpy_tensor_async), else tensor_copy."""
        cpy = getattr(dst_backend, "cpy_tensor", None)
        if cpy is None or not cpy(src, dst):
            tensor_copy(src, dst)

    def _gather(self, sp: Split) -> None:
        """A row gathering: each device's rows copied straight into their slice of the node on the main device
        (ggml's per-device cudaMemcpy2DPeerAsync into dst), then shown to an eval callback that wants it."""
        for y, rows in sp.gathers:
            self._copy(sp.backend, y, rows)
        cb = self.cb_eval
        if cb is not None:
            n = next(n for n in sp.nodes if n.op not in VIEW_OPS)
            if cb(n, True):
                getattr(sp.backend, "synchronize", lambda: None)()
                cb(n, False)

    def _run_observed(self, sp: Split) -> None:
        """With an eval callback: run up to each node it wants, then show it the node (ggml's sched compute with
        callback_eval, which also splits the graph at the nodes the callback asks for)."""
        cb, pending = self.cb_eval, []
        for n in sp.nodes:
            if n.op in VIEW_OPS:
                continue
            pending.append(n)
            if cb(n, True):
                sp.backend.graph_compute(pending)
                pending = []
                getattr(sp.backend, "synchronize", lambda: None)()
                cb(n, False)
        if pending:
            sp.backend.graph_compute(pending)

    def _run_poisoning(self, sp: Split, p: SchedPlan) -> None:
        """Debug: run node by node; after each step, poison what died there in every buffer."""
        for i in range(sp.step0, sp.step0 + len(sp.copies)):
            for al, ap in zip(p.allocators, p.alloc_plans):
                al.poison_after(i, ap)
        for i, n in enumerate(sp.nodes, start=sp.step0 + len(sp.copies)):
            if n.op not in VIEW_OPS:
                self._gather(sp) if sp.gathers else sp.backend.graph_compute([n])
            for al, ap in zip(p.allocators, p.alloc_plans):
                al.poison_after(i, ap)

    def forget(self, g: Graph) -> None:
        """Drop the plan of ``g`` and point its nodes back at their original sources."""
        entry = self._plans.pop(id(g), None)
        if entry is not None and entry[0] is g:
            self._undo_rewrites(g)
            if self._last is entry[1]:
                self._last = None

    # ------------------------------------------------------------------ introspection
    @property
    def n_splits(self) -> int:
        """Splits of the graph last planned or run."""
        return len(self._last.splits) if self._last else 0

    @property
    def n_copies_made(self) -> int:
        """Copy tensors (per copy set) of the graph last planned or run."""
        return self._last.n_copies if self._last else 0

    def get_backend(self, node: Tensor, g: Graph | None = None) -> Backend:
        p = self.alloc_graph(g) if g is not None else self._last
        return self.backends[p.assignment[node.id]]

    def dump(self, g: Graph, p: SchedPlan | None = None) -> str:
        """The splits with their inputs, then every node with its backend and the cause (ggml's debug print)."""
        p = p or self.alloc_graph(g)
        out = [f"sched: {len(p.splits)} splits, {p.n_copies} copies, "
               + ", ".join(f"{al.buft.name}: {ap.size} bytes (naive {ap.naive_size})"
                           for al, ap in zip(p.allocators, p.alloc_plans))]
        dev = lambda t: self.backends[p.assignment[t.id]].device if t.id in p.assignment else "?"
        for i, sp in enumerate(p.splits):
            ins = " ".join(f"[{_name(s)} {s.nbytes}B]" for s in sp.inputs)
            out.append(f"## SPLIT #{i}: {sp.backend.device} # {len(sp.inputs)} inputs{': ' + ins if ins else ''}")
            for n in sp.nodes:
                srcs = " ".join(f"{_name(s)}@{dev(s)}" for s in n.src if s is not None)
                out.append(f"  {n.op.value:<14} {_name(n):<28} {dev(n):<8} {p.causes.get(n.id, ''):<11} <- {srcs}")
        return "\n".join(out)

    def dump_dot(self, g: Graph) -> str:
        p = self.alloc_graph(g)
        return g.dump_dot(lambda n: self.backends[p.assignment[n.id]].device if n.id in p.assignment else "?")
