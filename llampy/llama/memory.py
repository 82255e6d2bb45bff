"""The context's memory, chosen from the model as llama.cpp's create_memory does: a KV cache when every layer is
attention, the recurrent memory when every layer is recurrent and none attends, both (HybridMemory) when the file
mixes them (per layer, or in one layer as Falcon-H1's). All
answer the same interface (kv_cache.KVCache is its reference: find_slot/apply, split, n_kv_for, n_seqs,
input_values, the seq_* operations, clear, state_write and state_read), so the context does not know which one it
holds; a memory that cannot cut a suffix adds seq_state_get/set_partial (the context checkpoints)."""
from __future__ import annotations

import numpy as np

from .kv_cache import KVCache
from .memory_recurrent import RecurrentMemory


def state_bytes_per_seq(hp) -> int:
    """Bytes of recurrent state one sequence holds (every recurrent layer's rolling row and state row, F32), as
    RecurrentMemory allocates them and llama.cpp's llama_memory_recurrent does; 0 for a model without such layers."""
    return sum(4 * (hp.n_embd_r() + hp.n_embd_s()) for il in range(hp.n_layer) if hp.is_recurrent(il))


def create_memory(model, n_ctx: int, n_seq_max: int, type_k, type_v, n_stream: int):
    hp = model.hparams
    recurrent = [hp.is_recurrent(il) for il in range(hp.n_layer)]
    if not any(hp.has_kv(il) for il in range(hp.n_layer)):
        return RecurrentMemory(hp, n_seq_max, model.layer_backend)
    kv = KVCache(hp, n_ctx, n_seq_max, model.layer_backend, type_k, type_v, n_stream=n_stream)
    if any(recurrent):
        return HybridMemory(kv, RecurrentMemory(hp, n_seq_max, model.layer_backend))
    return kv


class HybridMemory:
    """A KV cache for the attention layers and a recurrent memory for the others (llama.cpp's llama_memory_hybrid).
    Micro-batches are the recurrent memory's (equal tokens per sequence); cells, masks and K/V views are the KV
    cache's; a sequence operation goes to both, the recurrent side first where it may refuse."""

    def __init__(self, attn: KVCache, recr: RecurrentMemory):
        self.attn = attn
        self.recr = recr

    def __getattr__(self, name):
        # K/V tensors and views, masks, cells: the attention layers' cache
        return getattr(self.attn, name)

    @property
    def nbytes(self) -> int:
        return self.attn.nbytes + self.recr.nbytes

    def check_room(self, seq_ids) -> None:
        self.recr.check_room(seq_ids)
        self.attn.check_room(seq_ids)

    def split(self, batch, n_ubatch: int) -> list:
        return self.recr.split(batch, n_ubatch)

    def find_slot(self, n_tokens: int, seq_ids) -> np.ndarray:
        idxs = self.attn.find_slot(n_tokens, seq_ids)
        self.recr.find_slot(n_tokens, seq_ids)
        return idxs

    def apply(self, idxs, pos, seq_ids) -> None:
        self.attn.apply(idxs, pos, seq_ids)
        self.recr.apply(self.recr.find_cells(seq_ids), pos, seq_ids)

    def n_seqs(self) -> int:
        return self.recr.n_seqs()

    def input_values(self) -> dict:
        return self.recr.input_values()

    def seq_rm(self, seq_id: int, p0=None, p1=None) -> bool:
        if not self.recr.seq_rm(seq_id, p0, p1):
            return False
        return self.attn.seq_rm(seq_id, p0, p1)

    def seq_cp(self, src: int, dst: int, p0=None, p1=None) -> None:
        self.attn.seq_cp(src, dst, p0, p1)
        self.recr.seq_cp(src, dst, p0, p1)

    def seq_keep(self, seq_id: int) -> None:
        self.attn.seq_keep(seq_id)
        self.recr.seq_keep(seq_id)

    def seq_add_cells(self, seq_id: int, p0, p1, delta: int) -> np.ndarray:
        self.recr.seq_add_cells(seq_id, p0, p1, delta)
        return self.attn.seq_add_cells(seq_id, p0, p1, delta)

    def seq_pos_max(self, seq_id: int) -> int:
        return min(self.attn.seq_pos_max(seq_id), self.recr.seq_pos_max(seq_id))

    def seq_pos_min(self, seq_id: int) -> int:
        return max(self.attn.seq_pos_min(seq_id), self.recr.seq_pos_min(seq_id))

    def clear(self, data: bool = False) -> None:
        self.attn.clear(data)
        self.recr.clear(data)

    def state_write(self) -> dict:
        return {**self.attn.state_write(), **self.recr.state_write()}

    def state_read(self, z) -> None:
        self.recr.state_read(z)
        self.attn.state_read(z)

    # a context checkpoint (llama.cpp's LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY): the recurrent rows only; restoring one
    # takes the state back to where it was taken, and seq_rm then cuts the KV cells after it
    def seq_state_get_partial(self, seq_id: int) -> dict:
        return self.recr.seq_state_get(seq_id)

    def seq_state_set_partial(self, seq_id: int, state: dict) -> int:
        return self.recr.seq_state_set(seq_id, state)

    # recurrent rows for the graph helpers
    def get_r(self, il, src):
        return self.recr.get_r(il, src)

    def store_r(self, il, new, dst):
        return self.recr.store_r(il, new, dst)

    def states_s(self, il):
        return self.recr.states_s(il)

    def store_s(self, il, new, dst):
        return self.recr.store_s(il, new, dst)
