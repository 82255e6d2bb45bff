"""The IQ1 / IQ2 / IQ3 grid quantizers (llampy.ggml.quants_iq_search) and the weighted IQ4 ones against ggml's own
quantize_<type> through ctypes (libggml-base of the llama.cpp build), byte for byte, with and without an importance
matrix; and llampy quantize against llama-quantize on an IQ3 mix. Inputs are small: the searches are slow in both.

Here rather than in tests/ggml: make test-avx2 / test-generic re-run tests/ggml in fresh Numba caches, and these
kernels have no instruction-path variants."""
from __future__ import annotations

import ctypes
import hashlib
import os

import numpy as np
import pytest

from llampy.cli import main
from llampy.ggml.quants_iq_search import SEARCH_TYPES, grid_tables, quantize_iq
from llampy.ggml.quants_imatrix import quantize_weighted
from llampy.ggml.types import GGMLType as T, TYPE_TRAITS
from tests import llamacpp
from tests.llama.test_quantize import _ours, _reference, write_random_imatrix, write_random_llama

NEED_IMATRIX = (T.IQ2_XXS, T.IQ2_XS, T.IQ1_S)
# ggml builds these types' neighbour tables slowly (a sort of the grid per off-grid code: 23 s of CPU for the four
# here), so CI checks them against digests of libggml's output on tests/ggml's fixed input; LLAMPY_IQ_LIVE=1 runs
# the live comparison (test_digests_are_libggml_s re-derives the table)
DIGESTED = (T.IQ2_XS, T.IQ2_S, T.IQ1_S, T.IQ1_M)
LIBGGML_DIGESTS = {   # sha256 (first 32 hex digits) of ggml_quantize_chunk(fixed_input(), imatrix DIGEST_W or NULL)
    (T.IQ2_XS, True): "fa16719c6a0b894bcfef3d817f90ad8e",
    (T.IQ2_S, True): "375d5821e240e79dbd38cc1df570c3ce",
    (T.IQ2_S, False): "040d94f96a18c68fe11b38c58cd7fcbc",
    (T.IQ1_S, True): "de04c3827e0daa3242d6442a7b2e4491",
    (T.IQ1_M, True): "d45bb485529347a193a0bed26e0b0643",
    (T.IQ1_M, False): "de6d1b6fc4e331dc81f135339a900cc7",
}


def _digest_inputs():
    from tests.ggml.test_quants import fixed_input      # integer hashing only: the same on every platform
    w = ((np.arange(512) % 17) * np.float32(0.3) + np.float32(0.05)).astype(np.float32)
    w[100:108] = 0
    return fixed_input(), w


def _digest(b) -> str:
    return hashlib.sha256(np.ascontiguousarray(b).tobytes()).hexdigest()[:32]


@pytest.fixture(scope="module")
def libggml():
    path = llamacpp.libggml_base()
    if path is None:
        llamacpp.missing("libggml-base.so")
    lib = ctypes.CDLL(str(path))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]

    def quantize(x, t, w):
        tt = TYPE_TRAITS[t]
        out = np.zeros((x.shape[0], x.shape[1] // tt.blck_size * tt.type_size), np.uint8)
        lib.ggml_quantize_chunk(int(t), x.ctypes.data, out.ctypes.data, 0, x.shape[0], x.shape[1],
                                None if w is None else w.ctypes.data)
        return out
    return quantize


def _inputs():
    """8 rows of two super-blocks, with the cases the searches branch on"""
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((8, 512)) * rng.uniform(0.01, 3, (8, 1))).astype(np.float32)
    x[1, 256 + 64:256 + 96] = 0                   # a zero group of 32 inside a super-block (IQ3_S's qs pointer)
    x[1, :256] = 0                                # a zero super-block
    x[2, :128] *= np.float32(1e-9)                # groups under the IQ types' epsilons
    x[3] = np.round(x[3] * 2) / 2                 # a coarse grid: ties in the sorts and the roundings
    x[4] = np.abs(x[4])                           # one-signed rows
    x[5] = -np.abs(x[5])
    x[6, 17] = 40.0                               # an outlier
    x[7, ::5] = 0
    w = (rng.random(512) * 5 + 0.1).astype(np.float32)
    w[100:108] = 0                                # an imatrix column that saw nothing
    return x, w


@pytest.mark.parametrize("t", sorted(SEARCH_TYPES - set(DIGESTED), key=int), ids=lambda t: t.name)
def test_grid_search_equals_libggml(libggml, t):
    x, w = _inputs()
    np.testing.assert_array_equal(quantize_iq(x, t, w), libggml(x, t, w))
    np.testing.assert_array_equal(quantize_weighted(x, t, w), libggml(x, t, w))
    if t not in NEED_IMATRIX:                     # the types with weights of their own (x^2 or sigma2/4 + x^2)
        np.testing.assert_array_equal(quantize_iq(x, t), libggml(x, t, None))


@pytest.mark.parametrize("t, weighted", sorted(LIBGGML_DIGESTS, key=lambda k: (int(k[0]), k[1])),
                         ids=lambda v: v.name if isinstance(v, T) else ("imatrix" if v else "none"))
def test_grid_search_equals_libggml_digest(t, weighted):
    x, w = _digest_inputs()
    assert _digest(quantize_iq(x, t, w if weighted else None)) == LIBGGML_DIGESTS[(t, weighted)]


@pytest.mark.skipif(not os.environ.get("LLAMPY_IQ_LIVE"), reason="LLAMPY_IQ_LIVE=1: ggml's tables take minutes")
def test_digests_are_libggml_s(libggml):
    x, w = _digest_inputs()
    for (t, weighted), want in LIBGGML_DIGESTS.items():
        assert _digest(libggml(x, t, w if weighted else None)) == want, (t.name, weighted)
    xi, wi = _inputs()
    for t in DIGESTED:
        np.testing.assert_array_equal(quantize_iq(xi, t, wi), libggml(xi, t, wi), err_msg=t.name)


def test_weighted_iq4_equals_libggml(libggml):
    x, w = _inputs()
    for t in (T.IQ4_NL, T.IQ4_XS):
        np.testing.assert_array_equal(quantize_weighted(x, t, w), libggml(x, t, w), err_msg=t.name)


def test_grids_are_the_decoding_tables():
    """The search grids hold 2l+1 per coordinate, and every point decodes (dequantize) to the format's table row;
    codes off the grid list their neighbours nearest first."""
    from llampy.ggml import quants_tables as tab
    for t, dec, bits in ((T.IQ2_XXS, tab.IQ2XXS_GRID_BYTES, 2), (T.IQ1_S, tab.IQ1S_GRID_BYTES, 2),
                         (T.IQ3_S, tab.IQ3S_GRID_BYTES, 3)):
        grid, kmap, nb = grid_tables(t)
        vals = np.unique(dec)
        np.testing.assert_array_equal(vals[(grid - 1) // 2], dec)
        code = (((grid.astype(np.int64) - 1) // 2) << (bits * np.arange(grid.shape[1]))).sum(axis=1)
        np.testing.assert_array_equal(kmap[code], np.arange(len(grid)))
        off = np.nonzero(kmap < 0)[0][::997]
        for u in off:
            s = -kmap[u] - 1
            pts = nb[s + 1:s + 1 + nb[s]].astype(np.int64)
            pos = 2 * ((u >> (bits * np.arange(grid.shape[1]))) & ((1 << bits) - 1)) + 1
            d2 = ((grid[pts].astype(np.int64) - pos) ** 2).sum(axis=1)
            assert len(pts) and (np.diff(d2) >= 0).all()
            everyone = ((grid.astype(np.int64) - pos) ** 2).sum(axis=1)
            assert d2[0] == everyone.min()


def test_refusals(tmp_path, capsys):
    x, _ = _inputs()
    for t in NEED_IMATRIX:
        with pytest.raises(ValueError, match="requires an importance matrix"):
            quantize_iq(x, t)
    with pytest.raises(ValueError, match="whole blocks"):
        quantize_iq(x[:, :100], T.IQ3_S)
    m = tmp_path / "m.gguf"
    write_random_llama(m, n_ff=256, n_layer=1, n_vocab=256)
    # llama-quantize would abort in ggml (token_embd never needs an imatrix by its rule, IQ2_XXS always does)
    rc = main(["quantize", "--progress", "off", "--token-embedding-type", "iq2_xxs", str(m), str(tmp_path / "o.gguf"),
               "F16", "1"])
    assert rc == 1 and "needs an importance matrix" in capsys.readouterr().err


def test_iq3_mix_same_bytes_as_llama_quantize(tmp_path):
    tool = llamacpp.llama_quantize()
    if tool is None:
        llamacpp.missing("llama-quantize")
    m, im, ref, ours = (tmp_path / n for n in ("m.gguf", "im.gguf", "ref.gguf", "ours.gguf"))
    write_random_llama(m, n_ff=256, n_layer=1, n_vocab=256, seed=4)
    write_random_imatrix(m, im)
    _reference(tool, ["--imatrix", str(im), str(m), str(ref), "IQ3_XS", "2"])
    _ours(["--imatrix", str(im), str(m), str(ours), "IQ3_XS", "2"])
    assert ours.read_bytes() == ref.read_bytes()
