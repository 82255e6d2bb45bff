"""A batch of tokens to decode, like llama_batch: tokens, positions, sequence ids, and which positions want logits."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Batch:
    tokens: np.ndarray            # int32 [n]
    pos: np.ndarray               # int32 [n]
    seq_id: list                  # per token: a tuple of sequence ids (usually one)
    logits: np.ndarray            # bool [n]: return logits (or embeddings) for this position
    # float32 [n, n_embd]: input embeddings in place of the tokens (an image's chunk; llama_batch.embd), the
    # tokens then only placeholders
    embd: np.ndarray | None = None
    # int32 [n, 4]: M-RoPE's four positions of each token (an image's rows t, y, x, z), the pos column the first;
    # None: a text token's p, p, p, 0
    mpos: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def from_tokens(cls, tokens, pos0: int = 0, seq_id: int = 0, logits_last: bool = True,
                    logits_all: bool = False) -> "Batch":
        """One sequence's tokens at positions pos0, pos0+1, ... (llama_batch_get_one)."""
        t = np.asarray(tokens, dtype=np.int32).reshape(-1)
        n = len(t)
        want = np.zeros(n, dtype=bool)
        if logits_all:
            want[:] = True
        elif logits_last and n:
            want[-1] = True
        return cls(t, np.arange(pos0, pos0 + n, dtype=np.int32), [(seq_id,)] * n, want)

    @classmethod
    def from_embd(cls, embd, pos0: int = 0, seq_id: int = 0, pos=None, mpos=None) -> "Batch":
        """Rows of input embeddings of one sequence at positions pos0, pos0+1, ... (or ``pos``; or M-RoPE's
        ``mpos`` [n, 4], whose first column is then the position), no outputs."""
        e = np.ascontiguousarray(embd, dtype=np.float32)
        n = len(e)
        if mpos is not None:
            mpos = np.ascontiguousarray(mpos, dtype=np.int32).reshape(n, 4)
            p = mpos[:, 0].copy()
        else:
            p = np.arange(pos0, pos0 + n, dtype=np.int32) if pos is None else np.asarray(pos, np.int32)
        return cls(np.zeros(n, np.int32), p, [(seq_id,)] * n, np.zeros(n, bool), e, mpos)

    @classmethod
    def empty(cls) -> "Batch":
        return cls(np.zeros(0, np.int32), np.zeros(0, np.int32), [], np.zeros(0, bool))

    def add(self, token: int, pos: int, seq_ids, logits: bool) -> None:
        self.tokens = np.append(self.tokens, np.int32(token))
        self.pos = np.append(self.pos, np.int32(pos))
        self.seq_id = list(self.seq_id) + [tuple(seq_ids) if isinstance(seq_ids, (list, tuple)) else (int(seq_ids),)]
        self.logits = np.append(self.logits, bool(logits))

    def slice(self, i0: int, i1: int) -> "Batch":
        return Batch(self.tokens[i0:i1], self.pos[i0:i1], self.seq_id[i0:i1], self.logits[i0:i1],
                     None if self.embd is None else self.embd[i0:i1], None if self.mpos is None else self.mpos[i0:i1])

    def validate(self, n_vocab: int, n_seq_max: int) -> None:
        n = len(self.tokens)
        if not (len(self.pos) == len(self.seq_id) == len(self.logits) == n):
            raise ValueError("batch fields have different lengths")
        if n == 1:          # a decode step's token: Python ints (NumPy's min and max cost more than the test)
            bad = int(self.tokens[0])
            if not 0 <= bad < n_vocab:
                raise ValueError(f"token id {bad} is outside the vocabulary (0..{n_vocab - 1})")
        elif n and (self.tokens.min() < 0 or self.tokens.max() >= n_vocab):
            bad = int(self.tokens[(self.tokens < 0) | (self.tokens >= n_vocab)][0])
            raise ValueError(f"token id {bad} is outside the vocabulary (0..{n_vocab - 1})")
        for s in self.seq_id:
            for q in s:
                if not 0 <= q < n_seq_max:
                    raise ValueError(f"sequence id {q} is outside 0..{n_seq_max - 1} (n_seq_max)")
