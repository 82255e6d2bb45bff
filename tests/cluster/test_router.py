"""The prefix router's choices (llampy/cluster/router.py), driven directly with Serve's request records faked:
bursts of new conversations spread by conversation count, later turns follow their prefix, the load guard; and
through Serve's own routing loop (its request queue and replica probes, the replicas faked): each request gets the
replica chosen for it."""
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


class ProbedReplica:
    """What Serve's routing loop asks of a replica: its id, capacity and queue length (r0 answers its probe later
    than r1, so the requests routed to r1 are ready first)."""

    def __init__(self, i):
        from ray.serve._private.common import DeploymentID, ReplicaID
        self.replica_id = ReplicaID(unique_id=f"r{i}", deployment_id=DeploymentID(name="replica", app_name="t"))
        self.max_ongoing_requests, self.delay = 8, 0.02 * (1 - i)

    async def get_queue_len(self, *, deadline_s):
        await asyncio.sleep(self.delay)
        return 0


def test_serve_gives_each_request_the_replica_chosen_for_it():
    """A burst of 8 new conversations through RequestRouter's queue: each lands where the router chose for it (with
    Serve's FIFOMixin the first replica found went to the oldest request waiting: 2 of 8 landed as chosen)."""
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
    from ray.serve.request_router import PendingRequest

    from llampy.cluster.board import ROUTER_STATS

    async def burst():
        r = PrefixRouter(deployment_id=DeploymentID(name="replica", app_name="t"),
                         handle_source=DeploymentHandleSource.UNKNOWN)
        r.initialize_state()
        r.update_replicas([ProbedReplica(0), ProbedReplica(1)])
        rng = random.Random(1)
        prs = [PendingRequest(args=[{"tokens": [rng.randrange(49152) for _ in range(64)]}], kwargs={},
                              metadata=RequestMetadata(request_id=str(i), internal_request_id=f"q{i}"))
               for i in range(8)]
        got = await asyncio.gather(*(r._choose_replica_for_request(p) for p in prs))
        return [r.chosen[p.metadata.internal_request_id] for p in prs], [g.replica_id for g in got], prs

    routed0 = ROUTER_STATS["routed"]
    chosen, got, prs = asyncio.run(burst())
    assert got == chosen and sorted(x.unique_id for x in got) == ["r0"] * 4 + ["r1"] * 4
    assert ROUTER_STATS["routed"] - routed0 == 8                # once per request
    # every rank tried without a free replica: Serve backs off before asking again, not a busy loop
    assert all(p.routing_context.should_backoff for p in prs)
