"""Running the server: CORS, one structured log line per request, /metrics under llama-server's names, and a
graceful shutdown that lets requests in flight finish (or ends them cleanly) before the process exits."""
from __future__ import annotations

import asyncio
import json
import logging
import sys
import threading
import time
from collections import deque
from urllib.parse import urlsplit

log = logging.getLogger("llampy.server")


class Inbox:
    """One request's events, put by the event loop (Handoff delivers a step's events here) and awaited by the
    request's handler. Lighter than an asyncio.Queue: a deque and at most one waiting future. While the handler
    waits, one timer is armed for the wake-up ``next`` promises after ``timeout`` seconds without an event, and it
    is left armed while events flow (rather than a timeout set and cancelled around every event, a stream's every
    token): a wake-up then comes early, which the handlers take as a "nothing yet" (they check the client)."""

    __slots__ = ("items", "waiter", "timer")

    def __init__(self):
        self.items: deque = deque()
        self.waiter: asyncio.Future | None = None
        self.timer: asyncio.TimerHandle | None = None

    def put_nowait(self, item) -> None:
        self.items.append(item)
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def empty(self) -> bool:
        return not self.items

    def get_nowait(self):
        return self.items.popleft()

    def _wake(self) -> None:
        self.timer = None
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def next(self, timeout: float):
        """The next event, or None after at most ``timeout`` seconds without one (see the class)."""
        if self.items:
            return self.items.popleft()
        loop = asyncio.get_running_loop()
        self.waiter = w = loop.create_future()
        if self.timer is None:
            self.timer = loop.call_later(timeout, self._wake)
        try:
            await w
        finally:
            self.waiter = None
        return self.items.popleft() if self.items else None

    async def get(self):
        """The next event, waiting as long as it takes (asyncio.Queue's ``get``: callers that bound the wait
        themselves, with asyncio.wait_for and a timeout of their own each time, as the cluster's replicas do)."""
        while not self.items:
            self.waiter = w = asyncio.get_running_loop().create_future()
            try:
                await w
            finally:
                self.waiter = None
        return self.items.popleft()

    def close(self) -> None:
        """Disarm the timer (the request is over: nobody waits)."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


DEFAULT_CORS_METHODS = "GET, POST, OPTIONS"
DEFAULT_CORS_HEADERS = "*"


# ---------------------------------------------------------------------------------------------------- CORS
def origin_is_localhost(origin: str) -> bool:
    try:
        host = urlsplit(origin).hostname or ""
    except ValueError:
        return False
    return host in ("localhost", "127.0.0.1", "::1") or host.endswith(".localhost")


class Cors:
    """ASGI middleware, outermost: the Access-Control-* headers llama-server sends. ``origins``: "*" (any),
    "localhost" (an Origin on this machine is echoed back, any other gets no header: llampy's default), or a
    comma-separated list of origins (echoed back when listed). A preflight (OPTIONS with
    Access-Control-Request-Method) is answered here, before the API key is checked: browsers send none with it."""

    def __init__(self, app, origins: str = "localhost", methods: str = DEFAULT_CORS_METHODS,
                 headers: str = DEFAULT_CORS_HEADERS, credentials: bool = False, max_age: int = 600):
        self.app = app
        self.origins = origins.strip()
        self.allowed = {o.strip().rstrip("/") for o in self.origins.split(",") if o.strip()}
        self.methods, self.headers, self.credentials, self.max_age = methods, headers, credentials, max_age

    def allow(self, origin: str | None) -> str | None:
        """The Access-Control-Allow-Origin value for a request from ``origin``, or None."""
        if not origin:
            return "*" if self.origins == "*" and not self.credentials else None
        if self.origins == "*":
            return origin if self.credentials else "*"
        if self.origins == "localhost":
            return origin if origin_is_localhost(origin) else None
        return origin if origin.rstrip("/") in self.allowed else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        origin = headers.get("origin")
        allow = self.allow(origin)
        extra = []
        if allow is not None:
            extra.append((b"access-control-allow-origin", allow.encode("latin-1")))
            if allow != "*":
                extra.append((b"vary", b"Origin"))
            if self.credentials:
                extra.append((b"access-control-allow-credentials", b"true"))
        if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            if allow is not None:
                want = headers.get("access-control-request-headers", "")
                extra += [(b"access-control-allow-methods", self.methods.encode()),
                          (b"access-control-allow-headers",
                           (want if self.headers == "*" and want else self.headers).encode("latin-1")),
                          (b"access-control-max-age", str(self.max_age).encode())]
            await send({"type": "http.response.start", "status": 204 if allow is not None else 403,
                        "headers": extra + [(b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return

        if not extra:       # nothing to add: the response's messages (a stream's every chunk) go straight through
            return await self.app(scope, receive, send)

        async def send_with_cors(msg):
            if msg["type"] == "http.response.start":
                msg = {**msg, "headers": list(msg.get("headers", [])) + extra}
            await send(msg)
        await self.app(scope, receive, send_with_cors)


# ------------------------------------------------------------------------------------------------ logging
class JsonLines(logging.Formatter):
    """A record as one JSON object: time, level, message, and the ``fields`` it carries."""

    def format(self, record):
        out = {"ts": round(record.created, 3), "level": record.levelname.lower(), "msg": record.getMessage()}
        out.update(getattr(record, "fields", {}))
        return json.dumps(out, ensure_ascii=False)


class TextLines(logging.Formatter):
    """A record as one line of text: time, message, then key=value for each of its ``fields``."""

    def format(self, record):
        fields = " ".join(f"{k}={v}" for k, v in getattr(record, "fields", {}).items())
        return f"{self.formatTime(record)} {record.getMessage()}" + (f" {fields}" if fields else "")


def setup_logging(fmt: str = "json", stream=None) -> None:
    """The server's log: one line per request (and per lifecycle event) on stderr, as JSON (``fmt`` "json") or
    as key=value text ("text")."""
    h = logging.StreamHandler(stream or sys.stderr)
    h.setFormatter(JsonLines() if fmt == "json" else TextLines())
    log.handlers[:] = [h]
    log.setLevel(logging.INFO)
    log.propagate = False


def log_event(msg: str, **fields) -> None:
    log.info(msg, extra={"fields": fields})


def log_request(route: str, req, last, status: int) -> None:
    """The line of one engine request: its id, route, slot, token counts, timings (ms) and how it ended."""
    t = (last.timings if last is not None else None) or {}
    log_event("request", id=req.id, route=route, status=status, slot=last.slot if last is not None else -1,
              n_prompt=len(req.tokens), n_cached=last.n_cached if last is not None else 0,
              n_gen=last.n_gen if last is not None else 0,
              finish=(last.finish_reason if last is not None else "cancelled"),
              t_queue_ms=round(t.get("queue_ms", 0.0), 2), t_prompt_ms=round(t.get("prompt_ms", 0.0), 2),
              t_gen_ms=round(t.get("predicted_ms", 0.0), 2),
              t_total_ms=round((time.perf_counter() - req.t_arrival) * 1e3, 2))


# ------------------------------------------------------------------------------------------------ metrics
def llamacpp_metrics(server) -> str:
    """/metrics rows under llama-server's names (``llamacpp:``), with its help texts."""
    e = server.engine
    m = e.metrics
    pp_tps = m["prompt_tokens_total"] / m["prompt_seconds_total"] if m["prompt_seconds_total"] else 0.0
    tg_tps = m["generated_tokens_total"] / m["gen_seconds_total"] if m["gen_seconds_total"] else 0.0
    counters = [
        ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens",
         m["prompt_tokens_total"]),
        ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache", m["prompt_tokens_cached"]),
        ("prompt_seconds_total", "Total time spent processing prompts", m["prompt_seconds_total"]),
        ("tokens_predicted_total", "Number of generation tokens processed", m["generated_tokens_total"]),
        ("tokens_predicted_seconds_total", "Total time spent generating tokens", m["gen_seconds_total"]),
        ("n_decode_total", "Total number of llama_decode() calls", m["steps_total"]),
        ("n_tokens_max", "Largest observed sequence length (prompt + generation)", m["n_tokens_max"]),
        ("spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated",
         m["draft_tokens_total"]),
        ("spec_decode_num_accepted_tokens_total", "Speculative: Total draft tokens accepted by the target model",
         m["draft_tokens_accepted"]),
        ("spec_decode_num_drafts_total", "Speculative: Total speculative decoding verification steps",
         m["draft_steps_total"]),
    ]
    gauges = [
        ("prompt_tokens_seconds", "Average prompt throughput in tokens/s", pp_tps),
        ("predicted_tokens_seconds", "Average generation throughput in tokens/s", tg_tps),
        ("requests_processing", "Number of requests processing", e.busy_slots()),
        ("requests_deferred", "Number of requests deferred", e.queue_depth()),
        ("n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call",
         m["busy_slot_steps"] / max(m["steps_total"], 1)),
    ]
    out = []
    for kind, rows in (("counter", counters), ("gauge", gauges)):
        for name, help_, v in rows:
            out += [f"# HELP llamacpp:{name} {help_}", f"# TYPE llamacpp:{name} {kind}", f"llamacpp:{name} {v}"]
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------------------------ shutdown
class Draining:
    """ASGI middleware: while the server shuts down, a new request (on a connection kept alive) is a 503; the
    ones already in flight go on."""

    def __init__(self, app, server):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.server.engine.draining and scope["path"] != "/health":
            body = json.dumps({"error": {"message": "the server is shutting down", "type": "unavailable_error",
                                         "param": None, "code": 503}}).encode()
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)


def shutdown_engine(server, grace: float) -> None:
    """Refuse new requests, give the ones in flight ``grace`` seconds to finish, then end the rest with an error
    event (a 503 or an SSE error and [DONE]: every client gets a complete reply). Runs in its own thread."""
    e = server.engine
    e.begin_drain()
    n0 = e.busy_slots() + e.queue_depth()
    log_event("shutdown", in_flight=n0, grace_s=grace)
    t_end = time.monotonic() + grace
    while time.monotonic() < t_end and not e.idle():
        time.sleep(0.05)
    if not e.idle():
        n = e.run_job(e.cancel_all).result(timeout=30)
        log_event("shutdown: cancelled requests in flight", n_cancelled=n)


def make_uvicorn(app, server, host: str, port: int, grace: float, log_level: str = "warning"):
    """A uvicorn server whose first SIGINT/SIGTERM drains the engine (shutdown_engine) while uvicorn stops
    accepting connections and waits for the open ones; a second signal exits at once (uvicorn's force exit)."""
    import uvicorn

    class Graceful(uvicorn.Server):
        def handle_exit(self, sig, frame):
            first = not self.should_exit
            super().handle_exit(sig, frame)
            if first:
                threading.Thread(target=shutdown_engine, args=(server, grace), name="llampy-drain",
                                 daemon=True).start()

    return Graceful(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                   timeout_graceful_shutdown=grace + 30))
