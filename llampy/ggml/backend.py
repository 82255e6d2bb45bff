"""The backend interface (ggml-backend.h): a device, its buffer types and buffers, and a compute engine.

A backend fills about ten methods. Optional ones have defaults here, so callers never test for them.
Nothing in the core imports a backend: backends register themselves with ``register_backend``.

The buffer is the device boundary (ggml-backend-impl.h's buffer interface). A ``Buffer`` moves bytes in and out
of its memory — ``set_tensor``, ``get_tensor``, ``memset_tensor``, ``cpy_tensor``, ``clear`` — and says whether
that memory is host memory (``is_host``). Everyone outside the backends reads and writes tensors through the free
functions ``tensor_set``/``tensor_get``/``tensor_copy``/``tensor_memset``, which pick the path from the buffers
(ggml_backend_tensor_set/get/copy): a NumPy view where the memory is the host's, the buffer's own methods where it
is not, a trip through host memory between two devices. ``tensor_data`` (a NumPy view of a tensor's memory) is for
backends over their own host buffers only: it raises for any other memory.

A host buffer holds its bytes in a NumPy uint8 array (``HostBuffer.data``). Two backends with different ``device``
ids do not share buffers, even when both use host memory: the scheduler copies tensors between them.
"""
from __future__ import annotations

import sys
from typing import Callable

import numpy as np

from .tensor import Tensor, as_ndarray, VIEW_OPS

TENSOR_ALIGNMENT = 64


class BufferUsage:
    ANY = "any"
    WEIGHTS = "weights"
    COMPUTE = "compute"


class BufferType:
    """Where a buffer's memory lives (ggml_backend_buffer_type). ``device`` names the memory space; equal devices
    share buffers. This base class makes host buffers; a device's buffer type overrides ``alloc_buffer``."""

    def __init__(self, name: str, device: str, alignment: int = TENSOR_ALIGNMENT, is_host: bool = True,
                 max_size: int | None = None):
        self.name = name
        self.device = device
        self.alignment = alignment
        self.is_host = is_host
        self.max_size = sys.maxsize if max_size is None else int(max_size)

    def get_alignment(self) -> int:
        return self.alignment

    def get_max_size(self) -> int:
        """The largest buffer this type can allocate in one piece (ggml: SIZE_MAX unless the device says less)."""
        return self.max_size

    def alloc_buffer(self, size: int, usage: str = BufferUsage.ANY) -> "Buffer":
        """A new buffer of ``size`` bytes, zeroed (host pages are zero until touched; a device clears its memory)."""
        if not self.is_host:
            raise NotImplementedError(f"{self!r} is not host memory: its device implements alloc_buffer")
        return HostBuffer(self, np.zeros(max(int(size), 1), dtype=np.uint8), usage)

    def buffer_from_host(self, data: np.ndarray, usage: str = BufferUsage.WEIGHTS) -> "Buffer":
        """A buffer holding the bytes of ``data`` (e.g. a read-only mmap of a GGUF file): host memory is wrapped
        without a copy (ggml's buffer_from_host_ptr), other memory gets a copy (the loader's upload)."""
        raw = data.reshape(-1).view(np.uint8)
        if self.is_host:
            return HostBuffer(self, raw, usage)
        buf = self.alloc_buffer(raw.nbytes, usage)
        buf.write(0, raw)
        return buf

    def __repr__(self):
        return f"BufferType({self.name}, device={self.device}{'' if self.is_host else ', not host'})"


def _as_bytes(data) -> np.ndarray:
    """Raw bytes of an array or a bytes-like object, as a flat uint8 array (a view where possible)."""
    a = np.ascontiguousarray(data) if isinstance(data, np.ndarray) else np.frombuffer(data, np.uint8)
    return a.reshape(-1).view(np.uint8)


class Buffer:
    """A buffer of one buffer type (ggml_backend_buffer). A device implements the three byte methods (``write``,
    ``read``, ``memset``) and, if it can, ``cpy_tensor``; the tensor methods below are built on them.

    Tensor methods take byte ranges as ggml does: ``offset`` and ``size`` in bytes from the tensor's first byte
    (``t.data_offs`` in the buffer), within ``t.nbytes``."""

    def __init__(self, buft: BufferType, size: int, usage: str = BufferUsage.ANY):
        self.buft = buft
        self.size = int(size)
        self.usage = usage

    @property
    def is_host(self) -> bool:
        return self.buft.is_host

    # ------------------------------------------------------------ bytes (a device fills these)
    def write(self, offset: int, data: np.ndarray) -> None:
        """Copy the uint8 array ``data`` to byte ``offset`` of the buffer."""
        raise NotImplementedError

    def read(self, offset: int, size: int) -> np.ndarray:
        """A new uint8 array with ``size`` bytes from byte ``offset``."""
        raise NotImplementedError

    def memset(self, offset: int, size: int, value: int) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------ tensors (ggml_backend_buffer_i)
    def init_tensor(self, t: Tensor) -> None:
        """Called as t is placed here (ggml's init_tensor): a buffer that keeps per-tensor state sets it up."""

    def _range(self, t: Tensor, offset: int, size: int | None) -> tuple[int, int]:
        if t.storage.buffer is not self:
            raise ValueError(f"{t!r} is not in {self!r}")
        size = t.nbytes - offset if size is None else int(size)
        if offset < 0 or size < 0 or offset + size > t.nbytes:
            raise ValueError(f"bytes [{offset}, {offset + size}) lie outside {t!r} ({t.nbytes} bytes)")
        return t.data_offs + offset, size

    def set_tensor(self, t: Tensor, data, offset: int = 0, size: int | None = None) -> None:
        """Write ``size`` raw bytes of ``data`` (all of it by default) at byte ``offset`` of t."""
        raw = _as_bytes(data)
        size = raw.nbytes if size is None else int(size)
        off, size = self._range(t, offset, size)
        self.write(off, raw[:size])

    def get_tensor(self, t: Tensor, offset: int = 0, size: int | None = None) -> np.ndarray:
        """``size`` raw bytes of t from byte ``offset`` (the rest of t by default), as a new uint8 array."""
        off, size = self._range(t, offset, size)
        return self.read(off, size)

    def memset_tensor(self, t: Tensor, value: int, offset: int = 0, size: int | None = None) -> None:
        off, size = self._range(t, offset, size)
        self.memset(off, size, value)

    def cpy_tensor(self, src: Tensor, dst: Tensor) -> bool:
        """Copy src (any buffer) into dst (in this buffer) directly, if this buffer can: False when it cannot, and
        the caller goes through host memory."""
        return False

    def clear(self, value: int = 0) -> None:
        self.memset(0, self.size, value)

    def __repr__(self):
        return f"{type(self).__name__}({self.buft.name}, {self.size} bytes, {self.usage})"


class HostBuffer(Buffer):
    """Host memory: a NumPy uint8 array."""

    def __init__(self, buft: BufferType, data: np.ndarray, usage: str = BufferUsage.ANY):
        super().__init__(buft, data.nbytes, usage)
        self.data = data

    def write(self, offset, data):
        self.data[offset:offset + data.nbytes] = data

    def read(self, offset, size):
        return self.data[offset:offset + size].copy()

    def memset(self, offset, size, value):
        self.data[offset:offset + size] = value

    def cpy_tensor(self, src, dst):
        sb = src.storage.buffer
        if not sb.is_host:
            return False
        np.copyto(as_ndarray(dst, self.data), as_ndarray(src, sb.data))
        return True

    def clear(self, value=0):
        self.data.fill(value)


def tensor_alloc(buffer: Buffer, t: Tensor, offs: int) -> None:
    """Place ``t`` (a tensor that owns its memory) in ``buffer`` at byte ``offs``."""
    if t.view_src is not None:
        raise ValueError(f"{t!r} is a view; place its view_src instead")
    if offs < 0 or offs + t.nbytes > buffer.size:
        raise ValueError(f"{t!r} ({t.nbytes} bytes) does not fit in {buffer!r} at {offs}")
    t.buffer = buffer
    t.offs = offs
    init = getattr(buffer, "init_tensor", None)        # optional (buffers of other shapes need not have it)
    if init is not None:
        init(t)


def tensor_buffer(t: Tensor) -> Buffer | None:
    return t.storage.buffer


def _buffer(t: Tensor) -> Buffer:
    buf = t.storage.buffer
    if buf is None:
        raise ValueError(f"{t!r} has no storage")
    return buf


def tensor_data(t: Tensor) -> np.ndarray:
    """The NumPy view of a placed tensor's memory: for a backend over its own host buffers only. Everyone else
    uses tensor_set/tensor_get/tensor_copy, which work on any buffer."""
    buf = _buffer(t)
    if not buf.is_host:
        raise TypeError(f"{t!r} lives in {buf!r}, which is not host memory: read and write it with "
                        f"tensor_get/tensor_set (tensor_data is for backends over their own host buffers)")
    return as_ndarray(t, buf.data)


def tensor_host_view(t: Tensor) -> np.ndarray | None:
    """A flat NumPy view of t's memory where its buffer is host memory and t is contiguous, else None (then
    tensor_set/tensor_get). As llama.cpp's graph inputs are written straight into ``tensor->data`` where
    ``ggml_backend_buffer_is_host``: for callers that write or read the same tensor every step and keep the view
    while the tensor stays in the same buffer at the same offset."""
    buf = t.storage.buffer
    if buf is None or not buf.is_host or not t.is_contiguous() or t.nelements == 0:
        return None
    return as_ndarray(t, buf.data).reshape(-1)


# ---------------------------------------------------------------------------------------------- ggml_backend_tensor_*
def tensor_set(t: Tensor, value) -> None:
    """Write ``value`` (an array of t's shape in NumPy order, or anything that reshapes to it, cast to t's type; for
    block types the raw rows) into t, wherever its memory is."""
    buf = _buffer(t)
    if buf.is_host:
        dst = as_ndarray(t, buf.data)
        dst[...] = np.asarray(value).reshape(dst.shape)
        return
    if t.nelements == 0:
        return
    if t.is_contiguous():
        raw = np.empty(t.nbytes, np.uint8)
        arr = as_ndarray(t, raw, 0)
        arr[...] = np.asarray(value).reshape(arr.shape)
        buf.set_tensor(t, raw, 0, t.nbytes)
    else:      # a strided view: read its byte span, write the elements, put the span back
        raw = buf.get_tensor(t, 0, t.nbytes)
        arr = as_ndarray(t, raw, 0)
        arr[...] = np.asarray(value).reshape(arr.shape)
        buf.set_tensor(t, raw, 0, t.nbytes)


def tensor_get(t: Tensor) -> np.ndarray:
    """A new array with t's values (NumPy order: shape ``reversed(ne)``; block types: uint8 rows)."""
    buf = _buffer(t)
    if buf.is_host:
        return np.array(as_ndarray(t, buf.data))
    if t.nelements == 0:
        return as_ndarray(t, np.empty(0, np.uint8), 0)
    return np.array(as_ndarray(t, buf.get_tensor(t, 0, t.nbytes), 0))


def tensor_set_bytes(t: Tensor, data, offset: int = 0) -> None:
    """Raw bytes into t at byte ``offset`` (ggml_backend_tensor_set with a size of len(data))."""
    _buffer(t).set_tensor(t, data, offset)


def tensor_get_bytes(t: Tensor, offset: int = 0, size: int | None = None) -> np.ndarray:
    return _buffer(t).get_tensor(t, offset, size)


def tensor_memset(t: Tensor, value: int, offset: int = 0, size: int | None = None) -> None:
    """Set bytes of t (all of them by default) to ``value``. t must be contiguous: its bytes are one range."""
    if not t.is_contiguous():
        raise ValueError(f"tensor_memset of {t!r}: not contiguous")
    _buffer(t).memset_tensor(t, value, offset, size)


def tensor_copy(src: Tensor, dst: Tensor) -> None:
    """Copy src into dst (same type and shape), across devices if need be (ggml_backend_tensor_copy): a NumPy copy
    when both are host memory, else dst's buffer copies directly if it can, else through host memory."""
    if src.type != dst.type or src.ne != dst.ne:
        raise ValueError(f"tensor_copy: {src!r} and {dst!r} differ in type or shape")
    sb, db = _buffer(src), _buffer(dst)
    if sb.is_host and db.is_host:
        np.copyto(as_ndarray(dst, db.data), as_ndarray(src, sb.data))
    elif not db.cpy_tensor(src, dst):
        tensor_set(dst, tensor_get(src))


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

    def set_tensor(self, t: Tensor, value) -> None:
        """Write ``value`` into t (ggml_backend_tensor_set_async: a device may queue it; default: tensor_set)."""
        tensor_set(t, value)

    def get_tensor(self, t: Tensor) -> np.ndarray:
        return tensor_get(t)

    def cpy_tensor(self, src: Tensor, dst: Tensor) -> bool:
        """Copy src into dst (dst in this backend's memory) the backend's own way, e.g. queued on its stream
        (ggml's cpy_tensor_async). False: it cannot, and the scheduler calls tensor_copy."""
        return False

    def synchronize(self) -> None:
        pass

    # ------------------------------------------------------------ compute
    def supports_op(self, node: Tensor) -> bool:
        raise NotImplementedError

    def graph_compute(self, nodes: list[Tensor]) -> None:
        """Run the nodes (a split of a scheduled graph, in order). All tensors are placed in buffers this backend supports."""
        raise NotImplementedError

    def graph_optimize(self, graph_nodes: list[Tensor], nodes: list[Tensor]) -> list[Tensor]:
        """Rewrite ``nodes``, the run of ``graph_nodes`` that the scheduler placed here (one split), before copies and
        allocation (ggml's graph_optimize); returns the new run. A backend that runs fused ops fuses here, with
        ``fusion.fuse_nodes(graph_nodes, nodes, self)``. Default: nothing (the reference runs what it is given)."""
        return nodes

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
    if name == "cuda" and name not in _REGISTRY:
        _load_cuda()
    if name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; available: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name](**kw)


class BackendUnavailable(RuntimeError):
    """A backend that exists but cannot run here (no GPU, or its extra is not installed)."""


def _load_cuda() -> None:
    """The CUDA backend is imported on request: it needs the ``cuda`` extra (torch, triton)."""
    try:
        import torch  # noqa: F401
        import triton  # noqa: F401
    except ImportError as e:
        raise BackendUnavailable(f"the cuda backend needs torch and triton: pip install 'llampy[cuda]' ({e})") from None
    import importlib
    importlib.import_module("llampy.ggml.backends.cuda")


def _load_builtin() -> None:
    """Import the built-in backends (each registers itself); an error in one is an error, not a missing backend."""
    import importlib
    for mod in ("llampy.ggml.backends.reference", "llampy.ggml.backends.cpu"):
        importlib.import_module(mod)


def is_view_op(t: Tensor) -> bool:
    return t.op in VIEW_OPS
