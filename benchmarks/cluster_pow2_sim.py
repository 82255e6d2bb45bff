"""The cache hit rate Serve's power-of-two router gets by chance on the routing test's workload
(tests/cluster/test_ray_cluster.py: 8 conversations x 6 turns, 2 replicas x 4 slots), beside the prefix router's.

A model of the two placements that decide it, for two ways of interleaving the conversations:
  burst       each turn, all 8 conversations send together. pow2 picks 2 replicas at random (with 2 replicas: both)
              and sends the request to the one with fewer requests of the burst (ties at random), so over 2 replicas
              a conversation returns to its replica half the time; the requests a replica gets are admitted to its
              slots together.
  sequential  each round, the 8 conversations take their turn one after another, in a random order (one request
              in flight). pow2 sees every replica idle: a random one (with `--alternate`, 2 replicas: the other
              replica than the last request's, as a stale queue-length cache would make it).
On a replica the engine gives each request, in arrival order, the free slot sharing its prefix, else the free slot
holding the shortest cache (slots.py's choice). The prefix router sends a conversation home; its first turn to the
replica with the fewest conversations. Prints over 2000 runs the distribution of pow2's hit rate (cached / prompt
tokens), the prefix router's, and how often the prefix router falls short of k times pow2 in the same run; then the
same for the prompt tokens each router had to decode (pow2's over the prefix router's), over all turns and over
turns 2-6 (turn 1 decodes every prompt whatever the router).

    python benchmarks/cluster_pow2_sim.py [burst|sequential] [--alternate] [--replicas R] [--slots S]
"""
from __future__ import annotations

import random
import statistics
import sys

SYSTEM, SYSTEM_SD, TURN, SHARED = 250, 8, 25, 3     # tokens: system prompt (mean, sd), one turn, the template's opening
CONVS, TURNS = 8, 6


def run(seed: int, mode: str = "burst", router: str = "pow2", alternate: bool = False, replicas: int = 2,
        n_slots: int = 4) -> dict:
    rng = random.Random(seed)
    reps = range(replicas)
    slots = {r: [None] * n_slots for r in reps}     # conversation whose cache each slot holds
    lens = [int(rng.gauss(SYSTEM, SYSTEM_SD)) for _ in range(CONVS)]
    cached_len = {}                                 # (replica, slot) -> tokens cached
    home, n_home = {}, [0] * replicas
    tot = {"cached": 0, "decoded": 0, "decoded_later": 0}
    last = rng.randrange(replicas)

    def place(c, load):
        nonlocal last
        if router == "prefix":
            if c not in home:
                home[c] = min(reps, key=lambda r: n_home[r])
                n_home[home[c]] += 1
            return home[c]
        a, b = (0, 1) if replicas == 2 else rng.sample(reps, 2)
        if load[a] != load[b]:
            return a if load[a] < load[b] else b
        last = 1 - last if alternate and replicas == 2 else rng.choice((a, b))
        return last

    def admit(r, c, t, free):
        own = [s for s in free if slots[r][s] == c]
        if own:
            s, hit = own[0], lens[c]
        else:
            s = min(free, key=lambda s: (cached_len.get((r, s), 0), rng.random()))
            hit = SHARED if t else 0
        free.remove(s)
        n = lens[c] + TURN
        tot["cached"] += min(hit, n)
        tot["decoded"] += n - min(hit, n)
        if t:
            tot["decoded_later"] += n - min(hit, n)
        lens[c] = n
        slots[r][s] = c
        cached_len[(r, s)] = n

    for t in range(TURNS):
        order = list(range(CONVS))
        rng.shuffle(order)
        if mode == "burst":
            load, where = [0] * replicas, {}
            for c in order:
                where[c] = place(c, load)
                load[where[c]] += 1
            for r in reps:
                free = list(range(n_slots))
                for c in (c for c in order if where[c] == r):
                    if not free:        # more requests than slots: the rest wait for the next free slot
                        free = list(range(n_slots))
                    admit(r, c, t, free)
        else:
            for c in order:
                admit(place(c, [0] * replicas), c, t, list(range(n_slots)))
    tot["hit"] = tot["cached"] / (tot["cached"] + tot["decoded"])
    return tot


def arg(name: str, default: int) -> int:
    return int(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default


if __name__ == "__main__":
    mode = "sequential" if "sequential" in sys.argv else "burst"
    alt = "--alternate" in sys.argv
    R, S = arg("--replicas", 2), arg("--slots", 4)
    runs = 2000
    pw = [run(s, mode, "pow2", alt, R, S) for s in range(runs)]
    px = [run(s, mode, "prefix", False, R, S) for s in range(runs)]
    xs = sorted(p["hit"] for p in pw)
    ps = [p["hit"] for p in px]
    print(f"{mode}{' (alternating)' if alt else ''}, {R} replicas x {S} slots: prefix router "
          f"{statistics.mean(ps):.3f} (min {min(ps):.3f}); pow2 mean {statistics.mean(xs):.3f}, "
          f"1st/50th/99th/max {xs[runs // 100]:.3f}/{xs[runs // 2]:.3f}/{xs[runs - runs // 100]:.3f}/{xs[-1]:.3f}")
    for k in (1.6, 2.0, 3.0):
        print(f"  hit rate: P(prefix < {k} x pow2) = {sum(a['hit'] < k * b['hit'] for a, b in zip(px, pw)) / runs:.4f}")
    for key, what in (("decoded", "all turns"), ("decoded_later", "turns 2-6")):
        rs = sorted(b[key] / a[key] for a, b in zip(px, pw))
        print(f"  prompt tokens decoded, {what}: pow2 / prefix mean {statistics.mean(rs):.2f}, 1st percentile "
              f"{rs[runs // 100]:.2f}, min {rs[0]:.2f}; P(< 3) = {sum(r < 3 for r in rs) / runs:.4f}")
