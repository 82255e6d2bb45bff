"""A compute graph: the nodes (tensors with an op) in an order where every source comes first, and the leafs.

``Graph.build(outputs)`` walks sources depth-first from the outputs, as ggml_build_forward_expand does. A
tensor that is a view also depends on its ``view_src`` (the memory it reads or, for SET_ROWS/CPY, writes).
"""
from __future__ import annotations

from .tensor import Op, Tensor, VIEW_OPS


class Graph:
    def __init__(self):
        self.nodes: list[Tensor] = []
        self.leafs: list[Tensor] = []
        self._seen: set[int] = set()

    @classmethod
    def build(cls, *outputs: Tensor) -> "Graph":
        g = cls()
        for t in outputs:
            g.expand(t)
        return g

    def expand(self, root: Tensor) -> None:
        """Add ``root`` and everything it depends on (iterative DFS: graphs are deep)."""
        stack = [(root, False)]
        while stack:
            t, done = stack.pop()
            if done:
                if t.op is Op.NONE:
                    self.leafs.append(t)
                else:
                    self.nodes.append(t)
                continue
            if t.id in self._seen:
                continue
            self._seen.add(t.id)
            stack.append((t, True))
            deps = [s for s in t.src if s is not None]
            if t.view_src is not None and t.view_src not in deps:
                deps.append(t.view_src)
            for s in reversed(deps):
                if s.id not in self._seen:
                    stack.append((s, False))

    def __len__(self):
        return len(self.nodes)

    def __contains__(self, t: Tensor) -> bool:
        return t.id in self._seen

    def compute_nodes(self) -> list[Tensor]:
        """The nodes a backend must run (views are metadata only)."""
        return [n for n in self.nodes if n.op not in VIEW_OPS]

    def find(self, name: str) -> Tensor:
        for t in self.nodes + self.leafs:
            if t.name == name:
                return t
        raise KeyError(name)

    # ------------------------------------------------------------------ dumps
    def dump_text(self, backend_of=None) -> str:
        """One line per node: index, op, type, shape, name, sources; and the backend if ``backend_of(node)`` is given."""
        lines = [f"graph: {len(self.nodes)} nodes, {len(self.leafs)} leafs"]
        for i, n in enumerate(self.nodes):
            srcs = ", ".join(_label(s) for s in n.src if s is not None)
            be = f"  @{backend_of(n)}" if backend_of else ""
            lines.append(f"  {i:4d} {n.op.value:<14} {n.type.name:<5} {n.shape_str():<22} {_label(n):<28} <- {srcs}{be}")
        for i, t in enumerate(self.leafs):
            lines.append(f"  leaf {i:4d} {t.type.name:<5} {t.shape_str():<22} {_label(t)}")
        return "\n".join(lines)

    def dump_dot(self, backend_of=None) -> str:
        """Graphviz DOT: nodes as boxes (op, name, type, shape, backend), leafs as ellipses, edges from sources."""
        colors = ["lightblue", "lightyellow", "lightpink", "palegreen", "lavender"]
        backends: dict[str, str] = {}
        out = ["digraph G {", "  rankdir=TB;", '  node [fontname="monospace", fontsize=10];']
        for t in self.leafs:
            out.append(f'  t{t.id} [shape=ellipse, label="{_esc(_label(t))}\\n{t.type.name} {t.shape_str()}"];')
        for n in self.nodes:
            be = ""
            fill = "white"
            if backend_of:
                name = str(backend_of(n))
                fill = backends.setdefault(name, colors[len(backends) % len(colors)])
                be = f"\\n@{name}"
            out.append(f'  t{n.id} [shape=box, style=filled, fillcolor={fill}, '
                       f'label="{n.op.value}\\n{_esc(_label(n))}\\n{n.type.name} {n.shape_str()}{be}"];')
            for s in n.src:
                if s is not None:
                    out.append(f"  t{s.id} -> t{n.id};")
        out.append("}")
        return "\n".join(out)


def _label(t: Tensor) -> str:
    return t.name or f"#{t.id}"


def _esc(s: str) -> str:
    return s.replace('"', '\\"')
