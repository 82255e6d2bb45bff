#!/usr/bin/env python3
"""Where a server step's time goes: the server's engine in-process (no HTTP), N streams of the serve_load prompts at
once, with each step split into the decode's ops (wall time per op and weight shape), the decode's Python around
the graph (batch, cache cells, masks, graph lookup and building), and sampling with the events per slot.

    python benchmarks/serve_profile.py [--slots 32] [--ctx-per-slot 512] [--streams 8 32] [--tokens 32] [-t 2]

Each level runs a short untimed round first (kernels compiled, graphs of its shapes built). Timing every op adds a
Python call per node; the totals per step are what to compare, side by side in one run (e.g. two checkouts through
PYTHONPATH).
"""
from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", type=int, default=32, help="the server's --parallel (default 32, as serve_load)")
    ap.add_argument("--ctx-per-slot", type=int, default=512)
    ap.add_argument("--streams", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--tokens", type=int, default=32, help="generated tokens per request")
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if max(args.streams) > args.slots:
        ap.error("--streams above --slots")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from llampy import tuning
    tuning.install()
    from llampy.ggml.backends.cpu import backend as cpu_backend
    from llampy.ggml.types import GGMLType
    from llampy.llama.sampling import Chain
    from llampy.models import smollm2_path
    from llampy.server.app import Server
    from llampy.server.slots import Request

    ops: dict = collections.defaultdict(float)
    calls: dict = collections.defaultdict(list)     # each call's wall time, for the median against the mean
    timing = [False]
    bind = cpu_backend.CPUBackend._bind

    def timed_bind(self, node):         # every plan bound from here on times its calls while `timing` is set
        call = bind(self, node)
        src = node.src[0] if node.src else None
        key = (node.op.name, GGMLType(src.type).name if src is not None else "",
               tuple(int(x) for x in src.ne[:2]) if src is not None else ())

        def run():
            if not timing[0]:
                return call()
            t0 = time.perf_counter()
            call()
            dt = time.perf_counter() - t0
            ops[key] += dt
            calls[key].append(dt)
        return run
    cpu_backend.CPUBackend._bind = timed_bind

    srv = Server(smollm2_path(), n_parallel=args.slots, n_ctx=args.ctx_per_slot * args.slots, n_threads=args.threads)
    eng = srv.engine
    while eng.graphs_pending():         # the graphs the engine builds while idle
        time.sleep(0.2)
    acc: collections.Counter = collections.Counter()

    def wrap(obj, name, key):
        f = getattr(obj, name)

        def g(*a, **k):
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                acc[key] += time.perf_counter() - t0
                acc[key + " calls"] += 1
        setattr(obj, name, g)
    wrap(eng.ctx, "decode", "decode")
    wrap(eng.ctx.sched, "graph_compute", "graph")
    wrap(eng, "_step", "sample")
    from llampy.server import slots
    wrap(slots, "top_positions", "sample")     # the step's top-k of every row, before _step samples each
    wrap(eng, "_step_all", "step")
    tok = srv.model.vocab.tokenize

    def one_round(n, tokens):
        reqs = [eng.submit(Request(tokens=tok(f"Write a short story about the number {i}.", add_special=True,
                                              parse_special=True), max_tokens=tokens, ignore_eos=True,
                                   cache_prompt=False, sampler=Chain.from_params(temperature=0.8, seed=i)))
                for i in range(n)]
        for r in reqs:
            while not r.events.get().finish_reason:
                pass
        ttft = sorted(r.t_first - r.t_arrival for r in reqs)
        return ttft[len(ttft) // 2]

    for n in args.streams:
        one_round(n, 4)
        acc.clear()
        ops.clear()
        calls.clear()
        builds = eng.ctx.n_graph_builds
        timing[0] = True
        t0, c0 = time.perf_counter(), time.process_time()
        ttft = one_round(n, args.tokens)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        timing[0] = False
        steps = acc["step calls"]
        ms = 1e3 / steps
        print(f"{n} streams x {args.tokens} tokens: {n * args.tokens / wall:.1f} tok/s, TTFT p50 {ttft:.3f} s, "
              f"{steps} steps ({wall * ms:.1f} ms each), process CPU {cpu:.2f} s, "
              f"{eng.ctx.n_graph_builds - builds} graphs built")
        print(f"  per step: decode {acc['decode'] * ms:.1f} ms (ops {sum(ops.values()) * ms:.1f}, Python around the "
              f"graph {(acc['decode'] - acc['graph']) * ms:.1f}), sampling and events {acc['sample'] * ms:.1f}, "
              f"the rest of the step {(acc['step'] - acc['decode'] - acc['sample']) * ms:.1f}, between steps "
              f"{(wall - acc['step']) * ms:.1f}")
        by_op: dict = collections.defaultdict(float)
        for k, v in ops.items():
            by_op[k[0]] += v
        print("  ops per step (ms): " + ", ".join(f"{k} {v * ms:.2f}" for k, v in
                                                   sorted(by_op.items(), key=lambda kv: -kv[1])))
        print("  largest (ms per step): " + "; ".join(f"{k[0]} {k[1]} {k[2]} {v * ms:.2f}" for k, v in
                                                       sorted(ops.items(), key=lambda kv: -kv[1])[:7]))
        # a mean well above the median: a few slow calls (a thread held up), not a slow kernel
        print("  per call, mean / median (us): " + "; ".join(
            f"{k[0]} {k[1]} {k[2]} {v * 1e6 / len(calls[k]):.0f} / {sorted(calls[k])[len(calls[k]) // 2] * 1e6:.0f}"
            for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:7]))
        excess = 0.0        # every call's time above its op's median: what the held-up calls cost
        for ts in calls.values():
            med = sorted(ts)[len(ts) // 2]
            excess += sum(t - med for t in ts if t > med)
        print(f"  the calls' time above their op's median: {excess * ms:.1f} ms a step", flush=True)
    eng.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
