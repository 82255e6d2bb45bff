"""llampy.cluster's costs on a local Ray cluster (head without CPUs + 2 worker nodes of one CPU, 127.0.0.1): the
issue's figures, printed as one JSON object.

  router_p50_ms        p50 latency of a 1-token completion through the ingress, prefix router and Serve's pow2
  router_choose_us     the prefix router's own decision (block keys of a 2000-token prompt + the lookup), in-process
  stream_ms_per_token  streaming cost per token: wall time between a stream's first and last token minus the
                       engine's own generation time (llama-server's timings), over the tokens
  resume_s             a stream's break (SIGKILL of its replica) to its next token from another replica
  resume_s_node_lost   the same when the replica's worker node is removed at once (its raylet and workers killed);
                       the per-stream idle timeout is IDLE_S
  handoff_ms           one round trip actor -> stage actor on another node carrying N KB (a split's hidden state)
  pipeline_ms_per_token  SmolLM2 decode per token, one process vs second half in a stage on another node
  *_pss_mib            memory (PSS) of the cluster's processes: idle, then with Serve and 2 replicas of the tiny
                       model (its weights are 13 MiB; the rest is Ray, Serve and llampy's Python)
  throughput           generated tokens/s through the ingress with 1 replica, then with N (one per node with a
                       CPU), each replica under 2 x parallel clients, and the nodes the replicas ran on;
                       scaling = tps_N / (N x tps_1). Only meaningful across real hosts: the local nodes share
                       this machine's cores

Run as root, in a loopback-only network namespace as the tests do (names select figures: handoff router stream
resume node pipeline throughput; none: all but throughput):
    unshare -n sh -c 'ip link set lo up && RAY_USAGE_STATS_ENABLED=0 .venv/bin/python benchmarks/cluster_bench.py'
Throughput over N real hosts: start Ray on them (`ray start --head --node-ip-address=PRIVATE_IP` on one,
`ray start --address=PRIVATE_IP:6379 --node-ip-address=...` on the others, each with the model at the same path),
then on the head:
    LLAMPY_BENCH_ADDRESS=PRIVATE_IP:6379 LLAMPY_BENCH_MODEL=/models/smollm2.gguf \
        .venv/bin/python benchmarks/cluster_bench.py throughput
(LLAMPY_BENCH_SECONDS: each load's length, default 30; LLAMPY_BENCH_PARALLEL: slots per replica, default 4;
LLAMPY_BENCH_SERVER: the URL of one `llampy serve MODEL --parallel P -t 1` on one of the hosts, loaded the same way
first, for scaling_vs_one_server = tps_N / (N x its tokens/s), the issue's measure.) Two nodes on this machine, each
pinned to its own core in a network namespace of its own, against one server on one core:
`bash benchmarks/cluster_two_netns.sh [MODEL]` (root).
Ray runs its workers at nice 15 unless its nodes start with RAY_worker_niceness=0 (the local cluster here does;
on real hosts, set it for `ray start` to compare with one server at normal priority).
"""
from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TINY = Path(os.environ.get("LLAMPY_SHARED", ROOT.parent / "shared")) / "fixtures" / "tiny" / "llama-F32.gguf"
PORT = 8000
URL = f"http://127.0.0.1:{PORT}"
IDLE_S = 5          # the deployments' per-stream idle timeout (the tests' too): a stream silent this long has broken


def p50(xs):
    return round(statistics.median(xs), 3)


def router_latency(router: str, n: int = 60) -> float:
    import httpx
    from llampy.cluster import deploy
    deploy(str(TINY), replicas=2, parallel=4, router=router, port=PORT, place_timeout=240, idle_timeout=IDLE_S)
    _wait(2)
    c = httpx.Client(timeout=60)
    body = {"prompt": "Hello " * 40, "max_tokens": 1, "temperature": 0}
    for _ in range(5):
        c.post(URL + "/v1/completions", json=body)
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        assert c.post(URL + "/v1/completions", json=body).status_code == 200
        ts.append((time.perf_counter() - t0) * 1e3)
    return p50(ts)


def _wait(n: int, timeout: float = 240.0) -> None:
    import httpx
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            if httpx.get(URL + "/health", timeout=5).json().get("replicas") == n:
                return
        except Exception:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{n} replicas not healthy")


def router_choose_us() -> float:
    """The prefix router's choice for a 2000-token prompt among 4 replicas (block keys, lookup, bookkeeping)."""
    import asyncio
    from types import SimpleNamespace
    from llampy.cluster.router import PrefixRouter
    r = PrefixRouter.__new__(PrefixRouter)
    r.initialize_state()
    reps = [SimpleNamespace(replica_id=f"r{i}") for i in range(4)]
    toks = list(range(2000))

    async def go():
        ts = []
        for i in range(300):
            pr = SimpleNamespace(args=[{"tokens": toks[:1990] + [i] * 10}],
                                 metadata=SimpleNamespace(internal_request_id=str(i)),
                                 routing_context=SimpleNamespace(should_backoff=False))
            t0 = time.perf_counter()
            ranks = await r.choose_replicas(reps, pr)
            r.on_request_routed(pr, ranks[0][0].replica_id, None)
            ts.append((time.perf_counter() - t0) * 1e6)
            r.on_request_completed(ranks[0][0].replica_id, str(i))
        return p50(ts)
    return asyncio.run(go())


def stream_cost(n_tok: int = 128, reps: int = 5) -> float:
    import httpx
    out = []
    for i in range(reps):
        body = {"prompt": f"Once {i}", "n_predict": n_tok, "temperature": 0, "ignore_eos": True, "stream": True}
        t_first = t_last = None
        timings = None
        with httpx.stream("POST", URL + "/completion", json=body, timeout=120) as r:
            for ln in r.iter_lines():
                if not ln.startswith("data: ") or ln == "data: [DONE]":
                    continue
                o = json.loads(ln[6:])
                now = time.perf_counter()
                if t_first is None:
                    t_first = now
                t_last = now
                timings = o.get("timings") or timings
        engine_ms = timings["predicted_ms"] * (timings["predicted_n"] - 1) / max(timings["predicted_n"], 1)
        out.append(((t_last - t_first) * 1e3 - engine_ms) / (n_tok - 1))
    return p50(out)


def resume_seconds(cluster=None) -> list:
    """Seconds from a stream's break to its next token from another replica, for the streams on the busiest replica:
    that replica SIGKILLed, or (``cluster`` given) its worker node removed at once."""
    import httpx
    import ray
    board = ray.get_actor("llampy-board")
    started = threading.Event()
    n0 = len(httpx.get(URL + "/cluster/failover").json()["resume_seconds"])

    def one(i):
        body = {"prompt": f"Story {i}", "max_tokens": 900, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", URL + "/v1/completions", json=body, timeout=120) as r:
            for ln in r.iter_lines():
                if ln.startswith("data: {"):
                    started.set()
    ths = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in ths:
        t.start()
    started.wait(60)
    t0 = time.monotonic()       # a replica with streams on it: the board hears from each every half second
    while True:
        victim = max(ray.get(board.read.remote()), key=lambda r: r["busy"])
        if victim["busy"] or time.monotonic() - t0 > 10:
            break
        time.sleep(0.1)
    if cluster is None:
        os.kill(victim["pid"], signal.SIGKILL)
    else:
        cluster.remove_node(next(n for n in cluster.worker_nodes if n.node_id == victim["node_id"]),
                            allow_graceful=False)
    for t in ths:
        t.join()
    return [round(x, 3) for x in httpx.get(URL + "/cluster/failover").json()["resume_seconds"][n0:]]


def handoff_ms(sizes=(2, 8, 32), n: int = 200) -> dict:
    """Round trips from an actor on one worker node to a stage executor on the other, carrying N KB each way."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0)
    class Holder:           # a stage executor's memory, without a model
        def __init__(self):
            import numpy as np
            self.buf = np.zeros(1 << 20, np.uint8)

        def apply(self, ops):
            out = []
            for op in ops:
                if op[0] == "write":
                    self.buf[op[2]:op[2] + len(op[3])] = memoryview(op[3])
                elif op[0] == "read":
                    out.append(self.buf[op[2]:op[2] + op[3]].tobytes())
            return out

    @ray.remote(num_cpus=0)
    class Caller:
        def run(self, holder, size, n):
            import ray as r
            data = bytes(size)
            ts = []
            for _ in range(n + 10):
                t0 = time.perf_counter()
                r.get(holder.apply.remote([("write", 1, 0, data), ("read", 1, 0, size)]))
                ts.append(time.perf_counter() - t0)
            return sorted(ts[10:])[len(ts[10:]) // 2] * 1e3

    nodes = [x["NodeID"] for x in ray.nodes() if x["Alive"] and x["Resources"].get("CPU")]
    a, b = (NodeAffinitySchedulingStrategy(nd, soft=False) for nd in nodes[:2])
    h = Holder.options(scheduling_strategy=b).remote()
    c = Caller.options(scheduling_strategy=a).remote()
    return {f"{s}KB": round(ray.get(c.run.remote(h, s * 1024, n)), 3) for s in sizes}


def pipeline_ms_per_token(n: int = 24) -> dict:
    import numpy as np
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    from llampy.cluster.stage import Stage, StageRef, file_sha256, pipeline_layers
    from llampy.ggml.backends.remote import RemoteBackend
    from llampy.llama.batch import Batch
    from llampy.llama.context import Context
    from llampy.llama.model import Model
    from llampy.models import smollm2_path
    path = str(smollm2_path())
    node = next(x["NodeID"] for x in ray.nodes() if x["Alive"] and x["Resources"].get("CPU"))
    st = ray.remote(Stage).options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
    stage = st.remote(path, file_sha256(path), 1)
    remote = RemoteBackend(StageRef(stage))
    out = {}
    for name, m in (("one_process", Model(path, n_threads=1)),
                    ("pipeline_2", Model(path, devices=[remote], n_gpu_layers=pipeline_layers(path, 2),
                                         n_threads=1))):
        ctx = Context(m, n_ctx=256, n_batch=32, n_ubatch=32)
        toks = m.vocab.tokenize("The capital of France is", add_special=True, parse_special=False)
        ctx.decode(Batch.from_tokens(toks, 0, 0))
        t = int(np.argmax(ctx.get_logits_ith(-1)))
        ts = []
        for i in range(n):
            t0 = time.perf_counter()
            ctx.decode(Batch.from_tokens([t], len(toks) + i, 0))
            t = int(np.argmax(ctx.get_logits_ith(-1)))
            ts.append((time.perf_counter() - t0) * 1e3)
        out[name] = p50(ts[4:])
    out["round_trips_per_token"] = 1
    return out


def _load(url: str, n_clients: int, seconds: float, n_tok: int) -> float:
    """Generated tokens/s at ``url`` under ``n_clients`` clients sending ``n_tok``-token completions back to back."""
    import httpx
    toks, t_end = [], time.monotonic() + seconds

    def client(i):
        k = 0
        while time.monotonic() < t_end:
            r = httpx.post(url + "/v1/completions", json={"prompt": f"Story {i} part {k}:", "max_tokens": n_tok,
                                                          "ignore_eos": True, "temperature": 0}, timeout=300)
            r.raise_for_status()
            toks.append(r.json()["usage"]["completion_tokens"])
            k += 1
    t0 = time.monotonic()
    ths = [threading.Thread(target=client, args=(i,)) for i in range(n_clients)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    return round(sum(toks) / (time.monotonic() - t0), 1)


def throughput(model: str, parallel: int, seconds: float, n_tok: int = 64, server: str | None = None) -> dict:
    """Tokens/s with 1 replica and with one per node; with ``server`` (the URL of one `llampy serve` of the same
    model and slots, one thread), the same load on it first. See the module's docstring."""
    import httpx
    import ray
    from llampy.cluster import deploy
    n = sum(1 for nd in ray.nodes() if nd["Alive"] and nd["Resources"].get("CPU", 0) >= 1)
    out: dict = {"nodes": n, "parallel": parallel, "seconds": seconds, "max_tokens": n_tok}
    if server:
        for i in range(2):
            httpx.post(server + "/v1/completions", json={"prompt": f"Warm {i}", "max_tokens": 4}, timeout=120)
        out["tps_one_server"] = _load(server, 2 * parallel, seconds, n_tok)
    for reps in (1, n):
        deploy(model, replicas=reps, parallel=parallel, port=PORT, place_timeout=240)
        _wait(reps)
        for i in range(2 * reps):       # each replica's first step (plans, caches) outside the timing
            httpx.post(URL + "/v1/completions", json={"prompt": f"Warm {i}", "max_tokens": 4}, timeout=120)
        out[f"tps_{reps}"] = _load(URL, 2 * parallel * reps, seconds, n_tok)
        ip = {nd["NodeID"]: nd["NodeManagerAddress"] for nd in ray.nodes()}
        out[f"replica_nodes_{reps}"] = sorted(ip.get(r["node_id"], "?")        # where the replicas ran
                                              for r in ray.get(ray.get_actor("llampy-board").read.remote()))
    out["scaling"] = round(out[f"tps_{n}"] / (n * out["tps_1"]), 3)
    if server:
        out["scaling_vs_one_server"] = round(out[f"tps_{n}"] / (n * out["tps_one_server"]), 3)
    return out


def tree_pss_mib() -> float:
    """PSS of this process's descendants (the local cluster's GCS, raylets, workers, Serve's actors), MiB."""
    kids: dict[int, list] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    todo, total = list(kids.get(os.getpid(), [])), 0
    while todo:
        pid = todo.pop()
        todo += kids.get(pid, [])
        try:
            for ln in open(f"/proc/{pid}/smaps_rollup"):
                if ln.startswith("Pss:"):
                    total += int(ln.split()[1])
        except OSError:
            pass
    return round(total / 1024, 1)


def main() -> None:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Ray starts its workers (the replicas, the ingress, Serve's proxy) at nice 15; one server runs at the
    # caller's priority. The local nodes inherit this environment: workers at 0 (any other process on the
    # machine would otherwise take the cores from them)
    os.environ.setdefault("RAY_worker_niceness", "0")
    from llampy.cluster.launch import start_local
    res: dict = {}

    def put(key, value):        # each figure as soon as it is measured
        res[key] = value
        print(f"cluster_bench: {key} = {json.dumps(value)}", flush=True)

    only = set(sys.argv[1:])        # e.g. `cluster_bench.py resume`: that figure alone

    def want(name):
        return not only or name in only
    address = os.environ.get("LLAMPY_BENCH_ADDRESS")    # a real cluster's head (HOST:PORT): throughput over N hosts
    if address:
        from llampy.cluster.launch import connect
        if only != {"throughput"}:
            sys.exit("LLAMPY_BENCH_ADDRESS: only the throughput figure runs on an existing cluster")
        connect(address)
        c = None
    else:
        t0 = time.monotonic()
        c = start_local(2)
        put("cluster_start_s", round(time.monotonic() - t0, 1))
        put("idle_cluster_pss_mib", tree_pss_mib())
    if want("handoff"):
        put("handoff_ms", handoff_ms())
    if want("router"):
        put("router_p50_ms_pow2", router_latency("pow2"))
        put("serve_2_tiny_replicas_pss_mib", tree_pss_mib())
    if want("router") or want("stream") or want("resume") or want("node"):
        put("router_p50_ms_prefix", router_latency("prefix"))
    if want("router"):
        put("router_choose_us", router_choose_us())
    if want("stream"):
        put("stream_ms_per_token", stream_cost())
    if want("resume"):
        put("resume_s", resume_seconds())
    if want("node") and c is not None:         # last: the cluster has one worker node less after it
        _wait(2)        # Serve has replaced the killed replica
        put("resume_s_node_lost", resume_seconds(c))
    if "throughput" in only:
        put("throughput", throughput(os.environ.get("LLAMPY_BENCH_MODEL", str(TINY)),
                                     int(os.environ.get("LLAMPY_BENCH_PARALLEL", "4")),
                                     float(os.environ.get("LLAMPY_BENCH_SECONDS", "30")),
                                     server=os.environ.get("LLAMPY_BENCH_SERVER")))
    from ray import serve
    serve.delete("llampy")
    if want("pipeline") and c is not None:
        put("pipeline_ms_per_token", pipeline_ms_per_token())
    print(json.dumps(res, indent=1), flush=True)
    import ray
    ray.shutdown()
    if c is not None:
        c.shutdown()


if __name__ == "__main__":
    main()
