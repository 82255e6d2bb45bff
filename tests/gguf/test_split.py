"""Split GGUF files: written and merged byte for byte as llama.cpp's llama-gguf-split does, loaded as one model by
llampy (the same logits as the whole file) and by libllama."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from llampy.cli import main
from llampy.gguf import GGUFError, GGUFReader, GGUFWriter
from llampy.gguf.split import gguf_merge, gguf_split, open_gguf, parse_size, split_path, split_prefix
from llampy.llama.batch import Batch
from llampy.llama.context import Context
from llampy.llama.model import Model

from tests.paths import TINY

SRC = TINY / "qwen2-Q8_0.gguf"
TOKENS = [1, 5, 9, 13, 2, 7, 300, 4000]
CASES = [["--split-max-tensors", "7"], ["--split-max-size", "1M"],
         ["--no-tensor-first-split", "--split-max-tensors", "20"]]


def _llampy_logits(path) -> np.ndarray:
    m = Model(path)
    try:
        ctx = Context(m, n_ctx=64)
        ctx.decode(Batch.from_tokens(TOKENS, logits_all=True))
        return np.array([ctx.get_logits_ith(i).copy() for i in range(len(TOKENS))])
    finally:
        m.close()


def _gguf_split_tool() -> str | None:
    for d in (os.environ.get("LLAMPY_LLAMACPP_TOOLS", ""),):
        if d and os.access(os.path.join(d, "llama-gguf-split"), os.X_OK):
            return os.path.join(d, "llama-gguf-split")
    return None


def test_split_names_follow_llama_cpp():
    assert split_path("out/m", 0, 3) == "out/m-00001-of-00003.gguf"
    assert split_prefix("out/m-00002-of-00003.gguf", 1, 3) == "out/m"
    assert split_prefix("out/m-00002-of-00003.gguf", 0, 3) is None
    assert parse_size("2M") == 2_000_000 and parse_size("3G") == 3_000_000_000
    with pytest.raises(ValueError):
        parse_size("5K")


@pytest.mark.parametrize("args", CASES, ids=lambda a: "_".join(a).strip("-"))
def test_split_and_merge_round_trip(tmp_path, args):
    assert main(["gguf-split", *args, str(SRC), str(tmp_path / "m")]) == 0
    parts = sorted(tmp_path.glob("m-*.gguf"))
    assert len(parts) > 1
    with GGUFReader(SRC) as whole, open_gguf(parts[-1]) as split:     # any part names the model
        assert split.paths == [str(p) for p in parts]
        assert list(split.tensors) == list(whole.tensors)
        for name, t in whole.tensors.items():
            assert split.tensors[name].type == t.type and bytes(split.tensors[name].data) == bytes(t.data)
        assert {k: v for k, v in split.metadata.items() if not k.startswith("split.")}.keys() == whole.metadata.keys()
        assert split.metadata["split.count"] == len(parts)
        assert split.metadata["split.tensors.count"] == len(whole.tensors)
    for i, p in enumerate(parts[1:], 1):          # later parts carry the split keys only
        with GGUFReader(p) as r:
            assert list(r.metadata) == ["split.no", "split.tensors.count", "split.count"]
            assert r.metadata["split.no"] == i
    assert main(["gguf-split", "--merge", str(parts[0]), str(tmp_path / "merged.gguf")]) == 0
    with GGUFReader(tmp_path / "merged.gguf") as r, GGUFReader(SRC) as whole:
        assert r.metadata["split.count"] == 0 and list(r.metadata)[-1] == "split.count"
        assert [bytes(t.data) for t in r.tensors.values()] == [bytes(t.data) for t in whole.tensors.values()]
    # a merge never overwrites
    assert main(["gguf-split", "--merge", str(parts[0]), str(tmp_path / "merged.gguf")]) == 1


@pytest.mark.parametrize("args", CASES, ids=lambda a: "_".join(a).strip("-"))
def test_bytes_match_llama_gguf_split(tmp_path, args):
    tool = _gguf_split_tool()
    if tool is None:
        msg = "llama-gguf-split not built: run `bash scripts/llamacpp_tools.sh`, LLAMPY_LLAMACPP_TOOLS names its output"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    subprocess.run([tool, *args, str(SRC), str(tmp_path / "a" / "m")], check=True, capture_output=True)
    gguf_split(SRC, tmp_path / "b" / "m", **_kw(args))
    ours = sorted(p.name for p in (tmp_path / "b").iterdir())
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ours
    for name in ours:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    subprocess.run([tool, "--merge", str(tmp_path / "a" / ours[0]), str(tmp_path / "a.gguf")], check=True,
                   capture_output=True)
    gguf_merge(tmp_path / "a" / ours[0], tmp_path / "b.gguf")
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()


def _kw(args):
    kw = {}
    if "--split-max-tensors" in args:
        kw["max_tensors"] = int(args[args.index("--split-max-tensors") + 1])
    if "--split-max-size" in args:
        kw["max_size"] = parse_size(args[args.index("--split-max-size") + 1])
    kw["no_tensor_first_split"] = "--no-tensor-first-split" in args
    return kw


def test_split_model_gives_the_whole_models_logits(tmp_path):
    parts = gguf_split(SRC, tmp_path / "m", max_tensors=5)
    assert len(parts) == 6
    np.testing.assert_array_equal(_llampy_logits(parts[0]), _llampy_logits(SRC))


def test_libllama_loads_our_parts(tmp_path):
    from tests.llamacpp_run import llamacpp_logits
    parts = gguf_split(SRC, tmp_path / "m", max_tensors=9)
    np.testing.assert_array_equal(llamacpp_logits(parts[0], TOKENS), llamacpp_logits(SRC, TOKENS))


def test_broken_splits_are_errors(tmp_path):
    parts = gguf_split(SRC, tmp_path / "m", max_tensors=10)
    assert len(parts) == 3
    os.rename(parts[2], tmp_path / "elsewhere.gguf")
    with pytest.raises(GGUFError, match="part 3 of 3 is missing"):
        open_gguf(parts[0])
    # a part whose split.no lies
    w = GGUFWriter(parts[2])
    with GGUFReader(tmp_path / "elsewhere.gguf") as r:
        for k, v in r.metadata.items():
            w.add(k, 1 if k == "split.no" else v, r.value_types[k])
        for t in r.tensors.values():
            w.add_tensor_raw(t.name, t.type, t.ne, t.data)
        w.write()
    with pytest.raises(GGUFError, match="split.no is 1, expected 2"):
        open_gguf(parts[0])
    # a part renamed away from llama.cpp's naming
    renamed = Path(str(parts[0]).replace("-00001-of-", "-1-of-"))
    os.rename(parts[0], renamed)
    with pytest.raises(GGUFError, match="must be named"):
        open_gguf(renamed)
    assert main(["gguf-split", "--split-max-size", "1K", str(SRC), str(tmp_path / "z")]) == 1


def test_inspect_reports_every_part(tmp_path):
    from llampy.gguf.inspect import format_report, inspect_report
    parts = gguf_split(SRC, tmp_path / "m", max_tensors=10)
    rep, whole = inspect_report(parts[1]), inspect_report(SRC)
    assert [p["path"] for p in rep["parts"]] == [str(p) for p in parts]
    assert sum(p["n_tensors"] for p in rep["parts"]) == len(whole["tensors"]) == len(rep["tensors"])
    assert rep["tensor_bytes"] == whole["tensor_bytes"] and rep["n_params"] == whole["n_params"]
    assert "part 3/3" in format_report(rep) and whole["parts"] == []
