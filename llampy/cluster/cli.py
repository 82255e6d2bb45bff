"""`llampy cluster serve`: the OpenAI-compatible server over replicas on a Ray cluster (llampy/cluster/deploy.py).
Options may also come from a config file (JSON or TOML) whose keys are deploy()'s keywords; flags override it."""
from __future__ import annotations

import sys

KEYS = ("replicas", "min_replicas", "max_replicas", "parallel", "ctx_size", "router", "pipeline", "address", "port",
        "host", "threads", "idle_timeout", "api_key", "alias", "model")


def add_cluster_parser(sub) -> None:
    p = sub.add_parser("cluster", help="serve a model from replicas on a Ray cluster (needs llampy[ray])")
    csub = p.add_subparsers(dest="cluster_command", required=True)
    s = csub.add_parser("serve", help="replicas behind one OpenAI-compatible ingress, with failover")
    s.add_argument("model", nargs="?", default=None, help="GGUF path (the same on every node), or 'smollm2'")
    s.add_argument("--config", default=None, help="a JSON or TOML file of these options (deploy()'s keywords)")
    s.add_argument("--replicas", type=int, default=None, help="replicas of the model (default 1)")
    s.add_argument("--min-replicas", type=int, default=None, help="autoscaling: fewest replicas")
    s.add_argument("--max-replicas", type=int, default=None, help="autoscaling: most replicas")
    s.add_argument("--parallel", "-np", type=int, default=None, help="slots per replica (default 4)")
    s.add_argument("--ctx-size", "-c", type=int, default=None, help="KV cells per replica (default 4096)")
    s.add_argument("--router", choices=("prefix", "pow2"), default=None,
                   help="prefix: the replica holding the prompt's longest cached prefix (default); pow2: Serve's "
                        "power-of-two choices")
    s.add_argument("--pipeline", type=int, default=None, help="K: each replica's layers over K nodes (default 1)")
    s.add_argument("--address", default=None,
                   help="HOST:PORT of the Ray head, or local:N to start a local cluster of N worker nodes")
    s.add_argument("--host", default=None, help="address Serve's HTTP proxy binds (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=None, help="HTTP port (default 8080)")
    s.add_argument("-t", "--threads", type=int, default=None, help="kernel threads per replica (default 1)")
    s.add_argument("--idle-timeout", type=float, default=None,
                   help="seconds a stream may go without a token before it moves to another replica (default 20)")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    s.add_argument("--alias", default=None, help="the model name reported to clients")
    s.set_defaults(func=cmd_cluster)


def load_config(path) -> dict:
    import json
    from pathlib import Path
    text = Path(path).read_text()
    if str(path).endswith(".toml"):
        import tomllib
        cfg = tomllib.loads(text)
    else:
        cfg = json.loads(text)
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a table of options")
    bad = sorted(set(cfg) - set(KEYS))
    if bad:
        raise ValueError(f"{path}: unknown option(s) {', '.join(bad)}; known: {', '.join(KEYS)}")
    return cfg


def cmd_cluster(args) -> int:
    from .launch import ClusterError, RayMissing, require_ray
    try:
        require_ray()
    except RayMissing as e:
        print(f"llampy cluster: {e}", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config) if args.config else {}
    except (OSError, ValueError) as e:
        print(f"llampy cluster: --config: {e}", file=sys.stderr)
        return 2
    for k in KEYS:
        v = getattr(args, k, None)
        if v is not None:
            cfg[k] = v
    model = cfg.pop("model", None)
    from . import deploy
    try:
        d = deploy(model, **cfg)
    except ClusterError as e:
        print(f"llampy cluster: {e}", file=sys.stderr)
        return 2
    print(f"llampy: serving on {d.url} (ray cluster; Ctrl-C stops it)", flush=True)
    import signal
    import threading
    stop = threading.Event()
    old = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        stop.wait()
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
        d.shutdown()
    print("llampy: stopped", file=sys.stderr, flush=True)
    return 0
