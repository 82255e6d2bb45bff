"""gpt-oss's chat format (OpenAI's harmony), as llama.cpp's common/parsers/gpt-oss.cpp reads it.

A reply is a run of messages, each ``<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>TYPE]<|message|>BODY`` ended by
``<|end|>`` (then ``<|start|>assistant`` opens the next), ``<|call|>`` or ``<|return|>`` (both end the generation).
The recipient may stand before the channel instead (``<|start|>assistant to=functions.f<|channel|>commentary``).
Channel ``analysis`` is the reasoning (``reasoning_content``; with reasoning_format "none" it stays in the content
with its markers, as llama.cpp keeps it); ``final``, and ``commentary`` without a recipient (a preamble), are the
content; a message to ``functions.NAME`` is a tool call whose body is the JSON arguments; a message to any other
recipient (gpt-oss's built-in tools) is dropped, as llama.cpp consumes it.

The template takes earlier replies' reasoning as ``thinking`` (llama.cpp copies ``reasoning_content`` there).
"""
from __future__ import annotations

import re

DETECT = "<|channel|>"         # llama.cpp picks its gpt-oss handler by this marker in the template
# the control tokens a reply keeps in its text so that it can be read (llama.cpp's preserved tokens)
MARKERS = ("<|channel|>", "<|constrain|>", "<|message|>", "<|start|>", "<|end|>")
_ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
_START = "<|start|>assistant"
# a header; gpt-oss-20b now and then writes a stray "<|channel|>commentary[ to=assistant]" before the real channel
_HEADER = re.compile(r"(?:<\|start\|>assistant)?(?: to=(?P<to1>[^\s<]+))?"
                     r"(?:<\|channel\|>commentary(?: to=assistant)?(?=<\|channel\|>))?"
                     r"<\|channel\|>(?P<channel>[A-Za-z0-9_\-]+)(?: to=(?P<to2>[^\s<]+))?\s*(?:<\|constrain\|>)?"
                     r"(?P<constrain>[A-Za-z0-9_\-]*)<\|message\|>")
_CALL = re.compile(r"(?:<\|start\|>assistant)?(?: to=functions\.(?P<n1>[A-Za-z0-9_.\-]+))?<\|channel\|>"
                   r"(?:commentary|analysis)(?: to=functions\.(?P<n2>[A-Za-z0-9_.\-]+))?\s*(?:<\|constrain\|>)?"
                   r"[A-Za-z0-9_\-]*<\|message\|>")


def is_harmony(template_source: str) -> bool:
    return DETECT in template_source


def template_messages(messages: list) -> list:
    """reasoning_content as the template's ``thinking``; an assistant turn with calls and reasoning loses its
    content (llama.cpp's adjustment: the template then writes the reasoning before the calls)."""
    out = []
    for m in messages:
        if isinstance(m, dict) and isinstance(m.get("reasoning_content"), str):
            m = {**m, "thinking": m["reasoning_content"]}
            if isinstance(m.get("tool_calls"), list) and m["tool_calls"]:
                m.pop("content", None)
        out.append(m)
    return out


def _partial(text: str, marks=MARKERS + _ENDS) -> int:
    """The length of the longest end of ``text`` that may still become a marker."""
    i = text.rfind("<")
    if i < 0:
        return 0
    tail = text[i:]
    return len(tail) if any(m.startswith(tail) for m in marks) and tail not in marks else 0


class HarmonySplitter:
    """A reply into (reasoning, content), incrementally as ReasoningSplitter: ``feed`` returns what is safe to send,
    ``flush`` the rest, ``split`` a whole reply. Content holds the final and preamble bodies, and tool calls as
    written (``<|channel|>commentary to=functions.f ...<|message|>{...}``) for the tool-call parser.
    ``keep_analysis``: reasoning_format "none" (the analysis stays in the content, markers and all)."""

    def __init__(self, keep_analysis: bool = False):
        self.keep_analysis = keep_analysis
        self.state, self.buf, self.route = "header", "", None

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning, content = [], []
        while self.buf:
            if self.state == "plain":        # not harmony: everything is content
                content.append(self.buf)
                self.buf = ""
                break
            if self.state == "header":
                m = _HEADER.match(self.buf)
                if m is None:
                    if "<|message|>" in self.buf or not self._may_be_header(self.buf):
                        self.state = "plain"
                        continue
                    break            # wait for the rest of the header
                self.route = self._route(m)
                if self.route == "call":
                    content.append(m.group(0))
                elif self.route == "raw":
                    content.append(m.group(0)[len(_START):] if m.group(0).startswith(_START) else m.group(0))
                self.buf, self.state = self.buf[m.end():], "body"
                continue
            # body: up to the message's end marker
            ends = [(i, e) for e in _ENDS if (i := self.buf.find(e)) >= 0]
            if ends:
                i, e = min(ends)
                self._emit(self.buf[:i], reasoning, content)
                if self.route == "raw" and e == "<|end|>":
                    content.append(e)
                self.buf = self.buf[i + (len(e) if e != "<|start|>" else 0):]
                self.state = "header"
                continue
            keep = _partial(self.buf)
            self._emit(self.buf[:len(self.buf) - keep], reasoning, content)
            self.buf = self.buf[len(self.buf) - keep:]
            break
        return "".join(reasoning), "".join(content)

    def _may_be_header(self, s: str) -> bool:
        """Whether ``s`` can still grow into a message header."""
        for head in (_START, "<|channel|>", " to="):
            if s.startswith(head) or head.startswith(s):
                return True
        return False

    def _route(self, m) -> str:
        to = m.group("to1") or m.group("to2")
        if to:
            return "call" if to.startswith("functions.") else "drop"
        if m.group("channel") == "analysis":
            return "raw" if self.keep_analysis else "reasoning"
        return "content"

    def _emit(self, text: str, reasoning: list, content: list) -> None:
        if self.route == "reasoning":
            reasoning.append(text)
        elif self.route in ("content", "raw", "call"):
            content.append(text)

    def flush(self) -> tuple[str, str]:
        rest, self.buf = self.buf, ""
        if self.state == "body":
            return (rest, "") if self.route == "reasoning" else ("", rest if self.route != "drop" else "")
        return "", rest if self.state == "plain" or not rest.startswith(("<|channel|>", _START)) else ""

    def split(self, text: str) -> tuple[str, str]:
        sp = HarmonySplitter(self.keep_analysis)
        r1, c1 = sp.feed(text)
        r2, c2 = sp.flush()
        return (r1 + r2).strip(), c1 + c2


def call_headers(text: str):
    """(name, start, end) of each call header in a reply's content as HarmonySplitter leaves it; the JSON arguments
    start at ``end``."""
    for m in _CALL.finditer(text):
        name = m.group("n1") or m.group("n2")
        if name:
            yield name, m.start(), m.end()
