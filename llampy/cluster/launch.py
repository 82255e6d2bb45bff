"""deploy() (llampy.cluster.deploy): the ingress and replica deployments on a Ray cluster (an existing one, or a
local one for trying it out), behind Serve's HTTP proxy on the head node."""
from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

NAMESPACE = "llampy"
ROUTERS = ("prefix", "pow2")


class RayMissing(RuntimeError):
    pass


class ClusterError(RuntimeError):
    """A deployment that cannot be made: an unreachable address, resources that cannot be placed, a bad option."""


def require_ray():
    """Raise RayMissing unless Ray Serve is installed; looks for it without importing it (seconds)."""
    import importlib.util
    try:
        found = all(importlib.util.find_spec(m) is not None for m in ("ray", "ray.serve"))
    except (ImportError, ValueError):
        found = False
    if not found:
        raise RayMissing("llampy cluster needs Ray Serve, which is not installed: install llampy[ray] "
                         "(pip install 'llampy[ray]')")


def check_address(address: str | None) -> None:
    """A HOST:PORT that answers, before ray.init (which retries an unreachable head for a minute)."""
    if not address or address.startswith("local:"):
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ClusterError(f"--address {address!r}: expected HOST:PORT of the Ray head, or local:N")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as e:
        raise ClusterError(f"cannot reach the Ray head at {address}: {e}") from None


@dataclass
class Deployment:
    url: str
    handle: object                      # the ingress's DeploymentHandle
    name: str
    local_cluster: object = None        # ray.cluster_utils.Cluster when address was local:N
    info: dict = field(default_factory=dict)

    def shutdown(self) -> None:
        import ray
        from ray import serve
        serve.delete(self.name)
        if self.local_cluster is not None:
            serve.shutdown()
            ray.shutdown()
            self.local_cluster.shutdown()


# Serve's controller restarts a proxy that is not ready within 5 s (then 10 s, 15 s: it counts as a failed health
# check, 3 in a row) or misses health checks of 10 s: on a loaded machine a local cluster's proxy took longer to start
# and was killed again and again (Serve's controller log). The local cluster's nodes get longer ones (the user's
# environment wins). Ray starts its workers 15 nice levels below the raylet: on a machine that runs anything else, the
# replicas, the ingress and its template renderer (another 10 below) starved, and from nice 5 up they all sat at 19;
# a local cluster's workers run at the caller's priority instead, as one server does.
LOCAL_NODE_ENV = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "30",
                  "RAY_worker_niceness": "0"}
START_TRIES = 3


def _started(start, what: str):
    """``start()``, which starts a Ray node, tried again when the node did not register in time: Ray gives it 30 s
    (hard-coded in ray/_private/node.py), which a loaded machine can miss. The half-started node's processes are
    stopped first (the Node is the frame's ``self`` in the exception's traceback: Ray hands back no handle)."""
    import logging
    from ray._private.node import Node
    for attempt in range(START_TRIES):
        try:
            return start()
        except Exception as e:
            if "timed out during startup" not in str(e) or attempt == START_TRIES - 1:
                raise
            tb, node = e.__traceback__, None
            while tb is not None and node is None:
                node = tb.tb_frame.f_locals.get("self")
                node = node if isinstance(node, Node) else None
                tb = tb.tb_next
            if node is not None:
                node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)
            logging.getLogger("llampy.cluster").warning("the %s did not register within Ray's 30 s; starting it "
                                                        "again (%d of %d)", what, attempt + 2, START_TRIES)


def add_worker(c, cpus: int = 1, wait: bool = True):
    """A worker node of ``cpus`` CPUs on 127.0.0.1 added to the local cluster ``c``."""
    env = {k: os.environ.get(k, v) for k, v in LOCAL_NODE_ENV.items()}
    return _started(lambda: c.add_node(wait=wait, num_cpus=cpus, node_ip_address="127.0.0.1", env_vars=env),
                    "worker node")


def start_local(n_nodes: int, cpus_per_node: int = 1):
    """A local cluster: a head with no CPUs (Serve's controller and proxy) and ``n_nodes`` worker nodes, on
    127.0.0.1, without the dashboard."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray.cluster_utils import Cluster
    if n_nodes < 1:
        raise ClusterError(f"local:{n_nodes}: a local cluster needs at least one worker node")
    env = {k: os.environ.get(k, v) for k, v in LOCAL_NODE_ENV.items()}
    c = _started(lambda: Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False, "node_ip_address": "127.0.0.1", "env_vars": env}), "head node")
    try:
        for _ in range(n_nodes):        # each start waits for its node to register; then all are waited for
            add_worker(c, cpus_per_node, wait=False)
        c.wait_for_nodes(timeout=120)
        ray.init(address=c.address, namespace=NAMESPACE, logging_level="warning", log_to_driver=False)
    except BaseException:
        c.shutdown()
        raise
    return c


def connect(address: str | None, cpus_per_node: int = 1):
    """Connect this process to the cluster at ``address`` (HOST:PORT of its head, local:N, or None: the one this
    process is already connected to, else Ray's default). Returns the local Cluster, if one was started."""
    require_ray()
    import ray
    if address and address.startswith("local:"):
        try:
            n = int(address[6:])
        except ValueError:
            raise ClusterError(f"--address {address!r}: expected local:N (N worker nodes)") from None
        return start_local(n, cpus_per_node)
    if ray.is_initialized():
        return None
    check_address(address)
    ray.init(address=address or "auto", namespace=NAMESPACE, logging_level="warning", log_to_driver=False)
    return None


def deploy(model=None, replicas: int = 1, parallel: int = 4, router: str = "prefix", pipeline: int = 1,
           address: str | None = None, port: int = 8080, host: str = "127.0.0.1", ctx_size: int = 4096,
           threads: int | None = 1, min_replicas: int | None = None, max_replicas: int | None = None,
           idle_timeout: float = 20.0, name: str = "llampy", api_key: str | None = None,
           alias: str | None = None, cpus_per_node: int = 1, place_timeout: float = 60.0,
           autoscaling: dict | None = None) -> Deployment:
    """Deploy ``model`` (a GGUF path, or 'smollm2' / 'gemma3') as ``replicas`` replicas of ``parallel`` slots each
    behind one ingress; returns the URL and the ingress's handle. ``router``: 'prefix' (llampy/cluster/router.py)
    or 'pow2' (Serve's default). ``pipeline`` K: each replica's layers over K nodes (K - 1 stage actors).
    ``min_replicas``/``max_replicas``: autoscaling instead of a fixed count; ``autoscaling``: keys of Serve's
    autoscaling_config over llampy's defaults (its delays, look_back_period_s, ...). Every node holds the model file at the
    same path (checked by sha256)."""
    require_ray()
    if router not in ROUTERS:
        raise ClusterError(f"router must be one of {', '.join(ROUTERS)}, got {router!r}")
    if pipeline < 1 or replicas < 1 or parallel < 1:
        raise ClusterError("replicas, parallel and pipeline must be at least 1")
    if (min_replicas is None) != (max_replicas is None):
        raise ClusterError("give both min_replicas and max_replicas, or neither")
    if min_replicas is not None and not 0 < min_replicas <= max_replicas:
        raise ClusterError(f"need 0 < min_replicas <= max_replicas, got {min_replicas} and {max_replicas}")
    if autoscaling and min_replicas is None:
        raise ClusterError("autoscaling settings need min_replicas and max_replicas")
    if ctx_size // parallel < 8:
        raise ClusterError(f"parallel {parallel} and ctx_size {ctx_size} leave no room per slot")
    check_address(address)
    from ..models import resolve_model
    path = str(Path(resolve_model(model)).resolve())
    local = connect(address, cpus_per_node)
    try:
        return _deploy(path, replicas, parallel, router, pipeline, port, host, ctx_size, threads, min_replicas,
                       max_replicas, idle_timeout, name, api_key, alias, place_timeout, local, autoscaling)
    except BaseException:
        if local is not None:
            import ray
            ray.shutdown()
            local.shutdown()
        raise


def _deploy(path, replicas, parallel, router, pipeline, port, host, ctx_size, threads, min_replicas, max_replicas,
            idle_timeout, name, api_key, alias, place_timeout, local, autoscaling=None) -> Deployment:
    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig
    from .board import Board
    from .ingress import Ingress
    from .replica import Replica
    from .stage import file_sha256
    cpus = 1
    need = (min_replicas or replicas) * pipeline * cpus
    have = ray.cluster_resources().get("CPU", 0)
    if need > have:
        raise ClusterError(f"{min_replicas or replicas} replica(s) x {pipeline} stage(s) need {need} CPUs; the "
                           f"cluster has {have:g}")
    if pipeline > 1:
        nodes = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) >= cpus]
        if len(nodes) < pipeline:
            raise ClusterError(f"--pipeline {pipeline} needs {pipeline} nodes with {cpus} CPU each; the cluster "
                               f"has {len(nodes)}")
    sha = file_sha256(path)
    board = f"{name}-board"
    # the board and the ingress stay on the head, beside Serve's controller and proxy: losing a worker node loses
    # replicas only
    head = {"node:__internal_head__": 0.001}
    Board_ = ray.remote(num_cpus=0, max_restarts=-1, resources=head)(Board)
    try:
        ray.get_actor(board)
    except ValueError:
        Board_.options(name=board, lifetime="detached").remote()
    serve.start(http_options={"host": host, "port": port}, proxy_location="HeadOnly")
    scaling = {"num_replicas": replicas}
    if min_replicas is not None:
        scaling = {"autoscaling_config": {"min_replicas": min_replicas, "max_replicas": max_replicas,
                                          "target_ongoing_requests": max(1, parallel // 2),
                                          "upscale_delay_s": 2, "downscale_delay_s": 10, **(autoscaling or {})}}
    opts = dict(name="replica", max_ongoing_requests=parallel * 2, health_check_period_s=2,
                health_check_timeout_s=30, graceful_shutdown_timeout_s=5, ray_actor_options={"num_cpus": cpus},
                **scaling)
    if pipeline > 1:
        opts.update(placement_group_bundles=[{"CPU": cpus}] * pipeline, placement_group_strategy="STRICT_SPREAD")
        opts["ray_actor_options"] = {"num_cpus": 0}     # the replica runs in bundle 0, its stages in the others
    if router == "prefix":
        from .router import PrefixRouter
        opts["request_router_config"] = RequestRouterConfig(request_router_class=PrefixRouter)
    replica = serve.deployment(**opts)(Replica).bind(path, parallel, ctx_size, threads, pipeline, sha, board)
    ingress_cls = serve.deployment(name="ingress", max_ongoing_requests=10000,
                                   ray_actor_options={"num_cpus": 0, "resources": head})(serve.ingress()(Ingress))
    app = ingress_cls.bind(path, replica, board, parallel, ctx_size, idle_timeout, api_key, alias)
    t0 = time.monotonic()
    handle = _run_within(serve, app, name, place_timeout)
    return Deployment(f"http://{host}:{port}", handle, name, local,
                      {"model": path, "sha256": sha, "seconds": time.monotonic() - t0})


def _run_within(serve, app, name: str, timeout: float):
    """serve.run, but an application that is not coming up (replicas that cannot be placed, a replica whose
    constructor fails) is deleted and reported after ``timeout`` seconds, not waited for. One whose deployments are
    all being started or healthy (a slow machine) is waited for, up to 5 x ``timeout``."""
    import threading
    out: dict = {}

    def run():
        try:
            out["handle"] = serve.run(app, name=name, route_prefix="/")
        except BaseException as e:      # a constructor's error (a stage's missing file) comes back here
            out["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t0, status = time.monotonic(), ""
    while t.is_alive() and time.monotonic() - t0 < 5 * timeout:
        t.join(1.0)
        if not t.is_alive() or time.monotonic() - t0 < timeout:
            continue
        try:
            st = serve.status().applications.get(name)
            deps = st.deployments.items() if st is not None else ()
        except Exception:
            deps = ()
        status = "; ".join(f"{d}: {s.status.value} {s.message}".strip() for d, s in deps)
        # waiting for resources, or failing: give up; starting on a slow machine: wait on
        if any(s.status.value in ("UNHEALTHY", "DEPLOY_FAILED") or "resources" in (s.message or "")
               for _, s in deps):
            break
    if "handle" in out:
        return out["handle"]
    if "error" not in out:
        serve.delete(name, _blocking=False)
    err = out.get("error")
    msg = str(err).strip().splitlines()[-1] if err is not None else \
        f"not running after {time.monotonic() - t0:.0f} s"
    raise ClusterError(f"the deployment failed: {msg}" + (f" ({status})" if status and err is None else ""))
