"""The backend interface (ggml-backend.h): a device, its buffer types and buffers, and a compute engine.

A backend fills about ten methods. Optional ones have defaults here, so callers never test for them.
Nothing in the core imports a backend: backends register themselves with ``register_backend``.

Host buffers hold their bytes in a NumPy uint8 array (``Buffer.data``); a tensor placed in one is read and
written through ``tensor.as_ndarray(t, buffer.data)``. Every backend in this package uses host memory, but two
backends with different ``device`` ids do not share buffers: the scheduler copies tensors between them.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from .tensor import Tensor, as_ndarray, VIEW_OPS

TENSOR_ALIGNMENT = 64


class BufferUsage:
    ANY = "any"
    WEIGHTS = "weights"
    COMPUTE = "compute"


class BufferType:
    """Where a buffer's memory lives. ``device`` names the memory space; equal devices share buffers."""

    def __init__(self, name: str, device: str, alignment: int = TENSOR_ALIGNMENT, is_host: bool = True):
        self.name = name
        self.device = device
        self.alignment = alignment
        self.is_host = is_host

    def alloc_buffer(self, size: int, usage: str = BufferUsage.ANY) -> "Buffer":
        return Buffer(self, np.zeros(max(int(size), 1), dtype=np.uint8), usage)

    def wrap(self, data: np.ndarray, usage: str = BufferUsage.WEIGHTS) -> "Buffer":
        """A buffer over existing host bytes (e.g. a read-only mmap of a GGUF file), without copying."""
        return Buffer(self, data.reshape(-1).view(np.uint8), usage)

    def __repr__(self):
        return f"BufferType({self.name}, device={self.device})"


class Buffer:
    def __init__(self, buft: BufferType, data: np.ndarray, usage: str = BufferUsage.ANY):
        self.buft = buft
        self.data = data
        self.usage = usage

    @property
    def size(self) -> int:
        return self.data.nbytes

    def view(self, t: Tensor) -> np.ndarray:
        return as_ndarray(t, self.data)

    def clear(self, value: int = 0) -> None:
        self.data.fill(value)

    def __repr__(self):
        return f"Buffer({self.buft.name}, {self.size} bytes, {self.usage})"


def tensor_alloc(buffer: Buffer, t: Tensor, offs: int) -> None:
    """Place ``t`` (a tensor that owns its memory) in ``buffer`` at byte ``offs``."""
    if t.view_src is not None:
        raise ValueError(f"{t!r} is a view; place its view_src instead")
    if offs < 0 or offs + t.nbytes > buffer.size:
        raise ValueError(f"{t!r} ({t.nbytes} bytes) does not fit in {buffer!r} at {offs}")
    t.buffer = buffer
    t.offs = offs


def tensor_buffer(t: Tensor) -> Buffer | None:
    return t.storage.buffer


def tensor_data(t: Tensor) -> np.ndarray:
    """The NumPy view of a placed tensor's memory (host buffers only)."""
    buf = tensor_buffer(t)
    if buf is None:
        raise ValueError(f"{t!r} has no storage")
    return as_ndarray(t, buf.data)


class Backend:
    """A compute engine over one device. Subclasses implement the methods that raise NotImplementedError."""

    name: str = "backend"

    def __init__(self, device: str | None = None):
        self.device = device or self.name
        self._buft = BufferType(f"{self.device}", self.device)

    # ------------------------------------------------------------ memory
    def get_default_buffer_type(self) -> BufferType:
        return self._buft

    def alloc_buffer(self, size: int, usage: str = BufferUsage.ANY) -> Buffer:
        return self.get_default_buffer_type().alloc_buffer(size, usage)

    def supports_buft(self, buft: BufferType) -> bool:
        return buft.device == self.device

    def supports_buffer(self, buffer: Buffer) -> bool:
        return self.supports_buft(buffer.buft)

    def set_tensor(self, t: Tensor, value, offset: int = 0) -> None:
        """Write ``value`` (an array, or raw bytes) into t's memory. Host default: a NumPy copy."""
        dst = tensor_data(t)
        src = np.asarray(value)
        if src.dtype == np.uint8 and dst.dtype != np.uint8 and src.ndim == 1 and src.nbytes == t.nbytes:
            src = src.view(dst.dtype)
        np.copyto(dst, src.reshape(dst.shape), casting="same_kind" if src.dtype != dst.dtype else "no")

    def get_tensor(self, t: Tensor) -> np.ndarray:
        return np.array(tensor_data(t), copy=True)

    def cpy_tensor(self, src: Tensor, dst: Tensor) -> None:
        """Copy between tensors of the same type and shape, possibly on different devices (host default)."""
        np.copyto(tensor_data(dst), tensor_data(src))

    def synchronize(self) -> None:
        pass

    # ------------------------------------------------------------ compute
    def supports_op(self, node: Tensor) -> bool:
        raise NotImplementedError

    def graph_compute(self, nodes: list[Tensor]) -> None:
        """Run the nodes (a split of a scheduled graph, in order). All tensors are placed in buffers this backend supports."""
        raise NotImplementedError

    def offload_op(self, node: Tensor) -> bool:
        """Whether an op whose weights live elsewhere is worth running here anyway (ggml's offload_op). Default: no."""
        return False

    def __repr__(self):
        return f"{type(self).__name__}({self.device})"


_REGISTRY: dict[str, Callable[..., Backend]] = {}


def register_backend(name: str, factory: Callable[..., Backend]) -> None:
    _REGISTRY[name] = factory


def backend_names() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def backend_init(name: str, **kw) -> Backend:
    """Create a backend by name ('cpu', 'reference', 'cuda'). Importing the backend module registers it."""
    _load_builtin()
    if name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; available: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name](**kw)


def _load_builtin() -> None:
    """Import the built-in backends (each registers itself); an error in one is an error, not a missing backend."""
    import importlib
    for mod in ("llampy.ggml.backends.reference", "llampy.ggml.backends.cpu"):
        importlib.import_module(mod)


def is_view_op(t: Tensor) -> bool:
    return t.op in VIEW_OPS
