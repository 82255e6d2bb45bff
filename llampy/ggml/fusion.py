"""The fusion pass: rewrite known patterns into single nodes. The scheduler runs it per split, after placement,
through each backend's ``graph_optimize`` (ggml's graph_optimize): a backend fuses what it runs, within its splits.

  rms_norm(x) · w                                  -> RMS_NORM_MUL(x, w)        (w broadcast over x)
  RMS_NORM_MUL(x, w) + r                           -> RMS_NORM_MUL(x, w, r)     (r of the same shape: a post-norm
                                                                                 and the residual add after it)
  silu(g) · u,  gelu(g) · u                        -> SWIGLU(g, u), GEGLU(g, u) (same shapes)
  SWIGLU(mul_mat(wg, x), mul_mat(wu, x)), GEGLU(..) -> MUL_MAT_GLU(wg, wu, x)   (one x, 2-D weights of one type and
                                                                                 shape: the feed-forward's gate, up
                                                                                 and gated unit)
  scale(tanh(scale(x, a)), b)                      -> SOFTCAP(x, a, b)          (no offsets)
  ssm_conv(concat(reshape(get_rows(r, src)), transpose(x), 0), c) with set_rows(r, cont(the concat's last
  d_conv - 1 columns), dst)                       -> SSM_CONV_STATE(x, c, r, src, dst)
      a recurrent layer's convolution over its rolling rows in the memory r (mamba's and lfm2's conv_input): one
      kernel reads each sequence's row, convolves, and writes the row back, where five nodes gathered the rows,
      concatenated, convolved, copied the last columns out and stored them (the set_rows leaves the node list).
  silu(SSM_CONV_STATE(..) + b), silu(SSM_CONV_STATE(..)) -> SSM_CONV_STATE(.., b, silu)   (b: F32 [d_inner])
  swiglu(cont(z) or z, y + x · d)                 -> SSM_GATE(z, y, x, d)      (d: one value per head, [1, n_head]:
                                                                                 Mamba-2's skip and gate after the
                                                                                 scan, four passes over the tokens'
                                                                                 rows made one)
  permute(mul_mat(vᵀ, soft_max_ext(kq, mask, s)), 0, 2, 1, 3), kq = mul_mat(k, q)
                                                   -> FLASH_ATTN_EXT(q, k, v, mask, s)
      the attention of llama.cpp without flash attention, with the shapes of ops.py:
      q [d, n_q, n_head]  k [d, n_kv, n_head_kv]  vᵀ [n_kv, d_v, n_head_kv]  ->  kq [n_kv, n_q, n_head]
      -> kqv [d_v, n_q, n_head] -> permuted [d_v, n_head, n_q], which is flash_attn_ext's own result layout.
      A soft-capped kq (SOFTCAP(kq, a, b) under a softmax with scale 1, as gemma2 builds it) folds into the
      flash-attention node's scale a·b and softcap b.

A pattern fuses only when its intermediates have no other reader (nodes or views) and are not graph outputs or
inputs, when all its nodes are in the run being fused (one split), and when ``supports`` (a backend, or a predicate
on the new node) accepts the fused node. The pattern's last node *becomes* the fused node, in place: it keeps its
identity, name and flags, so whoever holds it (a graph's output, a reader) holds the fused node; the pattern's other
nodes leave the node list, which keeps its order otherwise. Results are unchanged up to float rounding (the CPU
flash attention rounds Q, K and V to F16, as llama.cpp's does; the CPU's other fused kernels give the same bits).
"""
from __future__ import annotations

from . import ops
from .graph import Graph
from .tensor import Flags, Op, Tensor, VIEW_OPS

_PINNED = Flags.OUTPUT | Flags.INPUT | Flags.WEIGHT


def _readers(nodes) -> dict[int, list[Tensor]]:
    """Tensor id -> the nodes that read it as a source or view its memory."""
    users: dict[int, list[Tensor]] = {}
    for n in nodes:
        for s in n.src:
            if s is not None:
                users.setdefault(s.id, []).append(n)
        if n.view_src is not None and all(s is not n.view_src for s in n.src):
            users.setdefault(n.view_src.id, []).append(n)
    return users


def _private(t: Tensor, users, consumer: Tensor) -> bool:
    """t is read by ``consumer`` alone (once or more) and is a plain intermediate."""
    return (t.op is not Op.NONE and not (t.flags & _PINNED) and t.view_src is None
            and all(u is consumer for u in users.get(t.id, ())))


def _accepts(supports, node: Tensor) -> bool:
    if supports is None:
        return True
    if hasattr(supports, "supports_op"):
        return bool(supports.supports_op(node))
    return bool(supports(node))


def _no_offset_scale(t: Tensor) -> bool:
    return t.op is Op.SCALE and t.op_params.get("b", 0.0) == 0.0


def _match(n: Tensor, users):
    """(fused node, the intermediates it removes), or None."""
    if n.op is Op.MUL:
        a, b = n.src
        for x, w in ((a, b), (b, a)):
            if x.op is Op.RMS_NORM and x.ne == n.ne and _private(x, users, n) and ops._can_repeat(w, x):
                return ops.rms_norm_mul(x.src[0], w, x.op_params["eps"]), [x]
        for x, u in ((a, b), (b, a)):
            if x.op in (Op.SILU, Op.GELU) and x.ne == u.ne == n.ne and x is not u and _private(x, users, n):
                glu = ops.swiglu if x.op is Op.SILU else ops.geglu
                return glu(x.src[0], u), [x]
    if n.op in (Op.SWIGLU, Op.GEGLU) and len(n.src) == 2:
        g, u = n.src                   # the split form: gate, up (ggml ignores swapped there)
        if (g.op is Op.MUL_MAT and u.op is Op.MUL_MAT and g is not u and g.src[1] is u.src[1]
                and g.src[0].type == u.src[0].type and g.src[0].ne == u.src[0].ne and g.src[0].ne[2:] == (1, 1)
                and _private(g, users, n) and _private(u, users, n)):
            glu = "swiglu" if n.op is Op.SWIGLU else "geglu"
            return ops.mul_mat_glu(g.src[0], u.src[0], g.src[1], glu), [g, u]
        if n.op is Op.SWIGLU:
            return _match_ssm_gate(n, users)
    if n.op is Op.ADD:
        a, b = n.src
        for p, r in ((a, b), (b, a)):
            if (p.op is Op.RMS_NORM_MUL and len(p.src) == 2 and p.ne == n.ne == r.ne and r.type == n.type and
                    p is not r and _private(p, users, n)):
                return ops.rms_norm_mul(p.src[0], p.src[1], p.op_params["eps"], add=r), [p]
    if _no_offset_scale(n):
        t = n.src[0]
        if t.op is Op.TANH and _private(t, users, n):
            s = t.src[0]
            if _no_offset_scale(s) and _private(s, users, t):
                return ops.softcap(s.src[0], s.op_params["s"], n.op_params["s"]), [t, s]
    if n.op is Op.PERMUTE and n.op_params.get("axes") == (0, 2, 1, 3):
        return _match_attention(n, users)
    if n.op is Op.SSM_CONV:
        return _match_conv_state(n, users)
    if n.op is Op.SILU:
        return _match_conv_state_silu(n, users)
    return None


def _match_conv_state_silu(n: Tensor, users):
    t, b, gone = n.src[0], None, []
    if t.op is Op.ADD and _private(t, users, n):
        a, b = t.src
        gone, t = [t], a
    if t.op is not Op.SSM_CONV_STATE or t.op_params.get("silu") or not _private(t, users, gone[0] if gone else n):
        return None
    if b is not None and (b is t or b.type != t.type or b.ne != (t.ne[0], 1, 1, 1) or not b.is_contiguous()):
        return None
    return ops.ssm_conv_state(*t.src[:5], bias=b, silu=True), gone + [t]


def _match_ssm_gate(n: Tensor, users):
    g, u = n.src
    if u.op is not Op.ADD or u is g or not _private(u, users, n):
        return None
    for y, m in (u.src, u.src[::-1]):
        if m.op is Op.MUL and m is not y and _private(m, users, u):
            break
    else:
        return None
    x, d = m.src
    gone = [u, m]
    if g.op is Op.CONT and _private(g, users, n):
        g, gone = g.src[0], gone + [g]
    ok = (all(t.type == n.type and t.ne == n.ne and t.nb[0] == 4 for t in (g, y, x)) and d.type == n.type
          and d.ne == (1, n.ne[1], 1, 1) and d.is_contiguous())
    return (ops.ssm_gate(g, y, x, d), gone) if ok else None

def _only_reader(t: Tensor, users, reader: Tensor) -> bool:
    """t (a node, or a view node) is read by ``reader`` alone and is not pinned."""
    return not (t.flags & _PINNED) and [u.id for u in users.get(t.id, ())] == [reader.id]


def _match_conv_state(n: Tensor, users):
    cx, c = n.src
    if cx.op is not Op.CONCAT or cx.op_params.get("dim") != 0 or cx.view_src is not None or cx.flags & _PINNED:
        return None
    rs, xt = cx.src
    if rs.op is not Op.RESHAPE or xt.op is not Op.TRANSPOSE or rs.src[0].op is not Op.GET_ROWS:
        return None
    get, x = rs.src[0], xt.src[0]
    r, src = get.src
    d_conv, d_inner = c.ne[0], c.ne[1]
    n_t, n_s = n.ne[1], n.ne[2]
    # the concat's other reader: a view of its last d_conv - 1 columns, copied out and stored into r's rows
    rest = [u for u in users.get(cx.id, ()) if u is not n]
    if len(rest) != 1 or rest[0].op is not Op.VIEW:
        return None
    last = rest[0]
    conts = users.get(last.id, ())
    if len(conts) != 1 or conts[0].op is not Op.CONT:
        return None
    cont = conts[0]
    stores = users.get(cont.id, ())
    if len(stores) != 1 or stores[0].op is not Op.SET_ROWS:
        return None
    store = stores[0]
    dst = store.src[1]
    if (r.op is not Op.NONE or store.view_src is not r or store.view_offs or store.src[0] is not cont
            or store.flags & _PINNED or users.get(store.id) or r.type != get.type or get.type != cont.type):
        return None
    if not (_only_reader(get, users, rs) and _only_reader(rs, users, cx) and _only_reader(xt, users, cx)
            and _only_reader(last, users, cont) and _only_reader(cont, users, store)
            and [u.id for u in users.get(cx.id, ())].count(n.id) == 1):
        return None
    if (last.view_offs != 4 * n_t or last.ne != (d_conv - 1, d_inner, n_s, 1) or last.nb[1:3] != cx.nb[1:3]
            or cont.ne != (r.ne[0], n_s, 1, 1) or get.ne != (r.ne[0], n_s, 1, 1) or x.ne != (d_inner, n_t, n_s, 1)
            or dst.type != src.type or dst.ne != src.ne):
        return None
    try:
        new = ops.ssm_conv_state(x, c, r, src, dst)
    except ValueError:
        return None
    return new, [get, rs, xt, cx, last, cont, store]


def _match_attention(n: Tensor, users):
    kqv = n.view_src
    if kqv is None or n.src[0] is not kqv or kqv.op is not Op.MUL_MAT or not _private(kqv, users, n):
        return None
    # the permuted result is replaced by a fresh tensor: its readers must read it as a node, not view its memory
    if any(u.op in VIEW_OPS for u in users.get(n.id, ())):
        return None
    vt, sm = kqv.src
    if sm.op is not Op.SOFT_MAX or not _private(sm, users, kqv):
        return None
    p = sm.op_params
    kq = sm.src[0]
    softcap, scale, removed, reader = 0.0, p["scale"], [kqv, sm], sm
    if kq.op is Op.SOFTCAP and p["scale"] == 1.0 and _private(kq, users, sm):
        # softcap·tanh(kq·s_in) == c·tanh(kq·scale / c) with c = s_out, scale = s_in·s_out
        softcap, scale = kq.op_params["s_out"], kq.op_params["s_in"] * kq.op_params["s_out"]
        removed.append(kq)
        reader, kq = kq, kq.src[0]
    if kq.op is not Op.MUL_MAT or not _private(kq, users, reader) or softcap < 0:
        return None
    removed.append(kq)
    k, q = kq.src
    mask = sm.src[1] if p.get("has_mask") else None
    if vt.ne[0] != k.ne[1] or vt.ne[2] != k.ne[2] or vt.ne[3] != k.ne[3] or q.ne[3] != k.ne[3]:
        return None
    if q.ne[2] % k.ne[2] or (mask is not None and (mask.ne[2] != 1 or mask.ne[3] != 1)):
        return None
    v = ops.transpose(vt)                     # [d_v, n_kv, n_head_kv], a view of the same memory
    fa = ops.flash_attn_ext(q, k, v, mask, scale, p.get("max_bias", 0.0), softcap)
    if fa.ne != n.ne:
        return None
    return fa, removed


def _adopt(n: Tensor, new: Tensor) -> None:
    """n becomes the fused node ``new`` (same type and shape): op, sources and layout; identity, name, flags stay."""
    n.op, n.src, n.op_params = new.op, list(new.src), new.op_params
    n.nb, n.view_src, n.view_offs = new.nb, None, 0


def _new_deps(t: Tensor, known: set[int]) -> list[Tensor]:
    """Nodes a fused node reads that no node list holds yet (the helper views a builder made), sources first."""
    out: list[Tensor] = []
    stack = [(s, False) for s in reversed([*t.src, t.view_src]) if s is not None]
    while stack:
        x, done = stack.pop()
        if done:
            out.append(x)
            continue
        if x.op is Op.NONE or x.id in known:
            continue
        known.add(x.id)
        stack.append((x, True))
        stack.extend((s, False) for s in reversed([*x.src, x.view_src]) if s is not None)
    return out


def fuse_nodes(graph_nodes, nodes, supports=None, max_passes: int = 4) -> tuple[list[Tensor], int]:
    """Rewrite the patterns above within ``nodes`` (a whole graph's nodes, or one split: a run of ``graph_nodes``),
    counting readers over all of ``graph_nodes``. Returns (the new node list for ``nodes``, the number of rewrites)."""
    n_fused = 0
    nodes = list(nodes)
    others = [x for x in graph_nodes]
    for _ in range(max_passes):    # a rewrite can expose another (softcap inside attention): a few passes
        users = _readers(others)
        inside = {x.id for x in nodes}
        removed: set[int] = set()
        changed: set[int] = set()      # rewritten in this pass: the readers map does not know them yet
        for n in nodes:
            if n.id in removed:
                continue
            m = _match(n, users)
            if m is None:
                continue
            new, gone = m
            # a pattern overlapping one rewritten in this pass waits for the next pass
            if (any(t.id in removed or t.id in changed or t.id not in inside for t in gone)
                    or new.type != n.type or new.ne != n.ne or not _accepts(supports, new)):
                continue
            _adopt(n, new)
            changed.add(n.id)
            removed.update(t.id for t in gone)
            n_fused += 1
        if not changed:
            break
        # keep the order; a fused node's new helper views go right before it
        known = {x.id for x in others}
        out = []
        for n in nodes:
            if n.id in removed:
                continue
            if n.id in changed:
                out.extend(_new_deps(n, known))
            out.append(n)
        others = [x for x in others if x.id not in removed and x.id not in inside] + out
        nodes = out
    return nodes, n_fused


def fuse(g: Graph, supports=None, max_passes: int = 4) -> tuple[Graph, int]:
    """Fuse a whole graph. Returns (the fused graph, the number of rewrites); ``g``'s nodes are rewritten in place,
    but ``g`` keeps the removed nodes in its list: use the returned graph."""
    nodes, n_fused = fuse_nodes(g.nodes, g.nodes, supports, max_passes)
    out = Graph()
    for t in g.leafs:
        out.expand(t)
    for n in nodes:
        out.expand(n)
    return out, n_fused
