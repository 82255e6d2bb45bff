"""The first prompt's kernels compiled on two cores instead of one (a cold start: an empty kernel cache).

Numba compiles one function at a time per process (a global lock), and each quantized matmul kernel takes
seconds. When the cache lacks the kernels of a model's weight formats, ``start`` runs a helper process that
evaluates the same batch on the same model with the plan's calls in reverse order: it compiles, and writes to
the shared cache, the kernels the main process needs last, while the main process compiles the ones it needs
first. When the main process reaches a kernel the helper has saved, Numba loads it from the cache. Its outputs
are garbage (the calls run out of order on uninitialised buffers; the graph's index inputs are set as for a real
batch, so every access stays in bounds) and nothing is read back.

This module holds the backend's side (is the cache cold, run plans reversed, start and end the helper); the
helper itself, which builds a context, is ``llampy.llama.warm``. It runs one thread, exits when its batches are
done, and also when its parent goes (its stdin closes). Measured (``llampy run`` to the first token, empty
cache): benchmarks/README.md, entry 35. ``LLAMPY_NO_WARM_HELPER=1`` turns it off.
"""
from __future__ import annotations

import atexit
import os
import subprocess
import threading

_helpers: list = []


def _kernels(t):
    """The decode kernels of weight format t (GGMLType): any of them cached means the format was compiled."""
    from ...types import GGMLType as T
    from . import qdot, qdot_ks
    return {T.Q4_0: [qdot._rest_q4_0], T.Q4_1: [qdot._rest_q4_1], T.Q5_0: [qdot._rest_q5_0],
            T.Q5_1: [qdot._rest_q5_1], T.Q8_0: [qdot._rest_q8_0], T.Q4_K: [qdot_ks.mv_q4_k_x8, qdot_ks._q4_k],
            T.Q5_K: [qdot_ks._q5_k], T.Q6_K: [qdot_ks._q6_k]}.get(t, [])


def _cached(disp) -> bool:
    try:
        return os.path.exists(disp._cache._cache_file._index_path)
    except AttributeError:        # a Numba without this layout: assume cached (no helper)
        return True


def cold(weight_types) -> bool:
    """Whether the kernel cache lacks the matmul kernels of any of these weight formats."""
    return any(ks and not any(_cached(k) for k in ks) for ks in map(_kernels, set(weight_types)))


def spawn(argv: list[str]):
    """Start a helper process running ``argv`` (see the module doc) with one Numba thread; returns its Popen, or
    None. It is killed when this process exits, and should call ``leave_with_parent`` itself."""
    if os.environ.get("LLAMPY_NO_WARM_HELPER") == "1":
        return None
    env = dict(os.environ, NUMBA_NUM_THREADS="1", LLAMPY_NO_WARM_HELPER="1")
    try:
        p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env=env)
    except OSError:
        return None
    _helpers.append(p)
    return p


@atexit.register
def _stop_helpers() -> None:
    for p in _helpers:
        if p.poll() is None:
            p.kill()
            p.wait()


def leave_with_parent() -> None:
    """In a helper: exit as soon as stdin closes (the parent has gone, however it ended)."""
    def watch():
        try:
            while os.read(0, 4096):      # the raw descriptor: a buffered stdin's lock would stop shutdown
                pass
        except OSError:
            pass
        os._exit(0)
    threading.Thread(target=watch, daemon=True).start()


def reverse_plans() -> None:
    """In a helper: this process's cpu plans run their calls last to first."""
    from .backend import CPUBackend

    def reversed_compute(self, plan):
        for c in reversed(plan.calls):
            c()
    CPUBackend.graph_plan_compute = reversed_compute
