"""The cpu backend: NumPy views over host buffers, Numba kernels for the hot ops, a plan of pre-bound calls.

``graph_plan_create(nodes)`` binds, once, each node to its kernel and the NumPy views of its sources and
destination; ``graph_plan_compute(plan)`` just calls them. Views read the buffers' current bytes, so inputs set
between runs are seen without re-planning.
"""
from __future__ import annotations

import numpy as np

from ...backend import Backend, tensor_data
from ...tensor import Flags, Op, Tensor, VIEW_OPS, BINARY_OPS, UNARY_OPS
from ...types import GGMLType, TYPE_TRAITS
from . import conv, dot_f32_short
from .direct import Direct, Prepare, resolve_calls
from . import numpy_ops as K
from .numba_ops import BINDERS, PAIR_BINDERS
from .ssm import bind_ssm_conv, bind_ssm_conv_state, bind_ssm_gate, bind_ssm_scan
from .delta import bind_gated_delta_net
from .wkv import bind_gated_linear_attn, bind_rwkv_wkv6, bind_rwkv_wkv7

T = GGMLType

_TABLE = {
    Op.SCALE: K.k_scale, Op.CLAMP: K.k_clamp, Op.SOFTCAP: K.k_softcap,
    Op.SWIGLU: K.k_glu, Op.GEGLU: K.k_glu, Op.SWIGLU_OAI: K.k_swiglu_oai,
    Op.RMS_NORM: K.k_rms_norm, Op.RMS_NORM_MUL: K.k_rms_norm_mul, Op.NORM: K.k_norm, Op.L2_NORM: K.k_l2_norm,
    Op.SOFT_MAX: K.k_soft_max, Op.ROPE: K.k_rope, Op.GET_ROWS: K.k_get_rows, Op.SET_ROWS: K.k_set_rows,
    Op.CPY: K.k_cpy, Op.CONT: K.k_cpy, Op.DUP: K.k_cpy, Op.CONCAT: K.k_concat, Op.REPEAT: K.k_repeat,
    Op.SUM_ROWS: K.k_sum_rows, Op.MEAN: K.k_mean, Op.ARGMAX: K.k_argmax, Op.ARGSORT: K.k_argsort,
    Op.TOP_K: K.k_top_k,
}
for _op in BINARY_OPS:
    _TABLE[_op] = K.k_binary
for _op in UNARY_OPS:
    _TABLE[_op] = K.k_unary
_TABLE.update({Op.IM2COL: conv.k_im2col, Op.POOL_2D: conv.k_pool_2d, Op.GELU_QUICK: conv.k_gelu_quick})


class Plan:
    """A graph's bound calls. ``memo``: what calls of one run share (the cells a mask leaves visible, for every
    attention layer reading that mask), emptied at the start of each run. ``fast``: from the second run (a plan kept
    for reuse: a decode step's), the calls with each that says what it runs (``direct.resolve_calls``) bound to its
    kernels' entry points (False after the first run); used while the backend's ``exact_max_rows`` is ``limit``,
    the one the products were bound under."""
    __slots__ = ("calls", "nodes", "memo", "fast", "limit")

    def __init__(self, calls, nodes, memo=None, limit=None):
        self.calls = calls
        self.nodes = nodes
        self.memo = {} if memo is None else memo
        self.fast = None
        self.limit = limit


class CPUBackend(Backend):
    name = "cpu"
    acc = np.float32
    # run each plan's calls last to first: only for kernel warm-up (llampy/llama/warmup.py), where a second process
    # compiles from the other end; the results are garbage
    reverse_calls = False

    def __init__(self, device: str | None = None, n_threads: int | None = None):
        super().__init__(device)
        self.n_threads = n_threads
        self._quantized: dict = {}
        self._memo: dict | None = None      # the plan being bound's (graph_plan_create)
        # batches larger than this go to BLAS instead of the bit-exact integer kernels (None: matmul's default)
        self.exact_max_rows = None
        if n_threads:
            import numba
            numba.set_num_threads(max(1, min(int(n_threads), numba.config.NUMBA_NUM_THREADS)))

    def supports_kv_type(self, t: GGMLType) -> bool:
        """Whether a KV cache of this type can live here: the types flash attention reads (F32, F16, BF16 and the
        block formats llama.cpp offers for caches)."""
        return t in (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.IQ4_NL, T.Q5_0, T.Q5_1)

    # ------------------------------------------------------------ ops
    def supports_op(self, node: Tensor) -> bool:
        if node.op in VIEW_OPS or node.op in _TABLE or node.op in (Op.MUL_MAT, Op.MUL_MAT_ID, Op.MUL_MAT_GLU,
                                                                     Op.FLASH_ATTN_EXT, Op.SSM_CONV, Op.SSM_SCAN,
                                                                     Op.SSM_CONV_STATE, Op.SSM_GATE,
                                                                     Op.RWKV_WKV6, Op.RWKV_WKV7,
                                                                     Op.GATED_DELTA_NET, Op.GATED_LINEAR_ATTN):
            if node.op == Op.FLASH_ATTN_EXT:
                return all(s.type in (T.F16, T.BF16, T.F32) or TYPE_TRAITS[s.type].is_quantized for s in node.src[1:3])
            return True
        return False

    def _mul_mat_fn(self):
        from .matmul import mul_mat
        return mul_mat

    def _view(self, t: Tensor) -> np.ndarray:
        """The NumPy view of t's memory that a plan binds (its buffers are host memory: tensor_data)."""
        return tensor_data(t)

    def _bind(self, node: Tensor):
        acc = self.acc
        dst = self._view(node)
        srcs = [self._view(s) if s is not None else None for s in node.src]
        op = node.op
        if op == Op.MUL_MAT:
            return self._bind_mul_mat(node, dst, srcs)
        if op == Op.MUL_MAT_ID:
            return self._bind_mul_mat_id(node, dst, srcs)
        if op == Op.MUL_MAT_GLU:
            return self._bind_mul_mat_glu(node, dst, srcs)
        if op == Op.FLASH_ATTN_EXT:
            return self._bind_flash_attn(node, dst, srcs)
        if op == Op.SSM_CONV:
            return bind_ssm_conv(node, dst, srcs)
        if op == Op.SSM_SCAN:
            return bind_ssm_scan(node, dst, srcs)
        if op == Op.SSM_CONV_STATE:
            return bind_ssm_conv_state(node, dst, srcs)
        if op == Op.SSM_GATE:
            return bind_ssm_gate(node, dst, srcs)
        if op == Op.RWKV_WKV6:
            return bind_rwkv_wkv6(node, dst, srcs)
        if op == Op.RWKV_WKV7:
            return bind_rwkv_wkv7(node, dst, srcs)
        if op == Op.GATED_DELTA_NET:
            return bind_gated_delta_net(node, dst, srcs)
        if op == Op.GATED_LINEAR_ATTN:
            return bind_gated_linear_attn(node, dst, srcs)
        binder = BINDERS.get(op)
        call = binder(node, dst, srcs) if binder is not None else None
        if call is not None:
            return call
        fn = _TABLE[op]
        return lambda: fn(node, dst, srcs, acc)

    def _bind_mul_mat(self, node, dst, srcs):
        a, b = node.src
        wa, xb = srcs
        wtype = a.type
        mm = self._mul_mat_fn()
        r2 = b.ne[2] // a.ne[2]
        r3 = b.ne[3] // a.ne[3]
        pairs = [(i13, i12) for i13 in range(b.ne[3]) for i12 in range(b.ne[2])]
        btype = b.type
        repacked = _repacked(a, 2)
        if wtype == T.F32 and btype == T.F32 and a.ne[0] <= dot_f32_short.MAX_K and len(pairs) > 1:
            # one call for every batch of a short F32 product (ggml_vec_dot_f32's order, as matmul.mul_mat's)
            self._quantized = {}
            return lambda: dot_f32_short.mul_mat_f32_short_batched(wa, xb, dst, r2, r3)
        if len(pairs) == 1 and btype == T.F32:
            from .matmul import act_scratch, bind_mul_mat
            x2 = xb[0, 0]
            key = id(act_scratch(x2.shape[0], x2.shape[1], wtype))
            this_x = (b.id, id(self._owner(b)))
            reuse = self._quantized.get(key) == this_x
            fast = bind_mul_mat(wa[0, 0], wtype, x2, dst[0, 0], lambda: self.exact_max_rows, reuse, repacked)
            if fast is not None:
                self._quantized[key] = this_x
                return fast
        # mul_mat quantizes into the activation buffers shared by shape, unrecorded: no later product may reuse them
        self._quantized = {}

        def run():
            for i13, i12 in pairs:
                x = xb[i13, i12]
                if btype != T.F32:
                    x = K.to_float(x, btype, np.float32)
                mm(wa[i13 // r3, i12 // r2], wtype, x, dst[i13, i12], self.exact_max_rows, repacked=repacked)
        return run

    def _bind_mul_mat_glu(self, node, dst, srcs):
        """The fused kernel where it applies (``matmul.bind_mul_mat_glu``), else the node's three ops bound as the
        unfused graph would bind them: the two products into buffers of their own, then the gated unit."""
        from ... import ops
        wg_t, wu_t, x_t = node.src
        gate, up = ops.mul_mat(wg_t, x_t), ops.mul_mat(wu_t, x_t)        # stand-ins, never in a graph
        glu = (ops.swiglu if node.op_params["glu"] == "swiglu" else ops.geglu)(gate, up)

        def bind_unfused():
            g, u = np.empty(dst.shape, np.float32), np.empty(dst.shape, np.float32)
            calls = [self._bind_mul_mat(gate, g, [srcs[0], srcs[2]]), self._bind_mul_mat(up, u, [srcs[1], srcs[2]])]
            binder = BINDERS.get(glu.op)
            call = binder(glu, dst, [g, u]) if binder is not None else None
            calls.append(call if call is not None else (lambda: K.k_glu(glu, dst, [g, u], self.acc)))
            return calls

        if x_t.ne[2] == x_t.ne[3] == 1 and x_t.type == T.F32:
            from .matmul import act_scratch, bind_mul_mat_glu
            x2 = srcs[2][0, 0]
            late = []

            def run_unfused():          # a batch past the integer path's limit, bound on first use
                if not late:
                    saved, self._quantized = self._quantized, {}     # outside planning: no reuse to claim
                    try:
                        late.extend(bind_unfused())
                    finally:
                        self._quantized = saved
                for c in late:
                    c()
            fast = bind_mul_mat_glu(srcs[0][0, 0], srcs[1][0, 0], wg_t.type, x2, dst[0, 0], node.op_params["glu"],
                                    lambda: self.exact_max_rows, run_unfused, _repacked(wg_t, 2))
            if fast is not None:
                # the activation buffers now hold this x (a later product of the same x may reuse them)
                self._quantized[id(act_scratch(x2.shape[0], x2.shape[1], wg_t.type))] = (x_t.id, id(self._owner(x_t)))
                return fast
        calls = bind_unfused()

        def run():
            for c in calls:
                c()
        if all(getattr(c, "direct", None) is not None for c in calls):
            run.direct = tuple(x for c in calls for x in c.direct)
        return run

    def _bind_mul_mat_id(self, node, dst, srcs):
        as_, b, ids = node.src
        wa, xb, idv = srcs
        mm = self._mul_mat_fn()
        wtype = as_.type
        n_b1 = b.ne[1]
        repacked = _repacked(as_, 3)
        # each expert's product quantizes its rows into the activation buffers shared by shape (a decode step's
        # rows have the shape of the layer's other products): no later product may take them as its x's
        self._quantized = {}

        def run():
            sel = np.asarray(idv)[0, 0]                 # (n_tokens, n_used)
            for e in np.unique(sel):
                t_idx, u_idx = np.nonzero(sel == e)
                x = np.asarray(xb[0, t_idx, u_idx % n_b1], dtype=np.float32)
                o = np.empty((len(t_idx), as_.ne[1]), np.float32)
                mm(wa[0, int(e)], wtype, x, o, self.exact_max_rows, repacked=repacked)
                dst[0, t_idx, u_idx] = o
        return run

    def _bind_flash_attn(self, node, dst, srcs):
        from .attention import _f16_to_f32, flash_attn, use_tiled
        q, k, v = node.src[:3]
        tiled = use_tiled(k.type, v.type, q.ne[1], v.ne[0])
        vdt = TYPE_TRAITS[k.type].vec_dot_type
        p = node.op_params
        qa, ka, va = srcs[:3]
        ma = srcs[3] if p["has_mask"] else None
        # attention sinks (gpt-oss): one logit per head, the last source
        sinks = np.ascontiguousarray(srcs[-1], np.float32).reshape(-1)[:q.ne[2]] if p.get("has_sinks") else None

        def kv(arr, t):     # (values, F16 bits, BF16 bits)
            if t in (T.F16, T.BF16):
                return arr.view(np.uint16), t == T.F16, t == T.BF16
            if TYPE_TRAITS[t].is_quantized:
                return K.to_float(arr, t, np.float32), False, False
            return arr, False, False

        fast = _fa_fast_path(node, qa, ka, va, srcs[3] if p["has_mask"] else None, dst, tiled, sinks,
                             self._memo)
        if fast is not None:
            return fast

        def run():
            kk, kf16, kbf16 = kv(ka, k.type)
            vv, vf16, vbf16 = kv(va, v.type)
            if ma is None:
                mask = None
            elif node.src[3].type == T.F16:      # only the queries' rows (the rest is padding), vcvtph2ps
                mask = _f16_to_f32(ma.view(np.uint16)[:, :, :q.ne[1]])
            else:
                mask = K.to_float(ma, node.src[3].type, np.float32)
            flash_attn(qa, kk, vv, mask, dst, p["scale"], p["max_bias"], p["softcap"], kf16, vf16, tiled, vdt, sinks,
                       kbf16, vbf16)
        return run

    # ------------------------------------------------------------ plans
    def graph_optimize(self, graph_nodes: list[Tensor], nodes: list[Tensor]) -> list[Tensor]:
        """Fuse, within the split, the patterns this backend has kernels for (rms_norm·mul, GLUs, attention...)."""
        from ...fusion import fuse_nodes
        return fuse_nodes(graph_nodes, nodes, self)[0]

    @staticmethod
    def _owner(t: Tensor) -> Tensor:
        return t.view_src if t.view_src is not None else t

    def graph_plan_create(self, nodes: list[Tensor]) -> Plan:
        # activation buffers (by id) -> (tensor id, memory owner id) of the x last quantized into them, in plan
        # order: a product reading the same x next reuses the quantization (see matmul.bind_mul_mat)
        self._quantized: dict = {}
        self._memo: dict = {}
        calls = []
        run = [n for n in nodes if n.op not in VIEW_OPS]
        i = 0
        while i < len(run):
            call = self._bind_pair(run[i], run[i + 1]) if i + 1 < len(run) else None
            bound = run[i:i + 2] if call is not None else run[i:i + 1]
            calls.append(call if call is not None else self._bind(run[i]))
            i += len(bound)
            for n in bound:
                if self._quantized:
                    # a node writing into the memory of a quantized x (SET_ROWS or CPY into a view of it, an op in
                    # place) makes that quantization stale
                    o = id(self._owner(n))
                    self._quantized = {k: v for k, v in self._quantized.items() if v[1] != o}
        self._quantized = {}
        memo, self._memo = self._memo, None
        return Plan(calls, nodes, memo, self.exact_max_rows)

    def _bind_pair(self, n: Tensor, m: Tensor):
        """One call for two consecutive nodes where a kernel does both (``numba_ops.PAIR_BINDERS``: a residual add
        and the norm reading it, a rotation and its store into the cache), or None. Small one-thread ops of a decoded
        token, whose Python call and kernel entry cost more than their work: fewer calls, the same bits."""
        binder = PAIR_BINDERS.get((n.op, m.op))
        if binder is None:
            return None
        return binder(n, m, [[self._view(s) if s is not None else None for s in n.src], self._view(n),
                             [self._view(s) for s in m.src], self._view(m)])

    def graph_plan_compute(self, plan: Plan) -> None:
        plan.memo.clear()
        if self.reverse_calls:
            for c in reversed(plan.calls):
                c()
            return
        same = plan.limit == self.exact_max_rows
        fast = plan.fast
        if fast is not None and same:
            if fast is False:       # a second run: the plan is kept and its kernels are compiled
                fast = plan.fast = resolve_calls(plan.calls)
            for c in fast:
                c()
            return
        for c in plan.calls:
            c()
        if same:
            plan.fast = False

    def graph_plan_settle(self, plan: Plan) -> None:
        """Bind the plan's fast run now if it has run once (what its second run would do first: resolving its
        calls types every argument of every kernel call, 15-80 ms for a SmolLM2 step of 1-32 tokens)."""
        if plan.fast is False and plan.limit == self.exact_max_rows:
            plan.fast = resolve_calls(plan.calls)

    def graph_compute(self, nodes: list[Tensor]) -> None:
        self.graph_plan_compute(self.graph_plan_create(nodes))


def _repacked(t: Tensor, dims: int) -> bool:
    """Whether llama.cpp would hold t repacked (its CPU extra buffer, ``ggml_repack_get_optimal_repack_type``): a
    model's weight of ``dims`` dimensions (2 for MUL_MAT, 3 for MUL_MAT_ID's experts) used as it is, not a view (the
    KV cache's K, which llama.cpp keeps in a plain buffer and multiplies by vec_dot), nor a LoRA adapter's
    ``.lora_a`` / ``.lora_b`` matrix (llama-adapter.cpp loads those into the plain CPU buffer)."""
    return (t.op == Op.NONE and bool(t.flags & Flags.WEIGHT) and all(v == 1 for v in t.ne[dims:])
            and not (t.name or "").endswith((".lora_a", ".lora_b")))


def _rows_contiguous(a, itemsize) -> bool:
    """The last axis contiguous and the one before it packed: what the vector kernels index directly."""
    return a.strides[-1] == itemsize and (a.shape[-2] <= 1 or a.strides[-2] == itemsize * a.shape[-1])


_VISIBLE: dict = {}     # a decode mask's key -> the buffers its listed cells are copied into (_fill_visible)


def _fill_visible(m, n_q, n_kv, bufs) -> None:
    """attention.visible_cells of the mask m into fixed buffers (idx, val, cnt), each row's cells first."""
    from .attention import visible_cells
    idx, val, cnt = visible_cells(m, n_q, n_kv)[:3]
    w = idx.shape[1]
    bufs[0][:, :w] = idx
    bufs[1][:, :w] = val
    bufs[2][:] = cnt


def _fa_fast_path(node, qa, ka, va, ma, dst, tiled, sinks=None, memo=None):
    """Decode-sized flash attention over F16 or BF16 K/V views of the cache, bound once: the kernel reads the cache
    views and writes the destination in place (no copies of K, V or the result per call). ``memo``: the plan's, where
    the layers reading one input mask share the cells it leaves visible (listed by the first of them in each run)."""
    from .attention import _fa_vec16, visible_cells
    q, k, v = node.src[:3]
    p = node.op_params
    half = (T.F16, T.BF16)
    if tiled or k.type not in half or v.type not in half or q.type != T.F32 or node.type != T.F32:
        return None
    if not dst.flags.c_contiguous:
        return None
    if not (_rows_contiguous(ka, 2) and _rows_contiguous(va, 2) and qa.strides[-1] == 4):
        return None
    kk, vv = ka.view(np.uint16), va.view(np.uint16)
    kb, vb = k.type == T.BF16, v.type == T.BF16
    from .numpy_ops import alibi_slopes
    slopes = alibi_slopes(q.ne[2], p["max_bias"], np.float32)
    softcap = p["softcap"]
    sc = np.float32(p["scale"] / softcap) if softcap else np.float32(p["scale"])
    cap = np.float32(softcap)
    if p["has_mask"]:
        mtype = node.src[3].type
        if mtype == T.F16:
            m = ma.view(np.uint16)                        # read as bits; rows past the queries' are padding
        elif mtype == T.F32:
            m = ma
        else:
            return None
        src = node.src[3].view_src if node.src[3].view_src is not None else node.src[3]
        if memo is None or src.op != Op.NONE:     # a mask computed in the graph: its buffer may be reused
            return lambda: _fa_vec16(qa, kk, vv, m, dst, sc, cap, slopes, sinks, kb, vb)
        # a str: its hash is kept, so the per-run lookup does not rehash a nested tuple
        key = repr(("visible", m.ctypes.data, m.shape, m.strides, qa.shape[2], kk.shape[2]))

        def visible():  # the first layer of a run lists the cells; the others reading this mask reuse the list
            vis = memo.get(key)
            if vis is None:
                vis = memo[key] = visible_cells(m, qa.shape[2], kk.shape[2])
            return vis
        if kb or vb:
            return lambda: _fa_vec16(qa, kk, vv, m, dst, sc, cap, slopes, sinks, kb, vb, visible())
        from .attention import _NO_SINKS, _fa_vec16_kernel
        sk = _NO_SINKS if sinks is None else sinks
        # F16 K and V: _fa_vec16's kernel called directly (30 calls a token in SmolLM2)
        run = lambda: _fa_vec16_kernel(qa, kk, vv, *visible(), dst, sc, cap, slopes, sk)
        n_q, n_rows = qa.shape[2], m.shape[0] * m.shape[1] * qa.shape[2]
        if m.shape[3] and n_rows * m.shape[3] <= 1 << 20 and src.flags & Flags.INPUT:
            # the plan's fast run: the cells listed once a run into buffers of the mask's width (the kernel reads
            # each row's first cnt), then the kernel's entry point with its arguments fixed
            bufs = _VISIBLE.get(key)
            if bufs is None:
                if len(_VISIBLE) > 64:
                    _VISIBLE.clear()
                bufs = _VISIBLE[key] = (np.zeros((n_rows, m.shape[3]), np.int32),
                                        np.zeros((n_rows, m.shape[3]), np.float32), np.zeros(n_rows, np.int32))
            run.direct = (Prepare(lambda: _fill_visible(m, n_q, kk.shape[2], bufs), key),
                          Direct(_fa_vec16_kernel, qa, kk, vv, *bufs, m.shape[0], m.shape[1], n_q, dst, sc, cap,
                                 slopes, sk))
        return run
    nomask = np.zeros((1, 1, 1, 0), np.float32)
    return lambda: _fa_vec16(qa, kk, vv, nomask, dst, sc, cap, slopes, sinks, kb, vb)
