"""deepseek2's multi-head latent attention in the KV cache: K alone is kept (V is its first kv_lora_rank values),
and what reads or rewrites the cache works with it: a sequence's state saved and restored, and the K-shift, which
turns only the roped values at the end of each K row (after the compressed KV; in a legacy file, after each head's
no-position key). The logits against llama.cpp: test_fidelity_tiny_more."""
from __future__ import annotations

import numpy as np
import pytest

from llampy.ggml.backend import tensor_get
from llampy.llama.batch import Batch
from llampy.llama.context import Context
from llampy.llama.model import Model
from llampy.llama.state import seq_get, seq_set

from tests.llama.test_fidelity_tiny_more import tiny_more_model


@pytest.fixture(scope="module")
def mla():
    path, ref = tiny_more_model("deepseek2")
    return Model(path), ref["prompts"][1]["prompt_ids"]


def test_cache_keeps_k_alone(mla):
    model, _ = mla
    hp = model.hparams
    ctx = Context(model, n_ctx=256)
    assert all(v is None for v in ctx.kv.v)
    # one F16 row of kv_lora_rank + n_rot values per cell and layer: no V, no per-head K
    assert ctx.kv.nbytes == hp.n_layer * 256 * (hp.n_lora_kv + hp.n_rot) * 2
    with pytest.raises(ValueError, match="type_v"):
        from llampy.ggml.types import GGMLType
        Context(model, n_ctx=256, type_k=GGMLType.F16, type_v=GGMLType.Q8_0)


def test_sequence_state_round_trip(mla):
    model, toks = mla
    ctx = Context(model, n_ctx=256)
    ctx.decode(Batch.from_tokens(toks[:-1]))
    saved = seq_get(ctx, 0)
    assert not any(k.startswith("v") for k in saved)
    ctx.decode(Batch.from_tokens(toks[-1:], pos0=len(toks) - 1))
    want = ctx.get_logits_ith(-1).copy()
    ctx.kv_clear(data=True)
    assert seq_set(ctx, 0, saved) == len(toks) - 1
    ctx.decode(Batch.from_tokens(toks[-1:], pos0=len(toks) - 1))
    assert np.array_equal(ctx.get_logits_ith(-1), want)


@pytest.mark.parametrize("name", ["deepseek2", "deepseek2-legacy"])
def test_k_shift_turns_the_roped_part(mla, name):
    """Tokens decoded from position m, then shifted down by m: layer 0's cached K rows are those of decoding them
    from position 0, the values before the roped part (the compressed KV; in a legacy file each head's no-position
    key) untouched and the roped values turned back (up to the F16 rounding of the turn); without the shift the
    roped values differ."""
    model, toks = mla
    if name != "deepseek2":
        model = Model(tiny_more_model(name)[0])
    hp = model.hparams
    m, n = 40, len(toks)
    r = hp.k_rope_offset

    def k_rows(pos0, shift):
        ctx = Context(model, n_ctx=256)
        ctx.decode(Batch.from_tokens(toks, pos0=pos0))
        if shift:
            ctx.seq_add(0, pos0, pos0 + n, shift)
        k = tensor_get(ctx.kv.k[0]).astype(np.float32)     # F16 (.., n_head_kv, n_ctx, head size)
        return k[..., :n, :]

    want = k_rows(0, 0)
    got = k_rows(m, -m)
    assert np.array_equal(got[..., :r], want[..., :r])
    err = np.abs(got[..., r:] - want[..., r:]).max()
    assert err <= 4e-3 * np.abs(want[..., r:]).max(), err
    assert np.abs(k_rows(m, 0)[..., r:] - want[..., r:]).max() > 50 * err


def test_multi_token_prediction_layers_are_left_out(mla, tmp_path):
    """A file whose block_count also counts nextn_predict_layers MTP blocks (blk.N.*, nextn.* tensors) runs its
    trunk alone, as llama.cpp does: the same logits as the file without them."""
    from llampy.gguf import GGUFReader
    from llampy.gguf.writer import GGUFWriter
    model, toks = mla
    path, _ = tiny_more_model("deepseek2")
    r = GGUFReader(path)
    n = model.hparams.n_layer
    w = GGUFWriter(tmp_path / "mtp.gguf")
    for k, v in r.metadata.items():
        w.add(k, n + 1 if k == "deepseek2.block_count" else v, r.value_types[k])
    w.add("deepseek2.nextn_predict_layers", 1, r.value_types["deepseek2.block_count"])
    for t in r.tensors.values():
        w.add_tensor_raw(t.name, t.type, t.ne, t.data)
        if t.name.startswith(f"blk.{n - 1}."):        # an MTP block: the last layer's tensors again, and its own
            w.add_tensor_raw(t.name.replace(f"blk.{n - 1}.", f"blk.{n}."), t.type, t.ne, t.data)
    emb = r.tensors["token_embd.weight"]
    w.add_tensor_raw(f"blk.{n}.nextn.eh_proj.weight", emb.type, (2 * emb.ne[0], emb.ne[0]),
                     np.zeros((emb.ne[0], 2 * emb.ne[0] // 32 * 34), np.uint8))
    w.write()
    mtp = Model(tmp_path / "mtp.gguf")
    assert mtp.hparams.n_layer == n
    logits = []
    for m in (model, mtp):
        ctx = Context(m, n_ctx=64)
        ctx.decode(Batch.from_tokens(toks[:8]))
        logits.append(ctx.get_logits_ith(-1))
    assert np.array_equal(logits[0], logits[1])
