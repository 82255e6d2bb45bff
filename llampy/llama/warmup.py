"""Kernel warm-up: compile, ahead of the first prompt, the cpu kernels a model needs, without its weights.

Kernels are Numba functions compiled on first use and kept in Numba's on-disk cache; a first run with an empty
cache spends most of its time compiling them (SmolLM2 ~10-15 s, Gemma 3 ~20 s on 2 cores). ``llampy warmup``
does that work as an explicit step (``make run`` runs it; a Dockerfile can too), so no user request pays for it.

What it runs is a *hollow* copy of the model: the real file's header — architecture, hyper-parameters, vocabulary,
every tensor's name, type and shape — with a data section that is a hole in a temporary file (zeros, nothing
allocated on disk). The kernels are chosen by tensor type and shape, never by value, so the copy's batches take
every code path the real model's would: by default a short prompt and one-token decode steps (a first run or chat
turn); with ``--all`` also a long prompt (the tiled prompt kernels, tiled attention) and batches of the sizes a server
decodes together. Without a model file, ``types`` builds the header of
a small llama-architecture model whose matrices are in those types.

Numba compiles one function at a time per process. With ``jobs=2`` a second process runs the same batches with each
plan's kernel calls in reverse order, so it compiles first what the first process needs last; each then finds the
other's kernels in the shared cache. The reversed calls read garbage (uninitialised intermediates), which is
harmless: the graph's index inputs are set as for a real batch, so every access stays in bounds, and nothing is
read back.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from ..ggml.types import TYPE_TRAITS, GGMLType
from ..gguf.constants import GGUFValueType

# batch sizes warmed: by default a short prompt and one-token decode (what a first `llampy run` or chat turn takes);
# with all=True also a long prompt (the tiled kernels and tiled attention from 64 queries) and the sixteen- and
# eight-row tiles a server's parallel decodes take
BATCHES = ((5,), ())                     # (prompt lengths, each followed by a decode step), (parallel decodes)
BATCHES_ALL = ((64, 5), (16, 8))


@dataclass
class WarmupResult:
    seconds: float
    compiled: int       # kernels this process compiled (the rest came from the cache)
    loaded: int         # kernels this process loaded from the cache


def hollow_copy(model_path, out_path) -> None:
    """Write to out_path the header of the GGUF at model_path with every tensor's data as zeros (a file hole)."""
    from ..gguf import GGUFReader, GGUFWriter
    r = GGUFReader(model_path)
    w = GGUFWriter(out_path, r.alignment, r.version)
    for k, v in r.metadata.items():
        w.add(k, v, r.value_types[k])
    for t in r.tensors.values():
        w.add_tensor_zeros(t.name, t.type, t.ne)
    w.write()


def add_spm_vocab(w, n_vocab: int) -> None:
    """A placeholder SPM vocabulary of n_vocab tokens (unk, bos, eos, the 256 byte tokens, then '▁t<i>'), for
    synthetic models whose text does not matter (warm-up, benchmarks)."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    pieces += [f"\u2581t{i}" for i in range(n_vocab - len(pieces))]
    w.add("tokenizer.ggml.model", "llama")
    w.add("tokenizer.ggml.tokens", pieces)
    w.add("tokenizer.ggml.scores", [0.0] * n_vocab)
    w.add("tokenizer.ggml.token_type", [2, 3, 3] + [6] * 256 + [1] * (n_vocab - 259))
    w.add("tokenizer.ggml.bos_token_id", 1, GGUFValueType.UINT32)     # llama.cpp reads token ids as u32
    w.add("tokenizer.ggml.eos_token_id", 2, GGUFValueType.UINT32)


def types_model(types, out_path) -> None:
    """A small llama model (one layer per type, all of that layer's matrices in it; n_embd 512, n_ff 1536, 8 heads of
    64, 4 KV heads; a 512-token SPM vocabulary) with zero weights, for warming the kernels of ``types``."""
    from ..gguf import GGUFWriter
    types = [GGMLType[t.upper()] if isinstance(t, str) else GGMLType(t) for t in types]
    n_embd, n_ff, n_head, n_head_kv, head_dim, n_vocab = 512, 1536, 8, 4, 64, 512
    for t in types:
        if n_embd % TYPE_TRAITS[t].blck_size or n_ff % TYPE_TRAITS[t].blck_size or t in (GGMLType.Q8_1, GGMLType.Q8_K):
            raise ValueError(f"{t.name} is not a weight type")
    w = GGUFWriter(out_path)
    a = "llama"
    for k, v in (("general.architecture", a), ("general.name", "warmup"), (f"{a}.block_count", len(types)),
                 (f"{a}.context_length", 4096), (f"{a}.embedding_length", n_embd),
                 (f"{a}.feed_forward_length", n_ff), (f"{a}.attention.head_count", n_head),
                 (f"{a}.attention.head_count_kv", n_head_kv), (f"{a}.rope.dimension_count", head_dim),
                 (f"{a}.attention.layer_norm_rms_epsilon", 1e-5)):
        w.add(k, v)
    add_spm_vocab(w, n_vocab)
    F32 = GGMLType.F32
    w.add_tensor_zeros("token_embd.weight", types[0], (n_embd, n_vocab))
    w.add_tensor_zeros("output_norm.weight", F32, (n_embd,))
    w.add_tensor_zeros("output.weight", types[0], (n_embd, n_vocab))
    for il, t in enumerate(types):
        b = f"blk.{il}."
        for name, ne in (("attn_norm", (n_embd,)), ("ffn_norm", (n_embd,))):
            w.add_tensor_zeros(b + name + ".weight", F32, ne)
        for name, ne in (("attn_q", (n_embd, n_head * head_dim)), ("attn_k", (n_embd, n_head_kv * head_dim)),
                         ("attn_v", (n_embd, n_head_kv * head_dim)), ("attn_output", (n_head * head_dim, n_embd)),
                         ("ffn_gate", (n_embd, n_ff)), ("ffn_up", (n_embd, n_ff)), ("ffn_down", (n_ff, n_embd))):
            w.add_tensor_zeros(b + name + ".weight", t, ne)
    w.write()


def _kernel_counts() -> tuple[int, int]:
    """(compiled, loaded from the cache) over the cpu backend's Numba functions so far in this process."""
    from numba.core.dispatcher import Dispatcher
    seen: dict[int, Dispatcher] = {}
    for name, mod in list(sys.modules.items()):
        if name.startswith("llampy.") and mod is not None:
            seen.update((id(d), d) for d in vars(mod).values() if isinstance(d, Dispatcher))
    compiled = sum(sum(d._cache_misses.values()) for d in seen.values())
    loaded = sum(sum(d._cache_hits.values()) for d in seen.values())
    return compiled, loaded


def run_batches(path, reverse: bool = False, batches=BATCHES) -> None:
    """Decode the warm-up batches on the (hollow) model at path, in this process."""
    from .batch import Batch
    from .context import Context
    from .model import Model
    if reverse:
        from ..ggml.backends.cpu.backend import CPUBackend
        CPUBackend.reverse_calls = True
    m = Model(path)
    prompts, parallel = batches
    n_max = max(prompts + parallel)
    # attention's K and V are views of the cache: contiguous when the cells it reads are the whole cache (a small
    # context, a server's decode), strided otherwise; each layout is a kernel signature of its own
    for n_ctx in (512, 256):
        ctx = Context(m, n_ctx=n_ctx, n_batch=n_max, n_ubatch=n_max, n_seq_max=max(parallel + (1,)))
        tok = min(3, m.hparams.n_vocab - 1)
        # each decode step twice: a plan's second run calls its kernels' entry points and runs its Prepare steps
        # (backends/cpu/direct.py), whose checks are kernels of their own
        for n in prompts:                 # a prompt, then decode steps after it
            ctx.decode(Batch.from_tokens([tok] * n))
            for i in range(2):
                ctx.decode(Batch.from_tokens([tok], pos0=n + i))
            ctx.kv_clear()
        for n in parallel:                # one token from each of n sequences, as a server's parallel decode step
            for i in range(2):
                b = Batch.empty()
                for s in range(n):
                    b.add(tok, i, [s], True)
                ctx.decode(b)
            ctx.kv_clear()


def warmup(model_path=None, types=None, jobs: int = 2, all: bool = False) -> WarmupResult:
    """Compile the kernels of the model at model_path (its header only is read), or of a small llama model in
    ``types``; with jobs=2 a second process compiles from the other end (module doc); ``all``: every batch size
    (BATCHES_ALL), for a server or long prompts."""
    batches = BATCHES_ALL if all else BATCHES
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="llampy-warmup-") as tmp:
        path = os.path.join(tmp, "hollow.gguf")
        if types:
            types_model(types, path)
        else:
            hollow_copy(model_path, path)
        helper = None
        if jobs > 1:
            helper = subprocess.Popen([sys.executable, "-m", "llampy.llama.warmup", path, "--reverse"]
                                      + (["--all"] if all else []),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      env=dict(os.environ, NUMBA_NUM_THREADS="1"))
        try:
            run_batches(path, batches=batches)
        finally:
            if helper is not None:
                _, err = helper.communicate()
                if helper.returncode != 0:
                    raise RuntimeError(f"the reversed warm-up process failed: {err.decode(errors='replace')[-2000:]}")
    compiled, loaded = _kernel_counts()
    return WarmupResult(time.perf_counter() - t0, compiled, loaded)


def main(argv) -> int:
    from .. import tuning
    tuning.install()
    run_batches(argv[0], reverse="--reverse" in argv[1:], batches=BATCHES_ALL if "--all" in argv[1:] else BATCHES)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
