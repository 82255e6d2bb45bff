"""OpenAI's /v1/completions: one prompt or a list of them, ``n`` choices each (choice index = prompt * n + j, all
decoded side by side in the slots), ``echo`` (the prompt before its completion; with ``logprobs``, the prompt
tokens' log-probs too, the first null, as OpenAI's; then max_tokens may be 0, the prompt scored alone), ``suffix``
(fill-in-the-middle, laid out as llama-server's /infill), log-probs with ``text_offset`` in every streamed chunk."""
from __future__ import annotations

import asyncio

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse

from . import limits, oai
from .fields import request_options
from .native import format_infill, infill_batch
from .oai import APIError, check_fields, include_usage, new_id, now, openapi_body, sampling_params, usage
from .ops import Inbox, log_request

MAX_CHOICES = 64           # prompts x n of one request


def split_prompts(prompt, n_vocab: int) -> list:
    """OpenAI's prompt forms: a string, a list of token ids, a list of strings and/or token-id lists (one prompt
    each)."""
    def ids_ok(x):
        return isinstance(x, list) and x and all(oai._is_int(t) for t in x)
    if isinstance(prompt, str) or ids_ok(prompt):
        out = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or ids_ok(p) for p in prompt):
        out = list(prompt)
    else:
        raise APIError(400, "'prompt' must be a string, a list of token ids, or a list of strings and token-id "
                            "lists", "prompt")
    for p in out:
        if isinstance(p, list) and any(not 0 <= t < n_vocab for t in p):
            raise APIError(400, "the prompt holds token ids outside the vocabulary", "prompt")
    return out


def add_completion_routes(app, server) -> None:
    from .app import SSE_HEADERS, Chunks, error_event, read_json, sse

    @app.post("/v1/completions", openapi_extra=openapi_body("completion"))
    async def completions(http: HTTPRequest):
        body = await read_json(http)
        check_fields(body, "completion")
        server.check_model(body)
        if "prompt" not in body:
            raise APIError(400, "'prompt' is required", "prompt")
        vocab = server.model.vocab
        prompts = split_prompts(body["prompt"], server.n_vocab)
        n = oai.choices_n(body, MAX_CHOICES)
        if len(prompts) * n > MAX_CHOICES:
            raise APIError(400, f"{len(prompts)} prompts x n={n} choices is more than {MAX_CHOICES}", "n")
        echo = oai.flag(body, "echo")
        zero = echo and body.get("max_tokens") == 0          # score the prompt, generate nothing
        p = sampling_params({**body, "max_tokens": None} if zero else body, server.n_vocab)
        n_lp = body.get("logprobs")
        n_lp = 0 if n_lp is None else n_lp
        if not oai._is_int(n_lp) or not 0 <= n_lp <= 20:
            raise APIError(400, "'logprobs' must be an integer between 0 and 20", "logprobs")
        want_lp = body.get("logprobs") is not None
        stream, with_usage = oai.flag(body, "stream"), include_usage(body)
        opts = request_options(body, server.engine.n_parallel)
        suffix = body.get("suffix")
        if suffix is not None and not isinstance(suffix, str):
            raise APIError(400, "'suffix' must be a string", "suffix")
        if suffix is not None and not server.supports_infill():
            raise APIError(400, "'suffix' needs a model with fill-in-the-middle tokens; this one has none",
                           "suffix")
        toks, shown = [], []
        for pr in prompts:
            if suffix is not None:          # fill in the middle: the prompt is the text before, suffix after
                if not isinstance(pr, str):
                    raise APIError(400, "'suffix' needs text prompts", "suffix")
                limit = server.engine.n_ctx_slot
                toks.append(await limits.run_sized(len(pr) + len(suffix), lambda: format_infill(
                    vocab, pr, suffix, [], [], infill_batch(limit), p["max_tokens"] or -1, limit)))
            else:
                toks.append(await server.tokenize_prompt_async(pr))
            shown.append(pr if isinstance(pr, str) else vocab.detokenize(pr))
        await server.prepare_sampling(p)
        g = oai.grammar_param(body)
        reqs = []
        for i, t in enumerate(toks):
            for j in range(n):
                pj = p if j == 0 or p["seed"] is None else {**p, "seed": p["seed"] + j}
                r = server.make_request(t, pj, n_lp, want_lp, grammar=await server.grammar_sampler(g), opts=opts)
                if zero:
                    r.max_tokens = 0
                if echo and want_lp:
                    r.prompt_logprobs = n_lp
                reqs.append(r)
        q = submit_all(server, reqs)
        cid, created = new_id("cmpl"), now()
        chunks = Chunks({"id": cid, "object": "text_completion", "created": created, "model": server.model_id,
                         "system_fingerprint": "llampy"})

        def lp_obj(entries, offset0=0):
            """entries: [(token, logprob or None, top [(id, logprob)] or None)]"""
            return oai.completion_logprobs([server.text(t) for t, _, _ in entries], [lp for _, lp, _ in entries],
                                           [None if top is None else [(server.text(i), v) for i, v in top]
                                            for _, _, top in entries], offset0)

        def prompt_entries(ev):
            return [(t, lp, None if lp is None else top) for t, lp, top in ev.prompt_logprobs]

        def chunk(choices, **extra) -> dict:
            return {**chunks.head, "choices": choices, **extra}

        def total_usage(lasts):
            n_prompt = sum(len(t) for t in toks)
            return usage(n_prompt, sum(ev.n_gen for ev in lasts if ev is not None),
                         sum(ev.n_cached for ev in lasts if ev is not None))

        if stream:
            async def gen():
                offsets = [0] * len(reqs)
                lasts = [None] * len(reqs)
                echoed = [not echo] * len(reqs)
                out = []        # chunks not yet written: the events already waiting go out in one write
                n_open = len(reqs)
                async for k, ev in merged(reqs, q, http):
                    if ev.error:
                        out.append(sse(error_event(ev)))
                        break
                    if not echoed[k]:       # echo: the prompt first (with its log-probs, when asked)
                        echoed[k] = True
                        lp = lp_obj(prompt_entries(ev)) if ev.prompt_logprobs is not None else None
                        out.append(sse(chunk([{"index": k, "text": shown[k // n], "logprobs": lp,
                                               "finish_reason": None}])))
                        if ev.prompt_logprobs is not None:
                            offsets[k] = sum(len(server.text(t)) for t, _, _ in ev.prompt_logprobs)
                            if q.empty():
                                yield b"".join(out)
                                out.clear()
                            continue
                    if ev.finish_reason is not None:
                        lasts[k] = ev
                        n_open -= 1
                    if ev.text or ev.finish_reason or (want_lp and ev.token is not None):
                        if want_lp and ev.token is not None:
                            lp = lp_obj([(ev.token, ev.logprob, ev.top)], offsets[k])
                            offsets[k] += len(server.text(ev.token))
                            out.append(sse(chunk([{"index": k, "text": ev.text, "logprobs": lp,
                                                   "finish_reason": ev.finish_reason}])))
                        else:
                            out.append(chunks.text(k, ev.text, ev.finish_reason))
                    if out and n_open and q.empty():
                        yield b"".join(out)
                        out.clear()
                else:
                    if with_usage:
                        out.append(sse(chunk([], usage=total_usage(lasts))))
                out.append(b"data: [DONE]\n\n")
                yield b"".join(out)
            return StreamingResponse(gen(), media_type="text/event-stream", headers=SSE_HEADERS)

        texts = [""] * len(reqs)
        entries: list = [[] for _ in reqs]
        lasts = [None] * len(reqs)
        async for k, ev in merged(reqs, q, http):
            if ev.error:
                raise APIError(ev.status, ev.error, type="server_error" if ev.status == 500 else "unavailable_error")
            if ev.prompt_logprobs is not None:
                entries[k] = prompt_entries(ev) + entries[k]
                continue
            texts[k] += ev.text
            if ev.token is not None:
                entries[k].append((ev.token, ev.logprob, ev.top))
            if ev.finish_reason is not None:
                lasts[k] = ev
        if any(ev is None for ev in lasts):
            return JSONResponse({}, status_code=499)
        if echo:
            texts = [shown[k // n] + t for k, t in enumerate(texts)]
        return chunk([{"index": k, "text": texts[k], "logprobs": lp_obj(entries[k]) if want_lp else None,
                       "finish_reason": lasts[k].finish_reason} for k in range(len(reqs))],
                     usage=total_usage(lasts))


def submit_all(server, reqs: list) -> Inbox:
    """Hand every request to the engine; their events arrive on one inbox as (index, event)."""
    from .app import Handoff
    from .slots import ShuttingDown
    h = Handoff.of(asyncio.get_running_loop())
    q = Inbox()
    for k, r in enumerate(reqs):
        r.emit = (lambda k: lambda ev: h.put(q, (k, ev)))(k)
        try:
            server.engine.submit(r)
        except (ShuttingDown, ValueError) as e:
            for done in reqs[:k]:
                done.cancel()
            if isinstance(e, ShuttingDown):
                raise APIError(503, str(e), type="unavailable_error") from None
            raise APIError(400, str(e), "prompt") from None
    return q


async def merged(reqs: list, q: Inbox, http: HTTPRequest):
    """(index, event) of several requests until each has finished. If the client goes away (or the response is
    cancelled), the unfinished ones are cancelled; each request gets its log line."""
    lasts = [None] * len(reqs)
    try:
        while any(ev is None for ev in lasts):
            item = await q.next(0.5)
            if item is None:
                if await http.is_disconnected():
                    return
                continue
            k, ev = item
            if ev.finish_reason is not None:
                lasts[k] = ev
            yield k, ev
            if ev.error:
                return
    finally:
        q.close()
        for r, last in zip(reqs, lasts):
            if last is None:
                r.cancel()
            log_request(http.url.path, r, last, 499 if last is None else (last.status if last.error else 200))
