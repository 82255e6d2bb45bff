"""Operating the server: /metrics under llama-server's names, one structured log line per request, and, with
`llampy serve` in a process of its own: load progress, --threads, graceful shutdown (requests in flight finish,
or end cleanly after --shutdown-timeout) and --prompt-cache across a restart."""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from .conftest import free_port, metric, sse_datas, wait_health


def llamacpp_metrics(url: str) -> dict:
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("llamacpp:"):
            name, v = line.split()
            out[name[len("llamacpp:"):]] = float(v)
    return out


def test_metrics_have_llama_servers_names(server_url):
    before = llamacpp_metrics(server_url)
    assert {"prompt_tokens_total", "prompt_seconds_total", "tokens_predicted_total", "tokens_predicted_seconds_total",
            "n_decode_total", "n_tokens_max", "prompt_tokens_seconds", "predicted_tokens_seconds",
            "requests_processing", "requests_deferred", "n_busy_slots_per_decode"} <= set(before)
    text = httpx.get(server_url + "/metrics").text
    assert "# TYPE llamacpp:tokens_predicted_total counter" in text and "# TYPE llamacpp:requests_processing gauge" \
        in text
    r = httpx.post(server_url + "/completion", json={"prompt": "Metrics, please:", "n_predict": 5,
                                                      "ignore_eos": True, "cache_prompt": False}, timeout=60)
    assert r.status_code == 200
    after = llamacpp_metrics(server_url)
    assert after["tokens_predicted_total"] >= before["tokens_predicted_total"] + 5
    assert after["prompt_tokens_total"] > before["prompt_tokens_total"]
    assert after["n_decode_total"] > before["n_decode_total"] and after["n_tokens_max"] >= 5
    assert after["tokens_predicted_total"] == metric(server_url, "tokens_predicted_total")   # the same counter


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        from llampy.server.ops import JsonLines
        self.setFormatter(JsonLines())
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(self.format(record))


@pytest.fixture
def log_lines():
    log = logging.getLogger("llampy.server")
    h, level = Lines(), log.level
    log.addHandler(h)
    log.setLevel(logging.INFO)
    yield h.lines
    log.removeHandler(h)
    log.setLevel(level)


def requests_logged(lines, route=None) -> list:
    out = [json.loads(x) for x in lines]
    return [o for o in out if o["msg"] == "request" and (route is None or o["route"] == route)]


def test_one_structured_line_per_request(server_url, log_lines):
    r = httpx.post(server_url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                              "max_tokens": 4}, timeout=60)
    assert r.status_code == 200
    (line,) = requests_logged(log_lines, "/v1/chat/completions")
    u = r.json()["usage"]
    assert line["n_prompt"] == u["prompt_tokens"] and line["n_gen"] == u["completion_tokens"]
    assert line["status"] == 200 and 0 <= line["slot"] < 4 and line["finish"] in ("stop", "length")
    assert line["t_prompt_ms"] > 0 and line["t_total_ms"] >= line["t_prompt_ms"] and len(line["id"]) == 16
    # a stream, and two choices of one request: a line each
    httpx.post(server_url + "/completion", json={"prompt": "Hi", "n_predict": 3, "stream": True}, timeout=60)
    httpx.post(server_url + "/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 2}, timeout=60)
    assert len(requests_logged(log_lines, "/completion")) == 1
    assert len(requests_logged(log_lines, "/v1/completions")) == 2
    # a client that goes away mid-stream: its line says so
    with httpx.stream("POST", server_url + "/completion", json={"prompt": "Count to a thousand:",
                                                                "n_predict": 400, "ignore_eos": True,
                                                                "stream": True}, timeout=60) as s:
        next(s.iter_lines())
    for _ in range(100):
        gone = [x for x in requests_logged(log_lines, "/completion") if x["status"] == 499]
        if gone:
            break
        time.sleep(0.1)
    assert gone and gone[0]["finish"] == "cancelled" and gone[0]["n_gen"] == 0


# ------------------------------------------------------------------------------------ llampy serve, a process
def start(*args, port: int):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen([sys.executable, "-m", "llampy.cli", "serve", "--port", str(port), "-np", "2",
                          "-c", "1024", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        wait_health(f"http://127.0.0.1:{port}", timeout=180, proc=p)
    except RuntimeError:
        p.kill()
        raise RuntimeError(p.communicate()[1][-3000:]) from None
    return p, f"http://127.0.0.1:{port}"


def stream_lines(url, path, body, out: list, started: threading.Event):
    with httpx.stream("POST", url + path, json=body, timeout=120) as s:
        for line in s.iter_lines():
            if line.startswith("data:"):
                out.append(line[5:].strip())
                started.set()


@pytest.mark.slow
def test_serve_shutdown_threads_progress_and_prompt_cache(tmp_path):
    cache = tmp_path / "prompts.npz"
    port = free_port()
    p, url = start("-t", "1", "--prompt-cache", str(cache), "--shutdown-timeout", "60", port=port)
    try:
        assert httpx.get(url + "/props").json()["n_threads"] == 1
        prompt = "Here is a list of the planets of the solar system, from the Sun outwards:"
        body = {"prompt": prompt, "n_predict": 24, "temperature": 0, "ignore_eos": True, "stream": True,
                "return_tokens": True}
        parts: list = []
        started = threading.Event()
        th = threading.Thread(target=stream_lines, args=(url, "/completion", body, parts, started))
        th.start()
        assert started.wait(120)
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)            # the request in flight finishes; nothing new is accepted
        th.join(timeout=120)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err[-2000:]
    final = json.loads(parts[-1])
    assert final["stop"] is True and final["tokens_predicted"] == 24 and final["stop_type"] == "limit"
    first = "".join(json.loads(x)["content"] for x in parts)
    assert "loading" in err and "100%" in err                 # load progress on stderr
    assert "saved" in err and cache.is_file()
    assert time.monotonic() - t0 < 60
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=2)

    # a new process finds the prompt in its slot's cache; a long request is ended cleanly after 1 s
    port = free_port()
    p, url = start("--prompt-cache", str(cache), "--shutdown-timeout", "1", port=port)
    try:
        again = httpx.post(url + "/completion", json={**body, "stream": False}, timeout=120).json()
        n_prompt = again["tokens_evaluated"]
        assert again["tokens_cached"] == n_prompt - 1 and again["content"] == first
        chat: list = []
        started = threading.Event()
        th = threading.Thread(target=stream_lines, args=(url, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Count to a thousand."}], "max_tokens": 900,
            "ignore_eos": True, "stream": True}, chat, started))
        th.start()
        assert started.wait(120)
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        th.join(timeout=60)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err[-2000:]
    assert time.monotonic() - t0 < 30
    assert chat[-1] == "[DONE]"
    end = json.loads(chat[-2])
    assert end["error"]["code"] == 503 and "shutting down" in end["error"]["message"]
    logged = [json.loads(x) for x in err.splitlines() if x.startswith("{")]
    assert any(x["msg"] == "request" and x["status"] == 503 for x in logged)
    assert any(x["msg"].startswith("shutdown") for x in logged)


def test_stream_chunk_template_writes_the_json_encoders_bytes():
    """A token's chunk from the stream's template (app.Chunks) is, byte for byte, the chunk object through
    json.dumps (app.sse): escapes, non-ASCII text, finish reasons, a completion's text and a chat's delta."""
    from llampy.server.app import Chunks, sse
    texts = ["", "a", " Paris", 'q"uo\\te/', "é中😀", "\n\t\r\x00\x1f\x7f", "\u2028\u2029", "\ufffd", "{}[],: "]
    for model in ("default", 'SmolLM2 "135M" é'):
        head = {"id": "cmpl-x1", "object": "text_completion", "created": 1764000000, "model": model,
                "system_fingerprint": "llampy"}
        c = Chunks(head)
        for t in texts:
            for fin in (None, "stop", "length"):
                for k in (0, 7, 63):
                    assert c.text(k, t, fin) == sse({**head, "choices": [{"index": k, "text": t, "logprobs": None,
                                                                          "finish_reason": fin}]})
                    for d in ({"content": t}, {}):
                        got = c.delta(k, d.get("content"), fin)
                        assert got == sse({**head, "choices": [{"index": k, "delta": d, "logprobs": None,
                                                                "finish_reason": fin}]})


def test_inbox_hands_events_over_in_order_and_wakes_a_waiter():
    """ops.Inbox: events in order, taken at once when waiting; a waiting handler is woken by a put, or with None
    once the timeout has passed without one; close disarms the timer."""
    import asyncio
    from llampy.server.ops import Inbox

    async def run():
        q = Inbox()
        q.put_nowait(1)
        q.put_nowait(2)
        assert [await q.next(1.0), await q.next(1.0)] == [1, 2] and q.empty()
        loop = asyncio.get_running_loop()
        loop.call_later(0.01, q.put_nowait, 3)
        t0 = loop.time()
        assert await q.next(5.0) == 3 and loop.time() - t0 < 2.0
        q.close()
        t0 = loop.time()
        assert await q.next(0.05) is None and loop.time() - t0 >= 0.04
        q.close()
        assert q.timer is None and q.waiter is None
        # asyncio.Queue's get (the cluster's replicas bound each wait themselves): a timeout leaves no waiter
        # behind, and a later event is still handed over, after one a timer of next() left armed woke it early
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(q.get(), 0.02)
        assert q.waiter is None
        loop.call_later(0.005, q.put_nowait, 4)
        assert await q.next(0.05) == 4 and q.timer is not None   # its timer left armed, to fire in get()
        loop.call_later(0.15, q.put_nowait, 5)
        assert await asyncio.wait_for(q.get(), 2.0) == 5 and q.timer is None
    asyncio.run(run())
