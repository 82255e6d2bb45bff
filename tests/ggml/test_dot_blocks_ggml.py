"""The block-table kernels of the ternary, FP4 and IQ grid formats (TQ2_0, TQ1_0, MXFP4, IQ2_XXS, IQ2_XS, IQ2_S,
IQ3_XXS, IQ3_S, IQ1_S, IQ1_M) in llampy/ggml/backends/cpu/dot_blocks.py and dot_grid.py, against
llama.cpp's own x86 kernels, called through ctypes in the libggml-cpu of the build from the sdist: the decode
rules give the reference dequantizer's bits, and every (weight row, activation row) product gives the bits of
``ggml_vec_dot_<type>_q8_*`` (from ``ggml_get_type_traits_cpu``) or, where llama.cpp repacks the rows
(IQ4_NL, MXFP4, Q4_0 with rows % 8 == 0), of ``ggml_gemv_<type>_8x8_q8_0`` and ``ggml_gemm_<type>_8x8_q8_0`` on the
rows repacked as ``make_block_<type>x8`` does. Both sides read the same 8-bit activations (llampy's, written as
ggml's Q8_0 / Q8_K blocks).
"""
from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest

from llampy.ggml import blocks as B
from llampy.ggml import quants as lq
from llampy.ggml.backends.cpu import dot_blocks as db, matmul as mm
from llampy.ggml.backends.cpu.act_quant import act_split
from llampy.ggml.types import GGMLType as T, TYPE_TRAITS
from tests import llamacpp

GRID = [T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M]
NEW = [T.TQ2_0, T.TQ1_0, T.MXFP4] + GRID


class _Traits(ctypes.Structure):
    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                ("nrows", ctypes.c_int64)]


_VEC_DOT = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.POINTER(ctypes.c_float), ctypes.c_size_t, ctypes.c_void_p,
                            ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


@pytest.fixture(scope="module")
def ggml_cpu():
    lib = llamacpp.libggml_cpu()[1]
    lib.ggml_cpu_init()
    lib.ggml_get_type_traits_cpu.restype = ctypes.POINTER(_Traits)
    lib.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]
    return lib


def ggml_act_blocks(x, vdt):
    """llampy's 8-bit activations of x (the split form the kernels read) and the same as ggml's block bytes."""
    n, k = x.shape
    s = act_split(x, vdt)
    if vdt == T.Q8_K:
        nb = k // 256
        blk = np.zeros((n, nb, 292), np.uint8)
        blk[:, :, 0:4] = s.xd.astype(np.float32).view(np.uint8).reshape(n, nb, 4)
        blk[:, :, 4:260] = s.xq.view(np.uint8).reshape(n, nb, 256)
        blk[:, :, 260:292] = s.xs.astype(np.int16).view(np.uint8).reshape(n, nb, 32)
    else:
        nb = k // 32
        blk = np.zeros((n, nb, 34), np.uint8)
        blk[:, :, 0:2] = s.xd.astype(np.float16).view(np.uint8).reshape(n, nb, 2)
        blk[:, :, 2:34] = s.xq.view(np.uint8).reshape(n, nb, 32)
    return s, np.ascontiguousarray(blk.reshape(n, -1))


def ggml_vec_dot(lib, t, wq, xb, k):
    tr = lib.ggml_get_type_traits_cpu(int(t)).contents
    assert tr.vec_dot_type == int(B.BLOCKS[t].dot_type)
    fn = _VEC_DOT(tr.vec_dot)
    out = np.zeros((xb.shape[0], wq.shape[0]), np.float32)
    r = ctypes.c_float()
    for i in range(xb.shape[0]):
        for j in range(wq.shape[0]):
            fn(k, ctypes.byref(r), 0, wq[j].ctypes.data, 0, xb[i].ctypes.data, 0, 1)
            out[i, j] = r.value
    return out


def repack_x8(wq, hs, xor=0):
    """Rows repacked as llama.cpp's make_block_mxfp4x8 / make_block_iq4_nlx8 / make_block_q4_0x8 (interleave 8): per
    8 rows and block, the 8 scales (``hs`` bytes each: MXFP4's exponent, IQ4_NL's and Q4_0's F16 d), then 16 chunks
    of 8 quant bytes, chunk c from row c % 8 at byte 8 * (c // 8), XORed with ``xor`` (Q4_0: 0x88, so that its
    signed-nibble table gives q - 8)."""
    rows, rb = wq.shape
    nb = rb // (16 + hs)
    blk = wq.reshape(rows // 8, 8, nb, 16 + hs)
    out = np.empty((rows // 8, nb, 8 * hs + 128), np.uint8)
    out[:, :, 0:8 * hs] = blk[:, :, :, 0:hs].transpose(0, 2, 1, 3).reshape(rows // 8, nb, 8 * hs)
    qs = blk[:, :, :, hs:].reshape(rows // 8, 8, nb, 2, 8)           # row, block, half, 8 bytes
    out[:, :, 8 * hs:] = qs.transpose(0, 2, 3, 1, 4).reshape(rows // 8, nb, 128) ^ np.uint8(xor)
    return np.ascontiguousarray(out.reshape(-1))


def _x8_fn(lib, t, form):
    fn = getattr(lib, f"ggml_{form}_{t.name.lower()}_8x8_q8_0")
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                   ctypes.c_int]
    return fn


def _repacked(wq, t):
    return repack_x8(wq, 1 if t == T.MXFP4 else 2, 0x88 if t == T.Q4_0 else 0)


def ggml_gemv_x8(lib, wq, xb, k, t=T.MXFP4):
    """ggml_gemv_<t>_8x8_q8_0 (MXFP4, IQ4_NL or Q4_0) on the rows repacked, one activation row per call."""
    fn = _x8_fn(lib, t, "gemv")
    rep = _repacked(wq, t)
    out = np.zeros((xb.shape[0], wq.shape[0]), np.float32)
    for i in range(xb.shape[0]):
        row = np.ascontiguousarray(xb[i])
        fn(k, out[i].ctypes.data, wq.shape[0], rep.ctypes.data, row.ctypes.data, 1, wq.shape[0])
    return out


def ggml_gemm_x8(lib, wq, xb, k, t):
    """ggml_gemm_<t>_8x8_q8_0 on the rows repacked, the activation rows (a multiple of 4) in the block_q8_0x4
    layout of ``ggml_quantize_mat_q8_0_4x8``: per 4 rows and block the 4 F16 scales, then 16 chunks of 8 quant bytes,
    chunk c from row c % 4 at byte 8 * (c // 4). The form llama.cpp runs for a prompt's rows 0 .. n - n % 4."""
    n = xb.shape[0]
    nb = k // 32
    blk = xb.reshape(n // 4, 4, nb, 34)
    vy = np.empty((n // 4, nb, 8 + 128), np.uint8)
    vy[:, :, 0:8] = blk[:, :, :, 0:2].transpose(0, 2, 1, 3).reshape(n // 4, nb, 8)
    vy[:, :, 8:] = blk[:, :, :, 2:].reshape(n // 4, 4, nb, 4, 8).transpose(0, 2, 3, 1, 4).reshape(n // 4, nb, 128)
    vy = np.ascontiguousarray(vy)
    fn = _x8_fn(lib, t, "gemm")
    rep = _repacked(wq, t)
    out = np.zeros((n, wq.shape[0]), np.float32)
    fn(k, out.ctypes.data, wq.shape[0], rep.ctypes.data, vy.ctypes.data, n, wq.shape[0])
    return out


def weights(rng, rows, k, t):
    """Quantized rows of mixed magnitudes; the grid formats (llampy has no quantizer for them): random blocks,
    every field arbitrary (all their indices are in range) but d, a float16 of such magnitudes."""
    scale = rng.choice([1e-3, 1.0, 40.0], size=(rows, 1))
    if t in GRID:
        fmt = B.BLOCKS[t]
        nb = k // fmt.blck_size
        blk = rng.integers(0, 256, (rows, nb, fmt.type_size), dtype=np.uint8)
        d = (rng.uniform(0.5, 2.0, (rows, nb)) * scale * 1e-2).astype(np.float16).view(np.uint16)
        if t == T.IQ1_M:      # d's bits are the top nibbles of the four scale words
            sc = blk[:, :, 48:56].copy().view(np.uint16) & np.uint16(0x0FFF)
            for j in range(4):
                sc[:, :, j] |= ((d >> np.uint16(4 * j)) & np.uint16(15)) << np.uint16(12)
            blk[:, :, 48:56] = sc.view(np.uint8)
        else:
            blk[:, :, 0:2] = d.view(np.uint8).reshape(rows, nb, 2)
        return blk.reshape(rows, -1)
    w = (rng.standard_normal((rows, k)) * scale).astype(np.float32)
    return lq.quantize(w, t).reshape(rows, -1)


@pytest.mark.parametrize("t", NEW, ids=lambda t: t.name)
def test_decode_rule_gives_the_reference_dequantizer_bits(t):
    rng = np.random.default_rng(2)
    fmt = B.BLOCKS[t]
    k, rows = 512, 4
    wq = weights(rng, rows, k, t)
    if t == T.TQ1_0:     # every byte value: the digits of bytes the quantizer never writes too
        wq[:, :52] = rng.integers(0, 256, (rows, 52), dtype=np.uint8)
    out = np.full((rows, k), np.nan, np.float32)
    for r in range(rows):
        for b in range(k // fmt.blck_size):
            fmt.decode(wq[r], b * fmt.type_size, out[r], b * fmt.blck_size)
    ref = lq.dequantize(wq, t).reshape(rows, k).astype(np.float32)
    assert np.array_equal(out.view(np.uint32), ref.view(np.uint32))
    tile = np.full((rows, k), np.nan, np.float32)
    db.DEQUANT_TILE[t](wq, tile)
    assert np.array_equal(tile.view(np.uint32), ref.view(np.uint32))


# (type, k, rows): 4 x 2 and 4 x 1 tiles and single rows (rows % 4 != 0, n = 3); MXFP4 with rows % 8 == 0 takes
# llama.cpp's repacked gemv, an odd block count its vec_dot's scalar tail (IQ4_NL's too), k % 256 != 0 the chain's
# last blocks
# Each kernel takes tens of seconds to compile: the suite runs one per family (the intricate ones: TQ1_0's digits,
# MXFP4's repacked chain, IQ2_XXS's grid and signs, IQ1_M's two accumulators) and IQ4_NL's odd tail (its kernel is
# test_dot_blocks.py's); LLAMPY_TEST_ALL_BLOCKS=1 runs every format.
ALL = ([(T.TQ2_0, 768, 6), (T.TQ1_0, 512, 7), (T.MXFP4, 288, 16), (T.MXFP4, 96, 6), (T.IQ4_NL, 608, 5)]
       + [(t, 512, 5) for t in GRID])
SUITE = {(T.TQ1_0, 512), (T.MXFP4, 288), (T.IQ4_NL, 608), (T.IQ2_XXS, 512), (T.IQ1_M, 512)}
CASES = ALL if os.environ.get("LLAMPY_TEST_ALL_BLOCKS") == "1" else [c for c in ALL if c[:2] in SUITE]


@pytest.mark.parametrize("t", [T.IQ4_NL, T.MXFP4, T.Q4_0], ids=lambda t: t.name)
def test_repacked_rows_give_ggml_gemv_bits_at_every_batch_size(ggml_cpu, t):
    """rows % 8 == 0, which llama.cpp repacks: its gemm keeps the gemv's chain per pair, so every batch size gives the
    gemv's bits (and the gemm's, which llama.cpp runs for a prompt's rows 0 .. n - n % 4), here through the decode
    kernel (eight weight rows as lanes: n = 3, and the last 3 rows of n = 27) and the prompt tiles (sixteen, then
    eight activation rows as lanes: rows 0..23 of n = 27; 40 weight rows, two chunks and a short one, n = 40: two
    steps of sixteen; k = 4096, n = 24: activation rows 4 KiB apart, whose blocks fall in one set of the first-level
    cache, a sixteen-row step and an eight-row one)."""
    rng = np.random.default_rng(int(t))
    for rows, n, k in ((16, 3, 160), (16, 27, 160), (40, 40, 160), (8, 24, 4096)):   # 160: an odd block count
        wq = weights(rng, rows, k, t)
        x = (rng.standard_normal((n, k)) * rng.choice([1e-2, 1.0, 30.0], size=(n, 1))).astype(np.float32)
        x[0, :32] = 0                   # an all-zero block (d = 0)
        s, xb = ggml_act_blocks(x, T.Q8_0)
        out = np.full((n, rows), np.nan, np.float32)
        db.mul_mat(wq, t, x, out, s, quantized=True)
        ref = ggml_gemv_x8(ggml_cpu, wq, xb, k, t)
        assert np.array_equal(out.view(np.uint32), ref.view(np.uint32)), (n, np.max(np.abs(out - ref)))
        n4 = n - n % 4
        gemm = ggml_gemm_x8(ggml_cpu, wq, xb[:n4], k, t)
        assert np.array_equal(out[:n4].view(np.uint32), gemm.view(np.uint32)), (n, np.max(np.abs(out[:n4] - gemm)))


@pytest.mark.parametrize("t,k,rows", CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_kernels_give_ggml_x86_bits(ggml_cpu, t, k, rows):
    rng = np.random.default_rng(int(t) * 1000 + k)
    wq = weights(rng, rows, k, t)
    if t in (T.TQ1_0, T.TQ2_0):       # arbitrary quant bytes too (TQ2_0's unused digit 3 included)
        nq = 52 if t == T.TQ1_0 else 64
        blk = wq.reshape(rows, -1, B.BLOCKS[t].type_size)
        blk[rows // 2:, :, :nq] = rng.integers(0, 256, blk[rows // 2:, :, :nq].shape, dtype=np.uint8)
    x = (rng.standard_normal((3, k)) * rng.choice([1e-2, 1.0, 30.0], size=(3, 1))).astype(np.float32)
    vdt = B.BLOCKS[t].dot_type
    s, xb = ggml_act_blocks(x, vdt)
    out = np.full((3, rows), np.nan, np.float32)
    db.mul_mat(wq, t, x, out, s, quantized=True)
    if t == T.MXFP4 and rows % 8 == 0:
        ref = ggml_gemv_x8(ggml_cpu, wq, xb, k)
    else:
        ref = ggml_vec_dot(ggml_cpu, t, wq, xb, k)
    assert np.array_equal(out.view(np.uint32), ref.view(np.uint32)), np.max(np.abs(out - ref))
    # and the product itself, through the dequantized weights (the decode rules) in float64
    xr = (s.xq.reshape(3, -1, 256 if vdt == T.Q8_K else 32).astype(np.float64)
          * s.xd[:, :, None].astype(np.float64)).reshape(3, k)
    wf = lq.dequantize(wq, t).reshape(rows, k).astype(np.float64)
    exact = xr @ wf.T
    bound = 1e-5 * (np.abs(xr) @ np.abs(wf).T) + 1e-30
    assert np.all(np.abs(out - exact) <= bound)
    assert TYPE_TRAITS[t].vec_dot_type == vdt


@pytest.mark.parametrize("t", [T.TQ2_0, T.TQ1_0], ids=lambda t: t.name)
def test_ternary_prompts_give_ggml_vec_dot_bits(ggml_cpu, t):
    """A prompt's batch (12 activation rows, past SMALL_N) of a ternary format: llama.cpp runs vec_dot at every
    batch size for these (they are not in its tiled path), and so does ``mul_mat`` (``dot_blocks.EVERY_N``)."""
    rng = np.random.default_rng(int(t) + 12)
    k, rows, n = 512, 9, 12
    wq = weights(rng, rows, k, t)
    x = (rng.standard_normal((n, k)) * rng.choice([1e-2, 1.0, 30.0], size=(n, 1))).astype(np.float32)
    s, xb = ggml_act_blocks(x, T.Q8_K)
    out = np.full((n, rows), np.nan, np.float32)
    mm.mul_mat(wq, t, x, out)
    ref = ggml_vec_dot(ggml_cpu, t, wq, xb, k)
    assert np.array_equal(out.view(np.uint32), ref.view(np.uint32)), np.max(np.abs(out - ref))
