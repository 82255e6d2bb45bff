"""Fake backends for allocator, scheduler and fusion tests.

``NullBackend`` computes nothing and records what it is asked (structure tests). ``NumpyBackend`` computes a
handful of ops in float64 NumPy, for results that must equal a single-backend run. Neither defines every optional
method of the Backend interface on purpose: the scheduler must give them defaults. ``DeviceBackend`` is a
NumpyBackend whose memory is not host memory (``DeviceBuffer``: bytes in a bytearray, reachable from outside only
through the buffer interface; ``tensor_data`` raises on it), as a GPU's would be.
"""
from __future__ import annotations

import numpy as np

from llampy.ggml.backend import Buffer, BufferType, BufferUsage, tensor_data, tensor_get, tensor_set
from llampy.ggml.tensor import Op, Tensor, VIEW_OPS, as_ndarray
from llampy.ggml.types import GGMLType as T


class DeviceBuffer(Buffer):
    """Device memory: a bytearray that only the buffer interface and its own backend (``device_view``) reach."""

    def __init__(self, buft, size, usage=BufferUsage.ANY):
        super().__init__(buft, max(int(size), 1), usage)
        self._mem = bytearray(self.size)
        self.n_writes = self.n_reads = self.n_device_copies = 0

    def write(self, offset, data):
        self._mem[offset:offset + data.nbytes] = data.tobytes()
        self.n_writes += 1

    def read(self, offset, size):
        self.n_reads += 1
        return np.frombuffer(bytes(self._mem[offset:offset + size]), np.uint8).copy()

    def memset(self, offset, size, value):
        self._mem[offset:offset + size] = bytes([value]) * size

    def cpy_tensor(self, src, dst):
        """Device to device on the same device, for contiguous tensors; anything else goes through the host."""
        sb = src.storage.buffer
        if not isinstance(sb, DeviceBuffer) or sb.buft.device != self.buft.device:
            return False
        if not (src.is_contiguous() and dst.is_contiguous()):
            return False
        a, b, n = src.data_offs, dst.data_offs, src.nbytes
        self._mem[b:b + n] = sb._mem[a:a + n]
        self.n_device_copies += 1
        return True

    def device_view(self, t: Tensor) -> np.ndarray:
        """For the device's own kernels only: t's elements over the device memory."""
        assert t.storage.buffer is self, f"{t!r} is not in {self!r}"
        return as_ndarray(t, np.frombuffer(self._mem, np.uint8))


class DeviceBufferType(BufferType):
    def __init__(self, name, device, alignment=64):
        super().__init__(name, device, alignment, is_host=False)
        self.buffers: list[DeviceBuffer] = []

    def alloc_buffer(self, size, usage=BufferUsage.ANY):
        buf = DeviceBuffer(self, size, usage)
        self.buffers.append(buf)
        return buf


class NullBackend:
    """Duck-typed (not a Backend subclass): supports everything except ``refuse``; records calls. ``host=False``
    gives it device memory."""

    def __init__(self, device="null", refuse=(), alignment=64, host=True):
        self.name = "null"
        self.device = device
        self.refuse = set(refuse)
        self.buft = BufferType(device, device, alignment) if host else DeviceBufferType(device, device, alignment)
        self.computed: list[list[Tensor]] = []
        self.n_copies_in = 0

    def get_default_buffer_type(self):
        return self.buft

    def alloc_buffer(self, size, usage=BufferUsage.ANY):
        return self.buft.alloc_buffer(size, usage)

    def supports_op(self, node):
        return node.op not in self.refuse

    def graph_compute(self, nodes):
        self.computed.append([n for n in nodes if n.op not in VIEW_OPS])

    def cpy_tensor(self, src, dst):
        """Counted, not made: a null backend computes nothing."""
        self.n_copies_in += 1
        return True

    def __repr__(self):
        return f"NullBackend({self.device})"


def _tile(b: np.ndarray, shape) -> np.ndarray:
    return np.tile(b, [s // d for s, d in zip(shape, b.shape)])


def _softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=-1, keepdims=True)


def _silu(x):
    return x / (1 + np.exp(-x))


def _gelu(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def _rms(x, eps):
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)


def _mul_mat(a, b):
    # a (ne03, ne02, m, k), b (ne13, ne12, n, k) -> (ne13, ne12, n, m); a broadcast over the batch dims
    a = np.repeat(np.repeat(a, b.shape[0] // a.shape[0], axis=0), b.shape[1] // a.shape[1], axis=1)
    return b @ np.swapaxes(a, -1, -2)


class NumpyBackend(NullBackend):
    """A tiny float64 NumPy backend: add, mul, mul_mat (F32), rms_norm(+mul), silu, gelu, tanh, swiglu, geglu,
    scale, softcap, cont, cpy, get_rows, soft_max, flash_attn_ext."""

    OPS = {Op.ADD, Op.MUL, Op.MUL_MAT, Op.RMS_NORM, Op.RMS_NORM_MUL, Op.SILU, Op.GELU, Op.TANH, Op.SWIGLU, Op.GEGLU,
           Op.SCALE, Op.SOFTCAP, Op.CONT, Op.CPY, Op.GET_ROWS, Op.SOFT_MAX, Op.FLASH_ATTN_EXT} | VIEW_OPS

    def __init__(self, device="numpy", refuse=(), alignment=64, host=True):
        super().__init__(device, refuse, alignment, host)
        self.name = "numpy"

    def _arr(self, t: Tensor) -> np.ndarray:
        return tensor_data(t)

    def _f(self, t: Tensor) -> np.ndarray:
        a = self._arr(t)
        if t.type == T.F16:
            return a.astype(np.float64)
        return np.asarray(a, dtype=np.float64) if t.type == T.F32 else np.asarray(a)

    def supports_op(self, node):
        if node.op not in self.OPS or node.op in self.refuse:
            return False
        if node.op == Op.MUL_MAT:
            return node.src[0].type == T.F32 and node.src[1].type == T.F32
        if node.op in (Op.SWIGLU, Op.GEGLU):
            return len(node.src) == 2 and not node.op_params.get("swapped")
        return node.op_params.get("max_bias", 0.0) == 0.0

    def cpy_tensor(self, src, dst):
        """Counted; the copy itself is the scheduler's (tensor_copy)."""
        self.n_copies_in += 1
        return False

    def graph_compute(self, nodes):
        for n in nodes:
            if n.op not in VIEW_OPS:
                out = self._arr(n)
                r = self._compute(n)
                out[...] = np.asarray(r).reshape(out.shape).astype(out.dtype)
        self.computed.append([n for n in nodes if n.op not in VIEW_OPS])

    def _compute(self, n: Tensor):
        op, s, p = n.op, n.src, n.op_params
        if op in (Op.ADD, Op.MUL):
            a, b = self._f(s[0]), self._f(s[1])
            b = _tile(b, a.shape)
            return a + b if op == Op.ADD else a * b
        if op == Op.MUL_MAT:
            return _mul_mat(self._f(s[0]), self._f(s[1]))
        if op == Op.RMS_NORM:
            return _rms(self._f(s[0]), p["eps"])
        if op == Op.RMS_NORM_MUL:
            x = self._f(s[0])
            y = _rms(x, p["eps"]) * _tile(self._f(s[1]), x.shape)
            return y + self._f(s[2]) if len(s) > 2 else y
        if op == Op.SILU:
            return _silu(self._f(s[0]))
        if op == Op.GELU:
            return _gelu(self._f(s[0]))
        if op == Op.TANH:
            return np.tanh(self._f(s[0]))
        if op in (Op.SWIGLU, Op.GEGLU):
            act = _silu if op == Op.SWIGLU else _gelu
            return act(self._f(s[0])) * self._f(s[1])
        if op == Op.MUL_MAT_GLU:
            act = _silu if p["glu"] == "swiglu" else _gelu
            x = self._f(s[2])
            return act(_mul_mat(self._f(s[0]), x)) * _mul_mat(self._f(s[1]), x)
        if op == Op.SCALE:
            return self._f(s[0]) * p["s"] + p["b"]
        if op == Op.SOFTCAP:
            return np.tanh(self._f(s[0]) * p["s_in"]) * p["s_out"]
        if op in (Op.CONT, Op.CPY):
            return np.ascontiguousarray(self._arr(s[0])).reshape(-1)
        if op == Op.GET_ROWS:
            a, idx = self._arr(s[0]), np.asarray(self._arr(s[1]))
            out = np.empty(self._arr(n).shape)
            for i3 in range(out.shape[0]):
                for i2 in range(out.shape[1]):
                    out[i3, i2] = a[i3 % a.shape[0], i2 % a.shape[1]][idx[0, i3, i2]]
            return out
        if op == Op.SOFT_MAX:
            x = self._f(s[0]) * p["scale"]
            if p["has_mask"]:
                m = self._f(s[1])[:, :, :x.shape[2], :]
                x = x + _tile(m, x.shape)
            return _softmax(x)
        if op == Op.FLASH_ATTN_EXT:
            q, k, v = self._f(s[0]), self._f(s[1]), self._f(s[2])           # (ne3, heads, n, d)
            r = q.shape[1] // k.shape[1]
            k, v = np.repeat(k, r, axis=1), np.repeat(v, r, axis=1)
            sc = q @ np.swapaxes(k, -1, -2) * p["scale"]
            if p["softcap"]:
                sc = p["softcap"] * np.tanh(sc / p["softcap"])
            if p["has_mask"]:
                m = self._f(s[3])[:, :, :sc.shape[2], :]
                sc = sc + _tile(m, sc.shape)
            o = _softmax(sc) @ v                            # (ne3, n_head, n_q, dv)
            return np.swapaxes(o, 1, 2)                       # (ne3, n_q, n_head, dv)
        raise NotImplementedError(op)


class DeviceBackend(NumpyBackend):
    """A NumpyBackend over device memory: its kernels read and write DeviceBuffers through ``device_view``."""

    def __init__(self, device="dev", refuse=(), alignment=64):
        super().__init__(device, refuse, alignment, host=False)
        self.name = "device"

    def _arr(self, t):
        buf = t.storage.buffer
        assert isinstance(buf, DeviceBuffer) and buf.buft is self.buft, f"{t!r} is not in {self!r}'s memory"
        return buf.device_view(t)


# ---------------------------------------------------------------------------------------------- test graphs
from llampy.ggml import ops                                  # noqa: E402
from llampy.ggml.backend import tensor_alloc                 # noqa: E402
from llampy.ggml.graph import Graph                          # noqa: E402
from llampy.ggml.tensor import Flags                         # noqa: E402


def weight(backend, ne, rng, scale=0.2, name="") -> Tensor:
    """An F32 weight (ne in ggml order) in a WEIGHTS buffer of ``backend``."""
    t = Tensor(T.F32, ne, name=name)
    t.flags |= Flags.WEIGHT
    tensor_alloc(backend.alloc_buffer(t.nbytes, BufferUsage.WEIGHTS), t, 0)
    tensor_set(t, rng.standard_normal(t.ne[::-1]) * scale)
    return t


def causal_mask(n_tok: int) -> np.ndarray:
    return np.triu(np.full((n_tok, n_tok), -np.inf, np.float32), 1)


class Block:
    """A small llama-style transformer (per layer: rms_norm·w, q/k/v, GQA attention without flash attention,
    o, residual, rms_norm·w, SwiGLU FFN, residual); layer il's weights live on ``devices[il]``."""

    def __init__(self, devices, n_embd=32, n_head=4, n_head_kv=2, n_ff=48, n_tok=6, seed=0, softcap=0.0):
        rng = np.random.default_rng(seed)
        hd = n_embd // n_head
        self.n_embd, self.n_tok = n_embd, n_tok
        self.x = Tensor(T.F32, (n_embd, n_tok), name="inp_embd").set_input()
        self.mask = Tensor(T.F32, (n_tok, n_tok), name="kq_mask").set_input()
        cur = self.x
        for il, dev in enumerate(devices):
            W = lambda *ne, s=0.2, nm="": weight(dev, ne, rng, s, f"blk.{il}.{nm}")
            h = ops.mul(ops.rms_norm(cur, 1e-5), W(n_embd, nm="attn_norm"))
            q = ops.reshape(ops.mul_mat(W(n_embd, n_embd, nm="attn_q"), h), hd, n_head, n_tok)
            k = ops.reshape(ops.mul_mat(W(n_embd, hd * n_head_kv, nm="attn_k"), h), hd, n_head_kv, n_tok)
            v = ops.reshape(ops.mul_mat(W(n_embd, hd * n_head_kv, nm="attn_v"), h), hd, n_head_kv, n_tok)
            kq = ops.mul_mat(ops.permute(k, 0, 2, 1, 3), ops.permute(q, 0, 2, 1, 3))   # [n_kv, n_tok, n_head]
            scale = 1.0 / np.sqrt(hd)
            if softcap:        # gemma2's way: scaled q, capped scores, softmax with scale 1
                kq = ops.scale(ops.tanh(ops.scale(kq, scale / softcap)), softcap)
                scale = 1.0
            kq = ops.soft_max_ext(kq, self.mask, scale)
            vt = ops.cont(ops.permute(v, 1, 2, 0, 3))                                    # [n_kv, hd, n_head_kv]
            kqv = ops.permute(ops.mul_mat(vt, kq), 0, 2, 1, 3)                           # [hd, n_head, n_tok]
            attn = ops.mul_mat(W(n_embd, n_embd, nm="attn_output"), ops.cont(kqv, n_embd, n_tok))
            cur = ops.add(cur, attn).set_name(f"ffn_inp-{il}")
            h = ops.mul(ops.rms_norm(cur, 1e-5), W(n_embd, nm="ffn_norm"))
            g = ops.mul_mat(W(n_embd, n_ff, nm="ffn_gate"), h)
            u = ops.mul_mat(W(n_embd, n_ff, nm="ffn_up"), h)
            f = ops.mul_mat(W(n_ff, n_embd, s=0.1, nm="ffn_down"), ops.mul(ops.silu(g), u))
            cur = ops.add(cur, f).set_name(f"l_out-{il}")
        self.out = cur.set_output()
        self.graph = Graph.build(self.out)

    def set_inputs(self, seed=1):
        x = np.random.default_rng(seed).standard_normal((self.n_tok, self.n_embd)).astype(np.float32)
        tensor_set(self.x, x)
        tensor_set(self.mask, causal_mask(self.n_tok))
        return x

    def result(self) -> np.ndarray:
        return tensor_get(self.out)
