"""The quantize kernels alone against ggml's: CPU time of ggml_quantize_chunk (llama.cpp's libggml-base, through
ctypes) and of llampy's quantize_rows on the same random rows, one thread each, and whether the bytes are equal.

    python benchmarks/quantize_kernels.py IQ3_XXS,IQ2_XS,Q2_K [im]     (NROWS=256 REPS=3 in the environment)

``im``: a random importance matrix for both. CPU time (process_time), so that a loaded machine disturbs the ratio
less than it does wall time; the whole command's time is quantize_bench.py's.
"""
import ctypes
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    import numba
    from llampy.ggml.types import GGMLType as T, TYPE_TRAITS
    from llampy.llama.quant import quantize_rows
    from tests import llamacpp
    numba.set_num_threads(1)
    path = llamacpp.libggml_base()
    if path is None:
        print("libggml-base not found: set LLAMPY_LLAMACPP (bash scripts/llamacpp.sh)")
        return 1
    lib = ctypes.CDLL(str(path))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_quantize_init.argtypes = [ctypes.c_int]
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((int(os.environ.get("NROWS", 256)), 2048)) * 0.02).astype(np.float32)
    w = rng.random(2048).astype(np.float32) + 0.01
    im = w if sys.argv[2:3] == ["im"] else None
    reps = int(os.environ.get("REPS", 3))
    for name in sys.argv[1].split(","):
        t = T[name]
        tt = TYPE_TRAITS[t]
        lib.ggml_quantize_init(int(t))
        ref = np.zeros((x.shape[0], x.shape[1] // tt.blck_size * tt.type_size), np.uint8)
        quantize_rows(x[:8], t, im)                     # compile / load the cached kernels
        tr, to = [], []
        for _ in range(reps):
            t0 = time.process_time()
            lib.ggml_quantize_chunk(int(t), x.ctypes.data, ref.ctypes.data, 0, x.shape[0], x.shape[1],
                                    None if im is None else im.ctypes.data)
            tr.append(time.process_time() - t0)
            t0 = time.process_time()
            ours = quantize_rows(x, t, im)
            to.append(time.process_time() - t0)
        print(f"{name:8s} {'im' if im is not None else '  '} ggml {min(tr) * 1e3:8.1f} ms  llampy "
              f"{min(to) * 1e3:8.1f} ms  ratio {min(to) / min(tr):5.2f}  same={np.array_equal(ref, ours)}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
