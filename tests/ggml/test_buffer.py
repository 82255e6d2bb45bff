"""The buffer interface (ggml-backend's buffer_i) and the free functions that dispatch on it: tensor_set/get/copy/
memset across host memory and device memory (tests/ggml/fakes.DeviceBuffer: bytes no NumPy view reaches), with
the same values either way; tensor_data only for host memory; uploads from host; the allocator's poison mode and
the KV cache through the interface."""
from __future__ import annotations

import numpy as np
import pytest

from llampy.ggml import ops
from llampy.ggml.alloc import GraphAllocator
from llampy.ggml.backend import (Backend, BufferType, BufferUsage, HostBuffer, tensor_alloc, tensor_copy, tensor_data,
                                 tensor_get, tensor_get_bytes, tensor_memset, tensor_set, tensor_set_bytes)
from llampy.ggml.quants import quantize
from llampy.ggml.tensor import Tensor
from llampy.ggml.types import GGMLType as T

from .fakes import DeviceBuffer, DeviceBufferType

HOST = BufferType("host", "host")
DEV0, DEV1 = DeviceBufferType("dev0", "dev0"), DeviceBufferType("dev1", "dev1")
BUFTS = {"host": HOST, "dev0": DEV0, "dev1": DEV1}


def placed(buft, type_, ne, name="t", pad=32):
    """A tensor of ``type_`` placed at a non-zero offset of a fresh buffer (to catch offset mistakes)."""
    t = Tensor(type_, ne, name=name)
    tensor_alloc(buft.alloc_buffer(t.nbytes + 2 * pad), t, pad)
    return t


def same(t, want) -> bool:
    """tensor_get(t) (all four dims, NumPy order) holds ``want``."""
    got = tensor_get(t)
    return got.size == np.size(want) and np.array_equal(got, np.reshape(want, got.shape).astype(got.dtype))


def values(type_, ne, seed=0):
    rng = np.random.default_rng(seed)
    shape = (1,) * (4 - len(ne)) + tuple(reversed(ne))
    if type_ == T.Q8_0:
        x = rng.standard_normal(shape[:-1] + (ne[0],)).astype(np.float32)
        return np.asarray(quantize(x.reshape(-1, ne[0]), T.Q8_0)).reshape(shape[:-1] + (-1,))
    if type_ in (T.I32, T.I64):
        return rng.integers(-1000, 1000, shape)
    return rng.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("where", ["host", "dev0"])
@pytest.mark.parametrize("type_", [T.F32, T.F16, T.I32, T.Q8_0])
def test_set_get_round_trip(where, type_):
    ne = (64, 3, 2)
    t = placed(BUFTS[where], type_, ne)
    v = values(type_, ne)
    tensor_set(t, v)
    assert tensor_get(t).shape == v.shape
    assert same(t, v.astype(np.float16) if type_ == T.F16 else v)
    # the bytes outside the tensor are untouched
    buf = t.buffer
    assert tensor_get_bytes(t).size == t.nbytes
    if where == "host":
        assert not buf.data[:32].any() and not buf.data[32 + t.nbytes:].any()
    else:
        assert not any(buf._mem[:32]) and not any(buf._mem[32 + t.nbytes:])


@pytest.mark.parametrize("where", ["host", "dev0"])
def test_strided_views_read_and_write_their_elements_only(where):
    t = placed(BUFTS[where], T.F32, (8, 6, 2))
    base = np.arange(96, dtype=np.float32).reshape(2, 6, 8)
    tensor_set(t, base)
    v = ops.view_3d(t, 8, 3, 2, t.nb[1], t.nb[2], t.nb[1])      # rows 1..3 of each of the two planes
    p = ops.permute(t, 1, 0, 2, 3)                               # a transposed view
    assert same(v, base[:, 1:4, :])
    assert same(p, np.swapaxes(base, 1, 2))
    tensor_set(v, -np.ones((2, 3, 8), np.float32))
    want = base.copy()
    want[:, 1:4, :] = -1
    assert same(t, want)


def test_tensor_data_only_for_host_memory():
    h, d = placed(HOST, T.F32, (4,)), placed(DEV0, T.F32, (4,))
    tensor_data(h)[...] = 1
    assert same(h, np.ones(4))
    with pytest.raises(TypeError, match="not host memory"):
        tensor_data(d)
    with pytest.raises(ValueError, match="no storage"):
        tensor_get(Tensor(T.F32, (4,)))


@pytest.mark.parametrize("src_at,dst_at", [("host", "host"), ("host", "dev0"), ("dev0", "host"), ("dev0", "dev0"),
                                           ("dev0", "dev1")])
@pytest.mark.parametrize("type_", [T.F32, T.Q8_0])
def test_copy_across_memories(src_at, dst_at, type_):
    ne = (32, 5)
    src, dst = placed(BUFTS[src_at], type_, ne, "src"), placed(BUFTS[dst_at], type_, ne, "dst")
    v = values(type_, ne, seed=3)
    tensor_set(src, v)
    tensor_copy(src, dst)
    if (src_at, dst_at) == ("dev0", "dev0"):
        assert dst.buffer.n_device_copies == 1 and src.buffer.n_reads == 0      # directly, on the device
    if (src_at, dst_at) == ("dev0", "dev1"):
        assert dst.buffer.n_device_copies == 0 and src.buffer.n_reads == 1      # through host memory
    assert np.array_equal(tensor_get(dst), tensor_get(src))


def test_copy_of_a_strided_device_view_into_another_device():
    src = placed(DEV0, T.F32, (8, 4))
    base = np.arange(32, dtype=np.float32).reshape(4, 8)
    tensor_set(src, base)
    view = ops.transpose(src)                               # [4, 8], not contiguous
    dst = placed(DEV1, T.F32, (4, 8))
    tensor_copy(view, dst)
    assert same(dst, base.T)
    with pytest.raises(ValueError, match="differ"):
        tensor_copy(src, dst)


@pytest.mark.parametrize("where", ["host", "dev0"])
def test_memset_and_clear(where):
    t = placed(BUFTS[where], T.F32, (16, 2))
    tensor_set(t, np.ones((2, 16), np.float32))
    tensor_memset(t, 0, offset=16 * 4)                      # the second row only
    got = tensor_get(t)[0, 0]
    assert (got[0] == 1).all() and (got[1] == 0).all()
    tensor_memset(t, 0xFF)
    assert np.isnan(tensor_get(t)).all()
    t.buffer.clear(0)
    assert not tensor_get(t).any()
    with pytest.raises(ValueError, match="not contiguous"):
        tensor_memset(ops.transpose(t), 0)


@pytest.mark.parametrize("where", ["host", "dev0"])
def test_bytes_with_offsets_and_bounds(where):
    t = placed(BUFTS[where], T.I32, (8,))
    tensor_set(t, np.arange(8))
    tensor_set_bytes(t, np.array([100, 101], np.int32), offset=3 * 4)
    assert same(t, [0, 1, 2, 100, 101, 5, 6, 7])
    assert list(tensor_get_bytes(t, 4 * 4, 2 * 4).view(np.int32)) == [101, 5]
    with pytest.raises(ValueError, match="outside"):
        tensor_set_bytes(t, np.zeros(3, np.int32), offset=6 * 4)
    with pytest.raises(ValueError, match="outside"):
        tensor_get_bytes(t, 4, 8 * 4)
    other = placed(BUFTS[where], T.I32, (8,))
    with pytest.raises(ValueError, match="is not in"):
        t.buffer.get_tensor(other)


def test_buffer_from_host_wraps_host_memory_and_copies_into_a_device():
    data = np.arange(64, dtype=np.uint8)
    hb = HOST.buffer_from_host(data)
    assert isinstance(hb, HostBuffer) and np.shares_memory(hb.data, data) and hb.usage == BufferUsage.WEIGHTS
    db = DEV0.buffer_from_host(data)
    assert isinstance(db, DeviceBuffer) and bytes(db._mem) == data.tobytes()
    t = Tensor(T.U8 if hasattr(T, "U8") else T.I8, (64,))
    tensor_alloc(db, t, 0)
    assert np.array_equal(tensor_get_bytes(t), data)


def test_buffer_types_report_alignment_and_max_size():
    assert HOST.get_alignment() == 64 and HOST.is_host and HOST.get_max_size() >= 2 ** 62
    bt = BufferType("small", "small", alignment=256, max_size=4096)
    assert bt.get_alignment() == 256 and bt.get_max_size() == 4096
    assert not DEV0.is_host and not DEV0.alloc_buffer(8).is_host
    with pytest.raises(NotImplementedError):
        BufferType("gpu", "gpu", is_host=False).alloc_buffer(8)


def test_allocator_poisons_device_memory_through_the_interface():
    x = Tensor(T.F32, (8,), name="x").set_input()
    y = ops.scale(x, 2.0)
    z = ops.sum_rows(y).set_output()                 # not in place: y's memory is freed after it
    al = GraphAllocator(DEV0, debug=True)
    p = al.alloc_graph([y, z], [x])
    tensor_set(y, np.ones(8, np.float32))
    al.poison_after(1, p)
    assert isinstance(al.buffer, DeviceBuffer)
    assert np.isnan(tensor_get(y)).all()             # y died at z: its bytes are poisoned
    assert not np.isnan(tensor_get(x)).any()         # x is an input: kept


class _DeviceCache(Backend):
    """Just memory: a backend whose buffer type is device memory with a large alignment and a small largest size."""
    name = "devcache"

    def __init__(self, alignment, max_size):
        super().__init__("devcache")
        self._buft = DeviceBufferType("devcache", "devcache", alignment)
        self._buft.max_size = max_size


def test_kv_cache_takes_alignment_and_size_limit_from_the_buffer_type():
    from types import SimpleNamespace
    from llampy.llama.kv_cache import KVCache
    hp = SimpleNamespace(n_layer=3, n_embd_head_k=8, n_embd_head_v=8, n_head_kv=lambda il: 1,
                         is_recurrent=lambda il: False, has_kv=lambda il: True, v_in_k=False,
                         kv_source=lambda il: il)
    be = _DeviceCache(alignment=1000, max_size=3000)
    kv = KVCache(hp, 10, 1, [be] * 3)                  # each K or V: 8 x 10 x F16 = 160 bytes
    offs = [t.offs for t in kv.k + kv.v]
    assert all(o % 1000 == 0 for o in offs)
    assert len(kv.buffers) == 2 and all(b.size <= 3000 for b in kv.buffers)
    assert all(isinstance(b, DeviceBuffer) for b in kv.buffers)
    for t in kv.k:
        tensor_set(t, np.ones(t.ne[::-1], np.float16))
    kv.clear()                                          # cells only
    assert all((tensor_get(t) == 1).all() for t in kv.k)
    kv.clear(data=True)
    assert not any(tensor_get(t).any() for t in kv.k)
