"""`llampy inspect`: the text report, --json, and one-line errors with exit status 1."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from llampy.cli import main
from llampy.gguf import GGUFReader, GGUFValueType as VT, GGUFWriter
from llampy.gguf.inspect import summarize_value

from .conftest import TINY


def test_text_report_on_the_default_model(capsys, smollm2_file):
    assert main(["inspect"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{smollm2_file}: GGUF v3, {smollm2_file.stat().st_size} bytes")
    assert '[49152 strings: "<|endoftext|>", "<|im_start|>", "<|im_end|>", ... ]' in out
    assert "tokenizer.ggml.token_type" in out and "[49152 int32 values: 3, 3, 3, ... ]" in out
    assert "llama.attention.layer_norm_rms_epsilon" in out and " 1e-05\n" in out
    lines = out.splitlines()
    row = next(ln for ln in lines if ln.strip().startswith("token_embd.weight"))
    assert row.split() == ["token_embd.weight", "Q8_0", "[576,", "49152]", "30081024"]
    totals = lines[lines.index("totals per type:") + 1:]
    assert totals[0].split()[:3] == ["Q4_1", "210", "tensors"]
    assert any(ln.split()[:2] == ["all", "272"] for ln in totals)
    assert lines[-1].startswith(f"file size: {smollm2_file.stat().st_size} bytes")


def test_json_report_matches_the_reader(capsys):
    path = TINY / "qwen3moe-Q8_0.gguf"
    assert main(["inspect", str(path), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    with GGUFReader(path) as r:
        assert rep["file_size"] == r.file_size == path.stat().st_size
        assert list(rep["metadata"]) == list(r.metadata)
        assert rep["metadata"]["general.architecture"] == "qwen3moe"
        assert rep["value_types"]["tokenizer.ggml.tokens"] == "ARRAY/STRING"
        assert [(t["name"], t["type"], tuple(t["shape"]), t["bytes"], t["offset"]) for t in rep["tensors"]] == \
            [(t.name, t.type.name, t.ne, t.nbytes, t.offset) for t in r.tensors.values()]
        for ty in {t.type for t in r.tensors.values()}:
            ts = [t for t in r.tensors.values() if t.type == ty]
            assert rep["totals"][ty.name] == {"count": len(ts), "bytes": sum(t.nbytes for t in ts)}
        assert rep["n_params"] == sum(t.n_elements for t in r.tensors.values())


def test_gemma3_by_name(capsys):
    assert main(["inspect", "gemma3", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["metadata"]["tokenizer.ggml.tokens"].startswith("[262144 strings: ")
    assert set(rep["totals"]) == {"Q8_0", "Q5_0", "Q4_K", "Q6_K", "F32"}


def test_summaries():
    assert summarize_value(np.arange(3, dtype=np.int32), (VT.ARRAY, VT.INT32)) == [0, 1, 2]
    assert summarize_value(np.arange(100, dtype=np.float32) / 4, (VT.ARRAY, VT.FLOAT32)) == \
        "[100 float32 values: 0.0, 0.25, 0.5, ... ]"
    assert summarize_value("x" * 500, (VT.STRING,)).endswith("... (500 chars)")
    assert summarize_value([[1]] * 20, (VT.ARRAY, VT.ARRAY, VT.INT32)) == \
        '[20 arrays: "[1 items]", "[1 items]", "[1 items]", ... ]'


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "llampy", *args], capture_output=True, text=True, timeout=60)


def test_bad_and_missing_files_give_one_line_and_status_1(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (1).to_bytes(8, "little") + (0).to_bytes(8, "little")
                    + b"\xff" * 40)
    r = _cli("inspect", str(bad))
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == f"llampy: error: {bad}: tensor 0 name: string length 18446744073709551615 " \
                       "runs past the end of the file (at byte 24)\n"
    missing = tmp_path / "missing.gguf"
    r = _cli("inspect", str(missing))
    assert (r.returncode, r.stderr) == (1, f"llampy: error: {missing}: cannot open: No such file or directory\n")


def test_main_reports_errors_without_traceback(tmp_path, capsys):
    p = tmp_path / "x.gguf"
    w = GGUFWriter(p)
    w.add("general.alignment", 64)
    w.add_tensor("t", np.zeros(3, np.float32))
    w.write()
    data = bytearray(p.read_bytes())
    assert len(data) == 192   # header 90, padded to 128, then 12 bytes of data padded to 64
    data[-60:] = b""          # cut into the tensor's data
    p.write_bytes(bytes(data))
    assert main(["inspect", str(p)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"llampy: error: {p}: tensor 't': data [0, 12) lies outside the data section "
                          "(4 bytes from byte 128) (at byte 82)\n")
    assert err.count("\n") == 1


def test_json_stays_strict_with_nan_and_inf(tmp_path, capsys):
    p = tmp_path / "nan.gguf"
    w = GGUFWriter(p)
    w.add("x.nan", float("nan"))
    w.add("x.inf", [1.0, float("-inf")], (VT.ARRAY, VT.FLOAT64))
    w.write()
    assert main(["inspect", str(p), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert rep["metadata"] == {"x.nan": "nan", "x.inf": [1.0, "-inf"]}
