"""The OpenAI-compatible HTTP server: routes over one model and the continuous-batching engine (slots.py)."""
from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
from pathlib import Path

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse

from ..llama.batch import Batch
from ..llama.chat import ChatTemplateError, template_from_metadata
from ..llama.context import Context
from ..llama.model import Model
from ..llama.sampling import Chain
from .oai import APIError, check_messages, new_id, now, sampling_params, usage
from .slots import Engine, Event, Request

MAX_BODY = 4 << 20
STATIC = Path(__file__).parent / "static"


class Server:
    def __init__(self, model_path, n_parallel: int = 4, n_ctx: int = 4096, api_key: str | None = None,
                 alias: str | None = None):
        self.model = Model(model_path)
        self.model_id = alias or Path(model_path).name
        self.names = {self.model_id, Path(model_path).name, Path(model_path).stem, "default"}
        self.engine = Engine(self.model, n_parallel, n_ctx)
        self.api_key = api_key
        self.template = template_from_metadata(self.model.metadata)
        self._embed_ctx = None
        self._embed_lock = threading.Lock()
        self.t_start = time.time()

    # ------------------------------------------------------------------ helpers
    def check_model(self, body: dict) -> None:
        m = body.get("model")
        if m is not None and not isinstance(m, str):
            raise APIError(400, "'model' must be a string", "model")
        if m and m not in self.names:
            raise APIError(404, f"the model '{m}' does not exist; this server serves '{self.model_id}'", "model",
                           code="model_not_found")

    def sampler(self, p: dict) -> Chain:
        return Chain.from_params(temperature=p["temperature"], top_k=p["top_k"], top_p=p["top_p"], min_p=p["min_p"],
                                 repeat_penalty=p["repeat_penalty"], frequency_penalty=p["frequency_penalty"],
                                 presence_penalty=p["presence_penalty"], logit_bias=p["logit_bias"], seed=p["seed"],
                                 n_vocab=self.model.hparams.n_vocab)

    def make_request(self, tokens: list, p: dict, n_probs: int = 0) -> Request:
        if not tokens:
            raise APIError(400, "the prompt is empty", "prompt")
        limit = self.engine.slots[0].n_ctx
        if len(tokens) >= limit:
            raise APIError(400, f"the prompt has {len(tokens)} tokens, more than the context of a slot ({limit}); "
                                f"shorten it or start the server with a larger --ctx-size", "prompt",
                           code="context_length_exceeded")
        max_tokens = p["max_tokens"] or (limit - len(tokens))
        r = Request(tokens=tokens, max_tokens=max_tokens, sampler=self.sampler(p), stop=p["stop"], n_probs=n_probs,
                    ignore_eos=p.get("ignore_eos", False))
        return self.engine.submit(r)

    def tokenize_prompt(self, prompt) -> list:
        v = self.model.vocab
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if any(not 0 <= t < v.n_tokens for t in prompt):
                raise APIError(400, "the prompt holds token ids outside the vocabulary", "prompt")
            return list(prompt)
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise APIError(400, "'prompt' must be a string or a list of token ids", "prompt")
        return v.tokenize(prompt, add_special=True, parse_special=True)

    def chat_tokens(self, messages: list) -> list:
        try:
            text = self.template.render(messages, add_generation_prompt=True)
        except ChatTemplateError as e:
            raise APIError(400, str(e), "messages") from None
        v = self.model.vocab
        toks = v.tokenize(text, add_special=False, parse_special=True)
        if v.add_bos and v.bos is not None and (not toks or toks[0] != v.bos):
            toks = [v.bos] + toks
        return toks

    def piece(self, tok: int) -> str:
        return self.model.vocab.token_to_piece(tok).decode("utf-8", errors="replace")

    def embed(self, texts: list) -> tuple[list, int]:
        with self._embed_lock:
            if self._embed_ctx is None:
                self._embed_ctx = Context(self.model, n_ctx=2048, n_batch=2048, n_ubatch=2048, embeddings=True,
                                          pooling="mean")
            out, n = [], 0
            for t in texts:
                toks = self.model.vocab.tokenize(t, add_special=True, parse_special=True)
                if not toks:
                    raise APIError(400, "cannot embed an empty input", "input")
                if len(toks) >= 2048:
                    raise APIError(400, f"the input has {len(toks)} tokens, more than 2048", "input")
                n += len(toks)
                self._embed_ctx.kv_clear()
                self._embed_ctx.decode(Batch.from_tokens(toks, logits_all=True))
                e = self._embed_ctx.get_embeddings_seq(0).astype("float64")
                out.append((e / max(float((e ** 2).sum()) ** 0.5, 1e-12)).tolist())
            return out, n


async def events(req: Request, http: HTTPRequest):
    """Yields the engine's events for one request; cancels it if the client disconnects."""
    while True:
        try:
            ev = req.events.get_nowait()
        except queue.Empty:
            if await http.is_disconnected():
                req.cancel()
                return
            await asyncio.sleep(0.004)
            continue
        yield ev
        if ev.finish_reason is not None:
            return


def sse(obj) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


def create_app(server: Server) -> FastAPI:
    app = FastAPI(title="llampy", version="0.1.0", description="OpenAI-compatible server of llampy")
    app.state.server = server

    @app.middleware("http")
    async def guard(http: HTTPRequest, call_next):
        if server.api_key and http.url.path not in ("/health", "/", "/index.html"):
            if http.headers.get("authorization", "") != f"Bearer {server.api_key}":
                return JSONResponse(APIError(401, "invalid or missing API key", type="authentication_error",
                                             code="invalid_api_key").body(), status_code=401)
        cl = http.headers.get("content-length")
        if cl is not None and cl.isdigit() and int(cl) > MAX_BODY:
            return JSONResponse(APIError(413, f"the request body is larger than {MAX_BODY} bytes").body(),
                                status_code=413)
        try:
            return await call_next(http)
        except APIError as e:
            return JSONResponse(e.body(), status_code=e.status)
        except Exception as e:  # a bug must not become a bare 500 without a body
            return JSONResponse(APIError(500, f"internal error: {e}", type="server_error").body(), status_code=500)

    async def body_of(http: HTTPRequest) -> dict:
        raw = await http.body()
        if len(raw) > MAX_BODY:
            raise APIError(413, f"the request body is larger than {MAX_BODY} bytes")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        return body

    def error_response(e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    # ------------------------------------------------------------------ OpenAI
    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest):
        try:
            body = await body_of(http)
            server.check_model(body)
            msgs = check_messages(body)
            p = sampling_params(body, server.model.hparams.n_vocab)
            want_lp = bool(body.get("logprobs"))
            n_top = body.get("top_logprobs") or 0
            if not isinstance(n_top, int) or isinstance(n_top, bool) or not 0 <= n_top <= 20:
                raise APIError(400, "'top_logprobs' must be an integer between 0 and 20", "top_logprobs")
            req = server.make_request(server.chat_tokens(msgs), p, n_top if want_lp else 0)
        except APIError as e:
            return error_response(e)
        cid, created = new_id("chatcmpl"), now()
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        def lp_entry(ev: Event):
            return {"token": server.piece(ev.token), "logprob": ev.logprob, "bytes": None,
                    "top_logprobs": [{"token": server.piece(i), "logprob": l, "bytes": None} for i, l in ev.top]}

        if body.get("stream"):
            async def gen():
                first = True
                async for ev in events(req, http):
                    if ev.error:
                        yield sse({"error": {"message": ev.error, "type": "server_error"}})
                        break
                    delta = {"role": "assistant", "content": ev.text} if first else {"content": ev.text}
                    first = False
                    ch = {"index": 0, "delta": delta, "finish_reason": ev.finish_reason,
                          "logprobs": {"content": [lp_entry(ev)]} if want_lp and ev.token is not None else None}
                    chunk = {"id": cid, "object": "chat.completion.chunk", "created": created,
                             "model": server.model_id, "choices": [ch]}
                    if ev.finish_reason is not None and include_usage:
                        yield sse(chunk)
                        chunk = {"id": cid, "object": "chat.completion.chunk", "created": created,
                                 "model": server.model_id, "choices": [], "usage": usage(ev.n_prompt, ev.n_gen)}
                    yield sse(chunk)
                yield b"data: [DONE]\n\n"
            return StreamingResponse(gen(), media_type="text/event-stream")
        text, lps, last = "", [], None
        async for ev in events(req, http):
            if ev.error:
                return error_response(APIError(500, ev.error, type="server_error"))
            text += ev.text
            if want_lp and ev.token is not None:
                lps.append(lp_entry(ev))
            last = ev
        return {"id": cid, "object": "chat.completion", "created": created, "model": server.model_id,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "logprobs": {"content": lps} if want_lp else None,
                             "finish_reason": last.finish_reason if last else "stop"}],
                "usage": usage(last.n_prompt if last else len(req.tokens), last.n_gen if last else 0)}

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        try:
            body = await body_of(http)
            server.check_model(body)
            if "prompt" not in body:
                raise APIError(400, "'prompt' is required", "prompt")
            p = sampling_params(body, server.model.hparams.n_vocab)
            n_lp = body.get("logprobs") or 0
            if not isinstance(n_lp, int) or isinstance(n_lp, bool) or not 0 <= n_lp <= 20:
                raise APIError(400, "'logprobs' must be an integer between 0 and 20", "logprobs")
            req = server.make_request(server.tokenize_prompt(body["prompt"]), p, n_lp)
        except APIError as e:
            return error_response(e)
        cid, created = new_id("cmpl"), now()
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        def lp_obj(evs):
            return {"tokens": [server.piece(e.token) for e in evs], "token_logprobs": [e.logprob for e in evs],
                    "top_logprobs": [{server.piece(i): l for i, l in e.top} for e in evs], "text_offset": []}

        if body.get("stream"):
            async def gen():
                async for ev in events(req, http):
                    if ev.error:
                        yield sse({"error": {"message": ev.error, "type": "server_error"}})
                        break
                    ch = {"index": 0, "text": ev.text, "finish_reason": ev.finish_reason,
                          "logprobs": lp_obj([ev]) if n_lp and ev.token is not None else None}
                    yield sse({"id": cid, "object": "text_completion", "created": created, "model": server.model_id,
                               "choices": [ch]})
                    if ev.finish_reason is not None and include_usage:
                        yield sse({"id": cid, "object": "text_completion", "created": created,
                                   "model": server.model_id, "choices": [], "usage": usage(ev.n_prompt, ev.n_gen)})
                yield b"data: [DONE]\n\n"
            return StreamingResponse(gen(), media_type="text/event-stream")
        text, evs, last = "", [], None
        async for ev in events(req, http):
            if ev.error:
                return error_response(APIError(500, ev.error, type="server_error"))
            text += ev.text
            if ev.token is not None:
                evs.append(ev)
            last = ev
        return {"id": cid, "object": "text_completion", "created": created, "model": server.model_id,
                "choices": [{"index": 0, "text": text, "logprobs": lp_obj(evs) if n_lp else None,
                             "finish_reason": last.finish_reason if last else "stop"}],
                "usage": usage(len(req.tokens), last.n_gen if last else 0)}

    @app.post("/v1/embeddings")
    async def embeddings(http: HTTPRequest):
        try:
            body = await body_of(http)
            server.check_model(body)
            inp = body.get("input")
            texts = [inp] if isinstance(inp, str) else inp
            if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
                raise APIError(400, "'input' must be a string or a non-empty list of strings", "input")
            vecs, n = await asyncio.get_running_loop().run_in_executor(None, server.embed, texts)
        except APIError as e:
            return error_response(e)
        return {"object": "list", "model": server.model_id,
                "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vecs)],
                "usage": {"prompt_tokens": n, "total_tokens": n}}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_id, "object": "model", "created": int(server.t_start),
                                            "owned_by": "llampy"}]}

    # ------------------------------------------------------------------ llama.cpp's native routes
    @app.post("/completion")
    async def completion(http: HTTPRequest):
        try:
            body = await body_of(http)
            if "prompt" not in body:
                raise APIError(400, "'prompt' is required", "prompt")
            p = sampling_params(body, server.model.hparams.n_vocab)
            n_probs = body.get("n_probs", 0)
            if not isinstance(n_probs, int) or isinstance(n_probs, bool) or n_probs < 0:
                raise APIError(400, "'n_probs' must be a non-negative integer", "n_probs")
            req = server.make_request(server.tokenize_prompt(body["prompt"]), p, n_probs)
        except APIError as e:
            return error_response(e)
        t0 = time.perf_counter()
        text, toks, probs, last = "", [], [], None
        async for ev in events(req, http):
            text += ev.text
            if ev.token is not None:
                toks.append(ev.token)
                probs.append({"id": ev.token, "token": server.piece(ev.token), "logprob": ev.logprob,
                              "top_logprobs": [{"id": i, "token": server.piece(i), "logprob": l} for i, l in ev.top]})
            last = ev
        out = {"content": text, "stop": True, "stop_type": "limit" if last and last.finish_reason == "length" else "eos",
               "tokens_predicted": len(toks), "tokens_evaluated": len(req.tokens), "model": server.model_id,
               "timings": {"predicted_ms": (time.perf_counter() - t0) * 1e3}}
        if body.get("return_tokens"):
            out["tokens"] = toks
        if n_probs:
            out["completion_probabilities"] = probs
        return out

    @app.post("/tokenize")
    async def tokenize(http: HTTPRequest):
        try:
            body = await body_of(http)
            content = body.get("content")
            if not isinstance(content, str):
                raise APIError(400, "'content' must be a string", "content")
        except APIError as e:
            return error_response(e)
        ids = server.model.vocab.tokenize(content, add_special=bool(body.get("add_special", False)),
                                          parse_special=bool(body.get("parse_special", True)))
        return {"tokens": ids}

    @app.post("/detokenize")
    async def detokenize(http: HTTPRequest):
        try:
            body = await body_of(http)
            toks = body.get("tokens")
            v = server.model.vocab
            if not isinstance(toks, list) or not all(isinstance(t, int) and 0 <= t < v.n_tokens for t in toks):
                raise APIError(400, "'tokens' must be a list of token ids", "tokens")
        except APIError as e:
            return error_response(e)
        return {"content": server.model.vocab.detokenize(toks)}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        m = server.engine.metrics
        tps = m["generated_tokens_total"] / m["decode_seconds_total"] if m["decode_seconds_total"] else 0.0
        lines = [
            "# HELP llampy_requests_total Requests received.", "# TYPE llampy_requests_total counter",
            f"llampy_requests_total {m['requests_total']}",
            "# TYPE llampy_prompt_tokens_total counter", f"llampy_prompt_tokens_total {m['prompt_tokens_total']}",
            "# TYPE llampy_tokens_predicted_total counter",
            f"llampy_tokens_predicted_total {m['generated_tokens_total']}",
            "# TYPE llampy_predicted_tokens_seconds gauge", f"llampy_predicted_tokens_seconds {tps:.3f}",
            "# TYPE llampy_requests_deferred gauge", f"llampy_requests_deferred {server.engine.queue_depth()}",
            "# TYPE llampy_requests_processing gauge", f"llampy_requests_processing {server.engine.busy_slots()}",
            "# TYPE llampy_kv_cache_tokens gauge", f"llampy_kv_cache_tokens {server.engine.kv_used()}",
            "# TYPE llampy_kv_cache_usage_ratio gauge",
            f"llampy_kv_cache_usage_ratio {server.engine.kv_used() / server.engine.n_ctx:.4f}",
        ]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    @app.get("/", response_class=HTMLResponse)
    async def index():
        return HTMLResponse((STATIC / "index.html").read_text(encoding="utf-8"))

    return app
