"""Constrained generation: GBNF grammars and JSON schemas compiled to a token mask per step by llguidance, applied
as one more sampler in the chain (llama.cpp's ``llama_sampler_init_llg``).

Three parts:
- ``tokenizer_for(vocab)``: llguidance's view of a llampy vocabulary: every token's bytes (control, unknown and
  ``<...>`` user-defined tokens prefixed with 0xFF, llguidance's mark for special tokens, so a grammar cannot emit
  them as text, only through a token terminal such as ``<|im_end|>``), the end-of-generation ids, and llampy's own
  tokenizer. Built once per vocabulary and cached (SmolLM2, 49k tokens: ~0.7 s; Gemma 3, 262k: ~2.2 s).
- ``LlamaGrammar``: a compiled grammar definition, from GBNF (``from_string``, ``from_file``; llguidance's GBNF to
  Lark converter), from a JSON schema (``from_json_schema``) or any JSON object (``json_object``). Compiling checks
  the grammar: what llguidance cannot compile or enforce is a ``GrammarError`` (a ValueError) naming it, never a
  grammar that quietly allows everything.
- ``Grammar``: the sampler. ``apply`` computes the mask and keeps only the candidates the matcher allows (the
  EOS/EOG tokens where the grammar may end, only those once it is complete); ``accept`` advances the matcher.
  ``overlap=True`` computes the next mask on a worker thread from ``accept`` on, beside the model's next forward
  pass (llguidance releases the GIL while it works). It is off by default: measured with
  benchmarks/grammar_cost.py on the shared 2-core machine it bought nothing (the decode loop waited longer for the
  grammar with it, 2.9-4.6% of the loop against 1.7-1.9% without: the worker competes with the decode threads for
  the cores and for the GIL around the call), while the whole constraint cost within noise of 0-6%.

Where few tokens are allowed, only those stay candidates, instead of the others being set to -inf as llama.cpp
does: every later sampler sees the same distribution (a -inf logit has probability 0 and is never selected) on a
much smaller array. Where most are allowed (inside a free string) the rest become -inf in place.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import threading
import weakref
from pathlib import Path

import numpy as np
from numba import njit

from .vocab import ATTR_CONTROL, ATTR_UNKNOWN, ATTR_USER_DEFINED, Vocab

# Whitespace between JSON tokens: none, one space, or a newline and an indent of up to 8 spaces. llguidance's default
# (any run of whitespace), and even llama.cpp's converter's (`"\n"{1,2} [ \t]{0,20}` per gap), let a small model at
# temperature 1 spend its whole budget on tabs and newlines (seen with SmolLM2); this still allows pretty-printing.
JSON_OPTIONS = {"whitespace_pattern": r"(?: |\n {0,8})?"}


class GrammarError(ValueError):
    """A grammar or schema that cannot be compiled or enforced, or a token the grammar rejects."""


def _llg():
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401  (the bitmask helpers)
    except ImportError as e:      # a hard dependency; say what is missing rather than fail later
        raise GrammarError(f"constrained generation needs the 'llguidance' package ({e})") from None
    return llguidance


# ------------------------------------------------------------------------------------------------ tokenizer
_TOKENIZERS: "weakref.WeakKeyDictionary[Vocab, object]" = weakref.WeakKeyDictionary()
_TOKENIZER_LOCK = threading.Lock()


def token_bytes(vocab: Vocab) -> tuple[list, list]:
    """Every token's bytes as llguidance wants them, and the ids of the special ones (marked with 0xFF)."""
    toks, special = [], []
    attr = vocab.attr
    for i in range(vocab.n_tokens):
        a = int(attr[i])
        text = vocab.tokens[i]
        if a & (ATTR_CONTROL | ATTR_UNKNOWN) or (a & ATTR_USER_DEFINED and text.startswith("<")
                                                  and text.endswith(">")):
            toks.append(b"\xff" + text.encode("utf-8", "surrogatepass"))
            special.append(i)
        else:
            toks.append(vocab.token_to_piece(i, special=True))
    return toks, special


class _VocabTokenizer:
    """The object llguidance.TokenizerWrapper reads: tokens, eos/bos ids, special ids, and a tokenize call."""

    def __init__(self, vocab: Vocab):
        self.tokens, self.special_token_ids = token_bytes(vocab)
        self.eos_token_id = vocab.eos if vocab.eos is not None else min(vocab.eog, default=0)
        self.bos_token_id = vocab.bos
        self._vocab = weakref.ref(vocab)

    def __call__(self, text):
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._vocab().tokenize(text, add_special=False, parse_special=False)


def tokenizer_for(vocab: Vocab):
    """llguidance's LLTokenizer for this vocabulary, built on first use and kept as long as the vocabulary."""
    with _TOKENIZER_LOCK:
        tk = _TOKENIZERS.get(vocab)
        if tk is None:
            llg = _llg()
            eog = sorted(vocab.eog) or ([vocab.eos] if vocab.eos is not None else [])
            tk = llg.LLTokenizer(llg.TokenizerWrapper(_VocabTokenizer(vocab)), eos_token=eog)
            _TOKENIZERS[vocab] = tk
        return tk


# ------------------------------------------------------------------------------------------------ grammars
class LlamaGrammar:
    """A compiled grammar: llguidance's grammar definition plus what it came from (``kind``: gbnf, lark,
    json_schema, regex). Build it with a constructor below; the names follow llama-cpp-python's LlamaGrammar."""

    def __init__(self, definition: str, kind: str, source):
        self.definition, self.kind, self.source = definition, kind, source

    @classmethod
    def from_string(cls, grammar: str, verbose: bool = False) -> "LlamaGrammar":
        """A GBNF grammar (llama.cpp's syntax, start rule ``root``); Lark source (llguidance's syntax, start rule
        ``start``) is recognised too."""
        llg = _llg()
        if not isinstance(grammar, str) or not grammar.strip():
            raise GrammarError("the grammar is empty")
        from llguidance.gbnf_to_lark import is_lark_syntax
        if is_lark_syntax(grammar):
            return cls(llg.LLMatcher.grammar_from_lark(grammar), "lark", grammar)._checked()
        return cls(llg.LLMatcher.grammar_from_lark(gbnf_to_lark(grammar)), "gbnf", grammar)._checked()

    @classmethod
    def from_file(cls, path, verbose: bool = False) -> "LlamaGrammar":
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise GrammarError(f"cannot read the grammar file {str(path)!r}: {e.strerror or e}") from None
        return cls.from_string(text, verbose)

    @classmethod
    def from_json_schema(cls, schema, verbose: bool = False) -> "LlamaGrammar":
        """A JSON schema, as a dict or its JSON text."""
        llg = _llg()
        if isinstance(schema, (str, bytes)):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        if isinstance(schema, bool):
            schema = {} if schema else {"not": {}}
        if not isinstance(schema, dict):
            raise GrammarError(f"a JSON schema must be an object, not {type(schema).__name__}")
        try:
            definition = llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except (ValueError, TypeError) as e:
            raise GrammarError(f"invalid JSON schema: {e}") from None
        return cls(definition, "json_schema", schema)._checked()

    @classmethod
    def json_object(cls) -> "LlamaGrammar":
        """Any JSON object (OpenAI's response_format {"type": "json_object"})."""
        return cls.from_json_schema({"type": "object"})

    @classmethod
    def from_regex(cls, regex: str) -> "LlamaGrammar":
        return cls(_llg().LLMatcher.grammar_from_regex(regex), "regex", regex)._checked()

    @classmethod
    def coerce(cls, grammar) -> "LlamaGrammar":
        """A LlamaGrammar from what an API caller may pass: one of ours, GBNF text, or an object carrying GBNF
        source in ``_grammar`` (llama-cpp-python's LlamaGrammar)."""
        if isinstance(grammar, cls):
            return grammar
        if isinstance(grammar, str):
            return cls.from_string(grammar)
        src = getattr(grammar, "_grammar", None)
        if isinstance(src, str):
            return cls.from_string(src)
        raise GrammarError(f"grammar must be GBNF text or a LlamaGrammar, not {type(grammar).__name__}")

    def _checked(self) -> "LlamaGrammar":
        is_error, msgs = _llg().LLMatcher.validate_grammar_with_warnings(self.definition)
        if is_error:
            raise GrammarError(f"invalid {self.kind.replace('_', ' ')}: {_clean(msgs[0])}")
        return self

    def matcher(self, vocab: Vocab):
        """A fresh llguidance matcher of this grammar over ``vocab``; GrammarError if it cannot be built."""
        llg = _llg()
        m = llg.LLMatcher(tokenizer_for(vocab), self.definition, log_level=0)
        if m.is_error():
            raise GrammarError(f"invalid {self.kind.replace('_', ' ')}: {_clean(m.get_error())}")
        return m

    def __repr__(self) -> str:
        src = self.source if isinstance(self.source, str) else json.dumps(self.source)
        return f"LlamaGrammar({self.kind}, {src[:60]!r}{'...' if len(src) > 60 else ''})"


def from_response_format(rf) -> LlamaGrammar | None:
    """OpenAI's ``response_format``: {"type": "text"} (no constraint), {"type": "json_object"} (any JSON object;
    llama-cpp-python's optional "schema" key narrows it), {"type": "json_schema", "json_schema": {"schema": ...}}."""
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise GrammarError("response_format must be an object with a 'type'")
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        schema = rf.get("schema")
        return LlamaGrammar.json_object() if schema is None else LlamaGrammar.from_json_schema(schema)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise GrammarError("response_format of type 'json_schema' needs a 'json_schema' object holding 'schema'")
        schema = js.get("schema", {"type": "object"} if "name" in js else None)
        if schema is None:
            raise GrammarError("response_format.json_schema needs a 'schema'")
        return LlamaGrammar.from_json_schema(schema)
    raise GrammarError(f"unknown response_format type {kind!r} (text, json_object or json_schema)")


def constraint(grammar=None, response_format=None) -> LlamaGrammar | None:
    """The one grammar a request asks for: ``grammar`` (LlamaGrammar or GBNF) or ``response_format``, not both."""
    rf = from_response_format(response_format)
    if grammar is not None and rf is not None:
        raise GrammarError("give either a grammar or a response_format, not both")
    return LlamaGrammar.coerce(grammar) if grammar is not None else rf


def gbnf_to_lark(text: str) -> str:
    """llama.cpp's GBNF as llguidance's Lark, by llguidance's converter with two repairs: token terminals
    (``<[id]>``, ``<|im_end|>``-style names) are kept, and ``\\uXXXX``/``\\UXXXXXXXX`` escapes come out as the
    character (the converter drops their leading zeros, which its own lexer then rejects)."""
    from llguidance import gbnf_to_lark as g2l

    class TokenNode(g2l.ASTNode):
        def __init__(self, text):
            self.text = text

        def __str__(self):
            return self.text

        def is_terminal(self):      # a token is not a lexeme: it keeps its rule a parser rule
            return False

    class Parser(g2l.GrammarParser):
        def _parse_char(self, pos):
            c, nxt = super()._parse_char(pos)
            if c[:2] in ("\\u", "\\U"):
                n = 4 if c[1] == "u" else 8
                code = int(pos.text[pos.pos + 2:pos.pos + 2 + n], 16)
                if code > 0x10FFFF:
                    raise g2l.GbnfToLarkError(pos, f"escape \\{c[1]}{code:X} is past the last code point")
                return (f"\\x{code:02x}" if code < 0x80 else chr(code)), nxt
            return c, nxt

        def _parse_sequence(self, pos, is_nested):
            nodes: list = []
            while pos.current() and pos.current() not in "|)" and (is_nested or pos.current() not in "\r\n"):
                c = pos.current()
                if c == '"':
                    node, pos = self._parse_literal(pos)
                elif c == "[":
                    node, pos = self._parse_char_class(pos)
                elif c == "(":
                    node, pos = self._parse_group(pos, is_nested=is_nested)
                elif c == ".":
                    node, pos = g2l.RegexNode("."), pos.advance()
                elif c == "<":
                    end = pos.text.find(">", pos.pos)
                    body = pos.text[pos.pos + 1:end] if end > 0 else ""
                    if not body or any(ch.isspace() for ch in body):
                        raise g2l.GbnfToLarkError(pos, "a token terminal is <[id]> or <token-text>")
                    node, pos = TokenNode(pos.text[pos.pos:end + 1]), pos.advance(end + 1 - pos.pos)
                elif self._is_word_char(c):
                    name, pos = self._parse_name(pos)
                    node = g2l.RuleRefNode(name)
                else:
                    break
                nodes.append(node)
                pos = self._skip_space(pos, allow_newlines=is_nested)
                pos = self._parse_repetition(pos, nodes)
                pos = self._skip_space(pos, allow_newlines=is_nested)
            return g2l.SequenceNode(nodes), pos

    try:
        rules = Parser().parse(text)
        g2l.resolve(rules)
    except Exception as e:       # the converter raises bare Exceptions for unknown rules and syntax errors
        raise GrammarError(f"invalid GBNF grammar: {e}") from None
    out = "%llguidance {}\n\n"
    for r in sorted(rules.values(), key=lambda r: r.order):
        out += str(r) + "\n"
    return out


def _clean(msg: str) -> str:
    return " ".join(str(msg).split())


# ------------------------------------------------------------------------------------------------ the sampler
# One worker computes the masks that overlap the forward pass (overlap=True); the server's streams share it.
_POOL: cf.ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> cf.ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="llampy-grammar")
        return _POOL


@njit(cache=True)
def _mask_count(words, n):
    """How many of the ids below n have their bit set (bit i of 32-bit word i // 32)."""
    k = 0
    for w in range(min(words.size, (n + 31) // 32)):
        x = np.uint32(words[w])
        if w * 32 + 32 > n:                              # the last word's bits past n do not count
            x &= np.uint32((1 << (n - w * 32)) - 1)
        x = x - ((x >> np.uint32(1)) & np.uint32(0x55555555))       # SWAR popcount
        x = (x & np.uint32(0x33333333)) + ((x >> np.uint32(2)) & np.uint32(0x33333333))
        x = (x + (x >> np.uint32(4))) & np.uint32(0x0F0F0F0F)
        k += ((x * np.uint32(0x01010101)) >> np.uint32(24)) & np.uint32(0xFF)   # the product may widen
    return k


@njit(cache=True)
def _mask_ids(words, n, k):
    """The k ids below n whose bit is set, ascending. Words of all zeros or all ones are taken whole."""
    out = np.empty(k, np.int64)
    j = 0
    for w in range(min(words.size, (n + 31) // 32)):
        x = np.uint32(words[w])
        if x == 0:
            continue
        base = w * 32
        for b in range(min(32, n - base)):
            if (x >> np.uint32(b)) & np.uint32(1) and j < k:
                out[j] = base + b
                j += 1
    return out[:j]


@njit(cache=True)
def _mask_disallow(words, logits):
    """-inf for every id whose bit is clear (ids past the mask included), in place."""
    n = logits.size
    nbits = words.size * 32
    for w in range((n + 31) // 32):
        base = w * 32
        x = np.uint32(words[w]) if base < nbits else np.uint32(0)
        if x == np.uint32(0xFFFFFFFF) and base + 32 <= n:
            continue
        for b in range(min(32, n - base)):
            if not (x >> np.uint32(b)) & np.uint32(1):
                logits[base + b] = -np.inf


@njit(cache=True)
def _mask_keep(words, ids):
    """Positions in ``ids`` whose bit is set (candidates that are not the plain full vocabulary)."""
    out = np.empty(ids.size, np.int64)
    k = 0
    nbits = words.size * 32
    for p in range(ids.size):
        i = ids[p]
        if 0 <= i < nbits and (np.uint32(words[i >> 5]) >> np.uint32(i & 31)) & np.uint32(1):
            out[k] = p
            k += 1
    return out[:k]


class Grammar:
    """The grammar sampler: put it first in a Chain. ``grammar`` is a LlamaGrammar, or GBNF text.

    ``overlap``: compute the next mask on a worker thread as soon as a token is accepted (while the caller runs the
    forward pass that produces the next logits); False (the default, see the module's doc) computes it in
    ``apply``."""

    def __init__(self, vocab: Vocab, grammar, overlap: bool = False):
        self.vocab = vocab
        self.grammar = LlamaGrammar.coerce(grammar)
        self.overlap = overlap
        self._m = self.grammar.matcher(vocab)
        self._llg = _llg()
        self._mask = self._llg.numpy.allocate_token_bitmask(1, tokenizer_for(vocab).vocab_size)
        self._pending: cf.Future | None = None
        self._fresh = False          # _mask holds the current state's mask

    # the Sampler interface (duck-typed, so that sampling.py need not import llguidance)
    def apply(self, c) -> None:
        self._wait()
        if not self._fresh:
            self._fill()
        words = self._mask[0]
        if c.identity:
            # few allowed (JSON structure, digits, enums): keep just those; many (inside a free string): -inf on
            # the rest in place, cheaper than copying most of the vocabulary
            k = _mask_count(words, c.size)
            if k == 0:
                why = _clean(self._m.get_error()) or "no continuation"
                raise GrammarError(f"the grammar allows no token here: {why}")
            if k <= c.size // 4:
                c.take(_mask_ids(words, c.size, k))
            elif k < c.size:
                _mask_disallow(words, c.logits)
            return
        keep = _mask_keep(words, c.ids.astype(np.int64))
        if keep.size == 0:
            raise GrammarError("the grammar allows none of the candidates left by earlier samplers")
        if keep.size < c.size:
            c.take(keep)

    def accept(self, token: int) -> None:
        self._wait()
        if self._m.is_stopped() and self.vocab.is_eog(token):
            return          # end of generation after the end (a caller ignoring EOS): nothing to advance
        self._fresh = False
        if not self._m.consume_token(int(token)):
            err = _clean(self._m.get_error())
            piece = self.vocab.token_to_piece(int(token), special=True)
            raise GrammarError(f"token {int(token)} ({piece!r}) does not match the grammar: {err}")
        if self.overlap and not self._m.is_stopped():
            self._pending = _pool().submit(self._fill)

    def reset(self) -> None:
        self._wait()
        self._m.reset()
        self._fresh = False

    # state
    def is_accepting(self) -> bool:
        """The text so far is a complete sentence of the grammar."""
        self._wait()
        return self._m.is_accepting()

    def is_stopped(self) -> bool:
        """Nothing but end of generation can follow."""
        self._wait()
        return self._m.is_stopped()

    def _fill(self) -> None:
        self._llg.numpy.fill_next_token_bitmask(self._m, self._mask)
        self._fresh = True

    def _wait(self) -> None:
        p, self._pending = self._pending, None
        if p is not None:
            p.result()

    def __repr__(self) -> str:
        return f"Grammar({self.grammar!r})"
