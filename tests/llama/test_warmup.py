"""`llampy warmup` (llampy/llama/warmup.py): from a model's header alone it compiles every kernel the model's
batches then use; a hollow copy reads as zeros and allocates nothing; bad types are refused."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.paths import ROOT

# a first prompt and decode in a fresh process: how many kernels it had to compile (warmup._kernel_counts)
_RUN = """
import sys, llampy
from llampy.llama.warmup import _kernel_counts
llm = llampy.Llama(sys.argv[1], n_ctx=256)
llm.create_completion("The capital of France is", max_tokens=4, temperature=0)
print(_kernel_counts()[0])
"""


def _py(args, env, **kw):
    r = subprocess.run([sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True, **kw)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


@pytest.mark.slow
def test_warmup_leaves_nothing_to_compile(tmp_path, smollm2_path):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    out = _py(["-m", "llampy.cli", "warmup", str(smollm2_path)], env)
    assert "compiled here" in out
    assert _py(["-c", _RUN, str(smollm2_path)], env).strip() == "0"


def test_hollow_copy_has_the_header_and_zeros(tmp_path, smollm2_path):
    from llampy.gguf import GGUFReader
    from llampy.llama.warmup import hollow_copy
    out = tmp_path / "h.gguf"
    hollow_copy(smollm2_path, out)
    a, b = GGUFReader(smollm2_path), GGUFReader(out)
    assert list(a.metadata) == list(b.metadata) and a.metadata["tokenizer.ggml.tokens"] == b.metadata[
        "tokenizer.ggml.tokens"]
    assert [(t.name, t.type, t.ne) for t in a.tensors.values()] == [(t.name, t.type, t.ne) for t in b.tensors.values()]
    assert out.stat().st_size == smollm2_path.stat().st_size
    assert out.stat().st_blocks * 512 < 4 << 20          # a hole, not 100 MB of zeros
    t = b.tensors["blk.3.ffn_up.weight"]
    assert not np.asarray(t.data).any()


def test_types_model_loads_and_runs(tmp_path):
    from llampy.llama.batch import Batch
    from llampy.llama.context import Context
    from llampy.llama.model import Model
    from llampy.llama.warmup import types_model
    types_model(["Q8_0", "F16"], tmp_path / "t.gguf")
    m = Model(tmp_path / "t.gguf")
    assert m.hparams.n_layer == 2 and m.tensors["blk.1.ffn_up.weight"].type.name == "F16"
    ctx = Context(m, n_ctx=64)
    ctx.decode(Batch.from_tokens([5, 6, 7]))
    assert np.isfinite(ctx.get_logits_ith(-1)).all()
    with pytest.raises(ValueError, match="Q8_K is not a weight type"):
        types_model(["Q8_K"], tmp_path / "u.gguf")


def test_cli_refuses_unknown_types():
    r = subprocess.run([sys.executable, "-m", "llampy.cli", "warmup", "--types", "Q4_0,BOGUS"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 2 and "BOGUS" in r.stderr and "Traceback" not in r.stderr
