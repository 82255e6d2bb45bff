"""Architectures from other packages: an entry point in the group llampy.architectures, registered here by a
temporary dist-info on sys.path (what `pip install` of a package declaring it leaves behind)."""
from __future__ import annotations

import textwrap

import numpy as np
import pytest

from llampy.gguf import GGUFReader
from llampy.gguf.writer import GGUFWriter
from llampy.llama import arch
from llampy.llama.batch import Batch
from llampy.llama.context import Context
from llampy.llama.model import Model

from tests.paths import TINY

PLUGIN = '''
"""scaledllama: llama's block, logits divided by scaledllama.logit_divisor."""
from llampy.llama.models import llama


def load_hparams(hp, md):
    llama.load_hparams(hp, md)
    hp.logit_divisor = float(md.get(f"{hp.arch}.logit_divisor", 1.0))


load_tensors = llama.load_tensors


def build_graph(model, g):
    return llama.build_graph(model, g, logit_scale=model.hparams.logit_divisor)
'''


def install(tmp_path, monkeypatch, name: str, module: str, source: str | None) -> None:
    if source is not None:
        (tmp_path / f"{module}.py").write_text(source)
    dist = tmp_path / "llampy_test_plugin-0.1.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: llampy-test-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[llampy.architectures]\n{name} = {module}\n")
    monkeypatch.syspath_prepend(str(tmp_path))


def renamed_copy(src, dst, new_arch: str, extra: dict) -> None:
    """The GGUF ``src`` with general.architecture and its keys' prefix changed to ``new_arch``."""
    r = GGUFReader(src)
    old = r.metadata["general.architecture"]
    w = GGUFWriter(dst)
    for k, v in r.metadata.items():
        if k == "general.architecture":
            v = new_arch
        w.add(new_arch + k[len(old):] if k.startswith(old + ".") else k, v, r.value_types[k])
    for k, v in extra.items():
        w.add(k, v)
    for t in r.tensors.values():
        w.add_tensor_raw(t.name, t.type, t.ne, t.data)
    w.write()


def test_entry_point_adds_an_architecture(tmp_path, monkeypatch):
    install(tmp_path, monkeypatch, "scaledllama", "llampy_scaledllama_test", textwrap.dedent(PLUGIN))
    assert "scaledllama" in arch.supported_architectures()
    path = tmp_path / "scaled.gguf"
    renamed_copy(TINY / "llama-F32.gguf", path, "scaledllama", {"scaledllama.logit_divisor": 4.0})
    toks = [504, 3575, 282, 4649, 314]
    logits = {}
    for p in (TINY / "llama-F32.gguf", path):
        ctx = Context(Model(p), n_ctx=64)
        ctx.decode(Batch.from_tokens(toks))
        logits[p] = ctx.get_logits_ith(-1)
    np.testing.assert_allclose(logits[path], logits[TINY / "llama-F32.gguf"] / 4.0, rtol=1e-5, atol=1e-6)


def test_builtin_name_wins_over_a_plugin(tmp_path, monkeypatch):
    install(tmp_path, monkeypatch, "llama", "llampy_not_imported_test", None)
    assert arch.arch_module("llama").__name__ == "llampy.llama.models.llama"


def test_broken_plugin_is_reported_by_name(tmp_path, monkeypatch):
    install(tmp_path, monkeypatch, "brokenarch", "llampy_broken_test", "raise ImportError('no kernels here')\n")
    with pytest.raises(arch.UnknownArchitecture, match="llampy_broken_test.*no kernels here"):
        arch.arch_module("brokenarch")


def test_plugin_without_the_three_functions(tmp_path, monkeypatch):
    install(tmp_path, monkeypatch, "halfarch", "llampy_half_test", "def load_hparams(hp, md):\n    pass\n")
    with pytest.raises(arch.UnknownArchitecture, match="load_tensors, build_graph"):
        arch.arch_module("halfarch")


def test_unknown_architecture_lists_the_supported():
    with pytest.raises(arch.UnknownArchitecture, match="supported: .*bert.*llama"):
        arch.arch_module("no-such-arch")
