"""The order in which llama.cpp's ``token_to_id`` (a ``std::unordered_map<std::string, llama_token>``) yields its
tokens, as libstdc++ builds it on Linux.

llama.cpp picks the EOT and FIM tokens it finds by text as the *first* match in that map's iteration; a vocabulary
holding both ``<|endoftext|>`` and ``<|im_end|>`` gets whichever comes first. The order is a fact of libstdc++'s
hashtable: keys hash with ``std::_Hash_bytes`` (64-bit MurmurHash2 variant, seed 0xc70f6907); a node inserted into an
empty bucket goes to the front of the whole list, else to the front of its bucket's run; a rehash (bucket counts
below, one per growth step of the prime policy) walks the old list and does the same into the new buckets. That is
replayed here with NumPy: one sort per rehash, the insertions between rehashes as sort keys.
"""
from __future__ import annotations

import numpy as np

# element count at which libstdc++'s _Prime_rehash_policy grows the table (before inserting), and the new count
_GROWTH = ((0, 13), (13, 29), (29, 59), (59, 127), (127, 257), (257, 541), (541, 1109), (1109, 2357), (2357, 5087),
           (5087, 10273), (10273, 20753), (20753, 42043), (42043, 85229), (85229, 172933), (172933, 351061),
           (351061, 712697), (712697, 1447153), (1447153, 2938679), (2938679, 5967347))
_MUL = np.uint64(0xC6A4A7935BD1E995)
_SEED = 0xC70F6907


def _shift_mix(v: np.ndarray) -> np.ndarray:
    return v ^ (v >> np.uint64(47))


def hash_bytes(keys: list[bytes]) -> np.ndarray:
    """std::hash<std::string> of each key (libstdc++, 64-bit), vectorised over keys."""
    lens = np.fromiter(map(len, keys), np.int64, len(keys))
    return _hash_joined(b"".join(keys), np.cumsum(lens) - lens, lens)


def _hash_joined(joined: bytes, starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    flat = np.frombuffer(joined + bytes(8), np.uint8)
    eight = np.arange(8)

    def load(rows, offs):
        return np.ascontiguousarray(flat[offs[:, None] + eight]).view("<u8")[:, 0]

    with np.errstate(over="ignore"):
        h = np.uint64(_SEED) ^ (lens.astype(np.uint64) * _MUL)
        n_full = lens // 8
        for k in range(int(n_full.max(initial=0))):
            rows = np.flatnonzero(n_full > k)
            data = load(rows, starts[rows] + 8 * k)
            h[rows] = (h[rows] ^ (_shift_mix(data * _MUL) * _MUL)) * _MUL
        rows = np.flatnonzero(lens % 8)                 # the last len % 8 bytes, zero-padded, unmixed
        data = load(rows, starts[rows] + 8 * n_full[rows])
        data &= (np.uint64(1) << (8 * (lens[rows] % 8)).astype(np.uint64)) - np.uint64(1)
        h[rows] = (h[rows] ^ data) * _MUL
        h = _shift_mix(h) * _MUL
        return _shift_mix(h)


def iteration_order(tokens: list[str], distinct: bool | None = None) -> np.ndarray:
    """Indices of the distinct token texts (first occurrence) in the order ``for (auto & t : token_to_id)`` visits
    them after inserting ``tokens`` in order. ``distinct``: whether no text repeats, when the caller knows."""
    if distinct if distinct is not None else len(set(tokens)) == len(tokens):
        idx = np.arange(len(tokens))
    else:                                   # a repeated text inserts no node (operator[] on an existing key)
        first: dict[str, int] = {}
        for i, t in enumerate(tokens):
            first.setdefault(t, i)
        idx = np.fromiter(first.values(), np.int64, len(first))      # insertion order of the nodes
    n = len(idx)
    if n == 0:
        return idx
    joined = "\0".join(tokens).encode("utf-8", "surrogatepass")
    ends = np.flatnonzero(np.frombuffer(joined, np.uint8) == 0)
    if len(ends) == len(tokens) - 1:                 # no NUL inside a token: split the one encoding at the NULs
        starts = np.concatenate([[0], ends + 1])
        lens = np.concatenate([ends, [len(joined)]]) - starts
        h = _hash_joined(joined, starts[idx], lens[idx])
    else:
        h = hash_bytes([tokens[i].encode("utf-8", "surrogatepass") for i in idx.tolist()])
    # phases: [start, end) of nodes inserted between two rehashes, and the bucket count they are inserted under
    phases = []
    for k, (at, count) in enumerate(_GROWTH):
        if at >= n:
            break
        end = _GROWTH[k + 1][0] if k + 1 < len(_GROWTH) else n
        phases.append((at, min(end, n), count))
    order = np.zeros(0, np.int64)          # node numbers (0..n-1) in list order
    big = np.int64(1) << 40
    for start, end, count in phases:
        hb = (h[:end] % np.uint64(count)).astype(np.int64)
        # The rehash walks the old list: a bucket's run goes to the front when first met, each node to the front of
        # its run. The insertions then put a node at the front of its run, or of the list when its bucket is empty.
        # Sorted ascending by (run, node within run):
        #   runs made by an insertion first, latest first; then the old runs by descending first-met position
        #   in a run: inserted nodes latest first; then old nodes by descending old position
        m = len(order)
        bo = hb[order]
        first_met = np.full(count, -1, np.int64)
        if m:
            u, i = np.unique(bo, return_index=True)
            first_met[u] = i
        new = np.arange(start, end)
        bn = hb[new]
        created = np.full(count, np.iinfo(np.int64).max)
        fresh = first_met[bn] < 0
        np.minimum.at(created, bn[fresh], new[fresh])
        run_key = np.where(first_met >= 0, -first_met, -created - big)
        nodes = np.concatenate([order, new])
        within = np.concatenate([-np.arange(m), -new - big])
        order = nodes[np.lexsort((within, run_key[np.concatenate([bo, bn])]))]
    return idx[order]
