"""KV cache cells: slots, sequences, masks, shifting (no model needed)."""
from __future__ import annotations

import numpy as np
import pytest

from llampy.ggml.backend import Backend
from llampy.ggml.types import GGMLType
from llampy.llama.hparams import HParams
from llampy.llama.kv_cache import CacheFull, KVCache


def make(size=16, n_seq=3, type_k=GGMLType.F16):
    hp = HParams(arch="llama", n_layer=2, n_embd=64, n_head_arr=[4, 4], n_head_kv_arr=[2, 2], n_embd_head_k=32,
                 n_embd_head_v=32)
    be = Backend("host")
    return KVCache(hp, size, n_seq, [be, be], type_k, GGMLType.F16)


def test_layout_is_contiguous_per_head():
    kv = make()
    k = kv.k[0]
    assert k.ne[:3] == (32, 16, 2)
    assert k.nb[1] == 64 and k.nb[2] == 64 * 16      # one head's cells are one block
    assert kv.nbytes >= 2 * 2 * 32 * 16 * 2 * 2


def test_slots_and_sequences():
    kv = make(size=8)
    idx = kv.find_slot(3)
    kv.apply(idx, np.array([0, 1, 2], np.int32), [(0,), (0,), (0,)])
    idx2 = kv.find_slot(2)
    assert list(idx2) == [3, 4]
    kv.apply(idx2, np.array([0, 1], np.int32), [(1,), (1,)])
    assert kv.seq_pos_max(0) == 2 and kv.seq_pos_max(1) == 1
    kv.seq_cp(0, 2, 0, 2)
    assert kv.seq[:2, 2].all() and not kv.seq[2, 2]
    kv.seq_rm(0, 1, -1)
    assert kv.seq_pos_max(0) == 0
    assert kv.pos[1] == 1      # still held by sequence 2
    assert kv.pos[2] == -1     # freed: no sequence holds it
    kv.seq_keep(1)
    assert kv.n_used() == 2 and kv.seq_pos_max(0) == -1
    with pytest.raises(CacheFull, match="full"):
        kv.find_slot(7)


def test_mask_causal_sequences_and_window():
    kv = make(size=8)
    kv.apply(np.arange(4), np.array([0, 1, 2, 3], np.int32), [(0,)] * 4)
    kv.apply(np.array([4]), np.array([0], np.int32), [(1,)])
    m = kv.mask(8, np.array([3, 0], np.int32), [(0,), (1,)])
    assert m.dtype == np.float16 and m.shape == (2, 8)
    assert (m[0, :4] == 0).all() and np.isinf(m[0, 4:]).all()
    assert (m[1, 4] == 0) and np.isinf(np.delete(m[1], 4)).all()
    w = kv.mask(8, np.array([3], np.int32), [(0,)], swa=2)
    assert list(np.isfinite(w[0, :4])) == [False, False, True, True]


def test_seq_add_shifts_and_drops_below_zero():
    kv = make(size=8)
    kv.apply(np.arange(5), np.arange(5, dtype=np.int32), [(0,)] * 5)
    shift = kv.seq_add_cells(0, 2, -1, -2)
    assert list(kv.pos[:5]) == [0, 1, 0, 1, 2]
    assert list(shift[:5]) == [0, 0, -2, -2, -2]
    kv.seq_rm(0, 0, 2)   # positions 0 and 1 are now held by cells 0, 1, 2 and 3
    assert kv.n_used() == 1


def test_q8_0_cache_needs_whole_blocks():
    kv = make(type_k=GGMLType.Q8_0)
    assert kv.k[0].type == GGMLType.Q8_0
    hp = HParams(arch="llama", n_layer=1, n_embd=48, n_head_arr=[2], n_head_kv_arr=[2], n_embd_head_k=24,
                 n_embd_head_v=24)
    with pytest.raises(ValueError, match="whole number"):
        KVCache(hp, 8, 1, [Backend("host")], GGMLType.Q8_0)


def test_find_slot_follows_llamacpps_head():
    """llama_kv_cache's head: the next search starts after the last batch's cells; a removal that frees a lower
    cell moves it there; a shift starts it over; a head beyond used + 2 n is ignored."""
    kv = make(size=16, n_seq=2)

    def put(n, seq, p0):
        idx = kv.find_slot(n)
        kv.apply(idx, np.arange(p0, p0 + n, dtype=np.int32), [(seq,)] * n)
        return list(idx)

    assert put(4, 0, 0) == [0, 1, 2, 3] and kv.head == 4
    assert put(4, 1, 0) == [4, 5, 6, 7] and kv.head == 8
    kv.seq_rm(1, 2, -1)                       # frees cells 6, 7: below the head, which moves there
    assert kv.head == 6
    assert put(1, 0, 4) == [6] and kv.head == 7
    kv.seq_rm(0, 0, 1)                        # frees cell 0
    assert kv.head == 0
    assert put(3, 1, 2) == [0, 7, 8] and kv.head == 9
    kv.seq_rm(1, 3, -1)                       # frees cells 7 and 8: 7 is below the head (9)
    assert kv.head == 7
    kv.head = 15                              # a head far past used (7) + 2 n (as after a batch was rolled back)
    assert put(1, 0, 5) == [7]                # the search starts over from cell 0 (from 15 it would take 15)
    kv.seq_add_cells(1, 0, -1, 1)             # a shift: the next search starts from 0
    assert kv.head == 0
    kv.clear()
    assert kv.head == 0 and put(2, 0, 0) == [0, 1]


def test_streams_keep_each_sequence_in_position_order():
    """n_stream = n_seq_max (llama.cpp's kv_unified = false): each sequence's cells come from its own range, from
    that range's head, so restarts and removals in one sequence never put another's new cells out of order."""
    kv = KVCache(make().hp, 16, 2, [Backend("host")] * 2, GGMLType.F16, GGMLType.F16, n_stream=2)
    assert kv.stream_size == 8 and list(kv.heads) == [0, 8]

    def put(seq, p0, n):
        seqs = [(seq,)] * n
        idx = kv.find_slot(n, seqs)
        kv.apply(idx, np.arange(p0, p0 + n, dtype=np.int32), seqs)
        return list(idx)

    assert put(0, 0, 3) == [0, 1, 2] and put(1, 0, 5) == [8, 9, 10, 11, 12]
    kv.seq_rm(0, 1, -1)                        # a restarted request keeps one cached token
    assert list(kv.heads) == [1, 13]
    assert put(1, 5, 1) == [13] and put(0, 1, 4) == [1, 2, 3, 4]
    for s in (0, 1):                           # positions ascend with the cell index within each sequence
        cells = np.flatnonzero(kv.seq[:, s])
        assert list(kv.pos[cells]) == sorted(kv.pos[cells]) and (cells // 8 == s).all()
    # a mixed batch takes each token's cells from its own stream
    seqs = [(1,), (0,), (1,)]
    assert list(kv.find_slot(3, seqs)) == [14, 5, 15]
    with pytest.raises(CacheFull, match="sequence 1"):   # stream 1 holds 8 cells; 8 are free elsewhere
        kv.check_room([(1,)] * 3)
    with pytest.raises(ValueError):
        kv.seq_cp(0, 1)
    kv.clear()
    assert list(kv.heads) == [0, 8]


def test_stream_mask_is_each_tokens_visible_cells():
    """With one stream per sequence (and unified), the mask is 0 exactly where the cell holds the token's sequence at
    a position up to the token's (any position when not causal), -inf elsewhere; a state whose sequences share
    cells (a unified cache's) is refused by a cache of streams."""
    hp = make().hp
    rng = np.random.default_rng(3)
    for n_stream in (1, 3):
        kv = KVCache(hp, 48, 3, [Backend("host")] * 2, GGMLType.F16, GGMLType.F16, n_stream=n_stream)
        nxt = [0, 0, 0]
        for _ in range(5):
            seqs = sorted((int(s),) for s in rng.integers(0, 3, 3))
            pos = np.array([nxt[s] + [q for q in seqs[:i]].count((s,)) for i, (s,) in enumerate(seqs)], np.int32)
            for (s,) in seqs:
                nxt[s] += 1
            kv.apply(kv.find_slot(3, seqs), pos, seqs)
            s = int(rng.integers(3))
            if rng.random() < 0.3 and nxt[s] > 0:         # the sequence's last cell freed
                kv.seq_rm(s, nxt[s] - 1, -1)
                nxt[s] -= 1
            for causal in (True, False):
                m = kv.mask(48, pos, seqs, causal=causal)
                want = np.array([[kv.seq[j, s] and kv.pos[j] >= 0 and (not causal or kv.pos[j] <= p)
                                  for j in range(48)] for (s,), p in zip(seqs, pos)])
                assert m.dtype == np.float16 and (m[want] == 0).all() and np.isneginf(m[~want]).all()
    shared = make(size=48, n_seq=3)
    shared.apply(np.array([40]), np.array([0], np.int32), [(0,)])     # sequence 0 in stream 2's range
    with pytest.raises(ValueError, match="unified"):
        kv.state_read(shared.state_write())
