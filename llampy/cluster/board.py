"""The board: a small named actor where each replica writes its counters every half second, and from which the
ingress reads them all at once for /health, /metrics and the count of healthy replicas (no probe per request)."""
from __future__ import annotations

import time

FRESH_S = 3.0       # a replica silent for longer is not counted as healthy
# The ingress reads every half second and each replica reports as often: a longer silence means the board itself did
# not run (its process, or the whole cluster, stopped or starved), not that every replica died at once. Such a gap
# ages the rows by PAUSE_S only; otherwise a cluster resumed after a pause read as having no replica (503s) until
# the replicas' next reports.
PAUSE_S = 1.0

# the prefix routers' counters in this process (the ingress's): router.py counts here, /metrics reads them
# (routed_elsewhere: requests Serve sent to another replica than the router's first choice)
ROUTER_STATS = {"routed": 0, "prefix_hits": 0, "new_prefixes": 0, "load_guard": 0, "routed_elsewhere": 0}


class Board:
    def __init__(self):
        self.rows: dict[str, dict] = {}
        self.t_last = time.monotonic()

    def _now(self) -> float:
        """The time, the rows' ``seen`` moved on past any gap between two calls beyond PAUSE_S."""
        now = time.monotonic()
        if now - self.t_last > PAUSE_S:
            for v in self.rows.values():
                v["seen"] += now - self.t_last - PAUSE_S
        self.t_last = now
        return now

    def report(self, replica_id: str, stats: dict) -> None:
        now = self._now()
        self.rows[replica_id] = {**stats, "seen": now}

    def read(self) -> list[dict]:
        """The replicas heard from within FRESH_S (older rows are dropped)."""
        now = self._now()
        self.rows = {k: v for k, v in self.rows.items() if now - v["seen"] <= FRESH_S}
        return list(self.rows.values())
