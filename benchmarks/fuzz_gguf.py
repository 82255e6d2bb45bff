"""Fuzzed model files through the loader: N hostile variants of the tiny fixture GGUFs (tests/fuzz_gguf.py says how
they are made and what "loaded" means), each opened, tokenized with, rendered and decoded in worker processes. The
target (issue 22): 0 non-llampy exceptions, 0 hangs, 0 crashes.

    python benchmarks/fuzz_gguf.py [-n 2000] [--seed 0] [-j 2] [--timeout 120] [--keep DIR] [--json FILE]

Files are made as workers free up and deleted once loaded; those that end badly are kept in --keep (default
benchmarks/fuzz-failures/) with a line each in its index.txt, so `python -c "from llampy.llama.model import
Model; Model('FILE')"` reproduces one. The same seed makes the same files.
"""
from __future__ import annotations

import argparse
import collections
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fuzz_gguf import iter_files, run_files  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=2000, help="files (default 2000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start", type=int, default=0, help="the first file's number (to resume a run)")
    ap.add_argument("-j", "--workers", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds a file may take before it is a hang")
    ap.add_argument("--keep", type=Path, default=ROOT / "benchmarks" / "fuzz-failures",
                    help="where files that end badly are kept")
    ap.add_argument("--json", type=Path, default=None, help="write every result here")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="llampy-fuzz-"))
    desc: dict = {}
    counts: collections.Counter = collections.Counter()
    kinds: collections.Counter = collections.Counter()
    bad: list[dict] = []
    t0 = time.perf_counter()
    done = 0

    def on_result(r: dict) -> None:
        nonlocal done
        done += 1
        kind = r["result"]
        kinds[kind] += 1
        counts["ok" if kind == "ok" else "llampy" if kind.startswith("llampy:") else kind.split(":")[0]] += 1
        r["what"] = desc.pop(r["path"], "")
        p = Path(r["path"])
        if kind != "ok" and not kind.startswith("llampy:"):
            args.keep.mkdir(parents=True, exist_ok=True)
            shutil.copy(p, args.keep / p.name)
            with open(args.keep / "index.txt", "a") as f:
                f.write(f"{p.name}\t{kind}\t{r['what']}\t{r['detail'].strip().splitlines()[-1:] or ''}\n")
            bad.append(r)
            print(f"\n{kind} on {p.name}: {r['what']}\n{r['detail'][-1200:]}", flush=True)
        p.unlink(missing_ok=True)
        if done % 50 == 0:
            print(f"[{done}/{args.n}] {dict(counts)} {time.perf_counter() - t0:.0f} s", flush=True)

    try:
        results = run_files(iter_files(work, args.n, args.seed, args.start, desc), n_workers=args.workers,
                            timeout=args.timeout, on_result=on_result)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    secs = time.perf_counter() - t0
    print(f"\n{len(results)} files (seed {args.seed}, {args.start}..{args.start + args.n - 1}) in {secs:.0f} s:")
    for k in ("ok", "llampy", "foreign", "hang", "crash"):
        print(f"  {k:8s} {counts[k]}")
    print("refusals by error:", ", ".join(f"{k.split(':')[1]} {v}" for k, v in kinds.most_common()
                                          if k.startswith("llampy:")))
    if args.json:
        args.json.write_text(json.dumps({"seed": args.seed, "start": args.start, "n": args.n, "seconds": secs,
                                         "counts": dict(counts), "kinds": dict(kinds), "results": results},
                                        indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
