"""llama-server's own routes: /completion and /infill (its response shape), /props, GET /slots and the slot actions
(save, restore, erase), /apply-template; and its fill-in-the-middle prompt layout (``format_infill``)."""
from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse

from ..mtmd.context import DEFAULT_MEDIA_MARKER
from . import limits, media, oai
from .fields import request_options
from .oai import APIError, check_fields, openapi_body, sampling_params
from .slots import Event

_FILENAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,254}")


def fim_tokens(vocab) -> tuple:
    """(fim_pre, fim_suf, fim_mid) of a vocabulary; APIError 501 naming what is missing, as llama-server."""
    miss = [n for n, k in (("prefix", "fim_pre"), ("suffix", "fim_suf"), ("middle", "fim_mid")) if vocab.fim[k] is None]
    if miss:
        raise APIError(501, f"Infill is not supported by this model: {', '.join(miss)} token is missing",
                       type="not_supported_error")
    return vocab.fim["fim_pre"], vocab.fim["fim_suf"], vocab.fim["fim_mid"]


def format_infill(vocab, prefix: str, suffix: str, extra: list, prompt: list, n_batch: int, n_predict: int,
                  n_ctx: int, spm_infill: bool = False) -> list:
    """llama-server's format_prompt_infill: [extra chunks] [BOS] FIM_PRE prefix prompt FIM_SUF suffix FIM_MID
    (suffix first with ``spm_infill``), the prefix kept to 3/4 of a batch (its end), the suffix to the rest (its
    start), the repo-level chunks (``extra``: [{"text", "filename"}], under FIM_REP/FIM_SEP when the vocabulary has
    them) to what the context has left, from their end."""
    def tok(text):
        return vocab.tokenize(text, add_special=False, parse_special=False)
    pre_id, suf_id, mid_id = fim_tokens(vocab)
    rep_id, sep_id = vocab.fim["fim_rep"], vocab.fim["fim_sep"]
    extra_toks: list = []
    if rep_id is not None:
        extra_toks += [rep_id] + tok("myproject\n")
    for chunk in extra:
        if sep_id is not None:
            extra_toks += [sep_id] + tok(chunk.get("filename", "tmp") + "\n")
        else:
            extra_toks += tok("\n\n--- snippet ---\n\n")
        extra_toks += tok(chunk["text"])
    if sep_id is not None:
        extra_toks += [sep_id] + tok("filename\n")
    t_pre, t_suf = tok(prefix), tok(suffix)
    n_pre = min(len(t_pre), 3 * (n_batch // 4))
    n_suf = min(len(t_suf), max(0, n_batch // 4 - (2 + len(prompt))))
    n_extra = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra_toks))
    t_pre = [pre_id] + t_pre[len(t_pre) - n_pre:] + list(prompt)
    t_suf = [suf_id] + t_suf[:n_suf]
    inp, end = (t_suf, t_pre) if spm_infill else (t_pre, t_suf)
    if vocab.add_bos and vocab.bos is not None:
        inp = [vocab.bos] + inp
    return extra_toks[len(extra_toks) - n_extra:] + inp + end + [mid_id]


def infill_batch(n_ctx_slot: int) -> int:
    """The n_batch format_infill sizes the prefix and suffix by: llama-server's default 2048, or half a smaller
    slot (so that room is left for the extra chunks, which llama-server gives n_ctx - n_batch)."""
    return min(2048, n_ctx_slot // 2)


def add_native_routes(app, server) -> None:
    from .app import SSE_HEADERS, error_event, events, read_json, sse, submit

    async def native_completion(http: HTTPRequest, body: dict, tokens: list, param: str = "prompt"):
        """A /completion-shaped reply (llama-server's) to ``tokens``: the text, stop type, token counts, timings,
        the slot; streamed as {"content", "stop"} parts with a final part holding the rest."""
        p = sampling_params(body, server.n_vocab)
        n_probs = body.get("n_probs", 0)
        if not oai._is_int(n_probs) or not 0 <= n_probs <= 100:
            raise APIError(400, "'n_probs' must be an integer between 0 and 100", "n_probs")
        opts = request_options(body, server.engine.n_parallel)
        stream, return_tokens = oai.flag(body, "stream"), oai.flag(body, "return_tokens")
        await server.prepare_sampling(p)
        req = server.make_request(tokens, p, n_probs, n_probs > 0, param,
                                  grammar=await server.grammar_sampler(oai.grammar_param(body)), opts=opts)
        q = submit(server, req)

        def prob(ev: Event) -> dict:
            b = server.piece(ev.token)
            return {"id": ev.token, "token": b.decode("utf-8", errors="replace"), "bytes": list(b),
                    "logprob": ev.logprob,
                    "top_logprobs": [{"id": i, "token": server.text(i), "bytes": list(server.piece(i)),
                                      "logprob": l} for i, l in ev.top]}

        def final(text: str, toks: list, probs: list, last: Event) -> dict:
            t = dict(last.timings or {})
            t.pop("queue_ms", None)
            t.pop("cache_n", None)
            out = {"index": 0, "content": text, "id_slot": last.slot, "stop": True, "model": server.model_id,
                   "tokens_predicted": last.n_gen, "tokens_evaluated": len(req.tokens),
                   "tokens_cached": last.n_cached, "truncated": False,
                   "stop_type": "limit" if last.finish_reason == "length" else "eos",
                   "timings": {"cache_n": last.n_cached, **t}}
            if return_tokens:
                out["tokens"] = toks
            if n_probs:
                out["completion_probabilities"] = probs
            return out

        if stream:
            async def gen():
                n_gen = 0
                async for ev in events(req, q, http):
                    if ev.error:
                        yield sse(error_event(ev))
                        return
                    part = {"index": 0, "content": ev.text, "stop": False}
                    if ev.token is not None:
                        n_gen += 1
                        if return_tokens:
                            part["tokens"] = [ev.token]
                        if n_probs:
                            part["completion_probabilities"] = [prob(ev)]
                    if ev.finish_reason is not None:
                        part = final(ev.text, [], [], ev)
                    elif opts["timings_per_token"]:
                        part["timings"] = live_timings(req, n_gen)
                    yield sse(part)
            return StreamingResponse(gen(), media_type="text/event-stream", headers=SSE_HEADERS)

        text, toks, probs, last = "", [], [], None
        async for ev in events(req, q, http):
            if ev.error:
                raise APIError(ev.status, ev.error, type="server_error" if ev.status == 500 else
                               "unavailable_error")
            text += ev.text
            if ev.token is not None:
                toks.append(ev.token)
                if n_probs:
                    probs.append(prob(ev))
            last = ev
        if last is None:
            return JSONResponse({}, status_code=499)
        return final(text, toks, probs, last)

    @app.post("/completion", openapi_extra=openapi_body("native"))
    @app.post("/completions", include_in_schema=False)
    async def completion(http: HTTPRequest):
        body = await read_json(http)
        check_fields(body, "native")
        if "prompt" not in body:
            raise APIError(400, "'prompt' is required", "prompt")
        mm = media.completion_prompt(server, body["prompt"])
        if mm is not None and mm[1]:              # llama.cpp's {"prompt_string", "multimodal_data"}
            toks = await asyncio.to_thread(media.media_tokens, server, mm[0], mm[1], True, "prompt")
        else:
            toks = await server.tokenize_prompt_async(mm[0] if mm is not None else body["prompt"])
        return await native_completion(http, body, toks)

    @app.post("/infill", openapi_extra=openapi_body("infill"))
    async def infill(http: HTTPRequest):
        """llama-server's fill-in-the-middle: input_prefix, input_suffix, optional input_extra chunks and prompt,
        laid out with the model's FIM tokens (format_infill); a model without them is a 501."""
        body = await read_json(http)
        check_fields(body, "infill")
        vocab = server.model.vocab
        fim_tokens(vocab)
        prefix, suffix = body.get("input_prefix"), body.get("input_suffix")
        for k, v in (("input_prefix", prefix), ("input_suffix", suffix)):
            if not isinstance(v, str):
                raise APIError(400, f"'{k}' is required and must be a string", k)
        prompt = body.get("prompt", "")
        if not isinstance(prompt, str):
            raise APIError(400, "'prompt' must be a string", "prompt")
        extra = body.get("input_extra") or []
        if not isinstance(extra, list) or not all(
                isinstance(c, dict) and isinstance(c.get("text"), str)
                and isinstance(c.get("filename", ""), str) for c in extra):
            raise APIError(400, "'input_extra' must be a list of {\"text\": string, \"filename\": string}",
                           "input_extra")
        n_predict = body.get("n_predict", body.get("max_tokens", -1))
        n_predict = n_predict if oai._is_int(n_predict) else -1
        size = len(prefix) + len(suffix) + len(prompt) + sum(len(c["text"]) for c in extra)
        toks = await limits.run_sized(size, lambda: format_infill(
            vocab, prefix, suffix, extra, vocab.tokenize(prompt, add_special=False, parse_special=True),
            infill_batch(server.engine.n_ctx_slot), n_predict, server.engine.n_ctx_slot))
        return await native_completion(http, body, toks, "input_prefix")

    @app.post("/apply-template", openapi_extra=openapi_body("apply_template"))
    async def apply_template(http: HTTPRequest):
        """The prompt the chat template makes of the messages (and tools), as /v1/chat/completions would feed
        it to the model."""
        body = await read_json(http)
        check_fields(body, "apply_template")
        msgs = oai.check_messages(body)
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise APIError(400, "'tools' must be a list", "tools")
        agp = body.get("add_generation_prompt", True)
        if not isinstance(agp, bool):
            raise APIError(400, "'add_generation_prompt' must be a boolean", "add_generation_prompt")
        kw = oai.template_kwargs(body)
        return {"prompt": await server.render_chat_async(msgs, tools, kw, agp)}

    @app.get("/props")
    async def props():
        e, v = server.engine, server.model.vocab
        return {"default_generation_settings": {"id": 0, "n_ctx": e.n_ctx_slot, "params": server.default_params()},
                "total_slots": e.n_parallel, "model_alias": server.model_id, "model_path": str(server.model.path),
                "chat_template": server.template.source, "bos_token": server.token_text(v.bos),
                "eos_token": server.token_text(v.eos), "modalities": {"vision": server.mtmd is not None, "audio": False},
                "media_marker": server.mtmd.media_marker if server.mtmd else DEFAULT_MEDIA_MARKER,
                "n_ctx": e.n_ctx, "n_threads": await asyncio.to_thread(server.kernel_threads),
                "infill": server.supports_infill(),
                "slot_save_path": str(server.slot_save_path) if server.slot_save_path else None,
                "speculative": _spec_props(server),
                "build_info": f"llampy {server.version}"}

    @app.get("/lora-adapters")
    async def lora_adapters():
        e = server.engine
        out = []
        for i, (ad, p, sc) in enumerate(zip(e.lora_adapters, e.lora_paths, e.lora_scales)):
            entry = {"id": i, "path": p, "scale": sc, "task_name": "", "prompt_prefix": ""}
            inv = ad.alora_invocation_tokens
            if inv:             # an activated LoRA: its invocation sequence, as text and as ids
                v = server.model.vocab
                entry["alora_invocation_string"] = b"".join(v.token_to_piece(t) for t in inv).decode(
                    "utf-8", errors="replace")
                entry["alora_invocation_tokens"] = list(inv)
            out.append(entry)
        return out

    @app.post("/lora-adapters")
    async def set_lora_adapters(http: HTTPRequest):
        """llama-server's: the body [{id, scale}] sets the server's adapter scales (those not listed: 0) for the
        requests admitted from now on; a slot whose cache was computed under other scales starts over."""
        from . import limits
        from .fields import lora_scales
        raw = await http.body()
        if len(raw) > 1 << 20:
            raise APIError(413, "the request body is larger than 1 MiB", code="request_too_large")
        body = await limits.parse_json_body(raw)
        if not isinstance(body, list):
            raise APIError(400, "Request body must be an array")
        scales = lora_scales(body, "body")
        e = server.engine
        bad = [i for i in scales if i >= len(e.lora_adapters)]
        if bad:
            raise APIError(400, f"adapter id {bad[0]} is out of range (the server has {len(e.lora_adapters)} LoRA "
                                f"adapters)", "id")
        await asyncio.wrap_future(e.run_job(lambda: e.set_lora_scales(scales)))
        return {"success": True}

    @app.get("/slots")
    async def slots():
        return server.engine.slots_info()

    @app.post("/slots/{slot_id}")
    async def slot_action(slot_id: int, http: HTTPRequest, action: str = ""):
        """llama-server's slot actions: ``save`` an idle slot's cached prompt (tokens and KV) to a file under
        --slot-save-path, ``restore`` it (into any slot), ``erase`` it."""
        e = server.engine
        if action not in ("save", "restore", "erase"):
            raise APIError(400, f"unknown slot action {action!r}: 'save', 'restore' or 'erase'", "action")
        if action == "erase":
            try:
                n = await asyncio.wrap_future(e.run_job(lambda: e.erase_slot(slot_id)))
            except ValueError as err:
                raise APIError(400, str(err), "id_slot") from None
            return {"id_slot": slot_id, "n_erased": n}
        if server.slot_save_path is None:
            raise APIError(501, "This server does not support slot save/restore: start it with --slot-save-path",
                           type="not_supported_error")
        body = await read_json(http)
        name = body.get("filename")
        if not isinstance(name, str) or not _FILENAME.fullmatch(name) or ".." in name:
            raise APIError(400, "'filename' must be a plain file name (letters, digits, '_', '-', '.')",
                           "filename")
        path = Path(server.slot_save_path) / name
        t0 = time.perf_counter()
        from ..llama.state import StateError
        try:
            if action == "save":
                n, size = await asyncio.wrap_future(e.run_job(lambda: e.save_slot(slot_id, path)))
                return {"id_slot": slot_id, "filename": name, "n_saved": n, "n_written": size,
                        "timings": {"save_ms": (time.perf_counter() - t0) * 1e3}}
            if not path.is_file():
                raise APIError(404, f"no saved slot file {name!r}", "filename", type="not_found_error")
            n, size = await asyncio.wrap_future(e.run_job(lambda: e.restore_slot(slot_id, path)))
        except (StateError, ValueError, OSError) as err:
            raise APIError(400, str(err), "filename" if isinstance(err, (StateError, OSError)) else "id_slot") \
                from None
        return {"id_slot": slot_id, "filename": name, "n_restored": n, "n_read": size,
                "timings": {"restore_ms": (time.perf_counter() - t0) * 1e3}}


def live_timings(req, n: int) -> dict:
    """timings_per_token: llama-server's timings so far (``n`` tokens generated), in a streamed part."""
    now = time.perf_counter()
    t_first = req.t_first or now
    prompt_ms = (t_first - (req.t_start or now)) * 1e3
    predicted_ms = (now - t_first) * 1e3
    return {"prompt_n": len(req.tokens), "prompt_ms": prompt_ms, "predicted_n": n, "predicted_ms": predicted_ms,
            "predicted_per_second": n / predicted_ms * 1e3 if predicted_ms > 0 else 0.0}


def _spec_props(server) -> dict | None:
    """/props' speculative decoding settings (None: no drafting)."""
    sp = server.engine.spec
    if sp is None:
        return None
    out = {"types": list(sp.types), "n_max": sp.n_max, "n_min": sp.n_min, "p_min": sp.p_min,
           "ngram_size_n": sp.ngram_size_n, "ngram_size_m": sp.ngram_size_m}
    if server.model_draft is not None:
        out["model_draft"] = str(server.model_draft.path)
    return out
