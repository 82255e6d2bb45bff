"""Which accelerators a model offloads to, and how many layers fit (llama.cpp's -ngl, -sm, -ts, -mg, -ot, and its
automatic fit).

``n_gpu_layers``: an int N (the last N repeating layers, and the output head when N > n_layer; -1: all of them),
or ``"auto"`` (as many as fit in free device memory beside the KV cache and compute buffers; all of them when no
GPU is there is never asked). Without a GPU, or without the ``cuda`` extra, a request for layers says so in one
line and the model runs on the CPU (``strict=True``: it stops instead) — never silently.
"""
from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass

AUTO = "auto"
COMPUTE_RESERVE = 1 << 30        # bytes kept free per device for compute buffers, CUDA graphs and the allocator


class OffloadError(ValueError):
    """A bad offload request: an -ngl/-ts/-ot value that does not parse, a GPU that does not exist, or (with
    strict offloading) layers asked for where there is no GPU."""


def parse_n_gpu_layers(v) -> int | str:
    """-ngl's value: an int, 'auto', or 'all' (= -1)."""
    if v is None:
        return 0
    if isinstance(v, int):
        return v
    s = str(v).strip().lower()
    if s == AUTO:
        return AUTO
    if s in ("all", "max"):
        return -1
    try:
        return int(s)
    except ValueError:
        raise OffloadError(f"n_gpu_layers must be an integer, 'auto' or 'all', got {v!r}") from None


def parse_override_tensor(spec) -> list[tuple[re.Pattern, str]]:
    """-ot's value: 'REGEX=BUFTYPE[,REGEX=BUFTYPE...]' (BUFTYPE: CPU, CUDA0, CUDA1, ...), or a list of them."""
    if not spec:
        return []
    items = spec if isinstance(spec, (list, tuple)) else [spec]
    out = []
    for item in items:
        for part in str(item).split(","):
            if not part.strip():
                continue
            pat, sep, where = part.rpartition("=")
            if not sep or not pat:
                raise OffloadError(f"--override-tensor: expected REGEX=BUFTYPE, got {part!r}")
            where = where.strip().upper()
            if where != "CPU" and not re.fullmatch(r"CUDA\d+", where):
                raise OffloadError(f"--override-tensor: unknown buffer type {where!r} (CPU, CUDA0, CUDA1, ...)")
            try:
                out.append((re.compile(pat), where))
            except re.error as e:
                raise OffloadError(f"--override-tensor: bad pattern {pat!r}: {e}") from None
    return out


def _gpu_present() -> bool:
    """A cheap look for an NVIDIA GPU before importing torch (or the Triton interpreter, for tests)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia/version")


def gpu_backends(main_gpu: int = 0, split_mode: str = "layer"):
    """(the accelerator backends to use, why there are none). split_mode 'none' uses main_gpu alone."""
    if not _gpu_present():
        return [], "no NVIDIA GPU was found"
    from ..ggml.backend import BackendUnavailable, backend_init
    try:
        from ..ggml.backends import cuda   # noqa: F401  (needs torch and triton)
    except ImportError as e:
        return [], f"the cuda backend needs torch and triton (pip install 'llampy[cuda]'): {e}"
    try:
        n = cuda.device_count()
        if n == 0:
            return [], "torch sees no CUDA device"
        if not 0 <= main_gpu < n:
            raise OffloadError(f"main_gpu {main_gpu} does not exist ({n} CUDA devices)")
        ids = [main_gpu] if split_mode == "none" else list(range(n))
        return [backend_init("cuda", device=i) for i in ids], ""
    except (BackendUnavailable, RuntimeError) as e:
        if isinstance(e, OffloadError):
            raise
        return [], str(e)


@dataclass
class FitReport:
    n_gpu_layers: int
    layer_bytes: int
    free_bytes: int


def fit_layers(reader, n_layer: int, kv_bytes_per_layer: int, free_bytes: int) -> FitReport:
    """How many of the last layers (and the output head, counted as layer n_layer) fit in ``free_bytes`` beside
    their KV cache and a reserve for compute buffers, as llama.cpp's automatic fit does."""
    per = [0] * (n_layer + 1)
    for name, info in reader.tensors.items():
        m = re.match(r"blk\.(\d+)\.", name)
        if m and int(m.group(1)) < n_layer:
            per[int(m.group(1))] += info.nbytes
        elif name.startswith("output.") or (name == "token_embd.weight" and "output.weight" not in reader.tensors):
            per[n_layer] += info.nbytes
    for il in range(n_layer):
        per[il] += kv_bytes_per_layer
    budget = free_bytes - COMPUTE_RESERVE
    n, used = 0, 0
    for il in range(n_layer, -1, -1):          # from the output head down: llama.cpp offloads the last layers
        if used + per[il] > budget:
            break
        used += per[il]
        n += 1
    return FitReport(n, used, free_bytes)


def warn_no_gpu(n_gpu_layers, reason: str, strict: bool) -> None:
    msg = f"n_gpu_layers={n_gpu_layers} cannot offload: {reason}; every layer runs on the CPU"
    if strict:
        raise OffloadError(msg.replace("; every layer runs on the CPU", ""))
    warnings.warn(msg, RuntimeWarning, stacklevel=4)
