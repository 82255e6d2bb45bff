"""Host-side costs per token that are not kernels: one step of the default sampler chain (penalties, bias, top-k,
top-p, min-p, temperature, dist) on SmolLM2's and Gemma 3's vocabulary sizes, and loading + tokenizing 12 kB with
Gemma 3's 262k vocabulary.

    python benchmarks/sampler_step.py

Bounds the engine was built to: a chain step under 2 ms (49k) and 10 ms (262k); vocabulary load and the 12 kB
tokenization each under 1 s.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llampy.gguf import GGUFReader            # noqa: E402
from llampy.llama.sampling import Chain       # noqa: E402
from llampy.llama.vocab import Vocab          # noqa: E402
from llampy.models import resolve_model       # noqa: E402


def main() -> int:
    for n_vocab in (49152, 262144):
        logits = np.random.default_rng(0).standard_normal(n_vocab).astype(np.float32) * 3
        ch = Chain.from_params(seed=1, n_vocab=n_vocab, repeat_penalty=1.1, logit_bias={5: -1.0})
        for t in (5, 17, 99):
            ch.accept(t)
        ch.sample(logits)
        t0 = time.perf_counter()
        for _ in range(50):
            ch.sample(logits)
        print(f"chain step, {n_vocab} tokens: {(time.perf_counter() - t0) / 50 * 1e3:.2f} ms")
    with GGUFReader(resolve_model("gemma3")) as r:
        md = dict(r.metadata)
    t0 = time.perf_counter()
    g = Vocab.from_metadata(md)
    print(f"Gemma 3 vocabulary load: {time.perf_counter() - t0:.3f} s")
    text = (ROOT.parent / "shared" / "fixtures" / "tiny" / "seed004_first6000.txt").read_text() * 2
    g.tokenize("warm up")
    t0 = time.perf_counter()
    g.tokenize(text, add_special=True, parse_special=True)
    print(f"tokenize {len(text.encode())} bytes: {time.perf_counter() - t0:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
