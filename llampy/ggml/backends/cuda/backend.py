"""The CUDA backend: device buffers from torch, block formats decoded by Triton kernels, the rest in torch.

A split's nodes are bound once per plan (``graph_plan_create``: each node becomes a closure over torch views of
its memory). Matrix products with block-format weights run the Triton ``matvec`` for up to 8 rows of activations
(decode) and dequantize to F16 tiles for cuBLAS above that (prompts); F16/BF16/F32 weights go to cuBLAS directly.
Attention is torch's scaled_dot_product_attention over the F16 cache (GQA folded into the query rows), the other
ops are torch expressions in float32 following ggml's semantics (``backends/reference.py`` states them).

Decode replays CUDA graphs: a plan that runs a second time with the same memory is captured
(``torch.cuda.CUDAGraph``) and replayed from then on, so a token costs one launch from Python, not hundreds. The
scheduler keeps a plan as long as its graph's tensors stay where they are (a new placement makes a new plan), and
everything a plan reads comes from the graph's inputs (written before each run), the weights or the KV cache.
Plans that must read device values on the host (MUL_MAT_ID's expert ids) run eagerly.

Under ``TRITON_INTERPRET=1`` without a GPU the device is torch's CPU and the Triton kernels run in the
interpreter: the tests of ``make test-cuda`` run there in CI.
"""
from __future__ import annotations

import math
import os
import warnings

import numpy as np
import torch
import torch.nn.functional as F
import triton

from ...backend import Backend, register_backend
from ...tensor import Flags, Op, Tensor, VIEW_OPS, BINARY_OPS, UNARY_OPS
from ...types import GGMLType, TYPE_TRAITS
from . import kernels as K
from . import mmvq as MMVQ
from .buffer import CUDABufferType, TORCH_DTYPE, rows, view

T = GGMLType
F32 = torch.float32

MATVEC_MAX_COLS = 8            # activation rows handled by the matvec kernel; more go to dequantize + cuBLAS
PLAIN = frozenset({T.F32, T.F16, T.BF16})
KV_QUANT = frozenset(K.KV_QUANT_TYPES)      # the block formats a KV cache may take here (stores and attention)
BLOCK_TYPES = frozenset(K.TYPES) - PLAIN


def torch_device(index: int = 0) -> torch.device:
    """The device the backend runs on: GPU ``index``; torch's CPU under ``TRITON_INTERPRET=1`` without a GPU."""
    if torch.cuda.is_available():
        if index >= torch.cuda.device_count():
            raise ValueError(f"CUDA device {index} does not exist ({torch.cuda.device_count()} visible)")
        return torch.device("cuda", index)
    if os.environ.get("TRITON_INTERPRET") == "1":
        return torch.device("cpu")
    raise RuntimeError("no CUDA device is available (torch.cuda.is_available() is False)")


def device_count() -> int:
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return 1 if os.environ.get("TRITON_INTERPRET") == "1" else 0


def free_memory(dev: torch.device) -> int:
    """Bytes free on the device (the interpreter's CPU "device": unbounded)."""
    if dev.type != "cuda":
        return 1 << 62
    free, _total = torch.cuda.mem_get_info(dev)
    return int(free)


# ---------------------------------------------------------------------------------------------- helpers
def _param(node, key):
    return float(np.float32(node.op_params[key]))


def _bcast(b: torch.Tensor, shape) -> torch.Tensor:
    """ggml's repeat rule: each dim of b divides the target's (torch broadcasts 1 and equal dims; others tile)."""
    if all(n == 1 or n == s for n, s in zip(b.shape, shape)):
        return b
    return b.repeat(*[s // n for s, n in zip(shape, b.shape)])


def _alibi(n_head: int, max_bias: float, dev) -> torch.Tensor | None:
    if max_bias <= 0:
        return None
    n2 = 2 ** int(math.floor(math.log2(n_head)))
    m0 = 2.0 ** (-max_bias / n2)
    m1 = 2.0 ** (-(max_bias / 2.0) / n2)
    s = [m0 ** (h + 1) if h < n2 else m1 ** (2 * (h - n2) + 1) for h in range(n_head)]
    return torch.tensor(s, dtype=F32, device=dev).reshape(1, -1, 1, 1)


def _gelu(x):
    """ggml's GELU (tanh form) as ggml-cpu computes it: the value at x's F16 rounding, rounded to F16 (its
    table), 0 below -10 and x above 10 — so that GPU and CPU layers agree."""
    g = F.gelu(x.to(torch.float16).float(), approximate="tanh").to(torch.float16).float()
    return torch.where(x <= -10.0, torch.zeros_like(x), torch.where(x >= 10.0, x, g))


def _gelu_quick(x):
    """ggml's GELU_QUICK as ggml-cpu computes it: x * sigmoid(1.702 x) at x's F16 rounding, rounded to F16 (its
    table)."""
    h = x.to(torch.float16).float()
    return (h * torch.sigmoid(1.702 * h)).to(torch.float16).float()


_UNARY = {
    Op.GELU_QUICK: _gelu_quick, Op.NEG: torch.neg,
    Op.SQR: lambda x: x * x, Op.SQRT: torch.sqrt, Op.EXP: torch.exp, Op.TANH: torch.tanh, Op.SILU: F.silu,
    Op.GELU: _gelu, Op.GELU_ERF: F.gelu, Op.RELU: torch.relu, Op.SIGMOID: torch.sigmoid,
    Op.SOFTPLUS: lambda x: torch.where(x > 20.0, x, torch.log(1.0 + torch.exp(torch.clamp(x, max=20.0)))),
}
_BINARY = {Op.ADD: torch.add, Op.SUB: torch.sub, Op.MUL: torch.mul, Op.DIV: torch.div}


class Plan:
    __slots__ = ("calls", "nodes", "capturable", "runs", "graph")

    def __init__(self, calls, nodes, capturable):
        self.calls = calls
        self.nodes = nodes
        self.capturable = capturable
        self.runs = 0
        self.graph = None


class CUDABackend(Backend):
    name = "cuda"
    # rows per program of the tiled products on a GPU (the several-column matvec's and the prompt dequantizer's
    # tensor-core tiles; the decode kernels' 1-16 rows divide it): a row split's shares are rounded to it
    # (split.py, ggml's get_row_rounding of mmq_y)
    row_tile = 16

    def __init__(self, device: str | int | None = None, n_threads: int | None = None, cuda_graphs: bool = True):
        index = int(str(device).rsplit(":", 1)[-1]) if device not in (None, "cuda") else 0
        self.dev = torch_device(index)
        super().__init__(f"cuda:{index}")
        self._buft = CUDABufferType(self.dev, self.device)
        self.cuda_graphs = cuda_graphs and self.dev.type == "cuda"
        self._lut = torch.tensor(K.LUT, device=self.dev)
        self._dummy = torch.zeros(1, dtype=torch.int32, device=self.dev)
        # streaming multiprocessors (launch shapes fill them); the interpreter: a few, so that its tests take the
        # split paths too
        self.n_sm = torch.cuda.get_device_properties(self.dev).multi_processor_count if self.dev.type == "cuda" else 4
        self._capture_warned = False
        self._q8_shared = None          # while a plan is bound: activation quantizations its products share
        self._norm_quant = None         # ... and the norms that make them (_norm_quant_plan)

    def description(self) -> str:
        if self.dev.type == "cuda":
            return torch.cuda.get_device_name(self.dev)
        return "CUDA kernels in the Triton interpreter (CPU)"

    def free_memory(self) -> int:
        return free_memory(self.dev)

    def synchronize(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)

    def supports_kv_type(self, t: GGMLType) -> bool:
        """Whether a KV cache of this type can live here (set_rows into it and attention over it run here)."""
        return t in PLAIN or t in KV_QUANT

    def supports_weight(self, t: GGMLType) -> bool:
        """Whether a weight of this type can live here (its matrix products and row reads run here)."""
        return t in K.TYPES

    # ------------------------------------------------------------ what runs here
    def supports_op(self, node: Tensor) -> bool:
        op = node.op
        if op in VIEW_OPS:
            return True
        srcs = [s for s in node.src if s is not None]
        if op in (Op.MUL_MAT, Op.MUL_MAT_ID):
            return srcs[0].type in K.TYPES and srcs[1].type in PLAIN
        if op == Op.MUL_MAT_GLU:
            return srcs[0].type in K.TYPES and srcs[1].type in K.TYPES and srcs[2].type in PLAIN
        if op == Op.GET_ROWS:
            return srcs[0].type in K.TYPES or srcs[0].type == T.I32
        if op == Op.SET_ROWS:
            if node.type in KV_QUANT:       # the quantizing store: one index list for every plane, F32 rows
                return (srcs[0].type == T.F32 and srcs[0].nb[0] == 4 and srcs[0].ne[3] == 1 and node.ne[3] == 1
                        and srcs[1].ne[1] == srcs[1].ne[2] == srcs[1].ne[3] == 1)
            return node.type in PLAIN and srcs[0].type in PLAIN
        if op in (Op.CPY, Op.CONT, Op.DUP):
            if node.type in KV_QUANT:       # F32 values into rows of a block format (the K shift's store)
                return srcs[0].type == T.F32 and node.nb[0] == TYPE_TRAITS[node.type].type_size
            if srcs[0].type in KV_QUANT:    # rows of a block format to F16/F32 (the K shift's read)
                return node.type in (T.F16, T.F32) and node.is_contiguous() and srcs[0].nb[0] == \
                    TYPE_TRAITS[srcs[0].type].type_size and srcs[0].ne == node.ne
            return node.type in TORCH_DTYPE and srcs[0].type in TORCH_DTYPE
        if op == Op.FLASH_ATTN_EXT:
            return all(s.type in PLAIN or (i in (1, 2) and s.type in KV_QUANT) for i, s in enumerate(srcs))
        if op == Op.ROPE and node.op_params.get("sections"):
            # ggml_rope_multi: the vision rope (an encoder's 2-D positions) here; M-RoPE and YaRN: the CPU's
            p = node.op_params
            return p["mode"] == 24 and p["ext_factor"] == 0.0 and srcs[0].type == T.F32 and node.type == T.F32
        if op in _TABLE:
            return all(s.type in TORCH_DTYPE for s in srcs) and node.type in TORCH_DTYPE
        return False

    FUSED = frozenset({Op.RMS_NORM_MUL, Op.SOFTCAP})     # the fused ops this backend binds to one kernel or two

    def graph_optimize(self, graph_nodes: list[Tensor], nodes: list[Tensor]) -> list[Tensor]:
        """Fuse RMS norm with its weight (and residual add) and soft-capping within the split: fewer launches."""
        from ...fusion import fuse_nodes
        return fuse_nodes(graph_nodes, nodes, lambda n: n.op in self.FUSED and self.supports_op(n))[0]

    def offload_op(self, node: Tensor) -> bool:
        """A large matrix product whose weights live on the host is still worth running here (ggml-cuda: batches of
        32 rows and more), its weights copied over."""
        return node.op in (Op.MUL_MAT, Op.MUL_MAT_ID) and node.src[1].ne[1] >= 32

    # ------------------------------------------------------------ plans
    def graph_plan_create(self, nodes: list[Tensor]) -> Plan:
        self._q8_shared = {}
        self._norm_quant = self._norm_quant_plan(nodes)
        stores = _rope_stores(nodes)
        try:
            calls = []
            for n in nodes:
                if n.op in VIEW_OPS or n.op == Op.NONE or stores.get(n.id, n) is None:
                    continue
                calls.append(b_rope(self, n, stores[n.id]) if n.id in stores else self._bind(n))
        finally:
            self._q8_shared = None
        capturable = not any(n.op == Op.MUL_MAT_ID for n in nodes)
        return Plan(calls, nodes, capturable)

    def graph_plan_compute(self, plan: Plan) -> None:
        if plan.graph is not None:
            plan.graph.replay()
            return
        plan.runs += 1
        if self.cuda_graphs and plan.capturable and plan.runs == 2:
            # the first run compiled every kernel; capture the second, then replay it (this run included)
            torch.cuda.synchronize(self.dev)
            g = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(g):
                    for c in plan.calls:
                        c()
            except Exception as e:          # a call the capture refuses: this plan runs eagerly from now on
                plan.capturable = False
                if not self._capture_warned:
                    self._capture_warned = True
                    warnings.warn(f"cuda: decode runs without CUDA graphs ({type(e).__name__}: {e})",
                                  RuntimeWarning, stacklevel=2)
            else:
                plan.graph = g
                g.replay()
                return
        for c in plan.calls:
            c()

    def graph_compute(self, nodes: list[Tensor]) -> None:
        plan = self.graph_plan_create(nodes)
        for c in plan.calls:
            c()

    # ------------------------------------------------------------ binding
    def _bind(self, node: Tensor):
        fn = _TABLE.get(node.op)
        if fn is None:
            raise NotImplementedError(f"the cuda backend does not run {node.op.value}")
        return fn(self, node)

    # matrix products ----------------------------------------------------------------------
    def _dequant(self, a: Tensor, a_rows: torch.Tensor, out_dtype, idx: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of a 2-D block-format (or F16/BF16/F32) matrix as a new [n, K] tensor of ``out_dtype``."""
        w = a_rows.reshape(-1, a_rows.shape[-1]) if idx is None else a_rows
        n = w.shape[0] if idx is None else idx.numel()
        kdim = a.ne[0]
        out = torch.empty((n, kdim), dtype=out_dtype, device=self.dev)
        if n == 0:
            return out
        if a.type in K.FAST_DEQUANT and K.FAST_DEQUANT_ON:
            br = 16 if self.dev.type == "cuda" else 32
            K.dequant_fast[(triton_cdiv(n, br), triton_cdiv(kdim, 256))](
                w, idx if idx is not None else self._dummy, out, n, kdim, a.nb[1], kdim, USE_IDX=idx is not None,
                TYPE=int(a.type), OUT_F16=out_dtype == torch.float16, BR=br)
            return out
        br, bk = (16, 256) if self.dev.type == "cuda" else (256, 256)   # the interpreter runs programs one by one
        grid = (triton_cdiv(n, br), triton_cdiv(kdim, bk))
        K.dequant[grid](w, idx if idx is not None else self._dummy, out, self._lut, n, kdim, a.nb[1], kdim,
                        USE_IDX=idx is not None, TYPE=int(a.type), OUT_F16=out_dtype == torch.float16,
                        BR=br, BK=bk)
        return out

    def _matvec_plan(self, a: Tensor, nc: int):
        """(rows per program, K tile, K elements per split, number of splits) for a's decode product. One column:
        4 rows and tiles of 1024 values per program, K split until there are about 32 programs per
        multiprocessor (the fastest launch shape of benchmarks/gpu_matvec.py on an H200 for Q4_K and Q4_0).
        Several columns: 16 rows (tensor-core tiles), tiles of 256."""
        n, kdim = a.ne[1], a.ne[0]
        bk = 1024 if nc == 1 else 256
        nkb = triton_cdiv(kdim, bk)
        if self.dev.type != "cuda":
            return 128, bk, nkb * bk, 1                  # the interpreter runs programs one by one
        bn = 4 if nc == 1 else 16
        want = 32 * torch.cuda.get_device_properties(self.dev).multi_processor_count
        split = max(1, min(nkb, want // triton_cdiv(n, bn)))
        kc = triton_cdiv(nkb, split) * bk
        return bn, bk, kc, triton_cdiv(kdim, kc)

    def _matvec(self, a: Tensor, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, plan, part=None) -> None:
        """y [nc, N] = round(x [nc, K]) @ a^T for a 2-D weight of a kernel type; x, y float32 with rows
        contiguous; x rounded to a's dot type as llama.cpp does. With several splits, ``part`` [splits, nc, N]
        takes the partial sums."""
        bn, bk, kc, split = plan
        nc, n = x.shape[0], a.ne[1]
        out = y if split == 1 else part
        K.matvec[(triton_cdiv(n, bn), split)](w, x, out, self._lut, n, a.ne[0], kc, a.nb[1], x.stride(0),
                                              out.stride(-2), out.stride(0) if split > 1 else 0,
                                              NC=nc, TYPE=int(a.type), ACT=_act(a.type), BN=bn, BK=bk)
        if split > 1:
            torch.sum(part, dim=0, out=y)

    def _q8_scratch(self, t: GGMLType, b: Tensor, kdim: int):
        """Buffers for one activation row quantized for a format of MMVQ.KERNELS (int8 values, block scales, sums
        of 16), and whether this product quantizes it: products of one plan that read the same activations in the
        same block size (attention's q, k, v; the FFN's gate and up) share one quantization, done by the first."""
        g = MMVQ.KERNELS[t][1]
        shared = self._q8_shared.get((id(b), g)) if self._q8_shared is not None else None
        if shared is not None:
            return shared, False
        bufs = self._q8_bufs(kdim, g)
        if self._q8_shared is not None:
            self._q8_shared[(id(b), g)] = bufs
        return bufs, True

    def _q8_bufs(self, kdim: int, g: int):
        """An activation row's quantized form for the integer decode kernels: int8 values, block scales, sums of 16."""
        return (torch.empty(kdim, dtype=torch.int8, device=self.dev), torch.empty(kdim // g, dtype=F32, device=self.dev),
                torch.empty(kdim // 16, dtype=torch.int32, device=self.dev), g)

    def _norm_quant_plan(self, nodes: list[Tensor]) -> dict:
        """RMS norms of one row whose every integer-kernel product quantizes it in one block size: id -> that size.
        Their norm kernel writes the quantization too (one launch less per norm)."""
        sizes: dict[int, set] = {}
        norms = {id(n) for n in nodes if n.op in (Op.RMS_NORM, Op.RMS_NORM_MUL)}
        for n in nodes:
            if n.op != Op.MUL_MAT or id(n.src[1]) not in norms:
                continue
            a, b = n.src
            ok = (a.type in MMVQ.KERNELS and a.ne[2] == a.ne[3] == 1 and b.ne[1] * b.ne[2] * b.ne[3] == 1
                  and b.type == T.F32 and b.is_contiguous())
            sizes.setdefault(id(b), set()).add(MMVQ.KERNELS[a.type][1] if ok else None)
        return {k: next(iter(v)) for k, v in sizes.items() if len(v) == 1 and None not in v}

    def _mmvq(self, a: Tensor, w: torch.Tensor, x: torch.Tensor, xq, y: torch.Tensor, quant: bool = True) -> None:
        """y [1, N] = x [1, K] @ a^T by the integer kernels (mmvq.py): x quantized to int8 in a's dot type (unless
        an earlier product of the plan did), then one program per BN rows. Falls back to the value rules (with a
        warning, once per type) where the device cannot compile them."""
        kdim, n = a.ne[0], a.ne[1]
        q, d, s, g = xq
        if quant:
            MMVQ.quantize_act[(kdim // g,)](x, q, d, s, kdim, G=g)
        kern = MMVQ.KERNELS[a.type][0]
        # the interpreter runs programs one after another: few programs of many rows (the same sums per row)
        bn, sb, warps = MMVQ.SHAPES[a.type] if self.dev.type == "cuda" else (512, 8, 4)
        try:
            extra = {"TYPE": int(a.type)} if a.type in MMVQ.TYPE_ARG else {}
            kern[(triton_cdiv(n, bn),)](w, q, d, s, y, n, kdim, a.nb[1], BN=bn, SB=sb, ASM=self.dev.type == "cuda",
                                        num_warps=warps, **extra)
        except Exception as e:          # a compiler that refuses the kernel: the value rules still work
            MMVQ.KERNELS.pop(a.type, None)
            warnings.warn(f"cuda: the integer {a.type.name} decode kernel failed ({type(e).__name__}: {e}); using "
                          f"the per-element one", RuntimeWarning, stacklevel=2)
            plan = self._matvec_plan(a, 1)
            part = torch.empty((plan[3], 1, n), dtype=F32, device=self.dev) if plan[3] > 1 else None
            self._matvec(a, w, x, y, plan, part)

    def _round_act(self, a_type: GGMLType, x: torch.Tensor) -> torch.Tensor:
        """x [n, K] (float32, rows contiguous) rounded to a_type's dot type, as a new tensor."""
        act = _act(a_type)
        if act == 0:
            return x
        out = torch.empty_like(x)
        kdim = x.shape[1]
        K.round_act[(x.shape[0], triton_cdiv(kdim, 256))](x, out, kdim, x.stride(0), out.stride(0), ACT=act, BK=256)
        return out




def _act(t: GGMLType) -> int:
    return K.ACT_OF_DOT_TYPE.get(TYPE_TRAITS[t].vec_dot_type, 0) if t in BLOCK_TYPES else 0


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _f(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == F32 else t.float()


# ---------------------------------------------------------------------------------------------- op binders
# each takes (backend, node) and returns a closure that runs the op

def b_binary(be, node):
    a, b, d = view(node.src[0]), view(node.src[1]), view(node)
    fn = _BINARY[node.op]
    shape = tuple(a.shape)
    if a.dtype == b.dtype == d.dtype == F32 and tuple(d.shape) == shape:
        # one kernel writing the result in place (a decode step's residual and bias adds: half the launches)
        return lambda: fn(a, _bcast(b, shape), out=d)

    def run():
        d.copy_(fn(_f(a), _bcast(_f(b), shape)))
    return run


def b_unary(be, node):
    a, d, fn = view(node.src[0]), view(node), _UNARY[node.op]
    return lambda: d.copy_(fn(_f(a)))


def b_scale(be, node):
    a, d = view(node.src[0]), view(node)
    s, b = _param(node, "s"), _param(node, "b")
    if b == 0.0 and a.dtype == d.dtype == F32 and a.shape == d.shape:
        return lambda: torch.mul(a, s, out=d)
    if b == 0.0:
        return lambda: d.copy_(_f(a) * s)
    return lambda: d.copy_(_f(a) * s + b)


def b_clamp(be, node):
    a, d = view(node.src[0]), view(node)
    lo, hi = _param(node, "min"), _param(node, "max")
    return lambda: d.copy_(torch.clamp(_f(a), lo, hi))


def b_softcap(be, node):
    a, d = view(node.src[0]), view(node)
    si, so = _param(node, "s_in"), _param(node, "s_out")
    return lambda: d.copy_(torch.tanh(_f(a) * si) * so)


def b_glu(be, node):
    a, d = view(node.src[0]), view(node)
    act = F.silu if node.op is Op.SWIGLU else _gelu
    if len(node.src) == 2 and node.src[1] is not None:
        u = view(node.src[1])
        if (a.dtype == u.dtype == d.dtype == F32 and a.is_contiguous() and u.is_contiguous() and d.is_contiguous()
                and a.shape == u.shape == d.shape):
            n = d.numel()
            gelu = node.op is Op.GEGLU
            return lambda: K.swiglu[(triton_cdiv(n, 1024),)](a, u, d, n, BLOCK=1024, GELU=gelu)
        return lambda: d.copy_(act(_f(a)) * _f(u))
    h = node.src[0].ne[0] // 2
    g, u = (a[..., h:], a[..., :h]) if node.op_params.get("swapped") else (a[..., :h], a[..., h:])
    return lambda: d.copy_(act(_f(g)) * _f(u))


def b_soft_max(be, node):
    a, d = view(node.src[0]), view(node)
    scale = _param(node, "scale")
    if not node.op_params["has_mask"]:
        return lambda: d.copy_(torch.softmax(_f(a) * scale, dim=-1))
    m = view(node.src[1])[:, :, :a.shape[2], :]
    slopes = _alibi(a.shape[1], _param(node, "max_bias"), be.dev)
    shape = (a.shape[0], a.shape[1]) + tuple(m.shape[2:])

    def run():
        mm = _bcast(_f(m), shape)
        if slopes is not None:
            mm = mm * slopes
        d.copy_(torch.softmax(_f(a) * scale + mm, dim=-1))
    return run


def _rows2d(t: torch.Tensor, ne0: int) -> torch.Tensor | None:
    """t as [rows, ne0] without a copy (rows evenly strided, values contiguous), or None."""
    if t.dtype != F32 or (t.dim() and t.stride(-1) != 1):
        return None
    try:
        return t.view(-1, ne0)
    except RuntimeError:
        return None


def _bind_rms(be, node, w_t, add_t):
    """The Triton row kernel for RMS norm (with weight and residual add) where the layouts allow, else torch."""
    a, d, eps = view(node.src[0]), view(node), _param(node, "eps")
    ne0 = node.src[0].ne[0]
    x2, d2 = _rows2d(a, ne0), _rows2d(d, ne0)
    w = view(w_t) if w_t is not None else None
    add = view(add_t) if add_t is not None else None
    w2 = _rows2d(w, ne0) if w is not None else None
    a2 = _rows2d(add, ne0) if add is not None else None
    fast = x2 is not None and d2 is not None and (w is None or (w2 is not None and w2.shape[0] in (1, x2.shape[0]))) \
        and (add is None or (a2 is not None and a2.shape[0] == x2.shape[0]))
    if fast:
        nrows = x2.shape[0]
        block = triton.next_power_of_2(ne0)
        sw = 0 if w2 is None or w2.shape[0] == 1 else w2.stride(0)
        g = be._norm_quant.get(id(node)) if nrows == 1 and be._norm_quant is not None else None
        qg, (xq, xd, xs) = 0, (be._dummy,) * 3
        if g is not None and be._q8_shared is not None:     # its decode products read the quantization made here
            xq, xd, xs, _g = be._q8_shared[(id(node), g)] = be._q8_bufs(ne0, g)
            qg = g

        def run():
            K.rms_norm_mul[(nrows,)](x2, w2 if w2 is not None else x2, a2 if a2 is not None else x2, d2, ne0,
                                     x2.stride(0), sw, a2.stride(0) if a2 is not None else 0, d2.stride(0), eps,
                                     xq, xd, xs, HAS_W=w2 is not None, HAS_ADD=a2 is not None, BLOCK=block, QG=qg)
        return run

    def run():
        x = _f(a)
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        if w is not None:
            y = y * _bcast(_f(w), tuple(x.shape))
        d.copy_(y if add is None else y + _f(add))
    return run


def b_rms_norm(be, node):
    return _bind_rms(be, node, None, None)


def b_rms_norm_mul(be, node):
    add = node.src[2] if len(node.src) > 2 and node.src[2] is not None else None
    return _bind_rms(be, node, node.src[1], add)


def b_norm(be, node):
    a, d, eps = view(node.src[0]), view(node), _param(node, "eps")

    def run():
        x = _f(a)
        xc = x - x.mean(-1, keepdim=True)
        d.copy_(xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps))
    return run


def b_l2_norm(be, node):
    a, d, eps = view(node.src[0]), view(node), _param(node, "eps")

    def run():
        x = _f(a)
        d.copy_(x / torch.clamp(torch.linalg.vector_norm(x, dim=-1, keepdim=True), min=eps))
    return run


def _bind_rope_vision(be, node):
    """ggml_rope_multi's vision mode (ggml-cuda's rope_vision): pair i rotates (x_i, x_{i + n_dims}) by the
    position of its section's row times theta_scale^(i's place in its section), each section starting again at
    its row; / freq factor, x freq_scale, x attn_factor (no YaRN ramp: supports_op leaves that to the CPU)."""
    p = node.op_params
    x, pos, d = view(node.src[0]), view(node.src[1]), view(node)
    n_dims = p["n_dims"]
    starts = np.cumsum((0,) + tuple(p["sections"][:3]))
    sector = np.arange(n_dims) % sum(p["sections"])
    row = np.searchsorted(starts, sector, side="right") - 1
    ts = np.float32(math.pow(p["freq_base"], -2.0 / n_dims))
    powers = torch.tensor(ts ** (sector - starts[row]).astype(np.float32), dtype=F32, device=be.dev)
    rowt = torch.tensor(row, dtype=torch.long, device=be.dev)
    ff = view(node.src[2]).reshape(-1)[:n_dims] if p.get("has_freq_factors") else None
    freq_scale, mscale = float(np.float32(p["freq_scale"])), float(np.float32(p["attn_factor"]))

    def run():
        th = pos.reshape(4, -1).to(F32)[rowt].t() * powers                   # [n_tokens, n_dims]
        if ff is not None:
            th = th / _f(ff)[None, :]
        theta = th * freq_scale
        c = (torch.cos(theta) * mscale)[None, :, None, :]
        s = (torch.sin(theta) * mscale)[None, :, None, :]
        xf = _f(x)
        x0, x1 = xf[..., :n_dims], xf[..., n_dims:2 * n_dims]
        d.copy_(torch.cat([x0 * c - x1 * s, x0 * s + x1 * c, xf[..., 2 * n_dims:]], dim=-1))
    return run


def _rope_stores(nodes: list[Tensor]) -> dict:
    """The ropes whose result only a SET_ROWS into the KV cache reads (K of the new tokens, through a permuted
    view): rope id -> that SET_ROWS, and the SET_ROWS id -> None. b_rope then rotates each row straight into the
    cache (one launch, not two) and the SET_ROWS is not bound. Only where nothing between the two reads the
    cache, and the store is set_rows' one-kernel case over a cache of plain cells."""
    readers: dict[int, list] = {}
    for n in nodes:
        for s in n.src:
            if s is not None:
                readers.setdefault(s.id, []).append(n)
    pos = {n.id: i for i, n in enumerate(nodes)}
    out = {}
    for n in nodes:
        if n.op != Op.ROPE or n.op_params.get("sections") or n.flags & Flags.OUTPUT or n.type != T.F32:
            continue
        chain, cur = [], n            # the views of the result down to the store
        while len(readers.get(cur.id, ())) == 1 and readers[cur.id][0].op in VIEW_OPS:
            cur = readers[cur.id][0]
            if cur.flags & Flags.OUTPUT:
                break
            chain.append(cur)
        st = readers.get(cur.id, [])
        if len(st) != 1 or st[0].op != Op.SET_ROWS or st[0].src[0] is not cur or st[0].type not in PLAIN:
            continue
        st = st[0]
        cache = st.view_src if st.view_src is not None else st
        between = nodes[pos[n.id] + 1:pos[st.id]]
        if any(s is not None and (s is cache or s.view_src is cache) for b in between for s in b.src):
            continue
        out[n.id], out[st.id] = st, None
    return out


def _rope_store_views(be, node, st):
    """For b_rope's fused store: (cache rows view (heads, cells, ne0), row ids) where the SET_ROWS ``st`` takes
    row (token t, head h) of the rope's result ``node`` to cache row ids[t] of head h; None where its views do
    not map the rows so (or set_rows' one-kernel case does not hold)."""
    src, idx = st.src[0], st.src[1]
    d, s, iv, r = view(st), view(src), view(idx), view(node)
    if not (src.ne[3] == 1 and st.ne[3] == 1 and st.ne[2] == src.ne[2] and d.stride(-1) == 1
            and idx.ne[1] == idx.ne[2] == idx.ne[3] == 1 and iv.stride(-1) == 1 and r.shape[0] == 1):
        return None
    s3 = s[0]                         # (heads, tokens, ne0): must be the rope's (tokens, heads, ne0) transposed
    if not (s3.data_ptr() == r.data_ptr() and s3.shape == (r.shape[2], r.shape[1], r.shape[3])
            and s3.stride(0) == r.stride(2) and s3.stride(1) == r.stride(1) and s3.stride(2) == 1):
        return None
    return d[0], iv.reshape(-1)


def b_rope(be, node, store=None):
    """ggml-cuda's rope: theta = pos * theta_scale^i (float32 power), / freq factor, YaRN ramp; NORM rotates
    adjacent pairs, NEOX the halves; dims past n_dims are copied. ``store``: the SET_ROWS that alone reads the
    result (``_rope_stores``): the rows go into the cache in the same launch, and that node computes nothing."""
    p = node.op_params
    if p.get("sections"):
        return _bind_rope_vision(be, node)
    x, pos, d = view(node.src[0]), view(node.src[1]), view(node)
    n_dims = p["n_dims"]
    half = n_dims // 2
    theta_scale = np.float32(p["freq_base"]) ** np.float32(-2.0 / n_dims)
    powers = torch.tensor(np.float32(theta_scale) ** np.arange(half, dtype=np.float32), dtype=F32, device=be.dev)
    ff = view(node.src[2]).reshape(-1)[:half] if p.get("has_freq_factors") else None
    freq_scale = float(np.float32(p["freq_scale"]))
    ext = float(np.float32(p["ext_factor"]))
    mscale = float(np.float32(p["attn_factor"]))
    mix = None
    if ext != 0.0:
        def corr(beta):
            return n_dims * math.log(p["n_ctx_orig"] / (beta * 2 * math.pi)) / (2 * math.log(p["freq_base"]))
        lo = max(0.0, math.floor(corr(p["beta_fast"])))
        hi = min(n_dims - 1.0, math.ceil(corr(p["beta_slow"])))
        y = (np.arange(half) - lo) / max(0.001, hi - lo)
        mix = torch.tensor(((1 - np.clip(y, 0, 1)) * ext).astype(np.float32), device=be.dev)
        mscale = float(np.float32(mscale * (1.0 + 0.1 * math.log(1.0 / freq_scale))))
    neox = p["mode"] == 2
    ne0 = node.src[0].ne[0]
    if x.dtype == F32 and d.dtype == F32 and x.shape[0] == 1 and x.stride(-1) == 1 and d.stride(-1) == 1:
        n_tok, n_head = x.shape[1], x.shape[2]
        half_p2 = triton.next_power_of_2(max(half, 1))
        tail = triton.next_power_of_2(ne0 - n_dims) if ne0 > n_dims else 0
        posv = pos.reshape(-1)
        ffv = ff if ff is not None else powers
        mixv = mix if mix is not None else powers

        fused = _rope_store_views(be, node, store) if store is not None else None
        if fused is not None:
            cache, rows = fused

            def run_store():
                K.rope[(n_tok, n_head)](x, posv, powers, ffv, mixv, cache, n_head, x.stride(1), x.stride(2),
                                        cache.stride(1), cache.stride(0), ne0, freq_scale, mscale, N_DIMS=n_dims,
                                        NEOX=neox, HAS_FF=ff is not None, HAS_MIX=mix is not None, HALF=half_p2,
                                        TAIL=tail, rows=rows, STORE=True)
            return run_store

        def run_fast():
            K.rope[(n_tok, n_head)](x, posv, powers, ffv, mixv, d, n_head, x.stride(1), x.stride(2), d.stride(1),
                                    d.stride(2), ne0, freq_scale, mscale, N_DIMS=n_dims, NEOX=neox,
                                    HAS_FF=ff is not None, HAS_MIX=mix is not None, HALF=half_p2, TAIL=tail)
        return _with_store(run_fast, be, store)

    def run():
        th = pos.reshape(-1).to(F32)[:, None] * powers[None, :]                  # [n_tokens, half]
        if ff is not None:
            th = th / _f(ff)[None, :]
        theta = th * freq_scale
        if mix is not None:
            theta = theta * (1 - mix) + th * mix
        c = (torch.cos(theta) * mscale)[None, :, None, :]
        s = (torch.sin(theta) * mscale)[None, :, None, :]
        xf = _f(x)
        if neox:
            x0, x1 = xf[..., :half], xf[..., half:n_dims]
            r = torch.cat([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1)
        else:
            x0, x1 = xf[..., 0:n_dims:2], xf[..., 1:n_dims:2]
            r = torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1).flatten(-2)
        if n_dims < ne0:
            r = torch.cat([r, xf[..., n_dims:]], dim=-1)
        d.copy_(r)
    return _with_store(run, be, store)


def _with_store(run, be, store):
    """A rope call followed by its store's own call, where the two could not become one launch."""
    if store is None:
        return run
    put = b_set_rows(be, store)

    def both():
        run()
        put()
    return both


def b_mul_mat(be, node):
    a, b = node.src
    d = view(node)
    bv = view(b)
    n_act = b.ne[1] * b.ne[2] * b.ne[3]
    if a.type in BLOCK_TYPES:
        if a.ne[2] != 1 or a.ne[3] != 1:
            raise NotImplementedError(f"mul_mat of a {a.type.name} tensor with ne2/ne3 > 1 on cuda")
        w = rows(a)
        kdim, n_out = a.ne[0], a.ne[1]
        x2 = bv.reshape(-1, kdim) if bv.is_contiguous() else None
        d2 = d.reshape(-1, n_out) if d.is_contiguous() else None
        use_mv = n_act <= MATVEC_MAX_COLS
        big = torch.float16 if be.dev.type == "cuda" else F32
        mv_plan = be._matvec_plan(a, n_act) if use_mv else None
        q8 = use_mv and n_act == 1 and a.type in MMVQ.KERNELS
        xq, quant = be._q8_scratch(a.type, b, kdim) if q8 else (None, False)
        part = torch.empty((mv_plan[3], n_act, n_out), dtype=F32, device=be.dev) if use_mv and mv_plan[3] > 1 \
            else None

        def run():
            x = x2 if x2 is not None else bv.reshape(-1, kdim)
            x = x if x.dtype == F32 and x.is_contiguous() else _f(x).contiguous()
            if use_mv:
                out = d2 if d2 is not None else torch.empty((n_act, n_out), dtype=F32, device=be.dev)
                if q8 and a.type in MMVQ.KERNELS:
                    be._mmvq(a, w, x, xq, out, quant)
                else:
                    be._matvec(a, w, x, out, mv_plan, part)
            else:
                wd = be._dequant(a, w, big)
                out = torch.matmul(be._round_act(a.type, x).to(big), wd.t())
            if out is not d2:
                d.copy_(out.reshape(d.shape))
        return run
    # plain weights: cuBLAS, a broadcast over b's dims 2 and 3
    av = view(a)
    r2, r3 = b.ne[2] // a.ne[2], b.ne[3] // a.ne[3]
    if a.type in (T.F16, T.BF16) and n_act == 1 and a.ne[2] == 1 and a.ne[3] == 1 and av.stride(-1) == 1 \
            and bv.is_contiguous():
        # one activation row (decode): a Triton kernel, float32 sums of the weights times x rounded to their
        # type (torch's half matmul of one row rounds the result to F16 and reaches ~half the bandwidth)
        kdim, n_out = a.ne[0], a.ne[1]
        bn, bk, warps = K.HALF_SHAPE if be.dev.type == "cuda" else (64, 256, 4)
        x1 = bv.reshape(1, kdim)
        d2 = d.reshape(1, n_out) if d.is_contiguous() and d.dtype == F32 else None

        def run_mv():
            x = x1 if x1.dtype == F32 else x1.to(F32)
            out = d2 if d2 is not None else torch.empty((1, n_out), dtype=F32, device=be.dev)
            K.matvec_half[(triton_cdiv(n_out, bn),)](av, x, out, n_out, kdim, av.stride(-2), kdim, n_out, NC=1,
                                                     BN=bn, BK=bk, num_warps=warps)
            if out is not d2:
                d.copy_(out.reshape(d.shape))
        return run_mv
    low = a.type in (T.F16, T.BF16) and be.dev.type == "cuda"
    dt = TORCH_DTYPE[a.type] if low else F32

    def run():
        aa = av if av.dtype == dt else av.to(dt)
        if r2 > 1 or r3 > 1:
            aa = aa.repeat_interleave(r3, dim=0).repeat_interleave(r2, dim=1)
        d.copy_(torch.matmul(bv.to(dt), aa.transpose(-1, -2)))
    return run


def b_mul_mat_glu(be, node):
    """act(gate · x) * (up · x): the fused node as two products (the CPU fuses it; here it is bound as such)."""
    gate, up, b = node.src
    d = view(node)
    act = F.silu if node.op_params["glu"] == "swiglu" else _gelu
    g_node = Tensor(T.F32, node.ne, op=Op.MUL_MAT, src=[gate, b])
    u_node = Tensor(T.F32, node.ne, op=Op.MUL_MAT, src=[up, b])
    ys = []
    for m in (g_node, u_node):
        buf = be.alloc_buffer(m.nbytes)
        from ...backend import tensor_alloc
        tensor_alloc(buf, m, 0)
        ys.append((b_mul_mat(be, m), view(m)))
    (rg, yg), (ru, yu) = ys

    def run():
        rg()
        ru()
        d.copy_(act(yg) * yu)
    return run


def b_mul_mat_id(be, node):
    as_, b, ids = node.src
    d = view(node)                          # (1, n_tokens, n_used, N)
    bv = view(b)                            # (1, n_tokens, b.ne1, K)
    iv = view(ids)                          # (1, 1, n_tokens, n_used)
    n_exp = as_.ne[2]
    block = as_.type in BLOCK_TYPES
    w = rows(as_) if block else view(as_)   # (1, n_exp, N, K')
    big = torch.float16 if be.dev.type == "cuda" else F32

    def run():
        sel = iv[0, 0].to(torch.int64)
        n_tok, n_used = sel.shape
        xs = _f(bv[0])                                            # (n_tokens, b.ne1, K)
        cols = torch.arange(n_used, device=be.dev) % xs.shape[1]
        flat = sel.reshape(-1)
        host = flat.cpu().numpy()
        for e in np.unique(host):
            if not 0 <= e < n_exp:
                raise IndexError(f"mul_mat_id: expert {e} out of range 0..{n_exp - 1}")
            where = torch.nonzero(flat == int(e)).reshape(-1)
            t_i, u_i = where // n_used, where % n_used
            x = xs[t_i, cols[u_i]].contiguous()
            if block and x.shape[0] <= MATVEC_MAX_COLS:       # the decode kernel, as for dense weights
                ev = _ExpertView(as_, int(e))
                y = torch.empty((x.shape[0], as_.ne[1]), dtype=F32, device=be.dev)
                plan = be._matvec_plan(ev, x.shape[0])
                part = torch.empty((plan[3],) + tuple(y.shape), dtype=F32, device=be.dev) if plan[3] > 1 else None
                be._matvec(ev, w[0, int(e)], x, y, plan, part)
            elif block:
                x = be._round_act(as_.type, x)
                we = be._dequant(_ExpertView(as_, int(e)), w[0, int(e)][None, None], big)
                y = torch.matmul(x.to(big), we.t()).float()
            else:
                y = torch.matmul(x, _f(w[0, int(e)]).t())
            d[0, t_i, u_i] = y.to(d.dtype)
    return run


class _ExpertView:
    """The facts ``_dequant`` reads of one expert's matrix."""

    def __init__(self, a: Tensor, e: int):
        self.type = a.type
        self.ne = (a.ne[0], a.ne[1], 1, 1)
        self.nb = a.nb


def b_get_rows(be, node):
    a, idx = node.src
    d = view(node)
    iv = view(idx)
    if a.type in BLOCK_TYPES:
        # ggml_get_rows: index row (i11, i12) picks rows of a's matrix (i02 = i11, i03 = i12)
        w = rows(a)
        n, n2, n3 = idx.ne[0], idx.ne[1], idx.ne[2]
        ii = iv.reshape(n3, n2, n)
        d3 = d.reshape(n3, n2, n, a.ne[0])

        def run():
            for i3 in range(n3):
                for i2 in range(n2):
                    d3[i3, i2].copy_(be._dequant(a, w[i3, i2], F32, ii[i3, i2].to(torch.int32).contiguous()))
        return run
    av = view(a)

    def run():
        ii = iv[0].to(torch.int64)                                  # (ne2', ne1', n)
        i3 = torch.arange(ii.shape[0], device=be.dev)[:, None, None]
        i2 = torch.arange(ii.shape[1], device=be.dev)[None, :, None]
        d.copy_(av[i3 % av.shape[0], i2 % av.shape[1], ii])
    return run


def b_set_rows(be, node):
    src, idx = node.src[0], node.src[1]
    if node.type in KV_QUANT:           # the quantizing store into a block-format KV cache
        s, iv = view(src)[0], view(idx).reshape(-1)
        db = rows(node)[0]                                             # (planes, rows, row bytes)
        n, s2, ne0, bb = src.ne[1], src.ne[2], src.ne[0], 8
        return lambda: K.quantize_rows[(n, s2, triton_cdiv(ne0 // 32, bb))](
            s, iv, db, n, ne0, s.stride(1), s.stride(0), 1, 1, db.stride(1), db.stride(0), 0, USE_IDX=True,
            TYPE=int(node.type), BYTES=K.KV_BLOCK_BYTES[node.type], BB=bb)
    d, s, iv = view(node), view(src), view(idx)
    s3, s2 = src.ne[3], src.ne[2]
    if (s3 == 1 and node.ne[3] == 1 and node.ne[2] == s2 and src.type == T.F32 and d.stride(-1) == 1
            and s.stride(-1) == 1 and idx.ne[1] == idx.ne[2] == idx.ne[3] == 1 and iv.stride(-1) == 1):
        n, ne0 = src.ne[1], src.ne[0]       # the KV cache's store: one kernel for every row of every head
        d3, s3d, i1 = d[0], s[0], iv.reshape(-1)
        blk = min(1024, triton.next_power_of_2(ne0))
        return lambda: K.set_rows[(n, s2, triton_cdiv(ne0, blk))](s3d, i1, d3, ne0, s3d.stride(1), d3.stride(1),
                                                                   s3d.stride(0), d3.stride(0), BLOCK=blk)
    def run():
        ii = iv.to(torch.int64)
        for i3 in range(s3):
            for i2 in range(s2):
                d[i3, i2].index_copy_(0, ii[0, i3 % ii.shape[1], i2 % ii.shape[2]], s[i3, i2].to(d.dtype))
    return run


def b_cpy(be, node):
    src = node.src[0]
    if node.type in KV_QUANT:           # values in the source's row-major order, quantized into dst's rows
        s = view(src)
        ne0, nr = node.ne[0], node.ne[1] * node.ne[2] * node.ne[3]
        db = rows(node)
        bb = 8

        def run_quant():
            x = s.contiguous().reshape(nr, ne0) if s.dtype == F32 else s.to(F32).reshape(nr, ne0)
            K.quantize_rows[(nr, 1, triton_cdiv(ne0 // 32, bb))](
                x, be._dummy, db, nr, ne0, ne0, 0, node.ne[1], node.ne[2], node.nb[1], node.nb[2], node.nb[3],
                USE_IDX=False, TYPE=int(node.type), BYTES=K.KV_BLOCK_BYTES[node.type], BB=bb)
        return run_quant
    if src.type in KV_QUANT:            # same shape: each row decoded into dst's (dense) rows
        d = view(node)
        return lambda: _decode_rows(be, src, d)
    s, d = view(src), view(node)
    shape = tuple(d.shape)
    return lambda: d.copy_(s.reshape(shape))


def _decode_rows(be, t: Tensor, out: torch.Tensor) -> None:
    """The rows of t (a block format; any strides, e.g. a permuted view of the KV cache) decoded into out's dense
    rows (F16 or F32, t's shape)."""
    nr, kdim = t.ne[1] * t.ne[2] * t.ne[3], t.ne[0]
    br = 16 if be.dev.type == "cuda" else 256          # the interpreter runs programs one by one
    K.dequant_rows3[(triton_cdiv(nr, br), triton_cdiv(kdim, 256))](
        rows(t), out, be._lut, nr, kdim, t.ne[1], t.ne[2], t.nb[1], t.nb[2], t.nb[3], kdim, TYPE=int(t.type),
        OUT_F16=out.dtype == torch.float16, BR=br, BK=256)


def b_concat(be, node):
    a, b, d = view(node.src[0]), view(node.src[1]), view(node)
    dim = 3 - node.op_params["dim"]
    return lambda: d.copy_(torch.cat([a, b], dim=dim))


def b_repeat(be, node):
    a, d = view(node.src[0]), view(node)
    shape = tuple(d.shape)
    return lambda: d.copy_(_bcast(a, shape).expand(shape))


def b_im2col(be, node):
    """dst (N, OH, OW, IC*KH*KW) = the input's patches, channel-major (c, kh, kw) as ggml's im2col (torch's unfold
    order), 0 outside the input; stored in dst's type (F16: the pixels rounded to F16, as ggml-cuda's)."""
    p = node.op_params
    x, d = view(node.src[1]), view(node)                             # x (N, IC, IH, IW)
    kw, kh = node.src[0].ne[0], node.src[0].ne[1]

    def run():
        cols = F.unfold(_f(x), (kh, kw), dilation=(p["d1"], p["d0"]), padding=(p["p1"], p["p0"]),
                        stride=(p["s1"], p["s0"]))                   # (N, IC*KH*KW, OH*OW)
        d.copy_(cols.transpose(1, 2).reshape(d.shape))
    return run


def b_pool_2d(be, node):
    """ggml's pool_2d: the max, or the sum / (k0 * k1), of the input values under each window; padding is left
    out of the sum but counted in the divisor (zeros for AVG), an empty window's max is -FLT_MAX."""
    p = node.op_params
    x, d = view(node.src[0]), view(node)                             # (N, C, IH, IW) -> (N, C, OH, OW)
    k, s = (p["k1"], p["k0"]), (p["s1"], p["s0"])
    pad = (p["p0"], p["p0"], p["p1"], p["p1"])
    avg = p["op"] == 1

    def run():
        xx = _f(x)
        if any(pad):
            xx = F.pad(xx, pad, value=0.0 if avg else -math.inf)
        if avg:
            y = F.avg_pool2d(xx, k, s)
        else:
            y = torch.clamp(F.max_pool2d(xx, k, s), min=-float(np.finfo(np.float32).max))
        d.copy_(y[..., :d.shape[2], :d.shape[3]])
    return run


def b_sum_rows(be, node):
    a, d = view(node.src[0]), view(node)
    return lambda: d.copy_(_f(a).sum(-1, keepdim=True))


def b_mean(be, node):
    a, d = view(node.src[0]), view(node)
    return lambda: d.copy_(_f(a).mean(-1, keepdim=True))


def b_argmax(be, node):
    """ggml's rule: of equal largest values the last wins (torch's argmax takes the first: search the row reversed)."""
    a, d = view(node.src[0]), view(node)
    n = node.src[0].ne[0]
    return lambda: d.copy_((n - 1 - torch.argmax(torch.flip(_f(a)[0, 0], dims=[-1]), dim=-1)).reshape(d.shape))


def b_argsort(be, node):
    a, d = view(node.src[0]), view(node)
    desc = node.op_params["order"] == 1
    return lambda: d.copy_(torch.argsort(_f(a), dim=-1, descending=desc, stable=True))


def b_top_k(be, node):
    a, d = view(node.src[0]), view(node)
    k = node.op_params["k"]
    return lambda: d.copy_(torch.argsort(_f(a), dim=-1, descending=True, stable=True)[..., :k])


def b_flash_attn(be, node):
    """softmax(scale * q k^T (softcapped) + slope * mask) v per head, GQA folded into the query rows of each KV
    head. torch's SDPA in F16 on the GPU (ggml-cuda rounds Q, K and V to F16 too), float32 on the CPU device."""
    q, k, v = node.src[:3]
    p = node.op_params
    quant = k.type in KV_QUANT or v.type in KV_QUANT                 # a cache in block formats: read by the value rules
    qv, d = view(q), view(node)                                      # q (ne3, H, n_q, D); d (ne3, n_q, H, Dv)
    if quant:   # the cache's rows as bytes for decode; dense F16 copies, made by each run, for the other paths
        kb, vb = rows(k), rows(v)                                    # (ne3, Hkv, n_kv, row bytes)
        kv = torch.empty((1, 1, 1, 1), dtype=torch.float16, device=be.dev).expand(tuple(k.ne[::-1]))   # shapes only
        vv = torch.empty((1, 1, 1, 1), dtype=torch.float16, device=be.dev).expand(tuple(v.ne[::-1]))
    else:
        kv, vv = view(k), view(v)
    mv = view(node.src[3]) if p["has_mask"] else None               # (m3, m2, n_q_pad, n_kv)
    ne3, H, n_q, _ = qv.shape
    Hkv = kv.shape[1]
    rk = H // Hkv
    scale = _param(node, "scale")
    cap = _param(node, "softcap")
    slopes = _alibi(H, _param(node, "max_bias"), be.dev)
    # SDPA's type on the GPU: F16, or BF16 over a BF16 cache (whose values may lie outside F16's range)
    dt = (torch.bfloat16 if k.type == v.type == T.BF16 else torch.float16) if be.dev.type == "cuda" else F32
    sinks = view(node.src[-1]) if p.get("has_sinks") else None       # (H,): a logit per head with no value
    manual = cap != 0.0 or slopes is not None or (mv is not None and mv.shape[1] > 1) or sinks is not None

    def expand_kv(t):
        t = t if t.shape[0] == ne3 else t[torch.arange(ne3, device=be.dev) % t.shape[0]]
        return t

    dk, dvh = qv.shape[-1], vv.shape[-1]
    decode_ok = slopes is None and (mv is None or mv.shape[1] == 1)          # soft-capping and sinks it handles
    if (decode_ok and ne3 == 1 and n_q == 1 and kv.shape[0] == 1 and vv.shape[0] == 1 and qv.stride(-1) == 1
            and (quant or (kv.stride(-1) == 1 and vv.stride(-1) == 1)) and d.stride(-1) == 1 and max(dk, dvh) <= 256
            and (mv is None or mv.stride(-1) == 1)):
        q1, k1, v1, d1 = qv[0, :, 0], kv[0], vv[0], d[0, 0]         # (H, D), (Hkv, n_kv, D), (H, Dv)
        if quant:
            k1, v1 = kb[0], vb[0]                                    # strides in bytes: the kernel's byte pointers
        extra = dict(QUANT=True, KT=int(k.type), VT=int(v.type)) if quant else {}
        extra.update(HAS_CAP=cap != 0.0, HAS_SINK=sinks is not None)
        sk = sinks if sinks is not None else be._dummy
        m1 = mv[0, 0, 0] if mv is not None else be._dummy
        n_kv = kv.shape[2]
        bd, bdv = triton.next_power_of_2(dk), triton.next_power_of_2(dvh)

        # flash-decoding: split the keys so that heads x splits fill the device twice over, in runs of whole
        # 64-key tiles; the splits' partial rows meet in attn_combine
        n_split = max(1, min(triton.cdiv(n_kv, 64), triton.cdiv(2 * be.n_sm, H)))
        chunk = triton.cdiv(triton.cdiv(n_kv, n_split), 64) * 64
        n_split = triton.cdiv(n_kv, chunk)
        if n_split == 1:
            def run_decode():
                K.attn_decode[(H, 1)](q1, k1, v1, m1, d1, be._dummy, n_kv, chunk, rk, q1.stride(0), k1.stride(1),
                                      k1.stride(0), v1.stride(1), v1.stride(0), d1.stride(0), 0, scale, be._lut,
                                      cap, sk, HAS_MASK=mv is not None, SPLIT=False, D=dk, DV=dvh, BD=bd, BDV=bdv,
                                      BN=64, **extra)
            return run_decode
        part = torch.empty((H, n_split, dvh), dtype=F32, device=be.dev)
        pml = torch.empty((H, n_split, 2), dtype=F32, device=be.dev)

        def run_split():
            K.attn_decode[(H, n_split)](q1, k1, v1, m1, part, pml, n_kv, chunk, rk, q1.stride(0), k1.stride(1),
                                        k1.stride(0), v1.stride(1), v1.stride(0), part.stride(0), part.stride(1),
                                        scale, be._lut, cap, sk, HAS_MASK=mv is not None, SPLIT=True, D=dk,
                                        DV=dvh, BD=bd, BDV=bdv, BN=64, **extra)
            K.attn_combine[(H,)](part, pml, d1, n_split, part.stride(0), part.stride(1), d1.stride(0), DV=dvh,
                                 BDV=bdv, BS=triton.next_power_of_2(n_split))
        return run_split

    run = _flash_attn_dense(be, d, mv, sinks, ne3, H, n_q, Hkv, rk, scale, cap, slopes, dt, manual, expand_kv)
    if not quant:
        return lambda: run(qv, kv, vv)
    dense_k, dense_v = _dense_kv(be, k), _dense_kv(be, v)
    if k.type == T.F16:
        return lambda: run(qv, dense_k(), dense_v())
    # K in a block format: q rounded to its dot type (Q8_0 blocks of 32), as ggml-cpu does and the decode kernel;
    # the products then in float32 (F16 would round the rounded q again)
    run32 = _flash_attn_dense(be, d, mv, sinks, ne3, H, n_q, Hkv, rk, scale, cap, slopes, F32, manual, expand_kv)
    def q_rounded():                    # the activation rounding of the products (round_act), q's rows
        x = qv.float().contiguous()
        return be._round_act(k.type, x.view(-1, x.shape[-1])).view(x.shape)
    return lambda: run32(q_rounded(), dense_k().float(), dense_v())


def _dense_kv(be, t: Tensor):
    """A closure returning a view of the KV cache (any type) as a new dense F16 tensor (ne3, ne2, ne1, ne0)."""
    if t.type not in KV_QUANT:
        src = view(t)
        return lambda: src.to(torch.float16)
    shape = tuple(t.ne[::-1])

    def dense():
        out = torch.empty(shape, dtype=torch.float16, device=be.dev)
        _decode_rows(be, t, out)
        return out
    return dense


def _q_as_k(qv, kv):
    """q rounded to an F16 or BF16 K's type (ggml's dot type for it: to nearest even), else as it is."""
    return qv.to(kv.dtype) if kv.dtype in (torch.float16, torch.bfloat16) else qv


def _flash_attn_dense(be, d, mv, sinks, ne3, H, n_q, Hkv, rk, scale, cap, slopes, dt, manual, expand_kv):
    """b_flash_attn's paths over dense K and V (the cache's views, or dense copies of a block-format cache): a
    function of (Q, K, V)."""
    if manual:
        def run(qv, kv, vv):
            qq = _f(_q_as_k(qv, kv))
            kk = _f(expand_kv(kv)).repeat_interleave(rk, dim=1)
            vvv = _f(expand_kv(vv)).repeat_interleave(rk, dim=1)
            s = torch.matmul(qq, kk.transpose(-1, -2)) * scale
            if cap:
                s = cap * torch.tanh(s / cap)
            if mv is not None:
                m = _f(mv[:, :, :n_q, :])
                m = m[torch.arange(ne3, device=be.dev) % m.shape[0]][:, torch.arange(H, device=be.dev) % m.shape[1]]
                s = s + (m * slopes if slopes is not None else m)
            if sinks is not None:       # the sink joins each row's softmax, then is dropped (ggml's add_sinks)
                col = _f(sinks).reshape(1, -1, 1, 1).expand(s.shape[0], s.shape[1], s.shape[2], 1)
                pr = torch.nan_to_num(torch.softmax(torch.cat([s, col], dim=-1), dim=-1), nan=0.0)[..., :-1]
            else:
                pr = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)
            d.copy_(torch.matmul(pr, vvv).transpose(1, 2))
        return run

    def run(qv, kv, vv):
        qq = _q_as_k(qv, kv).to(dt).reshape(
            ne3, Hkv, rk * n_q, qv.shape[-1])
        kk, vvv = expand_kv(kv).to(dt), expand_kv(vv).to(dt)
        m = None
        if mv is not None:
            m = mv[:, :, :n_q, :].to(dt)
            m = m if m.shape[0] == ne3 or m.shape[0] == 1 else m[torch.arange(ne3, device=be.dev) % m.shape[0]]
            if rk > 1:
                m = m.repeat(1, 1, rk, 1)
        o = F.scaled_dot_product_attention(qq, kk, vvv, attn_mask=m, scale=scale)
        d.copy_(o.reshape(ne3, H, n_q, -1).transpose(1, 2))
    return run


_TABLE = {
    Op.MUL_MAT: b_mul_mat, Op.MUL_MAT_GLU: b_mul_mat_glu, Op.MUL_MAT_ID: b_mul_mat_id, Op.GET_ROWS: b_get_rows, Op.SET_ROWS: b_set_rows,
    Op.ROPE: b_rope, Op.FLASH_ATTN_EXT: b_flash_attn, Op.SOFT_MAX: b_soft_max,
    Op.RMS_NORM: b_rms_norm, Op.RMS_NORM_MUL: b_rms_norm_mul, Op.NORM: b_norm, Op.L2_NORM: b_l2_norm,
    Op.SCALE: b_scale, Op.CLAMP: b_clamp, Op.SOFTCAP: b_softcap, Op.SWIGLU: b_glu, Op.GEGLU: b_glu,
    Op.CPY: b_cpy, Op.CONT: b_cpy, Op.DUP: b_cpy, Op.CONCAT: b_concat, Op.REPEAT: b_repeat,
    Op.IM2COL: b_im2col, Op.POOL_2D: b_pool_2d,
    Op.SUM_ROWS: b_sum_rows, Op.MEAN: b_mean, Op.ARGMAX: b_argmax, Op.ARGSORT: b_argsort, Op.TOP_K: b_top_k,
    **{o: b_binary for o in BINARY_OPS}, **{o: b_unary for o in UNARY_OPS},
}


register_backend("cuda", CUDABackend)
