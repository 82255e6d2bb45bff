"""The board: a small named actor where each replica writes its counters every half second, and from which the
ingress reads them all at once for /health, /metrics and the count of healthy replicas (no probe per request)."""
from __future__ import annotations

import time

FRESH_S = 3.0       # a replica silent for longer is not counted as healthy

# the prefix routers' counters in this process (the ingress's): router.py counts here, /metrics reads them
# (routed_elsewhere: requests Serve sent to another replica than the router's first choice)
ROUTER_STATS = {"routed": 0, "prefix_hits": 0, "new_prefixes": 0, "load_guard": 0, "routed_elsewhere": 0}


class Board:
    def __init__(self):
        self.rows: dict[str, dict] = {}

    def report(self, replica_id: str, stats: dict) -> None:
        self.rows[replica_id] = {**stats, "seen": time.monotonic()}

    def read(self) -> list[dict]:
        """The replicas heard from within FRESH_S (older rows are dropped)."""
        now = time.monotonic()
        self.rows = {k: v for k, v in self.rows.items() if now - v["seen"] <= FRESH_S}
        return list(self.rows.values())
