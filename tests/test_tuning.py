"""Process tuning is explicit (llampy/tuning.py): importing llampy, its layers or its backends changes nothing
process-wide; the entry points install it; each of its Numba patches is in place after install()."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.paths import ROOT

# what a program that imports llampy would see change: the environment, Numba's internals, the collector, and
# numpy's OpenBLAS thread count
_SNAPSHOT = r"""
import gc, json, os, sys
def snap():
    from numba.core import dispatcher, inline_closurecall, ir_utils
    from numba.core.runtime import nrtdynmod
    from llampy.ggml.backends.cpu import blas
    return {"env": dict(os.environ), "compile": id(dispatcher.Dispatcher.compile),
            "nrt": id(nrtdynmod.compile_nrt_functions), "copy": id(inline_closurecall.copy),
            "utils_copy": id(ir_utils.copy), "inline_ir": id(inline_closurecall.InlineWorker.inline_ir), "frozen": gc.get_freeze_count(),
            "blas": blas.get_threads()}
before = snap()
exec(sys.argv[1])
after = snap()
print(json.dumps({k: [before[k], after[k]] for k in before if before[k] != after[k]}))
"""


def _changes(code: str, env=None) -> dict:
    env = {k: v for k, v in (env or os.environ).items() if k != "GOMP_SPINCOUNT"}
    r = subprocess.run([sys.executable, "-c", _SNAPSHOT, code], env=env, cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_importing_llampy_changes_nothing_process_wide(smollm2_path):
    # every layer, the cpu backend, a model loaded and a context that built and ran a graph
    code = f"""
import llampy, llampy.cli, llampy.cli_engine, llampy.llama.api, llampy.server.app, llampy.ggml.backends.cpu
from llampy.llama.model import Model
from llampy.llama.context import Context
from llampy.llama.batch import Batch
ctx = Context(Model({str(smollm2_path)!r}), n_ctx=64)
ctx.decode(Batch.from_tokens([1, 2, 3]))
"""
    assert _changes(code) == {}


def test_install_applies_each_piece():
    ch = _changes("import llampy.tuning as t; t.install(); t.install(); t.after_graph_built()")
    assert ch["env"][1]["GOMP_SPINCOUNT"] == str(__import__("llampy.tuning").tuning.SPIN_COUNT)
    for k in ("compile", "nrt", "copy", "utils_copy", "inline_ir", "frozen"):
        assert k in ch, f"{k} not patched"
    assert ch["blas"][1] == 1


def test_spin_count_set_by_the_user_wins():
    env = dict(os.environ)
    r = subprocess.run([sys.executable, "-c", "import os, llampy.tuning as t; t.install(); "
                        "print(os.environ['GOMP_SPINCOUNT'])"], env=dict(env, GOMP_SPINCOUNT="5"), cwd=ROOT,
                       capture_output=True, text=True)
    assert r.stdout.strip() == "5", r.stderr


def test_llama_installs_it_unless_told_not_to(smollm2_path):
    code = f"import llampy; llampy.Llama({str(smollm2_path)!r}, n_ctx=64, tune_process=False)"
    assert _changes(code) == {}
    ch = _changes(f"import llampy; llampy.Llama({str(smollm2_path)!r}, n_ctx=64)")
    assert "GOMP_SPINCOUNT" in ch["env"][1] and "compile" in ch


def test_cli_installs_it():
    ch = _changes("import llampy.cli; llampy.cli.main(['tokenize', 'Hello'])")
    assert "GOMP_SPINCOUNT" in ch["env"][1] and "compile" in ch


def test_numba_outside_the_tested_range_is_a_clear_error(monkeypatch):
    from llampy import tuning
    monkeypatch.setattr(tuning, "_numba_version", lambda: (0, 99))
    monkeypatch.setattr(tuning, "_installed", False)
    with pytest.raises(tuning.TuningError, match=r"numba >=0\.68,<0\.69"):
        tuning.install()
    assert not tuning.installed()
