"""The cache hit rate Serve's power-of-two router gets by chance on the routing test's workload
(tests/cluster/test_ray_cluster.py: 8 conversations x 6 turns, 2 replicas x 4 slots), beside the prefix router's.

A model of the two placements that decide it, for two ways of interleaving the conversations:
  burst       each turn, all 8 conversations send together. pow2 over 2 replicas sends a burst's requests
              alternately to the less loaded replica (ties at random), so a conversation returns to its replica
              half the time, and the 4 requests a replica gets are admitted to its 4 slots together.
  sequential  each round, the 8 conversations take their turn one after another, in a random order (one request
              in flight). pow2 sees both replicas idle: a random one (with `--alternate`: the other replica than the
              last request's, as a stale queue-length cache would make it; with a random order that is as random).
On a replica the engine gives each request, in arrival order, the free slot sharing its prefix, else the free slot
holding the shortest cache (slots.py's choice). The prefix router sends a conversation home; its first turn to the
replica with the fewest conversations. Prints the distribution of pow2's hit rate (cached / prompt tokens) over
2000 runs, the prefix router's, and how often the prefix router would fall short of k times pow2 in the same run.

    python benchmarks/cluster_pow2_sim.py [burst|sequential] [--alternate]
"""
from __future__ import annotations

import random
import statistics
import sys

SYSTEM, SYSTEM_SD, TURN, SHARED = 250, 8, 25, 3     # tokens: system prompt (mean, sd), one turn, the template's opening


def run(seed: int, mode: str = "burst", router: str = "pow2", alternate: bool = False) -> float:
    rng = random.Random(seed)
    slots = {r: [None] * 4 for r in range(2)}       # conversation whose cache each slot holds
    lens = [int(rng.gauss(SYSTEM, SYSTEM_SD)) for _ in range(8)]
    cached_len = {}                                 # (replica, slot) -> tokens cached
    home, n_home = {}, [0, 0]
    cached = decoded = 0
    last = rng.randrange(2)

    def place(c, load):
        nonlocal last
        if router == "prefix":
            if c not in home:
                home[c] = 0 if n_home[0] <= n_home[1] else 1
                n_home[home[c]] += 1
            return home[c]
        if load[0] != load[1]:
            return 0 if load[0] < load[1] else 1
        last = 1 - last if alternate else rng.randrange(2)
        return last

    def admit(r, c, t, free):
        nonlocal cached, decoded
        own = [s for s in free if slots[r][s] == c]
        if own:
            s, hit = own[0], lens[c]
        else:
            s = min(free, key=lambda s: (cached_len.get((r, s), 0), rng.random()))
            hit = SHARED if t else 0
        free.remove(s)
        n = lens[c] + TURN
        cached += min(hit, n)
        decoded += n - min(hit, n)
        lens[c] = n
        slots[r][s] = c
        cached_len[(r, s)] = n

    for t in range(6):
        order = list(range(8))
        rng.shuffle(order)
        if mode == "burst":
            load, where = [0, 0], {}
            for c in order:
                where[c] = place(c, load)
                load[where[c]] += 1
            for r in range(2):
                free = list(range(4))
                for c in (c for c in order if where[c] == r):
                    admit(r, c, t, free)
        else:
            for c in order:
                admit(place(c, [0, 0]), c, t, list(range(4)))
    return cached / (cached + decoded)


if __name__ == "__main__":
    mode = next((a for a in sys.argv[1:] if not a.startswith("-")), "burst")
    alt = "--alternate" in sys.argv
    xs = sorted(run(s, mode, "pow2", alt) for s in range(2000))
    ps = sorted(run(s, mode, "prefix") for s in range(2000))
    print(f"{mode}{' (alternating)' if alt else ''}: prefix router {statistics.mean(ps):.3f} "
          f"(min {ps[0]:.3f}); pow2 mean {statistics.mean(xs):.3f}, 1st/50th/99th/max "
          f"{xs[20]:.3f}/{xs[1000]:.3f}/{xs[1980]:.3f}/{xs[-1]:.3f}")
    for k in (1.6, 2.0, 3.0):
        print(f"  P(prefix < {k} x pow2) = {sum(p < k * x for p, x in zip(ps, xs)) / len(xs):.4f}")
