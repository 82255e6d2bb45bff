"""What one request may cost the server before any model work: the JSON body's shape, and the work of turning text
into tokens, kept off the event loop when it is large.

A request body is parsed strictly: no `NaN`/`Infinity` literals or numbers that overflow to them (a NaN logit bias
would force its token at every step), no lone UTF-16 surrogates (`"\\ud800"`: no UTF-8 text holds one, and the
tokenizer could not encode it), and at most ``MAX_JSON_DEPTH`` levels of nesting (the parser itself recurses, and
so do the validators and the schema compiler downstream). Each is a 400 naming the problem.
"""
from __future__ import annotations

import asyncio
import json
import math
import re
from concurrent.futures import ThreadPoolExecutor

from .oai import APIError

MAX_JSON_DEPTH = 100            # arrays/objects inside each other in one request body
PARSE_INLINE = 256 << 10        # bodies up to this many bytes are parsed on the event loop, larger ones in a thread
TOKENIZE_INLINE = 4 << 10       # characters of text tokenized on the event loop; longer texts go to a thread

# a JSON escape of a UTF-16 surrogate; without one in the body, no parsed string can hold a surrogate (the UTF-8
# decoder refuses encoded surrogates)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")

# Long texts are tokenized here, two at a time: a few huge prompts then queue behind each other instead of taking
# every thread of the default executor (which other work of the event loop needs), and small requests, tokenized
# inline, never wait behind them.
_tokenize_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="llampy-tokenize")


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(s: str) -> float:
    v = float(s)
    if not math.isfinite(v):
        raise ValueError(f"the number {s[:40]} is too large")
    return v


def _check_structure(body, check_strings: bool) -> None:
    """Depth of nesting, and (when the raw body had a surrogate escape) strings that are not valid Unicode text.
    Iterative: a structure the parser accepted may still be too deep for a recursive walk."""
    stack = [(body, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict):
            items = list(v.items())
            if check_strings:
                for k, _ in items:
                    _check_text(k)
            vals = [x for _, x in items]
        elif isinstance(v, list):
            vals = v
        else:
            if check_strings and isinstance(v, str):
                _check_text(v)
            continue
        if depth > MAX_JSON_DEPTH:
            raise APIError(400, f"the request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels")
        for x in vals:
            if isinstance(x, (dict, list)):
                stack.append((x, depth + 1))
            elif check_strings and isinstance(x, str):
                _check_text(x)


def _check_text(s: str) -> None:
    if s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"the request body holds a lone UTF-16 surrogate (\\u{ord(s[e.start]):04x}), which is "
                            f"not text") from None


def _parse(raw: bytes):
    try:
        body = json.loads(raw, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:
        raise APIError(400, f"the request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels") \
            from None
    except (ValueError, UnicodeDecodeError) as e:    # JSONDecodeError, our constants, integers past 4300 digits
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    _check_structure(body, bool(_SURROGATE_ESCAPE.search(raw)))
    return body


async def parse_json_body(raw: bytes):
    """The parsed body (APIError 400 for the problems above); a large body is parsed in a worker thread."""
    if len(raw) <= PARSE_INLINE:
        return _parse(raw)
    return await asyncio.get_running_loop().run_in_executor(_tokenize_pool, _parse, raw)


def text_size(x) -> int:
    """Characters of the text in a request field: a string, or the strings of a list (prompts, token ids)."""
    if isinstance(x, str):
        return len(x)
    if isinstance(x, list):
        return sum(len(t) for t in x if isinstance(t, str))
    return 0


async def run_sized(n_chars: int, fn, *args):
    """fn(*args) on the event loop when it handles at most TOKENIZE_INLINE characters, else in the tokenizing
    threads (tokenizing runs at ~1 MB/s: a 4 MB prompt would stop every route for seconds)."""
    if n_chars <= TOKENIZE_INLINE:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(_tokenize_pool, lambda: fn(*args))


_longest: dict[int, int] = {}       # id(vocab) -> UTF-8 bytes of its longest token text


def min_tokens(vocab, text: str) -> int:
    """A lower bound on the number of tokens ``text`` makes, without tokenizing it: its UTF-8 bytes over those of
    the vocabulary's longest token. Only where every byte of the text ends up in some token whose text is at least
    as long (byte-level BPE; SentencePiece, whose ▁, byte and unknown tokens are no shorter than what they
    cover); 0 for tokenizers that normalise text away (WordPiece, Unigram's charsmap, whitespace splitting)."""
    if getattr(vocab, "model", None) not in ("gpt2", "llama") or getattr(vocab, "remove_extra_whitespaces", False):
        return 0
    n = _longest.get(id(vocab))
    if n is None:
        n = _longest[id(vocab)] = max((len(t.encode("utf-8", "surrogatepass")) for t in vocab.tokens), default=1)
    if len(text) * 4 < n:       # short text: not worth encoding to count
        return 0
    return len(text.encode("utf-8", "surrogatepass")) // max(n, 1)


def check_fits(vocab, text: str, limit: int, param: str) -> None:
    """APIError 400 (context_length_exceeded) when ``text`` surely makes ``limit`` tokens or more (min_tokens):
    a prompt that cannot fit a slot is refused without the seconds a megabyte of text takes to tokenize."""
    n = min_tokens(vocab, text)
    if n >= limit:
        raise APIError(400, f"'{param}' makes at least {n} tokens, more than the {limit - 1} that fit", param,
                       code="context_length_exceeded")
