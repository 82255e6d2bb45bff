"""The prefix-aware request router, on Serve's public RequestRouter API (ray.serve.request_router).

A prompt is cut into blocks of BLOCK tokens; block i's key is a hash of block i and key i-1 (a chain), so one key
names a whole prefix. The router remembers which replica each key was sent to. A request goes to the replica that
holds its longest known run of keys (its prompt's KV is most likely still in one of that replica's slots); a prompt
with no known key goes to the replica holding the fewest conversations. A load guard overrides the preference when
the preferred replica has more than ``max_imbalance`` requests in flight beyond the least busy one. It decides from
what it has seen (requests routed and completed): no probe per request.

Serve hands the replica a router picks to the request it was picked for (matched by request id) only without
FIFOMixin: with it, the replica goes to the oldest request waiting, so in a burst of conversations arriving
together each one's choice served another's request (measured: 4 of a burst of 8 on the other replica, 5
conversations on one replica's 4 slots, its cache thrashing).

The router runs in the process that holds the handle (the ingress). Serve ships this module by value (cloudpickle),
so its counters live in another module, imported when counted: llampy.cluster.board.ROUTER_STATS.
"""
from __future__ import annotations

from collections import OrderedDict

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

BLOCK = 16                  # tokens per block: the granularity at which prefixes are matched
MAX_KEYS = 1 << 18          # keys remembered (least recently used forgotten first)



def block_keys(tokens: list, block: int = BLOCK) -> list[int]:
    """The chained keys of the prompt's whole blocks: keys[i] stands for tokens[:(i + 1) * block]."""
    keys, h = [], 0
    for i in range(len(tokens) // block):
        h = hash((h, tuple(tokens[i * block:(i + 1) * block])))
        keys.append(h)
    return keys


class PrefixRouter(RequestRouter):
    def initialize_state(self, max_imbalance: int = 4, block: int = BLOCK):
        self.max_imbalance = max_imbalance
        self.block = block
        self.owner: OrderedDict[int, object] = OrderedDict()      # key -> replica id
        self.conversations: dict = {}                              # replica id -> first keys it holds
        self.inflight: dict = {}                                   # replica id -> requests routed, not completed
        self.pending_keys: dict = {}                               # internal request id -> keys
        self.chosen: dict = {}                                     # internal request id -> replica id

    # ------------------------------------------------------------ the choice
    def _keys(self, pr: PendingRequest | None) -> list[int]:
        if pr is None or not pr.args or not isinstance(pr.args[0], dict):
            return []
        rid = pr.metadata.internal_request_id
        keys = self.pending_keys.get(rid)
        if keys is None:
            keys = block_keys(pr.args[0].get("tokens") or [], self.block)
            self.pending_keys[rid] = keys
        return keys

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id: r for r in candidate_replicas}
        load = {rid: self.inflight.get(rid, 0) for rid in by_id}
        keys = self._keys(pending_request)
        preferred = None
        for k in reversed(keys):                        # the longest known run first
            rid = self.owner.get(k)
            if rid in by_id:
                preferred = rid
                break
        hit = preferred is not None
        if preferred is None:                           # a new prefix: the replica with the fewest conversations
            preferred = min(by_id, key=lambda r: (len(self.conversations.get(r, ())), load[r]))
        least = min(by_id, key=lambda r: load[r])
        guarded = load[preferred] - load[least] > self.max_imbalance
        choice = least if guarded else preferred
        if pending_request is not None:
            rid = pending_request.metadata.internal_request_id
            if rid not in self.chosen:
                # counted once per request: Serve asks again when every replica it was offered is full or
                # missed its queue-length probe
                from llampy.cluster.board import ROUTER_STATS as STATS
                STATS["routed"] += 1
                STATS["prefix_hits" if hit else "new_prefixes"] += 1
                STATS["load_guard"] += guarded
            # counted now, not when Serve reports the request routed: requests arriving together must see each
            # other's choices, or a burst of new conversations all lands on the same replica
            self._assign(rid, keys, choice)
            # once every rank has been tried, Serve waits (backs off) before asking again instead of spinning
            pending_request.routing_context.should_backoff = True
        rest = sorted((r for r in by_id if r != choice), key=lambda r: load[r])
        return [[by_id[choice]]] + [[by_id[r]] for r in rest]

    def _assign(self, request_id: str, keys: list, rid) -> None:
        old = self.chosen.get(request_id)
        if old == rid:
            return
        if old is not None:
            self.inflight[old] = max(0, self.inflight.get(old, 0) - 1)
        self.chosen[request_id] = rid
        self.inflight[rid] = self.inflight.get(rid, 0) + 1
        for k in keys:
            self.owner[k] = rid
            self.owner.move_to_end(k)
        if keys:
            self.conversations.setdefault(rid, set()).add(keys[0])
        while len(self.owner) > MAX_KEYS:
            self.owner.popitem(last=False)

    # ------------------------------------------------------------ what it learns
    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        rid = pending_request.metadata.internal_request_id
        if self.chosen.get(rid, replica_id) != replica_id:     # the choice was full or did not answer its probe
            from llampy.cluster.board import ROUTER_STATS as STATS
            STATS["routed_elsewhere"] += 1
        self._assign(rid, self.pending_keys.pop(rid, None) or [], replica_id)   # where it went, if not the choice

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        rid = self.chosen.pop(internal_request_id, replica_id)
        self.inflight[rid] = max(0, self.inflight.get(rid, 0) - 1)
        self.pending_keys.pop(internal_request_id, None)

    def update_replicas(self, replicas: list[RunningReplica]):
        alive = {r.replica_id for r in replicas}
        self._forget(lambda rid: rid not in alive)
        return super().update_replicas(replicas)

    def on_replica_actor_died(self, replica_id):
        self._forget(lambda rid: rid == replica_id)
        return super().on_replica_actor_died(replica_id)

    def _forget(self, gone) -> None:
        """A replica that left takes its cached prefixes with it."""
        for k in [k for k, rid in self.owner.items() if gone(rid)]:
            del self.owner[k]
        for rid in [r for r in list(self.conversations) + list(self.inflight) if gone(r)]:
            self.conversations.pop(rid, None)
            self.inflight.pop(rid, None)
