"""MUL_MAT_GLU's fused kernels (dot_q32._mv_rows16_glu: gate and up tiles and the gated unit in registers; for a few
activation rows dot_q32._mv_rest_glu, on any CPU; for the rows llama.cpp repacks, a model's IQ4_NL / MXFP4 weights,
dot_blocks._mv_r8_glu when decoding) give the bits of the three ops they replace, run as the cpu backend runs
them unfused."""
import numpy as np
import pytest

from llampy.ggml import ops
from llampy.ggml.backend import tensor_data
from llampy.ggml.backends.cpu import matmul
from llampy.ggml.backends.cpu.backend import CPUBackend
from llampy.ggml.backends.cpu.simd import ROWS16
from llampy.ggml.graph import Graph
from llampy.ggml.quants import quantize
from llampy.ggml.sched import Scheduler
from llampy.ggml.tensor import Op, Tensor
from llampy.ggml.types import GGMLType as T
from llampy.ggml.backend import BufferUsage, tensor_alloc
from llampy.ggml.tensor import Flags


def _weight(be, wtype, rows, k, rng):
    t = Tensor(wtype, (k, rows))
    t.flags |= Flags.WEIGHT
    tensor_alloc(be.alloc_buffer(t.nbytes, BufferUsage.WEIGHTS), t, 0)
    tensor_data(t)[...] = quantize(rng.standard_normal((rows, k)).astype(np.float32) * 0.5, wtype).reshape(
        tensor_data(t).shape)
    return t


def _run(be, out, x, xv):
    g = Graph.build(out.set_output())
    Scheduler([be]).alloc_graph(g)
    tensor_data(x)[...] = xv
    Scheduler([be]).graph_compute(g)
    return np.array(tensor_data(g.nodes[-1]))


_PROMPT = pytest.mark.skipif(not ROWS16, reason="the prompt's fused kernel needs AVX-512 VNNI (sixteen-row tiles); "
                                                "elsewhere the node runs unfused, which test_ops covers")


@pytest.mark.parametrize("wtype,glu,n", [pytest.param(T.Q5_0, "geglu", 16, marks=_PROMPT),
                                         pytest.param(T.Q4_1, "swiglu", 37, marks=_PROMPT),
                                         pytest.param(T.Q8_0, "swiglu", 16, marks=_PROMPT),
                                         pytest.param(T.Q8_0, "swiglu", 37, marks=_PROMPT),
                                         (T.Q8_0, "swiglu", 1), (T.Q8_0, "geglu", 3), (T.Q5_0, "swiglu", 1),
                                         (T.Q5_1, "geglu", 2),
                                         (T.IQ4_NL, "swiglu", 1), (T.IQ4_NL, "geglu", 3)])
def test_fused_kernel_is_bit_identical_to_the_three_ops(wtype, glu, n):
    rng = np.random.default_rng(n)
    be = CPUBackend()
    k, rows = 128 if n > 3 else 160, 48
    wg, wu = _weight(be, wtype, rows, k, rng), _weight(be, wtype, rows, k, rng)
    xv = (rng.standard_normal((n, k)) * 2).astype(np.float32)
    x = Tensor(T.F32, (k, n), name="x").set_input()
    fused = ops.mul_mat_glu(wg, wu, x, glu)
    calls = []
    orig = matmul.bind_mul_mat_glu

    def spy(*a, **kw):
        r = orig(*a, **kw)
        calls.append(r is not None)
        return r
    matmul.bind_mul_mat_glu = spy
    try:
        got = _run(be, fused, x, xv)
    finally:
        matmul.bind_mul_mat_glu = orig
    assert calls and all(calls)                 # the fused kernel was bound (each time the plan was made)
    x2 = Tensor(T.F32, (k, n), name="x").set_input()
    act = ops.swiglu if glu == "swiglu" else ops.geglu
    want = _run(be, act(ops.mul_mat(wg, x2), ops.mul_mat(wu, x2)), x2, xv)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert fused.op is Op.MUL_MAT_GLU
