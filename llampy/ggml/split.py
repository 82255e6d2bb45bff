"""Matrices split by rows across devices (llama.cpp's split_mode 'row'; ggml-cuda's split buffer type).

A weight placed in a ``SplitBufferType`` lives as row slices, one per device in ``tensor_split``'s proportions, each a
weight tensor of its own in that device's memory (``SplitBuffer.parts_of``). The buffer moves bytes in and out of the
whole matrix like any other (set and get scatter and gather the rows), so loading and state code know nothing of it.
The scheduler (sched.py, pass 0) turns each product over such a weight into one product per device over its rows,
each running where its rows live, and their concatenation on the main device, where the rest of the layer runs:

    y = mul_mat(w, x)   ->   y_i = mul_mat(w_i, x) on device i;  y[r0_i:r1_i] = y_i  (rows of w_i: r0_i .. r1_i)

so that every device reads only its share of the weights, as ggml-cuda's ggml_cuda_op_mul_mat does over a split
tensor: the scheduler's copies carry x to the devices, and the gathering node on the main device is no kernel but
the scheduler copying each device's rows straight into their slice of y (ggml's cudaMemcpy2DPeerAsync of dst_dd_i
into dst), one copy per device and no intermediate concatenations.

Each device's share starts and ends on a multiple of the row rounding (ggml's get_row_rounding/get_row_split): the
largest ``row_tile`` (rows per program of its tiled product kernels; 1 if it has none) of the devices that get rows,
so that no device's kernels run a partial tile except the last device's at the matrix's end.
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
        # the cumulative shares in float32, summed and divided in order as ggml_backend_cuda_split_buffer_type does
        cum, total = [], np.float32(0)
        for x in w.astype(np.float32):
            cum.append(total)
            total = np.float32(total + x)
        self.cum = [np.float32(c / total) for c in cum]
        self.main = main if main is not None else self.backends[0]
        # ggml's get_row_rounding: the largest tile of the devices whose share is not empty
        ends = self.cum[1:] + [np.float32(1)]
        self.rounding = max([int(getattr(b, "row_tile", 1)) for b, lo, hi in zip(self.backends, self.cum, ends)
                             if lo < hi] or [1])

    def row_ranges(self, n_rows: int) -> list[tuple[int, int]]:
        """[r0, r1) of each backend's rows (ggml's get_row_split: n_rows times the cumulative share, in float32,
        rounded down to the row rounding; the last device ends at n_rows)."""
        r = self.rounding
        bounds = [0] + [int(np.float32(n_rows) * c) // r * r for c in self.cum[1:]] + [n_rows]
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
