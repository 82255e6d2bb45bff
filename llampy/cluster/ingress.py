"""The ingress deployment: today's routes (llampy/server/app.py), their validation, templates and tokenization,
over replicas instead of an engine thread.

``ClusterServer`` is the one-process ``Server`` with a vocabulary-only model and a ``RemoteEngine``: the routes
build the same Requests and answer the same 400s; ``RemoteEngine.submit`` sends the request's token list and
settings to a replica through the Serve handle (whose router picks the replica) and feeds the replica's events to
the request as the engine thread would.

Failover lives here: a stream that breaks before its first token is submitted again; after it, it resumes on
another replica with the prompt plus the tokens generated so far and the sampler replayed over them; a stream
silent for ``idle_timeout`` counts as broken. After MAX_TRIES, one OpenAI-shaped error event and [DONE]. With no
healthy replica a request gets 503 with Retry-After.
"""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import random
import time
from pathlib import Path

from ..server.app import Server, create_app
from ..server.oai import APIError
from ..server.slots import Event

MAX_TRIES = 4           # replicas one stream may be sent to
RETRY_AFTER_S = 2
REFRESH_S = 0.5         # how often the ingress reads the board
# A render's wall-time budget in the ingress (one server's is 3 s). The render child runs at nice +10 beside
# the head's nice-0 processes; on a head that also runs replicas (a local cluster, the tests) a fresh child's
# first render, which compiles the template, missed 3 s under load and every chat request got a 400.
RENDER_SECONDS = 15.0


class NoReplica(APIError):
    def __init__(self):
        super().__init__(503, "no healthy replica is serving this model; try again shortly",
                         type="unavailable_error", code="no_replica")


class RemoteEngine:
    """What the routes use of slots.Engine, over the replicas. Counters are the replicas' sums (from the board)."""

    draining = False
    # the replicas load no LoRA adapters: a request's "lora" ids get the server's 400 (out of range)
    lora_adapters = lora_paths = lora_scales = ()

    def lora_of(self, lora) -> tuple:
        return ()

    def alora_ids(self, lora) -> list:
        return []

    def __init__(self, handle, board, n_parallel: int, n_ctx: int, idle_timeout: float):
        self.handle, self.board = handle, board
        self.n_parallel, self.n_ctx = n_parallel, n_ctx
        self.idle_timeout = idle_timeout
        self.rows: list[dict] = []
        self.t_rows = 0.0
        self._tasks: set = set()
        self.failover = {"resubmitted": 0, "resumed": 0, "failed": 0}
        self.t_resume: list[float] = []         # seconds from a stream's break to its next token elsewhere

    @property
    def n_ctx_slot(self) -> int:
        return self.n_ctx // self.n_parallel

    # ------------------------------------------------------------------ the board
    async def refresh(self) -> None:
        try:
            self.rows = await self.board.read.remote()
            self.t_rows = time.monotonic()
        except Exception:
            self.rows = []

    async def refresh_loop(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(REFRESH_S)

    def healthy(self) -> list[dict]:
        return [r for r in self.rows if r["alive"]]

    def alive(self) -> bool:
        return True             # the ingress itself; /health says whether replicas are there

    def busy_slots(self) -> int:
        return sum(r["busy"] for r in self.rows)

    def queue_depth(self) -> int:
        return sum(r["queue"] for r in self.rows)

    def kv_used(self) -> int:
        return sum(r["kv_used"] for r in self.rows)

    def graphs_pending(self) -> int:
        return sum(r.get("graphs_pending", 0) for r in self.rows)

    def tokens_per_second(self) -> float:
        return sum(r["tps"] for r in self.rows)

    @property
    def metrics(self) -> dict:
        out: dict = {}
        for r in self.rows:
            for k, v in r["metrics"].items():
                out[k] = max(out.get(k, 0), v) if k == "n_tokens_max" else out.get(k, 0) + v
        return out or {k: 0 for k in ("requests_total", "requests_finished", "requests_cancelled",
                                      "prompt_tokens_total", "prompt_tokens_cached", "generated_tokens_total",
                                      "decode_seconds_total", "prompt_seconds_total", "gen_seconds_total",
                                      "steps_total", "busy_slot_steps", "n_tokens_max")}

    def slots_info(self) -> list:
        raise APIError(501, "/slots is per replica: the cluster's ingress has no slots of its own",
                       type="not_supported_error")

    def run_job(self, fn) -> cf.Future:
        fut: cf.Future = cf.Future()
        fut.set_exception(APIError(501, "this route runs on one server's engine; the cluster serves completions "
                                        "and chat", type="not_supported_error"))
        return fut

    def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()

    # ------------------------------------------------------------------ requests
    def submit(self, req) -> None:
        if not self.healthy():
            raise NoReplica()
        t = asyncio.get_running_loop().create_task(self._drive(req))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    @staticmethod
    def _spec(req) -> dict:
        return {"tokens": list(req.tokens), "p": req.spec_p, "grammar": req.spec_grammar,
                "fields": {"max_tokens": req.max_tokens, "stop": list(req.stop), "n_probs": req.n_probs,
                           "logprobs": req.logprobs, "ignore_eos": req.ignore_eos,
                           "keep_tokens": sorted(req.keep_tokens), "cache_prompt": req.cache_prompt,
                           "id_slot": req.id_slot, "prompt_logprobs": req.prompt_logprobs, "params": req.params}}

    async def _drive(self, req) -> None:
        """One request's stream, across replicas if they fail."""
        # a replica still working on the request sends an empty item at least this often (replica.py)
        spec = {**self._spec(req), "keepalive_s": self.idle_timeout / 4}
        gen: list[int] = []
        n_prompt = len(req.tokens)
        why, t_break = "", None
        for attempt in range(MAX_TRIES):
            call = {**spec, "generated": list(gen)} if gen else spec
            if attempt:
                self.failover["resumed" if gen else "resubmitted"] += 1
            stream = self.handle.options(stream=True).generate.remote(call)
            try:
                async for items in self._items(stream, req):
                    for ev in items:
                        if ev.error and ev.status == 503:       # that replica is shutting down: go elsewhere
                            raise ConnectionError(ev.error)
                        if t_break is not None and ev.token is not None:
                            self.t_resume.append(time.monotonic() - t_break)
                            t_break = None
                        if call is not spec:      # counts as if it had run in one place
                            ev.n_prompt, ev.n_gen = n_prompt, ev.n_gen + len(call["generated"])
                            ev.n_cached = min(ev.n_cached, n_prompt)
                        if ev.token is not None:
                            gen.append(ev.token)
                        req.emit(ev)
                        if ev.finish_reason is not None:
                            return
                if req.cancelled:       # the client went away: the replica frees the slot
                    stream.cancel()
                    return
                why = "the replica's stream ended without a finish"
            except asyncio.CancelledError:
                stream.cancel()
                raise
            except Exception as e:          # the replica died, its node went away, or it stalled
                why = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            stream.cancel()
            if t_break is None:
                t_break = time.monotonic()
            await asyncio.sleep(0.05 * attempt)
        self.failover["failed"] += 1
        req.emit(Event(finish_reason="error", error=f"the stream failed on {MAX_TRIES} replicas; last: {why}",
                       status=503, n_prompt=n_prompt, n_gen=len(gen)))

    async def _items(self, stream, req):
        """The stream's items; TimeoutError when none comes for idle_timeout; stops when the client has gone."""
        nxt = None
        try:
            while True:
                nxt = asyncio.ensure_future(stream.__anext__())
                t0 = time.monotonic()
                while not nxt.done():
                    await asyncio.wait({nxt}, timeout=0.25)
                    if req.cancelled:
                        return
                    if not nxt.done() and time.monotonic() - t0 > self.idle_timeout:
                        raise TimeoutError(f"no item for {self.idle_timeout:g} s")
                try:
                    items = nxt.result()
                except StopAsyncIteration:
                    return
                nxt = None
                yield items
        finally:
            if nxt is not None and not nxt.done():
                nxt.cancel()


class ClusterServer(Server):
    """Server's routes' half: model metadata, vocabulary and chat template, no weights; requests go to a
    RemoteEngine."""

    def __init__(self, model_path, engine: RemoteEngine, api_key: str | None = None, alias: str | None = None):
        from ..llama.chat import template_from_metadata
        from ..llama.model import Model
        from ..server.render import TemplateRenderer
        self.n_threads = 1
        self.slot_save_path = self.prompt_cache = None
        self.model = Model(model_path, vocab_only=True)
        self.encoder = not getattr(self.model.arch, "USES_KV_CACHE", True)
        if self.encoder:
            raise ValueError(f"{self.model.hparams.arch} is an encoder; the cluster serves generative models")
        self.embd_n_ctx = 2048
        self._rank_ctx = self._embed_ctx = None
        self.model_id = alias or Path(model_path).stem
        self.names = {self.model_id, Path(model_path).name, Path(model_path).stem, str(model_path), "default"}
        self.engine = engine
        self.api_key = api_key
        self.template = template_from_metadata(self.model.metadata)
        self.renderer = TemplateRenderer(seconds=RENDER_SECONDS)
        self._check_template()
        self.n_vocab = self.model.hparams.n_vocab
        self.n_restored = 0
        self.t_start = time.time()

    async def grammar_sampler(self, g):
        gs = await super().grammar_sampler(g)       # built here too: its 400s are the ingress's
        if gs is not None:
            gs.llampy_source = g
        return gs

    def make_request(self, tokens, p, n_probs=0, logprobs=False, param="prompt", grammar=None, opts=None):
        if p.get("seed") in (None, -1):     # fixed here, so that a resumed stream draws the same numbers
            p = {**p, "seed": random.getrandbits(32)}
        req = super().make_request(tokens, p, n_probs, logprobs, param, grammar, opts)
        req.spec_p = p
        req.spec_grammar = getattr(grammar, "llampy_source", None)
        return req

    def kernel_threads(self) -> int:
        return 0


def router_rows(engine: RemoteEngine) -> str:
    from .board import ROUTER_STATS as STATS
    rows = [(f"router_{k}_total", "counter", f"Prefix router: {k.replace('_', ' ')}.", v) for k, v in STATS.items()]
    rows += [(f"failover_{k}_total", "counter", f"Streams {k} on another replica.", v)
             for k, v in engine.failover.items()]
    rows.append(("replicas_healthy", "gauge", "Replicas heard from within the last 3 s.", len(engine.healthy())))
    out = []
    for name, kind, help_, v in rows:
        out += [f"# HELP llampy_{name} {help_}", f"# TYPE llampy_{name} {kind}", f"llampy_{name} {v}"]
    return "\n".join(out) + "\n"


def build_app(server: ClusterServer, cors: dict | None = None):
    """create_app's routes, with /health and /metrics over the replicas and 503 + Retry-After without any."""
    from fastapi.responses import JSONResponse, PlainTextResponse
    from ..server.app import prometheus
    from ..server.ops import llamacpp_metrics
    app = create_app(server, cors=cors)
    app.router.routes = [r for r in app.router.routes if getattr(r, "path", None) not in ("/health", "/metrics")]
    eng = server.engine

    @app.exception_handler(NoReplica)
    async def on_no_replica(_, e: NoReplica):
        return JSONResponse(e.body(), status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.get("/health")
    async def health():
        await eng.refresh()
        n = len(eng.healthy())
        body = {"status": "ok" if n else "error", "replicas": n,
                "slots_idle": sum(r["n_parallel"] - r["busy"] for r in eng.healthy()),
                "slots_processing": eng.busy_slots()}
        if not n:
            body["error"] = "no healthy replica"
            return JSONResponse(body, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
        return body

    @app.get("/metrics")
    async def metrics():
        await eng.refresh()
        return PlainTextResponse(llamacpp_metrics(server) + prometheus(server) + router_rows(eng),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/cluster/failover")
    async def failover():
        return {**eng.failover, "resume_seconds": eng.t_resume[-100:]}

    return app


class Ingress:
    """The Serve deployment (wrapped by serve.ingress in deploy.py)."""

    def __init__(self, model_path: str, replica_handle, board_name: str, n_parallel: int, n_ctx: int,
                 idle_timeout: float = 20.0, api_key: str | None = None, alias: str | None = None,
                 cors: dict | None = None):
        import ray
        self.engine = RemoteEngine(replica_handle, ray.get_actor(board_name), n_parallel, n_ctx, idle_timeout)
        self.server = ClusterServer(model_path, self.engine, api_key, alias)
        self.cors = cors
        self._refresher = asyncio.get_event_loop().create_task(self.engine.refresh_loop())

    def __serve_build_asgi_app__(self):
        return build_app(self.server, self.cors)
