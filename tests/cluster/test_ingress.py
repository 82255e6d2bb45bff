"""The cluster's ingress without a cluster: its routes over in-process replicas (llampy/cluster/replica.py's
Replica, run without Ray) through a handle that breaks streams on purpose. The same 400s as one server; a broken
stream resumes with the same text; one that cannot go on ends with an error event and [DONE]; no replica: 503 with
Retry-After. Ray's own part (processes, nodes, Serve) is tests/cluster/test_ray_cluster.py."""
from __future__ import annotations

import asyncio
import json

import pytest

from tests.paths import TINY

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

MODEL = str(TINY / "llama-F32.gguf")
N_PARALLEL, N_CTX = 2, 1024


class Stream:
    """A replica's stream as a Serve handle gives it, one event per item (the replica merges the events that come
    within MERGE_S, so how many items a stream has depends on the machine's speed; the faults below must not);
    raises after ``fail_after`` items (a killed replica)."""

    def __init__(self, agen, fail_after):
        self.agen, self.fail_after, self.n, self.buf = agen, fail_after, 0, []

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.fail_after is not None and self.n >= self.fail_after:
            await self.agen.aclose()
            raise RuntimeError("ActorDiedError: the replica was killed")
        self.n += 1
        if not self.buf:
            self.buf = [[ev] for ev in await self.agen.__anext__()] or [[]]     # a keepalive stays empty
        return self.buf.pop(0)

    def cancel(self):
        asyncio.ensure_future(self.agen.aclose())


class Handle:
    """A DeploymentHandle over in-process replicas, round robin; ``faults``: call number -> items before it
    breaks."""

    def __init__(self, replicas, faults=None):
        self.replicas, self.faults, self.calls, self.specs = replicas, dict(faults or {}), 0, []

    def options(self, **_):
        return self

    @property
    def generate(self):
        return self

    def remote(self, spec):
        i = self.calls
        self.calls += 1
        self.specs.append(spec)
        return Stream(self.replicas[i % len(self.replicas)].generate(spec), self.faults.get(i))


class Board:
    def __init__(self, replicas):
        self.replicas = replicas
        self.read = self

    async def remote(self):
        return [r.stats() for r in self.replicas]


@pytest.fixture(scope="module")
def replicas():
    from llampy.cluster.replica import Replica
    reps = [Replica(MODEL, N_PARALLEL, N_CTX, n_threads=1) for _ in range(2)]
    yield reps
    for r in reps:
        r.engine.stop()


_server = {}


def cluster_client(replicas, faults=None, live=True, idle_timeout=5.0):
    """A fresh ingress app over ``replicas``; the ClusterServer (vocabulary, template renderer) is built once."""
    from llampy.cluster.ingress import ClusterServer, RemoteEngine, build_app
    handle = Handle(replicas, faults)
    eng = RemoteEngine(handle, Board(replicas if live else []), N_PARALLEL, N_CTX, idle_timeout=idle_timeout)
    server = _server.get("s")
    if server is None:
        server = _server["s"] = ClusterServer(MODEL, eng)
    server.engine = eng
    c = TestClient(build_app(server))
    c.get("/health")        # reads the board (the deployment's ingress does so every half second)
    return c, handle, eng


def chat(i: int, n: int = 24) -> dict:
    return {"messages": [{"role": "user", "content": f"Tell me story number {i}."}], "max_tokens": n,
            "temperature": 0, "stream": True}


def sse_events(text: str) -> list:
    return [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]


def stream_text(c: TestClient, body: dict) -> tuple[str, list]:
    r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    evs = sse_events(r.text)
    assert evs[-1] == "[DONE]"
    objs = [json.loads(e) for e in evs[:-1]]
    text = "".join(o["choices"][0]["delta"].get("content") or "" for o in objs if o.get("choices"))
    return text, objs


def test_same_400s_as_one_server(replicas):
    from llampy.server.app import create_app
    one = TestClient(create_app(replicas[0].server))
    c, _, _ = cluster_client(replicas)
    bodies = [("/v1/chat/completions", {"messages": "hi"}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 65}),
              ("/v1/completions", {"prompt": 5}),
              ("/v1/completions", {"prompt": "x", "max_tokens": -3}),
              ("/v1/completions", {"prompt": "x", "grammar": "root ::= (", "max_tokens": 2}),
              ("/v1/completions", {"prompt": "x " * 3000}),
              ("/v1/completions", {"prompt": "x", "lora": [{"id": 0, "scale": 1.0}]})]   # no adapters loaded
    for path, body in bodies:
        a, b = one.post(path, json=body), c.post(path, json=body)
        assert a.status_code == 400 and b.status_code == 400, (path, body, a.text, b.text)
        assert a.json() == b.json(), (path, body)
    bad = c.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert bad.status_code == 400 and bad.json() == one.post(
        "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}).json()


def test_broken_streams_resume_with_the_same_text(replicas):
    c, _, _ = cluster_client(replicas)
    want = [stream_text(c, chat(i))[0] for i in range(3)]
    assert all(want)
    # call 0 breaks before its first token (resubmitted); calls 2 and 4 after their first item (resumed)
    c, handle, eng = cluster_client(replicas, faults={0: 0, 2: 1, 4: 1})
    got = []
    for i in range(3):
        text, objs = stream_text(c, {**chat(i), "stream_options": {"include_usage": True}})
        got.append(text)
        assert objs[-1]["usage"]["completion_tokens"] == 24
        assert not any("error" in o for o in objs)
    assert got == want
    assert eng.failover["resubmitted"] == 1 and eng.failover["resumed"] == 2 and eng.failover["failed"] == 0
    resumed = [s for s in handle.specs if s.get("generated")]
    assert len(resumed) == 2
    for s in resumed:     # the resumed spec carries the tokens generated so far and the same (fixed) seed
        assert s["p"]["seed"] == handle.specs[handle.specs.index(s) - 1]["p"]["seed"]


def test_a_sampled_stream_resumes_with_the_same_text(replicas):
    """Temperature sampling: the resumed replica's sampler replays the tokens so far (their random draws included),
    so a stream broken after its first item and again later reads as the unbroken one."""
    body = {**chat(11, 32), "temperature": 0.9, "top_k": 40, "top_p": 0.95, "seed": 1234}
    c, _, _ = cluster_client(replicas)
    want = stream_text(c, body)[0]
    c, handle, eng = cluster_client(replicas, faults={0: 1, 1: 3})
    assert stream_text(c, body)[0] == want
    assert eng.failover["resumed"] == 2 and len(handle.specs[2]["generated"]) > len(handle.specs[1]["generated"])


def test_a_stream_that_cannot_go_on_ends_with_an_error_event(replicas):
    from llampy.cluster.ingress import MAX_TRIES
    c, _, eng = cluster_client(replicas, faults={i: 1 for i in range(MAX_TRIES)})
    r = c.post("/v1/chat/completions", json=chat(0))
    evs = sse_events(r.text)
    assert evs[-1] == "[DONE]"
    err = json.loads(evs[-2])
    assert err["error"]["type"] == "unavailable_error" and "failed on" in err["error"]["message"]
    assert eng.failover["failed"] == 1


def test_a_busy_replica_is_not_taken_for_a_dead_one(replicas):
    """A request that waits on its replica past the idle timeout (here the engine thread held by a job: no step, no
    event) is kept there by the replica's empty keepalive items: served once, not resubmitted elsewhere."""
    import time
    c, handle, eng = cluster_client(replicas[:1], idle_timeout=0.5)
    hold = replicas[0].engine.run_job(lambda: time.sleep(1.5))     # the engine takes its inbox in order
    text, objs = stream_text(c, chat(3, 4))
    assert hold.done()
    assert text and not any("error" in o for o in objs)
    assert handle.calls == 1 and eng.failover == {"resubmitted": 0, "resumed": 0, "failed": 0}
    assert handle.specs[0]["keepalive_s"] == 0.5 / 4


def test_health_check_fails_when_the_engine_stalls_while_busy(replicas, monkeypatch):
    """Serve's health check on a replica (Replica.check_health): passes while idle and while steps go on; fails
    when a request holds a slot and no decode step comes for STALL_S (here the engine thread held by a job);
    passes again once steps resume."""
    import threading
    import time

    import llampy.cluster.replica as R
    monkeypatch.setattr(R, "STALL_S", 0.3)
    rep = replicas[1]
    c, _, _ = cluster_client(replicas[1:])
    rep.check_health()
    idle = rep.engine.metrics["steps_total"]
    t = threading.Thread(target=stream_text, args=(c, {**chat(5, 48), "ignore_eos": True}))
    t.start()
    try:
        t0 = time.monotonic()      # a slot busy and a step made for it
        while not (rep.engine.busy_slots() and rep.engine.metrics["steps_total"] > idle) and \
                time.monotonic() - t0 < 30:
            time.sleep(0.01)
        assert rep.engine.busy_slots()
        started, release = threading.Event(), threading.Event()
        hold = rep.engine.run_job(lambda: (started.set(), release.wait(10)))
        try:
            assert started.wait(10)     # the engine is between two steps from here on
            rep.check_health()
            time.sleep(0.4)
            held = rep.engine.metrics["steps_total"]
            assert rep.engine.busy_slots()
            with pytest.raises(RuntimeError, match="busy without a decode step for 0.3 s"):
                rep.check_health()
            assert rep.engine.metrics["steps_total"] == held
        finally:
            release.set()
        hold.result(timeout=10)
        t0 = time.monotonic()
        while rep.engine.metrics["steps_total"] == held and time.monotonic() - t0 < 10:
            time.sleep(0.01)
        rep.check_health()
    finally:
        t.join(timeout=120)


def test_a_replica_sends_the_first_token_at_once_and_merges_the_rest(replicas, monkeypatch):
    """A replica's stream items: the first token's event at once, later events merged while they come within
    MERGE_S of the last item (here longer than the whole request: all the rest in one item, the finish last)."""
    import llampy.cluster.replica as R
    c, handle, _ = cluster_client(replicas[:1])
    text, _ = stream_text(c, {**chat(7, 16), "ignore_eos": True})
    monkeypatch.setattr(R, "MERGE_S", 60.0)

    async def items():
        return [it async for it in replicas[0].generate(handle.specs[-1]) if it]     # not the keepalives
    got = asyncio.run(items())
    # the first item goes as soon as the first token is there (with whatever else the engine queued by then)
    assert len(got) <= 2 and got[0][0].token is not None, [len(it) for it in got]
    assert got[-1][-1].finish_reason is not None and sum(ev.token is not None for it in got for ev in it) == 16


def test_the_board_does_not_age_its_rows_while_it_is_stopped(monkeypatch):
    """The whole cluster stopped for 84 s (a paused host, or this machine's SIGSTOPs): the replicas' rows are still
    fresh when it goes on, not dropped (which made the ingress answer 503 until the next reports). A replica that
    stops reporting while the ingress keeps reading is dropped after FRESH_S as before."""
    from types import SimpleNamespace

    import llampy.cluster.board as B
    t = [1000.0]
    monkeypatch.setattr(B, "time", SimpleNamespace(monotonic=lambda: t[0]))
    b = B.Board()
    b.report("a", {"id": "a"})
    b.report("b", {"id": "b"})
    t[0] += 84.0
    assert sorted(r["id"] for r in b.read()) == ["a", "b"]
    for _ in range(int(B.FRESH_S / 0.5) + 2):       # "a" reports, "b" is gone, the ingress reads
        t[0] += 0.5
        b.report("a", {"id": "a"})
        b.read()
    assert [r["id"] for r in b.read()] == ["a"]


def test_health_check_fails_when_the_engine_thread_is_dead():
    """A replica whose engine thread has ended (here stopped; a crash ends it the same way) fails Serve's health
    check, so Serve replaces it."""
    from llampy.cluster.replica import Replica
    rep = Replica(MODEL, 1, 256, n_threads=1)
    rep.check_health()
    rep.engine.stop()
    assert not rep.engine.alive()
    with pytest.raises(RuntimeError, match="the engine thread stopped"):
        rep.check_health()


def test_no_replica_is_503_with_retry_after(replicas):
    c, _, _ = cluster_client(replicas, live=False)
    r = c.post("/v1/chat/completions", json={**chat(0), "stream": False})
    assert r.status_code == 503 and r.headers["retry-after"] == "2"
    assert r.json()["error"]["code"] == "no_replica"
    h = c.get("/health")
    assert h.status_code == 503 and h.headers["retry-after"] == "2"


def test_metrics_sum_the_replicas(replicas):
    c, _, _ = cluster_client(replicas)
    stream_text(c, chat(7, 4))
    m = {ln.split()[0]: float(ln.split()[1]) for ln in c.get("/metrics").text.splitlines()
         if ln and not ln.startswith("#")}
    total = sum(r.engine.metrics["generated_tokens_total"] for r in replicas)
    assert m["llampy_tokens_predicted_total"] == total > 0
    assert m["llampy_replicas_healthy"] == 2
    h = c.get("/health").json()
    assert h["replicas"] == 2 and h["slots_idle"] == 2 * N_PARALLEL
