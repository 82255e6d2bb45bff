"""The recurrent memory (llama.cpp's llama_memory_recurrent): a fixed-size state per sequence instead of a growing
cache, for state-space layers (Mamba, Mamba-2).

Cells: ``n_seq_max`` of them. A cell holds one state: per recurrent layer a rolling row ``r`` (the convolution's
last d_conv - 1 inputs, [n_embd_r] floats) and a state row ``s`` ([n_embd_s] floats), both F32, and the position
of the last token folded into it. A sequence's ``tail`` is its cell; ``seq_cp`` makes the destination share the
source's cell, and the first of them to decode afterwards moves to a free cell (copy on write: the graph reads the
shared cell and writes the new one). A new sequence starts from zeros.

It answers the KV cache's interface, so the context does not know which memory it drives: ``find_slot`` gives
each token the cell its sequence writes, ``apply`` records it, ``n_kv_for`` is the number of state rows the
micro-batch's graph reads (one per sequence), and ``input_values`` the rows each sequence reads from and writes
to. What a state cannot do, it refuses as llama.cpp does: removing a suffix of a sequence (``seq_rm`` answers False
and changes nothing); shifting positions moves only the last one.
"""
from __future__ import annotations

import numpy as np

from ..ggml import ops
from ..ggml.backend import tensor_get, tensor_set
from ..ggml.tensor import Flags, Tensor
from ..ggml.types import GGMLType
from .kv_cache import CacheFull, place_tensors

F32 = GGMLType.F32
POS_MAX = np.iinfo(np.int32).max


def _rows(t: Tensor) -> np.ndarray:
    """A state tensor's values as [cells, row]."""
    return tensor_get(t).reshape(t.ne[1], t.ne[0])


class RecurrentMemory:
    def __init__(self, hparams, n_seq_max: int, layer_backends):
        hp = self.hp = hparams
        self.n_seq_max = int(n_seq_max)
        self.size = max(1, self.n_seq_max)
        self.n_stream = 1
        self.pos = np.full(self.size, -1, np.int32)              # per cell: last position folded in; -1: empty
        self.n_tok = np.zeros(self.size, np.int64)               # per cell: tokens folded in
        self.seq = np.zeros((self.size, self.n_seq_max), bool)   # per cell: the sequences that share it
        self.tail = np.full(self.n_seq_max, -1, np.int64)        # per sequence: its cell
        self.r: list[Tensor | None] = []
        self.s: list[Tensor | None] = []
        by_backend: dict[int, list] = {}
        for il in range(hp.n_layer):
            if not hp.is_recurrent(il):
                self.r.append(None)
                self.s.append(None)
                continue
            r = Tensor(F32, (hp.n_embd_r(), self.size), name=f"cache_r_l{il}")
            s = Tensor(F32, (hp.n_embd_s(), self.size), name=f"cache_s_l{il}")
            r.flags |= Flags.WEIGHT
            s.flags |= Flags.WEIGHT
            self.r.append(r)
            self.s.append(s)
            by_backend.setdefault(id(layer_backends[il]), [layer_backends[il], []])[1].extend([r, s])
        self.buffers = place_tensors(by_backend.values())
        # the micro-batch being decoded: per sequence, the cell its state is read from and the one written
        self._src = np.zeros(0, np.int32)
        self._dst = np.zeros(0, np.int32)

    @property
    def nbytes(self) -> int:
        return sum(b.size for b in self.buffers)

    def state_bytes_per_seq(self) -> int:
        return sum(t.nb[1] for t in self.r + self.s if t is not None)

    # ------------------------------------------------------------------ cells
    def n_used(self) -> int:
        return int((self.pos >= 0).sum())

    def used_max_p1(self) -> int:
        return len(self._src)

    def n_kv_for(self, n_needed_p1: int, pad: int = 1) -> int:
        """The state rows a micro-batch's graph reads: one per sequence in it."""
        return self.n_seqs()

    def check_room(self, seq_ids) -> None:
        for s in seq_ids:
            if len(s) != 1:
                raise ValueError(f"a token of a recurrent model belongs to one sequence, not {list(s)}")

    def split(self, batch, n_ubatch: int) -> list:
        """Micro-batches in which every sequence has the same number of tokens (llama.cpp's split_equal): each
        takes the next tokens of every sequence that has some left, as many as the one with fewest has, at most
        n_ubatch in all; tokens grouped by sequence. Raises ValueError unless each sequence's positions continue
        its state (a state cannot skip or go back)."""
        seqs = np.array([s[0] for s in batch.seq_id], np.int64)
        order = list(dict.fromkeys(seqs.tolist()))
        rest = {s: list(np.flatnonzero(seqs == s)) for s in order}
        for s, idx in rest.items():
            p = np.asarray(batch.pos)[idx]
            last = self.seq_pos_max(s)
            if (last >= 0 and p[0] != last + 1) or (len(p) > 1 and (np.diff(p) != 1).any()):
                raise ValueError(f"the positions of sequence {s} must continue its state one by one: it ends at "
                                 f"{last}, the batch gives {p[:4].tolist()}{'...' if len(p) > 4 else ''}")
        out = []
        while rest:
            live = list(rest)[:n_ubatch]
            n_seq_tokens = max(1, min(min(len(rest[s]) for s in live), n_ubatch // len(live)))
            ub = []
            for s in live:
                ub.extend(rest[s][:n_seq_tokens])
                rest[s] = rest[s][n_seq_tokens:]
                if not rest[s]:
                    del rest[s]
            out.append(np.array(ub, np.int64))
        return out

    def _free_cell(self, prefer: int) -> int:
        free = ~self.seq.any(axis=1)
        if prefer < self.size and free[prefer]:
            return prefer
        cells = np.flatnonzero(free)
        if not len(cells):
            raise CacheFull("no free recurrent state cell (more sequences than n_seq_max)")
        return int(cells[0])

    def find_slot(self, n_tokens: int, seq_ids) -> np.ndarray:
        """The cells of a micro-batch's sequences (tokens grouped by sequence, as ``split`` makes them): a new
        sequence gets a free cell, zeroed; one sharing its cell gets a free cell to write (copy on write)."""
        seqs = [s[0] for s in seq_ids]
        order = list(dict.fromkeys(seqs))
        src, dst = [], []
        taken = self.seq.copy()
        for s in order:
            cell = int(self.tail[s])
            if cell < 0 or taken[cell].sum() > 1:
                free = ~taken.any(axis=1)
                cands = [s] if s < self.size and free[s] else []
                cands += list(np.flatnonzero(free))
                if not cands:
                    raise CacheFull("no free recurrent state cell (more sequences than n_seq_max)")
                new = int(cands[0])
                if cell >= 0:
                    taken[cell, s] = False
                taken[new, s] = True
                src.append(cell if cell >= 0 else new)
                dst.append(new)
            else:
                src.append(cell)
                dst.append(cell)
        self._src = np.array(src, np.int32)
        self._dst = np.array(dst, np.int32)
        self._cell_of = dict(zip(order, dst))
        return self.find_cells(seq_ids)

    def find_cells(self, seq_ids) -> np.ndarray:
        """Per token, the cell find_slot chose for its sequence."""
        return np.array([self._cell_of[s[0]] for s in seq_ids], np.int64)

    def apply(self, idxs: np.ndarray, pos: np.ndarray, seq_ids) -> None:
        for c, src in zip(self._dst, self._src):
            if c == src and self.pos[c] < 0:           # a new sequence: its state starts from zero
                self._zero(int(c))
        for i, (c, s) in enumerate(zip(idxs, seq_ids)):
            s = s[0]
            old = int(self.tail[s])
            if old != c:
                if old >= 0:
                    self.seq[old, s] = False
                    self.n_tok[c] = self.n_tok[old]
                else:
                    self.n_tok[c] = 0
                self.tail[s] = c
                self.seq[c, s] = True
            self.pos[c] = pos[i]
            self.n_tok[c] += 1

    def _zero(self, cell: int) -> None:
        for t in self.r + self.s:
            if t is not None:
                tensor_set(ops.view_1d(t, t.ne[0], cell * t.nb[1]), np.zeros(t.ne[0], np.float32))

    def n_seqs(self) -> int:
        """Sequences of the micro-batch being decoded (its graph reads one state row each)."""
        return max(len(self._src), 1)

    def input_values(self) -> dict:
        return {"rs_src": self._src, "rs_dst": self._dst}

    def mask(self, *a, **k):
        raise TypeError("a recurrent memory has no attention mask")

    # ------------------------------------------------------------------ sequences (llama_memory_seq_*)
    def _drop(self, s: int) -> None:
        c = int(self.tail[s])
        if c >= 0:
            self.seq[c, s] = False
            if not self.seq[c].any():
                self.pos[c] = -1
                self.n_tok[c] = 0
        self.tail[s] = -1

    def seq_rm(self, seq_id: int, p0: int | None = None, p1: int | None = None) -> bool:
        """Remove positions [p0, p1) of seq_id (-1: every sequence). A state holds the whole history or nothing:
        a range that covers the last position but not the first answers False and changes nothing; a range that
        misses the last position changes nothing and answers True."""
        p0 = 0 if p0 is None or p0 < 0 else p0
        p1 = POS_MAX if p1 is None or p1 < 0 else p1
        if seq_id >= self.n_seq_max:
            return False
        if seq_id < 0:
            if p0 != p1 and (p0 != 0 or p1 != POS_MAX):
                return False
            if p0 == p1:
                return True
            for s in range(self.n_seq_max):
                self._drop(s)
            return True
        c = int(self.tail[seq_id])
        if c < 0:
            return True
        pos = int(self.pos[c])
        if 0 < p0 <= pos < p1:
            return False
        if p0 <= pos < p1:
            self._drop(seq_id)
        return True

    def seq_cp(self, src: int, dst: int, p0: int | None = None, p1: int | None = None) -> None:
        """dst shares src's whole state (the range is not looked at, as in llama.cpp)."""
        if src == dst:
            return
        self._drop(dst)
        c = int(self.tail[src])
        if c >= 0:
            self.seq[c, dst] = True
            self.tail[dst] = c

    def seq_keep(self, seq_id: int) -> None:
        for s in range(self.n_seq_max):
            if s != seq_id:
                self._drop(s)

    def seq_pos_max(self, seq_id: int) -> int:
        c = int(self.tail[seq_id]) if 0 <= seq_id < self.n_seq_max else -1
        return int(self.pos[c]) if c >= 0 else -1

    def seq_pos_min(self, seq_id: int) -> int:
        return self.seq_pos_max(seq_id)

    def seq_add_cells(self, seq_id: int, p0, p1, delta: int) -> np.ndarray:
        """Only the last position moves, when it lies in [p0, p1); there are no keys to re-rotate."""
        p0 = 0 if p0 is None or p0 < 0 else p0
        p1 = POS_MAX if p1 is None or p1 < 0 else p1
        c = int(self.tail[seq_id]) if 0 <= seq_id < self.n_seq_max else -1
        if c >= 0 and p0 <= self.pos[c] < p1:
            self.pos[c] += delta
        return np.zeros(1, np.int32)

    def seq_div(self, seq_id: int, p0, p1, d: int) -> None:
        p0 = 0 if p0 is None or p0 < 0 else p0
        p1 = POS_MAX if p1 is None or p1 < 0 else p1
        c = int(self.tail[seq_id]) if 0 <= seq_id < self.n_seq_max else -1
        if d != 1 and c >= 0 and p0 <= self.pos[c] < p1:
            self.pos[c] //= d

    def clear(self, data: bool = False) -> None:
        self.pos[:] = -1
        self.n_tok[:] = 0
        self.seq[:] = False
        self.tail[:] = -1
        if data:
            for buf in self.buffers:
                buf.clear(0)

    # ------------------------------------------------------------------ state
    def _shapes(self) -> dict:
        return {f"{k}{il}": (t.ne[1], t.ne[0]) for il in range(len(self.r))
                for k, t in (("r", self.r[il]), ("s", self.s[il])) if t is not None}

    def state_write(self) -> dict:
        out = {"rs_pos": self.pos, "rs_n_tok": self.n_tok, "rs_seq": self.seq, "rs_tail": self.tail}
        for il in range(len(self.r)):
            if self.r[il] is not None:
                out[f"r{il}"] = _rows(self.r[il])
                out[f"s{il}"] = _rows(self.s[il])
        return out

    def state_read(self, z) -> None:
        """Checked whole before anything changes: a state of another model or size raises ValueError."""
        if z["rs_seq"].shape != self.seq.shape:
            raise ValueError(f"state is for {z['rs_seq'].shape[1]} sequences, this memory has {self.n_seq_max}")
        for name, shape in self._shapes().items():
            if name not in z or z[name].shape != shape or z[name].dtype != np.float32:
                got = z[name].shape if name in z else "nothing"
                raise ValueError(f"state row {name} is {got}, this model's is {shape}")
        self.pos[:] = z["rs_pos"]
        self.n_tok[:] = z["rs_n_tok"]
        self.seq[:] = z["rs_seq"]
        self.tail[:] = z["rs_tail"]
        for il in range(len(self.r)):
            if self.r[il] is not None:
                tensor_set(self.r[il], z[f"r{il}"])
                tensor_set(self.s[il], z[f"s{il}"])

    def seq_state_get(self, seq_id: int) -> dict:
        """One sequence's state: its last position, token count and every layer's rows."""
        c = int(self.tail[seq_id])
        out = {"rs_pos": np.array([self.pos[c] if c >= 0 else -1], np.int32),
               "rs_n_tok": np.array([self.n_tok[c] if c >= 0 else 0], np.int64)}
        for il in range(len(self.r)):
            if self.r[il] is not None:
                for k, t in (("r", self.r[il]), ("s", self.s[il])):
                    # the cell's row alone (a checkpoint keeps it: not a view into a copy of every cell)
                    out[f"{k}{il}"] = (tensor_get(ops.view_1d(t, t.ne[0], c * t.nb[1])).reshape(-1) if c >= 0
                                       else np.zeros(t.ne[0], np.float32))
        return out

    def seq_state_set(self, seq_id: int, state: dict) -> int:
        """Replace seq_id's state with one from seq_state_get; returns its token count."""
        for name, (_, n) in self._shapes().items():
            if name not in state or np.asarray(state[name]).shape != (n,):
                raise ValueError(f"saved row {name} does not fit this model's ({n} floats)")
        self._drop(seq_id)
        pos, n_tok = int(state["rs_pos"][0]), int(state["rs_n_tok"][0])
        if pos < 0:
            return 0
        c = self._free_cell(seq_id)
        for il in range(len(self.r)):
            if self.r[il] is not None:
                for k, t in (("r", self.r[il]), ("s", self.s[il])):
                    tensor_set(ops.view_1d(t, t.ne[0], c * t.nb[1]), np.asarray(state[f"{k}{il}"], np.float32))
        self.seq[c, seq_id] = True
        self.tail[seq_id] = c
        self.pos[c] = pos
        self.n_tok[c] = n_tok
        return n_tok

    # the part of a sequence that a suffix removal cannot bring back (llama.cpp's LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY):
    # here all of it, the state rows
    seq_state_get_partial = seq_state_get
    seq_state_set_partial = seq_state_set

    # ------------------------------------------------------------------ graph views
    # -> [n_embd_r, n_seqs]: the rolling rows the micro-batch's sequences start from
    def get_r(self, il: int, src: Tensor) -> Tensor:
        return ops.get_rows(self.r[il], src)

    # new: [n_embd_r, n_seqs] -> the memory, rows written at dst
    def store_r(self, il: int, new: Tensor, dst: Tensor) -> Tensor:
        return ops.set_rows(self.r[il], new, dst)

    def states_s(self, il: int) -> Tensor:
        return self.s[il]

    def store_s(self, il: int, new: Tensor, dst: Tensor) -> Tensor:
        return ops.set_rows(self.s[il], new, dst)
