"""The context's memory, chosen from the model as llama.cpp's create_memory does: a KV cache when every layer is
attention, the recurrent memory when every layer is recurrent. Both answer the same interface (kv_cache.KVCache
is its reference: find_slot/apply, split, n_kv_for, input_values, the seq_* operations, clear, state_write and
state_read), so the context does not know which one it holds."""
from __future__ import annotations

from .kv_cache import KVCache
from .memory_recurrent import RecurrentMemory


def create_memory(model, n_ctx: int, n_seq_max: int, type_k, type_v, n_stream: int):
    hp = model.hparams
    recurrent = [hp.is_recurrent(il) for il in range(hp.n_layer)]
    if all(recurrent):
        return RecurrentMemory(hp, n_seq_max, model.layer_backend)
    if any(recurrent):
        raise NotImplementedError(f"{hp.arch}: models that mix attention and recurrent layers are not supported yet")
    return KVCache(hp, n_ctx, n_seq_max, model.layer_backend, type_k, type_v, n_stream=n_stream)
