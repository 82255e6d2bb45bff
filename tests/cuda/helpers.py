"""Leaves in device memory for the CUDA backend's tests: the same values as tests/ggml/helpers.leaf places in host
memory (the same random stream), written through the buffer interface."""
from __future__ import annotations

from llampy.ggml.backend import backend_init, tensor_alloc, tensor_get_bytes, tensor_set_bytes
from llampy.ggml.tensor import Tensor

from tests.ggml.helpers import leaf as host_leaf

REF = backend_init("reference")


def device_leaf(backend, type, shape_np, value=None, rng=None) -> Tensor:
    h = host_leaf(REF, type, shape_np, value, rng)
    t = Tensor(type, h.ne)
    tensor_alloc(backend.alloc_buffer(max(t.nbytes, 1)), t, 0)
    tensor_set_bytes(t, tensor_get_bytes(h))
    return t


def count_launches(monkeypatch, module, name: str) -> list:
    """Record the grid of every launch of the Triton kernel ``module.name`` (it still runs): a list to read after."""
    calls, real = [], getattr(module, name)

    class Counted:
        def __getitem__(self, grid):
            calls.append(grid)
            return real[grid]
    monkeypatch.setattr(module, name, Counted())
    return calls
