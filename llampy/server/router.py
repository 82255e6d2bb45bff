"""Several models behind one server (llama-server's router mode, Ollama's model list): the GGUF files of a folder,
each named by its file name without ``.gguf``, loaded on first use, unloaded after an idle time (``keep_alive``),
when ``--models-max`` are loaded and another is asked for, or when memory runs short.

Each loaded model is a whole single-model server (app.Server and its routes, its own slots and engine thread), in
this process. The router reads a request's ``model`` (the JSON body's field; the ``model`` query parameter for a
GET) and hands the request to that model's routes. Its own routes: GET /health, GET /v1/models and /models (every
model of the folder with its state), POST /models/load and /models/unload ({"model": NAME}).

``keep_alive`` (Ollama's) in a request body: how long the model stays loaded after this request, as seconds or a
duration ("30s", "5m", "1h"); 0 unloads it when the request is done, a negative value keeps it loaded.
"""
from __future__ import annotations

import asyncio
import gc
import json
import re
import threading
import time
from pathlib import Path

from fastapi import Request as HTTPRequest

from .oai import APIError

DEFAULT_KEEP_ALIVE = 300.0      # seconds (Ollama's 5 minutes)
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})$")


def scan_models(folder) -> dict:
    """{name: path} of the GGUF models in ``folder`` and its direct subfolders: projectors (mmproj*) and the later
    parts of split files are not models of their own; a split model is named without its -00001-of-0000N."""
    out = {}
    root = Path(folder)
    files = sorted(list(root.glob("*.gguf")) + list(root.glob("*/*.gguf")))
    for f in files:
        stem = f.name[:-5]
        if stem.lower().startswith("mmproj") or not f.is_file():
            continue
        m = _SPLIT.search(stem)
        if m:
            if m.group(1) != "00001":
                continue
            stem = stem[:m.start()]
        out.setdefault(stem, f)
    return out


def parse_keep_alive(v) -> float | None:
    """Ollama's keep_alive: seconds (a number), or a duration string ("10s", "5m", "1h", "1h30m"); negative: forever
    (None is returned for "no change")."""
    if v is None:
        return None
    if isinstance(v, bool):
        raise APIError(400, "'keep_alive' must be a number of seconds or a duration such as '5m'", "keep_alive")
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        s = v.strip()
        try:
            return float(s)
        except ValueError:
            pass
        m = re.fullmatch(r"(-)?((?:\d+(?:\.\d+)?[hms])+)", s)
        if m:
            total = sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)([hms])",
                                                                                        m.group(2)))
            return -total if m.group(1) else total
    raise APIError(400, f"'keep_alive' must be a number of seconds or a duration such as '5m', got {v!r}",
                   "keep_alive")


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class Entry:
    def __init__(self, name: str, path: Path):
        self.name, self.path = name, path
        self.server = None
        self.app = None
        self.state = "unloaded"         # unloaded | loading | loaded
        self.error: str | None = None   # why the last load failed
        self.active = 0                 # requests in flight
        self.keep_alive = None          # seconds after the last request (None: the router's default)
        self.expires_at = 0.0           # monotonic time; inf: never
        self.t_loaded = 0.0
        self.lock = threading.Lock()    # held while loading or unloading


class Router:
    """The models of a folder and the servers of those loaded. ``make_server(path, name)`` builds one model's Server;
    ``make_app(server)`` its routes."""

    def __init__(self, models_dir, make_server, make_app, keep_alive: float = DEFAULT_KEEP_ALIVE,
                 models_max: int = 4, autoload: bool = True, mem_margin: int = 512 << 20):
        self.dir = Path(models_dir)
        if not self.dir.is_dir():
            raise FileNotFoundError(f"--models-dir {models_dir}: no such folder")
        self.make_server, self.make_app = make_server, make_app
        self.keep_alive, self.models_max, self.autoload = float(keep_alive), int(models_max), autoload
        self.mem_margin = mem_margin
        self.lock = threading.Lock()
        self.entries: dict[str, Entry] = {}
        self.rescan()
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="llampy-router-reaper", daemon=True)
        self._reaper.start()

    def rescan(self) -> None:
        found = scan_models(self.dir)
        with self.lock:
            for name, path in found.items():
                if name not in self.entries:
                    self.entries[name] = Entry(name, path)

    # ------------------------------------------------------------------ use (any thread; blocking)
    def acquire(self, name: str, keep_alive=None, load: bool | None = None) -> Entry:
        """The loaded entry of ``name``, loading it if needed, counted as in use until ``release``."""
        if name not in self.entries:
            self.rescan()
        e = self.entries.get(name)
        if e is None:
            raise APIError(404, f"The model '{name}' does not exist; GET /v1/models lists the models of this server",
                           "model", code="model_not_found")
        with e.lock:
            if e.server is None:
                if not (self.autoload if load is None else load):
                    raise APIError(400, f"the model '{name}' is not loaded (POST /models/load loads it)", "model",
                                   code="model_not_loaded")
                self._load(e)
            with self.lock:
                e.active += 1
                if keep_alive is not None:
                    e.keep_alive = keep_alive
        return e

    def release(self, e: Entry) -> None:
        with self.lock:
            e.active -= 1
            ka = self.keep_alive if e.keep_alive is None else e.keep_alive
            e.expires_at = float("inf") if ka < 0 else time.monotonic() + ka
        if e.active == 0 and ka == 0:
            self.unload(e.name)

    def unload(self, name: str) -> bool:
        """Unload an idle model: True if it was loaded and is now gone."""
        e = self.entries.get(name)
        if e is None:
            raise APIError(404, f"The model '{name}' does not exist", "model", code="model_not_found")
        with e.lock:
            with self.lock:
                if e.server is None or e.active:
                    return False
                server, e.server, e.app, e.state = e.server, None, None, "unloaded"
            server.engine.stop()
            server.renderer.close()     # its template workers are child processes
        del server
        gc.collect()                    # the model's mapped file and its buffers go now, not at some later sweep
        return True

    def loaded(self) -> list:
        with self.lock:
            return [e for e in self.entries.values() if e.server is not None]

    def close(self) -> None:
        self._stop.set()
        for e in list(self.entries.values()):
            if e.server is not None:
                e.server.engine.stop()
                e.server.renderer.close()

    # ------------------------------------------------------------------ internals
    def _load(self, e: Entry) -> None:
        self._make_room(e)
        e.state, e.error = "loading", None
        try:
            server = self.make_server(e.path, e.name)
            app = self.make_app(server)
        except Exception as err:        # a file that does not load is that model's failure, not the router's
            e.state, e.error = "unloaded", f"{type(err).__name__}: {err}"
            raise APIError(503, f"the model '{e.name}' failed to load: {err}", "model",
                           type="unavailable_error") from None
        with self.lock:
            e.server, e.app, e.state, e.t_loaded = server, app, "loaded", time.time()

    def _make_room(self, e: Entry) -> None:
        """Unload idle models, least recently used first, while --models-max are loaded or memory is short of the
        file's size plus a margin."""
        need = e.path.stat().st_size + self.mem_margin
        while True:
            idle = sorted((x for x in self.loaded() if x.active == 0 and x is not e), key=lambda x: x.expires_at)
            full = len(self.loaded()) >= self.models_max
            avail = _mem_available()
            short = avail is not None and avail < need
            if not (full or short) or not idle:
                return
            self.unload(idle[0].name)

    def _reap_loop(self) -> None:
        while not self._stop.wait(0.5):
            now = time.monotonic()
            for e in self.loaded():
                if e.active == 0 and e.expires_at <= now:
                    self.unload(e.name)

    def describe(self) -> list:
        """/v1/models' entries: every model of the folder, with its state."""
        self.rescan()
        out = []
        now_m, now_w = time.monotonic(), time.time()
        with self.lock:
            entries = sorted(self.entries.values(), key=lambda x: x.name)
        for e in entries:
            st = {"value": e.state}
            if e.error and e.state == "unloaded":
                st["failed"], st["error"] = True, e.error
            d = {"id": e.name, "object": "model", "owned_by": "llampy", "created": int(e.path.stat().st_mtime),
                 "path": str(e.path), "size": e.path.stat().st_size, "status": st}
            if e.server is not None:
                d["loaded_at"] = int(e.t_loaded)
                d["in_flight"] = e.active
                d["expires_at"] = None if e.expires_at == float("inf") or e.active else \
                    int(now_w + max(e.expires_at - now_m, 0))
                d["meta"] = {"n_ctx": e.server.engine.n_ctx, "n_parallel": e.server.engine.n_parallel,
                             "n_vocab": e.server.n_vocab}
            out.append(d)
        return out


class RouterApp:
    """ASGI: the router's own routes, or the request handed to its model's routes."""
    OWN = {("GET", "/health"), ("GET", "/v1/models"), ("GET", "/models"), ("POST", "/models/load"),
           ("POST", "/models/unload")}

    def __init__(self, router: Router, api_key: str | None = None, cors: dict | None = None):
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse
        from .app import Guard, read_json
        from .ops import Cors
        self.router = router
        own = FastAPI(title="llampy router")

        @own.exception_handler(APIError)
        async def on_api_error(_, e: APIError):
            return JSONResponse(e.body(), status_code=e.status)

        @own.get("/health")
        async def health():
            return {"status": "ok", "models_loaded": len(router.loaded()), "models": len(router.entries)}

        @own.get("/v1/models")
        @own.get("/models")
        async def models():
            return {"object": "list", "data": await asyncio.to_thread(router.describe)}

        @own.post("/models/load")
        async def load(http: HTTPRequest):
            body = await read_json(http)
            name = _model_name(body.get("model"))
            ka = parse_keep_alive(body.get("keep_alive"))
            e = await asyncio.to_thread(router.acquire, name, ka, True)
            router.release(e)
            return {"success": True, "model": name}

        @own.post("/models/unload")
        async def unload(http: HTTPRequest):
            body = await read_json(http)
            name = _model_name(body.get("model"))
            done = await asyncio.to_thread(router.unload, name)
            if not done and router.entries[name].server is not None:
                raise APIError(409, f"the model '{name}' is serving requests; unload it when they are done",
                               "model", code="model_busy")
            return {"success": True, "model": name, "unloaded": done}

        self.own = Cors(Guard(own, api_key), **{"origins": "localhost", **(cors or {})})
        self.api_key = api_key

    async def __call__(self, scope, receive, send):
        from fastapi.responses import JSONResponse
        from .app import MAX_BODY
        from . import limits
        if scope["type"] != "http" or (scope["method"], scope["path"]) in self.OWN or scope["method"] == "OPTIONS":
            await self.own(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_key and headers.get("authorization", "") != f"Bearer {self.api_key}":
            await self.own(scope, receive, send)        # the router's guard answers with its 401
            return
        try:
            if scope["method"] == "POST":
                raw, more = bytearray(), True
                while more:
                    msg = await receive()
                    if msg["type"] == "http.disconnect":
                        return
                    raw += msg.get("body", b"")
                    more = msg.get("more_body", False)
                    if len(raw) > MAX_BODY:
                        raise APIError(413, f"the request body is larger than {MAX_BODY} bytes",
                                       code="request_too_large")
                body = await limits.parse_json_body(bytes(raw))
                if not isinstance(body, dict):
                    raise APIError(400, "the request body must be a JSON object")
                name = _model_name(body.get("model"))
                ka = parse_keep_alive(body.pop("keep_alive", None))
                raw = json.dumps(body).encode()
            else:
                from urllib.parse import parse_qs
                q = parse_qs(scope.get("query_string", b"").decode("latin-1"))
                name = _model_name(q.get("model", [None])[0])
                ka, raw = None, b""
            e = await asyncio.to_thread(self.router.acquire, name, ka)
        except APIError as err:
            await JSONResponse(err.body(), status_code=err.status)(scope, receive, send)
            return
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": bytes(raw), "more_body": False}
            return await receive()

        hdrs = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
        if scope["method"] == "POST":
            hdrs.append((b"content-length", str(len(raw)).encode()))
        try:
            await e.app({**scope, "headers": hdrs}, replay, send)
        finally:
            self.router.release(e)


def _model_name(v) -> str:
    if v is None:
        raise APIError(400, "'model' is required: this server serves several models (GET /v1/models lists them)",
                       "model")
    if not isinstance(v, str) or not v:
        raise APIError(400, "'model' must be a non-empty string", "model")
    return v[:-5] if v.endswith(".gguf") else v
