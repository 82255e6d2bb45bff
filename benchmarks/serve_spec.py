#!/usr/bin/env python3
"""Speculative decoding in the server's engine: generated tokens/s and the draft acceptance rate on repetitive
tasks (editing a given piece of code, quoting a given text), without drafting and with each drafter, and a check
that every configuration gives the same greedy replies.

    python benchmarks/serve_spec.py [--model smollm2] [--draft FILE] [--tokens 128] [--streams 1 4] [--rounds 2]

Configurations: none; ngram-simple (prompt lookup: llama.cpp's defaults 12/48, and 4/16); draft-simple with
--draft (default: the target model itself, which accepts nearly every draft and so shows the verification's cost
and the acceptance ceiling; a smaller model of the same vocabulary is what makes it pay). Each configuration gets
its own in-process Server (slots = the largest stream count); the requests go straight to its engine; the
configurations take turns in every round and each row is its best round.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

CODE = '''def mean(xs):
    total = 0
    for x in xs:
        total = total + x
    return total / len(xs)


def variance(xs):
    m = mean(xs)
    total = 0
    for x in xs:
        total = total + (x - m) * (x - m)
    return total / len(xs)
'''
TEXT = ("The river starts in the hills above the town. In spring the snow melts and the river grows wide and fast; "
        "in summer it is slow and warm, and children swim in it near the old mill. The mill has not turned for fifty "
        "years, but the town keeps it painted, because visitors like to take pictures of it.")
TASKS = [
    [{"role": "user", "content": "Rename the variable `total` to `acc` in this code and show the whole code:\n\n"
                                 + CODE}],
    [{"role": "user", "content": "Copy this text exactly, word for word:\n\n" + TEXT}],
    [{"role": "user", "content": "Rewrite this code with `xs` renamed to `values`:\n\n" + CODE}],
    [{"role": "user", "content": "Repeat the following paragraph, then say 'done':\n\n" + TEXT}],
]


def one_round(server, toks, n_tokens, n_streams):
    """Two requests per stream, greedy: (tokens/s, tokens, seconds, drafted, accepted, replies by task)."""
    from llampy.llama.sampling import Chain
    from llampy.server.slots import Request
    e = server.engine
    d0, a0 = e.metrics["draft_tokens_total"], e.metrics["draft_tokens_accepted"]
    jobs = [toks[i % len(toks)] for i in range(n_streams * 2)]
    out = [None] * len(jobs)
    lock, nxt = threading.Lock(), [0]

    def client():
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= len(jobs):
                return
            r = e.submit(Request(tokens=list(jobs[i]), max_tokens=n_tokens, cache_prompt=False,
                                 sampler=Chain.from_params(temperature=0)))
            got = []
            while True:
                ev = r.events.get()
                if ev.token is not None:
                    got.append(ev.token)
                if ev.finish_reason:
                    break
            out[i] = got
    t0 = time.perf_counter()
    th = [threading.Thread(target=client) for _ in range(n_streams)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    dt = time.perf_counter() - t0
    n_gen = sum(len(o) for o in out)
    replies = {i % len(toks): o for i, o in enumerate(out)}
    return (n_gen / dt, n_gen, dt, e.metrics["draft_tokens_total"] - d0,
            e.metrics["draft_tokens_accepted"] - a0, replies)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--draft", default=None, help="draft model GGUF (default: the target model itself)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--configs", nargs="+", default=["none", "ngram-12-48", "ngram-4-16", "draft-4"],
                    help="none, ngram-N-M (ngram-simple sizes), draft-K (draft-simple, K tokens at most)")
    args = ap.parse_args()
    from llampy import tuning
    tuning.install()
    from llampy.llama.speculative import SpecParams
    from llampy.models import resolve_model
    path = resolve_model(args.model)
    draft = resolve_model(args.draft) if args.draft else path
    print(f"model {path.name}, draft {draft.name if draft else '-'}, {args.tokens} tokens, best of {args.rounds}",
          flush=True)
    from llampy.server.app import Server
    servers = {}
    for cfg in args.configs:
        if cfg == "none":
            spec, d = None, None
        elif cfg.startswith("ngram-"):
            _, n, m = cfg.split("-")
            spec, d = SpecParams(types=("ngram-simple",), ngram_size_n=int(n), ngram_size_m=int(m)), None
        elif cfg.startswith("draft-"):
            spec, d = SpecParams(types=("draft-simple",), n_max=int(cfg.split("-")[1])), draft
        else:
            print(f"unknown config {cfg!r}", file=sys.stderr)
            return 2
        servers[cfg] = Server(path, n_parallel=max(args.streams), n_ctx=1024 * max(args.streams), spec=spec,
                              model_draft=d)
    toks = [servers[args.configs[0]].chat_tokens(m) for m in TASKS]
    # every engine builds its decode graphs while idle: wait for all of them, so that none builds while another is
    # timed; then a short untimed round each (kernels loaded, the draft context's graphs built)
    while any(server.engine._to_reserve for server in servers.values()):
        time.sleep(0.2)
    for server in servers.values():
        one_round(server, toks[:1], 4, 1)
    best, replies = {}, {}
    # configurations take turns within each round, so that a slow spell of a shared machine hits them alike
    for k in range(args.rounds):
        for ns in args.streams:
            for cfg, server in servers.items():
                row = one_round(server, toks, args.tokens, ns)
                replies.setdefault(cfg, row[5])
                if (cfg, ns) not in best or row[0] > best[(cfg, ns)][0]:
                    best[(cfg, ns)] = row
                print(f"round {k + 1}: {cfg}, {ns} streams: {row[0]:.1f} tok/s", file=sys.stderr, flush=True)
    for server in servers.values():
        server.engine.stop()
    print("| config | streams | tok/s | tokens | s | drafted | accepted | acceptance | speed-up | same replies |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    ref = replies[args.configs[0]]
    for ns in args.streams:
        for cfg in args.configs:
            tps, n_gen, dt, drafted, acc, _ = best[(cfg, ns)]
            rate = f"{acc / drafted:.2f}" if drafted else "-"
            base = best[(args.configs[0], ns)][0]
            print(f"| {cfg} | {ns} | {tps:.1f} | {n_gen} | {dt:.1f} | {drafted} | {acc} | {rate} | "
                  f"{tps / base:.2f}x | {'yes' if replies[cfg] == ref else 'NO'} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
