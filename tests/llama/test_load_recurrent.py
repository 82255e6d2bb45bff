"""Loading state-space models: the errors llama.cpp gives for files it cannot run, and what it accepts."""
from __future__ import annotations

import json

import pytest

from llampy.gguf import GGUFReader
from llampy.gguf.writer import GGUFWriter
from llampy.llama.arch import UnknownArchitecture
from llampy.llama.hparams import MissingMetadata
from llampy.llama.model import Model, ModelLoadError

from tests.llama.tiny_recurrent import gguf


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return {n: gguf(n, tmp_path_factory) for n in ("mamba-s128-Q8_0", "mamba2-s16-g2-Q8_0", "rwkv7-h32-Q8_0",
                                                   "lfm2-c3-Q8_0", "qwen3next-s64-legacy-Q8_0",
                                                   "rwkv6qwen2-h16-Q8_0")}


def _rewrite(src, dst, drop=(), set_=None, drop_tensors=()):
    """A copy of the GGUF ``src`` with keys dropped or replaced (same value type) and tensors left out."""
    r = GGUFReader(src)
    w = GGUFWriter(dst)
    for k, v in r.metadata.items():
        if k in drop or k == "general.alignment":
            continue
        w.add(k, (set_ or {}).get(k, v), r.value_types[k])
    for name, t in r.tensors.items():
        if name not in drop_tensors:
            w.add_tensor_raw(name, t.type, t.ne, t.data)
    w.write()
    r.close()
    return dst


@pytest.mark.parametrize("key", ["ssm.conv_kernel", "ssm.inner_size", "ssm.state_size", "ssm.time_step_rank",
                                 "ssm.group_count", "attention.layer_norm_rms_epsilon"])
def test_missing_ssm_key_is_named(built, tmp_path, key):
    path = _rewrite(built["mamba2-s16-g2-Q8_0"], tmp_path / "m.gguf", drop=(f"mamba2.{key}",))
    with pytest.raises(MissingMetadata, match=f"mamba2.{key}"):
        Model(path)


def test_mamba_inner_size_must_be_twice_the_width(built, tmp_path):
    path = _rewrite(built["mamba-s128-Q8_0"], tmp_path / "m.gguf", set_={"mamba.ssm.inner_size": 96})
    with pytest.raises(ModelLoadError, match="only an expansion factor of 2 is supported for now"):
        Model(path)


def test_missing_ssm_tensor_is_named(built, tmp_path):
    path = _rewrite(built["mamba-s128-Q8_0"], tmp_path / "m.gguf", drop_tensors=("blk.1.ssm_a",))
    with pytest.raises(ModelLoadError, match="blk.1.ssm_a"):
        Model(path)


def test_unsupported_recurrent_architecture_is_named(built, tmp_path):
    path = _rewrite(built["mamba2-s16-g2-Q8_0"], tmp_path / "m.gguf", set_={"general.architecture": "plamo2"})
    with pytest.raises(UnknownArchitecture, match="plamo2"):
        Model(path)


def test_state_per_sequence_is_llama_cpps(built):
    m = Model(built["mamba2-s16-g2-Q8_0"])
    hp = m.hparams
    # llama.cpp: n_embd_r = (d_conv - 1) * (d_inner + 2 n_group d_state), n_embd_s = d_state * d_inner
    assert hp.n_embd_r() == 3 * (128 + 2 * 2 * 16) and hp.n_embd_s() == 16 * 128
    assert all(hp.is_recurrent(il) for il in range(hp.n_layer))


@pytest.mark.parametrize("name,key", [("rwkv7-h32-Q8_0", "rwkv7.wkv.head_size"),
                                      ("rwkv7-h32-Q8_0", "rwkv7.attention.decay_lora_rank"),
                                      ("lfm2-c3-Q8_0", "lfm2.shortconv.l_cache"),
                                      ("qwen3next-s64-legacy-Q8_0", "qwen3next.ssm.group_count"),
                                      ("qwen3next-s64-legacy-Q8_0", "qwen3next.expert_count"),
                                      ("rwkv6qwen2-h16-Q8_0", "rwkv6qwen2.time_mix_extra_dim")])
def test_missing_wkv_or_shortconv_key_is_named(built, tmp_path, name, key):
    path = _rewrite(built[name], tmp_path / "m.gguf", drop=(key,))
    with pytest.raises(MissingMetadata, match=key):
        Model(path)


def test_rwkv_and_shortconv_state_sizes_are_llama_cpps(built):
    hp = Model(built["rwkv7-h32-Q8_0"]).hparams
    # llama.cpp: RWKV n_embd_r = token_shift_count * n_embd, n_embd_s = n_embd * head_size
    assert hp.n_embd_r() == 2 * 64 and hp.n_embd_s() == 64 * 32
    hp = Model(built["lfm2-c3-Q8_0"]).hparams
    # LFM2: n_embd_r = n_embd * (l_cache - 1), no state row; attention on the layers with KV heads
    assert hp.n_embd_r() == 64 * 2 and hp.n_embd_s() == 0
    assert [hp.is_recurrent(il) for il in range(4)] == [True, True, False, True]


def test_gated_deltanet_state_sizes_and_layers_are_llama_cpps(built):
    hp = Model(built["qwen3next-s64-legacy-Q8_0"]).hparams
    # llama.cpp: n_embd_r = (d_conv - 1) * (d_inner + 2 n_group d_state), n_embd_s = d_state * d_inner; the layers
    # from attention.recurrent_layers
    assert hp.n_embd_r() == 2 * (128 + 2 * 2 * 64) and hp.n_embd_s() == 64 * 128
    assert [hp.is_recurrent(il) for il in range(3)] == [True, False, True]
    assert [hp.has_kv(il) for il in range(3)] == [False, True, False]
    hp = Model(built["rwkv6qwen2-h16-Q8_0"]).hparams
    assert hp.n_embd_r() == 64 and hp.n_embd_s() == 64 * 16          # one token-shift row


def test_qwen3next_value_heads_must_be_state_sized(built, tmp_path):
    path = _rewrite(built["qwen3next-s64-legacy-Q8_0"], tmp_path / "m.gguf", set_={"qwen3next.ssm.inner_size": 96})
    with pytest.raises(ValueError, match="ssm.inner_size 96"):
        Model(path)


def test_inspect_reports_the_state_per_sequence(built, capsys):
    from llampy.cli import main
    # mamba2-s16-g2: 2 layers of (3 * (128 + 2 * 2 * 16) + 16 * 128) floats; lfm2-c3: 3 convolution layers of
    # 64 * 2 floats (the attention layer holds none)
    for name, want in (("mamba2-s16-g2-Q8_0", 2 * 4 * (3 * 192 + 16 * 128)), ("lfm2-c3-Q8_0", 3 * 4 * 128)):
        assert main(["inspect", str(built[name])]) == 0
        assert f"recurrent state per sequence: {want} bytes" in capsys.readouterr().out
        assert main(["inspect", str(built[name]), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["recurrent_state_bytes_per_seq"] == want
