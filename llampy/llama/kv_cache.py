"""The KV cache: per-layer K and V tensors plus the cells that say which position of which sequence each row holds.

Layout: K of layer il is ``[n_embd_head_k, kv_size, n_head_kv]`` (ne order): for each KV head, the cells are
contiguous, so attention reads one contiguous block per head. V likewise. New rows are written by SET_ROWS
nodes in the graph at the cell indices this object picks (``find_slot``); the mask says which cells each token
may see. Several sequences share the cache through per-cell sequence sets (a bool matrix).
"""
from __future__ import annotations

import numpy as np

from ..ggml import ops
from ..ggml.backend import BufferUsage, tensor_alloc
from ..ggml.tensor import Tensor, Flags
from ..ggml.types import GGMLType, row_size

KV_PAD = 256  # n_kv is padded to this so that decode graphs are reused for 256 steps


class CacheFull(ValueError):
    """No room in the KV cache for a batch (a ContextError too: see context.py)."""


class KVCache:
    def __init__(self, hparams, kv_size: int, n_seq_max: int, layer_backends, type_k=GGMLType.F16,
                 type_v=GGMLType.F16):
        hp = hparams
        self.hp = hp
        self.size = int(kv_size)
        self.n_seq_max = int(n_seq_max)
        self.type_k = GGMLType(type_k)
        self.type_v = GGMLType(type_v)
        for t, d in ((self.type_k, hp.n_embd_head_k), (self.type_v, hp.n_embd_head_v)):
            row_size(t, d)  # raises if the head size is not whole blocks of the cache type
        self.pos = np.full(self.size, -1, dtype=np.int32)        # -1: empty
        self.head = 0                                             # where find_slot starts looking
        self.seq = np.zeros((self.size, self.n_seq_max), dtype=bool)
        self.k: list[Tensor] = []
        self.v: list[Tensor] = []
        self.buffers = []
        # one buffer per layer's backend, tensors placed in it
        by_backend: dict[int, list] = {}
        for il in range(hp.n_layer):
            k = Tensor(self.type_k, (hp.n_embd_head_k, self.size, hp.n_head_kv(il)), name=f"cache_k_l{il}")
            v = Tensor(self.type_v, (hp.n_embd_head_v, self.size, hp.n_head_kv(il)), name=f"cache_v_l{il}")
            k.flags |= Flags.WEIGHT
            v.flags |= Flags.WEIGHT
            self.k.append(k)
            self.v.append(v)
            by_backend.setdefault(id(layer_backends[il]), [layer_backends[il], []])[1].extend([k, v])
        # the tensors of each backend in its buffer type's buffers: aligned as it asks, a new buffer where one would
        # pass its largest size (ggml_backend_alloc_ctx_tensors_from_buft). Fresh buffers are zeroed.
        for backend, tensors in by_backend.values():
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
                end = group[-1][1] + group[-1][0].nbytes
                buf = buft.alloc_buffer(end, BufferUsage.COMPUTE)
                for t, o in group:
                    tensor_alloc(buf, t, o)
                self.buffers.append(buf)

    @property
    def nbytes(self) -> int:
        return sum(b.size for b in self.buffers)

    # ------------------------------------------------------------------ cells
    def n_used(self) -> int:
        return int((self.pos >= 0).sum())

    def used_max_p1(self) -> int:
        used = np.flatnonzero(self.pos >= 0)
        return int(used[-1]) + 1 if len(used) else 0

    def n_kv_for(self, n_needed_p1: int, pad: int = KV_PAD) -> int:
        """The number of cells the attention reads: padded so graphs are reused (llama.cpp pads to 256)."""
        n = max(n_needed_p1, 1)
        return min(self.size, (n + pad - 1) // pad * pad)

    def find_slot(self, n_tokens: int) -> np.ndarray:
        """Cell indices for n new tokens, as llama.cpp's llama_kv_cache::find_slot picks them: the empty cells met
        scanning from ``head`` (the cell after the previous batch's last, or the lowest one a removal freed), wrapping
        to cell 0; the scan starts at 0 when head is beyond used + 2 n. Raises CacheFull if there are not enough.
        (Where cells land decides the order flash attention sums them in, so this is part of matching llama.cpp
        when several sequences share the cache.)"""
        free = np.flatnonzero(self.pos < 0)
        if len(free) < n_tokens:
            raise CacheFull(f"the KV cache is full: {n_tokens} new tokens need cells but only {len(free)} of "
                            f"{self.size} are free (raise n_ctx, or remove sequences with seq_rm)")
        head = self.head if self.head <= (self.size - len(free)) + 2 * n_tokens else 0
        order = np.concatenate([free[free >= head], free[free < head]])
        return order[:n_tokens].astype(np.int64)

    def apply(self, idxs: np.ndarray, pos: np.ndarray, seq_ids: list) -> None:
        self.pos[idxs] = pos
        self.seq[idxs] = False
        for i, s in zip(idxs, seq_ids):
            self.seq[i, list(s)] = True
        if len(idxs):
            self.head = int(idxs[-1]) + 1

    def _freed(self, was_used: np.ndarray, lower_only: bool = True) -> None:
        """llama.cpp's head after a removal: the lowest freed cell, if below the current head."""
        freed = np.flatnonzero(was_used & (self.pos < 0))
        if len(freed) and (not lower_only or freed[0] < self.head):
            self.head = int(freed[0])

    def mask(self, n_kv: int, pos: np.ndarray, seq_ids: list, swa: int = 0, causal: bool = True) -> np.ndarray:
        """F16 [n_tokens, n_kv] (row-major, i.e. ggml [n_kv, n_tokens]): 0 where token i may see cell j, -inf elsewhere."""
        cpos = self.pos[:n_kv]
        n = len(pos)
        seq_first = np.array([s[0] for s in seq_ids], dtype=np.int64) if n else np.zeros(0, np.int64)
        visible = self.seq[:n_kv][:, seq_first].T                       # [n, n_kv] the cell holds the token's sequence
        visible &= (cpos >= 0)[None, :]
        if causal:
            visible &= cpos[None, :] <= pos[:, None]
        if swa > 0:
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
        self._freed(used)
        return True

    def seq_cp(self, src: int, dst: int, p0: int | None = None, p1: int | None = None) -> None:
        r = self._range(p0, p1) & self.seq[:, src]
        self.seq[r, dst] = True

    def seq_keep(self, seq_id: int) -> None:
        keep = self.seq[:, seq_id].copy()
        used = self.pos >= 0
        self.seq[:] = False
        self.seq[keep, seq_id] = True
        self.pos[~keep] = -1
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
        shift[gone] = 0
        g = np.flatnonzero(gone)
        self.head = int(g[0]) if len(g) else 0     # llama.cpp: the first removed cell, else start over
        return shift

    def clear(self, data: bool = False) -> None:
        """Forget every cell; with ``data``, also zero K and V (llama.cpp's clear(data))."""
        self.pos[:] = -1
        self.seq[:] = False
        self.head = 0
        if data:
            for buf in self.buffers:
                buf.clear(0)

    # ------------------------------------------------------------------ graph views
    # k: [n_embd_head_k, n_kv, n_head_kv] — contiguous per head
    def view_k(self, il: int, n_kv: int) -> Tensor:
        k = self.k[il]
        return ops.view_3d(k, k.ne[0], n_kv, k.ne[2], k.nb[1], k.nb[2], 0)

    def view_v(self, il: int, n_kv: int) -> Tensor:
        v = self.v[il]
        return ops.view_3d(v, v.ne[0], n_kv, v.ne[2], v.nb[1], v.nb[2], 0)

    # cur: [n_embd_head, n_head_kv, n_tokens]; idxs: I64 [n_tokens] -> the cache, rows written at idxs
    def store_k(self, il: int, cur: Tensor, idxs: Tensor) -> Tensor:
        return ops.set_rows(self.k[il], ops.permute(cur, 0, 2, 1, 3), idxs)

    def store_v(self, il: int, cur: Tensor, idxs: Tensor) -> Tensor:
        return ops.set_rows(self.v[il], ops.permute(cur, 0, 2, 1, 3), idxs)
