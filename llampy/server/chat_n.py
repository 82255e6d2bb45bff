"""/v1/chat/completions with ``n`` > 1: n replies to one prompt, each a request of its own in the engine (they share
the prompt's cached prefix and decode side by side in the slots). Choice j samples with seed + j when a seed is
given (as /v1/completions' choices do), so each choice is the reply a request with that seed gets alone."""
from __future__ import annotations

from fastapi.responses import StreamingResponse

from . import oai
from .completions import merged, submit_all
from .oai import APIError, usage


async def chat_choices(server, http, n, toks, p, gs_list, want_lp, n_top, opts, tp, make_think, stream, with_usage,
                       cid, created):
    """The response of a chat request with n choices. ``gs_list``: a grammar sampler per choice (or Nones);
    ``make_think()``: a new reasoning splitter (or None), one per choice."""
    from .app import SSE_HEADERS, error_event, sse
    reqs = []
    for j in range(n):
        pj = p if j == 0 or p["seed"] is None else {**p, "seed": p["seed"] + j}
        r = server.make_request(toks, pj, n_top if want_lp else 0, want_lp, "messages", gs_list[j], opts)
        r.keep_tokens = tp.keep_tokens
        reqs.append(r)
    q = submit_all(server, reqs)
    thinks = [make_think() for _ in range(n)]

    def lp_entry(ev) -> dict:
        return oai.chat_logprob(server.piece(ev.token), ev.logprob, [(server.piece(i), v) for i, v in ev.top])

    def chunk(choices, **extra) -> dict:
        return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": server.model_id,
                "system_fingerprint": "llampy", "choices": choices, **extra}

    def total(lasts) -> dict:
        return usage(len(toks), sum(ev.n_gen for ev in lasts if ev is not None),
                     max((ev.n_cached for ev in lasts if ev is not None), default=0))

    def message(k, text):
        """(message, finish_reason override or None) of choice k's whole text."""
        reasoning, text = thinks[k].split(text) if thinks[k] else ("", text)
        msg, finish = {"role": "assistant", "content": text}, None
        if reasoning:
            msg["reasoning_content"] = reasoning
        if tp.format != "none":
            content, calls = tp.parse(text)
            msg["content"] = (content or None) if calls else content
            if calls:
                msg["tool_calls"] = [c.to_openai() for c in calls]
                finish = "tool_calls"
        return msg, finish

    if stream:
        from ..llama.tools import tool_call_deltas

        async def gen():
            for k in range(n):
                yield sse(chunk([{"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}]))
            texts, lasts = [""] * n, [None] * n
            async for k, ev in merged(reqs, q, http):
                if ev.error:
                    yield sse(error_event(ev))
                    break
                if ev.finish_reason is not None:
                    lasts[k] = ev
                if tp.format != "none":     # with tools a choice is sent when whole (calls are parsed from it)
                    texts[k] += ev.text
                    if ev.finish_reason is None:
                        continue
                    reasoning, text = thinks[k].split(texts[k]) if thinks[k] else ("", texts[k])
                    content, calls = tp.parse(text)
                    deltas = [{"role": "assistant", "content": content if content or not calls else None}]
                    if reasoning:
                        deltas[0]["reasoning_content"] = reasoning
                    for d in deltas + tool_call_deltas(calls):
                        yield sse(chunk([{"index": k, "delta": d, "logprobs": None, "finish_reason": None}]))
                    yield sse(chunk([{"index": k, "delta": {}, "logprobs": None,
                                      "finish_reason": "tool_calls" if calls else ev.finish_reason}]))
                    continue
                delta = {"content": ev.text} if ev.text else {}
                sp = thinks[k]
                if sp is not None:
                    r, c = sp.feed(ev.text)
                    if ev.finish_reason is not None:
                        r2, c2 = sp.flush()
                        r, c = r + r2, c + c2
                    delta = {key: v for key, v in (("reasoning_content", r), ("content", c)) if v}
                if delta or ev.finish_reason or (want_lp and ev.token is not None):
                    lp = {"content": [lp_entry(ev)]} if want_lp and ev.token is not None else None
                    yield sse(chunk([{"index": k, "delta": delta, "logprobs": lp,
                                      "finish_reason": ev.finish_reason}]))
            else:
                if with_usage:
                    yield sse(chunk([], usage=total(lasts)))
            yield b"data: [DONE]\n\n"
        return StreamingResponse(gen(), media_type="text/event-stream", headers=SSE_HEADERS)

    texts, lps, lasts = [""] * n, [[] for _ in range(n)], [None] * n
    async for k, ev in merged(reqs, q, http):
        if ev.error:
            raise APIError(ev.status, ev.error, type="server_error" if ev.status == 500 else "unavailable_error")
        texts[k] += ev.text
        if want_lp and ev.token is not None:
            lps[k].append(lp_entry(ev))
        if ev.finish_reason is not None:
            lasts[k] = ev
    if any(ev is None for ev in lasts):     # the client went away; nobody reads this
        from fastapi.responses import JSONResponse
        return JSONResponse({}, status_code=499)
    choices = []
    for k in range(n):
        msg, finish = message(k, texts[k])
        choices.append({"index": k, "message": msg, "logprobs": {"content": lps[k]} if want_lp else None,
                        "finish_reason": finish or lasts[k].finish_reason})
    return {"id": cid, "object": "chat.completion", "created": created, "model": server.model_id,
            "system_fingerprint": "llampy", "choices": choices, "usage": total(lasts)}
