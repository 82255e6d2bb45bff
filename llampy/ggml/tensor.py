"""The tensor record, as ggml's struct ggml_tensor: a type, a shape, byte strides, an op and its sources.

A tensor computes nothing. It is either a *leaf* (op NONE: a weight, an input, a constant) or a *node* (an op over
sources, executed later by a backend). Views (VIEW, RESHAPE, PERMUTE, TRANSPOSE) share the memory of ``view_src``
at ``view_offs`` bytes; ``view_src`` always points at the tensor that owns the memory, never at another view.

Storage: ``buffer`` (a backend Buffer) and ``offs`` (byte offset in it) are set by whoever places the tensor —
the model loader for weights, the graph allocator for intermediates. A view's storage is its ``view_src``'s.
"""
from __future__ import annotations

import itertools
from enum import Enum, IntFlag

import numpy as np

from .types import GGMLType, TYPE_TRAITS, row_size

GGML_MAX_DIMS = 4
GGML_MAX_SRC = 10


class Op(Enum):
    NONE = "none"
    DUP = "dup"
    ADD = "add"
    SUB = "sub"
    MUL = "mul"
    DIV = "div"
    SQR = "sqr"
    SQRT = "sqrt"
    SUM_ROWS = "sum_rows"
    MEAN = "mean"
    ARGMAX = "argmax"
    REPEAT = "repeat"
    CONCAT = "concat"
    NORM = "norm"
    RMS_NORM = "rms_norm"
    L2_NORM = "l2_norm"
    MUL_MAT = "mul_mat"
    MUL_MAT_ID = "mul_mat_id"
    SCALE = "scale"
    SET_ROWS = "set_rows"
    CPY = "cpy"
    CONT = "cont"
    RESHAPE = "reshape"
    VIEW = "view"
    PERMUTE = "permute"
    TRANSPOSE = "transpose"
    GET_ROWS = "get_rows"
    SOFT_MAX = "soft_max"
    ROPE = "rope"
    CLAMP = "clamp"
    ARGSORT = "argsort"
    TOP_K = "top_k"
    FLASH_ATTN_EXT = "flash_attn_ext"
    SSM_CONV = "ssm_conv"
    SSM_SCAN = "ssm_scan"
    IM2COL = "im2col"
    POOL_2D = "pool_2d"
    RWKV_WKV6 = "rwkv_wkv6"
    RWKV_WKV7 = "rwkv_wkv7"
    GATED_DELTA_NET = "gated_delta_net"
    GATED_LINEAR_ATTN = "gated_linear_attn"
    # unary (ggml keeps these under GGML_OP_UNARY; flat here)
    EXP = "exp"
    TANH = "tanh"
    SILU = "silu"
    GELU = "gelu"
    GELU_ERF = "gelu_erf"
    RELU = "relu"
    SIGMOID = "sigmoid"
    SOFTPLUS = "softplus"
    NEG = "neg"
    GELU_QUICK = "gelu_quick"
    # gated linear units (GGML_OP_GLU): out = act(gate) * up
    SWIGLU = "swiglu"
    GEGLU = "geglu"
    SWIGLU_OAI = "swiglu_oai"     # gpt-oss: min(x, limit) * sigmoid(alpha x) * (clamp(up, -limit, limit) + 1)
    # produced by the fusion pass only
    RMS_NORM_MUL = "rms_norm_mul"
    SOFTCAP = "softcap"
    MUL_MAT_GLU = "mul_mat_glu"
    SSM_CONV_STATE = "ssm_conv_state"
    SSM_GATE = "ssm_gate"


VIEW_OPS = frozenset({Op.VIEW, Op.RESHAPE, Op.PERMUTE, Op.TRANSPOSE})
UNARY_OPS = frozenset({Op.SQR, Op.SQRT, Op.EXP, Op.TANH, Op.SILU, Op.GELU, Op.GELU_ERF, Op.RELU, Op.SIGMOID,
                       Op.SOFTPLUS, Op.GELU_QUICK, Op.NEG})
BINARY_OPS = frozenset({Op.ADD, Op.SUB, Op.MUL, Op.DIV})


class Flags(IntFlag):
    NONE = 0
    INPUT = 1    # set from outside before each compute; lives for the whole graph
    OUTPUT = 2   # read after compute; never overwritten by the allocator
    WEIGHT = 4   # a model parameter; already has storage


_ids = itertools.count()


class Tensor:
    __slots__ = ("type", "ne", "nb", "op", "op_params", "src", "view_src", "view_offs", "name", "flags",
                 "buffer", "offs", "id", "__weakref__")

    def __init__(self, type: GGMLType, ne, nb=None, op: Op = Op.NONE, src=(), op_params=None,
                 view_src: "Tensor | None" = None, view_offs: int = 0, name: str = ""):
        ne = tuple(int(n) for n in ne)
        if not 1 <= len(ne) <= GGML_MAX_DIMS:
            raise ValueError(f"a tensor has 1 to 4 dims, got {ne}")
        ne = ne + (1,) * (GGML_MAX_DIMS - len(ne))
        if any(n < 0 for n in ne):
            raise ValueError(f"negative dimension in {ne}")
        self.type = GGMLType(type)
        self.ne = ne
        self.nb = tuple(nb) if nb is not None else contiguous_strides(self.type, ne)
        self.op = op
        self.src = list(src)
        self.op_params = op_params if op_params is not None else {}
        if view_src is not None and view_src.view_src is not None:  # always point at the memory's owner
            view_offs += view_src.view_offs
            view_src = view_src.view_src
        self.view_src = view_src
        self.view_offs = view_offs
        self.name = name
        self.flags = Flags.NONE
        self.buffer = None
        self.offs = 0
        self.id = next(_ids)

    # --- shape helpers (ggml_nelements, ggml_nrows, ggml_nbytes, ggml_is_contiguous ...) ---
    @property
    def n_dims(self) -> int:
        for i in range(GGML_MAX_DIMS - 1, 0, -1):
            if self.ne[i] > 1:
                return i + 1
        return 1

    @property
    def nelements(self) -> int:
        return self.ne[0] * self.ne[1] * self.ne[2] * self.ne[3]

    @property
    def nrows(self) -> int:
        return self.ne[1] * self.ne[2] * self.ne[3]

    @property
    def nbytes(self) -> int:
        """Bytes from the first to one past the last element (ggml_nbytes), for any strides."""
        if any(n == 0 for n in self.ne):
            return 0
        tt = TYPE_TRAITS[self.type]
        if tt.blck_size == 1:
            return tt.type_size + sum((self.ne[i] - 1) * self.nb[i] for i in range(GGML_MAX_DIMS))
        n = row_size(self.type, self.ne[0])
        return n + sum((self.ne[i] - 1) * self.nb[i] for i in range(1, GGML_MAX_DIMS))

    def is_contiguous(self) -> bool:
        return self.nb == contiguous_strides(self.type, self.ne) or self.nelements <= 1 and self.nb[0] == TYPE_TRAITS[self.type].type_size

    def is_view(self) -> bool:
        return self.view_src is not None

    def is_leaf(self) -> bool:
        return self.op is Op.NONE

    def set_name(self, name: str) -> "Tensor":
        self.name = name
        return self

    def set_input(self) -> "Tensor":
        self.flags |= Flags.INPUT
        return self

    def set_output(self) -> "Tensor":
        self.flags |= Flags.OUTPUT
        return self

    @property
    def storage(self) -> "Tensor":
        """The tensor that owns this tensor's memory."""
        return self.view_src if self.view_src is not None else self

    @property
    def data_offs(self) -> int:
        """Byte offset of element 0 in the owner's buffer."""
        return self.storage.offs + self.view_offs

    def shape_str(self) -> str:
        return "[" + ", ".join(str(n) for n in self.ne[:max(self.n_dims, 1)]) + "]"

    def __repr__(self):
        return f"Tensor({self.name or '#%d' % self.id}, {self.type.name}, {self.shape_str()}, op={self.op.value})"


def contiguous_strides(t: GGMLType, ne) -> tuple:
    tt = TYPE_TRAITS[t]
    nb0 = tt.type_size
    nb1 = row_size(t, ne[0]) if tt.blck_size > 1 else nb0 * ne[0]
    nb2 = nb1 * ne[1]
    nb3 = nb2 * ne[2]
    return (nb0, nb1, nb2, nb3)


def new_tensor(type: GGMLType, *ne, name: str = "") -> Tensor:
    """A leaf with no storage yet (an input, or a weight the loader will place)."""
    return Tensor(type, ne, name=name)


def numpy_dtype(t: GGMLType) -> np.dtype:
    tt = TYPE_TRAITS[t]
    return tt.dtype if tt.dtype is not None else np.dtype(np.uint8)


def as_ndarray(t: Tensor, data: np.ndarray, offs: int | None = None) -> np.ndarray:
    """A NumPy view of ``t`` over the raw bytes ``data`` (the uint8 array of the buffer that owns t's memory, or, with
    ``offs``, bytes that hold t's element 0 at byte ``offs``: a copy of t's byte range read from a device).

    Plain types give an array of shape ``reversed(ne)`` with t's strides. Block types give uint8 rows:
    shape (ne3, ne2, ne1, row_bytes) with strides (nb3, nb2, nb1, 1).
    """
    tt = TYPE_TRAITS[t.type]
    if offs is None:
        offs = t.data_offs
    if tt.blck_size == 1:
        shape = t.ne[::-1]
        strides = t.nb[::-1]
        dtype = tt.dtype
    else:
        shape = (t.ne[3], t.ne[2], t.ne[1], row_size(t.type, t.ne[0]))
        strides = (t.nb[3], t.nb[2], t.nb[1], 1)
        dtype = np.dtype(np.uint8)
    if t.nelements == 0:
        return np.empty(shape, dtype)
    if offs < 0 or offs + t.nbytes > data.nbytes:
        raise ValueError(f"{t!r} at offset {offs} (+{t.nbytes} bytes) lies outside its buffer ({data.nbytes} bytes)")
    return np.ndarray(shape, dtype, buffer=data, offset=offs, strides=strides)
