"""The remote backend (llampy/ggml/backends/remote.py) over direct transports: stage executors in this process, each
reading weights from its own open copy of the file. A model split over 1 or 2 stages gives one process's greedy
tokens and logits bit for bit; one round trip per decode with one stage; each graph shape described once; no
weight bytes sent; the split's output goes stage to stage. Over Ray, on two nodes: tests/cluster/test_ray_cluster.py.
"""
from __future__ import annotations

import numpy as np
import pytest

from llampy.ggml.backends.cpu.backend import CPUBackend
from llampy.ggml.backends.remote import RemoteBackend, StageExecutor
from llampy.gguf.split import open_gguf
from llampy.llama.batch import Batch
from llampy.llama.context import Context
from llampy.llama.model import Model

from tests.paths import TINY

MODEL = TINY / "gemma3-Q8_0.gguf"       # 6 layers, sliding-window and global ones


class Stage:
    """A stage in this process, its operations counted by kind."""

    def __init__(self):
        self.reader = open_gguf(MODEL)
        self.exec = StageExecutor(CPUBackend(n_threads=1),
                                  lambda name: self.reader.tensors[name].data.reshape(-1).view(np.uint8))
        self.kinds: dict = {}

    def __call__(self, ops):
        for op in ops:
            self.kinds[op[0]] = self.kinds.get(op[0], 0) + 1
        return self.exec.apply(ops)


def greedy(model, seqs, n=6):
    ctx = Context(model, n_ctx=128, n_batch=32, n_ubatch=32, n_seq_max=len(seqs))
    toks, logits = [[] for _ in seqs], [[] for _ in seqs]
    for s, p in enumerate(seqs):
        ctx.decode(Batch.from_tokens(p, 0, s))
        logits[s].append(np.array(ctx.get_logits_ith(-1)))
        toks[s].append(int(logits[s][-1].argmax()))
    for step in range(n - 1):
        b = Batch.empty()
        for s, (t, p) in enumerate(zip(toks, seqs)):
            b.add(t[-1], len(p) + step, s, True)
        ctx.decode(b)
        for s in range(len(seqs)):
            logits[s].append(np.array(ctx.get_logits_ith(s)))
            toks[s].append(int(logits[s][-1].argmax()))
    return toks, logits


@pytest.fixture(scope="module")
def reference():
    one = Model(MODEL, n_threads=1)
    seqs = [one.vocab.tokenize(t, add_special=True, parse_special=False)
            for t in ("The capital of France is", "Once upon a time, in a small village")]
    return seqs, {k: greedy(one, seqs[:k]) for k in (1, 2)}


@pytest.mark.parametrize("n_stages", [1, 2])
def test_split_model_equals_one_process(reference, n_stages):
    seqs, want = reference
    stages = [Stage() for _ in range(n_stages)]
    devices = [RemoteBackend(st, device=f"remote:{i}") for i, st in enumerate(stages, 1)]
    n_layer = 6
    split = Model(MODEL, devices=devices, n_gpu_layers=n_layer + 1 - n_layer // (n_stages + 1), n_threads=1)
    assert split.layer_backend[0] is split.cpu and split.layer_backend[n_layer] is devices[-1]
    for k in (1, 2):
        calls = [d.n_calls for d in devices]
        toks, logits = greedy(split, seqs[:k])
        assert toks == want[k][0]
        for a, b in zip(logits, want[k][1]):
            np.testing.assert_array_equal(np.array(a), np.array(b))
        if n_stages == 1:
            assert devices[0].n_calls - calls[0] == k + 5        # one round trip per decode
    for st, d in zip(stages, devices):
        assert d.bytes_sent < 1 << 20                           # inputs and hidden states; the weights stay put
        assert st.kinds["alloc_weight"] > 0 and st.kinds["plan"] <= 8   # a few shapes, each described once
    if n_stages == 2:
        assert stages[0].kinds["push"] > 0                      # the first stage hands its output to the second


def test_a_stage_with_another_file_is_refused():
    st = Stage()
    st.exec.weights = lambda name: np.zeros(3, np.uint8)       # a file whose tensors are not the model's
    with pytest.raises(ValueError, match="the stage's copy of .* has 3 bytes"):
        Model(MODEL, devices=[RemoteBackend(st)], n_gpu_layers=2, n_threads=1).devices[0].flush()
