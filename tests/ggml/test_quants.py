"""Block formats against the oracles: gguf-py (dequantize, and quantize where it has one), ggml's own C code
(digests of libggml's output on a fixed input, and a live comparison where a built libggml is at hand), direct
transliterations of ggml's reference formulas for Q8_1 / Q8_K, and every tensor of both real models."""
from __future__ import annotations

import ctypes
import hashlib
import math
from pathlib import Path

import numpy as np
import pytest
from gguf import quants as gq
from gguf.constants import GGMLQuantizationType as GQ

from llampy.ggml.quants import DEQUANTIZE_TYPES, QUANTIZE_TYPES, dequantize, quantize, quantize_act
from llampy.ggml.types import GGMLType as T, QK_K, TYPE_TRAITS

ROOT = Path(__file__).resolve().parents[2]
BLOCK_TYPES = sorted((t for t in DEQUANTIZE_TYPES if TYPE_TRAITS[t].is_quantized), key=int)
GGUF_PY_DEQUANT = [t for t in BLOCK_TYPES + [T.F16, T.BF16] if t.name in GQ.__members__ and
                   (t in (T.F16,) or GQ[t.name] in gq._type_traits)]
GGUF_PY_QUANT = [T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.TQ1_0, T.TQ2_0, T.MXFP4]


def assert_same_floats(ours: np.ndarray, theirs: np.ndarray, msg=""):
    """Bitwise equal, NaN payloads aside (random bytes can hold NaN/inf scales)."""
    ours, theirs = np.asarray(ours, np.float32), np.asarray(theirs, np.float32).reshape(ours.shape)
    nan = np.isnan(ours)
    np.testing.assert_array_equal(nan, np.isnan(theirs), err_msg=msg)
    np.testing.assert_array_equal(ours[~nan].view(np.uint32), theirs[~nan].view(np.uint32), err_msg=msg)


def random_blocks(t, shape, seed):
    tt = TYPE_TRAITS[t]
    return np.random.default_rng(seed).integers(0, 256, shape[:-1] + (shape[-1] * tt.type_size,), dtype=np.uint8)


def fixed_input() -> np.ndarray:
    """12 rows x 512 float32 values from integer hashing only (no RNG stream or libm involved, so identical on
    every platform), exactly representable, with the cases the rounding rules differ on: ties, zeros, outliers,
    tiny groups, one-signed rows."""
    i = np.arange(12 * 512, dtype=np.uint64)
    z = i * np.uint64(0x9E3779B97F4A7C15) + np.uint64(0x632BE59BD9B4E019)
    z ^= z >> np.uint64(31)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(29)
    v = ((z >> np.uint64(40)).astype(np.int64) - (1 << 23)).astype(np.float32) / np.float32(1 << 21)  # [-4, 4)
    x = v.reshape(12, 512) * (np.float32(2.0) ** (np.arange(12, dtype=np.float32) % 7 - 3))[:, None]
    x[1] = np.round(x[1] * 4) / 4                     # a coarse grid: many exact halves when scaled
    x[2, :300] = 0                                    # zero sub-blocks and a zero super-block
    x[3, 7] = 300.0                                   # an outlier
    x[4] *= np.float32(2.0 ** -60)                    # below the k-quants' group epsilon in places
    x[5] = np.abs(x[5])                               # one-signed rows (the mins of Q4_1 / K-quants)
    x[6] = -np.abs(x[6])
    x[7] = 0
    x[8, ::3] = 0
    x[9] = np.round(x[9])                              # integers
    return x


# sha256 (first 32 hex digits) of ggml's output on fixed_input(): ggml_quantize_chunk (the path of llama-quantize
# without imatrix) or, for the dot types, quantize_row_q8_1_ref / quantize_row_q8_K_ref, from libggml-base
# (llama.cpp, built from source here). test_quantize_equals_libggml_live re-derives them where the library exists.
LIBGGML_DIGESTS = {
    T.F16: "87a9fa9dcb1695ec5e6e536c6831b082",
    T.Q4_0: "e8d81f6c950cd595d26b6948e3b42560",
    T.Q4_1: "012e8bc76261842f768f8e6d40b13dd5",
    T.Q5_0: "22ef24faec85f5f9dc5fd3319b2669a0",
    T.Q5_1: "a070e6909016c59ecd36ee3d344cb512",
    T.Q8_0: "d7e7189b3808c8a63b8a623779b5be11",
    T.Q8_1: "cf482fa81494347a10d4b5d1b2517dd0",
    T.Q2_K: "9aad0ebce80158aa702df2089d03f0bc",
    T.Q3_K: "c787a539e09651f56fedf6cfb2d5b3d8",
    T.Q4_K: "6617b7b146c8a49b7f785437a8ee47c0",
    T.Q5_K: "fca66e2dc2d829917a5f8ab79a18a1a4",
    T.Q6_K: "1cbb85e15c941f6f035f846b8fa50011",
    T.Q8_K: "e5b649b1817caf63f9d5c9532b962705",
    T.IQ4_NL: "6dc8b2b32d11ea4f35bfe3d9d270a545",
    T.IQ4_XS: "750498c0638dc8386293d98d2cb8ceec",
    T.BF16: "fe4ba8529a6713d444a28a7f098176c0",
    T.TQ1_0: "c46735356d23df175fabbed5983d0afe",
    T.TQ2_0: "60e8efc7f6c208cd408d321499fbffc3",
    T.MXFP4: "dad5e58c9dabaadfa7b9adf501f9b217",
    T.NVFP4: "ec732bd61d2e909e10bbe49d8dcd02c4",
    T.Q1_0: "ce97c5455faa9d5b414f6eb4bcb30fc9",
    T.Q2_0: "97415553eb6253ad994ec78a23cbff3c",
}


def _digest(b: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(b).tobytes()).hexdigest()[:32]


# ------------------------------------------------------------------------------------------------ gguf-py

@pytest.mark.parametrize("t", GGUF_PY_DEQUANT, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", [(1,), (3, 2), (2, 3, 1), (7,)], ids=str)
def test_dequantize_equals_gguf_py_on_random_bytes(t, shape):
    raw = random_blocks(t, shape, seed=int(t) * 31 + len(shape))
    ours = dequantize(raw, t)
    tt = TYPE_TRAITS[t]
    assert ours.shape == shape[:-1] + (shape[-1] * tt.blck_size,) and ours.dtype == np.float32
    with np.errstate(all="ignore"):
        theirs = gq.dequantize(raw, GQ(int(t)))
    assert_same_floats(ours, theirs, t.name)


@pytest.mark.parametrize("t", GGUF_PY_QUANT, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", [(1, 256), (5, 512), (2, 3, 256)], ids=str)
def test_quantize_equals_gguf_py(t, shape):
    rng = np.random.default_rng(len(shape) * 7 + shape[-1])
    x = (rng.standard_normal(shape) * rng.uniform(0.01, 30, shape[:-1] + (1,))).astype(np.float32)
    x.reshape(-1, shape[-1])[0, :64] = 0                         # zero blocks
    x.reshape(-1, shape[-1])[-1, 64:128] = np.round(x.reshape(-1, shape[-1])[-1, 64:128])   # ties
    ours = quantize(x, t)
    theirs = np.asarray(gq.quantize(x, GQ(int(t)))).view(np.uint8).reshape(ours.shape)
    assert ours.shape == shape[:-1] + (shape[-1] // TYPE_TRAITS[t].blck_size * TYPE_TRAITS[t].type_size,)
    np.testing.assert_array_equal(ours, theirs)


def test_quantize_equals_gguf_py_on_the_fixed_input():
    x = fixed_input()
    for t in GGUF_PY_QUANT:
        np.testing.assert_array_equal(quantize(x, t), np.asarray(gq.quantize(x, GQ(int(t)))).view(np.uint8).reshape(
            12, -1), err_msg=t.name)


# ------------------------------------------------------------------------------------------------ ggml itself

@pytest.mark.parametrize("t", sorted(QUANTIZE_TYPES, key=int), ids=lambda t: t.name)
def test_quantize_equals_libggml_digest(t):
    assert _digest(quantize(fixed_input(), t)) == LIBGGML_DIGESTS[t]


def _find_libggml():
    from tests import llamacpp
    p = llamacpp.libggml_base()
    return Path(p) if p else None


class LibGGML:
    """ggml's own quantizers and dequantizers through ctypes (libggml-base of a llama.cpp build)."""

    def __init__(self, path):
        self.lib = ctypes.CDLL(str(path))
        self.lib.ggml_quantize_chunk.restype = ctypes.c_size_t
        self.lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                                 ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]

    @staticmethod
    def _name(t):
        n = t.name.lower()
        return n[:-2] + "_K" if n.endswith("_k") else n

    def quantize(self, x, t):
        x = np.ascontiguousarray(x, np.float32).reshape(-1, x.shape[-1])
        tt = TYPE_TRAITS[t]
        out = np.zeros((x.shape[0], x.shape[1] // tt.blck_size * tt.type_size), np.uint8)
        if t in (T.Q8_1, T.Q8_K):                 # the dot types: only their _ref row quantizers
            getattr(self.lib, f"quantize_row_{self._name(t)}_ref")(
                ctypes.c_void_p(x.ctypes.data), ctypes.c_void_p(out.ctypes.data), ctypes.c_int64(x.size))
        else:
            self.lib.ggml_quantize_chunk(int(t), x.ctypes.data, out.ctypes.data, 0, x.shape[0], x.shape[1], None)
        return out

    def dequantize(self, raw, t):
        raw = np.ascontiguousarray(raw, np.uint8).reshape(-1)
        tt = TYPE_TRAITS[t]
        n = raw.size // tt.type_size * tt.blck_size
        out = np.zeros(n, np.float32)
        getattr(self.lib, f"dequantize_row_{self._name(t)}")(
            ctypes.c_void_p(raw.ctypes.data), ctypes.c_void_p(out.ctypes.data), ctypes.c_int64(n))
        return out


@pytest.fixture(scope="module")
def libggml():
    path = _find_libggml()
    if path is None or not path.exists():
        from tests import llamacpp
        llamacpp.missing("libggml-base.so")
    return LibGGML(path)


def test_quantize_equals_libggml_live(libggml):
    x = fixed_input()
    rng = np.random.default_rng(5)
    y = (rng.standard_normal((64, 1024)) * rng.uniform(0.001, 10, (64, 1))).astype(np.float32)
    for t in sorted(QUANTIZE_TYPES, key=int):
        ref = libggml.quantize(x, t)
        assert _digest(ref) == LIBGGML_DIGESTS[t], f"{t.name}: digest table is stale"
        np.testing.assert_array_equal(quantize(x, t), ref, err_msg=t.name)
        np.testing.assert_array_equal(quantize(y, t), libggml.quantize(y, t), err_msg=t.name)


def test_dequantize_equals_libggml_live(libggml):
    for t in BLOCK_TYPES:
        if t == T.Q8_1:                           # a dot type: ggml has no dequantizer for it
            continue
        raw = random_blocks(t, (40, 3), seed=int(t))
        assert_same_floats(dequantize(raw, t).reshape(-1), libggml.dequantize(raw, t), t.name)


# ------------------------------------------------------------------------------------------------ Q8_1, Q8_K

def _roundf(v: float) -> int:
    """C roundf (halves away from zero); exact in float64 for a float32 v."""
    return int(math.copysign(math.floor(abs(v) + 0.5), v))


def _nearest_int(v: np.float32) -> int:
    """ggml's nearest_int, literally: the bits of v + 12582912.f."""
    i = int(np.array([np.float32(v) + np.float32(12582912.0)], np.float32).view(np.int32)[0])
    return (i & 0x007FFFFF) - 0x00400000


def q8_1_ref(x: np.ndarray) -> bytes:
    """quantize_row_q8_1_ref, one value at a time, in float32."""
    out = b""
    for blk in x.reshape(-1, 32).astype(np.float32):
        amax = np.float32(0)
        for v in blk:
            amax = max(amax, np.float32(abs(v)))
        d = np.float32(amax / np.float32(127))
        idv = np.float32(np.float32(1) / d) if d else np.float32(0)
        qs = [_roundf(float(np.float32(v * idv))) for v in blk]
        s = np.float32(np.float32(sum(qs)) * d)
        out += np.float16(d).tobytes() + np.float16(s).tobytes() + np.array(qs, np.int8).tobytes()
    return out


def q8_k_ref(x: np.ndarray) -> bytes:
    """quantize_row_q8_K_ref, one value at a time (bsums of an all-zero block: 0)."""
    out = b""
    for blk in x.reshape(-1, QK_K).astype(np.float32):
        amax, mx = np.float32(0), np.float32(0)
        for v in blk:
            if abs(v) > amax:
                amax, mx = np.float32(abs(v)), v
        if not amax:
            out += bytes(4 + QK_K + 32)
            continue
        iscale = np.float32(np.float32(-127) / mx)
        qs = [min(127, _nearest_int(np.float32(iscale * v))) for v in blk]
        bsums = [sum(qs[16 * j:16 * j + 16]) for j in range(16)]
        out += np.float32(np.float32(1) / iscale).tobytes() + np.array(qs, np.int8).tobytes() + \
            np.array(bsums, "<i2").tobytes()
    return out


@pytest.mark.parametrize("t,ref", [(T.Q8_1, q8_1_ref), (T.Q8_K, q8_k_ref)], ids=["Q8_1", "Q8_K"])
def test_dot_types_equal_the_reference_formula(t, ref):
    x = fixed_input()[[0, 1, 2, 3, 5, 9]]
    rng = np.random.default_rng(3)
    x = np.concatenate([x, (rng.standard_normal((2, 512)) * 5).astype(np.float32)])
    assert quantize(x, t).tobytes() == ref(x)


def test_dot_types_round_trip():
    x = np.random.default_rng(0).standard_normal((3, 512)).astype(np.float32)
    for t, blck in ((T.Q8_1, 32), (T.Q8_K, QK_K), (T.Q8_0, 32)):
        q = quantize(x, t)
        y = dequantize(q, t)
        amax = np.abs(x.reshape(-1, blck)).max(axis=1, keepdims=True)
        # half a step of amax/127, plus the fp16 rounding of d for the 32-value types
        assert (np.abs(y - x).reshape(-1, blck) <= amax / 127 * 0.5 + amax * 2e-3).all(), t.name
    q = quantize(x, T.Q8_K).reshape(3, 2, 292)
    qs = q[:, :, 4:260].view(np.int8).astype(np.int32)
    np.testing.assert_array_equal(q[:, :, 260:292].copy().view("<i2"), qs.reshape(3, 2, 16, 16).sum(axis=3))
    q1 = quantize(x, T.Q8_1).reshape(-1, 36)
    s = q1[:, 2:4].copy().view("<f2")[:, 0].astype(np.float32)
    d = q1[:, 0:2].copy().view("<f2")[:, 0].astype(np.float32)
    qsum = q1[:, 4:].view(np.int8).astype(np.int32).sum(axis=1).astype(np.float32)
    np.testing.assert_allclose(s, qsum * d, rtol=2e-3)     # s is rounded from the unrounded d (exact: above)


def test_activation_q8_0_is_the_x86_rounding():
    # 127/amax and round-half-even (ggml's AVX quantize_row_q8_0) vs the reference's 1/d and roundf
    x = np.zeros((1, 32), np.float32)
    x[0, 0] = 127.0
    x[0, 1] = 2.5
    act = quantize_act(x, T.Q8_0)[0, 2:].view(np.int8)
    ref = quantize(x, T.Q8_0)[0, 2:].view(np.int8)
    assert act[1] == 2 and ref[1] == 3


# ------------------------------------------------------------------------------------------------ round trips, API

# worst |x - dequantize(quantize(x))| over a block, as a fraction of the block's largest |x|, on normal data
ROUND_TRIP_BOUND = {T.Q4_0: 0.13, T.Q4_1: 0.07, T.Q5_0: 0.065, T.Q5_1: 0.035, T.Q8_0: 0.005, T.Q8_1: 0.005,
                    T.Q8_K: 0.005, T.Q2_K: 0.45, T.Q3_K: 0.25, T.Q4_K: 0.12, T.Q5_K: 0.06, T.Q6_K: 0.03,
                    T.IQ4_NL: 0.12, T.IQ4_XS: 0.12, T.TQ1_0: 0.5, T.TQ2_0: 0.5, T.MXFP4: 0.25, T.NVFP4: 0.25,
                    T.Q1_0: 4.0, T.Q2_0: 0.5, T.F16: 0.001, T.BF16: 0.004}


@pytest.mark.parametrize("t", sorted(QUANTIZE_TYPES, key=int), ids=lambda t: t.name)
def test_round_trip_error_is_bounded(t):
    x = np.random.default_rng(int(t)).standard_normal((4, 2 * QK_K)).astype(np.float32) * 3
    y = dequantize(quantize(x, t), t)
    assert y.shape == x.shape
    blck = max(TYPE_TRAITS[t].blck_size, 32)
    err = np.abs(y - x).reshape(-1, blck).max(axis=1) / np.abs(x).reshape(-1, blck).max(axis=1)
    assert err.max() <= ROUND_TRIP_BOUND[t], (t.name, err.max())


def test_type_sets():
    assert QUANTIZE_TYPES >= {T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q8_1, T.Q8_K, T.Q2_K, T.Q3_K,
                              T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS}
    assert DEQUANTIZE_TYPES >= {T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K,
                                T.Q5_K, T.Q6_K, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M,
                                T.IQ4_NL, T.IQ4_XS, T.TQ1_0, T.TQ2_0, T.MXFP4, T.Q8_1, T.Q8_K, T.NVFP4, T.Q1_0,
                                T.Q2_0}
    assert set(DEQUANTIZE_TYPES) == set(T)          # every type ggml has


def test_shapes_ne0_and_plain_types():
    q = quantize(np.ones((2, 3, 64), np.float32), T.Q8_0)
    assert q.shape == (2, 3, 68) and q.dtype == np.uint8
    assert dequantize(q, T.Q8_0).shape == (2, 3, 64)
    assert dequantize(q.reshape(-1), T.Q8_0, ne0=64).shape == (6, 64)
    assert dequantize(q, T.Q8_0, ne0=64).shape == (2, 3, 64)
    with pytest.raises(ValueError):
        dequantize(q, T.Q8_0, ne0=32)
    with pytest.raises(ValueError):
        dequantize(q[..., :-1], T.Q8_0)
    with pytest.raises(ValueError):
        quantize(np.ones(48, np.float32), T.Q4_0)
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    for t, typed in ((T.F32, x), (T.F16, x.astype(np.float16)), (T.F64, x.astype(np.float64)),
                     (T.I8, (x * 10).astype(np.int8)), (T.I16, (x * 10).astype(np.int16)),
                     (T.I32, (x * 10).astype(np.int32)), (T.I64, (x * 10).astype(np.int64))):
        want = typed.astype(np.float32)
        np.testing.assert_array_equal(dequantize(typed, t), want, err_msg=t.name)
        np.testing.assert_array_equal(dequantize(typed.view(np.uint8), t), want, err_msg=t.name)
    bf = quantize(x, T.BF16)
    assert bf.shape == (3, 16)
    np.testing.assert_array_equal(dequantize(bf, T.BF16), dequantize(bf.view(np.uint16), T.BF16))
    assert np.abs(dequantize(bf, T.BF16) - x).max() <= np.abs(x).max() * 2 ** -8
    np.testing.assert_array_equal(dequantize(quantize(x, T.F16), T.F16), x.astype(np.float16).astype(np.float32))


# ------------------------------------------------------------------------------------------------ real models

@pytest.mark.slow
@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_every_tensor_of_the_real_models_dequantizes_like_gguf_py(which):
    import gguf

    from llampy import models
    reader = gguf.GGUFReader(getattr(models, f"{which}_path")())
    n = 0
    for ti in reader.tensors:
        t = T(int(ti.tensor_type))
        raw = np.asarray(ti.data)
        ours = dequantize(raw, t)
        theirs = gq.dequantize(raw, ti.tensor_type)
        assert_same_floats(ours, theirs, ti.name)
        n += TYPE_TRAITS[t].is_quantized
    assert n > 100


def test_numba_fp16_rounding_equals_numpy():
    """quants_base.fp16_bits / fp16_value (the k-quant kernels' fp16 fields) against NumPy's float16 cast: every
    fp16 value, the midpoints between neighbours and one float32 either side (ties to even), random float32 bit
    patterns, subnormals, overflow to infinity and signed zeros."""
    from numba import njit
    from llampy.ggml.quants_base import fp16_bits, fp16_value

    @njit(cache=False)
    def conv(x, h, r):
        for i in range(x.shape[0]):
            h[i] = fp16_bits(x[i])
            r[i] = fp16_value(h[i]) if (h[i] & 0x7C00) != 0x7C00 else np.float32(np.inf)
    f = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    f = np.sort(f[np.isfinite(f)])
    mid = ((f[:-1].astype(np.float64) + f[1:]) / 2).astype(np.float32)
    bits = np.random.default_rng(3).integers(0, 2**32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    x = np.concatenate([f, mid, np.nextafter(mid, np.float32(np.inf)), np.nextafter(mid, np.float32(-np.inf)),
                        bits.view(np.float32), np.float32([0.0, -0.0, 65504, 65519.996, 65520, 1e30, -1e30,
                                                           2.98e-8, 2.99e-8, 1e-30, -1e-30])])
    x = x[~np.isnan(x)]
    h, r = np.empty(len(x), np.uint16), np.empty(len(x), np.float32)
    conv(x, h, r)
    with np.errstate(over="ignore"):
        ref = x.astype(np.float16)
    assert (h == ref.view(np.uint16)).all()
    fin = np.isfinite(ref)
    assert (r[fin] == ref[fin].astype(np.float32)).all()



def test_kernel_cache_is_keyed_on_helper_sources(tmp_path):
    """quants_base.cached_njit: a kernel cached before a helper in another module changed is compiled again (Numba's
    own key, the kernel's file stamp and bytecode, would load the old code), and one keyed on unchanged files loads
    from the cache; the second process's first kernel (z, which allocates through Numba's runtime) loads before
    anything compiles, so without the registries that only a compilation installs. Subprocesses with their own
    NUMBA_CACHE_DIR (Numba reads it once per process)."""
    import os
    import subprocess
    import sys
    (tmp_path / "helper.py").write_text("from numba import njit\n\n@njit\ndef h(x):\n    return x + 1\n")
    (tmp_path / "kern.py").write_text(
        "import helper\nimport numpy as np\nfrom llampy.ggml.quants_base import cached_njit\n\n"
        "@cached_njit([helper.__file__, __file__])(cache=True, nogil=True)\ndef f(x):\n    return helper.h(x)\n\n"
        "@cached_njit([__file__])(cache=True)\ndef g(x):\n    return x * 10\n\n"
        "@cached_njit([__file__])(cache=True)\ndef z(n):\n    return np.ones(n, np.float32)[1:].sum()\n\n"
        "print(z(6), sum(z.stats.cache_hits.values()), f(1), sum(f.stats.cache_hits.values()), g(1), "
        "sum(g.stats.cache_hits.values()))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]),
               NUMBA_CACHE_DIR=str(tmp_path / "nc"))

    def run():
        return subprocess.run([sys.executable, str(tmp_path / "kern.py")], env=env, capture_output=True, text=True,
                              check=True).stdout.split()
    assert run() == ["5.0", "0", "2", "0", "10", "0"]          # compiled and saved
    (tmp_path / "helper.py").write_text("from numba import njit\n\n@njit\ndef h(x):\n    return x + 2\n")
    assert run() == ["5.0", "1", "3", "0", "10", "1"]          # z and g loaded; f compiled again (new helper)


def test_kernel_cache_types_plain_arrays_as_numba():
    """cached_njit's dispatchers type a plain ndarray argument themselves (without numpy.ma): the same type as
    Numba's typeof for every layout, dtype, dimension count and read-only array, and Numba's own answer (or error)
    for anything else."""
    import numba
    from llampy.ggml.kernel_cache import _typeof_pyval
    from llampy.ggml.quants_rows import f16_to_f32
    d = f16_to_f32
    assert d.typeof_pyval.func is _typeof_pyval
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    ro = np.zeros(5, np.uint8)
    ro.flags.writeable = False
    cases = [x, x[0], x[:, 1], x[..., ::2], np.asfortranarray(x), x.T, ro, np.zeros(3, np.uint16),
             np.zeros((2, 2), np.int64), np.zeros((), np.float64), np.zeros(2, np.bool_), np.zeros(2, np.float16),
             np.zeros(2, np.complex64), np.zeros(3, [("a", np.int32), ("b", np.float32)]), 3, 2.5, (1, 2)]
    for a in cases:
        assert _typeof_pyval(d, a) == d.typeof_pyval(a) == type(d).typeof_pyval(d, a) == numba.typeof(a), a
    with pytest.raises(numba.core.errors.NumbaTypeError):
        _typeof_pyval(d, np.ma.masked_array(np.zeros(2)))
