"""The tiny recurrent GGUFs of tests/fixtures/tiny_recurrent, built once per test process and shared by the test
modules that load them (the builds are deterministic; the JSON beside each holds the sha256 it was recorded on)."""
from __future__ import annotations

import importlib.util
import os

import pytest

from tests.paths import ROOT, TINY

HERE = ROOT / "tests" / "fixtures" / "tiny_recurrent"
_mod = None


def fixtures():
    global _mod
    if _mod is None:
        spec = importlib.util.spec_from_file_location("make_fixtures", HERE / "make_fixtures.py")
        _mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_mod)
    return _mod


def gguf(name: str, tmp_path_factory):
    """The path of model ``name``, built into this process's temporary directory the first time it is asked for."""
    if not (TINY / "qwen2-Q8_0.gguf").exists():
        pytest.skip("the shared tiny fixtures (their vocabulary) are not here")
    d = tmp_path_factory.getbasetemp() / "tiny_recurrent"
    d.mkdir(exist_ok=True)
    path = d / f"{name}.gguf"
    if not path.exists():
        part = d / f"{name}.{os.getpid()}.part"
        fixtures().build(name, part)
        os.replace(part, path)
    return path
