"""benchmarks/gpu_carry.py: files cut into device calls' folders within each call's room, and put back together
on the other side (pieces in any order, over several calls), each piece and each whole file checked by sha256."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from benchmarks import gpu_carry as gc


@pytest.fixture
def files(tmp_path):
    rng = np.random.default_rng(0)
    src = tmp_path / "src"
    src.mkdir()
    out = []
    for name, size in (("a.gguf", 2500), ("b.gguf", 7001), ("shared/fixtures/tiny/c.json", 300)):
        p = src / name.replace("/", "_")
        p.write_bytes(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
        out.append((name, p))
    return out


def test_split_fills_each_call_to_its_room_in_order():
    calls = gc.split([("a", 2500), ("b", 7001), ("c", 300)], [1000], 3000)
    assert [sum(p["length"] for p in c) for c in calls] == [1000, 3000, 3000, 2801]
    for name, size in (("a", 2500), ("b", 7001), ("c", 300)):
        pieces = [p for c in calls for p in c if p["name"] == name]
        assert [p["offset"] for p in pieces] == list(np.cumsum([0] + [p["length"] for p in pieces[:-1]]))
        assert sum(p["length"] for p in pieces) == size
    with pytest.raises(ValueError, match="no room"):
        gc.split([("a", 10)], [0], 5)


def test_pieces_taken_over_several_calls_give_the_files_back(files, tmp_path):
    out, store = tmp_path / "carry", tmp_path / "store"
    dirs = gc.write_plan(files, out, [1500], 4200)
    assert [d.name for d in dirs] == ["c01", "c02", "c03"]
    for d, room in zip(dirs, (1500, 4200, 4200)):
        assert sum(p.stat().st_size for p in d.iterdir() if p.name != "manifest.json") <= room
    # the last call first: b's tail and c whole; a and b still partial, no READY
    rep = gc.take(dirs[2], store)
    assert rep["shared/fixtures/tiny/c.json"][2] == "ok" and rep["a.gguf"][2] == "0/2 pieces"
    assert not (store / "READY").exists() and not (store / "a.gguf").exists()
    rep = gc.take(dirs[0], store)
    assert rep["a.gguf"][2] == "1/2 pieces" and rep["a.gguf"][0] == 1500
    gc.take(dirs[0], store)                         # a call sent again changes nothing
    rep = gc.take(dirs[1], store)
    assert all(r[2] == "ok" for r in rep.values())
    for name, p in files:
        assert (store / name).read_bytes() == p.read_bytes()
    assert json.loads((store / "READY").read_text())["b.gguf"] == gc.sha256(files[1][1])
    assert not list(store.rglob("*.part"))


def test_a_bad_piece_is_refused(files, tmp_path):
    out, store = tmp_path / "carry", tmp_path / "store"
    dirs = gc.write_plan(files, out, [1500], 4200)
    piece = dirs[1] / gc.piece_file("b.gguf", 0)
    data = bytearray(piece.read_bytes())
    data[17] ^= 1
    piece.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="sha256"):
        gc.take(dirs[1], store)
    # a whole file whose pieces each pass but whose manifest sum differs (a stale piece from another plan)
    dirs = gc.write_plan(files, out, [1500], 4200)
    m = json.loads((dirs[0] / "manifest.json").read_text())
    m["files"][0]["sha256"] = "0" * 64
    for d in dirs:
        (d / "manifest.json").write_text(json.dumps(m))
    shutil.rmtree(store)
    gc.take(dirs[0], store)
    with pytest.raises(ValueError, match="whole sha256"):
        gc.take(dirs[1], store)


def test_the_calls_carry_the_first_paths_once_start_the_check_first_and_wait_last(tmp_path):
    dirs = [tmp_path / f"c0{i}" for i in (1, 2, 3)]
    lines = gc.calls_text(dirs, [".llamacpp-src"], 560, False, ["TYPES=Q4_K_M"]).splitlines()
    assert lines[0].startswith('1. carry [".llamacpp-src", ".gpu-carry/c01"]')
    assert lines[0].endswith("take .gpu-carry/c01 --start 560 --env TYPES=Q4_K_M`")
    assert '2. carry [".gpu-carry/c02"]' in lines[1] and "--start" not in lines[1] and "wait" not in lines[1]
    assert lines[2].startswith(f'3. carry [".gpu-carry/c03"], timeout_s {gc.WAIT_S}') and "c03; python3" in lines[2]
    assert "wait $OUT" in lines[2] and lines[3] == "then give_back."


def test_targets_read_each_real_models_line(tmp_path):
    """gpu_targets.py's real-model targets, two per model, from the lines the GPU test prints: met, missed, or not
    measured with pytest's reason."""
    from benchmarks import gpu_targets as gt
    log = tmp_path / "pytest_real.log"
    log.write_text("\n".join(["..", gt.real_model_line("smollm2", [True] * 24, 0.0031),
                              gt.real_model_line("gemma3", [True] * 5 + [False] * 19, 0.07), "1 passed, 1 failed"]))
    res = {t["target"]: t for t in gt.targets(tmp_path)}
    assert res["real model smollm2: greedy tokens as the CPU backend's"]["met"] is True
    assert res["real model smollm2: log-probs within 0.05"]["met"] is True
    assert res["real model gemma3: greedy tokens as the CPU backend's"]["met"] is False
    assert "first difference at step 5" in res["real model gemma3: greedy tokens as the CPU backend's"]["detail"]
    assert res["real model gemma3: log-probs within 0.05"]["met"] is False
    log.write_text("SKIPPED [2] tests/cuda/test_cuda_model.py:150: /tmp/x/smollm2.gguf was not carried\n2 skipped\n")
    res = {t["target"]: t for t in gt.targets(tmp_path)}
    t = res["real model gemma3: log-probs within 0.05"]
    assert t["met"] is None and "not carried" in t["detail"]
