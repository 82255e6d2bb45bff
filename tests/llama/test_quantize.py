"""llampy quantize against llama-quantize, byte for byte, on small random-weight GGUFs (n_embd 256, so the 256-value
k-quant blocks fit) and on the tiny llama fixture (n_embd 64: every k-quant falls back); with and without an imatrix.
Plus the mixing rules on their own, and the imatrix formats."""
from __future__ import annotations

import subprocess

import numpy as np
import pytest

from llampy.cli import main
from llampy.gguf.constants import GGUFValueType as VT
from llampy.gguf.reader import GGUFReader
from llampy.gguf.writer import GGUFWriter
from llampy.ggml.types import GGMLType as T
from llampy.llama.imatrix import IMatrix, quantize_weights, read_imatrix, write_imatrix
from llampy.llama.quant import QuantizeParams, QuantizeState, tensor_get_type, weights_order
from tests import llamacpp
from tests.paths import ROOT

TINY = ROOT.parent / "shared" / "fixtures" / "tiny" / "llama-F32.gguf"


def write_random_llama(path, n_embd=256, n_ff=512, n_layer=4, n_head=4, n_head_kv=1, n_vocab=512, seed=0,
                       dtype=np.float32, tied=False, file_type=0):
    rng = np.random.default_rng(seed)
    w = GGUFWriter(path)
    w.add("general.architecture", "llama")
    w.add("general.name", "random")
    if file_type is not None:
        w.add("general.file_type", file_type, VT.UINT32)
    for k, v in (("block_count", n_layer), ("context_length", 256), ("embedding_length", n_embd),
                 ("feed_forward_length", n_ff), ("attention.head_count", n_head),
                 ("attention.head_count_kv", n_head_kv), ("vocab_size", n_vocab)):
        w.add(f"llama.{k}", v, VT.UINT32)
    w.add("llama.attention.layer_norm_rms_epsilon", 1e-5, VT.FLOAT32)
    hd = n_embd // n_head

    def t(name, *shape):
        w.add_tensor(name, (rng.standard_normal(shape) * 0.05).astype(dtype))
    t("token_embd.weight", n_vocab, n_embd)
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, np.float32))
        t(f"blk.{i}.attn_q.weight", n_embd, n_embd)
        t(f"blk.{i}.attn_k.weight", hd * n_head_kv, n_embd)
        t(f"blk.{i}.attn_v.weight", hd * n_head_kv, n_embd)
        t(f"blk.{i}.attn_output.weight", n_embd, n_embd)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, np.float32))
        t(f"blk.{i}.ffn_gate.weight", n_ff, n_embd)
        t(f"blk.{i}.ffn_up.weight", n_ff, n_embd)
        t(f"blk.{i}.ffn_down.weight", n_embd, n_ff)
    w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    if not tied:
        t("output.weight", n_vocab, n_embd)
    w.write()


def write_random_imatrix(model, path, seed=1):
    r = GGUFReader(model)
    rng = np.random.default_rng(seed)
    im = IMatrix(datasets=["random.txt"], chunk_count=3, chunk_size=128)
    for n, t in r.tensors.items():
        if len(t.ne) >= 2 and n.startswith("blk."):
            im.entries[n] = ((rng.random(t.ne[0]) * 5 + 0.1).astype(np.float32) * 384, np.array([384]))
    r.close()
    write_imatrix(path, im)


def _reference(tool, args):
    p = subprocess.run([tool, *args], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]


def _ours(args):
    assert main(["quantize", "--progress", "off", *args]) == 0


@pytest.fixture(scope="module")
def tool():
    t = llamacpp.llama_quantize()
    if t is None:
        llamacpp.missing("llama-quantize")
    return t


@pytest.fixture(scope="module")
def rand_model(tmp_path_factory):
    p = tmp_path_factory.mktemp("q") / "rand.gguf"
    write_random_llama(p)
    return p


FAST = ["Q4_0", "Q5_1", "Q8_0", "Q4_K_M", "Q6_K", "F16", "BF16"]
MORE = ["Q4_1", "Q5_0", "Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q5_K_S", "Q5_K_M", "IQ4_NL", "IQ4_XS",
        "TQ1_0", "TQ2_0", "Q1_0", "Q2_0", "MXFP4_MOE", "F32", "COPY"]


@pytest.mark.parametrize("ftype", FAST)
def test_same_bytes_as_llama_quantize(tool, rand_model, tmp_path, ftype):
    ref, ours = tmp_path / "ref.gguf", tmp_path / "ours.gguf"
    _reference(tool, [str(rand_model), str(ref), ftype, "2"])
    _ours([str(rand_model), str(ours), ftype, "2"])
    assert ours.read_bytes() == ref.read_bytes()


@pytest.mark.slow
@pytest.mark.parametrize("ftype", MORE)
def test_same_bytes_every_type(tool, rand_model, tmp_path, ftype):
    ref, ours = tmp_path / "ref.gguf", tmp_path / "ours.gguf"
    _reference(tool, [str(rand_model), str(ref), ftype, "2"])
    _ours([str(rand_model), str(ours), ftype, "2"])
    assert ours.read_bytes() == ref.read_bytes()


@pytest.mark.parametrize("opts", [["--pure"], ["--leave-output-tensor"], ["--output-tensor-type", "q8_0"],
                                  ["--token-embedding-type", "q4_k", "--tensor-type", "ffn_down=q5_0"],
                                  ["--override-kv", "general.name=str:renamed"]])
def test_same_bytes_with_options(tool, rand_model, tmp_path, opts):
    ref, ours = tmp_path / "ref.gguf", tmp_path / "ours.gguf"
    _reference(tool, [*opts, str(rand_model), str(ref), "Q4_K_M", "2"])
    _ours([*opts, str(rand_model), str(ours), "Q4_K_M", "2"])
    assert ours.read_bytes() == ref.read_bytes()


def test_same_bytes_tiny_fixture_fallbacks(tool, tmp_path):
    """n_embd 64: k-quants fall back to Q5_0/Q8_0, the tied output rule picks token_embd's type."""
    ref, ours = tmp_path / "ref.gguf", tmp_path / "ours.gguf"
    _reference(tool, [str(TINY), str(ref), "Q4_K_M", "2"])
    _ours([str(TINY), str(ours), "Q4_K_M", "2"])
    assert ours.read_bytes() == ref.read_bytes()


@pytest.mark.parametrize("ftype,kernels", [("Q5_K_M", None), ("BF16", None), ("F32", False), ("F32", True),
                                          ("COPY", None)])
def test_same_bytes_from_f16_and_tied(tool, tmp_path, monkeypatch, ftype, kernels):
    """An F16 model without general.file_type (a COPY writes llama_model_loader's guess, MOSTLY_F16 | GUESSED): F16
    rows go to F32 and BF16 straight into the output (by NumPy's table lookups, or Numba's conversion when the
    kernels run the file: ``kernels`` forces either)."""
    if kernels is not None:
        from llampy.llama import quant
        monkeypatch.setattr(quant, "_NUMPY_UNITS_PER_THREAD", 0 if kernels else 10**15)
    src, ref, ours = tmp_path / "f16.gguf", tmp_path / "ref.gguf", tmp_path / "ours.gguf"
    write_random_llama(src, n_layer=2, dtype=np.float16, tied=True, seed=3, file_type=None)
    _reference(tool, [str(src), str(ref), ftype, "2"])
    _ours([str(src), str(ours), ftype, "2"])
    assert ours.read_bytes() == ref.read_bytes()


@pytest.mark.parametrize("ftype", ["Q4_0", "Q5_0", "Q8_0", "Q4_1", "Q5_1", "Q2_K", "Q2_K_S", "Q3_K_M", "Q4_K_M",
                                   "Q5_K_S", "Q6_K"])
def test_same_bytes_with_imatrix(tool, rand_model, tmp_path, ftype):
    im, ref, ours = tmp_path / "im.gguf", tmp_path / "ref.gguf", tmp_path / "ours.gguf"
    write_random_imatrix(rand_model, im)
    _reference(tool, ["--imatrix", str(im), str(rand_model), str(ref), ftype, "2"])
    _ours(["--imatrix", str(im), str(rand_model), str(ours), ftype, "2"])
    assert ours.read_bytes() == ref.read_bytes()
    assert GGUFReader(ours).get("quantize.imatrix.entries_count") == 28


# ------------------------------------------------------------------------------------------------ without llama.cpp

def _types(names_ne, ftype, **kw):
    meta = {"general.architecture": "llama", "llama.block_count": 8, "llama.attention.head_count": 32,
            "llama.attention.head_count_kv": 8}
    names = weights_order([n for n, _ in names_ne])
    p = QuantizeParams(ftype=ftype, **kw)
    qs = QuantizeState(meta, p, names)
    from llampy.llama.quant import FTYPE_DEFAULT
    ne = dict(names_ne)
    return {n: tensor_get_type(qs, n, T.F32, ne[n], FTYPE_DEFAULT[ftype]) for n in names}


def test_mixture_rules_q4_k_m():
    names = [("token_embd.weight", (4096, 1000)), ("output.weight", (4096, 1000))]
    for i in range(8):
        names += [(f"blk.{i}.attn_v.weight", (4096, 1024)), (f"blk.{i}.ffn_down.weight", (11008 // 256 * 256, 4096)),
                  (f"blk.{i}.attn_q.weight", (4096, 4096))]
    t = _types(names, 15)
    assert t["output.weight"] == T.Q6_K and t["token_embd.weight"] == T.Q4_K
    # use_more_bits(i, 8): layers 0, 7 and every third from 1 + 2
    assert [t[f"blk.{i}.ffn_down.weight"] for i in range(8)] == [T.Q6_K, T.Q4_K, T.Q4_K, T.Q6_K, T.Q4_K, T.Q4_K,
                                                                 T.Q6_K, T.Q6_K]
    assert t["blk.3.attn_q.weight"] == T.Q4_K


def test_imatrix_roundtrip_and_normalisation(tmp_path):
    im = IMatrix(datasets=["a.txt"], chunk_count=2, chunk_size=64)
    im.entries["blk.0.ffn_down.weight"] = (np.arange(8, dtype=np.float32), np.array([4, 0]))
    p = tmp_path / "im.gguf"
    write_imatrix(p, im)
    back = read_imatrix(p)
    assert back.has_metadata and back.datasets == ["a.txt"] and back.chunk_count == 2 and back.chunk_size == 64
    s, c = back.entries["blk.0.ffn_down.weight"]
    assert s.tolist() == list(range(8)) and c.tolist() == [4, 0]
    w = quantize_weights(back)["blk.0.ffn_down.weight"]
    assert w.tolist() == [0, 0.25, 0.5, 0.75, 1, 1, 1, 1]   # an expert that saw no token weighs 1


@pytest.mark.parametrize("t", [T.Q8_0, T.Q4_0, T.Q5_0, T.Q4_1, T.Q5_1, T.Q1_0, T.Q2_0, T.TQ1_0, T.TQ2_0])
def test_row_quantizers_match_reference(t):
    """quants_rows (the Numba loops quantize runs) against quants.quantize, ties and zero blocks included."""
    from llampy.ggml.quants import quantize
    from llampy.ggml.quants_rows import quantize_rows_ref
    x = (np.random.default_rng(5).standard_normal((64, 256)) * 0.05).astype(np.float32)
    x[0, :32] = 0
    x[1, :32] = 1
    x[2, 5] = -3
    x[3, 32:64] = np.float32(0.5)
    x[4, :32] = np.linspace(-1, 1, 32, dtype=np.float32)
    assert (quantize_rows_ref(x, t) == quantize(x, t)).all()


def test_f16_rows_to_f32_every_bit_pattern():
    """quantize's fp16 -> float32 kernel on all 65536 patterns: NumPy's cast bit for bit (subnormals, infinities,
    NaN payloads)."""
    from llampy.ggml.quants_rows import f16_to_f32
    h = np.arange(65536, dtype=np.uint16)
    out = np.empty(65536, np.float32)
    f16_to_f32(h, out)
    cast = h.view(np.float16).astype(np.float32)
    assert np.array_equal(out.view(np.uint32), cast.view(np.uint32))
    # NumPy's lookups (quantize without Numba; BF16 either way): the same float32 bits, and to BF16 what gguf-py's
    # statement of ggml_compute_fp32_to_bf16 gives for the float32 (llama-quantize's route)
    import gguf
    from llampy.ggml import quants_np
    out[:] = 0
    quants_np.f16_to_f32(h, out)
    assert np.array_equal(out.view(np.uint32), cast.view(np.uint32))
    bf = np.empty(65536, np.uint16)
    quants_np.f16_to_bf16(h, bf)
    np.testing.assert_array_equal(bf, np.asarray(gguf.quants.quantize(cast, gguf.GGMLQuantizationType.BF16))
                                  .view(np.uint16))


def test_q2_k_s_needs_an_imatrix(rand_model, tmp_path, capsys):
    assert main(["quantize", "--progress", "off", str(rand_model), str(tmp_path / "o.gguf"), "Q2_K_S", "1"]) == 1
    assert "requires an importance matrix" in capsys.readouterr().err


def test_quantize_command_pauses_and_restores_the_collector(rand_model, tmp_path, monkeypatch):
    """The command pauses the garbage collector during its start-up and resumes it after the first tensor (its
    start-up objects frozen); it leaves the collector as it found it, after a run, a failure or bad arguments."""
    import gc
    from llampy import tuning
    states = []
    resume = tuning.start_up_gc.resume

    def spy(self):
        states.append(gc.isenabled())
        resume(self)
        states.append((gc.isenabled(), gc.get_freeze_count() > 0))
    monkeypatch.setattr(tuning.start_up_gc, "resume", spy)
    args = ["quantize", "--progress", "off", str(rand_model), str(tmp_path / "o.gguf")]
    # an earlier test in this process may have left objects frozen (a Llama installs the process tuning, whose
    # contexts freeze each new graph's objects): start from none frozen, and freeze them again at the end
    was_frozen = gc.get_freeze_count() > 0
    gc.unfreeze()
    try:
        _collector_cases(main, args, states, monkeypatch)
    finally:
        gc.unfreeze()
        if was_frozen:
            gc.freeze()


def _collector_cases(main, args, states, monkeypatch):
    import gc
    assert gc.isenabled() and gc.get_freeze_count() == 0
    assert main(args + ["Q8_0", "1"]) == 0
    assert states == [False, (True, True)]
    assert gc.isenabled() and gc.get_freeze_count() == 0
    assert main(args + ["Q2_K_S", "1"]) == 1        # fails before any tensor
    with pytest.raises(SystemExit):
        main(["quantize", "--no-such-option"])
    assert gc.isenabled() and gc.get_freeze_count() == 0
    gc.disable()
    try:
        assert main(args + ["Q8_0", "1"]) == 0
        assert not gc.isenabled()
    finally:
        gc.enable()
    # the process's own command (main() without arguments): everything frozen at the end, and the process ended
    # there by os._exit with the command's status (its shutdown skipped)
    monkeypatch.setattr("sys.argv", ["llampy"] + args + ["Q8_0", "1"])

    class Exit(BaseException):
        pass

    def _exit(rc):
        raise Exit(rc)
    monkeypatch.setattr("os._exit", _exit)
    with pytest.raises(Exit) as e:
        main()
    assert e.value.args == (0,)
    assert gc.isenabled() and gc.get_freeze_count() > 0


def test_numpy_rows_match_reference():
    """quants_np (the conversions quantize runs without Numba) against quants.quantize, ties and zero blocks
    included; its rounding against roundf on every float32 within 2000 steps of each integer and half to 128."""
    from llampy.ggml.quants import quantize
    from llampy.ggml.quants_base import roundf
    from llampy.ggml.quants_np import _HALF_DOWN, quantize_rows
    x = (np.random.default_rng(6).standard_normal((64, 256)) * 0.05).astype(np.float32)
    x[0, :32] = 0
    x[1, :32] = 1
    x[2, 5] = -3
    x[3, 32:64] = np.linspace(-127, 127, 32, dtype=np.float32)     # x * id lands on halves and integers
    x[4, :2] = [np.float32(0.49999997), np.float32(127)]
    x[5, :4] = [np.float32(1e-30), np.float32(7e4), -np.float32(3e38), np.float32(2.5)]
    x[6, :32] = -2.0                                                # ties of the largest magnitude: the first wins
    x[6, 7] = 2.0
    x[7, 64:96] = np.arange(32, dtype=np.float32) - 16              # levels on exact halves, the top one clamped
    x[8, 96:128] = np.float32(3e-8) * np.arange(32, dtype=np.float32)  # a scale that is subnormal in fp16
    for t in (T.Q8_0, T.F16, T.BF16, T.F32, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1):
        ref = x.view(np.uint8) if t == T.F32 else quantize(x, t)    # 7e4 and 3e38 overflow fp16 to inf
        out = np.empty_like(ref)
        quantize_rows(x, t, out)
        assert (out == ref).all(), t.name
    marks = np.concatenate([np.arange(129, dtype=np.float32), np.arange(128, dtype=np.float32) + np.float32(0.5)])
    v = (marks.view(np.int32)[:, None] + np.arange(-2000, 2000, dtype=np.int32)).reshape(-1).view(np.float32)
    v = np.concatenate([v, -v])
    v = v[np.abs(v) <= 128]
    assert (np.trunc(v + np.copysign(_HALF_DOWN, v)) == roundf(v)).all()
    # BF16 on every kind of float32 (NaNs of both signs and any payload, infinities, subnormals, the rounding
    # carry into the exponent) against gguf-py's statement of ggml_compute_fp32_to_bf16
    import gguf
    bits = np.random.default_rng(7).integers(0, 2**32, (64, 256), dtype=np.uint64).astype(np.uint32)
    bits[0, :8] = [0x7F800001, 0xFFFFFFFF, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0x3F80FFFF, 0x00008000, 0x80018000]
    x = bits.view(np.float32)
    out = np.empty((64, 512), np.uint8)
    quantize_rows(x, T.BF16, out)
    theirs = np.asarray(gguf.quants.quantize(x, gguf.GGMLQuantizationType.BF16)).view(np.uint16)
    np.testing.assert_array_equal(out.view(np.uint16), theirs)


def test_plain_types_without_numba(tmp_path, monkeypatch):
    """A file of F32/F16/BF16/Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 tensors only is converted without importing Numba (its
    start-up would cost more than the conversion), to the bytes the Numba kernels write."""
    import sys
    from llampy.llama import quant
    src = tmp_path / "f16.gguf"
    write_random_llama(src, n_layer=1, dtype=np.float16)
    for opts in (["Q8_0"], ["BF16"], ["--pure", "Q5_1"]):           # --pure: output.weight Q5_1 too, not Q6_K
        ours = tmp_path / f"np-{opts[-1]}.gguf"
        args = ["quantize", "--progress", "off", *opts[:-1], str(src), str(ours), opts[-1], "2"]
        code = (f"import sys; from llampy.cli import main; rc = main({args!r}); "
                "assert rc == 0; assert 'numba' not in sys.modules, 'numba imported'")
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
        assert p.returncode == 0, p.stderr[-2000:]
        monkeypatch.setattr(quant, "_NUMPY_UNITS_PER_THREAD", 0)    # the same file through the Numba kernels
        _ours([*opts[:-1], str(src), str(tmp_path / "kernels.gguf"), opts[-1], "2"])
        monkeypatch.undo()
        assert ours.read_bytes() == (tmp_path / "kernels.gguf").read_bytes(), opts


def test_kernel_types_named_without_numba():
    """quants_np's names for what the kernels quantize (read when a file is planned, before Numba loads) are
    those of the kernel modules."""
    from llampy.ggml.quants import QUANTIZE_TYPES
    from llampy.ggml.quants_iq_search import REQUIRES_IMATRIX, SEARCH_TYPES
    from llampy.ggml.quants_np import KERNEL_NEEDS_IMATRIX, KERNEL_TYPES
    assert KERNEL_TYPES == QUANTIZE_TYPES | SEARCH_TYPES | {T.F32}
    assert KERNEL_NEEDS_IMATRIX == REQUIRES_IMATRIX


_HELPER_RUN = """
import sys
from llampy.llama import quant
n = [0]
takes = quant._Helper.takes
def counted(self, i):
    r = takes(self, i)
    n[0] += r
    return r
quant._Helper.takes = counted
if sys.argv[3] == "fail":
    def fail(*a):
        raise OSError("disk full")
    quant._helper_run = fail
p = quant.QuantizeParams(ftype=quant.parse_ftype(sys.argv[3] if sys.argv[3] != "fail" else "Q4_0")[0], nthread=2)
try:
    quant.quantize_model(sys.argv[1], sys.argv[2], p, own_process=True)
except quant.QuantizeError as e:
    print("error", e)
from numba.core import entrypoints
from numba.core.runtime import nrtdynmod
nrt = nrtdynmod.compile_nrt_functions.__module__ == "llampy.ggml.backends.cpu.nrt_cache"
print("numba" in sys.modules, n[0], "yaml" in sys.modules, entrypoints._already_initialized,
      nrt and "llampy.ggml.backends.cpu" not in sys.modules)
"""


def test_helper_process_converts_while_numba_loads(tool, tmp_path):
    """In a process that has not loaded Numba, a forked helper converts the first tensors NumPy can while the
    kernels load, writing them into the output at their places: the file is llama-quantize's, byte for byte (the
    tied token_embd.weight goes to Q6_K, which needs the kernels; every other matrix can go to the helper). A helper
    that fails fails the command, and leaves no file. Numba came as ``tuning.lean_numba`` brings it: without PyYAML,
    without running the installed packages' Numba extensions, its runtime module from the cache (nrt_cache,
    without importing the cpu backend)."""
    import sys
    src = tmp_path / "f16.gguf"
    write_random_llama(src, n_layer=2, dtype=np.float16, tied=True, seed=5)
    for ftype in ("Q4_0",):
        ref, ours = tmp_path / f"ref-{ftype}.gguf", tmp_path / f"ours-{ftype}.gguf"
        _reference(tool, [str(src), str(ref), ftype, "2"])
        p = subprocess.run([sys.executable, "-c", _HELPER_RUN, str(src), str(ours), ftype], capture_output=True,
                           text=True, cwd=ROOT)
        assert p.returncode == 0, p.stderr[-2000:]
        kernels, taken, yaml, no_entry_points, nrt_alone = p.stdout.split()
        assert kernels == "True" and int(taken) > 0, p.stdout
        assert (yaml, no_entry_points, nrt_alone) == ("False", "True", "True"), p.stdout     # tuning.lean_numba
        assert ours.read_bytes() == ref.read_bytes(), ftype
    bad = tmp_path / "bad.gguf"
    p = subprocess.run([sys.executable, "-c", _HELPER_RUN, str(src), str(bad), "fail"], capture_output=True,
                       text=True, cwd=ROOT)
    assert p.returncode == 0 and "error the helper process failed" in p.stdout, p.stdout + p.stderr[-2000:]
    assert "disk full" in p.stderr and not bad.exists()


def test_imatrix_types_need_the_kernels():
    """An importance matrix sends Q4_0/Q4_1/Q5_0/Q5_1 to the kernels (ggml weighs their search by it; the NumPy
    rows are the unweighted reference), while Q8_0 ignores it as ggml does; big files go to the kernels too."""
    from types import SimpleNamespace
    from llampy.llama.quant import _needs_kernels
    ti = SimpleNamespace(type=T.F16, n_elements=256 * 256)
    im = np.ones((1, 256), np.float32)
    for t in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0):
        assert not _needs_kernels([("w", ti, (256, 256), t, 0, None)], 2), t.name
        assert _needs_kernels([("w", ti, (256, 256), t, 0, im)], 2) == (t != T.Q8_0), t.name
    big = SimpleNamespace(type=T.F16, n_elements=10 ** 9)
    assert _needs_kernels([("w", big, (4096, 244141), T.Q4_0, 0, None)], 2)
    assert _needs_kernels([("w", ti, (256, 256), T.Q6_K, 0, None)], 2)
