"""GGUF writer: byte-identical round trips of real files, every value type, inference, gguf-py reads what we write."""
from __future__ import annotations

import io
import os

import gguf
import numpy as np
import pytest

from llampy.ggml.types import GGMLType
from llampy.gguf import GGUFReader, GGUFValueType as VT, GGUFWriter, copy_gguf
from llampy.gguf.constants import SCALAR_DTYPES
from llampy.gguf.writer import FileRange, infer_value_type

from .conftest import TINY_FILES, sha256


def test_smollm2_round_trip_is_byte_identical(smollm2_file, tmp_path):
    with GGUFReader(smollm2_file) as r:
        copy_gguf(r, tmp_path / "s.gguf")
    assert sha256(tmp_path / "s.gguf") == sha256(smollm2_file)


def test_gemma3_round_trip_is_byte_identical(gemma3_file, tmp_path):
    with GGUFReader(gemma3_file) as r:
        GGUFWriter.from_reader(r, tmp_path / "g.gguf").write()
    assert sha256(tmp_path / "g.gguf") == sha256(gemma3_file)


@pytest.mark.parametrize("path", TINY_FILES, ids=lambda p: p.name)
def test_tiny_fixtures_round_trip_to_a_file_object(path):
    buf = io.BytesIO()
    with GGUFReader(path) as r:
        copy_gguf(r, buf)
    assert buf.getvalue() == path.read_bytes()


SCALARS = [(VT.UINT8, 255), (VT.INT8, -128), (VT.UINT16, 65535), (VT.INT16, -32768), (VT.UINT32, 2**32 - 1),
           (VT.INT32, -2**31), (VT.FLOAT32, 0.1), (VT.BOOL, True), (VT.STRING, "naïve ✓"), (VT.UINT64, 2**64 - 1),
           (VT.INT64, -2**63), (VT.FLOAT64, 0.1)]


def test_every_value_type_round_trips_and_gguf_py_agrees(tmp_path):
    p = tmp_path / "all.gguf"
    w = GGUFWriter(p)
    for vt, v in SCALARS:
        w.add(f"s.{vt.name}", v, vt)
        w.add(f"a.{vt.name}", [v, v, v] if vt != VT.BOOL else [True, False, True], (VT.ARRAY, vt))
    w.add("a.empty", [], (VT.ARRAY, VT.STRING))
    w.add("a.nested", [[1, 2], [3], []], (VT.ARRAY, VT.ARRAY, VT.INT32))
    w.add("a.nested3", [[["x"], []], [["y", "z"]]], (VT.ARRAY, VT.ARRAY, VT.ARRAY, VT.STRING))
    w.add("a.mixed", [np.array([1.5], np.float32), ["s"], [True]])
    w.write()
    with GGUFReader(p) as r:
        for vt, v in SCALARS:
            got = r.metadata[f"s.{vt.name}"]
            expect = float(np.float32(v)) if vt == VT.FLOAT32 else v
            assert got == expect and type(got) is type(expect) and r.value_types[f"s.{vt.name}"] == (vt,)
            a = r.metadata[f"a.{vt.name}"]
            assert r.value_types[f"a.{vt.name}"] == (VT.ARRAY, vt)
            if vt == VT.STRING:
                assert a == [v] * 3
            else:
                assert isinstance(a, np.ndarray) and a.dtype == (np.bool_ if vt == VT.BOOL else SCALAR_DTYPES[vt])
                assert a.tolist() == ([True, False, True] if vt == VT.BOOL else [expect] * 3)
        assert r.metadata["a.empty"] == [] and r.value_types["a.empty"] == (VT.ARRAY, VT.STRING)
        assert [x.tolist() for x in r.metadata["a.nested"]] == [[1, 2], [3], []]
        assert r.value_types["a.nested"] == (VT.ARRAY, VT.ARRAY, VT.INT32)
        assert r.metadata["a.nested3"] == [[["x"], []], [["y", "z"]]]
        assert r.value_types["a.mixed"] == (VT.ARRAY, VT.ARRAY, [(VT.ARRAY, VT.FLOAT32), (VT.ARRAY, VT.STRING),
                                                                  (VT.ARRAY, VT.BOOL)])
        # writing back what was read, nested and mixed arrays included, gives the same bytes
        buf = io.BytesIO()
        copy_gguf(r, buf)
        assert buf.getvalue() == p.read_bytes()
    theirs = gguf.GGUFReader(p)      # the oracle reads flat keys the same (it has no nested arrays)
    for vt, v in SCALARS:
        f = theirs.fields[f"s.{vt.name}"]
        assert [VT(int(t)) for t in f.types] == [vt]
        assert f.contents() == (float(np.float32(v)) if vt == VT.FLOAT32 else v)


def test_value_type_inference():
    assert infer_value_type(True) == (VT.BOOL,)
    assert infer_value_type(5) == (VT.INT32,) and infer_value_type(2**40) == (VT.INT64,)
    assert infer_value_type(2**63) == (VT.UINT64,)
    assert infer_value_type(0.5) == (VT.FLOAT32,) and infer_value_type("x") == (VT.STRING,)
    assert infer_value_type(np.uint16(3)) == (VT.UINT16,) and infer_value_type(np.float64(1)) == (VT.FLOAT64,)
    assert infer_value_type(np.zeros(3, np.float32)) == (VT.ARRAY, VT.FLOAT32)
    assert infer_value_type(np.zeros(3, bool)) == (VT.ARRAY, VT.BOOL)
    assert infer_value_type(["a", "b"]) == (VT.ARRAY, VT.STRING)
    assert infer_value_type([1, 2]) == (VT.ARRAY, VT.INT32) and infer_value_type([1, 2**40]) == (VT.ARRAY, VT.INT64)
    assert infer_value_type([1, 2.5]) == (VT.ARRAY, VT.FLOAT32)
    assert infer_value_type([[1], [2, 3]]) == (VT.ARRAY, VT.ARRAY, VT.INT32)
    with pytest.raises(ValueError, match="cannot infer"):
        infer_value_type([1, "a"])
    with pytest.raises(ValueError):
        infer_value_type({"a": 1})


def test_writer_refuses_bad_input(tmp_path):
    w = GGUFWriter(tmp_path / "x.gguf")
    w.add("k", 1)
    with pytest.raises(ValueError, match="duplicate metadata key 'k'"):
        w.add("k", 2)
    with pytest.raises(ValueError, match="'u8'.*UINT8"):
        w.add("u8", 256, VT.UINT8)
    with pytest.raises(ValueError, match="'s'"):
        w.add("s", 5, VT.STRING)
    with pytest.raises(ValueError, match="'a'"):
        w.add("a", [1, -1], (VT.ARRAY, VT.UINT32))
    with pytest.raises(ValueError, match="general.alignment"):
        w.add("general.alignment", 48)
    with pytest.raises(ValueError, match="non-empty"):
        w.add("", 1)
    with pytest.raises(ValueError, match="element type"):
        w.add("arr", [1], VT.ARRAY)
    with pytest.raises(ValueError, match="takes 68"):
        w.add_tensor_raw("q", GGMLType.Q8_0, (32, 2), b"\0" * 67)
    with pytest.raises(ValueError, match="whole number of Q8_0 blocks"):
        w.add_tensor_raw("q", GGMLType.Q8_0, (33,), b"\0" * 34)
    w.add_tensor("t", np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="duplicate tensor name 't'"):
        w.add_tensor("t", np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="1 to 63 bytes"):
        w.add_tensor("n" * 64, np.zeros(4, np.float32))
    with pytest.raises(ValueError):
        w.add_tensor("b", np.zeros(4, np.complex64))
    with pytest.raises(ValueError, match="power of two"):
        GGUFWriter(tmp_path / "y.gguf", alignment=48)


def test_add_tensor_infers_types_and_lays_out_with_alignment(tmp_path):
    rng = np.random.default_rng(1)
    f32 = rng.standard_normal((3, 5)).astype(np.float32)
    f16 = rng.standard_normal((2, 3, 4)).astype(np.float16)
    i32 = np.arange(7, dtype=np.int32)
    q8 = rng.integers(0, 256, (6, 2 * 34), dtype=np.uint8)     # 6 rows of 64 Q8_0 values
    p = tmp_path / "t.gguf"
    w = GGUFWriter(p)
    w.add("general.alignment", 64)
    w.add_tensor("f32", f32)
    w.add_tensor("f16", f16)
    w.add_tensor("i32", i32)
    w.add_tensor("q8", q8, GGMLType.Q8_0)
    w.add_tensor("bf16", np.arange(6, dtype=np.uint16).reshape(2, 3), GGMLType.BF16)
    w.write()
    with GGUFReader(p) as r:
        assert r.alignment == 64 and r.value_types["general.alignment"] == (VT.UINT32,)
        assert [(t.type, t.ne) for t in r.tensors.values()] == [
            (GGMLType.F32, (5, 3)), (GGMLType.F16, (4, 3, 2)), (GGMLType.I32, (7,)), (GGMLType.Q8_0, (64, 6)),
            (GGMLType.BF16, (3, 2))]
        assert all(t.offset % 64 == 0 for t in r.tensors.values())
        for name, a in [("f32", f32), ("f16", f16), ("i32", i32), ("q8", q8)]:
            got = r.tensor_array(name)
            assert got.dtype == a.dtype and got.shape == a.shape
            np.testing.assert_array_equal(got, a)
        np.testing.assert_array_equal(r.tensor_array("bf16"), np.arange(6).reshape(2, 3))
    g = gguf.GGUFReader(p)
    assert [t.name for t in g.tensors] == ["f32", "f16", "i32", "q8", "bf16"]
    np.testing.assert_array_equal(g.tensors[0].data, f32)


def test_lazy_tensors_are_made_at_write_time(tmp_path):
    made = []
    a = np.arange(96, dtype=np.float32).reshape(3, 32)
    w = GGUFWriter(tmp_path / "lazy.gguf")
    w.add("general.architecture", "llama")
    w.add_tensor_lazy("a", GGMLType.F32, (32, 3), lambda: made.append("a") or a)
    w.add_tensor("b", a * 2)
    seen = []
    assert made == []
    w.write(progress=lambda i, n, name: seen.append((i, n, name)))
    assert made == ["a"] and seen == [(0, 2, "a"), (1, 2, "b")]
    with GGUFReader(tmp_path / "lazy.gguf") as r:
        np.testing.assert_array_equal(r.tensor_array("a"), a)
        np.testing.assert_array_equal(r.tensor_array("b"), a * 2)
    w = GGUFWriter(tmp_path / "bad.gguf")
    w.add_tensor_lazy("a", GGMLType.F32, (32, 3), lambda: a[:2])
    with pytest.raises(ValueError, match="bytes made"):
        w.write()


def _copy_by_bytes(r, target):
    """What llampy quantize writes for an unchanged file: every value as the file's bytes, every tensor as a range
    of the input copied by the kernel (or through a buffer into a file object)."""
    w = GGUFWriter(target, r.alignment, r.version)
    for k in r.metadata:
        w.add_encoded(k, r.value_bytes(k), r.value_types[k])
    for t in r.tensors.values():
        w.add_tensor_lazy(t.name, t.type, t.ne, lambda t=t: FileRange(r.fileno(), t.offset, t.nbytes))
    w.write()


@pytest.mark.parametrize("path", TINY_FILES[:4], ids=lambda p: p.name)
def test_encoded_values_and_file_ranges_copy_a_file_byte_for_byte(path, tmp_path):
    with GGUFReader(path) as r:
        _copy_by_bytes(r, tmp_path / "c.gguf")
        buf = io.BytesIO()
        _copy_by_bytes(r, buf)
    assert (tmp_path / "c.gguf").read_bytes() == path.read_bytes() == buf.getvalue()


def test_encoded_values_beside_added_ones(tmp_path):
    p = tmp_path / "a.gguf"
    w = GGUFWriter(p)
    w.add("general.alignment", 64, VT.UINT32)
    w.add("t.tokens", ["a", "ü", ""], (VT.ARRAY, VT.STRING))
    w.add("t.n", 7, VT.INT32)
    w.add_tensor("x", np.arange(64, dtype=np.float32))
    w.write()
    with GGUFReader(p) as r:
        w2 = GGUFWriter(tmp_path / "b.gguf")
        for k in r.metadata:
            w2.add_encoded(k, r.value_bytes(k), r.value_types[k])
        assert w2.alignment == 64            # the alignment key still sets the layout
        with pytest.raises(ValueError, match="duplicate"):
            w2.add_encoded("t.n", r.value_bytes("t.n"), r.value_types["t.n"])
        w2.add("t.more", 1.5)
        w2.add_tensor("x", np.arange(64, dtype=np.float32))
        w2.write()
    with GGUFReader(tmp_path / "b.gguf") as r:
        assert r.metadata["t.tokens"] == ["a", "ü", ""] and r.metadata["t.n"] == 7 and r.metadata["t.more"] == 1.5
        assert r.alignment == 64 and list(r.metadata)[-1] == "t.more"


def test_file_range_past_the_source_end_is_an_error(tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(bytes(range(100)))
    with open(src, "rb") as f:
        w = GGUFWriter(io.BytesIO())
        w.add_tensor_lazy("x", GGMLType.I8, (64,), lambda: FileRange(f.fileno(), 60, 64))
        with pytest.raises(ValueError, match="missing"):
            w.write()
        out = tmp_path / "ok.gguf"
        w = GGUFWriter(out)
        w.add_tensor_lazy("x", GGMLType.I8, (64,), lambda: FileRange(f.fileno(), 36, 64))
        w.write()
    with GGUFReader(out) as r:
        assert bytes(r.tensors["x"].data) == bytes(range(36, 100))


def _ranged_copy(src, out, sizes):
    """Writes tensors of ``sizes`` bytes (I8), each a range of ``src`` at an odd offset, to ``out``; their bytes."""
    w = GGUFWriter(out)
    want = []
    with open(src, "rb") as f:
        data = src.read_bytes()
        off = 7
        for i, n in enumerate(sizes):
            w.add_tensor_lazy(f"t{i}", GGMLType.I8, (n,), lambda o=off, n=n: FileRange(f.fileno(), o, n))
            want.append(data[off:off + n])
            off += n + 13
        w.write()
    return want


@pytest.mark.parametrize("fail", [None, "in", "out"])
def test_file_ranges_over_several_pipe_passes_and_when_splice_fails(tmp_path, monkeypatch, fail):
    from llampy.gguf import writer
    src = tmp_path / "src.bin"
    src.write_bytes(np.random.default_rng(1).integers(0, 256, 5 << 20, dtype=np.uint8).tobytes())
    calls = []
    if fail:
        real = os.splice

        def splice(a, b, n, **kw):       # the first pass goes through; then the chosen side fails
            calls.append(kw)
            if len(calls) > 2 and ("offset_src" in kw) == (fail == "in"):
                raise OSError(22, "splice refused")
            return real(a, b, n, **kw)
        monkeypatch.setattr(writer.os, "splice", splice)
    sizes = [3 * writer._PIPE_BYTES + 5, 100, writer._PIPE_BYTES - 1]
    want = _ranged_copy(src, tmp_path / "o.gguf", sizes)
    with GGUFReader(tmp_path / "o.gguf") as r:
        assert [bytes(r.tensors[f"t{i}"].data) for i in range(len(sizes))] == want
    if fail:
        assert len(calls) >= 3
