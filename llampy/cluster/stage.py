"""Pipeline stages: Ray actors holding a remote backend's memory (llampy/ggml/backends/remote.py) on other nodes.

A stage opens its own copy of the model file at the same path, checked against the driver's sha256, and reads its
layers' weights from it; nothing but a split's inputs and outputs crosses. A pipelined replica's stages run in the
bundles of its placement group (STRICT_SPREAD: one node each); the replica keeps the first share of the layers,
the stages the rest and the output head (n_gpu_layers-style placement over K - 1 remote devices).
"""
from __future__ import annotations

import hashlib
import os
import socket


class StageError(RuntimeError):
    pass


def file_sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def check_model_file(path, sha256: str | None) -> None:
    """Raise StageError naming this node and the path when the file is missing or is another one."""
    node = socket.gethostname()
    if not os.path.isfile(path):
        raise StageError(f"node {node}: the model file {path} is missing (each node needs its own copy)")
    if sha256 and file_sha256(path) != sha256:
        raise StageError(f"node {node}: {path} has another sha256 than the driver's copy ({sha256[:12]}...)")


class Stage:
    """The actor: a StageExecutor over a CPU backend and this node's copy of the model."""

    def __init__(self, path: str, sha256: str | None, n_threads: int | None = None):
        import numpy as np
        from ..ggml.backends.cpu.backend import CPUBackend
        from ..ggml.backends.remote import StageExecutor
        from ..gguf.split import open_gguf
        from .. import tuning
        check_model_file(path, sha256)
        tuning.install()
        self.reader = open_gguf(path)
        self.exec = StageExecutor(CPUBackend(n_threads=n_threads),
                                  lambda name: self.reader.tensors[name].data.reshape(-1).view(np.uint8))

    def apply(self, ops: list) -> list:
        return self.exec.apply(ops)

    def node(self) -> str:
        return socket.gethostname()

    def ping(self) -> bool:
        return True


class StageRef:
    """The replica's view of one stage: its actor and the transport its RemoteBackend calls."""

    def __init__(self, actor, timeout: float = 120.0):
        self.actor, self.timeout = actor, timeout

    def __call__(self, ops: list) -> list:
        import ray
        return ray.get(self.actor.apply.remote(ops), timeout=self.timeout)

    def check(self) -> None:
        import ray
        ray.get(self.actor.ping.remote(), timeout=10)


def pipeline_layers(path, k: int) -> int:
    """The layers (plus the output head) the K - 1 stages hold: all but the replica's first n_layer // k."""
    from ..gguf.split import open_gguf
    r = open_gguf(path)
    try:
        md = r.metadata
        n_layer = int(md[f"{md['general.architecture']}.block_count"])
    finally:
        r.close()
    return n_layer + 1 - n_layer // k


def start_stages(path, k: int, sha256: str | None, n_threads: int | None = None, timeout: float = 60.0):
    """K - 1 stage actors in bundles 1..K-1 of the caller's placement group (anywhere when it has none); returns
    Model's offload keywords (the remote devices and how many layers they take) and the StageRefs."""
    import ray
    from ray.util.placement_group import get_current_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    from ..ggml.backends.remote import RemoteBackend
    pg = get_current_placement_group()
    cls = ray.remote(num_cpus=1, max_restarts=0)(Stage)
    actors = []
    for i in range(1, k):
        opts = {}
        if pg is not None:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(placement_group=pg,
                                                                           placement_group_bundle_index=i)
        actors.append(cls.options(**opts).remote(path, sha256, n_threads))
    try:
        ray.get([a.ping.remote() for a in actors], timeout=timeout)
    except ray.exceptions.RayActorError as e:       # the stage's own check (StageError) says which node and path
        raise StageError(str(getattr(e, "cause", None) or e).splitlines()[-1]) from None
    refs = [StageRef(a) for a in actors]
    devices = [RemoteBackend(r, device=f"remote:{i}") for i, r in enumerate(refs, 1)]
    return {"devices": devices, "n_gpu_layers": pipeline_layers(path, k)}, refs
