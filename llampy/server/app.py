"""The OpenAI-compatible HTTP server: routes over one model and the continuous-batching engine (slots.py).

Request handlers only validate, tokenize and wait: all model work happens on the engine thread. Events come back
through ``Handoff`` (a step's events in one ``loop.call_soon_threadsafe``) into one ``ops.Inbox`` per request."""
from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
from pathlib import Path

import numpy as np
from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..llama.batch import Batch
from ..llama.chat import ChatTemplateError, template_from_metadata
from ..llama.context import Context
from ..llama.grammar import Grammar, GrammarError
from ..llama.reasoning import splitter_for
from ..llama.tools import ToolError, chat_plan, tool_call_deltas
from ..llama.model import Model
from ..llama.sampling import Chain
from . import limits, media, oai
from .oai import (APIError, check_fields, check_messages, include_usage, new_id, now, openapi_body, sampling_params,
                  usage)
from .fields import request_options
from .ops import Cors, Draining, Inbox, llamacpp_metrics, log_request
from .render import RenderBudgetError, TemplateRenderer
from .slots import Engine, Event, Request, ShuttingDown
from .completions import MAX_CHOICES

MAX_BODY = 4 << 20          # bytes of one request body
EMBD_CTX = 2048             # tokens of one embedding input
MAX_EMBD_INPUTS = 128       # inputs of one /v1/embeddings request
MAX_EMBD_TOKENS = 8 * EMBD_CTX  # tokens of all the inputs of one request
STATIC = Path(__file__).parent / "static"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DISCONNECT_CHECK = 0.5      # seconds between checks that a request's client is still there


class Server:
    """One model, one engine, and what the routes need to turn requests into token lists."""

    def __init__(self, model_path, n_parallel: int = 4, n_ctx: int = 4096, api_key: str | None = None,
                 alias: str | None = None, tune_process: bool = True, n_threads: int | None = None,
                 slot_save_path=None, prompt_cache=None, progress=None, offload: dict | None = None,
                 mmproj=None, allow_remote_images: bool = False, spec=None, model_draft=None, lora=None,
                 ctx_checkpoints: int = 32, cache_types: dict | None = None, mmproj_offload: bool = True):
        """``slot_save_path``: the folder /slots/{id}?action=save|restore reads and writes (None: those actions
        are refused). ``prompt_cache``: a file of the slots' cached prompts, restored here when it exists (and
        fits this model) and written by ``save_prompt_cache`` at shutdown. ``progress(fraction)``: called as the
        weights load (Model's progress_callback). ``offload``: Model's GPU keywords (n_gpu_layers, split_mode,
        tensor_split, main_gpu, override_tensor). ``mmproj``: a projector GGUF (image input, server/media.py);
        ``mmproj_offload``: the image encoder on the model's first GPU when it has GPU layers (--no-mmproj-offload:
        False); ``allow_remote_images``: fetch http(s) image URLs too. ``spec``: speculative decoding settings
        (llama/speculative.SpecParams); ``model_draft``: the draft model's GGUF (spec type draft-simple).
        ``lora``: (path, scale) pairs of GGUF LoRA adapters (GET/POST /lora-adapters, a request's "lora").
        ``ctx_checkpoints``: recurrent states kept per slot of a recurrent or hybrid model (--ctx-checkpoints)."""
        if tune_process:
            from .. import tuning
            tuning.install()     # before the model's first kernel (llampy/tuning.py)
        self.n_threads = n_threads
        self.slot_save_path = Path(slot_save_path) if slot_save_path else None
        self.prompt_cache = Path(prompt_cache) if prompt_cache else None
        self.model = Model(model_path, n_threads=n_threads, progress_callback=progress, n_ctx_hint=n_ctx,
                           **(offload or {}))
        # an encoder (bert) serves /v1/embeddings and /rerank only; its inputs are bounded by its position table
        self.encoder = not getattr(self.model.arch, "USES_KV_CACHE", True)
        self.embd_n_ctx = min(EMBD_CTX, self.model.hparams.n_ctx_train or EMBD_CTX) if self.encoder else EMBD_CTX
        self._rank_ctx = None
        self.model_id = alias or Path(model_path).stem
        self.names = {self.model_id, Path(model_path).name, Path(model_path).stem, str(model_path), "default"}
        self.mtmd = None
        self.allow_remote_images = allow_remote_images
        if mmproj:
            from ..mtmd import MtmdContext
            self.mtmd = MtmdContext(mmproj, self.model, n_threads=n_threads, use_gpu=mmproj_offload)
        # an image is decoded in one micro-batch (its tokens attend to each other): the batch holds the largest
        n_img = self.mtmd.proj.n_image_tokens(self.mtmd.proj.hparams.image_size,
                                              self.mtmd.proj.hparams.image_size) if self.mtmd else 0
        self.model_draft = None
        if model_draft is not None:
            self.model_draft = Model(model_draft, n_threads=n_threads, n_ctx_hint=n_ctx)
            if spec is None:            # a draft model alone means: draft with it (llama-server's default type)
                from ..llama.speculative import SpecParams
                spec = SpecParams(types=("draft-simple",))
        self.spec = spec
        self.engine = Engine(self.model, n_parallel, n_ctx, min_batch=n_img, spec=spec, draft_model=self.model_draft,
                             n_ctx_checkpoints=ctx_checkpoints, **(cache_types or {}))
        self.engine.mtmd = self.mtmd
        if lora:
            from ..llama.lora import LoraAdapter
            self.engine.set_lora_adapters([LoraAdapter(self.model, p) for p, _ in lora], [p for p, _ in lora],
                                          [sc for _, sc in lora])
        self.api_key = api_key
        self.template = template_from_metadata(self.model.metadata)
        self.renderer = TemplateRenderer()      # chat templates render in child processes, within a budget
        self._check_template()
        self.n_vocab = self.model.hparams.n_vocab
        self._embed_ctx = None
        self.engine.run_job(self._warmup).result()
        self.n_restored = 0
        if self.prompt_cache is not None and self.prompt_cache.is_file():
            from ..llama.state import StateError
            try:
                self.n_restored = self.engine.run_job(lambda: self.engine.load_prompt_cache(self.prompt_cache)).result()
            except StateError as e:      # another model's, or damaged: start without it, say so
                import warnings
                warnings.warn(f"--prompt-cache not restored: {e}", RuntimeWarning, stacklevel=2)
        self.t_start = time.time()

    version = "0.1.0"

    def save_prompt_cache(self) -> int:
        """The slots' cached prompts to --prompt-cache, once the engine thread has stopped (it owns the cache)."""
        if self.prompt_cache is None:
            return 0
        if self.engine.alive():
            import warnings
            warnings.warn("--prompt-cache not written: the engine thread is still running", RuntimeWarning,
                          stacklevel=2)
            return 0
        return self.engine.save_prompt_cache(self.prompt_cache)

    def default_params(self) -> dict:
        """The sampling settings a request gets when it sets none (GET /props)."""
        p = sampling_params({}, self.n_vocab)
        return {k: v for k, v in p.items() if k != "logit_bias"} | {"n_predict": -1, "n_probs": 0}

    def kernel_threads(self) -> int:
        """The threads the engine's kernels run on (Numba's count on the engine thread)."""
        import numba
        return self.engine.run_job(numba.get_num_threads).result(timeout=30)

    def token_text(self, tok) -> str:
        return "" if tok is None else self.model.vocab.token_to_piece(tok).decode("utf-8", errors="replace")

    def supports_infill(self) -> bool:
        fim = self.model.vocab.fim
        return all(fim[k] is not None for k in ("fim_pre", "fim_suf", "fim_mid"))

    def _warmup(self) -> None:
        """One prompt batch and one decode step before the first request (as llama-server does): kernels are
        compiled or loaded from Numba's cache and the common graphs built, so no client pays for it."""
        ctx, sid = self.engine.ctx, 0
        toks = self.model.vocab.tokenize("Hello, world. This warms the kernels up.", add_special=True,
                                         parse_special=False)
        if self.encoder:
            self.embed([toks])
            return
        ctx.decode(Batch.from_tokens(toks, 0, sid))
        ctx.decode(Batch.from_tokens([toks[-1]], len(toks), sid))
        ctx.seq_rm(sid, -1, -1)

    def check_model(self, body: dict) -> None:
        m = body.get("model")
        if m is not None and not isinstance(m, str):
            raise APIError(400, "'model' must be a string", "model")
        if m and m not in self.names:
            raise APIError(404, f"The model '{m}' does not exist; this server serves '{self.model_id}'", "model",
                           code="model_not_found")

    def sampler(self, p: dict, grammar: Grammar | None = None) -> Chain:
        """The request's sampler chain (llampy/llama/sampling.py): every field sampling_params read."""
        from .fields import resolve_logit_bias
        keys = ("typical_p", "min_keep", "top_n_sigma", "xtc_probability", "xtc_threshold", "dynatemp_range",
                "dynatemp_exponent", "repeat_last_n", "mirostat", "mirostat_tau", "mirostat_eta", "dry_multiplier",
                "dry_base", "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers", "samplers")
        bias = resolve_logit_bias(p["logit_bias"], self.model.vocab)
        if p.get("ignore_eos"):         # llama-server bans every end-of-generation token (its logit_bias_eog)
            for t in sorted(self.model.vocab.eog):
                bias[t] = bias.get(t, 0.0) - np.inf
        try:
            return Chain.from_params(temperature=p["temperature"], top_k=p["top_k"], top_p=p["top_p"],
                                     min_p=p["min_p"], repeat_penalty=p["repeat_penalty"],
                                     frequency_penalty=p["frequency_penalty"], presence_penalty=p["presence_penalty"],
                                     logit_bias=bias,
                                     seed=p["seed"], n_vocab=self.n_vocab, grammar=grammar, vocab=self.model.vocab,
                                     **{k: p[k] for k in keys if k in p})
        except ValueError as e:
            raise APIError(400, str(e)) from None

    async def prepare_sampling(self, p: dict) -> None:
        """Work a sampler chain needs once per vocabulary, done off the event loop: DRY's sequence-breaker table
        (~0.5 s over SmolLM2's vocabulary, ~1.5 s over Gemma 3's)."""
        if p.get("dry_multiplier"):
            from ..llama.sampling_dry import DEFAULT_BREAKERS, dry_breakers
            await asyncio.to_thread(dry_breakers, self.model.vocab,
                                    p.get("dry_sequence_breakers") or DEFAULT_BREAKERS)

    async def grammar_sampler(self, g) -> Grammar | None:
        """The Grammar sampler of a compiled grammar (oai.grammar_param, or a tool plan's), built off the event
        loop: the first one builds llguidance's view of the vocabulary (SmolLM2 ~0.7 s, Gemma 3 ~2 s)."""
        if g is None:
            return None
        try:
            return await asyncio.to_thread(Grammar, self.model.vocab, g)
        except GrammarError as e:
            raise APIError(400, str(e), "grammar") from None

    def make_request(self, tokens: list, p: dict, n_probs: int = 0, logprobs: bool = False,
                     param: str = "prompt", grammar: Grammar | None = None, opts: dict | None = None) -> Request:
        """A Request for the engine. ``opts``: fields.request_options' (cache_prompt, id_slot)."""
        if self.encoder:
            raise APIError(501, f"This server's model ({self.model.hparams.arch}) is an encoder: it serves "
                                f"/v1/embeddings and /rerank, not completions", type="not_supported_error")
        if not tokens:
            raise APIError(400, "the prompt is empty", param)
        limit = self.engine.n_ctx_slot
        if len(tokens) >= limit:
            raise APIError(400, f"the prompt has {len(tokens)} tokens, more than fit in the context of a slot "
                                f"({limit}); shorten it or start the server with a larger --ctx-size", param,
                           code="context_length_exceeded")
        max_tokens = p["max_tokens"] or (limit - len(tokens))
        opts = opts or {}
        lora = opts.get("lora")
        n_ad = len(self.engine.lora_adapters)
        if lora is not None and any(i >= n_ad for i in lora):
            raise APIError(400, f"'lora': adapter id {max(lora)} is out of range (the server has {n_ad} LoRA "
                                f"adapter{'' if n_ad == 1 else 's'})", "lora")
        if len(self.engine.alora_ids(self.engine.lora_of(lora))) > 1:
            raise APIError(400, "Cannot run multiple aLoRAs in a single request", "lora")
        shown = {k: v for k, v in p.items() if k != "logit_bias" and v is not None}
        return Request(tokens=tokens, max_tokens=max_tokens, sampler=self.sampler(p, grammar), stop=p["stop"],
                       n_probs=n_probs, logprobs=logprobs or n_probs > 0, ignore_eos=p["ignore_eos"],
                       cache_prompt=opts.get("cache_prompt", True), id_slot=opts.get("id_slot", -1),
                       spec_n_max=opts.get("spec_n_max"), spec_n_min=opts.get("spec_n_min"),
                       spec_p_min=opts.get("spec_p_min"), lora=lora,
                       params={**shown, "n_predict": max_tokens, "n_probs": n_probs})

    def tokenize_prompt(self, prompt) -> list:
        v = self.model.vocab
        if isinstance(prompt, list) and prompt and all(oai._is_int(t) for t in prompt):
            if any(not 0 <= t < v.n_tokens for t in prompt):
                raise APIError(400, "the prompt holds token ids outside the vocabulary", "prompt")
            return list(prompt)
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise APIError(400, "'prompt' must be a string or a list of token ids (one prompt per request)",
                           "prompt")
        limits.check_fits(v, prompt, self.engine.n_ctx_slot, "prompt")
        return v.tokenize(prompt, add_special=True, parse_special=True)

    def tool_plan(self, body: dict, messages: list):
        """The request's tool plan (llampy/llama/tools.py) and the grammar its reply must match (from the tools,
        or the request's grammar/json_schema/response_format)."""
        g = oai.grammar_param(body)
        par = body.get("parallel_tool_calls")
        if par is not None and not isinstance(par, bool):
            raise APIError(400, "'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
        try:
            return chat_plan(self.template, messages, body.get("tools"), body.get("tool_choice"), par,
                             self.model.vocab, g)
        except ToolError as e:
            raise APIError(400, str(e), "tool_choice" if "tool_choice" in str(e) else "tools") from None
        except GrammarError as e:       # a tool's parameters that are no usable schema
            raise APIError(400, f"tools: {e}", "tools") from None

    def _check_template(self) -> None:
        """Refuse at load a chat template that cannot render a short conversation within the render budget, and
        make the in-process probes of tools.py (which render the template once, on a fixed conversation, the
        first time a request carries tool calls) here, under the same time limit."""
        from ..llama.tools import object_arguments
        self.renderer.warm()
        try:
            try:
                self.renderer.render(self.template, [{"role": "user", "content": "Hello"}])
            except RenderBudgetError:
                raise
            except ChatTemplateError:
                pass        # a template may refuse this conversation; a request's own messages will say
            for t in (self.template, self.template.tool_use):
                if t is not None and not _within(self.renderer.seconds, object_arguments, t.source):
                    raise RenderBudgetError(f"took longer than {self.renderer.seconds:g} s to render a "
                                            f"conversation with a tool call")
        except RenderBudgetError as e:
            self.engine.stop()
            self.renderer.close()
            raise ChatTemplateError(f"the model's chat template is refused: {e}") from None

    def render_chat(self, messages: list, tools: list | None = None, kwargs: dict | None = None,
                    add_generation_prompt: bool = True) -> str:
        """The prompt of a chat, rendered in a render process within the time and memory budget (render.py); a
        template that fails or runs over is a 400. Blocks: a route awaits render_chat_async."""
        try:
            return self.renderer.render(self.template, messages, add_generation_prompt=add_generation_prompt,
                                        tools=tools, **(kwargs or {}))
        except ChatTemplateError as e:
            raise APIError(400, f"the chat template rejected the messages: {e}", "messages") from None

    async def render_chat_async(self, messages: list, tools: list | None = None, kwargs: dict | None = None,
                                add_generation_prompt: bool = True) -> str:
        return await self.renderer.run_async(self.render_chat, messages, tools, kwargs, add_generation_prompt)

    async def tokenize_prompt_async(self, prompt) -> list:
        """tokenize_prompt, off the event loop when the prompt is long (limits.run_sized)."""
        return await limits.run_sized(limits.text_size(prompt), self.tokenize_prompt, prompt)

    async def chat_tokens_async(self, text: str) -> list:
        return await limits.run_sized(len(text), self.chat_tokens, None, None, text)

    def chat_tokens(self, messages: list, tools: list | None = None, text: str | None = None) -> list:
        text = self.render_chat(messages, tools) if text is None else text
        v = self.model.vocab
        limits.check_fits(v, text, self.engine.n_ctx_slot, "messages")
        toks = v.tokenize(text, add_special=False, parse_special=True)
        if v.add_bos and v.bos is not None and (not toks or toks[0] != v.bos):
            toks = [v.bos] + toks
        return toks

    def piece(self, tok: int) -> bytes:
        return self.model.vocab.token_to_piece(tok)

    def text(self, tok: int) -> str:
        return self.piece(tok).decode("utf-8", errors="replace")

    def embed(self, toks_list: list) -> list:
        """Pooled, L2-normalised embeddings: an encoder's own pooling (its pooling_type: mean, cls or last), mean
        for the others. Runs on the engine thread (Engine.run_job)."""
        if self._embed_ctx is None:
            pooling = getattr(self.model.hparams, "pooling_type", None)
            pooling = pooling if self.encoder and pooling in ("mean", "cls", "last") else "mean"
            n = self.embd_n_ctx
            self._embed_ctx = Context(self.model, n_ctx=n, n_batch=n, n_ubatch=n, embeddings=True, pooling=pooling,
                                      max_graphs=32)
        out = []
        for toks in toks_list:
            self._embed_ctx.kv_clear()
            self._embed_ctx.decode(Batch.from_tokens(toks, logits_all=True))
            e = self._embed_ctx.get_embeddings_seq(0).astype("float64")
            out.append((e / max(float((e ** 2).sum()) ** 0.5, 1e-12)).tolist())
        return out


    def can_rank(self) -> bool:
        """Whether the model has a classification head for /rerank."""
        return getattr(self.model.arch, "RANK_HEAD", False) and any(
            getattr(self.model, t, None) is not None for t in ("cls", "cls_out"))

    def rank_n_ctx(self) -> int:
        return self.embd_n_ctx

    def rank(self, toks_list: list) -> list:
        """The classification head's first score of each token list (llama-server's rerank). Engine thread."""
        if self._rank_ctx is None:
            n = self.embd_n_ctx
            self._rank_ctx = Context(self.model, n_ctx=n, n_batch=n, n_ubatch=n, embeddings=True, pooling="rank",
                                     max_graphs=32)
        out = []
        for toks in toks_list:
            self._rank_ctx.kv_clear()
            self._rank_ctx.decode(Batch.from_tokens(toks, logits_all=True))
            out.append(float(self._rank_ctx.get_embeddings_seq(0)[0]))
        return out


class Guard:
    """ASGI middleware: the API key (every path but /health and the chat page's files) and the declared body size.
    Plain ASGI rather than BaseHTTPMiddleware, which would sit between streaming responses and disconnects."""

    OPEN = ("/health", "/", "/index.html", "/favicon.ico")

    def __init__(self, app, api_key: str | None):
        self.app, self.api_key = app, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            path = scope["path"]
            err = None
            if self.api_key and path not in self.OPEN and not path.startswith("/static/") \
                    and headers.get("authorization", "") != f"Bearer {self.api_key}":
                err = APIError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'",
                               type="authentication_error", code="invalid_api_key")
            cl = headers.get("content-length", "")
            if err is None and cl.isdigit() and int(cl) > MAX_BODY:
                err = APIError(413, f"the request body ({cl} bytes) is larger than {MAX_BODY} bytes",
                               code="request_too_large")
            if err is not None:
                await JSONResponse(err.body(), status_code=err.status)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def read_json(http: HTTPRequest) -> dict:
    """The body as a JSON object; read in pieces so that an undeclared (chunked) oversized body stops early."""
    raw = bytearray()
    async for part in http.stream():
        raw += part
        if len(raw) > MAX_BODY:
            raise APIError(413, f"the request body is larger than {MAX_BODY} bytes", code="request_too_large")
    body = await limits.parse_json_body(bytes(raw))    # strict: depth, NaN/Infinity, lone surrogates
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def _within(seconds: float, fn, *args) -> bool:
    """Run fn(*args) in a daemon thread; False if it has not returned after ``seconds`` (it is left running:
    only for a caller about to give up, as a server refusing its model)."""
    t = threading.Thread(target=fn, args=args, daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive()


class Handoff:
    """Events from the engine thread to one event loop's queues: put appends to a list, and a burst of them (a step's
    token for every stream) reaches the loop in one callback, so the loop wakes once per step rather than once per
    stream (each call_soon_threadsafe writes to the loop's wake-up pipe). Each queue gets its events in order.

    The engine does not wait for the loop to handle a step's events before its next decode: it was tried (the loop's
    thread then never takes a core from the decode's two kernel threads), and over HTTP the serial wait (1 ms a
    step at 8 streams, 3-5 ms at 32) cost more than the overlap: 8 streams 196 -> 210 tok/s, 32 streams 269 -> 276,
    TTFT p50 at 32 0.31 -> 0.21 s without it (quiet, in turn in one server, three rounds)."""

    _of: dict = {}

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.items: list = []
        self.lock = threading.Lock()
        self.due = False                # a delivery is scheduled and has not yet taken the list

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> "Handoff":
        h = cls._of.get(loop)
        if h is None:
            cls._of = {lp: x for lp, x in cls._of.items() if not lp.is_closed()}     # a test's loops come and go
            h = cls._of[loop] = cls(loop)
        return h

    def put(self, q: Inbox, item) -> None:
        with self.lock:
            self.items.append((q, item))
            if self.due:
                return
            self.due = True
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:            # the loop is closed: nobody waits for these events
            with self.lock:
                self.items, self.due = [], False
            raise

    def _deliver(self) -> None:
        with self.lock:
            items, self.items, self.due = self.items, [], False
        for q, item in items:
            q.put_nowait(item)


def submit(server: Server, req: Request) -> Inbox:
    """Hand the request to the engine; its events arrive on the returned inbox, in this event loop."""
    q = Inbox()
    h = Handoff.of(asyncio.get_running_loop())
    req.emit = lambda ev: h.put(q, ev)
    try:
        server.engine.submit(req)
    except ShuttingDown as e:
        raise APIError(503, str(e), type="unavailable_error") from None
    except ValueError as e:
        raise APIError(400, str(e), "prompt") from None
    return q


async def events(req: Request, q: Inbox, http: HTTPRequest):
    """The engine's events for one request. If the client goes away (or the response is cancelled), the request is
    cancelled and its slot freed at the engine's next step."""
    done, last = False, None
    check_at = time.monotonic() + DISCONNECT_CHECK
    try:
        while True:
            ev = await q.next(DISCONNECT_CHECK)
            # also while events flow: a client waiting for a whole (non-streamed) reply is only seen to leave here
            if ev is None or time.monotonic() >= check_at:
                check_at = time.monotonic() + DISCONNECT_CHECK
                if await http.is_disconnected():
                    return
            if ev is None:
                continue
            done = ev.finish_reason is not None
            if done:
                last = ev
            yield ev
            if done:
                return
    finally:
        q.close()
        if not done:
            req.cancel()
        log_request(http.url.path, req, last, 499 if last is None else (last.status if last.error else 200))


def sse(obj) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


_json_str = json.encoder.encode_basestring      # what json.dumps(a str, ensure_ascii=False) writes


def _json_finish(reason: str | None) -> str:
    return "null" if reason is None else _json_str(reason)


class Chunks:
    """A stream's common chunks written from a template: the fixed head of every chunk (id, object, created, model,
    system_fingerprint) is encoded once, and a token's chunk, one choice with its index, text and finish reason,
    is the head and a few formatted fields, the same bytes as ``sse({**head, "choices": [...]})``, without a dict
    built and walked by the JSON encoder for every token of every stream."""

    def __init__(self, head: dict):
        s = json.dumps({**head, "choices": None}, ensure_ascii=False)
        assert s.endswith(', "choices": null}')
        self.head = head
        self.prefix = "data: " + s[:-len("null}")]

    def text(self, index: int, text: str, finish: str | None) -> bytes:
        """A text completion's choice (logprobs null)."""
        return (f'{self.prefix}[{{"index": {index:d}, "text": {_json_str(text)}, "logprobs": null, '
                f'"finish_reason": {_json_finish(finish)}}}]}}\n\n').encode()

    def delta(self, index: int, content: str | None, finish: str | None) -> bytes:
        """A chat choice whose delta is {"content": content}, or {} for None (logprobs null)."""
        d = "{}" if content is None else f'{{"content": {_json_str(content)}}}'
        return (f'{self.prefix}[{{"index": {index:d}, "delta": {d}, "logprobs": null, '
                f'"finish_reason": {_json_finish(finish)}}}]}}\n\n').encode()


def error_event(ev: Event) -> dict:
    kind = "unavailable_error" if ev.status == 503 else "server_error"
    return {"error": {"message": ev.error, "type": kind, "param": None, "code": ev.status}}


def create_app(server: Server, api_key: str | None = None, cors: dict | None = None) -> FastAPI:
    """The routes over ``server``. ``cors``: ops.Cors' settings (origins, methods, headers, credentials);
    default: origins "localhost"."""
    app = FastAPI(title="llampy", version="0.1.0",
                  description="OpenAI-compatible server of llampy: continuous batching over parallel slots")
    app.state.server = server
    app.add_middleware(Guard, api_key=api_key if api_key is not None else server.api_key)
    app.add_middleware(Draining, server=server)
    app.add_middleware(Cors, **{"origins": "localhost", **(cors or {})})     # outermost: preflights before the key

    @app.exception_handler(APIError)
    async def on_api_error(_, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(e.status_code, str(e.detail), type=kind).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def on_bug(_, e: Exception):  # last resort: a bug still answers with a body, in OpenAI's shape
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error").body(),
                            status_code=500)

    # ------------------------------------------------------------------ OpenAI
    @app.post("/v1/chat/completions", openapi_extra=openapi_body("chat"))
    async def chat_completions(http: HTTPRequest):
        body = await read_json(http)
        check_fields(body, "chat")
        server.check_model(body)
        msgs, bitmaps = media.media_messages(server, check_messages(body))
        p = sampling_params(body, server.n_vocab)
        n_choices = oai.choices_n(body, MAX_CHOICES)
        opts = request_options(body, server.engine.n_parallel)
        await server.prepare_sampling(p)
        want_lp = oai.flag(body, "logprobs")
        n_top = body.get("top_logprobs") or 0
        if not oai._is_int(n_top) or not 0 <= n_top <= 20:
            raise APIError(400, "'top_logprobs' must be an integer between 0 and 20", "top_logprobs")
        if body.get("top_logprobs") is not None and not want_lp:     # as OpenAI and llama-server
            raise APIError(400, "'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
        stream, with_usage = oai.flag(body, "stream"), include_usage(body)
        tp, g = server.tool_plan(body, msgs)
        if want_lp and stream and tp.format != "none":      # a stream with tools is sent when the reply is whole
            raise APIError(400, "'logprobs' is not supported with tools on a stream", "logprobs")
        prompt = await server.render_chat_async(tp.messages, tp.tools, oai.template_kwargs(body))
        # the reply's thinking block goes to reasoning_content (llama.cpp's --reasoning-format, per request here)
        think = splitter_for(tp.source, prompt, oai.reasoning_format(body))
        gs = await server.grammar_sampler(g)
        toks = await (asyncio.to_thread(media.media_tokens, server, prompt, bitmaps, False) if bitmaps
                      else server.chat_tokens_async(prompt))
        if n_choices > 1:               # n replies: a request each (chat_n.py)
            from .chat_n import chat_choices
            gs_list = [gs] + [await server.grammar_sampler(g) for _ in range(n_choices - 1)]
            return await chat_choices(server, http, n_choices, toks, p, gs_list, want_lp, n_top, opts, tp,
                                      lambda: splitter_for(tp.source, prompt, oai.reasoning_format(body)), stream,
                                      with_usage, new_id("chatcmpl"), now())
        req = server.make_request(toks, p, n_top if want_lp else 0, want_lp, "messages", gs, opts)
        req.keep_tokens = tp.keep_tokens      # the format's markers stay in the text, or it cannot be parsed
        q = submit(server, req)
        cid, created = new_id("chatcmpl"), now()
        chunks = Chunks({"id": cid, "object": "chat.completion.chunk", "created": created, "model": server.model_id,
                         "system_fingerprint": "llampy"})

        def lp_entry(ev: Event) -> dict:
            return oai.chat_logprob(server.piece(ev.token), ev.logprob, [(server.piece(i), l) for i, l in ev.top])

        def chunk(choices, **extra) -> dict:
            return {**chunks.head, "choices": choices, **extra}

        if stream and tp.format != "none":
            async def gen_tools():
                """With tools the reply is read whole (a call cannot be told from text until it ends), then sent
                as a content delta and/or one delta per call, and the finish."""
                text = ""
                async for ev in events(req, q, http):
                    if ev.error:
                        yield sse(error_event(ev))
                        break
                    text += ev.text
                    if ev.finish_reason is None:
                        continue
                    reasoning, text = think.split(text) if think else ("", text)
                    content, calls = tp.parse(text)
                    deltas = [{"role": "assistant", "content": content if content or not calls else None}]
                    if reasoning:
                        deltas[0]["reasoning_content"] = reasoning
                    for d in deltas + tool_call_deltas(calls):
                        yield sse(chunk([{"index": 0, "delta": d, "logprobs": None, "finish_reason": None}]))
                    yield sse(chunk([{"index": 0, "delta": {}, "logprobs": None,
                                      "finish_reason": "tool_calls" if calls else ev.finish_reason}]))
                    if with_usage:
                        yield sse(chunk([], usage=usage(ev.n_prompt, ev.n_gen, ev.n_cached)))
                yield b"data: [DONE]\n\n"
            return StreamingResponse(gen_tools(), media_type="text/event-stream", headers=SSE_HEADERS)

        if stream:
            async def gen():
                yield sse(chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}]))
                sp = think
                n_gen = 0
                out = []        # chunks not yet written: the events already waiting go out in one write
                async for ev in events(req, q, http):
                    if ev.error:
                        out.append(sse(error_event(ev)))
                        break
                    n_gen += ev.token is not None
                    delta = {"content": ev.text} if ev.text else {}
                    if sp is not None:
                        r, c = sp.feed(ev.text)
                        if ev.finish_reason is not None:
                            r2, c2 = sp.flush()
                            r, c = r + r2, c + c2
                        delta = {k: v for k, v in (("reasoning_content", r), ("content", c)) if v}
                    if delta or ev.finish_reason or (want_lp and ev.token is not None):
                        lp = {"content": [lp_entry(ev)]} if want_lp and ev.token is not None else None
                        extra = {}
                        if opts["timings_per_token"]:     # llama-server's timings, in every chunk
                            from .native import live_timings
                            extra["timings"] = live_timings(req, n_gen)
                        if lp is None and not extra and delta.keys() <= {"content"}:
                            out.append(chunks.delta(0, delta.get("content"), ev.finish_reason))
                        else:
                            out.append(sse(chunk([{"index": 0, "delta": delta, "logprobs": lp,
                                                   "finish_reason": ev.finish_reason}], **extra)))
                    if ev.finish_reason is not None and with_usage:
                        out.append(sse(chunk([], usage=usage(ev.n_prompt, ev.n_gen, ev.n_cached))))
                    if out and ev.finish_reason is None and q.empty():
                        yield b"".join(out)
                        out.clear()
                out.append(b"data: [DONE]\n\n")
                yield b"".join(out)
            return StreamingResponse(gen(), media_type="text/event-stream", headers=SSE_HEADERS)

        text, lps, last = "", [], None
        async for ev in events(req, q, http):
            if ev.error:
                raise APIError(ev.status, ev.error, type="server_error" if ev.status == 500 else
                               "unavailable_error")
            text += ev.text
            if want_lp and ev.token is not None:
                lps.append(lp_entry(ev))
            last = ev
        if last is None:        # the client went away; nobody reads this
            return JSONResponse({}, status_code=499)
        reasoning, text = think.split(text) if think else ("", text)
        message, finish = {"role": "assistant", "content": text}, last.finish_reason
        if reasoning:
            message["reasoning_content"] = reasoning
        if tp.format != "none":
            content, calls = tp.parse(text)
            message["content"] = (content or None) if calls else content
            if calls:
                message["tool_calls"] = [c.to_openai() for c in calls]
                finish = "tool_calls"
        return {"id": cid, "object": "chat.completion", "created": created, "model": server.model_id,
                "system_fingerprint": "llampy",
                "choices": [{"index": 0, "message": message, "logprobs": {"content": lps} if want_lp else None,
                             "finish_reason": finish}],
                "usage": usage(last.n_prompt, last.n_gen, last.n_cached)}

    from .completions import add_completion_routes
    add_completion_routes(app, server)
    from .rerank import add_rerank_routes
    add_rerank_routes(app, server)

    @app.post("/v1/embeddings", openapi_extra=openapi_body("embeddings"))
    async def embeddings(http: HTTPRequest):
        body = await read_json(http)
        check_fields(body, "embeddings")
        server.check_model(body)
        inp = body.get("input")
        texts = [inp] if isinstance(inp, str) else inp
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise APIError(400, "'input' must be a string or a non-empty list of strings", "input")
        fmt = body.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            raise APIError(400, "'encoding_format' must be 'float' or 'base64'", "encoding_format")
        if len(texts) > MAX_EMBD_INPUTS:
            raise APIError(400, f"'input' has {len(texts)} items; one request embeds at most {MAX_EMBD_INPUTS}",
                           "input")
        for i, t in enumerate(texts):
            limits.check_fits(server.model.vocab, t, server.embd_n_ctx + 1, "input")
        toks = [await limits.run_sized(len(t), server.model.vocab.tokenize, t, True, True) for t in texts]
        for i, t in enumerate(toks):
            if not t:
                raise APIError(400, f"input[{i}] is empty", "input")
            if len(t) > server.embd_n_ctx:
                raise APIError(400, f"input[{i}] has {len(t)} tokens, more than {server.embd_n_ctx}", "input",
                               code="context_length_exceeded")
        if sum(len(t) for t in toks) > MAX_EMBD_TOKENS:
            raise APIError(400, f"the inputs have {sum(len(t) for t in toks)} tokens in all; one request embeds at "
                                f"most {MAX_EMBD_TOKENS}", "input", code="context_length_exceeded")
        vecs = []
        for t in toks:
            # one input per engine job, the next one handed over when this one is done: the generating slots get
            # a decode step between two inputs, and a request that arrives meanwhile waits for one input at most
            vecs += await asyncio.wrap_future(server.engine.run_job(lambda t=t: server.embed([t])))
            if await http.is_disconnected():
                return JSONResponse({}, status_code=499)
        n = sum(len(t) for t in toks)
        if fmt == "base64":     # what the openai client asks for by default: little-endian float32 bytes
            vecs = [base64.b64encode(np.asarray(v, "<f4").tobytes()).decode() for v in vecs]
        return {"object": "list", "model": server.model_id,
                "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vecs)],
                "usage": {"prompt_tokens": n, "total_tokens": n}}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_id, "object": "model", "created": int(server.t_start),
                                            "owned_by": "llampy",
                                            "capabilities": ["completion"] + (["multimodal"] if server.mtmd else []),
                                            "meta": {"n_ctx": server.engine.n_ctx, "n_vocab": server.n_vocab,
                                                     "n_parallel": server.engine.n_parallel}}]}

    # ------------------------------------------------------------------ llama.cpp's native routes
    @app.post("/tokenize", openapi_extra=openapi_body("tokenize"))
    async def tokenize(http: HTTPRequest):
        body = await read_json(http)
        check_fields(body, "tokenize")
        content = body.get("content")
        if not isinstance(content, str):
            raise APIError(400, "'content' must be a string", "content")
        add, parse, pieces = oai.flag(body, "add_special"), body.get("parse_special", True) is not False, \
            oai.flag(body, "with_pieces")

        def work() -> bytes:    # the JSON too: FastAPI's encoder walks a returned dict in Python, item by item
            ids = server.model.vocab.tokenize(content, add_special=add, parse_special=parse)
            out = {"tokens": [{"id": i, "piece": server.text(i)} for i in ids] if pieces else ids}
            return json.dumps(out, ensure_ascii=False).encode()
        return Response(await limits.run_sized(len(content), work), media_type="application/json")

    @app.post("/detokenize", openapi_extra=openapi_body("detokenize"))
    async def detokenize(http: HTTPRequest):
        body = await read_json(http)
        check_fields(body, "detokenize")
        toks = body.get("tokens")
        if not isinstance(toks, list) or not all(oai._is_int(t) and 0 <= t < server.n_vocab for t in toks):
            raise APIError(400, "'tokens' must be a list of token ids of the vocabulary", "tokens")
        return {"content": server.model.vocab.detokenize(toks)}

    from .native import add_native_routes
    add_native_routes(app, server)

    @app.get("/health")
    async def health():
        if not server.engine.alive():
            return JSONResponse({"status": "error", "error": "the engine thread stopped"}, status_code=503)
        return {"status": "ok", "slots_idle": server.engine.n_parallel - server.engine.busy_slots(),
                "slots_processing": server.engine.busy_slots()}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(llamacpp_metrics(server) + prometheus(server),
                                 media_type="text/plain; version=0.0.4")

    # ------------------------------------------------------------------ the chat page
    @app.get("/", include_in_schema=False)
    async def index():
        return FileResponse(STATIC / "index.html", media_type="text/html")

    @app.get("/static/{name}", include_in_schema=False)
    async def static(name: str):
        f = STATIC / name
        if "/" in name or name.startswith(".") or not f.is_file():
            raise APIError(404, f"no file {name!r}", type="not_found_error")
        return FileResponse(f)

    return app


def prometheus(server: Server) -> str:
    e = server.engine
    m = e.metrics
    gen_tps = m["generated_tokens_total"] / m["gen_seconds_total"] if m["gen_seconds_total"] else 0.0
    pp_tps = m["prompt_tokens_total"] / m["prompt_seconds_total"] if m["prompt_seconds_total"] else 0.0
    rows = [
        ("requests_total", "counter", "Completion requests accepted.", m["requests_total"]),
        ("requests_finished_total", "counter", "Requests that ended with stop or length.", m["requests_finished"]),
        ("requests_cancelled_total", "counter", "Requests whose client went away.", m["requests_cancelled"]),
        ("prompt_tokens_total", "counter", "Prompt tokens decoded.", m["prompt_tokens_total"]),
        ("prompt_tokens_cached_total", "counter", "Prompt tokens reused from a slot's cache.",
         m["prompt_tokens_cached"]),
        ("tokens_predicted_total", "counter", "Tokens generated.", m["generated_tokens_total"]),
        ("prompt_tokens_seconds", "gauge", "Prompt tokens per second of decode time.", round(pp_tps, 3)),
        ("predicted_tokens_seconds", "gauge", "Generated tokens per second of decode time.", round(gen_tps, 3)),
        ("predicted_tokens_seconds_recent", "gauge", "Generated tokens per second of wall time, last 10 s.",
         round(e.tokens_per_second(), 3)),
        ("n_decode_total", "counter", "Batches decoded.", m["steps_total"]),
        ("n_busy_slots_per_decode", "gauge", "Mean busy slots per decoded batch.",
         round(m["busy_slot_steps"] / m["steps_total"], 4) if m["steps_total"] else 0.0),
        ("requests_deferred", "gauge", "Requests waiting for a slot (queue depth).", e.queue_depth()),
        ("requests_processing", "gauge", "Busy slots.", e.busy_slots()),
        ("slots_total", "gauge", "Slots (--parallel).", e.n_parallel),
        ("graphs_pending", "gauge",
         "Graphs the engine will still build or run once while idle (decode steps, prompt pieces).",
         e.graphs_pending()),
        ("kv_cache_tokens", "gauge", "KV cache cells in use.", e.kv_used()),
        ("kv_cache_usage_ratio", "gauge", "KV cache cells in use / ctx-size.", round(e.kv_used() / e.n_ctx, 4)),
    ]
    out = []
    for name, kind, help_, v in rows:
        out += [f"# HELP llampy_{name} {help_}", f"# TYPE llampy_{name} {kind}", f"llampy_{name} {v}"]
    return "\n".join(out) + "\n"
