"""SentencePiece-style (SPM) tokenization as llama.cpp runs it (llama-vocab.cpp ``llm_tokenizer_spm_session``).

The text (spaces already escaped to U+2581 by the caller) starts as one symbol per code point. Repeatedly, the
adjacent pair whose concatenation is a vocabulary token with the highest score merges (leftmost among equal
scores). What is left is looked up whole; a symbol outside the vocabulary falls back to one ``<0xXX>`` token per
UTF-8 byte. Unlike BPE there are no merge ranks: the scores decide.
"""
from __future__ import annotations

import heapq


def spm_tokenize(text: str, token_to_id: dict, scores: list, byte_ids: list) -> list[int]:
    """``scores``: per-id float scores; ``byte_ids[b]``: the token for byte ``b`` (None where the vocabulary has
    none)."""
    n = len(text)
    if n == 0:
        return []
    sym = list(text)
    nxt = list(range(1, n + 1))
    prv = list(range(-1, n - 1))
    heap: list = []
    get = token_to_id.get

    def push(i: int, j: int) -> None:
        if i >= 0 and j < n:
            s = sym[i] + sym[j]
            t = get(s)
            if t is not None:
                # the queue's order: higher score first, then the smaller left index
                heapq.heappush(heap, (-scores[t], i, s))

    for i in range(n - 1):
        push(i, i + 1)
    while heap:
        _, i, s = heapq.heappop(heap)
        j = nxt[i]
        if not sym[i] or j >= n or not sym[j] or sym[i] + sym[j] != s:
            continue                      # stale: one side merged with another neighbour since it was queued
        sym[i], sym[j] = s, ""
        nxt[i] = nxt[j]
        if nxt[j] < n:
            prv[nxt[j]] = i
        push(prv[i], i)
        push(i, nxt[i])

    out: list[int] = []
    for s in sym:
        if not s:
            continue
        t = get(s)
        if t is not None:
            out.append(t)
            continue
        # llama.cpp's resegment: a merged symbol is always a token, so what is missing is a single character
        for b in s.encode("utf-8", "surrogatepass"):
            t = byte_ids[b]
            if t is None:
                from .vocab import VocabError     # (here: vocab imports this module)
                raise VocabError(f"SPM vocabulary has no byte token for 0x{b:02X} (needed for {s!r})")
            out.append(t)
    return out
