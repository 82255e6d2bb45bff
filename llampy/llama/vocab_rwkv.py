"""RWKV's "world" tokenization as llama.cpp runs it (llama-vocab.cpp ``llm_tokenizer_rwkv``): token texts are
escaped bytes (``\\t \\n \\r \\xNN``, a backslash before any other character stands for it), and the text's UTF-8 is
cut greedily into the longest token at each position; a byte no token starts with becomes the unknown token."""
from __future__ import annotations


def rwkv_unescape(escaped: str) -> bytes:
    """llama_unescape_rwkv_token."""
    out = bytearray()
    escaping, hex_left, acc = False, 0, 0
    for c in escaped.encode("utf-8", "surrogatepass"):
        if hex_left:
            acc = ((acc << 4) + (c - 87 if c >= 0x61 else c - 48)) & 0xFF     # 'a'.. -> 10.., else digits
            hex_left -= 1
            if not hex_left:
                out.append(acc)
                acc = 0
        elif escaping:
            if c == 0x78:              # x
                hex_left = 2
            else:
                out.append({0x74: 9, 0x6E: 10, 0x72: 13}.get(c, c))
            escaping = False
        elif c == 0x5C:                # backslash
            escaping = True
        else:
            out.append(c)
    return bytes(out)


class RwkvTokenizer:
    def __init__(self, tokens: list[str], unk: int | None):
        self.ids: dict[bytes, int] = {}
        for i, t in enumerate(tokens):          # a repeated byte string: the last id, as llama.cpp's trie
            self.ids[rwkv_unescape(t)] = i
        self.prefixes = {k[:n] for k in self.ids for n in range(1, len(k) + 1)}
        self.max_len = max(map(len, self.ids), default=0)
        self.unk = unk if unk is not None else -1

    def tokenize(self, text: str) -> list[int]:
        b = text.encode("utf-8", "surrogatepass")
        out, pos, n = [], 0, len(b)
        while pos < n:
            if b[pos:pos + 1] not in self.prefixes:
                out.append(self.unk)
                pos += 1
                continue
            # the trie walk: extend while the prefix is a path, remember the longest token
            tid, end, j = 0, 0, pos + 1
            while j <= n and b[pos:j] in self.prefixes:
                t = self.ids.get(b[pos:j])
                if t is not None:
                    tid, end = t, j
                j += 1
            if end == 0:
                # a path of prefixes with no token on it (a malformed vocabulary): llama.cpp would go back to
                # position 0 and loop for ever; here the byte is unknown, as one no token starts with
                out.append(self.unk)
                pos += 1
                continue
            out.append(tid)
            pos = end
        return out
