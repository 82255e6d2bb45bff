"""The cache hit rate Serve's power-of-two router gets by chance on the routing test's workload
(tests/cluster/test_ray_cluster.py: 8 conversations x 6 turns, 2 replicas x 4 slots, each turn a burst of all 8).

A model of the two placements that decide it: pow2 over 2 replicas sends a burst's requests alternately to the less
loaded replica (ties at random), so a conversation returns to its replica half the time; on a replica the engine
gives each request, in arrival order, its own cached slot if free, else the free slot holding the shortest cache
(slots.py's choice: longest common prefix, then emptiest). Prints the distribution of the hit rate (cached / prompt
tokens) over 2000 runs and how often the prefix router's measured 0.807 would fall short of k times it.
"""
from __future__ import annotations

import random
import statistics

SYSTEM, TURN, SHARED = 250, 25, 3     # tokens: system prompt, one turn, the template's opening every prompt shares


def run(seed: int) -> float:
    rng = random.Random(seed)
    slots = {r: [None] * 4 for r in range(2)}       # conversation held by each slot
    lens = [SYSTEM] * 8
    cached = decoded = 0
    for t in range(6):
        order = list(range(8))
        rng.shuffle(order)
        load, where = [0, 0], {}
        for c in order:
            r = rng.randrange(2) if load[0] == load[1] else (0 if load[0] < load[1] else 1)
            where[c] = r
            load[r] += 1
        for r in range(2):
            free = list(range(4))
            for c in (c for c in order if where[c] == r):
                own = [s for s in free if slots[r][s] == c]
                if own:
                    s, hit = own[0], lens[c]
                else:
                    s = min(free, key=lambda s: (lens[slots[r][s]] if slots[r][s] is not None else 0, rng.random()))
                    hit = SHARED if t else 0
                free.remove(s)
                slots[r][s] = c
                n = lens[c] + TURN
                cached += min(hit, n)
                decoded += n - min(hit, n)
                lens[c] = n
    return cached / (cached + decoded)


if __name__ == "__main__":
    xs = sorted(run(s) for s in range(2000))
    print(f"pow2 hit rate: mean {statistics.mean(xs):.3f}, 1st/50th/99th percentile "
          f"{xs[20]:.3f}/{xs[1000]:.3f}/{xs[1980]:.3f}")
    for k in (1.6, 2.0, 3.0):
        print(f"P(0.807 < {k} x pow2) = {sum(x > 0.807 / k for x in xs) / len(xs):.4f}")
