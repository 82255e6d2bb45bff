"""Continuous batching: N slots share one KV cache through sequence ids; one engine thread decodes, every step, one
batch holding the next token of every generating slot and a chunk of the prompt of newly admitted requests.

A request arriving while others generate starts at the next step. A slot keeps its prompt's KV and reuses the
common prefix with the next request it serves. A cancelled request (client gone) frees its slot at the next step.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from ..llama.batch import Batch
from ..llama.context import Context
from ..llama.sampling import Chain, top_logprobs
from ..llama.vocab import StreamDecoder

PROMPT_CHUNK = 64   # prompt tokens per slot per step, so that one long prompt does not stall the others


@dataclass
class Request:
    tokens: list
    max_tokens: int
    sampler: Chain
    stop: list = field(default_factory=list)
    n_probs: int = 0
    ignore_eos: bool = False
    # filled by the engine; read by the HTTP side through ``events``
    events: "queue.Queue" = field(default_factory=queue.Queue)
    cancelled: bool = False
    t_arrival: float = field(default_factory=time.perf_counter)

    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class Event:
    """One step of a request: new text (possibly empty), the token, its log-prob, top log-probs; or the end."""
    text: str = ""
    token: int | None = None
    logprob: float | None = None
    top: list = field(default_factory=list)
    finish_reason: str | None = None
    n_prompt: int = 0
    n_gen: int = 0
    error: str | None = None


class Slot:
    def __init__(self, sid: int, n_ctx_slot: int):
        self.id = sid
        self.n_ctx = n_ctx_slot
        self.cached: list[int] = []     # tokens whose K/V are in the cache for this sequence
        self.req: Request | None = None
        self.pending: list[int] = []    # prompt tokens still to decode
        self.n_gen = 0
        self.last_logits = None
        self.dec = None
        self.text = ""
        self.emitted = 0


class Engine:
    def __init__(self, model, n_parallel: int = 4, n_ctx: int = 4096):
        self.model = model
        self.vocab = model.vocab
        self.n_parallel = n_parallel
        self.n_ctx = n_ctx
        self.ctx = Context(model, n_ctx=n_ctx, n_batch=max(512, n_parallel * PROMPT_CHUNK),
                           n_ubatch=max(512, n_parallel * PROMPT_CHUNK), n_seq_max=n_parallel)
        self.slots = [Slot(i, n_ctx // n_parallel) for i in range(n_parallel)]
        self.queue: "queue.Queue[Request]" = queue.Queue()
        self.waiting: list[Request] = []
        self.lock = threading.Lock()
        self.metrics = {"requests_total": 0, "prompt_tokens_total": 0, "generated_tokens_total": 0,
                        "decode_seconds_total": 0.0, "steps_total": 0}
        self._stop = False
        self.thread = threading.Thread(target=self._loop, name="llampy-engine", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------ public
    def submit(self, req: Request) -> Request:
        if len(req.tokens) >= self.slots[0].n_ctx:
            raise ValueError(f"the prompt has {len(req.tokens)} tokens, but a slot's context holds "
                             f"{self.slots[0].n_ctx} (ctx-size {self.n_ctx} / parallel {self.n_parallel})")
        self.metrics["requests_total"] += 1
        self.queue.put(req)
        return req

    def stop(self) -> None:
        self._stop = True
        self.queue.put(None)
        self.thread.join(timeout=5)

    def busy_slots(self) -> int:
        return sum(1 for s in self.slots if s.req is not None)

    def queue_depth(self) -> int:
        return self.queue.qsize() + len(self.waiting)

    def kv_used(self) -> int:
        return self.ctx.kv.n_used()

    # ------------------------------------------------------------------ loop
    def _admit(self) -> None:
        while True:
            try:
                r = self.queue.get_nowait() if any(s.req is not None for s in self.slots) or self.waiting \
                    else self.queue.get(timeout=0.05)
            except queue.Empty:
                break
            if r is None:
                return
            self.waiting.append(r)
        for r in list(self.waiting):
            if r.cancelled:
                self.waiting.remove(r)
                continue
            free = [s for s in self.slots if s.req is None]
            if not free:
                break
            # prefer the free slot whose cached tokens share the longest prefix with this prompt
            slot = max(free, key=lambda s: _common(s.cached, r.tokens))
            self.waiting.remove(r)
            self._start(slot, r)

    def _start(self, slot: Slot, r: Request) -> None:
        n_common = min(_common(slot.cached, r.tokens), len(r.tokens) - 1)
        self.ctx.seq_rm(slot.id, n_common, -1)
        slot.cached = list(r.tokens[:n_common])
        slot.pending = list(r.tokens[n_common:])
        slot.req, slot.n_gen, slot.text, slot.emitted = r, 0, "", 0
        slot.dec = StreamDecoder(self.vocab, special=False)
        self.metrics["prompt_tokens_total"] += len(slot.pending)

    def _finish(self, slot: Slot, reason: str, text: str = "") -> None:
        r = slot.req
        r.events.put(Event(text=text, finish_reason=reason, n_prompt=len(r.tokens), n_gen=slot.n_gen))
        slot.req = None

    def _loop(self) -> None:
        while not self._stop:
            self._admit()
            for s in self.slots:
                if s.req is not None and s.req.cancelled:
                    s.req = None            # the client went away: free the slot
            active = [s for s in self.slots if s.req is not None]
            if not active:
                continue
            batch = Batch.empty()
            rows = {}
            for s in active:
                if s.pending:
                    chunk, s.pending = s.pending[:PROMPT_CHUNK], s.pending[PROMPT_CHUNK:]
                    for j, t in enumerate(chunk):
                        last = not s.pending and j == len(chunk) - 1
                        batch.add(t, len(s.cached) + j, [s.id], last)
                        if last:
                            rows[s.id] = len(batch) - 1
                    s.cached.extend(chunk)
                else:
                    batch.add(s.next_token, len(s.cached), [s.id], True)
                    rows[s.id] = len(batch) - 1
                    s.cached.append(s.next_token)
            t0 = time.perf_counter()
            try:
                self.ctx.decode(batch)
            except Exception as e:  # never leave a request hanging: fail the ones in this batch
                for s in active:
                    s.req.events.put(Event(error=f"decode failed: {e}", finish_reason="error"))
                    s.req = None
                    s.cached = []
                    self.ctx.seq_rm(s.id, -1, -1)
                continue
            self.metrics["decode_seconds_total"] += time.perf_counter() - t0
            self.metrics["steps_total"] += 1
            for s in active:
                if s.id in rows:
                    self._step(s, self.ctx.get_logits_ith(rows[s.id]))

    def _step(self, s: Slot, logits: np.ndarray) -> None:
        r = s.req
        tok = int(r.sampler.sample(logits))
        r.sampler.accept(tok)
        x = logits.astype(np.float64)
        lse = x.max() + np.log(np.exp(x - x.max()).sum())
        lp = float(x[tok] - lse)
        top = top_logprobs(logits, r.n_probs) if r.n_probs else []
        s.n_gen += 1
        self.metrics["generated_tokens_total"] += 1
        if self.vocab.is_eog(tok) and not r.ignore_eos:
            s.n_gen -= 1
            self._finish(s, "stop", s.text[s.emitted:] + s.dec.flush())
            return
        s.text += s.dec.feed(tok)
        hit = -1
        for st in r.stop:
            p = s.text.find(st, max(0, s.emitted - len(st)))
            if p >= 0 and (hit < 0 or p < hit):
                hit = p
        if hit >= 0:
            r.events.put(Event(text=s.text[s.emitted:hit], token=tok, logprob=lp, top=top))
            self._finish(s, "stop")
            return
        safe = len(s.text)
        for st in r.stop:
            for k in range(min(len(st) - 1, len(s.text)), 0, -1):
                if s.text.endswith(st[:k]):
                    safe = min(safe, len(s.text) - k)
                    break
        r.events.put(Event(text=s.text[s.emitted:safe], token=tok, logprob=lp, top=top))
        s.emitted = safe
        if s.n_gen >= r.max_tokens or len(s.cached) + 1 >= s.n_ctx:
            self._finish(s, "length", s.text[s.emitted:] + s.dec.flush())
            return
        s.next_token = tok


def _common(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
