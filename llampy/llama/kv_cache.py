"""The KV cache: per-layer K and V tensors plus the cells that say which position of which sequence each row holds.

Layout: K of layer il is ``[n_embd_head_k, kv_size, n_head_kv]`` (ne order): for each KV head, the cells are
contiguous, so attention reads one contiguous block per head. V likewise. New rows are written by SET_ROWS
nodes in the graph at the cell indices this object picks (``find_slot``); the mask says which cells each token
may see. Several sequences share the cache through per-cell sequence sets (a bool matrix).

With ``hparams.v_in_k`` (MLA, deepseek2: llama.cpp's K-only cache for ``is_mla()``) no V is kept: each cell's V is
the first ``n_embd_head_v`` values of its K row (the compressed KV, followed by the roped key part), read through
a view of K.

A layer may keep no K and V of its own and attend over another layer's (``hparams.kv_source``; gemma3n's layers
past the twentieth, llama.cpp's reuse callback): no tensors are allocated for it, its views are the other layer's,
and the graph stores nothing for it.

With ``n_stream`` > 1 (llama.cpp's ``kv_unified = false``, llama-server's default) the cells are cut into one
equal range per sequence, each with its own ``head``: a sequence's cells then stay in position order whatever the
other sequences did, and since flash attention sums the visible cells in cell order (with an F16 accumulator, as
ggml's), a sequence's logits do not depend on where earlier traffic left holes in the cache.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ..ggml import ops
from ..ggml.backend import BufferUsage, tensor_alloc, tensor_get, tensor_set
from ..ggml.tensor import Tensor, Flags
from ..ggml.types import GGMLType, TYPE_TRAITS

KV_PAD = 256  # n_kv is padded to this so that decode graphs are reused for 256 steps
# With one stream per sequence, pieces of several sequences share a micro-batch while together they hold fewer
# tokens than this: ggml's CPU flash attention takes its tiled path from 64 queries (Q_TILE) and below it computes
# each query row on its own (one_chunk), and the matrix products give each row the same bits at every batch size,
# so every row gets the result it gets in a micro-batch of its own sequence (llama.cpp's split_equal groups
# streams too, its query blocks per stream).
MIX_BELOW = 64


@njit(cache=True)
def _causal_mask(cpos, seq, pos, seq_first, lo, hi, n_kv, causal):
    """KVCache.mask without SWA or M-RoPE, as F16 bits: row i is 0 (0x0000) at the cells of [lo[i], hi[i]) that hold
    sequence seq_first[i] at a position up to pos[i] (any position when not causal), -inf (0xFC00) elsewhere. Only
    the token's stream is scanned (a stream's cells hold its own sequence only); a unified cache passes [0, n_kv)."""
    m = np.full((pos.size, n_kv), 0xFC00, np.uint16)
    for i in range(pos.size):
        s, p = seq_first[i], pos[i]
        for j in range(lo[i], hi[i]):
            if seq[j, s] and cpos[j] >= 0 and (not causal or cpos[j] <= p):
                m[i, j] = 0
    return m


@njit(cache=True)
def _free_cells(pos, lo, hi, head, n_tokens):
    """_find_in_stream's cells (the first n_tokens empty cells of [lo, hi) from head on, wrapping to lo; from lo when
    head is beyond the used cells + 2 n_tokens), or an empty array when fewer are free."""
    n_free = 0
    for j in range(lo, hi):
        n_free += pos[j] < 0
    out = np.empty(n_tokens if n_free >= n_tokens else 0, np.int64)
    if n_free < n_tokens:
        return out
    if head - lo > (hi - lo) - n_free + 2 * n_tokens:
        head = lo
    k = 0
    for j in range(head, hi):
        if k < n_tokens and pos[j] < 0:
            out[k] = j
            k += 1
    for j in range(lo, head):
        if k < n_tokens and pos[j] < 0:
            out[k] = j
            k += 1
    return out


class CacheFull(ValueError):
    """No room in the KV cache for a batch (a ContextError too: see context.py)."""


def place_tensors(per_backend) -> list:
    """The tensors of each (backend, tensors) pair in its buffer type's buffers: aligned as it asks, a new buffer
    where one would pass its largest size (ggml_backend_alloc_ctx_tensors_from_buft). Fresh buffers are zeroed.
    Returns the buffers."""
    buffers = []
    for backend, tensors in per_backend:
        buft = backend.get_default_buffer_type()
        align, max_size = buft.get_alignment(), buft.get_max_size()
        groups, total = [[]], 0
        for t in tensors:
            size = (t.nbytes + align - 1) // align * align
            if groups[-1] and total + size > max_size:
                groups.append([])
                total = 0
            groups[-1].append((t, total))
            total += size
        for group in groups:
            if not group:
                continue
            end = group[-1][1] + group[-1][0].nbytes
            buf = buft.alloc_buffer(end, BufferUsage.COMPUTE)
            for t, o in group:
                tensor_alloc(buf, t, o)
            buffers.append(buf)
    return buffers


class KVCache:
    def __init__(self, hparams, kv_size: int, n_seq_max: int, layer_backends, type_k=GGMLType.F16,
                 type_v=GGMLType.F16, n_stream: int = 1):
        hp = hparams
        self.hp = hp
        self.size = int(kv_size)
        self.n_seq_max = int(n_seq_max)
        self.n_stream = int(n_stream)
        if self.n_stream not in (1, self.n_seq_max):
            raise ValueError(f"n_stream must be 1 (unified) or n_seq_max ({self.n_seq_max}), got {n_stream}")
        self.stream_size = self.size // self.n_stream   # cells of one stream; a remainder past the last is unused
        if self.stream_size < 1:
            raise ValueError(f"{self.size} cells cannot hold {self.n_stream} streams")
        self.type_k = GGMLType(type_k)
        self.type_v = GGMLType(type_v)
        self.v_in_k = hp.v_in_k
        if self.v_in_k and self.type_v != self.type_k:
            raise ValueError(f"this model keeps V inside K (MLA): type_v ({self.type_v.name}) must equal type_k "
                             f"({self.type_k.name})")
        for what, t, d in (("K", self.type_k, hp.n_embd_head_k), ("V", self.type_v, hp.n_embd_head_v)):
            bs = TYPE_TRAITS[t].blck_size   # a block-format cache stores whole blocks per head (llama.cpp asserts)
            if d % bs:
                raise ValueError(f"a {t.name} {what} cache needs heads of a multiple of {bs} values; this model's "
                                 f"{what} heads have {d}, not a whole number of blocks: use f16, bf16 or f32")
        self.pos = np.full(self.size, -1, dtype=np.int32)        # -1: empty
        # (used cells, last used cell + 1) of pos as it is, or None when not known: kept through a decode step's
        # one-token apply, forgotten by every other change of pos (_changed), counted again on demand (_counts)
        self._counts_now: tuple | None = (0, 0)
        # per stream: where find_slot starts looking (its first cell to begin with)
        self.heads = np.arange(self.n_stream, dtype=np.int64) * self.stream_size
        self.seq = np.zeros((self.size, self.n_seq_max), dtype=bool)
        self.k: list[Tensor] = []
        self.v: list[Tensor] = []
        self.buffers = []
        # one buffer per layer's backend, tensors placed in it
        by_backend: dict[int, list] = {}
        # the layer whose tensors each layer's views read (llama.cpp's map_layer_ids)
        self.layer_src = [hp.kv_source(il) for il in range(hp.n_layer)]
        for il in range(hp.n_layer):
            # a hybrid's recurrent layer keeps no K and V, nor does a layer reading another's
            if not hp.has_kv(il) or self.layer_src[il] != il:
                self.k.append(None)
                self.v.append(None)
                continue
            k = Tensor(self.type_k, (hp.n_embd_head_k, self.size, hp.n_head_kv(il)), name=f"cache_k_l{il}")
            k.flags |= Flags.WEIGHT
            self.k.append(k)
            if self.v_in_k:
                self.v.append(None)
                by_backend.setdefault(id(layer_backends[il]), [layer_backends[il], []])[1].append(k)
                continue
            v = Tensor(self.type_v, (hp.n_embd_head_v, self.size, hp.n_head_kv(il)), name=f"cache_v_l{il}")
            v.flags |= Flags.WEIGHT
            self.v.append(v)
            by_backend.setdefault(id(layer_backends[il]), [layer_backends[il], []])[1].extend([k, v])
        self.buffers = place_tensors(by_backend.values())

    @property
    def nbytes(self) -> int:
        return sum(b.size for b in self.buffers)

    # ------------------------------------------------------------------ cells
    def _counts(self) -> tuple:
        c = self._counts_now
        if c is None:
            used = np.flatnonzero(self.pos >= 0)
            c = self._counts_now = (len(used), int(used[-1]) + 1 if len(used) else 0)
        return c

    def _changed(self) -> None:
        """pos was changed other than by a one-token apply: the counts are taken again when next asked for."""
        self._counts_now = None

    def n_used(self) -> int:
        return self._counts()[0]

    def used_max_p1(self) -> int:
        return self._counts()[1]

    def n_kv_for(self, n_needed_p1: int, pad: int = KV_PAD) -> int:
        """The number of cells the attention reads: padded so graphs are reused (llama.cpp pads to 256)."""
        n = max(n_needed_p1, 1)
        return min(self.size, (n + pad - 1) // pad * pad)

    @property
    def head(self) -> int:
        """The head of the first (with a unified cache, the only) stream."""
        return int(self.heads[0])

    @head.setter
    def head(self, v: int) -> None:
        self.heads[0] = v

    def stream_of(self, seq_ids) -> int:
        """The stream a token of these sequences goes to: 0 in a unified cache, else its sequence's own."""
        if self.n_stream == 1:
            return 0
        if len(seq_ids) != 1:
            raise ValueError(f"with one KV stream per sequence a token belongs to one sequence, not {list(seq_ids)}")
        return int(seq_ids[0])

    def _stream_range(self, st: int) -> tuple[int, int]:
        lo = st * self.stream_size
        return lo, lo + self.stream_size

    def find_slot(self, n_tokens: int, seq_ids: list | None = None) -> np.ndarray:
        """Cell indices for n new tokens, as llama.cpp's llama_kv_cache::find_slot picks them: the empty cells met
        scanning from ``head`` (the cell after the previous batch's last, or the lowest one a removal freed), wrapping
        to the start; the scan starts there when head is beyond used + 2 n. With streams, each token's cells come
        from its sequence's stream, scanned from that stream's head. Raises CacheFull if there are not enough.
        (Where cells land decides the order flash attention sums them in, so this is part of matching llama.cpp
        when several sequences share the cache.)"""
        if self.n_stream == 1 or seq_ids is None:
            return self._find_in_stream(0, n_tokens)
        streams = np.array([self.stream_of(s) for s in seq_ids], dtype=np.int64)
        out = np.empty(len(streams), dtype=np.int64)
        for st in np.unique(streams):
            sel = streams == st
            out[sel] = self._find_in_stream(int(st), int(sel.sum()))
        return out

    def _find_in_stream(self, st: int, n_tokens: int) -> np.ndarray:
        lo, hi = self._stream_range(st) if self.n_stream > 1 else (0, self.size)
        cells = _free_cells(self.pos, lo, hi, int(self.heads[st]), n_tokens)
        if len(cells) < n_tokens:
            where = f"stream {st} (sequence {st}) of the KV cache" if self.n_stream > 1 else "the KV cache"
            raise CacheFull(f"{where} is full: {n_tokens} new tokens need cells but only "
                            f"{int((self.pos[lo:hi] < 0).sum())} of {hi - lo} are free (raise n_ctx, or remove "
                            f"sequences with seq_rm)")
        return cells

    def check_room(self, seq_ids: list) -> None:
        """Raises CacheFull unless every stream has room for its tokens of a batch (before any is placed)."""
        if self.n_stream == 1:
            free = self.size - self._counts()[0]
            if free < len(seq_ids):
                raise CacheFull(f"the context is full: {len(seq_ids)} tokens need room but only {free} of "
                                f"{self.size} cells are free")
            return
        streams = np.array([self.stream_of(s) for s in seq_ids], dtype=np.int64)
        n_free = (self.pos[:self.n_stream * self.stream_size].reshape(self.n_stream, -1) < 0).sum(axis=1)
        need = np.bincount(streams, minlength=self.n_stream)
        short = np.flatnonzero(need > n_free)
        if len(short):
            st = short[0]
            raise CacheFull(f"the context of sequence {st} is full: {need[st]} tokens need room but only "
                            f"{n_free[st]} of its {self.stream_size} cells are free")

    def split(self, batch, n_ubatch: int) -> list:
        """The micro-batches of a batch, as index arrays. A unified cache cuts the batch into runs of n_ubatch.
        With one stream per sequence, a sequence with several tokens in the batch (a prompt) is decoded in
        micro-batches of its own and the single tokens of the others (generation steps) together: as llama.cpp
        gives each stream its own block of queries, a sequence's attention then takes the kernel path its own
        token count picks (ggml's CPU flash attention switches to float32 tiles from 64 queries), whatever the
        other sequences send in the same batch. Pieces shorter than MIX_BELOW then share micro-batches while
        together below it (a step's short prompts and drafts in one pass over the weights, not one each)."""
        n = len(batch)
        if self.n_stream == 1:
            return [np.arange(i0, min(i0 + n_ubatch, n)) for i0 in range(0, n, n_ubatch)]
        seqs = np.array([s[0] for s in batch.seq_id], dtype=np.int64)
        _, first, inverse, counts = np.unique(seqs, return_index=True, return_inverse=True, return_counts=True)
        single = np.flatnonzero(counts[inverse] == 1)
        groups = [single] if len(single) else []
        for u in np.argsort(first):
            if counts[u] > 1:
                groups.append(np.flatnonzero(inverse == u))
        cap = min(n_ubatch, MIX_BELOW - 1)     # a shared micro-batch's tokens
        out, mix = [], []
        for g in groups:
            for i0 in range(0, len(g), n_ubatch):
                piece = g[i0:i0 + n_ubatch]
                if len(piece) > cap:
                    out.append(piece)
                    continue
                if mix and sum(map(len, mix)) + len(piece) > cap:
                    out.append(np.concatenate(mix))
                    mix = []
                mix.append(piece)
        if mix:
            out.append(np.concatenate(mix))
        return out

    def n_seqs(self) -> int:
        """Sequences of the micro-batch that decides the graph's shape: a KV cache's graphs do not depend on it."""
        return 1

    def input_values(self) -> dict:
        """Graph inputs this memory fills beyond the cells and masks the context sets: none."""
        return {}

    def apply(self, idxs: np.ndarray, pos: np.ndarray, seq_ids: list) -> None:
        if len(idxs) == 1 and len(seq_ids[0]) == 1:     # a decode step's token of one sequence: Python ints
            i = int(idxs[0])
            c = self._counts_now
            if c is not None:
                self._counts_now = (c[0] + int(self.pos[i] < 0), max(c[1], i + 1))
            self.pos[i] = pos[0]
            row = self.seq[i]
            row[:] = False
            row[seq_ids[0][0]] = True
            self.heads[i // self.stream_size if self.n_stream > 1 else 0] = i + 1
            return
        self.pos[idxs] = pos
        self._changed()
        self.seq[idxs] = False
        for i, s in zip(idxs, seq_ids):
            self.seq[i, list(s)] = True
        if len(idxs):
            if self.n_stream == 1:
                self.heads[0] = int(idxs[-1]) + 1
            else:   # each stream's head after its last new cell
                for i in idxs:
                    self.heads[int(i) // self.stream_size] = int(i) + 1

    def _freed(self, was_used: np.ndarray, lower_only: bool = True) -> None:
        """llama.cpp's head after a removal: the lowest freed cell (of each stream), if below its current head."""
        freed = np.flatnonzero(was_used & (self.pos < 0))
        if self.n_stream == 1:
            if len(freed) and (not lower_only or freed[0] < self.heads[0]):
                self.heads[0] = int(freed[0])
            return
        streams = freed // self.stream_size      # cells past the last stream are never used, never freed
        for st in np.unique(streams):
            first = int(freed[streams == st][0])
            if not lower_only or first < self.heads[st]:
                self.heads[st] = first

    def apply_2d(self, idxs: np.ndarray, mpos: np.ndarray) -> None:
        """M-RoPE: the (x, y) of an image's cells (llama_kv_cell_ext), which order the tokens sharing a position."""
        if getattr(self, "ext", None) is None:
            self.ext = np.zeros((self.size, 2), np.int32)
        self.ext[idxs, 0] = mpos[:, 2]
        self.ext[idxs, 1] = mpos[:, 1]

    def mask(self, n_kv: int, pos: np.ndarray, seq_ids: list, swa: int = 0, causal: bool = True,
             chunked: bool = False, mpos: np.ndarray | None = None) -> np.ndarray:
        """F16 [n_tokens, n_kv] (row-major, i.e. ggml [n_kv, n_tokens]): 0 where token i may see cell j, -inf elsewhere.
        swa > 0: only cells less than swa positions back, or with ``chunked`` (llama 4) only cells of the token's
        own chunk of swa positions (llama_hparams::is_masked_swa)."""
        cpos = self.pos[:n_kv]
        n = len(pos)
        seq_first = np.array([s[0] for s in seq_ids], dtype=np.int64) if n else np.zeros(0, np.int64)
        if swa <= 0 and mpos is None:   # the common case in one pass, over the token's stream only
            if self.n_stream > 1:
                lo = seq_first * self.stream_size
                hi = np.minimum(lo + self.stream_size, n_kv)
            else:
                lo, hi = np.zeros(n, np.int64), np.full(n, n_kv, np.int64)
            return _causal_mask(cpos, self.seq, np.asarray(pos, np.int64), seq_first, lo, hi, n_kv,
                                causal).view(np.float16)
        visible = self.seq[:n_kv][:, seq_first].T                       # [n, n_kv] the cell holds the token's sequence
        visible &= (cpos >= 0)[None, :]
        if causal:
            visible &= cpos[None, :] <= pos[:, None]
            if mpos is not None and getattr(self, "ext", None) is not None:
                # M-RoPE: an image's tokens share one position; a cell of it later in (y, x) order is hidden
                cx, cy = self.ext[:n_kv, 0][None, :], self.ext[:n_kv, 1][None, :]
                x, y = mpos[:, 2][:, None], mpos[:, 1][:, None]
                visible &= ~((cpos[None, :] == pos[:, None]) & ((cy > y) | ((cy == y) & (cx > x))))
        if swa > 0 and chunked:
            visible &= cpos[None, :] >= (pos[:, None] // swa) * swa
        elif swa > 0:
            visible &= (pos[:, None] - cpos[None, :]) < swa
        m = np.full((n, n_kv), -np.inf, dtype=np.float16)
        m[visible] = 0
        return m

    # ------------------------------------------------------------------ sequences (llama_memory_seq_*)
    def _range(self, p0, p1):
        p0 = 0 if p0 is None or p0 < 0 else p0
        p1 = np.iinfo(np.int32).max if p1 is None or p1 < 0 else p1
        return (self.pos >= p0) & (self.pos < p1)

    def seq_rm(self, seq_id: int, p0: int | None = None, p1: int | None = None) -> bool:
        """Remove positions [p0, p1) of seq_id (-1: of every sequence)."""
        r = self._range(p0, p1)
        used = self.pos >= 0
        if seq_id < 0:
            self.seq[r] = False
        else:
            self.seq[r, seq_id] = False
        self.pos[~self.seq.any(axis=1)] = -1
        self._changed()
        self._freed(used)
        return True

    def seq_cp(self, src: int, dst: int, p0: int | None = None, p1: int | None = None) -> None:
        if self.n_stream > 1 and src != dst:
            raise ValueError("seq_cp between sequences needs a unified KV cache (their cells are in other streams)")
        r = self._range(p0, p1) & self.seq[:, src]
        self.seq[r, dst] = True

    def seq_keep(self, seq_id: int) -> None:
        keep = self.seq[:, seq_id].copy()
        used = self.pos >= 0
        self.seq[:] = False
        self.seq[keep, seq_id] = True
        self.pos[~keep] = -1
        self._changed()
        self._freed(used)

    def seq_pos_max(self, seq_id: int) -> int:
        p = self.pos[self.seq[:, seq_id]]
        return int(p.max()) if len(p) else -1

    def seq_pos_min(self, seq_id: int) -> int:
        p = self.pos[self.seq[:, seq_id]]
        return int(p.min()) if len(p) else -1

    def seq_add_cells(self, seq_id: int, p0, p1, delta: int) -> np.ndarray:
        """Shift positions [p0, p1) of seq_id by delta; returns the per-cell shift (for re-roping K). Cells moved
        below position 0 are removed, as llama.cpp does."""
        r = self._range(p0, p1) & self.seq[:, seq_id]
        shift = np.zeros(self.size, dtype=np.int32)
        shift[r] = delta
        self.pos[r] += delta
        gone = r & (self.pos < 0)
        self.seq[gone] = False
        self.pos[gone] = -1
        self._changed()
        shift[gone] = 0
        g = np.flatnonzero(gone)
        st = self.stream_of((seq_id,)) if seq_id >= 0 else 0
        # llama.cpp: the first removed cell, else start over (in the sequence's stream)
        self.heads[st] = int(g[0]) if len(g) else self._stream_range(st)[0]
        return shift

    def clear(self, data: bool = False) -> None:
        """Forget every cell; with ``data``, also zero K and V (llama.cpp's clear(data))."""
        self.pos[:] = -1
        self._counts_now = (0, 0)
        self.seq[:] = False
        self.heads[:] = [self._stream_range(st)[0] for st in range(self.n_stream)]
        if data:
            for buf in self.buffers:
                buf.clear(0)

    # ------------------------------------------------------------------ state
    def state_write(self) -> dict:
        """The cells and the used rows of every layer's K and V (llama_state_get_data's memory part)."""
        used = self.used_max_p1()
        out = {"pos": self.pos, "seq": self.seq, "n_ctx": np.array([self.size]), "used": np.array([used])}
        for il in range(len(self.k)):
            if self.k[il] is None:
                continue
            out[f"k{il}"] = tensor_get(self.view_k(il, used))
            if self.v[il] is not None:
                out[f"v{il}"] = tensor_get(self.view_v(il, used))
        return out

    def state_read(self, z) -> None:
        if int(z["n_ctx"][0]) != self.size or z["seq"].shape != self.seq.shape:
            raise ValueError(f"state is for a cache of {int(z['n_ctx'][0])} cells, this one has {self.size}")
        if self.n_stream > 1:           # each stream's cells hold its own sequence only (find_slot, mask)
            cell, sq = np.nonzero(z["seq"])
            if (cell // self.stream_size != sq).any():
                raise ValueError("state is for a cache whose sequences share cells (a unified cache); this one keeps "
                                 "one stream per sequence")
        used = int(z["used"][0])
        self.pos[:] = z["pos"]
        self._changed()
        self.seq[:] = z["seq"]
        self.heads[:] = np.arange(self.n_stream) * self.stream_size
        for il in range(len(self.k)):
            if self.k[il] is None:
                continue
            tensor_set(self.view_k(il, used), z[f"k{il}"])
            if self.v[il] is not None:
                tensor_set(self.view_v(il, used), z[f"v{il}"])

    # ------------------------------------------------------------------ graph views
    # k: [n_embd_head_k, n_kv, n_head_kv] — contiguous per head
    def view_k(self, il: int, n_kv: int) -> Tensor:
        il = self.layer_src[il]
        k = self.k[il]
        return ops.view_3d(k, k.ne[0], n_kv, k.ne[2], k.nb[1], k.nb[2], 0)

    def view_v(self, il: int, n_kv: int) -> Tensor:
        il = self.layer_src[il]
        if self.v[il] is None:      # V inside K: the first n_embd_head_v values of each K row
            k = self.k[il]
            return ops.view_3d(k, self.hp.n_embd_head_v, n_kv, k.ne[2], k.nb[1], k.nb[2], 0)
        v = self.v[il]
        return ops.view_3d(v, v.ne[0], n_kv, v.ne[2], v.nb[1], v.nb[2], 0)

    # cur: [n_embd_head, n_head_kv, n_tokens]; idxs: I64 [n_tokens] -> the cache, rows written at idxs
    def store_k(self, il: int, cur: Tensor, idxs: Tensor) -> Tensor:
        return ops.set_rows(self.k[il], ops.permute(cur, 0, 2, 1, 3), idxs)

    # -> None where V is inside K (store_k wrote it)
    def store_v(self, il: int, cur: Tensor, idxs: Tensor) -> Tensor | None:
        if self.v[il] is None:
            return None
        return ops.set_rows(self.v[il], ops.permute(cur, 0, 2, 1, 3), idxs)
