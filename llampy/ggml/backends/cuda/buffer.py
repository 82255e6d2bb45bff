"""Device memory of the CUDA backend: a buffer is one torch uint8 tensor on the device.

The buffer interface (``ggml/backend.py``) moves bytes: ``write``/``read``/``memset`` copy between host arrays and
the device tensor, ``cpy_tensor`` copies device to device (this device or a peer) or host to device directly. Tensors are
read by the backend's kernels through ``view`` (a typed torch view with the tensor's shape and strides) and
``rows`` (the uint8 rows of a block-format tensor). Under ``TRITON_INTERPRET=1`` without a GPU the "device" is
torch's CPU memory, still not host memory to the rest of llampy: the boundary is tested there.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch

from ...backend import Buffer, BufferType, BufferUsage
from ...tensor import Tensor
from ...types import GGMLType, TYPE_TRAITS, row_size

T = GGMLType

TORCH_DTYPE = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16, T.I32: torch.int32,
               T.I64: torch.int64, T.I16: torch.int16, T.I8: torch.int8, T.F64: torch.float64}

_PAD = 16       # buffer sizes are rounded up to this, so that any typed view of the whole buffer exists


def _from_numpy(a: np.ndarray) -> torch.Tensor:
    """A torch view of a host array, read-only ones too (a GGUF file's mapped pages: torch only reads them here)."""
    if a.flags.writeable:
        return torch.from_numpy(a)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


class CUDABufferType(BufferType):
    def __init__(self, device: torch.device, name: str, alignment: int = 256):
        """``name``: the backend's device id (buffers of equal ids are shared by their backends)."""
        super().__init__(name if device.type == "cuda" else f"{name} (interpreter)", name, alignment=alignment,
                         is_host=False)
        self.torch_device = device

    def alloc_buffer(self, size: int, usage: str = BufferUsage.ANY) -> "CUDABuffer":
        n = (max(int(size), 1) + _PAD - 1) // _PAD * _PAD
        return CUDABuffer(self, torch.zeros(n, dtype=torch.uint8, device=self.torch_device), usage)


class CUDABuffer(Buffer):
    def __init__(self, buft: CUDABufferType, data: torch.Tensor, usage: str):
        super().__init__(buft, data.numel(), usage)
        self.data = data
        self._typed: dict = {}

    # ------------------------------------------------------------ bytes
    def write(self, offset, data):
        src = _from_numpy(np.ascontiguousarray(data))
        self.data[offset:offset + src.numel()].copy_(src)

    def read(self, offset, size):
        return self.data[offset:offset + size].cpu().numpy().copy()

    def memset(self, offset, size, value):
        self.data[offset:offset + size].fill_(int(value))

    def cpy_tensor(self, src: Tensor, dst: Tensor) -> bool:
        """src (contiguous) into dst from this device, another device (a peer copy) or host memory; dst contiguous
        or rows of one (a row gathering's slice of a product: ggml's cudaMemcpy2DPeerAsync)."""
        sb = src.storage.buffer
        if not src.is_contiguous():
            return False
        if isinstance(sb, CUDABuffer):
            data = sb.data[src.data_offs:src.data_offs + src.nbytes]
        elif sb.is_host and hasattr(sb, "data"):
            data = _from_numpy(sb.data[src.data_offs:src.data_offs + src.nbytes])
        else:
            return False
        if dst.is_contiguous():
            self.data[dst.data_offs:dst.data_offs + dst.nbytes].copy_(data)
            return True
        row = dst.ne[0] * dst.nb[0]
        if dst.nb[0] != TYPE_TRAITS[dst.type].type_size or TYPE_TRAITS[dst.type].blck_size != 1:
            return False
        shape, strides = (dst.ne[3], dst.ne[2], dst.ne[1], row), (dst.nb[3], dst.nb[2], dst.nb[1], 1)
        self.data.as_strided(shape, strides, self.data.storage_offset() + dst.data_offs).copy_(data.view(shape))
        return True

    def clear(self, value=0):
        self.data.fill_(int(value))

    # ------------------------------------------------------------ views for the kernels
    def typed(self, dtype: torch.dtype) -> torch.Tensor:
        v = self._typed.get(dtype)
        if v is None:
            v = self._typed[dtype] = self.data.view(dtype)
        return v


def view(t: Tensor) -> torch.Tensor:
    """A torch view of a plain-typed tensor in device memory: shape reversed(ne), t's strides."""
    buf = t.storage.buffer
    dt = TORCH_DTYPE[t.type]
    isz = TYPE_TRAITS[t.type].type_size
    off = t.data_offs
    if off % isz or any(nb % isz for nb in t.nb):
        raise ValueError(f"{t!r}: offset or strides not a multiple of its element size")
    return torch.as_strided(buf.typed(dt), t.ne[::-1], [nb // isz for nb in t.nb[::-1]], off // isz)


def rows(t: Tensor) -> torch.Tensor:
    """The uint8 rows of a tensor (any type): shape (ne3, ne2, ne1, row bytes), strides (nb3, nb2, nb1, 1)."""
    buf = t.storage.buffer
    return torch.as_strided(buf.data, (t.ne[3], t.ne[2], t.ne[1], row_size(t.type, t.ne[0])),
                            (t.nb[3], t.nb[2], t.nb[1], 1), t.data_offs)
