"""GGUF reader: agreement with gguf-py (the oracle) on every key and tensor, zero-copy views (open times: benchmarks/gguf_open.py)."""
from __future__ import annotations


import gguf
import numpy as np
import pytest

from llampy.ggml.types import GGMLType
from llampy.gguf import GGUFError, GGUFReader, GGUFValueType as VT, TensorInfo

from .conftest import TINY_FILES


def assert_same_as_gguf_py(ours: GGUFReader, theirs: gguf.GGUFReader) -> None:
    """Every key (value, value type, order) and every tensor (type, shape, offset, size, bytes, typed view)."""
    fields = [f for f in theirs.fields.values() if not f.name.startswith("GGUF.")]
    assert list(ours.metadata) == [f.name for f in fields]
    for f in fields:
        ov, tv = ours.metadata[f.name], f.contents()
        assert ours.value_types[f.name] == tuple(VT(int(t)) for t in f.types), f.name
        if isinstance(ov, np.ndarray):
            assert ov.ndim == 1 and not ov.flags.writeable, f.name
            assert ov.dtype.kind == ("b" if f.types[-1] == gguf.GGUFValueType.BOOL else ov.dtype.kind)
            np.testing.assert_array_equal(ov, np.asarray(tv), err_msg=f.name)
        else:
            assert type(ov) is type(tv) and ov == tv, f.name
    assert ours.version == theirs.fields["GGUF.version"].contents()
    assert ours.alignment == theirs.alignment and ours.data_offset == theirs.data_offset
    assert list(ours.tensors) == [t.name for t in theirs.tensors]
    for t in theirs.tensors:
        o = ours.tensors[t.name]
        assert o.type == GGMLType(int(t.tensor_type)), t.name
        assert o.ne == tuple(int(x) for x in t.shape), t.name
        assert (o.offset, o.nbytes) == (t.data_offset, t.n_bytes), t.name
        assert o.data.dtype == np.uint8 and o.data.shape == (o.nbytes,) and not o.data.flags.writeable
        arr, expect = ours.tensor_array(t.name), t.data
        if o.type == GGMLType.BF16:   # ours: the uint16 bits shaped reversed(ne); gguf-py: raw bytes
            arr, expect = arr.reshape(-1).view(np.uint8), expect.reshape(-1).view(np.uint8)
        elif o.type.name not in ("F32", "F16", "F64", "I8", "I16", "I32", "I64"):
            # block types: gguf-py keeps the leading dims; ours is [n_rows, row_bytes] whatever n_dims
            expect = expect.reshape(-1, expect.shape[-1])
        assert arr.shape == expect.shape and arr.dtype == expect.dtype, t.name
        np.testing.assert_array_equal(arr, expect, err_msg=t.name)


@pytest.mark.parametrize("path", TINY_FILES, ids=lambda p: p.name)
def test_tiny_fixtures_match_gguf_py(path):
    with GGUFReader(path) as ours:
        assert_same_as_gguf_py(ours, gguf.GGUFReader(path))


def test_smollm2_matches_gguf_py(smollm2_file):
    with GGUFReader(smollm2_file) as ours:
        assert_same_as_gguf_py(ours, gguf.GGUFReader(smollm2_file))
        assert len(ours.tensors) == 272 and len(ours.get("tokenizer.ggml.tokens")) == 49152
        assert ours.get("tokenizer.ggml.merges")[0] == "Ġ t"


@pytest.mark.slow  # gguf-py alone takes ~9 s to open it
def test_gemma3_matches_gguf_py(gemma3_file):
    with GGUFReader(gemma3_file) as ours:
        assert_same_as_gguf_py(ours, gguf.GGUFReader(gemma3_file))
        assert {t.type for t in ours.tensors.values()} >= {GGMLType.Q5_0, GGMLType.Q4_K, GGMLType.Q6_K}


def test_views_are_zero_copy_and_typed(smollm2_file):
    with GGUFReader(smollm2_file) as r:
        scores = r.get("tokenizer.ggml.token_type")
        assert isinstance(scores, np.ndarray) and scores.dtype == np.int32 and not scores.flags.owndata
        info = r.tensors["token_embd.weight"]
        assert isinstance(info, TensorInfo) and info.type == GGMLType.Q8_0 and info.ne == (576, 49152)
        q = r.tensor_array("token_embd.weight")
        assert q.shape == (49152, 576 // 32 * 34) and q.dtype == np.uint8
        assert np.shares_memory(q, info.data)
        norm = r.tensor_array("blk.0.attn_norm.weight")
        assert norm.dtype == np.float32 and norm.shape == (576,)
        assert norm.ctypes.data == np.frombuffer(r._mm, np.uint8).ctypes.data + r.tensors["blk.0.attn_norm.weight"].offset
        assert r.get("no.such.key", 7) == 7
        assert isinstance(r.get("llama.block_count"), int) and isinstance(r.get("llama.rope.freq_base"), float)
        assert r.get("tokenizer.ggml.add_bos_token") is False
        assert r.data_offset % r.alignment == 0 and r.file_size == smollm2_file.stat().st_size
        with pytest.raises(ValueError):
            norm[0] = 1.0   # read-only mapping


def test_close_keeps_handed_out_views_valid(smollm2_file):
    r = GGUFReader(smollm2_file)
    norm = r.tensor_array("blk.0.attn_norm.weight")
    expect = norm.copy()
    r.close()
    np.testing.assert_array_equal(norm, expect)   # the mapping stays while a view holds it
    assert r.tensors == {} or all(t.data is None for t in r.tensors.values())


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(GGUFError, match="cannot open: No such file") as e:
        GGUFReader(tmp_path / "nope.gguf")
    assert str(e.value).startswith(str(tmp_path / "nope.gguf") + ": ")
    with pytest.raises(GGUFError, match="not a regular file"):
        GGUFReader(tmp_path)
