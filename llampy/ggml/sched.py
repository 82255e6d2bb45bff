"""The graph scheduler (ggml_backend_sched): places each node on a backend, cuts the graph into splits, copies
tensors that cross devices, allocates one compute buffer per backend, and keeps the whole plan while the graph holds.

Backends come in priority order (the first is preferred; the CPU is usually last). ``LLAMPY_SCHED_DEBUG=1`` prints
each node with its backend and the cause of the choice.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

from .alloc import GraphAllocator
from .backend import Backend, tensor_data
from .graph import Graph
from .tensor import Flags, Op, Tensor, VIEW_OPS


@dataclass
class Split:
    backend: Backend
    nodes: list = field(default_factory=list)
    copies: list = field(default_factory=list)      # (src tensor, copy tensor) refreshed before the split runs
    plan: object = None


@dataclass
class SchedPlan:
    splits: list
    assignment: dict        # node id -> backend index
    causes: dict            # node id -> why
    allocators: list
    alloc_plans: list
    n_copies: int = 0


class Scheduler:
    def __init__(self, backends: list[Backend], debug: bool | None = None):
        if not backends:
            raise ValueError("the scheduler needs at least one backend")
        self.backends = list(backends)
        self.debug = bool(int(os.environ.get("LLAMPY_SCHED_DEBUG", "0"))) if debug is None else debug
        self._plans: dict[int, SchedPlan] = {}
        self._graphs: dict[int, Graph] = {}
        self._allocators = [GraphAllocator(b.get_default_buffer_type()) for b in self.backends]
        self.n_replans = 0

    # ------------------------------------------------------------------ assignment
    def _backend_of_storage(self, t: Tensor) -> int | None:
        buf = t.storage.buffer
        if buf is None:
            return None
        for i, b in enumerate(self.backends):
            if b.supports_buffer(buf):
                return i
        return None

    def _assign(self, g: Graph):
        nodes = g.nodes
        assign: dict[int, int] = {}
        cause: dict[int, str] = {}
        # 1. nodes whose weights (or own memory: KV cache writes, views of weights) live on a backend go there
        for n in nodes:
            cands = []
            if n.view_src is not None:
                cands.append(n.view_src)
            cands += [s for s in n.src if s is not None and s.storage.flags & Flags.WEIGHT]
            for s in cands:
                bi = self._backend_of_storage(s)
                if bi is not None and (n.op in VIEW_OPS or self.backends[bi].supports_op(n)):
                    assign[n.id] = bi
                    cause[n.id] = f"1.storage of {s.storage.name or '#%d' % s.storage.id}"
                    break
        # 2. expand to neighbours: down, then up, where the backend supports the op
        for order, tag in ((nodes, "2.down"), (list(reversed(nodes)), "2.up")):
            cur = None
            for n in order:
                if n.id in assign:
                    cur = assign[n.id]
                elif cur is not None and (n.op in VIEW_OPS or self.backends[cur].supports_op(n)):
                    assign[n.id] = cur
                    cause[n.id] = tag
        # 3. the rest: the first backend that supports the op
        for n in nodes:
            if n.id not in assign:
                for i, b in enumerate(self.backends):
                    if n.op in VIEW_OPS or b.supports_op(n):
                        assign[n.id] = i
                        cause[n.id] = "3.supports_op"
                        break
                else:
                    raise RuntimeError(f"no backend supports {n!r}")
        # a node its backend cannot run goes to one that can (expansion only picks supporting backends)
        for n in nodes:
            if n.op not in VIEW_OPS and not self.backends[assign[n.id]].supports_op(n):
                for i, b in enumerate(self.backends):
                    if b.supports_op(n):
                        assign[n.id], cause[n.id] = i, "3.fallback"
                        break
        return assign, cause

    # ------------------------------------------------------------------ planning
    def _plan(self, g: Graph) -> SchedPlan:
        assign, cause = self._assign(g)
        splits: list[Split] = []
        for n in g.nodes:
            bi = assign[n.id]
            if n.op in VIEW_OPS and splits:   # views compute nothing: keep them in the current split
                splits[-1].nodes.append(n)
                continue
            if not splits or splits[-1].backend is not self.backends[bi]:
                splits.append(Split(self.backends[bi]))
            splits[-1].nodes.append(n)
        # 4. copies for sources living on (or produced by) another device
        producer = {n.id: assign[n.id] for n in g.nodes}
        n_copies = 0
        leaf_home: dict[int, int] = {}
        for sp in splits:
            bi = self.backends.index(sp.backend)
            made: dict[int, Tensor] = {}
            for n in sp.nodes:
                if n.op in VIEW_OPS:
                    continue
                for j, s in enumerate(n.src):
                    if s is None:
                        continue
                    home = self._home(s, producer, leaf_home, bi)
                    if home == bi or self._shares_memory(home, bi):
                        continue
                    if s.id not in made:
                        c = Tensor(s.type, s.ne, name=f"{s.name or '#%d' % s.id}#copy@{sp.backend.device}")
                        made[s.id] = c
                        sp.copies.append((s, c))
                        n_copies += 1
                    n.src[j] = made[s.id]
        # 5. allocate one compute buffer per backend; plans per split
        allocs, aplans = [], []
        keep_ids = frozenset(src.storage.id for sp in splits for src, _ in sp.copies)
        for bi, b in enumerate(self.backends):
            mine = [n for sp in splits if sp.backend is b for n in [c for _, c in sp.copies] + sp.nodes]
            leafs = [t for t in g.leafs if leaf_home.get(t.id, self._first_user(t, g, assign)) == bi]
            al = self._allocators[bi]
            aplans.append(al.alloc_graph(mine, leafs, keep_ids))
            allocs.append(al)
        for sp in splits:
            create = getattr(sp.backend, "graph_plan_create", None)
            sp.plan = create(sp.nodes) if create else sp.nodes
        plan = SchedPlan(splits, assign, cause, allocs, aplans, n_copies)
        if self.debug:
            self._print(g, plan)
        return plan

    def _home(self, s: Tensor, producer, leaf_home, default) -> int:
        st = s.storage
        if st.buffer is not None:
            bi = self._backend_of_storage(st)
            return default if bi is None else bi
        if st.id in producer:
            return producer[st.id]
        leaf_home.setdefault(st.id, default)
        return leaf_home[st.id]

    def _shares_memory(self, a: int, b: int) -> bool:
        return self.backends[a].get_default_buffer_type().device == self.backends[b].get_default_buffer_type().device

    def _first_user(self, t: Tensor, g: Graph, assign) -> int:
        for n in g.nodes:
            if any(s is t for s in n.src):
                return assign[n.id]
        return len(self.backends) - 1

    def _print(self, g: Graph, plan: SchedPlan) -> None:
        print(f"sched: {len(plan.splits)} splits, {plan.n_copies} copies", file=sys.stderr)
        for n in g.nodes:
            b = self.backends[plan.assignment[n.id]]
            print(f"  {n.op.value:<14} {n.name or '#%d' % n.id:<28} {b.device:<10} {plan.causes.get(n.id, '')}",
                  file=sys.stderr)

    # ------------------------------------------------------------------ public
    def alloc_graph(self, g: Graph) -> SchedPlan:
        """Plan the graph (once per Graph object) and place its tensors."""
        p = self._plans.get(id(g))
        if p is None or self._graphs.get(id(g)) is not g:
            p = self._plan(g)
            self._plans[id(g)] = p
            self._graphs[id(g)] = g
            self.n_replans += 1
        else:
            # another graph may have re-placed shared allocators' tensors: re-place this graph's tensors
            for al, ap, bi in zip(p.allocators, p.alloc_plans, range(len(self.backends))):
                self._replace(al, ap, g, p)
        return p

    def _replace(self, al, ap, g, p):
        if al.plan_ is ap:
            return
        # the allocator's buffer may have been replaced by a bigger one: tensors must follow
        from .backend import tensor_alloc
        if al.buffer is None or al.buffer.size < ap.size:
            al.buffer = al.buft.alloc_buffer(ap.size)
        tensors = {t.id: t for sp in p.splits for t in sp.nodes + [c for _, c in sp.copies]}
        tensors.update({t.id: t for t in g.leafs})
        for tid, off in ap.offsets.items():
            if tid in tensors:
                tensor_alloc(al.buffer, tensors[tid], off)
        al.plan_ = ap
        for sp in p.splits:
            create = getattr(sp.backend, "graph_plan_create", None)
            sp.plan = create(sp.nodes) if create else sp.nodes

    def graph_compute(self, g: Graph) -> None:
        p = self.alloc_graph(g)
        debug_alloc = any(al.debug for al in p.allocators)
        for sp in p.splits:
            for src, cpy in sp.copies:
                tensor_data(cpy)[...] = tensor_data(src)
            if debug_alloc:
                self._run_poisoning(sp, p)
                continue
            run = getattr(sp.backend, "graph_plan_compute", None)
            if run:
                run(sp.plan)
            else:
                sp.backend.graph_compute(sp.nodes)
        for b in self.backends:
            b.synchronize()

    def _run_poisoning(self, sp: Split, p: SchedPlan) -> None:
        bi = self.backends.index(sp.backend)
        al = p.allocators[bi]
        nodes_all = [n for s in p.splits if s.backend is sp.backend for n in [c for _, c in s.copies] + s.nodes]
        index = {n.id: i for i, n in enumerate(nodes_all)}
        for n in sp.nodes:
            if n.op not in VIEW_OPS:
                sp.backend.graph_compute([n])
            al.poison_after(index[n.id])

    def forget(self, g: Graph) -> None:
        self._plans.pop(id(g), None)
        self._graphs.pop(id(g), None)

    # ------------------------------------------------------------------ introspection
    def n_splits(self, g: Graph) -> int:
        return len(self.alloc_graph(g).splits)

    def n_copies(self, g: Graph) -> int:
        return self.alloc_graph(g).n_copies

    def get_backend(self, g: Graph, node: Tensor) -> Backend:
        return self.backends[self.alloc_graph(g).assignment[node.id]]

    def dump_dot(self, g: Graph) -> str:
        p = self.alloc_graph(g)
        return g.dump_dot(lambda n: self.backends[p.assignment[n.id]].device)
