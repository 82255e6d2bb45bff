"""Hostile and broken files: each check of the reader, by a hand-made file, asserting the message and the offset;
bounded memory on absurd counts; and hypothesis-driven mutation and truncation of real files, which must either
open or raise GGUFError — never another exception, never a hang."""
from __future__ import annotations

import os
import struct
import tempfile
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from llampy.ggml.types import GGMLType
from llampy.gguf import GGUFError, GGUFReader, GGUFValueType as VT, GGUFWriter, copy_gguf

from .conftest import TINY_FILES


# ------------------------------------------------------------------------------ byte builders
def u32(x):
    return struct.pack("<I", x)


def u64(x):
    return struct.pack("<Q", x)


def gstr(b: bytes):
    return u64(len(b)) + b


def header(n_tensors=0, n_kv=0, version=3, magic=b"GGUF"):
    return magic + u32(version) + u64(n_tensors) + u64(n_kv)


def kv(key: bytes, vt: int, payload: bytes):
    return gstr(key) + u32(vt) + payload


def tinfo(name: bytes, ne, type_: int, offset: int):
    return gstr(name) + u32(len(ne)) + b"".join(u64(x) for x in ne) + u32(type_) + u64(offset)


def arr(et: int, n: int, payload: bytes = b""):
    return u32(et) + u64(n) + payload


H = 24            # header size
KV0 = H + 8 + 1   # where the type of a 1-byte key at the start of the metadata is
F32, Q8_0 = int(GGMLType.F32), int(GGMLType.Q8_0)


def with_data(head: bytes, data: bytes = b"", align: int = 32) -> bytes:
    return head + b"\0" * ((-len(head)) % align) + data


def case(id_, data, msg, offset):
    return pytest.param(data, msg, offset, id=id_)


def _string_array_bad_utf8():
    prefix = header(n_kv=1) + gstr(b"k") + u32(VT.ARRAY) + arr(VT.STRING, 2) + gstr(b"ok") + u64(3) + b"a"
    return prefix + b"\xc3(" + b"\0" * 8, len(prefix)


def _nested(depth):
    return header(n_kv=1) + gstr(b"k") + u32(VT.ARRAY) + arr(VT.ARRAY, 1) * depth + arr(VT.INT8, 0) + b"\0" * 32


_SBAD, _SBAD_AT = _string_array_bad_utf8()
_KV_U32 = kv(b"k", VT.UINT32, u32(1))
_T_AT = H                                     # tensor infos start right after the header when there are no keys

CASES = [
    case("magic", header(magic=b"GGML"), r"bad magic b'GGML': not a GGUF file", 0),
    case("v1", header(version=1), r"unsupported GGUF version 1 \(GGUF v1 is obsolete", 4),
    case("v7", header(version=7), r"unsupported GGUF version 7; supported: 2, 3", 4),
    case("big-endian", b"GGUF\0\0\0\3" + u64(0) + u64(0), r"big-endian", 4),
    case("too-small", b"GGUF\3\0\0\0", r"file too small to be GGUF \(8 bytes", 0),
    case("n_kv", header(n_kv=10**15), r"metadata count 1000000000000000 is larger than the file could hold", 16),
    case("n_tensors", header(n_tensors=10**15), r"tensor count 1000000000000000 is larger", 8),
    case("key-length", header(n_kv=1) + u64(10**12) + b"k" * 20,
         r"metadata key 0: string length 1000000000000 runs past the end of the file", H),
    case("empty-key", header(n_kv=1) + kv(b"", VT.UINT32, u32(1)), r"metadata key 0 is empty", H),
    case("duplicate-key", header(n_kv=2) + _KV_U32 * 2, r"duplicate metadata key 'k'", H + len(_KV_U32)),
    case("value-type", header(n_kv=1) + kv(b"k", 99, b"\0" * 8), r"type of 'k': unknown value type 99", KV0),
    case("utf8-key", header(n_kv=1) + kv(b"a\xff", VT.UINT8, b"\0"), r"metadata key 0: invalid UTF-8", H + 8 + 1),
    case("utf8-value", header(n_kv=1) + kv(b"k", VT.STRING, gstr(b"ab\xfe")),
         r"value of 'k': invalid UTF-8", KV0 + 4 + 8 + 2),
    case("utf8-array", _SBAD, r"value of 'k': string 1 is invalid UTF-8", _SBAD_AT),
    case("string-truncated", header(n_kv=1) + kv(b"k", VT.STRING, u64(50) + b"x"),
         r"value of 'k': string length 50 runs past the end of the file", KV0 + 4),
    case("u32-array", header(n_kv=1) + kv(b"k", VT.ARRAY, arr(VT.UINT32, 10**15)),
         r"value of 'k': array of 1000000000000000 UINT32 runs past the end of the file", KV0 + 8),
    case("string-array", header(n_kv=1) + kv(b"k", VT.ARRAY, arr(VT.STRING, 10**15)),
         r"array of 1000000000000000 strings runs past", KV0 + 8),
    case("string-array-short", header(n_kv=1) + kv(b"k", VT.ARRAY, arr(VT.STRING, 3, gstr(b"a") + gstr(b"b") + b"\0" * 6)),
         r"string 2 length runs past the end of the file", KV0 + 4 + 12 + 18),
    case("array-array", header(n_kv=1) + kv(b"k", VT.ARRAY, arr(VT.ARRAY, 10**15)),
         r"array of 1000000000000000 arrays runs past", KV0 + 8),
    case("array-type", header(n_kv=1) + kv(b"k", VT.ARRAY, arr(13, 1) + b"\0" * 8),
         r"value of 'k' element type: unknown value type 13", KV0 + 4),
    case("nesting", _nested(9), r"value of 'k'\[0\]\[0\]\[0\]\[0\]\[0\]\[0\]\[0\]\[0\]: arrays nested deeper than 8",
         KV0 + 4 + 8 * 12),
    case("bool", header(n_kv=1) + kv(b"k", VT.BOOL, b"\2"), r"value of 'k': invalid bool value 2", KV0 + 4),
    case("bool-array", header(n_kv=1) + kv(b"k", VT.ARRAY, arr(VT.BOOL, 3, b"\0\1\5")),
         r"value of 'k': invalid bool value 5", KV0 + 4 + 12 + 2),
    case("truncated-kv", header(n_kv=2) + _KV_U32 + gstr(b"k2") + b"\4\0",
         r"file truncated: type of 'k2' needs 4 bytes, 2 remain", H + len(_KV_U32) + 10),
    case("alignment-type", header(n_kv=1) + kv(b"general.alignment", VT.UINT64, u64(64)),
         r"general.alignment must be UINT32, not UINT64", H + 8 + 17),
    case("alignment-pow2", header(n_kv=1) + kv(b"general.alignment", VT.UINT32, u32(48)),
         r"general.alignment 48 is not a power of two", H + 8 + 17 + 4),
    case("alignment-0", header(n_kv=1) + kv(b"general.alignment", VT.UINT32, u32(0)),
         r"general.alignment 0 is not a power of two", H + 8 + 17 + 4),
    case("name-too-long", with_data(header(n_tensors=1) + tinfo(b"n" * 64, [32], F32, 0), b"\0" * 128),
         r"tensor 0 name is too long \(64 bytes; ggml allows 63\)", _T_AT),
    case("duplicate-tensor", with_data(header(n_tensors=2) + tinfo(b"t", [8], F32, 0) + tinfo(b"t", [8], F32, 32),
                                       b"\0" * 64), r"duplicate tensor name 't'", _T_AT + 33),
    case("n_dims-0", header(n_tensors=1) + gstr(b"t") + u32(0) + b"\0" * 32, r"tensor 't': n_dims 0 is outside 1..4",
         _T_AT + 9),
    case("n_dims-5", header(n_tensors=1) + gstr(b"t") + u32(5) + b"\0" * 60, r"tensor 't': n_dims 5 is outside 1..4",
         _T_AT + 9),
    case("tensor-type", header(n_tensors=1) + tinfo(b"t", [8], 77, 0), r"tensor 't': unknown tensor type 77",
         _T_AT + 9 + 4 + 8),
    case("removed-type", header(n_tensors=1) + tinfo(b"t", [32], 4, 0), r"tensor 't': unknown tensor type 4",
         _T_AT + 9 + 4 + 8),
    case("overflow", header(n_tensors=1) + tinfo(b"t", [2**40, 2**40], F32, 0),
         r"tensor 't': shape \[1099511627776, 1099511627776\] element count overflows int64", _T_AT + 13),
    case("overflow-dim", header(n_tensors=1) + tinfo(b"t", [2**63], F32, 0),
         r"element count overflows int64", _T_AT + 13),
    case("blocks", header(n_tensors=1) + tinfo(b"t", [33, 2], Q8_0, 0),
         r"tensor 't': ne\[0\] = 33 is not a whole number of Q8_0 blocks of 32", _T_AT + 13),
    case("misaligned", with_data(header(n_tensors=1) + tinfo(b"t", [8], F32, 3), b"\0" * 64),
         r"tensor 't': data offset 3 is not a multiple of the alignment 32", _T_AT + 9 + 4 + 8 + 4),
    case("outside", with_data(header(n_tensors=1) + tinfo(b"t", [10**6], F32, 0), b"\0" * 64),
         r"tensor 't': data \[0, 4000000\) lies outside the data section \(64 bytes from byte 64\)", _T_AT + 25),
    case("offset-huge", with_data(header(n_tensors=1) + tinfo(b"t", [8], F32, 2**64 - 32), b"\0" * 64),
         r"lies outside the data section", _T_AT + 25),
    case("overlap", with_data(header(n_tensors=2) + tinfo(b"a", [16], F32, 0) + tinfo(b"b", [16], F32, 32),
                              b"\0" * 128), r"tensors 'a' and 'b' overlap", 96 + 32),
    case("truncated-tinfo", header(n_tensors=1) + gstr(b"t") + u32(4) + u64(8) + u64(1) + u64(1),
         r"file truncated: tensor 't' ne\[3\] needs 8 bytes, 0 remain", _T_AT + 37),
    case("no-data-section", header(n_tensors=1) + tinfo(b"t", [0], F32, 0),
         r"file truncated before the tensor data section", _T_AT + 33),
]


@pytest.mark.parametrize("data,msg,offset", CASES)
def test_hostile_file_raises_gguf_error_with_offset(tmp_path, data, msg, offset):
    p = tmp_path / "bad.gguf"
    p.write_bytes(data)
    with pytest.raises(GGUFError, match=msg) as e:
        GGUFReader(p)
    assert e.value.offset == offset, str(e.value)
    assert str(e.value) == f"{p}: {e.value.problem} (at byte {offset})"


@pytest.mark.parametrize("data", [c.values[0] for c in CASES if c.id in
                                  ("n_kv", "n_tensors", "u32-array", "string-array", "array-array", "key-length")])
def test_absurd_counts_allocate_nothing(tmp_path, data):
    p = tmp_path / "bad.gguf"
    p.write_bytes(data)
    tracemalloc.start()
    try:
        with pytest.raises(GGUFError):
            GGUFReader(p)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 256 * 1024


def test_fifo_is_refused_without_blocking(tmp_path):
    p = tmp_path / "pipe.gguf"
    os.mkfifo(p)
    with pytest.raises(GGUFError, match="not a regular file"):
        GGUFReader(p)


def test_empty_and_minimal_files(tmp_path):
    p = tmp_path / "empty.gguf"
    p.write_bytes(b"")
    with pytest.raises(GGUFError, match="too small"):
        GGUFReader(p)
    p.write_bytes(header())                     # no keys, no tensors: valid, and no data section needed
    with GGUFReader(p) as r:
        assert (r.metadata, r.tensors, r.version, r.alignment) == ({}, {}, 3, 32)
    p.write_bytes(header(version=2))
    assert GGUFReader(p).version == 2


def test_zero_size_tensors_and_empty_arrays(tmp_path):
    p = tmp_path / "z.gguf"
    p.write_bytes(with_data(header(n_tensors=2, n_kv=2) + kv(b"a", VT.ARRAY, arr(VT.STRING, 0))
                            + kv(b"b", VT.ARRAY, arr(VT.FLOAT32, 0)) + tinfo(b"z", [0, 4], Q8_0, 0)
                            + tinfo(b"y", [8], F32, 0), b"\0" * 32))
    with GGUFReader(p) as r:
        assert r.metadata["a"] == [] and r.metadata["b"].shape == (0,)
        assert r.tensors["z"].nbytes == 0 and r.tensor_array("z").shape == (4, 0)
        assert r.tensor_array("y").shape == (8,)


def test_undecoded_string_arrays(tmp_path):
    """decode_string_arrays=False (llampy quantize's reader): the keys, types, value bytes and tensors of a full
    read, arrays of strings (nested ones too) as their counts; invalid UTF-8 in them passes, a length past the end
    of the file does not."""
    from llampy.gguf.reader import UndecodedStrings
    p = tmp_path / "rich.gguf"
    p.write_bytes(_rich_file())
    with GGUFReader(p) as full, GGUFReader(p, decode_string_arrays=False) as lazy:
        assert list(lazy.metadata) == list(full.metadata) and lazy.value_types == full.value_types
        assert all(lazy.value_bytes(k) == full.value_bytes(k) for k in full.metadata)
        assert lazy.metadata["a.strings"] == UndecodedStrings(4) and len(lazy.metadata["a.strings"]) == 4
        assert lazy.metadata["a.mixed"][1] == UndecodedStrings(1)
        assert lazy.metadata["s.string"] == "héllo"
        assert [a.tolist() for a in lazy.metadata["a.nested"]] == [[1, 2], [3]]
        assert ({n: (t.type, t.ne, t.offset) for n, t in lazy.tensors.items()}
                == {n: (t.type, t.ne, t.offset) for n, t in full.tensors.items()})
    p.write_bytes(_rich_file().replace("ü".encode() * 3, b"\xff" * 6))
    with pytest.raises(GGUFError, match="invalid UTF-8"):
        GGUFReader(p)
    with GGUFReader(p, decode_string_arrays=False) as lazy:
        assert b"\xff" * 6 in lazy.value_bytes("a.strings")
    p.write_bytes(header(n_kv=1) + kv(b"k", VT.ARRAY, arr(VT.STRING, 3, gstr(b"a") + gstr(b"b") + b"\0" * 6)))
    with pytest.raises(GGUFError, match="string 2 length runs past the end of the file"):
        GGUFReader(p, decode_string_arrays=False)
    p.write_bytes(header(n_kv=1) + kv(b"k", VT.ARRAY, arr(VT.STRING, 2, gstr(b"a") + u64(99) + b"b")))
    with pytest.raises(GGUFError, match="string 1 length 99 runs past the end of the file"):
        GGUFReader(p, decode_string_arrays=False)


# ------------------------------------------------------------------------------ fuzzing
def _rich_file() -> bytes:
    """A small file with every value type, nested and mixed arrays and several tensor types: mutations of it hit
    structure (lengths, types, counts) far more often than mutations of a file that is mostly vocabulary."""
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "rich.gguf"
        w = GGUFWriter(p, alignment=64)
        w.add("general.alignment", 64, VT.UINT32)
        for vt, v in [(VT.UINT8, 200), (VT.INT8, -5), (VT.UINT16, 60000), (VT.INT16, -300), (VT.UINT32, 7),
                      (VT.INT32, -7), (VT.FLOAT32, 0.5), (VT.BOOL, True), (VT.STRING, "héllo"),
                      (VT.UINT64, 2**40), (VT.INT64, -2**40), (VT.FLOAT64, 1e-300)]:
            w.add(f"s.{vt.name.lower()}", v, vt)
            if vt != VT.STRING:
                w.add(f"a.{vt.name.lower()}", np.array([v, v], dtype=np.float64 if isinstance(v, float) else None)
                      if vt != VT.BOOL else [True, False, True], (VT.ARRAY, vt))
        w.add("a.strings", ["a", "", "ü" * 3, "<|x|>"])
        w.add("a.nested", [[1, 2], [3]], (VT.ARRAY, VT.ARRAY, VT.INT32))
        w.add("a.mixed", [np.array([1.5], np.float32), ["s"]])
        rng = np.random.default_rng(0)
        w.add_tensor("f32", rng.standard_normal((3, 8)).astype(np.float32))
        w.add_tensor("f16", rng.standard_normal(16).astype(np.float16))
        w.add_tensor_raw("q8", GGMLType.Q8_0, (32, 2), rng.integers(0, 256, 68, dtype=np.uint8))
        w.add_tensor_raw("q4k", GGMLType.Q4_K, (256,), rng.integers(0, 256, 144, dtype=np.uint8))
        w.add_tensor_raw("bf16", GGMLType.BF16, (4, 1, 1, 2), rng.integers(0, 256, 16, dtype=np.uint8))
        w.add_tensor("i8", np.arange(5, dtype=np.int8))
        w.write()
        return p.read_bytes()


RICH = _rich_file()
_TMP = Path(tempfile.mkdtemp(prefix="llampy-gguf-fuzz-"))


def _open_or_gguf_error(data: bytes, name: str = "f.gguf"):
    """The property: opening gives a consistent reader or a GGUFError; anything else fails the test."""
    p = _TMP / name
    p.write_bytes(data)
    try:
        r = GGUFReader(p)
    except GGUFError as e:
        assert e.path == str(p) and e.problem
        return None
    for t in r.tensors.values():
        assert r.data_offset <= t.offset and t.offset + t.nbytes <= len(data) and t.data.nbytes == t.nbytes
        r.tensor_array(t.name)
    return r


edits = st.lists(st.tuples(st.integers(0, len(RICH) - 1), st.integers(0, 255)), min_size=1, max_size=6)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(edits, st.one_of(st.none(), st.integers(0, len(RICH))))
def test_fuzz_rich_file(edits, cut):
    data = bytearray(RICH)
    for pos, val in edits:
        data[pos] = val
    r = _open_or_gguf_error(bytes(data[:cut]))
    if r is not None:
        # whatever opens can be written back, and that copy reads back to itself byte for byte
        a, b = _TMP / "a.gguf", _TMP / "b.gguf"
        copy_gguf(r, a)
        copy_gguf(GGUFReader(a), b)
        assert a.read_bytes() == b.read_bytes()


def _regions(path: Path):
    """(data, end of the header region, where the tensor infos start) of a real file."""
    data = path.read_bytes()
    with GGUFReader(path) as r:
        first = next(iter(r.tensors))
        t0 = data.index(gstr(first.encode()))
        return data, r.data_offset, t0


@pytest.fixture(scope="module")
def tiny_regions():
    return [_regions(p) for p in TINY_FILES[:4]]


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_fuzz_tiny_fixture_headers(tiny_regions, data):
    raw, end, t0 = data.draw(st.sampled_from(tiny_regions))
    pos = st.one_of(st.integers(0, 1024), st.integers(max(0, t0 - 64), end - 1), st.integers(0, end - 1))
    edit = data.draw(st.lists(st.tuples(pos, st.integers(0, 255)), min_size=1, max_size=4))
    buf = bytearray(raw)
    for p, v in edit:
        buf[p] = v
    if data.draw(st.booleans()):
        buf = buf[:data.draw(st.integers(0, len(buf)))]
    _open_or_gguf_error(bytes(buf))


@pytest.fixture(scope="module")
def smollm2_header(smollm2_file):
    raw, end, t0 = _regions(smollm2_file)
    return raw[:end + 65536], end, t0   # the header region and a little data: every tensor past it is out of bounds


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_fuzz_smollm2_header_copy(smollm2_header, data):
    raw, end, t0 = smollm2_header
    buf = bytearray(raw)
    for p, v in data.draw(st.lists(st.tuples(st.one_of(st.integers(0, 4096), st.integers(t0 - 64, end - 1)),
                                             st.integers(0, 255)), max_size=4)):
        buf[p] = v
    if data.draw(st.booleans()):
        buf = buf[:data.draw(st.one_of(st.integers(0, len(buf)), st.integers(t0 - 64, len(buf))))]
    _open_or_gguf_error(bytes(buf), "s.gguf")
