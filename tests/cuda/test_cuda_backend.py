"""The CUDA backend against the float64 reference: every op case of tests/ggml/test_ops.py, the block formats'
value rules against the ggml layer's dequantizer and the table's field offsets, the buffer boundary, decode
matrix-vector products past one tile, and CUDA-graph replay (on a GPU)."""
from __future__ import annotations

import numpy as np
import pytest

from llampy.ggml import ops
from llampy.ggml.backend import backend_init, tensor_alloc, tensor_data, tensor_get, tensor_get_bytes, tensor_set
from llampy.ggml.blocks import BLOCKS
from llampy.ggml.graph import Graph
from llampy.ggml.quants import dequantize, quantize
from llampy.ggml.sched import Scheduler
from llampy.ggml.tensor import Op, Tensor
from llampy.ggml.types import GGMLType as T, TYPE_TRAITS

from tests.ggml.helpers import random_blocks, run as run_host
from tests.ggml.test_ops import CASES

from .helpers import REF, count_launches, device_leaf

CUDA = backend_init("cuda")
from llampy.ggml.backends.cuda import kernels as K  # noqa: E402  (imported by the backend)

# the reference rounds activations to the weight's dot type (Q8_0/Q8_1/Q8_K) and uses ggml-cpu's F16 GELU table;
# the GPU keeps activations in float32 (F16 inside tensor-core tiles), as ggml-cuda's dequantize paths do
LOOSE = 1e-2


def _run(be, build):
    rng = np.random.default_rng(7)
    place = device_leaf if be is CUDA else None
    B = (lambda ty, shape, value=None: place(be, ty, shape, value, rng)) if place else \
        (lambda ty, shape, value=None: __import__("tests.ggml.helpers", fromlist=["leaf"]).leaf(be, ty, shape, value, rng))
    out = build(B)
    out.set_output()
    g = Graph.build(out)
    return g, out


@pytest.mark.parametrize("name", sorted(CASES))
def test_cuda_matches_reference(name):
    build, tol = CASES[name]
    g, out = _run(CUDA, build)
    from llampy.ggml.backends.cuda.backend import _TABLE
    from llampy.ggml.tensor import VIEW_OPS
    foreign = [n for n in g.nodes if n.op not in _TABLE and n.op not in VIEW_OPS]
    if foreign:     # ops the backend has no kernel for: it must refuse them (the scheduler runs them on the CPU)
        assert not any(CUDA.supports_op(n) for n in foreign)
        return
    for n in g.nodes:
        assert CUDA.supports_op(n), f"cuda refuses {n!r}"
    Scheduler([CUDA]).graph_compute(g)
    got = tensor_get(out).astype(np.float64)
    want = run_host(REF, _run(REF, build)[1])[0].astype(np.float64)
    scale = max(1.0, float(np.nanmax(np.abs(want)))) if want.size else 1.0
    loose = "mul_mat" in name or "gelu" in name or "geglu" in name or "flash" in name
    np.testing.assert_allclose(got, want, rtol=0, atol=max(tol, LOOSE if loose else 2e-5) * scale)


KERNEL_BLOCK_TYPES = [t for t in K.TYPES if TYPE_TRAITS[t].is_quantized]


@pytest.mark.parametrize("t", KERNEL_BLOCK_TYPES, ids=lambda t: t.name)
def test_value_rules_match_dequantize(t):
    """Each format's Triton value rule decodes random blocks (all bit patterns, sane scales) exactly as
    quants.dequantize does, and reads the fields where the block table puts them."""
    rng = np.random.default_rng(int(t))
    nrow, k = 5, 2 * TYPE_TRAITS[t].blck_size
    raw = random_blocks(t, (1, 1, nrow, nrow and k // TYPE_TRAITS[t].blck_size * TYPE_TRAITS[t].type_size), rng)
    w = Tensor(t, (k, nrow))
    tensor_alloc(CUDA.alloc_buffer(w.nbytes), w, 0)
    tensor_set(w, raw)
    import torch
    from llampy.ggml.backends.cuda.buffer import rows
    want = dequantize(raw.reshape(nrow, -1), t)
    for fast in ((True, False) if t in K.FAST_DEQUANT else (False,)):   # dequant_fast's layout too, and gathers
        K.FAST_DEQUANT_ON = fast
        try:
            got = CUDA._dequant(w, rows(w), torch.float32).cpu().numpy()
            pick = torch.tensor([3, 0, 3], dtype=torch.int32, device=CUDA.dev)
            got_idx = CUDA._dequant(w, rows(w), torch.float16, pick).cpu().numpy()
        finally:
            K.FAST_DEQUANT_ON = True
        np.testing.assert_array_equal(got, want, err_msg=f"fast={fast}")
        np.testing.assert_array_equal(got_idx, want[[3, 0, 3]].astype(np.float16), err_msg=f"fast={fast}, rows")
    fields = {f.name: f.offset for f in BLOCKS[t].fields}
    for name, off in K.FIELD_OFFSETS[t].items():
        assert fields[name] == off, (t.name, name)


def test_formats_without_kernels_are_refused():
    """A block format with no value rule here (Q8_K, an activation format) is refused for products and get_rows, so
    the scheduler runs them on the CPU; IQ1_S and NVFP4, which have one, are taken."""
    x, idx = Tensor(T.F32, (256, 2)), Tensor(T.I32, (2,))
    for t, ok in ((T.Q8_K, False), (T.IQ1_S, True), (T.NVFP4, True)):
        w = Tensor(t, (256, 4))
        assert bool(CUDA.supports_op(ops.mul_mat(w, x))) is ok and bool(CUDA.supports_op(ops.get_rows(w, idx))) is ok


@pytest.mark.parametrize("t", [T.MXFP4, T.NVFP4], ids=lambda t: t.name)
def test_fp4_values_at_every_scale_byte(t):
    """MXFP4's scale byte e is GGML_E8M0_TO_FP32_HALF: 2^(e - 128), float32 subnormals for e < 2 and inf past the
    float range for the largest nibbles; NVFP4's four are ggml_ue4m3_to_fp32 (half of E4M3 without its sign bit,
    subnormal for exponent 0, 0x7F read as 0): every scale byte decodes as quants.dequantize does."""
    import torch
    from llampy.ggml.backends.cuda.buffer import rows
    ts, bs = TYPE_TRAITS[t].type_size, TYPE_TRAITS[t].blck_size
    raw = np.random.default_rng(3).integers(0, 256, (256, ts), dtype=np.uint8)
    if t == T.MXFP4:
        raw[:, 0] = np.arange(256)
    else:
        raw[:, :4] = np.arange(256)[:, None]
    w = Tensor(t, (bs * 8, 256 // 8))
    tensor_alloc(CUDA.alloc_buffer(w.nbytes), w, 0)
    tensor_set(w, raw.reshape(32, -1))
    want = dequantize(raw.reshape(32, -1), t)
    if t == T.MXFP4:
        assert np.isinf(want).any() and (want[0, :32][want[0, :32] != 0] != 0).all()
    else:
        assert (want.reshape(256, 64)[[0, 0x7F, 0x80, 0xFF]] == 0).all(axis=1).tolist() == [True, True, True, False]
    np.testing.assert_array_equal(CUDA._dequant(w, rows(w), torch.float32).cpu().numpy(), want)


@pytest.mark.parametrize("t,ncols", [(t, c) for t in (T.Q4_K, T.Q6_K, T.Q4_0, T.Q8_0) for c in (1, 3, 8, 9)]
                         + [(t, c) for t in (T.IQ2_XXS, T.IQ3_S, T.IQ1_S, T.TQ1_0, T.TQ2_0, T.MXFP4, T.NVFP4, T.Q1_0,
                                             T.Q2_0) for c in (1, 9)],
                         ids=lambda v: v.name if isinstance(v, T) else str(v))
def test_matvec_and_tiles_past_one_block(t, ncols):
    """Decode products (matvec, 1..8 columns) and the dequantize+matmul path (9 columns) over several K tiles and
    a row count that is not a multiple of the kernel's rows per program."""
    rng = np.random.default_rng(ncols)
    n, k = 37, 768
    wv = rng.standard_normal((n, k)).astype(np.float32)
    x = rng.standard_normal((ncols, k)).astype(np.float32)
    # the grid formats' quantizers search (and IQ2_XXS's needs an importance matrix): random blocks with small
    # scales instead
    grid = t in (T.IQ2_XXS, T.IQ3_S, T.IQ1_S)
    q = random_blocks(t, (n, k // 256 * TYPE_TRAITS[t].type_size), rng) if grid else quantize(wv, t)
    w = Tensor(t, (k, n))
    tensor_alloc(CUDA.alloc_buffer(w.nbytes), w, 0)
    tensor_set(w, q)
    xt = Tensor(T.F32, (k, ncols))
    tensor_alloc(CUDA.alloc_buffer(xt.nbytes), xt, 0)
    tensor_set(xt, x)
    out = ops.mul_mat(w, xt).set_output()
    Scheduler([CUDA]).graph_compute(Graph.build(out))
    got = tensor_get(out).reshape(ncols, n)
    from llampy.ggml.backends.reference import mul_mat_f64
    want = np.empty((ncols, n))
    mul_mat_f64(q, t, x, want)          # x rounded to t's dot type first, as llama.cpp (and the kernels) do
    # matvec: float32 sums of the same products; 9 columns: F16 tiles for cuBLAS on a GPU
    tol = 1e-5 if ncols <= 8 or not CUDA.cuda_graphs else 2e-3
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * np.abs(want).max())


@pytest.mark.parametrize("t", [T.F16, T.BF16], ids=lambda t: t.name)
def test_half_matvec_sums_in_float32_over_rounded_activations(t):
    """One activation row times an F16/BF16 matrix (the decode kernel matvec_half, K not a multiple of its
    tile, rows not a multiple of its rows per program): float32 sums of the weights times x rounded to the
    weight's type, as ggml's vec_dot_f16/bf16 — within float32 summation error of the float64 product, where
    torch's half matmul of one row rounds the result to the half type."""
    from llampy.ggml.quants import quantize_bf16

    def bits(v):            # the half type's bits of float32 values
        return v.astype(np.float16).view(np.uint16) if t == T.F16 else quantize_bf16(v).view(np.uint16)

    def value(h):           # and back, exactly
        return h.view(np.float16).astype(np.float64) if t == T.F16 else \
            (h.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    rng = np.random.default_rng(21)
    n, k = 37, 1000
    wb = bits(rng.standard_normal((n, k)).astype(np.float32)).reshape(n, k)
    x = rng.standard_normal((1, k)).astype(np.float32)
    w = Tensor(t, (k, n))
    tensor_alloc(CUDA.alloc_buffer(w.nbytes), w, 0)
    tensor_set(w, wb.view(np.float16) if t == T.F16 else wb)
    xt = Tensor(T.F32, (k, 1))
    tensor_alloc(CUDA.alloc_buffer(xt.nbytes), xt, 0)
    tensor_set(xt, x)
    out = ops.mul_mat(w, xt).set_output()
    Scheduler([CUDA]).graph_compute(Graph.build(out))
    got = tensor_get(out).reshape(n)
    wf = value(wb)
    want = wf @ value(bits(x[0]).reshape(k))
    unrounded = wf @ x[0].astype(np.float64)
    scale = np.abs(wf) @ np.abs(x[0].astype(np.float64))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * scale.max())
    assert np.abs(want - unrounded).max() > 10e-6 * scale.max()    # the rounding of x is visible at this tolerance


def test_device_memory_is_not_host_memory():
    """Code outside the backend cannot take a NumPy view of device tensors: tensor_data refuses, and
    tensor_set/tensor_get go through the buffer."""
    t = Tensor(T.F32, (4, 3))
    tensor_alloc(CUDA.alloc_buffer(t.nbytes), t, 0)
    with pytest.raises(TypeError):
        tensor_data(t)
    v = np.arange(12, dtype=np.float32).reshape(3, 4)
    tensor_set(t, v)
    np.testing.assert_array_equal(tensor_get(t).reshape(3, 4), v)


def test_two_backend_graph_copies_across_the_boundary():
    """A graph whose weights live on the device and whose input lives on the host: the scheduler places the
    product on the device and copies the input over; the result equals the CPU's."""
    cpu = backend_init("cpu")
    rng = np.random.default_rng(3)
    wv = rng.standard_normal((16, 64)).astype(np.float32)
    xv = rng.standard_normal((2, 64)).astype(np.float32)
    w = device_leaf(CUDA, T.F32, (16, 64), wv)
    x = Tensor(T.F32, (64, 2)).set_input()
    y = ops.scale(ops.mul_mat(w, x), 0.5).set_output()
    g = Graph.build(y)
    s = Scheduler([CUDA, cpu])
    s.alloc_graph(g)
    tensor_set(x, xv)
    s.graph_compute(g)
    assert s.get_backend(g.nodes[0], g) is CUDA
    np.testing.assert_allclose(tensor_get(y).reshape(2, 16), 0.5 * xv @ wv.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t", [T.Q4_K, T.F16], ids=lambda t: t.name)
def test_row_split_over_two_gpus_equals_one(t):
    """split_mode 'row' over two CUDA backends (two GPUs, or both in the interpreter): a matrix's rows split 1:1.5
    (ggml/split.py; 38.4 rows rounded down to the backends' 16-row tiles: 32), each backend's decode and prompt
    products over its own rows, copied by the scheduler into their rows of the first's product (a peer copy of
    the other device's rows, strided for several columns): one backend's product bit for bit."""
    import torch
    from llampy.ggml.backend import BufferUsage
    from llampy.ggml.split import SplitBufferType
    from llampy.ggml.tensor import Flags
    if CUDA.dev.type == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("one GPU here")
    other = backend_init("cuda", device="cuda:1" if CUDA.device == "cuda:0" else "cuda:0")
    cpu = backend_init("cpu")
    rng = np.random.default_rng(5)
    rows = rng.standard_normal((96, 256)).astype(np.float32)
    data = np.ascontiguousarray(rows.astype(np.float16).view(np.uint8) if t == T.F16 else quantize(rows, t))
    for n in (1, 5):
        x = rng.standard_normal((n, 256)).astype(np.float32)
        res = []
        for buft, backends in ((CUDA.get_default_buffer_type(), [CUDA, cpu]),
                               (SplitBufferType([CUDA, other], [1, 1.5], main=CUDA), [CUDA, other, cpu])):
            w = Tensor(t, (256, 96), name="w")
            w.flags |= Flags.WEIGHT
            tensor_alloc(buft.buffer_from_host(data.reshape(-1), BufferUsage.WEIGHTS), w, 0)
            xt = Tensor(T.F32, (256, n), name="x")
            xt.flags |= Flags.INPUT
            y = ops.mul_mat(w, xt).set_output()
            g = Graph.build(y)
            sched = Scheduler(backends)
            sched.alloc_graph(g)
            tensor_set(xt, x)
            sched.graph_compute(g)
            res.append(tensor_get(y))
        assert [(r0, r1) for _, _, r0, r1 in w.buffer.parts_of(w)] == [(0, 32), (32, 96)]
        ran = [(nd.op, sp.backend) for sp in sched._last.splits for nd in sp.nodes if nd.op in (Op.MUL_MAT, Op.CONCAT)]
        assert ran == [(Op.MUL_MAT, CUDA), (Op.MUL_MAT, other), (Op.CONCAT, CUDA)]
        assert sched._last.splits[-1].inputs == [] and len(sched._last.splits[-1].gathers) == 2
        np.testing.assert_array_equal(res[1], res[0])


@pytest.mark.skipif(not CUDA.cuda_graphs, reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_follows_new_inputs():
    """From the second run on, a plan replays its captured CUDA graph: new input values give new results."""
    rng = np.random.default_rng(5)
    wq = quantize(rng.standard_normal((64, 256)).astype(np.float32), T.Q4_K)
    w = Tensor(T.Q4_K, (256, 64))
    tensor_alloc(CUDA.alloc_buffer(w.nbytes), w, 0)
    tensor_set(w, wq)
    x = Tensor(T.F32, (256, 1)).set_input()
    y = ops.silu(ops.mul_mat(w, x)).set_output()
    g = Graph.build(y)
    s = Scheduler([CUDA])
    s.alloc_graph(g)
    from llampy.ggml.backends.reference import mul_mat_f64
    for i in range(4):
        xv = rng.standard_normal((1, 256)).astype(np.float32)
        tensor_set(x, xv)
        s.graph_compute(g)
        z = np.empty((1, 64))
        mul_mat_f64(wq, T.Q4_K, xv, z)        # x rounded to Q8_K first, as the kernel does
        np.testing.assert_allclose(tensor_get(y).reshape(1, 64), z / (1 + np.exp(-z)), rtol=0,
                                   atol=1e-5 * np.abs(z).max())
    assert s._last.splits[0].plan.graph is not None


@pytest.mark.parametrize("t", [T.Q4_K, T.Q8_0], ids=lambda t: t.name)
def test_split_k_sums_to_the_whole_product(t):
    """The GPU's launch shape splits K across programs (partial sums added after): any split gives the product
    of one pass, to float32 rounding."""
    import torch
    from llampy.ggml.backends.cuda.buffer import rows
    rng = np.random.default_rng(9)
    n, k = 20, 1024
    q = quantize(rng.standard_normal((n, k)).astype(np.float32), t)
    w = Tensor(t, (k, n))
    tensor_alloc(CUDA.alloc_buffer(w.nbytes), w, 0)
    tensor_set(w, q)
    x = torch.tensor(rng.standard_normal((1, k)).astype(np.float32), device=CUDA.dev)
    whole = torch.empty((1, n), dtype=torch.float32, device=CUDA.dev)
    CUDA._matvec(w, rows(w), x, whole, (8, 256, k, 1))
    for kc in (256, 512):
        split = k // kc
        y = torch.empty((1, n), dtype=torch.float32, device=CUDA.dev)
        part = torch.empty((split, 1, n), dtype=torch.float32, device=CUDA.dev)
        CUDA._matvec(w, rows(w), x, y, (8, 256, kc, split), part)
        np.testing.assert_allclose(y.cpu().numpy(), whole.cpu().numpy(), rtol=1e-5, atol=1e-5)


def test_norm_and_weight_fuse_into_one_row_kernel():
    """rms_norm then mul by a weight becomes one RMS_NORM_MUL node in the backend's split (graph_optimize), and
    gives the unfused result."""
    from llampy.ggml.tensor import Op
    rng = np.random.default_rng(4)
    xv = rng.standard_normal((6, 64)).astype(np.float32)
    wv = rng.standard_normal(64).astype(np.float32)
    x = device_leaf(CUDA, T.F32, (6, 64), xv)
    w = device_leaf(CUDA, T.F32, (64,), wv)
    y = ops.mul(ops.rms_norm(x, 1e-6), w).set_output()
    g = Graph.build(y)
    s = Scheduler([CUDA])
    s.graph_compute(g)
    assert y.op is Op.RMS_NORM_MUL
    want = xv / np.sqrt((xv.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6) * wv
    np.testing.assert_allclose(tensor_get(y).reshape(6, 64), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t,k", [(T.Q4_K, 1280), (T.Q6_K, 768), (T.Q4_0, 352), (T.Q4_1, 352), (T.Q8_0, 800)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_integer_decode_kernels_agree_with_the_value_rules(t, k):
    """The integer decode kernels (mmvq.py: int8 activations, dp4a on weight words) give the value-rule kernel's
    product (activations rounded the same way) at launch shapes whose last chunk of blocks is partial; Q4_1 to
    the F16 rounding of Q8_1's sum, as ggml stores it."""
    import torch
    from llampy.ggml.backends.cuda import mmvq as M
    from llampy.ggml.backends.cuda.buffer import rows
    rng = np.random.default_rng(13)
    n = 11
    q = quantize(rng.standard_normal((n, k)).astype(np.float32), t)
    w = Tensor(t, (k, n))
    tensor_alloc(CUDA.alloc_buffer(w.nbytes), w, 0)
    tensor_set(w, q)
    x = torch.tensor(rng.standard_normal((1, k)).astype(np.float32), device=CUDA.dev)
    want = torch.empty((1, n), dtype=torch.float32, device=CUDA.dev)
    bk = 256 if k % 256 == 0 else 32
    CUDA._matvec(w, rows(w), x, want, (8, bk, k, 1))
    g = M.KERNELS[t][1]
    xq = (torch.empty(k, dtype=torch.int8, device=CUDA.dev), torch.empty(k // g, dtype=torch.float32, device=CUDA.dev),
          torch.empty(k // 16, dtype=torch.int32, device=CUDA.dev))
    M.quantize_act[(k // g,)](x, *xq, k, G=g)
    extra = {"TYPE": int(t)} if t in M.TYPE_ARG else {}
    for name, kern in M.VARIANTS[t].items():           # both kernels of the format
        for bn, sb in ((4, 2), (2, 8)):
            y = torch.full((n,), float("nan"), dtype=torch.float32, device=CUDA.dev)
            kern[((n + bn - 1) // bn,)](rows(w), *xq, y, n, k, w.nb[1], BN=bn, SB=sb, ASM=CUDA.dev.type == "cuda",
                                        **extra)
            np.testing.assert_allclose(y.cpu().numpy(), want[0].cpu().numpy(), rtol=1e-3 if t == T.Q4_1 else 1e-5,
                                       atol=1e-3 if t == T.Q4_1 else 1e-5, err_msg=f"kernel {name}, BN={bn}, SB={sb}")


def test_products_of_one_input_share_its_quantization():
    """q, k and v products of one activation row (Q4_K, Q6_K and Q4_K weights) quantize it once in the plan and
    still give the three separate products."""
    from llampy.ggml.backends.cuda import mmvq as M
    rng = np.random.default_rng(14)
    k = 512
    x = device_leaf(CUDA, T.F32, (1, k), rng.standard_normal((1, k)).astype(np.float32))
    outs, ws = [], []
    for t, n in ((T.Q4_K, 6), (T.Q6_K, 5), (T.Q4_K, 3)):
        wv = rng.standard_normal((n, k)).astype(np.float32)
        ws.append(wv)
        outs.append(ops.mul_mat(device_leaf(CUDA, t, (n, k), wv), x))
    total = ops.concat(ops.concat(outs[0], outs[1], 0), outs[2], 0).set_output()
    g = Graph.build(total)
    calls = []
    orig = M.quantize_act

    class Counting:                     # counts the quantizations the plan launches
        def __getitem__(self, grid):
            calls.append(grid)
            return orig[grid]
    M.quantize_act = Counting()
    try:
        Scheduler([CUDA]).graph_compute(g)
    finally:
        M.quantize_act = orig
    assert len(calls) == 1
    got = tensor_get(total).reshape(-1)
    sep = []                            # each product alone, in a graph of its own: its own quantization
    for wv, t in zip(ws, (T.Q4_K, T.Q6_K, T.Q4_K)):
        o = ops.mul_mat(device_leaf(CUDA, t, wv.shape, wv), x).set_output()
        Scheduler([CUDA]).graph_compute(Graph.build(o))
        sep.append(tensor_get(o).reshape(-1))
    np.testing.assert_array_equal(got, np.concatenate(sep))
    want = np.concatenate([dequantize(quantize(wv, t), t, k).reshape(wv.shape) @ tensor_get(x).reshape(-1)
                           for wv, t in zip(ws, (T.Q4_K, T.Q6_K, T.Q4_K))])
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


# ---------------------------------------------------------------------------------------------- quantized KV cache
KV_TYPES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1]


def _kv_rows(rng):
    """Rows a cache stores: random values, with blocks that test the quantizers' edges (all zero, one value far
    out, a tie for the largest magnitude with opposite signs, halves of Q8_0's step)."""
    x = rng.standard_normal((2, 3, 64)).astype(np.float32)
    x[1, 2, :32] = 0.0
    x[1, 0, 40] = 10.0
    x[0, 2, 32:] = 0.5
    x[0, 2, 40], x[0, 2, 50] = -3.0, 3.0
    x[0, 0, :32] = np.arange(-16, 16, dtype=np.float32) * 0.25 + 0.125
    return x


def _store_graph(be, t, place):
    rng = np.random.default_rng(3)
    x = _kv_rows(rng)
    cache = place(be, t, (2, 8, 64), np.zeros((2, 8, 64)), rng)
    src = place(be, T.F32, (2, 3, 64), x, rng)
    idx = place(be, T.I64, (3,), np.array([6, 2, 0]), rng)
    stored = ops.set_rows(cache, src, idx)
    # the K shift's read and write-back: a permuted view of the cache to F32 and back into it
    view = ops.permute(stored, 0, 2, 1, 3)
    back = ops.cpy(ops.scale(ops.cont(ops.cast(view, T.F32)), -0.5), view)
    return stored, back


@pytest.mark.parametrize("t", KV_TYPES, ids=lambda t: t.name)
def test_quantized_kv_cache_stores_the_cpu_backends_bytes(t):
    """set_rows into a block-format cache (llama.cpp's -ctk/-ctv q8_0 ... q5_1) quantizes on the device as
    ggml-cpu's from_float does: the same bytes as the CPU backend, edge blocks included; the K shift's cast of a
    permuted view and its copy back give the CPU's bytes too."""
    from tests.ggml.helpers import leaf
    cpu = backend_init("cpu")
    out = {}
    for be, place in ((CUDA, device_leaf), (cpu, leaf)):
        stored, back = _store_graph(be, t, place)
        g1 = Graph.build(stored.set_output())
        if be is CUDA:
            assert all(CUDA.supports_op(n) for n in g1.nodes)
        Scheduler([be]).graph_compute(g1)
        first = tensor_get_bytes(stored).copy()
        g2 = Graph.build(back.set_output())
        if be is CUDA:
            assert all(CUDA.supports_op(n) for n in g2.nodes)
        Scheduler([be]).graph_compute(g2)
        out[be.name] = first, tensor_get_bytes(stored).copy()
    np.testing.assert_array_equal(out["cuda"][0], out["cpu"][0])
    np.testing.assert_array_equal(out["cuda"][1], out["cpu"][1])
    assert not np.array_equal(out["cpu"][0], out["cpu"][1])      # the write-back changed the cache


def test_bf16_kv_cache_follows_the_cpu_backend():
    """A BF16 cache (-ctk/-ctv bf16): the store rounds to nearest even as ggml_cpu_fp32_to_bf16 (the CPU backend's
    bytes, the K shift's write-back too; Triton's interpreter would truncate), and attention over it rounds q to
    BF16 (K's dot type) in the decode kernel and the prompt path: the CPU backend's values (ggml's one_chunk
    kernel, tests/ggml/test_attention_bf16_ggml.py) up to float32 summation order."""
    from tests.ggml.helpers import leaf
    cpu = backend_init("cpu")
    out = {}
    for be, place in ((CUDA, device_leaf), (cpu, leaf)):
        stored, back = _store_graph(be, T.BF16, place)
        Scheduler([be]).graph_compute(Graph.build(stored.set_output()))
        first = tensor_get_bytes(stored).copy()
        Scheduler([be]).graph_compute(Graph.build(back.set_output()))
        out[be.name] = first, tensor_get_bytes(stored).copy()
    np.testing.assert_array_equal(out["cuda"][0], out["cpu"][0])
    np.testing.assert_array_equal(out["cuda"][1], out["cpu"][1])

    def case(nq):
        def build(B):
            q = ops.permute(B(T.F32, (nq, 4, 64)), 0, 2, 1, 3)
            m = np.zeros((nq, 70))
            m[:, 65:] = -np.inf
            return ops.flash_attn_ext(q, B(T.BF16, (2, 70, 64)), B(T.BF16, (2, 70, 64)), B(T.F16, (nq, 70), m), 0.125)
        return build
    for nq in (1, 5):           # the decode kernel, the prompt path
        g, o = _run(CUDA, case(nq))
        assert all(CUDA.supports_op(n) for n in g.nodes)
        Scheduler([CUDA]).graph_compute(g)
        want = run_host(cpu, _run(cpu, case(nq))[1])[0]
        np.testing.assert_allclose(tensor_get(o), want, rtol=0, atol=2e-6 * np.abs(want).max())


@pytest.mark.parametrize("t", [T.Q8_0, T.Q4_0], ids=lambda t: t.name)
def test_decode_attention_reads_a_quantized_cache_in_place(t, monkeypatch):
    """One query row over a block-format cache: the decode kernel reads the blocks through the value rules (no
    dense copy of the cache is made), and agrees with the reference; a prompt's rows (dense copies) too."""
    def case(nq):
        def build(B):
            q = ops.permute(B(T.F32, (nq, 4, 64)), 0, 2, 1, 3)
            m = np.zeros((nq, 70))
            m[:, 65:] = -np.inf
            return ops.flash_attn_ext(q, B(t, (2, 70, 64)), B(t, (2, 70, 64)), B(T.F16, (nq, 70), m), 0.125)
        return build
    for nq in (1, 5):
        if nq == 1:
            monkeypatch.setattr(K, "dequant_rows3", None)              # a dense copy would fail here
        g, out = _run(CUDA, case(nq))
        assert all(CUDA.supports_op(n) for n in g.nodes)
        Scheduler([CUDA]).graph_compute(g)
        monkeypatch.undo()
        got = tensor_get(out).astype(np.float64)
        want = run_host(REF, _run(REF, case(nq))[1])[0].astype(np.float64)
        np.testing.assert_allclose(got, want, rtol=0, atol=LOOSE * max(1.0, np.abs(want).max()))


@pytest.mark.parametrize("cap,sinks", [(3.0, None), (0.0, [4.0, -1.0, 0.0, 9.0]), (5.0, [0.5, 2.0, -3.0, 1.0])])
def test_decode_kernel_takes_softcapping_and_sinks(cap, sinks, monkeypatch):
    """One query row with soft-capped scores (gemma 2) or attention sinks (gpt-oss) goes through the decode kernel
    (not the dense path's torch expressions), split over the cache where the device is large, and agrees with the
    reference."""
    calls = count_launches(monkeypatch, K, "attn_decode")
    monkeypatch.setattr(CUDA, "n_sm", 4)                      # 4 heads x 2 splits: the combine step runs too

    def build(B):
        q = ops.permute(B(T.F32, (1, 4, 64)), 0, 2, 1, 3)
        m = np.zeros((1, 300))
        m[:, 290:] = -np.inf
        s = B(T.F32, (4,), np.array(sinks)) if sinks is not None else None
        return ops.flash_attn_ext(q, B(T.F16, (2, 300, 64)), B(T.F16, (2, 300, 64)), B(T.F16, (1, 300), m), 0.125,
                                  0.0, cap, sinks=s)
    g, out = _run(CUDA, build)
    Scheduler([CUDA]).graph_compute(g)
    assert calls and calls[0][1] > 1
    got = tensor_get(out).astype(np.float64)
    want = run_host(REF, _run(REF, build)[1])[0].astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-3 * max(1.0, np.abs(want).max()))


def test_geglu_kernel_follows_ggml_cpus_gelu_table():
    """GEGLU in one kernel: GELU as ggml-cpu's F16 table gives it (the value at g's F16 rounding, rounded to F16;
    0 at or below -10, g at or above 10) times u, against the CPU backend over -12..12, within one F16 step."""
    from tests.ggml.helpers import leaf
    cpu = backend_init("cpu")
    g = np.linspace(-12.0, 12.0, 4 * 257, dtype=np.float32).reshape(4, 257)
    u = np.random.default_rng(2).standard_normal((4, 257)).astype(np.float32)

    def build(be, place):
        rng = np.random.default_rng(0)
        return ops.geglu(place(be, T.F32, (4, 257), g, rng), place(be, T.F32, (4, 257), u, rng))
    out = build(CUDA, device_leaf)
    Scheduler([CUDA]).graph_compute(Graph.build(out.set_output()))
    got = tensor_get(out).reshape(4, 257)
    want = run_host(cpu, build(cpu, leaf))[0].reshape(4, 257)
    # one F16 step of the GELU value, or where ggml's 1 + tanhf(y) cancels (g below -3) a few float32 steps of 1
    # times |g| (tanhf's own last bits: CUDA's differs from glibc's)
    step = np.abs(u) * np.maximum(np.maximum(np.abs(want / u), 6.1e-5) * 2.0 ** -10, 3e-7 * np.abs(g))
    assert (np.abs(got - want) <= step * 1.001).all(), np.abs(got - want).max()
    assert (np.abs(got - want) == 0).mean() > 0.95          # and most values exactly the table's
    assert (got[g <= -10.0] == 0).all() and np.array_equal(got[g >= 10.0], (g * u)[g >= 10.0])


@pytest.mark.parametrize("t", [T.Q4_K, T.Q8_0, T.Q6_K], ids=lambda t: t.name)
def test_norm_writes_its_products_quantized_activations(t, monkeypatch):
    """A norm of one row feeding integer-kernel products quantizes the row in its own kernel (Q8_K blocks of 256
    for the k-quants, Q8_0 blocks of 32 for the others): the products' results are the unfused ones bit for bit,
    without a quantization launch of their own."""
    from llampy.ggml.backends.cuda import backend as CB
    from llampy.ggml.backends.cuda import mmvq as MMVQ
    launches = count_launches(monkeypatch, MMVQ, "quantize_act")
    rng = np.random.default_rng(4)
    k = 512
    wq = [quantize(rng.standard_normal((n, k)).astype(np.float32), t) for n in (48, 16)]
    x = rng.standard_normal((1, k)).astype(np.float32) * 3
    nwv = rng.uniform(0.5, 1.5, k).astype(np.float32)
    got = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(CB.CUDABackend, "_norm_quant_plan", lambda self, nodes: {})
        xs, nw = device_leaf(CUDA, T.F32, (1, k), x), device_leaf(CUDA, T.F32, (k,), nwv)
        ws = []
        for n, q in zip((48, 16), wq):
            w = Tensor(t, (k, n))
            tensor_alloc(CUDA.alloc_buffer(w.nbytes), w, 0)
            tensor_set(w, q)
            ws.append(w)
        h = ops.mul(ops.rms_norm(xs, 1e-6), nw)
        outs = [ops.mul_mat(w, h).set_output() for w in ws]
        launches.clear()
        Scheduler([CUDA]).graph_compute(Graph.build(*outs))
        got[fused] = [tensor_get(o).copy() for o in outs], len(launches)
    for a, b in zip(got[True][0], got[False][0]):
        np.testing.assert_array_equal(a, b)
    assert (got[True][1], got[False][1]) == (0, 1)
