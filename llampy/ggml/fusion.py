"""The fusion pass: rewrite known patterns into single nodes before scheduling.

- rms_norm(x) · w                        -> RMS_NORM_MUL(x, w)
- silu(g) · u, gelu(g) · u               -> SWIGLU(g, u), GEGLU(g, u)
- scale(tanh(scale(x, a)), b)            -> SOFTCAP(x, a, b)
- permute(mul_mat(vᵀ, soft_max_ext(mul_mat(k, q), mask, scale)), 0, 2, 1, 3)
                                         -> FLASH_ATTN_EXT(q, k, v, mask, scale)
A pattern fuses only when its intermediates have no other reader and are not outputs, and when ``supports``
(a backend or a predicate on the new node) accepts the fused node. Results are unchanged up to float rounding
(flash attention rounds Q, K and V to F16 as llama.cpp's CPU kernel does).
"""
from __future__ import annotations

from . import ops
from .graph import Graph
from .tensor import Flags, Op, Tensor


def _consumers(g: Graph) -> dict[int, list[Tensor]]:
    users: dict[int, list[Tensor]] = {}
    for n in g.nodes:
        for s in n.src:
            if s is not None:
                users.setdefault(s.id, []).append(n)
        if n.view_src is not None and n.view_src not in n.src:
            users.setdefault(n.view_src.id, []).append(n)
    return users


def _private(t: Tensor, users, consumer: Tensor) -> bool:
    """t is read only by ``consumer`` and is not a graph output."""
    return not (t.flags & Flags.OUTPUT) and [u.id for u in users.get(t.id, [])] == [consumer.id]


def _accepts(supports, node: Tensor) -> bool:
    if supports is None:
        return True
    if hasattr(supports, "supports_op"):
        return supports.supports_op(node)
    return bool(supports(node))


def _match(n: Tensor, users):
    """A fused replacement for node n, or None."""
    if n.op == Op.MUL and len(n.src) == 2:
        a, b = n.src
        for x, w in ((a, b), (b, a)):
            if x.op == Op.RMS_NORM and _private(x, users, n) and ops._can_repeat(w, x) and x.ne == n.ne:
                return ops.rms_norm_mul(x.src[0], w, x.op_params["eps"])
        for x, u in ((a, b), (b, a)):
            if x.op in (Op.SILU, Op.GELU) and _private(x, users, n) and x.ne == u.ne == n.ne:
                return (ops.swiglu if x.op == Op.SILU else ops.geglu)(x.src[0], u)
    if n.op == Op.SCALE and n.op_params.get("b", 0.0) == 0.0:
        t = n.src[0]
        if t.op == Op.TANH and _private(t, users, n):
            s = t.src[0]
            if s.op == Op.SCALE and s.op_params.get("b", 0.0) == 0.0 and _private(s, users, t):
                return ops.softcap(s.src[0], s.op_params["s"], n.op_params["s"])
    if n.op == Op.PERMUTE and n.op_params.get("axes") == (0, 2, 1, 3):
        kqv = n.src[0]
        if kqv.op == Op.MUL_MAT and _private(kqv, users, n):
            vt, sm = kqv.src
            if sm.op == Op.SOFT_MAX and _private(sm, users, kqv) and sm.op_params.get("max_bias", 0.0) == 0.0:
                kq = sm.src[0]
                if kq.op == Op.MUL_MAT and _private(kq, users, sm):
                    k, q = kq.src
                    mask = sm.src[1] if sm.op_params.get("has_mask") else None
                    v = ops.transpose(vt)          # back to [d_v, n_kv, n_head_kv]
                    if v.ne[1] != k.ne[1] or v.ne[2] != k.ne[2]:
                        return None
                    return ops.flash_attn_ext(q, k, v, mask, sm.op_params["scale"])
    return None


def fuse(g: Graph, supports=None) -> tuple[Graph, int]:
    """Returns (the fused graph, the number of rewrites). The input graph's nodes are rewired in place."""
    users0 = _consumers(g)
    roots = [n for n in g.nodes if n.id not in users0 or n.flags & Flags.OUTPUT]
    n_fused = 0
    changed = True
    budget = len(g.nodes)        # every rewrite removes a node: never loop forever
    while changed and budget > 0:
        budget -= 1
        changed = False
        users = _consumers(g)
        for n in list(g.nodes):
            new = _match(n, users)
            if new is None or not _accepts(supports, new):
                continue
            new.name = n.name
            new.flags |= n.flags & Flags.OUTPUT
            for u in users.get(n.id, []):
                u.src = [new if s is n else s for s in u.src]
                if u.view_src is n:      # views (reshape, permute...) read the fused node's memory now
                    u.view_src = new
            roots = [new if r is n else r for r in roots]
            n_fused += 1
            changed = True
            g = Graph.build(*roots)
            break
    return g, n_fused
