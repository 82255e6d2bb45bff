"""Reasoning models: a reply's thinking block split from its content into ``reasoning_content`` (llama.cpp's
``--reasoning-format``), and the checks of the request fields that steer it.

The block is ``<think> ... </think>`` (DeepSeek R1, Qwen 3, QwQ) or, for a Gemma 4 template,
``<|channel>thought ... <channel|>``; a gpt-oss (harmony) template's replies are read by tools_harmony's splitter
(the ``analysis`` channel is the reasoning). ``reasoning_format``: "none" keeps it in the content; "auto", the default,
splits it where the template knows the tags or the prompt opened a block; "deepseek" splits it whatever the
template. ``chat_template_kwargs`` are extra template variables (``enable_thinking`` among them, a boolean as
llama-server requires).
"""
from __future__ import annotations

from . import tools_gemma4 as gemma4
from . import tools_harmony as harmony

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
FORMATS = ("none", "auto", "deepseek", "deepseek-legacy")
RESERVED = frozenset({"messages", "add_generation_prompt", "tools", "bos_token", "eos_token"})


def check_reasoning_format(v) -> str:
    """The reasoning_format, "auto" when None; ValueError naming the choices otherwise."""
    if v is None:
        return "auto"
    if v not in FORMATS:
        raise ValueError(f"reasoning_format must be 'none', 'auto' or 'deepseek', got {v!r}")
    return v


def check_template_kwargs(kw) -> dict:
    """chat_template_kwargs: an object of template variables that do not replace the ones the renderer sets;
    enable_thinking a boolean (llama-server refuses a string there too: "false" would be true in the template)."""
    if kw is None:
        return {}
    if not isinstance(kw, dict) or not all(isinstance(k, str) and k.isidentifier() for k in kw):
        raise ValueError("chat_template_kwargs must be an object of template variables")
    reserved = RESERVED & set(kw)
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(sorted(reserved))}")
    if "enable_thinking" in kw and not isinstance(kw["enable_thinking"], bool):
        raise ValueError("chat_template_kwargs.enable_thinking must be a boolean")
    return dict(kw)


def tags(template_source: str) -> tuple[str, str]:
    """The thinking block's opening and closing tags for this template."""
    if gemma4.DETECT in template_source or gemma4.THOUGHT_OPEN in template_source:
        return gemma4.THOUGHT_OPEN, gemma4.THOUGHT_CLOSE
    return THINK_OPEN, THINK_CLOSE


def markers(template_source: str) -> tuple:
    """The tokens a reply keeps in its text so that its block can be found (Gemma 4's are control tokens)."""
    if harmony.is_harmony(template_source):
        return harmony.MARKERS
    if tags(template_source)[0] == gemma4.THOUGHT_OPEN:
        return "<|channel>", "<channel|>"
    return THINK_OPEN, THINK_CLOSE


def wants_reasoning(template_source: str, prompt: str, reasoning_format: str | None) -> bool:
    """Whether a reply's thinking block is split off (see the module's docstring)."""
    if reasoning_format == "none":
        return False
    open_tag = tags(template_source)[0]
    return (reasoning_format in ("deepseek", "deepseek-legacy") or open_tag in template_source
            or prompt.rstrip().endswith(open_tag))


def splitter_for(template_source: str, prompt: str, reasoning_format: str | None) -> "ReasoningSplitter | None":
    """The splitter of one request's reply, or None where the block stays in the content."""
    if harmony.is_harmony(template_source):       # its messages' headers never stay in the content
        return harmony.HarmonySplitter(keep_analysis=reasoning_format == "none")
    if not wants_reasoning(template_source, prompt, reasoning_format):
        return None
    t = tags(template_source)
    return ReasoningSplitter(prompt.rstrip().endswith(t[0]), t)


class ReasoningSplitter:
    """Splits a reply into reasoning (inside the tags) and content, incrementally for streams: ``feed`` returns
    (reasoning, content) text that is safe to send (a tail that may be the start of a tag is held back); ``flush``
    the rest. ``opened``: the prompt ended with the opening tag (the reply starts inside the block). ``split``
    splits a whole reply with a fresh state, whatever was fed."""

    def __init__(self, opened: bool = False, tags: tuple = (THINK_OPEN, THINK_CLOSE)):
        self.opened, self.tags = opened, tags
        self.state = "think" if opened else "start"
        self.buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        open_tag, close_tag = self.tags
        self.buf += text
        reasoning, content = "", ""
        while True:
            if self.state == "start":
                s = self.buf.lstrip()
                if s.startswith(open_tag):
                    self.buf, self.state = s[len(open_tag):], "think"
                    continue
                if open_tag.startswith(s) and s:       # might still become the opening tag
                    return reasoning, content
                if not s:
                    return reasoning, content
                self.state = "content"
            if self.state == "think":
                i = self.buf.find(close_tag)
                if i >= 0:
                    reasoning += self.buf[:i]
                    self.buf, self.state = self.buf[i + len(close_tag):].lstrip(), "content"
                    continue
                keep = _partial_tail(self.buf, close_tag)
                reasoning += self.buf[:len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                return reasoning, content
            content += self.buf
            self.buf = ""
            return reasoning, content

    def flush(self) -> tuple[str, str]:
        rest, self.buf = self.buf, ""
        return (rest, "") if self.state == "think" else ("", rest)

    def split(self, text: str) -> tuple[str, str]:
        return split_reasoning(text, self.opened, self.tags)


def _partial_tail(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def split_reasoning(text: str, opened: bool = False, tags: tuple = (THINK_OPEN, THINK_CLOSE)) -> tuple[str, str]:
    """(reasoning, content) of a whole reply."""
    sp = ReasoningSplitter(opened, tags)
    r1, c1 = sp.feed(text)
    r2, c2 = sp.flush()
    return (r1 + r2).strip(), c1 + c2
