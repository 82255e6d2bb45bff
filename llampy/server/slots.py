"""Continuous batching: N slots share one KV cache through sequence ids; one engine thread decodes, every step, one
batch holding the next token of every generating slot and chunks of the prompts of newly admitted requests.

A request arriving while others generate starts at the next step. A slot keeps its prompt's KV and reuses the
common prefix with the next request it serves. A cancelled request (client gone) frees its slot at the next step.
The engine thread is the only one that touches the Context; everything else talks to it through queues, and
every failure ends in an event for the request concerned, so no request waits forever and no slot stays busy.
"""
from __future__ import annotations

import concurrent.futures as cf
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..llama.batch import Batch
from ..llama.context import PAD_BELOW, Context
from ..llama.sampling import Chain, sample_rows, top_logprobs, top_positions
from ..llama.speculative import DraftPlanner, DraftRate, Drafters, SpeculativeError, cap_rows, exact_rows
from ..llama.vocab import StreamDecoder

# A prompt is decoded in chunks of this many tokens, one per step, so that the slots already generating get a token
# every step (a chunk's worth of delay each).
PROMPT_BUDGET = 64
# Chunks of the prompts of this many slots at most share a step (llama-server fills each step up to n_batch with
# every prompt's tokens): requests arriving together all start within the same steps, instead of each waiting for
# the whole prompts of those before it (the first ones would finish before the last ones had a token).
PROMPT_SLOTS_PER_STEP = 8
# Requests that clients send together reach the engine one after another, as the HTTP side parses each (~1 ms
# apiece at 32 at once). An idle engine that started a step on the first of them would take the others only in the
# next step, after that one: their first token two steps away instead of one. So when a request finds the engine
# idle, it admits the requests that follow within GATHER_GAP_S of each other, for GATHER_MAX_S at most, before the
# first step (llama-server takes every waiting prompt into one batch; a lone request waits GATHER_GAP_S).
GATHER_GAP_S = 0.003
GATHER_MAX_S = 0.05
# llama-server's --ctx-checkpoints default: checkpoints kept per slot of a recurrent or hybrid model
N_CTX_CHECKPOINTS = 32
# a checkpoint is also taken this many tokens before a prompt's end (llama-server's last checkpoint_offsets entry):
# the next turn's prompt often re-renders the end of this one (a chat template's generation prompt)
CHECKPOINT_TAIL = 4


@dataclass
class Event:
    """One step of a request: new text (possibly empty), the token, its log-prob, top log-probs; or the end."""
    text: str = ""
    token: int | None = None
    logprob: float | None = None
    top: list = field(default_factory=list)
    finish_reason: str | None = None        # "stop" | "length" on the last event, "error" with ``error``
    n_prompt: int = 0
    n_gen: int = 0
    n_cached: int = 0                       # prompt tokens whose KV was reused from the slot's previous request
    error: str | None = None
    status: int = 500                       # the HTTP status an error maps to (503: the server is shutting down)
    slot: int = -1                          # on the last event: the slot that served the request
    timings: dict | None = None             # on the last event: llama-server's timings (Engine._timings)
    # once, before the first generated token, when the request asked for them (prompt_logprobs >= 0):
    # [(token, logprob or None for the first, [(id, logprob)] top)] for every prompt token
    prompt_logprobs: list | None = None


@dataclass
class Request:
    tokens: list
    max_tokens: int
    sampler: Chain
    stop: list = field(default_factory=list)
    n_probs: int = 0                        # top log-probs per token
    logprobs: bool = False                  # the sampled token's log-prob
    ignore_eos: bool = False
    keep_tokens: frozenset = frozenset()    # control tokens whose text the reply keeps (tool-call markers)
    # How events reach the client. The HTTP side replaces it with a thread-safe hand-off to its event loop;
    # the default queue serves synchronous callers (tests, scripts).
    emit: Callable[[Event], None] | None = None
    events: "queue.Queue[Event]" = field(default_factory=queue.Queue)
    cancelled: bool = False
    t_arrival: float = field(default_factory=time.perf_counter)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    cache_prompt: bool = True               # reuse the slot's cached prefix (llama-server's cache_prompt)
    id_slot: int = -1                       # the slot to run in (-1: any; llama-server's id_slot)
    prompt_logprobs: int = -1               # >= 0: the prompt tokens' log-probs with this many top ones (echo)
    params: dict = field(default_factory=dict)      # the request's settings, as GET /slots shows them
    # llama-server's speculative.n_max / n_min / p_min for this request (None: the server's settings; n_max 0: no
    # drafting)
    spec_n_max: int | None = None
    spec_n_min: int | None = None
    spec_p_min: float | None = None
    lora: dict | None = None                # llama-server's per-request lora: {adapter id: scale}, others 0
    t_start: float = 0.0                    # admitted to a slot
    t_first: float = 0.0                    # the prompt decoded (the first token sampled)

    def __post_init__(self):
        if self.emit is None:
            self.emit = self.events.put

    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class Checkpoint:
    """A slot's recurrent state after its first ``n_tokens`` cached tokens (llama-server's context checkpoint)."""
    n_tokens: int
    tokens: tuple                   # those tokens: restored only for a prompt (and a cache) that starts with them
    state: dict                     # Context.state_seq_get_partial

    @property
    def nbytes(self) -> int:
        return sum(np.asarray(a).nbytes for a in self.state.values())


class Slot:
    def __init__(self, sid: int, n_ctx_slot: int):
        self.id = sid
        self.n_ctx = n_ctx_slot
        self.cached: list[int] = []     # tokens whose K/V are in the cache for this sequence, in order
        self.req: Request | None = None
        self.pending: list[int] = []    # prompt tokens still to decode
        self.next_token = -1            # sampled, not yet decoded
        self.n_gen = 0
        self.n_reused = 0
        self.dec: StreamDecoder | None = None
        self.text = ""
        self.emitted = 0                # chars of ``text`` already sent
        self.prompt_lps: list = []      # the prompt tokens' log-probs so far (Request.prompt_logprobs)
        self.n_draft = 0                # drafted tokens checked for this request, and those accepted
        self.n_draft_acc = 0
        self.draft_rate = DraftRate()   # how often this request's drafts are right (DraftPlanner)
        self.lora: tuple = ()           # the LoRA scales its cached K/V were computed with
        self.alora_from = 0             # an aLoRA request: its first tokens up to this one decode without adapters
        self.checkpoints: list[Checkpoint] = []     # oldest first; each one's tokens prefix ``cached``
        # M-RoPE: (the cached list, items counted, positions they save) so that Engine._pos counts only what was
        # appended since (an image's tokens share one position: the item count is not the position)
        self.pos_memo: tuple | None = None


class Engine:
    def __init__(self, model, n_parallel: int = 4, n_ctx: int = 4096, prompt_budget: int = PROMPT_BUDGET,
                 min_batch: int = 0, spec=None, draft_model=None, n_ctx_checkpoints: int = N_CTX_CHECKPOINTS,
                 step_budget: int | None = None, type_k=None, type_v=None):
        """``prompt_budget``: the tokens of a prompt's chunk; ``step_budget``: prompt tokens of all slots together
        per step (default: the chunks of min(n_parallel, PROMPT_SLOTS_PER_STEP) slots). ``min_batch``: the
        micro-batch holds at least this many tokens (the projector's largest image, whose tokens are decoded
        together). ``spec``: speculative.SpecParams (None: no drafting); ``draft_model``: the
        Model that drafts when spec.types holds draft-simple. ``n_ctx_checkpoints``: the recurrent states a slot
        keeps of a recurrent or hybrid model (llama-server's --ctx-checkpoints; 0: none), so that a prompt sharing
        a prefix with the slot's cache restarts from the last one inside it rather than from the start."""
        if n_ctx_checkpoints < 0:
            raise ValueError(f"ctx-checkpoints must be 0 or more, got {n_ctx_checkpoints}")
        if n_parallel < 1:
            raise ValueError(f"parallel must be at least 1, got {n_parallel}")
        if n_ctx // n_parallel < 8:
            raise ValueError(f"ctx-size {n_ctx} leaves fewer than 8 tokens per slot with {n_parallel} slots")
        self.model = model
        self.vocab = model.vocab
        self.n_parallel = n_parallel
        self.n_ctx = n_ctx
        self.prompt_budget = max(1, prompt_budget)
        self.step_budget = max(self.prompt_budget, step_budget if step_budget is not None
                               else self.prompt_budget * min(n_parallel, PROMPT_SLOTS_PER_STEP))
        self.spec = spec if spec is not None and spec.enabled() else None
        self.drafters = None
        spec_cap = 0                    # the longest draft: a step's batch holds it after each slot's token
        if self.spec is not None:
            spec_cap = self.spec.cap()
            if not getattr(model.arch, "USES_KV_CACHE", True) or _recurrent(model):
                raise SpeculativeError(f"speculative decoding needs a model whose cache can drop rejected drafts; "
                                       f"{model.hparams.arch} keeps a recurrent state or no cache")
        n_batch = max(self.step_budget + n_parallel * (1 + spec_cap), min_batch)
        # a micro-batch: one prompt chunk, or the step's tokens of generating slots, or pieces of both together
        # (KVCache.split); an image's tokens in one
        n_ubatch = max(self.prompt_budget + n_parallel * (1 + spec_cap), min_batch)
        self.mtmd = None                # a MtmdContext when the server takes images (its prompts hold ImagePos)
        # graphs are cached per (tokens, outputs, kv) shape, so keep more; decode steps read the whole cache
        # (n_kv padded to it), so theirs differ only in the batch size; so do the short pieces of prompts that share
        # micro-batches, padded to a few sizes (Context's pad_ubatch: the same bits, fewer graphs to build)
        # one KV stream per slot (llama-server's default, kv_unified off): a request's result does not depend on
        # where earlier requests left cells in the cache
        self.ctx = Context(model, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_seq_max=n_parallel,
                           max_graphs=2 * n_parallel + 64 + (PAD_BELOW if spec_cap else 0), kv_pad_decode=n_ctx,
                           kv_unified=False, pad_ubatch=True,
                           **{k: v for k, v in (("type_k", type_k), ("type_v", type_v)) if v is not None},
                           embeddings=not getattr(model.arch, "USES_KV_CACHE", True))   # an encoder: no LM head
        self.slots = [Slot(i, n_ctx // n_parallel) for i in range(n_parallel)]
        # only a memory that cannot cut a suffix needs them (a KV cache answers seq_rm at any position)
        self.n_ctx_checkpoints = n_ctx_checkpoints if _recurrent(model) else 0
        # LoRA adapters (set_lora_adapters): the server's scales (POST /lora-adapters), and the turn of the scale
        # sets when requests of several are active (one set per decode step)
        self.lora_adapters: list = []
        self.lora_paths: list = []
        self.lora_scales: list = []
        self._lora_turn = 0
        self.planner = None
        self.exact_rows = None          # a step that checks drafts holds at most this many rows (None: any number)
        if self.spec is not None:
            self.drafters = Drafters(self.spec, model.vocab, n_ctx, n_parallel, draft_model)
            if self.spec.plan:
                self.planner = DraftPlanner()
            # where a batch's rows do not get a single step's bits (K-quant products from 4 rows), a step that would
            # have held no more rows than that without drafts holds no more with them: a lone request's greedy reply
            # stays the one it gets without drafting (several requests at once already share such batches)
            self.exact_rows = exact_rows(self.ctx, 0)
        # graphs built while idle: the largest batch first (its buffers then hold every smaller graph's, which
        # would otherwise move them), then a decode step of every number of generating slots; then, for a server
        # of PROMPT_SLOTS_PER_STEP slots or more, the padded shapes of short prompt pieces beside generating slots
        # (Context.pad_shapes: ~40 graphs at 32 slots, a few seconds of CPU while idle, so that requests arriving
        # together do not wait for them; a smaller server sees few of them and builds them as they come)
        self._to_reserve = [(n_batch, n_parallel)] + [(k, k) for k in range(n_parallel, 0, -1)]
        if self.spec is not None:
            # and the steps that check drafts: every generating slot's token and its draft, all rows outputs (up to
            # the micro-batches Context pads and keeps on the decode step's path), so that the planner's first try
            # of a size does not wait for its graph
            top = min(n_parallel * (1 + spec_cap), n_ubatch, PAD_BELOW - 1)
            self._to_reserve += [(k, k) for k in range(n_parallel + 1, top + 1)]
        self._pad_shapes_due = n_parallel >= PROMPT_SLOTS_PER_STEP
        # then every kept graph placed again (Context.place): those reserved before a later one made a buffer grow
        # move now, while idle, not at their first step
        self._to_place: list | None = None
        # then, while the cache is still empty, every kept graph run once (Context.warm): a shape's first run loads
        # its kernels, its second binds its fast run (a decode step of 32 slots: 250, 166, then ~125 ms)
        self._to_warm: list = []
        self.inbox: "queue.Queue" = queue.Queue()   # Requests, and jobs (callables) to run on this thread
        self.waiting: list[Request] = []
        self.metrics = {"requests_total": 0, "requests_finished": 0, "requests_cancelled": 0,
                        "prompt_tokens_total": 0, "prompt_tokens_cached": 0, "generated_tokens_total": 0,
                        "decode_seconds_total": 0.0, "prompt_seconds_total": 0.0, "gen_seconds_total": 0.0,
                        "steps_total": 0, "busy_slot_steps": 0, "n_tokens_max": 0,
                        "draft_tokens_total": 0, "draft_tokens_accepted": 0, "draft_steps_total": 0,
                        "draft_seconds_total": 0.0, "checkpoints_restored": 0}
        self._recent: list[tuple[float, int]] = []   # (time, tokens generated) per step, for a live tokens/s
        self._stop = False
        self.draining = False           # set by begin_drain: new requests are refused
        self.thread = threading.Thread(target=self._loop, name="llampy-engine", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------ public (any thread)
    def set_lora_adapters(self, adapters, paths, scales) -> None:
        """The LoRA adapters requests may use (llama-server's --lora / --lora-scaled), with the server's scales."""
        self.lora_adapters, self.lora_paths = list(adapters), [str(p) for p in paths]
        self.lora_scales = [float(x) for x in scales]

    def set_lora_scales(self, scales: dict) -> None:
        """POST /lora-adapters: the listed adapters take their scale, the others 0 (construct_lora_list); requests
        admitted from now on use them. Call through run_job."""
        self.lora_scales = [float(scales.get(i, 0.0)) for i in range(len(self.lora_adapters))]

    def lora_of(self, lora: dict | None) -> tuple:
        """A request's adapter scales: its "lora" ({id: scale}, the others 0), else the server's."""
        if lora is None:
            return tuple(self.lora_scales)
        return tuple(float(lora.get(i, 0.0)) for i in range(len(self.lora_adapters)))

    def _lora_of(self, r: Request) -> tuple:
        return self.lora_of(r.lora)

    def alora_ids(self, lora: tuple) -> list:
        """The adapters enabled in ``lora`` when all of them are activated LoRAs (llama-server's lora_all_alora),
        else []."""
        on = [i for i, sc in enumerate(lora) if sc != 0.0]
        return on if on and all(self.lora_adapters[i].alora_invocation_tokens for i in on) else []

    def _lora_now(self, s: Slot) -> tuple:
        """The scales the slot's next tokens decode with: none before an aLoRA's activation, else its request's."""
        return (0.0,) * len(s.lora) if len(s.cached) < s.alora_from else s.lora

    @property
    def n_ctx_slot(self) -> int:
        return self.slots[0].n_ctx

    def submit(self, req: Request) -> Request:
        if self.draining:
            raise ShuttingDown("the server is shutting down")
        if not req.tokens:
            raise ValueError("the prompt is empty")
        if len(req.tokens) >= self.n_ctx_slot:
            raise ValueError(f"the prompt has {len(req.tokens)} tokens, but a slot's context holds "
                             f"{self.n_ctx_slot} (ctx-size {self.n_ctx} / parallel {self.n_parallel})")
        self.metrics["requests_total"] += 1
        self.inbox.put(req)
        return req

    def run_job(self, fn: Callable) -> cf.Future:
        """Run fn() on the engine thread between two steps (the Context and the model's kernels are not shared
        between threads); the future holds its result or exception."""
        fut: cf.Future = cf.Future()
        self.inbox.put((fn, fut))
        return fut

    def erase_slot(self, sid: int) -> int:
        """Forget the cache of an idle slot (llama-server's /slots/{id}?action=erase); the number of tokens
        erased. Call through run_job: it touches the Context."""
        if not 0 <= sid < self.n_parallel:
            raise ValueError(f"there is no slot {sid} (the server has {self.n_parallel})")
        s = self.slots[sid]
        if s.req is not None:
            raise ValueError(f"slot {sid} is processing a request")
        n = len(s.cached)
        self.ctx.seq_rm(sid, -1, -1)
        s.cached, s.checkpoints = [], []
        return n

    def save_slot(self, sid: int, path) -> tuple[int, int]:
        """An idle slot's cached prompt (tokens and KV) to a file (llama-server's /slots/{id}?action=save):
        (tokens saved, bytes written). Call through run_job."""
        from ..llama.state import save_seqs
        s = self._idle_slot(sid)
        if not _text_only(s.cached):
            raise ValueError(f"slot {sid} holds an image: its cache cannot be saved to a file")
        return len(s.cached), save_seqs(path, self.ctx, {"slot": (s.cached, sid)})

    def restore_slot(self, sid: int, path) -> tuple[int, int]:
        """A file from save_slot into an idle slot: (tokens restored, bytes read). Raises StateError for a file of
        another model, ValueError if it does not fit the slot. Call through run_job."""
        from ..llama.state import StateError, load_seq, read_seqs
        s = self._idle_slot(sid)
        states, size = read_seqs(path, self.ctx)
        st = states.get("slot")
        if st is None:
            raise StateError(f"{path} holds no slot")
        if len(st["tokens"]) >= s.n_ctx:
            raise ValueError(f"the saved prompt has {len(st['tokens'])} tokens, more than slot {sid} holds")
        s.cached, s.checkpoints = [], []
        s.cached = load_seq(st, self.ctx, sid)
        return len(s.cached), size

    def save_prompt_cache(self, path) -> int:
        """Every slot's cached prompt to one file (--prompt-cache), for the next start; returns the tokens saved.
        Call through run_job (or after the loop has stopped)."""
        from ..llama.state import save_seqs
        seqs = {f"slot{s.id}": (s.cached, s.id) for s in self.slots
                if s.cached and s.req is None and _text_only(s.cached)}      # a cache holding an image is not kept
        if seqs:
            save_seqs(path, self.ctx, seqs)
        return sum(len(t) for t, _ in seqs.values())

    def load_prompt_cache(self, path) -> int:
        """The slots' prompts from a save_prompt_cache file, each into the slot it came from when that slot has
        room; returns the tokens restored. Raises StateError for a file of another model."""
        from ..llama.state import load_seq, read_seqs
        states, _ = read_seqs(path, self.ctx)
        n = 0
        for key, st in states.items():
            sid = int(key[4:]) if key.startswith("slot") and key[4:].isdigit() else -1
            if not 0 <= sid < self.n_parallel or len(st["tokens"]) >= self.slots[sid].n_ctx:
                continue
            self.slots[sid].cached = load_seq(st, self.ctx, sid)
            n += len(self.slots[sid].cached)
        return n

    def slots_info(self) -> list:
        """GET /slots: each slot's state (read from any thread; a snapshot, not a lock-step view)."""
        out = []
        for s in self.slots:
            r = s.req
            out.append({"id": s.id, "id_task": r.id if r is not None else None, "n_ctx": s.n_ctx,
                        "is_processing": r is not None, "n_cached": len(s.cached),
                        "params": dict(r.params) if r is not None else {},
                        "next_token": {"has_next_token": r is not None, "n_decoded": s.n_gen if r else 0,
                                       "n_remain": max(r.max_tokens - s.n_gen, 0) if r else 0}})
        return out

    def begin_drain(self) -> None:
        """Refuse new requests (ShuttingDown); the ones in flight go on."""
        self.draining = True

    def idle(self) -> bool:
        return not self.waiting and self.inbox.empty() and all(s.req is None for s in self.slots)

    def cancel_all(self, msg: str = "the server is shutting down") -> int:
        """End every request in flight or waiting with an error event (status 503): each client gets a complete
        reply. Call through run_job; returns how many were ended."""
        n = 0
        for s in self.slots:
            if s.req is not None:
                self._fail(s, msg, 503)
                n += 1
        for r in self.waiting:
            r.emit(Event(error=msg, finish_reason="error", status=503, n_prompt=len(r.tokens)))
            n += 1
        self.waiting = []
        return n

    def _idle_slot(self, sid: int) -> Slot:
        if not 0 <= sid < self.n_parallel:
            raise ValueError(f"there is no slot {sid} (the server has {self.n_parallel})")
        if self.slots[sid].req is not None:
            raise ValueError(f"slot {sid} is processing a request")
        return self.slots[sid]

    def stop(self) -> None:
        self._stop = True
        self.inbox.put(None)
        self.thread.join(timeout=10)

    def alive(self) -> bool:
        return self.thread.is_alive()

    def busy_slots(self) -> int:
        return sum(1 for s in self.slots if s.req is not None)

    def graphs_pending(self) -> int:
        """Graphs the engine still means to build, place or run once while idle (at least 1 until it knows them
        all)."""
        placing = 1 if self._to_place is None else len(self._to_place)
        return len(self._to_reserve) + int(self._pad_shapes_due) + placing + len(self._to_warm)

    def queue_depth(self) -> int:
        return self.inbox.qsize() + len(self.waiting)

    def kv_used(self) -> int:
        return int(self.ctx.kv.n_used())

    def tokens_per_second(self, window: float = 10.0) -> float:
        """Generated tokens per second over the last ``window`` seconds of wall time."""
        now = time.perf_counter()
        recent = [(t, n) for t, n in list(self._recent) if now - t <= window]
        if not recent:
            return 0.0
        span = max(now - recent[0][0], 1e-3)
        return sum(n for _, n in recent) / span

    # ------------------------------------------------------------------ the loop (engine thread only)
    def _loop(self) -> None:
        # Numba's thread count is per calling thread: the kernels run here, so the model's n_threads is set here
        n_threads = getattr(getattr(self.model, "cpu", None), "n_threads", None)
        if n_threads:
            import numba
            numba.set_num_threads(max(1, min(int(n_threads), numba.config.NUMBA_NUM_THREADS)))
        while not self._stop:
            try:
                self._admit()
                self._drop_cancelled()
                if any(s.req is not None for s in self.slots):
                    self._step_all()
            except Exception as e:  # a bug here must not kill the thread: fail the requests in flight, go on
                for s in self.slots:
                    if s.req is not None:
                        self._fail(s, f"internal error: {type(e).__name__}: {e}")
        for s in self.slots:
            if s.req is not None:
                self._fail(s, "the server is shutting down", 503)

    def _admit(self) -> None:
        idle = not self.waiting and all(s.req is None for s in self.slots)
        gather = 0.0                    # until when a burst's requests are gathered (see GATHER_GAP_S)
        while True:
            try:
                if gather:
                    left = gather - time.perf_counter()
                    if left <= 0:
                        break
                    item = self.inbox.get(timeout=min(GATHER_GAP_S, left))
                elif idle and self._to_reserve:
                    try:
                        self.ctx.reserve(*self._to_reserve[0])
                    finally:
                        self._to_reserve.pop(0)
                        if not self._to_reserve and self._pad_shapes_due:
                            self._pad_shapes_due = False
                            self._to_reserve = self.ctx.pad_shapes(self.n_parallel)
                        if not self._to_reserve and self._to_place is None:
                            self._to_place = self.ctx.kept_shapes()
                            self._to_warm = list(self._to_place)
                    item = self.inbox.get_nowait()
                elif idle and self._to_place:
                    self.ctx.place(self._to_place.pop())
                    item = self.inbox.get_nowait()
                elif idle and self._to_warm:
                    if self.ctx.kv.n_used() or any(s.cached for s in self.slots):
                        self._to_warm = []      # a request came first: its cells stay as they are
                    else:
                        self.ctx.warm(self._to_warm.pop())
                    item = self.inbox.get_nowait()
                else:
                    item = self.inbox.get(timeout=0.05) if idle else self.inbox.get_nowait()
            except queue.Empty:
                if idle and (self._to_reserve or self._to_place or self._to_warm):
                    continue
                break
            if idle and isinstance(item, Request) and GATHER_MAX_S > 0:
                gather = time.perf_counter() + GATHER_MAX_S
            idle = False
            if item is None:
                return
            if isinstance(item, tuple):
                fn, fut = item
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as e:  # handed to the caller, who turns it into an HTTP error
                        fut.set_exception(e)
                continue
            self.waiting.append(item)
        for r in list(self.waiting):
            if r.cancelled:
                self.waiting.remove(r)
                self.metrics["requests_cancelled"] += 1
                continue
            free = [s for s in self.slots if s.req is None]
            if r.id_slot >= 0:          # it waits for its own slot; the others go on being admitted
                free = [s for s in free if s.id == r.id_slot]
                if not free:
                    continue
            elif not free:
                break
            # the free slot sharing the longest prefix if over a tenth of the prompt (llama-server's
            # slot_prompt_similarity: a template's few shared tokens do not evict a conversation), else the emptiest
            slot = max(free, key=lambda s: (c if (c := _common(s.cached, r.tokens)) * 10 > len(r.tokens) else 0,
                                            -len(s.cached)))
            self.waiting.remove(r)
            try:
                self._start(slot, r)
            except Exception as e:  # the request has no slot yet: _loop's handler would not reach it
                slot.req, slot.cached, slot.checkpoints = None, [], []
                r.emit(Event(error=f"internal error: {type(e).__name__}: {e}", finish_reason="error",
                             n_prompt=len(r.tokens), slot=slot.id))
                self.ctx.seq_rm(slot.id, -1, -1)

    def _start(self, slot: Slot, r: Request) -> None:
        # keep at least the last prompt token to decode: its logits give the first generated token; a request
        # without cache_prompt, or wanting its prompt's log-probs (which need the logits of every position),
        # decodes its prompt whole
        n_common = min(_common(slot.cached, r.tokens), len(r.tokens) - 1)
        if not r.cache_prompt or r.prompt_logprobs >= 0:
            n_common = 0
        lora = self._lora_of(r)
        alora = self.alora_ids(lora)
        start = -1
        if alora:
            if len(alora) != 1:         # the request's fields were checked; the server's scales may have changed
                raise ValueError("Cannot run multiple aLoRAs in a single request")
            start = _alora_start(r.tokens, self.lora_adapters[alora[0]].alora_invocation_tokens)
            if start < 0:               # no invocation in the prompt: the adapter is off for this request
                lora = tuple(0.0 if i == alora[0] else sc for i, sc in enumerate(lora))
                alora = []
        # K/V computed under other adapter scales are not this request's; llama-server keeps them for an aLoRA
        # after no adapter or an aLoRA (lora_should_clear_cache), to where its adapter starts
        if lora != slot.lora and not (alora and (not any(slot.lora) or self.alora_ids(slot.lora))):
            n_common = 0
        slot.lora = lora
        # llama-server decodes an aLoRA prompt's tokens before the one preceding the invocation without the adapter,
        # and reuses a cache up to there only
        slot.alora_from = max(0, start - 1)
        if start > 0:
            n_common = min(n_common, start - 1)
        if n_common < len(r.tokens) and not isinstance(r.tokens[n_common], (int, np.integer)):
            n_common -= r.tokens[n_common].j          # an image is decoded whole: from its first position
        r.t_start = time.perf_counter()
        slot.prompt_lps = []
        if not self.ctx.seq_rm(slot.id, self._pos(slot, n_common), -1):   # a recurrent state cannot be cut
            n_common = self._restore_checkpoint(slot, n_common)
        # the checkpoints past what is kept no longer describe this sequence
        slot.checkpoints = [c for c in slot.checkpoints if c.n_tokens <= n_common]
        slot.cached = list(r.tokens[:n_common])
        slot.pending = list(r.tokens[n_common:])
        slot.req, slot.n_gen, slot.n_reused, slot.text, slot.emitted = r, 0, n_common, "", 0
        slot.n_draft = slot.n_draft_acc = 0
        slot.draft_rate = DraftRate()
        slot.dec = StreamDecoder(self.vocab, special=False, keep=r.keep_tokens)
        self.metrics["prompt_tokens_total"] += len(slot.pending)
        self.metrics["prompt_tokens_cached"] += n_common

    def _restore_checkpoint(self, slot: Slot, n_common: int) -> int:
        """seq_rm refused to cut the slot's sequence at n_common (a recurrent state): go back to the newest checkpoint
        within the common prefix, and cut the KV cells a hybrid holds past it; else start over. Returns the tokens
        kept."""
        for ck in reversed(slot.checkpoints):
            if ck.n_tokens > n_common or tuple(slot.cached[:ck.n_tokens]) != ck.tokens:
                continue
            try:
                self.ctx.state_seq_set_partial(slot.id, ck.state)
            except ValueError:          # not this model's (cannot happen from _checkpoint): start over
                break
            if self.ctx.seq_rm(slot.id, ck.n_tokens, -1):
                self.metrics["checkpoints_restored"] += 1
                return ck.n_tokens
            break
        self.ctx.seq_rm(slot.id, -1, -1)
        return 0

    def _checkpoint(self, s: Slot) -> None:
        """Keep the slot's recurrent state as it is now, after its cached tokens: at most n_ctx_checkpoints per slot,
        the oldest dropped first, one taken again at the same point replacing the earlier."""
        st = self.ctx.state_seq_get_partial(s.id)
        if st is None:
            return
        n = len(s.cached)
        cks = [c for c in s.checkpoints if c.n_tokens != n]
        del cks[:max(0, len(cks) - self.n_ctx_checkpoints + 1)]
        cks.append(Checkpoint(n, tuple(s.cached), st))
        s.checkpoints = cks

    def _drop_cancelled(self) -> None:
        for s in self.slots:
            if s.req is not None and s.req.cancelled:
                # the client went away: free the slot; its KV stays valid for prefix reuse
                s.req = None
                self.metrics["requests_cancelled"] += 1

    def _step_all(self) -> None:
        t_step = time.perf_counter()
        active = [s for s in self.slots if s.req is not None]
        if self.lora_adapters and active:
            # one set of adapter scales per decode (the graph applies them to every row): slots of other sets
            # wait for their turn, which comes round step by step
            sets = sorted({self._lora_now(s) for s in active})
            cur = sets[self._lora_turn % len(sets)]
            self._lora_turn += 1
            active = [s for s in active if self._lora_now(s) == cur]
            self.ctx.set_loras([(ad, sc) for ad, sc in zip(self.lora_adapters, cur) if sc != 0.0])
        # the batch's columns, made into a Batch once (Batch.add per token copied its arrays every time)
        toks: list = []
        poss: list = []
        seqs: list = []
        wants: list = []

        def add(t, p, sid, want):
            toks.append(t)
            poss.append(p)
            seqs.append((sid,))
            wants.append(want)
        rows: dict[int, int] = {}       # slot id -> batch position whose logits it samples from
        took: dict[int, int] = {}       # slot id -> prompt tokens of it in this batch
        # Prompt chunks first, oldest request first, within the step's budget. Each slot's cells come from its own
        # stream of the cache, in position order (flash attention sums them in cell order, with ggml's F16
        # accumulator: cells out of order would change the last bits, which SmolLM2 amplifies).
        # A prompt is cut into chunks of prompt_budget tokens from where its slot's cache ends, each decoded whole
        # (a later one waits for the next step rather than be cut to the budget left): where a prompt's chunks
        # begin, and so the attention path of its tokens (the Context decodes a chunk apart, or with other short
        # pieces that keep it on the same path: KVCache.split), depends on that prompt only, not on the other
        # requests of the step.
        budget = self.step_budget
        prows: dict[int, int] = {}      # slot id -> batch position of its chunk's first token (prompt log-probs)
        for s in sorted((s for s in active if s.pending), key=lambda s: s.req.t_arrival):
            if not isinstance(s.pending[0], (int, np.integer)):
                self._decode_image(s)       # an image next: its own decode, then its text in the next step
                continue
            chunk = s.pending[:self.prompt_budget]
            for j, t in enumerate(chunk):   # a text chunk ends where an image begins
                if not isinstance(t, (int, np.integer)):
                    chunk = chunk[:j]
                    break
            tail = len(s.pending) - CHECKPOINT_TAIL
            if self.n_ctx_checkpoints and 0 < tail < len(chunk):
                chunk = chunk[:tail]        # stop short of the prompt's end: a checkpoint is taken there
            if len(s.cached) < s.alora_from:
                chunk = chunk[:s.alora_from - len(s.cached)]     # an aLoRA's adapter starts after this chunk
            if took and len(chunk) > budget:
                continue
            every = s.req.prompt_logprobs >= 0
            if every:
                prows[s.id] = len(toks)
            p0 = self._pos(s)
            for j, t in enumerate(chunk):
                last = j == len(chunk) - 1 and len(chunk) == len(s.pending)
                add(t, p0 + j, s.id, last or every)
                if last:
                    rows[s.id] = len(toks) - 1
            took[s.id] = len(chunk)
            budget -= len(chunk)
        active = [s for s in active if s.req is not None]      # an image that failed ended its request
        if not active:
            return
        # then one token for each generating slot, followed by its draft when speculating
        drafts = self._drafts([s for s in active if not s.pending], len(toks)) if self.spec is not None else {}
        for s in active:
            if not s.pending:
                p0 = self._pos(s)
                add(s.next_token, p0, s.id, True)
                rows[s.id] = len(toks) - 1
                for j, t in enumerate(drafts.get(s.id, ())):
                    add(t, p0 + 1 + j, s.id, True)
        if not toks:                    # this step decoded images only
            return
        batch = Batch(np.array(toks, np.int32), np.array(poss, np.int32), seqs, np.array(wants, bool))
        t0 = time.perf_counter()
        try:
            self.ctx.decode(batch)
        except Exception as e:  # never leave a request hanging: fail the ones in this batch, clear their KV
            for s in active:
                self._fail(s, f"decode failed: {e}")
                s.cached = []
                self.ctx.seq_rm(s.id, -1, -1)
            return
        dt = time.perf_counter() - t0
        for sid, b0 in prows.items():
            s = self.slots[sid]
            self._prompt_logprobs(s, b0, took[sid])
        # the batch is in the cache: commit what each slot decoded
        for s in active:
            if s.id in took:
                n = took[s.id]
                s.cached.extend(s.pending[:n])
                s.pending = s.pending[n:]
                if self.n_ctx_checkpoints and len(s.pending) in (0, CHECKPOINT_TAIL) and _text_only(s.cached):
                    self._checkpoint(s)
            elif not s.pending:
                s.cached.append(s.next_token)
        m = self.metrics
        m["decode_seconds_total"] += dt
        m["steps_total"] += 1
        m["busy_slot_steps"] += len(active)
        m["n_tokens_max"] = max(m["n_tokens_max"], max(len(s.cached) for s in active))
        share = sum(took.values()) / len(batch)
        m["prompt_seconds_total"] += dt * share
        m["gen_seconds_total"] += dt * (1 - share)
        g0 = m["generated_tokens_total"]
        # the leading top-k of every row sampled without a draft, in one call (the outputs keep the batch's order),
        # and the tokens of the common chains in another (a request that wants no token draws none)
        out_row = np.cumsum(wants) - 1
        plain = [s for s in active if s.id in rows and not drafts.get(s.id) and s.req.max_tokens > 0]
        chains, logits = [s.req.sampler for s in plain], self.ctx.get_logits()
        at = [int(out_row[rows[s.id]]) for s in plain]
        top_list = top_positions(chains, logits, at)
        tops = dict(zip((s.id for s in plain), top_list))
        picked = dict(zip((s.id for s in plain), sample_rows(chains, logits, at, top_list)))
        for s in active:
            if s.id in rows:
                try:
                    if drafts.get(s.id):
                        self._verify(s, rows[s.id], drafts[s.id])
                    else:
                        self._step(s, self.ctx.get_logits_ith(rows[s.id]), tops.get(s.id), picked.get(s.id))
                except Exception as e:  # a sampler or detokenizer failure ends this request only
                    self._fail(s, f"sampling failed: {type(e).__name__}: {e}")
        now = time.perf_counter()
        if self.planner is not None and not took:      # the whole step: drafting, decode, sampling
            self.planner.observe_step(len(batch), now - t_step)
        self._recent.append((now, m["generated_tokens_total"] - g0))     # with drafts, several per slot
        if now - self._recent[0][0] > 30:
            self._recent = [(t, n) for t, n in self._recent if now - t <= 10.0]

    def _drafts(self, gen: list, n_prompt: int = 0) -> dict:
        """{slot id: draft} for the generating slots: n-gram lookup first, then the draft model for the slots it left
        without one, all in one batch per draft step. A slot drafts at most what its context and its request's
        max_tokens leave after the next token (llama-server's get_n_draft_max). With the planner, each draft is cut
        to what is worth checking in this step (``n_prompt``: the step's prompt rows); a draft not checked at all
        is kept aside and scored against the tokens that follow."""
        want = {}
        t0 = time.perf_counter()
        if self.planner is not None:
            for s in gen:
                s.draft_rate.score_shadow(s.cached + [s.next_token])
        for s in gen:
            r = s.req
            room = min(s.n_ctx - len(s.cached) - 2, r.max_tokens - s.n_gen - 1)
            if r.spec_n_max is not None:
                room = min(room, r.spec_n_max)
            if room >= 1 and _text_only(s.cached):
                want[s.id] = (s.cached, s.next_token, room, r.spec_n_min, r.spec_p_min)
        out = self.drafters.draft(want) if want else {}
        if self.exact_rows is not None and out and n_prompt + len(gen) <= self.exact_rows:
            out = cap_rows(out, n_prompt + len(gen), self.exact_rows)
        if self.planner is not None and out:
            keep = self.planner.plan(n_prompt + len(gen), out,
                                     {sid: self.slots[sid].draft_rate.rate() for sid in out})
            for sid, d in list(out.items()):
                rate = self.slots[sid].draft_rate
                if keep[sid] == 0:
                    if rate.shadow is None:
                        rate.shadow = (len(self.slots[sid].cached) + 1, d)
                    del out[sid]
                else:
                    out[sid] = d[:keep[sid]]
        self.metrics["draft_seconds_total"] += time.perf_counter() - t0
        return out

    def _verify(self, s: Slot, row: int, draft: list) -> None:
        """Sample the rows of a slot's token and draft in order, each token exactly as without a draft, keeping a
        drafted token while it equals the one sampled at its place (llama.cpp's common_sampler_sample_and_accept_n);
        the cells of the rejected rest leave the cache."""
        s.n_draft += len(draft)         # counted first: the request may end (and report them) within the loop
        self.metrics["draft_tokens_total"] += len(draft)
        self.metrics["draft_steps_total"] += 1
        n_acc = s.n_draft_acc
        try:
            for i in range(len(draft) + 1):
                tok = self._step(s, self.ctx.get_logits_ith(row + i))
                # past an end-of-generation token nothing drafted is kept (it continues only with ignore_eos)
                if tok is None or i == len(draft) or tok != draft[i] or self.vocab.is_eog(tok):
                    break
                s.cached.append(tok)    # already in the cache: the draft put it there
                s.n_draft_acc += 1
                self.metrics["draft_tokens_accepted"] += 1
        finally:
            self.ctx.seq_rm(s.id, self._pos(s), -1)
            s.draft_rate.observe(len(draft), s.n_draft_acc - n_acc)

    def _decode_image(self, s: Slot) -> None:
        """The image at the head of the slot's pending prompt, decoded as an embeddings batch of its own (non-causal
        where the model wants it, so it cannot share a batch with other slots' tokens)."""
        ch = s.pending[0].chunk
        t0 = time.perf_counter()
        try:
            self.mtmd.eval_image(self.ctx, ch, self._pos(s), s.id, self.ctx.n_batch)
        except Exception as e:
            self._fail(s, f"decoding the image failed: {e}")
            s.cached = []
            self.ctx.seq_rm(s.id, -1, -1)
            return
        dt = time.perf_counter() - t0
        self.metrics["decode_seconds_total"] += dt
        self.metrics["prompt_seconds_total"] += dt
        s.cached.extend(s.pending[:ch.n_tokens])
        s.pending = s.pending[ch.n_tokens:]

    def _pos(self, s: Slot, n: int | None = None) -> int:
        """The sequence position after the slot's first n cached items (all by default): n itself, but with M-RoPE
        an image's tokens share one position and advance it by max(rows, columns) (MtmdContext.seq_pos)."""
        n = len(s.cached) if n is None else n
        if self.mtmd is None or not self.mtmd.mrope:
            return n
        memo = s.pos_memo
        if memo is None or memo[0] is not s.cached or memo[1] > n:    # a new list, or an earlier point: recount
            memo = (s.cached, 0, 0)
        items, k, saved = memo
        saved += self.mtmd.seq_pos(items[k:n], n - k) - (n - k)   # per whole image: its last item is in the slice
        s.pos_memo = (items, n, saved)
        return n + saved

    def _fail(self, s: Slot, msg: str, status: int = 500) -> None:
        r = s.req
        s.req = None
        if r is not None:
            r.emit(Event(error=msg, finish_reason="error", n_prompt=len(r.tokens), n_gen=s.n_gen, status=status,
                         slot=s.id, n_cached=s.n_reused, timings=self._timings(s, r)))

    def _finish(self, s: Slot, reason: str, text: str = "") -> None:
        r = s.req
        s.req = None
        self.metrics["requests_finished"] += 1
        r.emit(Event(text=text, finish_reason=reason, n_prompt=len(r.tokens), n_gen=s.n_gen, n_cached=s.n_reused,
                     slot=s.id, timings=self._timings(s, r)))

    @staticmethod
    def _timings(s: Slot, r: Request) -> dict:
        """llama-server's timings of a request (milliseconds), plus the time it waited for a slot."""
        now = time.perf_counter()
        t_first = r.t_first or now
        prompt_n, prompt_ms = len(r.tokens) - s.n_reused, (t_first - (r.t_start or now)) * 1e3
        predicted_n, predicted_ms = s.n_gen, (now - t_first) * 1e3 if r.t_first else 0.0
        return {"queue_ms": ((r.t_start or now) - r.t_arrival) * 1e3, "cache_n": s.n_reused,
                "prompt_n": prompt_n, "prompt_ms": prompt_ms,
                "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
                "prompt_per_second": prompt_n / prompt_ms * 1e3 if prompt_ms > 0 else 0.0,
                "predicted_n": predicted_n, "predicted_ms": predicted_ms,
                "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else 0.0,
                "predicted_per_second": predicted_n / predicted_ms * 1e3 if predicted_ms > 0 else 0.0,
                **({"draft_n": s.n_draft, "draft_n_accepted": s.n_draft_acc} if s.n_draft else {})}

    def _prompt_logprobs(self, s: Slot, b0: int, n: int) -> None:
        """The log-probs of the prompt tokens that follow the ``n`` decoded from batch position b0 on."""
        r = s.req
        g0 = len(s.cached)                  # the chunk's first prompt index (not yet committed)
        for j in range(n):
            g = g0 + j
            if g + 1 >= len(r.tokens):
                break
            x = self.ctx.get_logits_ith(b0 + j)
            s.prompt_lps.append((r.tokens[g + 1], _logprob(x, r.tokens[g + 1]),
                                 top_logprobs(x, r.prompt_logprobs) if r.prompt_logprobs else []))

    def _step(self, s: Slot, logits: np.ndarray, top: np.ndarray | None = None, tok: int | None = None) -> int | None:
        """Sample the slot's next token and pass its text on: the token, or None when the request ended. ``top``:
        the positions the sampler's leading top-k keeps (sampling.top_positions), when known; ``tok``: the token
        its sampler picked already (sampling.sample_rows, the step's common chains at once)."""
        r = s.req
        if s.n_gen == 0 and not r.t_first:
            r.t_first = time.perf_counter()
            if r.prompt_logprobs >= 0:
                r.emit(Event(prompt_logprobs=[(r.tokens[0], None, [])] + s.prompt_lps))
            if r.max_tokens <= 0:       # the prompt only (echo with max_tokens 0)
                self._finish(s, "length")
                return None
        # the raw row stays as it is for the log-probs: the sampler edits its own copy (Candidates)
        logits = np.asarray(logits, dtype=np.float32)
        if tok is None:
            tok = int(r.sampler.sample(logits, top) if top is not None else r.sampler.sample(logits))
        r.sampler.accept(tok)
        lp, top = None, []
        if r.logprobs or r.n_probs:
            lp = _logprob(logits, tok)
            top = top_logprobs(logits, r.n_probs) if r.n_probs else []
        self.metrics["generated_tokens_total"] += 1
        if self.vocab.is_eog(tok) and not r.ignore_eos:
            self._finish(s, "stop", s.text[s.emitted:] + s.dec.flush())
            return None
        s.n_gen += 1
        s.text += s.dec.feed(tok)
        # a stop string ends the text just before it; the search starts where an earlier match could begin
        hit = -1
        for st in r.stop:
            p = s.text.find(st, max(0, s.emitted - len(st) + 1))
            if p >= 0 and (hit < 0 or p < hit):
                hit = p
        if hit >= 0:
            r.emit(Event(text=s.text[s.emitted:hit], token=tok, logprob=lp, top=top))
            self._finish(s, "stop")
            return None
        # hold back a tail that could be the start of a stop string
        safe = len(s.text)
        for st in r.stop:
            for k in range(min(len(st) - 1, len(s.text) - s.emitted), 0, -1):
                if s.text.endswith(st[:k]):
                    safe = min(safe, len(s.text) - k)
                    break
        r.emit(Event(text=s.text[s.emitted:safe], token=tok, logprob=lp, top=top))
        s.emitted = safe
        if s.n_gen >= r.max_tokens or len(s.cached) + 1 >= s.n_ctx:
            self._finish(s, "length", s.text[s.emitted:] + s.dec.flush())
            return None
        s.next_token = tok
        return tok


class ShuttingDown(RuntimeError):
    """A request submitted while the server drains for shutdown (a 503)."""


def _logprob(logits: np.ndarray, tok: int) -> float:
    """log softmax(logits)[tok], in float64 over the whole row."""
    x = np.asarray(logits, dtype=np.float64)
    mx = x.max()
    return float(x[tok] - (mx + np.log(np.exp(x - mx).sum())))


def _recurrent(model) -> bool:
    hp = model.hparams
    return any(hp.is_recurrent(il) for il in range(hp.n_layer))


def _text_only(tokens: list) -> bool:
    """No image positions (mtmd.ImagePos) among the tokens: what the state files can hold."""
    return all(isinstance(t, (int, np.integer)) for t in tokens)


def _alora_start(tokens: list, inv: list) -> int:
    """Where the last occurrence of the invocation sequence starts in the prompt, -1 if none: llama-server's
    backward scan, which after a mismatch looks for the sequence's last token from the next position on."""
    m = len(inv) - 1
    for i in range(len(tokens) - 1, -1, -1):
        if tokens[i] == inv[m]:
            if m == 0:
                return i
            m -= 1
        else:
            m = len(inv) - 1
    return -1


def _common(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
