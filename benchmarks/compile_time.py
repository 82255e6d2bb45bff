#!/usr/bin/env python3
"""CPU seconds to compile one block-table decode kernel (backends/cpu/dot_blocks.py), per type.

    NUMBA_CACHE_DIR=$(mktemp -d) python benchmarks/compile_time.py Q2_K IQ2_XXS ...

Run it with an empty Numba cache (a fresh NUMBA_CACHE_DIR), else it times a cache load. Each type's first product
(16 rows of random block bytes, one activation row) compiles its kernel; the activation quantizer is compiled
before the clock starts. CPU time (process_time), not wall time: a shared machine's load does not move it much.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llampy.ggml import blocks as B                          # noqa: E402
from llampy.ggml.backends.cpu import dot_blocks as D        # noqa: E402
from llampy.ggml.backends.cpu.act_quant import act_split    # noqa: E402
from llampy.ggml.types import GGMLType as T                 # noqa: E402


def main(argv=None) -> int:
    names = (argv if argv is not None else sys.argv[1:]) or ["Q2_K", "IQ2_XXS"]
    rng = np.random.default_rng(0)
    for name in names:
        t = T[name]
        f = B.BLOCKS[t]
        w = rng.integers(0, 256, (16, 512 // f.blck_size * f.type_size), dtype=np.uint8)
        x = rng.standard_normal((1, 512)).astype(np.float32)
        act_split(x, f.dot_type)
        out = np.empty((1, 16), np.float32)
        c0 = time.process_time()
        D.mul_mat(w, t, x, out)
        print(f"{name}: first call {time.process_time() - c0:.1f} s CPU", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
