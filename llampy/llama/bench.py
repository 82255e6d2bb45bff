"""llama-bench's two tests: pp (one batch of n_prompt tokens into an empty cache) and tg (n_gen single-token
decodes), each timed over reps after a warm-up run, reported as tokens/s mean ± sd."""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from .batch import Batch
from ..ggml.types import GGMLType
from .context import Context


@dataclass
class BenchResult:
    model_filename: str
    model_type: str
    model_size: int
    model_n_params: int
    n_threads: int
    n_batch: int
    n_ubatch: int
    n_prompt: int
    n_gen: int
    samples_ns: list = field(default_factory=list)
    samples_ts: list = field(default_factory=list)
    avg_ns: float = 0.0
    stddev_ns: float = 0.0
    avg_ts: float = 0.0
    stddev_ts: float = 0.0
    backend: str = "cpu"
    n_gpu_layers: int = 0
    type_k: str = "f16"
    type_v: str = "f16"
    test: str = ""

    def to_json(self) -> dict:
        return asdict(self)


def _run_pp(ctx: Context, tokens: np.ndarray) -> None:
    ctx.kv_clear()
    for i0 in range(0, len(tokens), ctx.n_batch):
        ctx.decode(Batch.from_tokens(tokens[i0:i0 + ctx.n_batch], pos0=i0))


def _run_tg(ctx: Context, tokens: np.ndarray) -> None:
    ctx.kv_clear()
    for i, t in enumerate(tokens):
        ctx.decode(Batch.from_tokens([int(t)], pos0=i))


def bench(model, n_prompt: int = 512, n_gen: int = 128, reps: int = 5, n_batch: int = 2048, n_ubatch: int = 512,
          n_threads: int = 2, seed: int = 1234, loras=None, type_k=GGMLType.F16,
          type_v=GGMLType.F16) -> list[BenchResult]:
    """llama-bench's pp and tg tests; ``loras``: (LoraAdapter, scale) pairs applied throughout (--lora);
    ``type_k``/``type_v``: the KV cache's types (-ctk/-ctv)."""
    rng = np.random.default_rng(seed)
    n_vocab = model.hparams.n_vocab
    n_ctx = max(n_prompt, n_gen, 1) + 1
    ctx = Context(model, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, type_k=type_k, type_v=type_v)
    ctx.set_loras(loras or [])
    results = []
    tests = []
    if n_prompt > 0:
        tests.append(("pp", n_prompt, 0, _run_pp))
    if n_gen > 0:
        tests.append(("tg", 0, n_gen, _run_tg))
    for name, np_, ng, fn in tests:
        n = np_ or ng
        tokens = rng.integers(0, n_vocab, n).astype(np.int32)
        fn(ctx, tokens)  # warm-up: compiles kernels and builds the graphs
        samples = []
        for _ in range(reps):
            tokens = rng.integers(0, n_vocab, n).astype(np.int32)
            t0 = time.perf_counter_ns()
            fn(ctx, tokens)
            samples.append(time.perf_counter_ns() - t0)
        ts = [n * 1e9 / s for s in samples]
        r = BenchResult(model_filename=str(model.path), model_type=model.desc(), model_size=model.size_bytes,
                        model_n_params=model.n_params, n_threads=n_threads, n_batch=ctx.n_batch,
                        n_ubatch=ctx.n_ubatch, n_prompt=np_, n_gen=ng, samples_ns=samples, samples_ts=ts,
                        avg_ns=statistics.mean(samples), stddev_ns=statistics.stdev(samples) if len(samples) > 1 else 0.0,
                        avg_ts=statistics.mean(ts), stddev_ts=statistics.stdev(ts) if len(ts) > 1 else 0.0,
                        test=f"{name}{n}", n_gpu_layers=model.n_gpu_layers,
                        backend="cuda" if model.n_gpu_layers else "cpu", type_k=GGMLType(type_k).name.lower(),
                        type_v=GGMLType(type_v).name.lower())
        results.append(r)
    return results
