"""The high-level Python API, in the spirit of llama-cpp-python's ``Llama``: load a model, complete, chat, embed.

Underneath are the public Model, Context, Batch and sampler objects; this file only strings them together.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from ..models import resolve_model
from .batch import Batch
from .context import Context, ContextError
from .grammar import GrammarError, LlamaGrammar, constraint  # noqa: F401  (GrammarError, LlamaGrammar: public)
from .lora import LoraAdapter
from .model import Model


class PromptTooLong(ContextError):
    pass


@dataclass
class GenStep:
    token: int
    text: str                   # the new text (held back while it might be the start of a stop string)
    logprob: float
    top: list = field(default_factory=list)   # [(id, logprob)] over the raw logits
    finish_reason: str | None = None


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def top_logprobs(logits: np.ndarray, k: int) -> list:
    lp = _log_softmax(logits)
    k = min(k, len(lp))
    idx = np.argpartition(-lp, k - 1)[:k] if k > 0 else np.zeros(0, int)
    idx = idx[np.lexsort((idx, -lp[idx]))]
    return [(int(i), float(lp[i])) for i in idx]


class _Logprobs:
    """A text completion's ``logprobs`` object as steps arrive: tokens (their pieces), token_logprobs, top_logprobs
    (piece -> logprob) and text_offset (where each piece starts, counted from ``offset``)."""

    def __init__(self, vocab, offset: int = 0):
        self.vocab, self.offset = vocab, offset
        self.tokens, self.lps, self.tops, self.offsets = [], [], [], []

    def add(self, s: GenStep) -> None:
        piece = self.vocab.token_to_piece(s.token).decode("utf-8", "replace")
        self.tokens.append(piece)
        self.lps.append(s.logprob)
        self.tops.append({self.vocab.token_to_piece(i).decode("utf-8", "replace"): lp for i, lp in s.top})
        self.offsets.append(self.offset)
        self.offset += len(piece)

    def obj(self) -> dict:
        return {"tokens": self.tokens, "token_logprobs": self.lps, "top_logprobs": self.tops,
                "text_offset": self.offsets}


def _chat_logprobs(lp: dict | None) -> dict | None:
    """A text completion's logprobs in a chat completion's shape: {"content": [{token, logprob, bytes,
    top_logprobs: [{token, logprob, bytes}]}]}."""
    if lp is None:
        return None

    def entry(t: str, v: float) -> dict:
        return {"token": t, "logprob": v, "bytes": list(t.encode("utf-8"))}
    return {"content": [{**entry(t, v), "top_logprobs": [entry(a, b) for a, b in top.items()]}
                        for t, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"])],
            "refusal": None}


class Llama:
    def __init__(self, model_path=None, n_ctx: int = 2048, n_threads: int | None = None, seed: int | None = None,
                 n_batch: int = 512, n_ubatch: int = 512, embedding: bool = False, pooling: str | None = None,
                 n_gpu_layers: int | str = 0, chat_template: str | None = None, n_seq_max: int = 1,
                 type_k: str = "f16", type_v: str = "f16", use_mmap: bool = True, verbose: bool = False,
                 tune_process: bool = True, vocab_only: bool = False, split_mode: str = "layer",
                 tensor_split=None, main_gpu: int = 0, override_tensor=None, lora_path: str | None = None,
                 lora_scale: float = 1.0, lora_adapters=None, mmproj_path: str | None = None,
                 mmproj_offload: bool = True):
        """``tune_process``: install llampy's process tuning (``llampy.tuning``: OpenMP spin, single-threaded
        OpenBLAS, Numba patches, graphs frozen out of the garbage collector) before loading; False leaves the
        process as it is, for a program that hosts llampy beside other work. ``vocab_only``: the vocabulary
        alone (tokenize, detokenize), from a GGUF of any architecture; no weights, no context. ``n_gpu_layers``,
        ``split_mode``, ``tensor_split``, ``main_gpu``, ``override_tensor``: offload to CUDA GPUs as llama.cpp's
        -ngl/-sm/-ts/-mg/-ot (``llama.devices``; 'auto' fits what free memory holds). ``lora_path`` (scaled by
        ``lora_scale``) and ``lora_adapters`` ((path, scale) pairs): GGUF LoRA adapters applied at run time
        (``llama.lora``; ``set_lora_scales`` changes the scales later). ``pooling`` (``embed``): mean, cls, last
        or rank; None: the file's pooling_type for an encoder (bert), else mean. An encoder embeds only.
        ``mmproj_path``: a projector GGUF (llama.cpp's --mmproj): chat messages may then hold OpenAI-style
        ``image_url`` parts (``llampy.mtmd``); a projector for another model raises ProjectorError. With GPU layers
        the image encoder runs on the model's first GPU too (``mmproj_offload`` False: on the CPU, as llama.cpp's
        --no-mmproj-offload)."""
        from ..ggml.types import GGMLType
        if tune_process:
            from .. import tuning
            tuning.install()
        self.model_path = str(resolve_model(model_path))
        self.model = Model(self.model_path, n_gpu_layers=n_gpu_layers, use_mmap=use_mmap, n_threads=n_threads,
                           vocab_only=vocab_only, split_mode=split_mode, tensor_split=tensor_split,
                           main_gpu=main_gpu, override_tensor=override_tensor, n_ctx_hint=n_ctx)
        self.vocab = self.model.vocab
        self.verbose = verbose
        if vocab_only:
            self.ctx = None
            return
        self.seed = seed
        kt, vt = GGMLType[type_k.upper()], GGMLType[type_v.upper()]
        self.ctx = Context(self.model, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_seq_max=n_seq_max,
                           type_k=kt, type_v=vt, embeddings=not getattr(self.model.arch, "USES_KV_CACHE", True))
        pairs = ([(lora_path, lora_scale)] if lora_path else []) + list(lora_adapters or [])
        self.lora_adapters = [LoraAdapter(self.model, p) for p, _ in pairs]
        self.ctx.set_loras([(ad, s) for ad, (_, s) in zip(self.lora_adapters, pairs)])
        self._embed_ctx = None
        self._embedding = embedding
        self._pooling = pooling
        self._chat_template_override = chat_template
        self._chat_template = None
        self._cached: list = []               # tokens (and image positions) whose K/V are in the cache, sequence 0
        self.verbose = verbose
        self.mtmd = None
        if mmproj_path:
            from ..mtmd import MtmdContext
            self.mtmd = MtmdContext(mmproj_path, self.model, n_threads=n_threads, use_gpu=mmproj_offload)

    # ------------------------------------------------------------------ basics
    def set_lora_scales(self, scales) -> None:
        """New scales for the adapters loaded at creation (one per adapter, in order; 0 switches one off). The
        cached prompt is dropped: its K/V were computed with the old scales."""
        scales = [float(x) for x in scales]
        if len(scales) != len(self.lora_adapters):
            raise ValueError(f"{len(scales)} scales for {len(self.lora_adapters)} LoRA adapters")
        self.ctx.set_loras([(ad, sc) for ad, sc in zip(self.lora_adapters, scales) if sc != 0.0])
        self.reset()

    @property
    def n_ctx(self) -> int:
        return self.ctx.n_ctx

    @property
    def n_vocab(self) -> int:
        return self.model.hparams.n_vocab

    def tokenize(self, text, add_bos: bool = True, special: bool = False) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self.vocab.tokenize(text, add_special=add_bos, parse_special=special)

    def detokenize(self, tokens, special: bool = False) -> bytes:
        return b"".join(self.vocab.token_to_piece(int(t), special=special) for t in tokens)

    def token_eos(self) -> int | None:
        return self.vocab.eos

    def token_bos(self) -> int | None:
        return self.vocab.bos

    def reset(self) -> None:
        self.ctx.kv_clear()
        self._cached = []

    # ------------------------------------------------------------------ saved state (llama-cpp-python's)
    def save_state(self):
        """The context's state (the cache and the tokens it holds) as a LlamaState; ``load_state`` brings it back,
        here or in another Llama of the same model and n_ctx, and the next completion reuses its prefix."""
        from .state import LlamaState
        data = self.ctx.state_save()
        logits = self.ctx.get_logits()
        return LlamaState(self._cached, logits[-1:].copy() if len(logits) else np.zeros((0, self.n_vocab)),
                          len(self._cached), data, len(data), self.seed)

    def load_state(self, state) -> None:
        """Restore a LlamaState from ``save_state`` (raises ContextError if it is for another cache size)."""
        self.ctx.state_load(state.llama_state)
        self._cached = [int(t) for t in state.input_ids]

    # ------------------------------------------------------------------ speculative decoding
    def set_speculative(self, spec, model_draft=None) -> None:
        """Draft tokens in ``generate`` (and the completions built on it) and check them in one batch:
        ``spec`` a speculative.SpecParams (None: off), ``model_draft`` the draft model (a GGUF path or a Model) for
        the type draft-simple. The output is the same as without drafting, greedy or seeded."""
        from .speculative import DraftPlanner, DraftRate, Drafters, exact_rows
        if spec is None or not spec.enabled():
            self._drafters = None
            return
        if model_draft is not None and not isinstance(model_draft, Model):
            model_draft = Model(resolve_model(model_draft), n_ctx_hint=self.n_ctx)
        self._drafters = Drafters(spec, self.vocab, self.n_ctx, 1, model_draft)
        self.spec_stats = {"drafted": 0, "accepted": 0}
        # drafts cut to what is worth checking (as the server's engine does): step costs and the acceptance rate
        self._planner = DraftPlanner() if spec.plan else None
        self._draft_rate = DraftRate()
        self._checking = 0              # the length of the draft being checked
        self._step_start = None         # (rows, start) of the step under way, timed up to the next one's start
        # where a batch's rows do not get a single step's bits, drafts short enough that the greedy run stays the
        # plain one (speculative.exact_rows; it leaves the cache empty)
        self._exact_rows = exact_rows(self.ctx, 0)
        self._cached = []

    def _draft_checked(self, n_accepted: int) -> None:
        if getattr(self, "_planner", None) is not None and self._checking:
            self._draft_rate.observe(self._checking, n_accepted)
        self._checking = 0

    def _eval_drafted(self, token: int, room: int):
        """Decode ``token`` and, when a drafter offers one, a draft after it, in one batch: (the logits after
        ``token``, the draft, the logits after each drafted token)."""
        d = getattr(self, "_drafters", None)
        plan = getattr(self, "_planner", None) if d else None
        t0 = time.perf_counter()
        if plan is not None:
            # a step's cost: from its start to the next one's (drafting, decode, and sampling and handing out its
            # tokens), as the server's engine times a step
            if self._step_start is not None:
                plan.observe_step(self._step_start[0], t0 - self._step_start[1])
            self._draft_rate.score_shadow(self._cached + [int(token)])
        draft = d.draft({0: (self._cached, token, room, None, None)}).get(0, []) if d and room >= 1 else []
        if draft and getattr(self, "_exact_rows", None) is not None:
            draft = draft[:self._exact_rows - 1]
        if plan is not None and draft:
            keep = plan.plan(1, {0: draft}, {0: self._draft_rate.rate()})[0]
            if keep == 0 and self._draft_rate.shadow is None:
                self._draft_rate.shadow = (len(self._cached) + 1, draft)
            draft = draft[:keep]
        if plan is not None:
            self._step_start = (1 + len(draft), t0)
        if not draft:
            return self.eval_token(token), [], []
        self.ctx.decode(Batch.from_tokens([token] + draft, pos0=self._pos(), logits_all=True))
        self._checking = len(draft)
        self.spec_stats["drafted"] += len(draft)
        self._cached.append(int(token))
        rows = [np.array(self.ctx.get_logits_ith(j)) for j in range(len(draft) + 1)]
        return rows[0], draft, rows[1:]

    # ------------------------------------------------------------------ evaluation with prefix reuse
    def eval_prompt(self, tokens: list[int]) -> np.ndarray:
        """Bring the cache to hold exactly ``tokens`` (reusing the common prefix) and return the last logits."""
        if len(tokens) == 0:
            raise ContextError("the prompt is empty")
        if not isinstance(tokens[-1], (int, np.integer)):
            raise ContextError("a prompt cannot end with an image: its logits come from text after it")
        if len(tokens) >= self.n_ctx:
            raise PromptTooLong(f"the prompt has {len(tokens)} tokens, but the context holds {self.n_ctx} "
                                f"(n_ctx); shorten the prompt or raise n_ctx")
        n_common = 0
        for a, b in zip(self._cached, tokens):
            if a != b:
                break
            n_common += 1
        n_common = min(n_common, len(tokens) - 1)   # re-evaluate at least the last token to get its logits
        if not self.ctx.seq_rm(0, self._pos(n_common), -1):     # a recurrent state cannot drop a suffix: start over
            self.ctx.seq_rm(0, -1, -1)
            n_common = 0
        if n_common < len(tokens) and not isinstance(tokens[n_common], (int, np.integer)):
            n_common -= tokens[n_common].j          # an image is decoded whole: from its first position
        if not self.ctx.seq_rm(0, self._pos(n_common), -1):
            self.ctx.seq_rm(0, -1, -1)
            n_common = 0
        self._cached = list(tokens[:n_common])
        rest = tokens[n_common:]
        i0 = 0
        while i0 < len(rest):
            if not isinstance(rest[i0], (int, np.integer)):     # an image chunk's first position (mtmd.ImagePos)
                ch = rest[i0].chunk
                self.mtmd.eval_image(self.ctx, ch, self._pos(), 0, self.ctx.n_batch)
                self._cached.extend(rest[i0:i0 + ch.n_tokens])
                i0 += ch.n_tokens
                continue
            i1 = i0
            while i1 < len(rest) and i1 - i0 < self.ctx.n_batch and isinstance(rest[i1], (int, np.integer)):
                i1 += 1
            chunk = rest[i0:i1]
            self.ctx.decode(Batch.from_tokens(chunk, pos0=self._pos(), logits_last=i1 == len(rest)))
            self._cached.extend(int(t) for t in chunk)
            i0 = i1
        return self.ctx.get_logits_ith(-1)

    def _pos(self, n: int | None = None) -> int:
        """The sequence position after the first n cached items (all of them by default): n itself, but with M-RoPE
        an image's tokens share one position and advance it by max(rows, columns)."""
        n = len(self._cached) if n is None else n
        if self.mtmd is None or not self.mtmd.mrope:
            return n
        return self.mtmd.seq_pos(self._cached, n)

    def eval_token(self, token: int) -> np.ndarray:
        self.ctx.decode(Batch.from_tokens([token], pos0=self._pos()))
        self._cached.append(int(token))
        return self.ctx.get_logits_ith(-1)

    def make_sampler(self, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, typical_p=1.0, repeat_penalty=1.0,
                     repeat_last_n=64, frequency_penalty=0.0, presence_penalty=0.0, mirostat_mode=0,
                     mirostat_tau=5.0, mirostat_eta=0.1, logit_bias=None, seed=None, grammar=None, **more):
        """The sampler chain of these parameters; ``grammar`` (a LlamaGrammar or GBNF text) goes first, as a
        Grammar sampler over this model's vocabulary. ``more``: Chain.from_params' other settings (min_keep,
        dynatemp_range, dynatemp_exponent, top_n_sigma, xtc_probability, xtc_threshold, dry_multiplier, dry_base,
        dry_allowed_length, dry_penalty_last_n (-1: n_ctx), dry_sequence_breakers, samplers)."""
        from .sampling import Chain
        seed = seed if seed is not None else self.seed
        if grammar is not None:
            from .grammar import Grammar
            grammar = Grammar(self.vocab, grammar)
        return Chain.from_params(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p,
                                 repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n,
                                 frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                                 mirostat=mirostat_mode, mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta,
                                 logit_bias=logit_bias, seed=seed, n_vocab=self.n_vocab, grammar=grammar,
                                 vocab=self.vocab, **{"dry_penalty_last_n": self.n_ctx, **more})

    def generate(self, prompt_tokens: list[int], max_tokens: int, sampler, stop=(), n_probs: int = 0,
                 ignore_eos: bool = False, keep_tokens: frozenset = frozenset()) -> Iterator[GenStep]:
        """Sample up to max_tokens tokens after the prompt; the last step carries finish_reason. ``keep_tokens``:
        control tokens whose text stays in the output (the rest give none)."""
        from .vocab import StreamDecoder
        if max_tokens is None or max_tokens < 0:
            max_tokens = self.n_ctx - len(prompt_tokens)
        logits = self.eval_prompt(prompt_tokens)
        if getattr(self, "_planner", None) is not None:     # a new text: its drafts' rate starts over
            self._draft_rate, self._checking, self._step_start = type(self._draft_rate)(), 0, None
        dec = StreamDecoder(self.vocab, special=False, keep=frozenset(keep_tokens))
        stop = [s for s in (stop or []) if s]
        draft, rows = [], []            # a draft not yet checked, and the logits after each of its tokens
        try:
            yield from self._generate(logits, max_tokens, sampler, stop, n_probs, ignore_eos, dec, draft, rows)
        finally:                        # the rejected or unused rest of a draft leaves the cache
            if draft:
                self.ctx.seq_rm(0, self._pos(), -1)

    def _generate(self, logits, max_tokens, sampler, stop, n_probs, ignore_eos, dec, draft, rows):
        text_all = ""
        emitted = 0
        for i in range(max_tokens):
            tok = int(sampler.sample(logits))
            sampler.accept(tok)
            lp = _log_softmax(logits)
            step = GenStep(tok, "", float(lp[tok]), top_logprobs(logits, n_probs) if n_probs else [])
            if self.vocab.is_eog(tok) and not ignore_eos:
                step.text = text_all[emitted:] + dec.flush()
                step.finish_reason = "stop"
                yield step
                return
            text_all += dec.feed(tok)
            # stop strings: cut at the first match; hold back a tail that may begin one
            hit = min((p for p in (text_all.find(s, max(0, emitted - len(s))) for s in stop) if p >= 0), default=-1)
            if hit >= 0:
                step.text = text_all[emitted:hit]
                step.finish_reason = "stop"
                yield step
                return
            safe = len(text_all)
            for s in stop:
                for k in range(min(len(s) - 1, len(text_all)), 0, -1):
                    if text_all.endswith(s[:k]):
                        safe = min(safe, len(text_all) - k)
                        break
            step.text = text_all[emitted:safe]
            emitted = safe
            last = i == max_tokens - 1 or len(self._cached) + 1 >= self.n_ctx
            if last:
                step.text += text_all[emitted:] + dec.flush()
                step.finish_reason = "length"
                yield step
                return
            yield step
            # a drafted token equal to the one sampled is in the cache already: its logits come next
            if draft and tok == draft[0] and not self.vocab.is_eog(tok):
                self._cached.append(tok)
                self.spec_stats["accepted"] += 1
                draft.pop(0)
                logits = rows.pop(0)
                if not draft:
                    self._draft_checked(self._checking)
                continue
            if draft:
                self._draft_checked(self._checking - len(draft))
                self.ctx.seq_rm(0, self._pos(), -1)
                draft.clear()
                rows.clear()
            room = min(max_tokens - i - 2, self.n_ctx - len(self._cached) - 3)
            logits, new, new_rows = self._eval_drafted(tok, room)
            draft.extend(new)
            rows.extend(new_rows)

    # ------------------------------------------------------------------ OpenAI-shaped completions
    def create_completion(self, prompt, max_tokens: int | None = 16, temperature: float = 0.8, top_p: float = 0.95,
                          min_p: float = 0.05, typical_p: float = 1.0, top_k: int = 40, stop=None, seed=None,
                          repeat_penalty: float = 1.0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                          logprobs: int | None = None, stream: bool = False, logit_bias=None, echo: bool = False,
                          mirostat_mode: int = 0, mirostat_tau: float = 5.0, mirostat_eta: float = 0.1,
                          add_special: bool = True, grammar=None, response_format=None, preserved_tokens=None,
                          **sampling):
        """``grammar``: a LlamaGrammar (``LlamaGrammar.from_string``/``from_json_schema``) or GBNF text;
        ``response_format``: OpenAI's {"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema":
        ...}}. Either constrains the text token by token; one that cannot be compiled raises GrammarError (a
        ValueError) before anything is generated. ``preserved_tokens`` (llama-server's field): token ids or texts
        of single tokens whose text the output keeps although they are control tokens. ``sampling``: the other
        samplers' settings (make_sampler's ``more``: DRY, XTC, top-n-sigma, dynatemp, min_keep, samplers order).
        ``logprobs``: the top ``logprobs`` tokens per step with ``text_offset`` (from the prompt's end, or its start
        with ``echo``), in every chunk of a stream too."""
        grammar = constraint(grammar, response_format)
        keep = self._token_ids(preserved_tokens or ())
        tokens = prompt if isinstance(prompt, list) else self.vocab.tokenize(prompt, add_special=add_special,
                                                                               parse_special=True)
        if isinstance(stop, str):
            stop = [stop]
        sampler = self.make_sampler(temperature, top_k, top_p, min_p, typical_p, repeat_penalty, 64,
                                    frequency_penalty, presence_penalty, mirostat_mode, mirostat_tau, mirostat_eta,
                                    logit_bias, seed, grammar, **sampling)
        steps = self.generate(tokens, max_tokens if max_tokens is not None else -1, sampler, stop or [],
                              n_probs=logprobs or 0, keep_tokens=keep)
        cid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        model = self.model_path
        prefix = self.vocab.detokenize([t for t in tokens if isinstance(t, (int, np.integer))], special=True) \
            if echo else ""
        if stream:
            return self._stream_completion(steps, cid, created, model, logprobs, prefix)
        text, lp, finish = prefix, _Logprobs(self.vocab, len(prefix)), None
        for s in steps:
            text += s.text
            lp.add(s)
            finish = s.finish_reason
        choice = {"text": text, "index": 0, "logprobs": lp.obj() if logprobs is not None else None,
                  "finish_reason": finish}
        return {"id": cid, "object": "text_completion", "created": created, "model": model, "choices": [choice],
                "usage": {"prompt_tokens": len(tokens), "completion_tokens": len(lp.tokens),
                          "total_tokens": len(tokens) + len(lp.tokens)}}

    def _stream_completion(self, steps, cid, created, model, logprobs, prefix=""):
        def chunk(text, lp, finish):
            return {"id": cid, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"text": text, "index": 0, "logprobs": lp, "finish_reason": finish}]}
        if prefix:
            yield chunk(prefix, None, None)
        offset = len(prefix)
        for s in steps:
            lp = None
            if logprobs is not None:
                one = _Logprobs(self.vocab, offset)
                one.add(s)
                offset = one.offset
                lp = one.obj()
            yield chunk(s.text, lp, s.finish_reason)

    __call__ = create_completion

    def _token_ids(self, tokens) -> frozenset:
        ids = set()
        for t in tokens:
            i = self.vocab.token_to_id.get(t) if isinstance(t, str) else t
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.vocab.n_tokens:
                raise ValueError(f"preserved_tokens: {t!r} is not a single token of the vocabulary")
            ids.add(i)
        return frozenset(ids)

    # ------------------------------------------------------------------ chat
    def chat_template(self):
        if self._chat_template is None:
            from .chat import template_from_metadata
            self._chat_template = template_from_metadata(self.model.metadata, self._chat_template_override)
        return self._chat_template

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        return self.chat_template().render(messages, add_generation_prompt=add_generation_prompt)

    def create_chat_completion(self, messages, max_tokens: int | None = None, temperature: float = 0.2,
                               top_p: float = 0.95, min_p: float = 0.05, top_k: int = 40, stop=None, seed=None,
                               stream: bool = False, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                               repeat_penalty: float = 1.0, logit_bias=None, logprobs: bool = False,
                               top_logprobs: int | None = None, grammar=None, response_format=None, tools=None,
                               tool_choice=None, parallel_tool_calls: bool | None = None,
                               reasoning_format: str | None = None, chat_template_kwargs: dict | None = None):
        """An OpenAI-shaped chat completion. ``grammar``/``response_format`` as in create_completion. ``tools``,
        ``tool_choice``, ``parallel_tool_calls`` as OpenAI's (llampy/llama/tools.py): calls come back in
        ``message.tool_calls`` with finish_reason "tool_calls"; a forced call (required, or a named function) is
        constrained by the tools' parameter schemas. With tools, a stream sends the reply when it is complete.
        ``reasoning_format`` and ``chat_template_kwargs`` as llama-server's (llampy/llama/reasoning.py): the
        reply's thinking block goes to ``message.reasoning_content`` (streamed as ``reasoning_content`` deltas)
        unless "none"; the kwargs are extra template variables, e.g. {"enable_thinking": False}. Bad values
        raise ValueError."""
        from .reasoning import check_reasoning_format, check_template_kwargs, splitter_for
        from .tools import chat_plan
        reasoning_format = check_reasoning_format(reasoning_format)
        kwargs = check_template_kwargs(chat_template_kwargs)
        grammar = constraint(grammar, response_format)
        tp, grammar = chat_plan(self.chat_template(), messages, tools, tool_choice, parallel_tool_calls, self.vocab,
                                grammar)
        msgs, images = self._chat_images(tp.messages)
        prompt = self.chat_template().render(msgs, add_generation_prompt=True, tools=tp.tools, **kwargs)
        think = splitter_for(tp.source, prompt, reasoning_format)
        # the rendered template already holds BOS where the model wants it
        if self.mtmd is not None and images:
            tokens = self.mtmd.flatten(self.mtmd.tokenize(prompt, images, add_special=False))
        else:
            tokens = self.vocab.tokenize(prompt, add_special=False, parse_special=True)
        if self.vocab.add_bos and self.vocab.bos is not None and (not tokens or tokens[0] != self.vocab.bos):
            tokens = [self.vocab.bos] + tokens
        res = self.create_completion(tokens, max_tokens=max_tokens, temperature=temperature, top_p=top_p, min_p=min_p,
                                     top_k=top_k, stop=stop, seed=seed, stream=stream, repeat_penalty=repeat_penalty,
                                     presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                                     logit_bias=logit_bias, logprobs=(top_logprobs or 1) if logprobs else None,
                                     grammar=grammar, preserved_tokens=tp.keep_tokens)
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        if stream:
            return self._stream_chat(res, cid, think) if tp.format == "none" else \
                self._stream_tools(res, cid, tp, think)
        ch = res["choices"][0]
        reasoning, text = think.split(ch["text"]) if think else ("", ch["text"])
        message, finish = {"role": "assistant", "content": text}, ch["finish_reason"]
        if reasoning:
            message["reasoning_content"] = reasoning
        if tp.format != "none":
            content, calls = tp.parse(text)
            message["content"] = (content or None) if calls else content
            if calls:
                message["tool_calls"] = [c.to_openai() for c in calls]
                finish = "tool_calls"
        return {"id": cid, "object": "chat.completion", "created": res["created"], "model": res["model"],
                "choices": [{"index": 0, "message": message, "logprobs": _chat_logprobs(ch["logprobs"]),
                             "finish_reason": finish}],
                "usage": res["usage"]}

    def _chat_images(self, messages):
        """Messages with OpenAI content parts: the text joined, each image a media marker (their bitmaps beside);
        images without a projector raise ValueError."""
        from ..mtmd.content import flatten_messages, has_images
        if not has_images(messages):
            if any(isinstance(m, dict) and isinstance(m.get("content"), list) for m in messages):
                return flatten_messages(messages)[0], []          # text parts only
            return messages, []
        if self.mtmd is None:
            raise ValueError("image input needs a projector: create the Llama with mmproj_path (llama.cpp's --mmproj)")
        from ..mtmd import bitmap_from_bytes
        msgs, raw = flatten_messages(messages, self.mtmd.media_marker)
        return msgs, [bitmap_from_bytes(b) for b in raw]

    def _stream_tools(self, chunks, cid, tp, think=None):
        """A stream with tools: the reply is read whole (a call cannot be told from text until it ends), then sent
        as a content delta and/or tool-call deltas, and the finish."""
        from .tools import tool_call_deltas
        text, finish, created, model = "", None, None, None
        for c in chunks:
            text += c["choices"][0]["text"]
            finish, created, model = c["choices"][0]["finish_reason"], c["created"], c["model"]
        reasoning, text = think.split(text) if think else ("", text)
        content, calls = tp.parse(text)
        deltas = [{"role": "assistant", "content": content if content or not calls else None}]
        if reasoning:
            deltas[0]["reasoning_content"] = reasoning
        deltas += tool_call_deltas(calls)
        for d in deltas:
            yield {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": [{"index": 0, "delta": d, "finish_reason": None}]}
        yield {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
               "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls" if calls else finish}]}

    def _stream_chat(self, chunks, cid, think=None):
        first = True
        for c in chunks:
            ch = c["choices"][0]
            delta = {"content": ch["text"]}
            if think is not None:       # held-back tails of a tag come out with the next piece or the finish
                r, t = think.feed(ch["text"])
                if ch["finish_reason"] is not None:
                    r2, t2 = think.flush()
                    r, t = r + r2, t + t2
                delta = {k: v for k, v in (("reasoning_content", r), ("content", t)) if v}
            if first:
                delta = {"role": "assistant", **delta}
            first = False
            yield {"id": cid, "object": "chat.completion.chunk", "created": c["created"], "model": c["model"],
                   "choices": [{"index": 0, "delta": delta, "logprobs": _chat_logprobs(ch["logprobs"]),
                                "finish_reason": ch["finish_reason"]}]}

    # ------------------------------------------------------------------ embeddings
    def embed(self, input, normalize: bool = True):
        """One pooled embedding per input string: the pooling asked for at creation, else the file's (an encoder's
        pooling_type), else the mean over the last hidden state. With rank pooling, the classifier's scores."""
        single = isinstance(input, str)
        texts = [input] if single else list(input)
        encoder = not getattr(self.model.arch, "USES_KV_CACHE", True)
        # an encoder's learned positions end at its training context
        limit = min(self.n_ctx, self.model.hparams.n_ctx_train or self.n_ctx) if encoder else self.n_ctx
        if self._embed_ctx is None:
            pooling = self._pooling or getattr(self.model.hparams, "pooling_type", None)
            pooling = pooling if pooling in ("mean", "cls", "last", "rank") else "mean"
            self._embed_ctx = Context(self.model, n_ctx=self.n_ctx, n_batch=self.n_ctx, n_ubatch=self.n_ctx,
                                      embeddings=True, pooling=pooling)
        out = []
        for text in texts:
            toks = self.vocab.tokenize(text, add_special=True, parse_special=True)
            if len(toks) >= limit:
                raise PromptTooLong(f"the input has {len(toks)} tokens, but the context holds {limit}")
            if not toks:
                raise ContextError("cannot embed an empty input")
            self._embed_ctx.kv_clear()
            self._embed_ctx.decode(Batch.from_tokens(toks, logits_all=True))
            e = self._embed_ctx.get_embeddings_seq(0).astype(np.float64)
            if normalize:
                e = e / max(np.linalg.norm(e), 1e-12)
            out.append([float(x) for x in e])
        return out[0] if single else out

    def create_embedding(self, input, model: str | None = None):
        texts = [input] if isinstance(input, str) else list(input)
        data = [{"object": "embedding", "index": i, "embedding": self.embed(t)} for i, t in enumerate(texts)]
        n = sum(len(self.vocab.tokenize(t, add_special=True, parse_special=True)) for t in texts)
        return {"object": "list", "data": data, "model": model or self.model_path,
                "usage": {"prompt_tokens": n, "total_tokens": n}}
