"""How long opening a GGUF takes (header, metadata and tensor table parsed; data mapped, not read): best of N.

    python benchmarks/gguf_open.py [MODEL ...] [-n 5]

The bound the reader was built to: 0.3 s for Gemma 3 270M (262k vocabulary strings); ~0.09 s measured on a 2-core
EPYC, ~0.035 s for SmolLM2.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llampy.gguf import GGUFReader  # noqa: E402
from llampy.models import resolve_model  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*", default=["smollm2", "gemma3"])
    ap.add_argument("-n", type=int, default=5)
    args = ap.parse_args(argv)
    for m in args.models:
        path = resolve_model(m)
        best = float("inf")
        for _ in range(args.n):
            t0 = time.perf_counter()
            GGUFReader(path).close()
            best = min(best, time.perf_counter() - t0)
        print(f"{path.name}: {best * 1e3:.1f} ms (best of {args.n})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
