"""The prefix router's choices (llampy/cluster/router.py), driven directly with Serve's request records faked:
bursts of new conversations spread by conversation count, later turns follow their prefix, the load guard."""
from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve.request_router")
from llampy.cluster.router import BLOCK, PrefixRouter, block_keys  # noqa: E402


def router(max_imbalance=4):
    r = PrefixRouter.__new__(PrefixRouter)     # the policy alone: no Serve router state behind it
    r.initialize_state(max_imbalance=max_imbalance)
    return r


REPLICAS = [SimpleNamespace(replica_id=f"replica-{i}") for i in range(2)]
_ids = iter(range(10 ** 9))


def request(tokens):
    return SimpleNamespace(args=[{"tokens": tokens}], metadata=SimpleNamespace(internal_request_id=str(next(_ids))),
                           routing_context=SimpleNamespace(should_backoff=False))


def choose(r, pr):
    return asyncio.run(r.choose_replicas(REPLICAS, pr))[0][0].replica_id


def test_block_keys_name_whole_prefixes():
    a = list(range(100))
    b = a[:40] + [7] * 60
    ka, kb = block_keys(a), block_keys(b)
    assert len(ka) == 100 // BLOCK
    n_same = 40 // BLOCK
    assert ka[:n_same] == kb[:n_same] and all(x != y for x, y in zip(ka[n_same:], kb[n_same:]))


def test_conversations_stick_to_their_replica_and_spread():
    rng = random.Random(0)
    r = router()
    convs = [[rng.randrange(49152) for _ in range(200)] for _ in range(8)]
    first = [choose(r, request(c)) for c in convs]         # a burst: nothing completed in between
    assert sorted(first.count(x.replica_id) for x in REPLICAS) == [4, 4]
    for turn in range(3):
        for i, c in enumerate(convs):
            c += [rng.randrange(49152) for _ in range(30)]
            pr = request(c)
            assert choose(r, pr) == first[i]
            r.on_request_completed(first[i], pr.metadata.internal_request_id)


def test_load_guard_sends_past_a_busy_replica():
    r = router(max_imbalance=2)
    shared = list(range(64))
    picks = [choose(r, request(shared + [i] * 20)) for i in range(6)]   # all prefer the replica holding `shared`
    assert picks[:3] == [picks[0]] * 3 and picks[3] != picks[0]
