"""Matrices split by rows across devices (llama.cpp's split_mode 'row'; ggml-cuda's split buffer type).

A weight placed in a ``SplitBufferType`` lives as row slices, one per device in ``tensor_split``'s proportions, each a
weight tensor of its own in that device's memory (``SplitBuffer.parts_of``). The buffer moves bytes in and out of the
whole matrix like any other (set and get scatter and gather the rows), so loading and state code know nothing of it.
The scheduler (sched.py, pass 0) turns each product over such a weight into one product per device over its rows,
each running where its rows live, and their concatenation on the main device, where the rest of the layer runs:

    y = mul_mat(w, x)   ->   y = concat(mul_mat(w_0, x), mul_mat(w_1, x), ...)   (rows of w_i: r0_i .. r1_i)

so that every device reads only its share of the weights, as ggml-cuda's ggml_cuda_op_mul_mat does over a split
tensor; the scheduler's copies carry x to the devices and the slices back.
"""
from __future__ import annotations

import numpy as np

from .backend import Buffer, BufferType, BufferUsage, _as_bytes, tensor_alloc
from .tensor import Flags, Tensor


class SplitBufferType(BufferType):
    """Row-split memory over ``backends`` (their shares of each matrix's rows: ``tensor_split``, default equal);
    ``main``: the backend that gathers the products' rows (llama.cpp's main_gpu)."""

    def __init__(self, backends, tensor_split=None, main=None):
        names = ",".join(b.device for b in backends)
        super().__init__(f"split({names})", f"split:{names}", is_host=False)
        self.backends = list(backends)
        w = np.asarray(tensor_split if tensor_split else [1.0] * len(self.backends), np.float64)
        if len(w) != len(self.backends) or (w < 0).any() or w.sum() <= 0:
            raise ValueError(f"tensor_split {list(w)} does not share rows over {len(self.backends)} devices")
        self.cum = np.concatenate([[0.0], np.cumsum(w) / w.sum()])
        self.main = main if main is not None else self.backends[0]

    def row_ranges(self, n_rows: int) -> list[tuple[int, int]]:
        """[r0, r1) of each backend's rows (llama.cpp's get_row_split: n_rows times the cumulative shares)."""
        bounds = [int(n_rows * c) for c in self.cum]
        bounds[-1] = n_rows
        return list(zip(bounds[:-1], bounds[1:]))

    def alloc_buffer(self, size: int, usage: str = BufferUsage.ANY) -> "SplitBuffer":
        return SplitBuffer(self, size, usage)

    def buffer_from_host(self, data: np.ndarray, usage: str = BufferUsage.WEIGHTS) -> "SplitBuffer":
        """A buffer that takes ``data``'s bytes as its tensor's once that tensor is placed in it (the rows' split
        needs the tensor's shape)."""
        buf = SplitBuffer(self, data.nbytes, usage)
        buf.pending = _as_bytes(data)
        return buf


class SplitBuffer(Buffer):
    """The record of row-split tensors: no memory of its own, its tensors' rows in the devices' buffers."""

    def __init__(self, buft: SplitBufferType, size: int, usage: str = BufferUsage.ANY):
        super().__init__(buft, size, usage)
        self.parts: dict[int, list] = {}
        self.pending = None

    def init_tensor(self, t: Tensor) -> None:
        """Give t (a contiguous matrix) its row slices in the devices' memory (ggml's split buffer init_tensor)."""
        if t.ne[2] != 1 or t.ne[3] != 1 or not t.is_contiguous():
            raise ValueError(f"{t!r}: only a contiguous matrix can be split by rows")
        parts = []
        for b, (r0, r1) in zip(self.buft.backends, self.buft.row_ranges(t.ne[1])):
            if r1 > r0:
                p = Tensor(t.type, (t.ne[0], r1 - r0), name=f"{t.name}@{b.device}")
                p.flags |= Flags.WEIGHT
                tensor_alloc(b.get_default_buffer_type().alloc_buffer(p.nbytes, self.usage), p, 0)
                parts.append((b, p, r0, r1))
        self.parts[t.id] = parts
        if self.pending is not None:
            data, self.pending = self.pending, None
            self.set_tensor(t, data)

    def parts_of(self, t: Tensor) -> list[tuple]:
        """(backend, slice tensor, first row, end row) of each device that holds rows of t."""
        return self.parts[t.id]

    def set_tensor(self, t, data, offset=0, size=None):
        raw = _as_bytes(data)
        size = raw.nbytes if size is None else int(size)
        if offset != 0 or size != t.nbytes:     # part of the matrix: patch the whole and scatter it again
            whole = self.get_tensor(t)
            whole[offset:offset + size] = raw[:size]
            raw = whole
        rb = t.nb[1]
        for _, p, r0, r1 in self.parts[t.id]:
            p.storage.buffer.set_tensor(p, raw[r0 * rb:r1 * rb])

    def get_tensor(self, t, offset=0, size=None):
        whole = np.concatenate([p.storage.buffer.get_tensor(p) for _, p, _, _ in self.parts[t.id]])
        size = t.nbytes - offset if size is None else int(size)
        return whole[offset:offset + size].copy()

    def memset_tensor(self, t, value, offset=0, size=None):
        size = t.nbytes - offset if size is None else int(size)
        self.set_tensor(t, np.full(size, value, np.uint8), offset, size)

    def clear(self, value=0):
        for parts in self.parts.values():
            for _, p, _, _ in parts:
                p.storage.buffer.memset_tensor(p, value)
