"""The Mamba-2 ssm_scan kernel (llampy/ggml/backends/cpu/ssm.py) against ggml_ssm_scan itself, called through ctypes in
llama.cpp's build from the sdist: bit for bit, with leftover states and whole blocks of GGML_F32_STEP lanes (AVX2:
32, so 16, 48 and 160 leave some over and 64, 128 do not; AVX-512: 64, so 16 and 48 run wholly in scalar code and
160 leaves 32), several sequences starting from other state rows. The build is native to the machine running the
test, so the kernel must follow the host's width (HOST_ORDER_ONLY: the default order on an AVX-512 host,
LLAMPY_FLOAT_ORDER=host elsewhere). A NumPy statement of both widths' orders checks the width llampy runs on any
host."""
from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np
import pytest

from llampy.ggml.backends.cpu.simd import F16_VEC_LANES
from llampy.ggml.backends.cpu.ssm import ssm_scan_f32
from tests import llamacpp
from tests.ggml.helpers import HOST_ORDER_ONLY

P, I64 = ctypes.c_void_p, ctypes.c_int64


@pytest.fixture(scope="module")
def ggml():
    base, cpu = llamacpp.libggml_cpu(ctypes.RTLD_GLOBAL)
    base.ggml_init.argtypes, base.ggml_init.restype = [llamacpp.GGMLInitParams], P
    base.ggml_new_tensor_4d.argtypes, base.ggml_new_tensor_4d.restype = [P, ctypes.c_int, I64, I64, I64, I64], P
    base.ggml_ssm_scan.argtypes, base.ggml_ssm_scan.restype = [P] * 8 + [I64], P
    base.ggml_new_graph.argtypes, base.ggml_new_graph.restype = [P], P
    base.ggml_build_forward_expand.argtypes = [P, P]
    base.ggml_get_data.argtypes, base.ggml_get_data.restype = [P], P
    base.ggml_free.argtypes = [P]
    cpu.ggml_graph_compute_with_ctx.argtypes = [P, P, ctypes.c_int]
    return base, cpu


def _inputs(n_seqs, n_tok, n_head, head_dim, d_state, n_group):
    """s (a pool of n_seqs + 1 state rows), x, dt, A (< 0, per head), B, C, ids (each sequence from another row)."""
    rng = np.random.default_rng(d_state + n_tok)
    f = lambda *sh, s=1.0: (rng.standard_normal(sh) * s).astype(np.float32)   # noqa: E731
    return [f(n_seqs + 1, n_head, head_dim, d_state), f(n_seqs, n_tok, n_head, head_dim), f(n_seqs, n_tok, n_head, s=2),
            -rng.uniform(1, 16, (n_head, 1)).astype(np.float32), f(n_seqs, n_tok, n_group, d_state),
            f(n_seqs, n_tok, n_group, d_state), np.arange(n_seqs, 0, -1, dtype=np.int32)]


def _kernel(ins):
    n_seqs, _, n_head, head_dim = ins[1].shape
    y = np.zeros_like(ins[1])
    states = np.zeros((n_seqs, n_head, head_dim, ins[0].shape[3]), np.float32)
    ssm_scan_f32(*ins, y, states, np.arange(n_seqs, dtype=np.int32))
    return np.concatenate([y.ravel(), states.ravel()])


@HOST_ORDER_ONLY
@pytest.mark.parametrize("n_seqs,n_tok,n_head,head_dim,d_state,n_group",
                         [(1, 1, 4, 16, 128, 1), (2, 7, 4, 16, 64, 2), (1, 5, 2, 8, 16, 1), (2, 3, 4, 8, 48, 2),
                          (1, 9, 6, 16, 160, 1)])
def test_mamba2_scan_gives_ggml_bits(ggml, n_seqs, n_tok, n_head, head_dim, d_state, n_group):
    base, cpu = ggml
    ins = _inputs(n_seqs, n_tok, n_head, head_dim, d_state, n_group)
    ctx = base.ggml_init(llamacpp.GGMLInitParams(1 << 26, None, False))
    ts = []
    for a in ins:
        ne = list(reversed(a.shape)) + [1] * (4 - a.ndim)
        t = base.ggml_new_tensor_4d(ctx, 26 if a.dtype == np.int32 else 0, *ne)
        ctypes.memmove(base.ggml_get_data(t), a.ctypes.data, a.nbytes)
        ts.append(t)
    r = base.ggml_ssm_scan(ctx, *ts, 1)
    gf = base.ggml_new_graph(ctx)
    base.ggml_build_forward_expand(gf, r)
    cpu.ggml_graph_compute_with_ctx(ctx, gf, 2)
    n = ins[1].size + n_seqs * n_head * head_dim * d_state
    want = np.ctypeslib.as_array(ctypes.cast(base.ggml_get_data(r), ctypes.POINTER(ctypes.c_float)), (n,)).copy()
    base.ggml_free(ctx)
    assert np.array_equal(_kernel(ins).view(np.uint32), want.view(np.uint32))


def _fma(a, b, c):
    """float32 a * b + c rounded once (the float64 product of two float32 values is exact)."""
    return (np.float64(a) * np.float64(b) + np.float64(c)).astype(np.float32)


def _reduce(acc, lanes):
    """GGML_F32_VEC_REDUCE of the four vectors of ``lanes`` laid out flat in acc (..., 4 * lanes): x0 + x2, x1 + x3,
    their sum, then AVX2's halves and two hadds, or AVX-512's halving order (GCC's _mm512_reduce_add_ps)."""
    x = acc.reshape(acc.shape[:-1] + (4, lanes))
    v = (x[..., 0, :] + x[..., 2, :]) + (x[..., 1, :] + x[..., 3, :])
    if lanes == 8:
        t = v[..., :4] + v[..., 4:]
        return (t[..., 0] + t[..., 1]) + (t[..., 2] + t[..., 3])
    while v.shape[-1] > 1:
        h = v.shape[-1] // 2
        v = v[..., :h] + v[..., h:]
    return v[..., 0]


def _statement(s, x, dt, A, B, C, ids, lanes):
    """ggml_ssm_scan's Mamba-2 loop in the order of the build of ``lanes`` (8: AVX2, 16: AVX-512), with the C
    library's expf and logf for dt's softplus and the decay, as ggml's scalar calls."""
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    libm.expf.restype = libm.logf.restype = ctypes.c_float
    libm.expf.argtypes = libm.logf.argtypes = [ctypes.c_float]
    f32 = np.float32
    n_seqs, n_tok, n_head, head_dim = x.shape
    d_state = s.shape[3]
    step = 4 * lanes
    nv = d_state - d_state % step
    per_group = n_head // B.shape[2]
    y = np.zeros_like(x)
    out = np.zeros((n_seqs, n_head, head_dim, d_state), np.float32)
    for j in range(n_seqs):
        for h in range(n_head):
            st = s[ids[j], h].copy()
            g = h // per_group
            for t in range(n_tok):
                d = dt[j, t, h]
                dsp = d if d > 20 else f32(libm.logf(f32(1) + f32(libm.expf(d))))
                dA = f32(libm.expf(f32(dsp * A[h, 0])))
                x_dt = x[j, t, h] * dsp                               # (head_dim,)
                st = _fma(st, dA, B[j, t, g][None, :] * x_dt[:, None])
                acc = np.zeros((head_dim, step), np.float32)
                for k0 in range(0, nv, step):
                    acc = _fma(st[:, k0:k0 + step], C[j, t, g, k0:k0 + step], acc)
                sumf = _reduce(acc, lanes) if nv else np.zeros(head_dim, np.float32)
                for k in range(nv, d_state):
                    sumf = _fma(st[:, k], C[j, t, g, k], sumf)
                y[j, t, h] = sumf
            out[j, h] = st
    return np.concatenate([y.ravel(), out.ravel()])


@pytest.mark.parametrize("n_seqs,n_tok,n_head,head_dim,d_state,n_group",
                         [(2, 3, 4, 8, 48, 2), (1, 4, 2, 8, 128, 1), (2, 2, 2, 4, 160, 1)])
def test_mamba2_scan_follows_the_build_width(n_seqs, n_tok, n_head, head_dim, d_state, n_group):
    """The kernel in the width llampy runs (simd.F16_VEC_LANES) equals the NumPy statement of that build's order,
    and differs from the other width's where their blocks differ (the orders are distinct, not two names for one)."""
    ins = _inputs(n_seqs, n_tok, n_head, head_dim, d_state, n_group)
    got = _kernel(ins).view(np.uint32)
    assert np.array_equal(got, _statement(*ins, F16_VEC_LANES).view(np.uint32))
    if d_state == 128:
        assert not np.array_equal(got, _statement(*ins, 24 - F16_VEC_LANES).view(np.uint32))


@pytest.mark.parametrize("dst,fused", [([2, 1], True), ([0, 1], True), ([0, 3], True), ([1, 2], False), ([3, 3], False)])
def test_scan_writing_the_memory_rows_equals_scan_then_copy(dst, fused):
    """ssm._Scan bound to the SET_ROWS that stores its states (bind_state_store's case) writes them straight into the
    memory rows, in place where a sequence keeps its row; where a target row is another sequence's starting row
    ([1, 2]: the sequences starting from rows 2 and 1 swap them, and one would overwrite the other's state before it
    is read) or two targets meet, it runs unfused and leaves the rows to the SET_ROWS' copy. Either way the outputs
    and the rows are the scan's then the copy's."""
    from llampy.ggml.backends.cpu.ssm import _Scan
    ins = _inputs(2, 3, 4, 16, 48, 2)
    ins[0] = np.concatenate([ins[0], ins[0][:1] * 0.5])            # four rows: 0, 1, 2 and a spare
    ins[6] = np.array([2, 1], np.int32)                             # sequence 0 starts from row 2, sequence 1 from 1
    y_want = np.zeros_like(ins[1])
    s_want = np.zeros((2,) + ins[0].shape[1:], np.float32)
    ssm_scan_f32(*[a.copy() for a in ins], y_want, s_want, np.arange(2, dtype=np.int32))
    mem = ins[0].copy()
    y = np.zeros_like(ins[1])
    out_s = np.zeros_like(s_want)
    scan = _Scan(mem, *ins[1:], y, out_s)
    scan.store = np.array(dst, np.int32)
    scan()
    assert scan.stored == fused
    assert np.array_equal(y.view(np.uint32), y_want.view(np.uint32))
    if fused:
        for j, r in enumerate(dst):
            assert np.array_equal(mem[r].view(np.uint32), s_want[j].view(np.uint32))
        untouched = [r for r in range(4) if r not in dst]
        assert np.array_equal(mem[untouched], ins[0][untouched])
    else:
        assert np.array_equal(mem, ins[0])                          # the memory waits for the SET_ROWS' copy
        assert np.array_equal(out_s.view(np.uint32), s_want.view(np.uint32))


def test_scan_of_a_prompt_reads_packed_b_and_c():
    """A prompt's B and C are views into the convolution's rows (x, B, C side by side per token): the bound scan
    copies them packed before each run (PACK_MIN_TOKENS and more) and gives the bits of the scan on contiguous
    inputs, run after run with new values in the views."""
    from llampy.ggml.backends.cpu.ssm import PACK_MIN_TOKENS, _Scan
    n_s, n_t, n_head, head_dim, d_state, n_group = 2, PACK_MIN_TOKENS + 3, 4, 8, 48, 2
    xbc = np.zeros((n_s, n_t, n_head * head_dim + 2 * n_group * d_state), np.float32)
    xv = xbc[..., :n_head * head_dim].reshape(n_s, n_t, n_head, head_dim)
    bv = xbc[..., n_head * head_dim:-n_group * d_state].reshape(n_s, n_t, n_group, d_state)
    cv = xbc[..., -n_group * d_state:].reshape(n_s, n_t, n_group, d_state)
    mem = np.zeros((n_s + 1, n_head, head_dim, d_state), np.float32)
    y = np.zeros((n_s, n_t, n_head, head_dim), np.float32)
    out_s = np.zeros((n_s, n_head, head_dim, d_state), np.float32)
    ins = _inputs(n_s, n_t, n_head, head_dim, d_state, n_group)
    scan = _Scan(mem, xv, ins[2], ins[3], bv, cv, ins[6], y, out_s)
    assert len(scan.packs) == 2
    for run in range(2):
        ins = _inputs(n_s, n_t + run, n_head, head_dim, d_state, n_group)
        ins[1], ins[4], ins[5] = ins[1][:, :n_t], ins[4][:, :n_t], ins[5][:, :n_t]
        mem[...], xv[...], bv[...], cv[...] = ins[0], ins[1], ins[4], ins[5]
        scan.args[2][...], scan.args[3][...], scan.args[6][...] = ins[2][:, :n_t], ins[3], ins[6]
        y_want = np.zeros_like(y)
        s_want = np.zeros_like(out_s)
        ssm_scan_f32(*[np.ascontiguousarray(a) for a in ins[:2]], np.ascontiguousarray(ins[2][:, :n_t]), ins[3],
                     *[np.ascontiguousarray(a) for a in ins[4:]], y_want, s_want, np.arange(n_s, dtype=np.int32))
        scan()
        assert np.array_equal(y.view(np.uint32), y_want.view(np.uint32))
        assert np.array_equal(out_s.view(np.uint32), s_want.view(np.uint32))

def _conv_layer(dev, d_conv, d_inner, n_t, n_s, n_rows, rng, extra_reader=False, tail=""):
    """mamba's conv_input then ssm_conv over a memory of n_rows rolling rows (the graph models/mamba.py builds),
    then (tail) silu of the output plus a bias, or silu alone: (graph, x, src, dst, memory, output)."""
    from llampy.ggml.backend import BufferUsage, tensor_alloc, tensor_set
    from llampy.ggml.tensor import Tensor
    from llampy.ggml.types import GGMLType as T
    from llampy.ggml import ops
    from llampy.ggml.graph import Graph
    from tests.ggml.fakes import weight
    dc1 = d_conv - 1
    r = Tensor(T.F32, (dc1 * d_inner, n_rows), name="r")
    tensor_alloc(dev.alloc_buffer(r.nbytes, BufferUsage.WEIGHTS), r, 0)
    tensor_set(r, rng.standard_normal((n_rows, dc1 * d_inner)).astype(np.float32))
    c = weight(dev, (d_conv, d_inner), rng, scale=0.5)
    x = Tensor(T.F32, (d_inner, n_t, n_s), name="x").set_input()
    src = Tensor(T.I32, (n_s,), name="src").set_input()
    dst = Tensor(T.I32, (n_s,), name="dst").set_input()
    cx = ops.concat(ops.reshape(ops.get_rows(r, src), dc1, d_inner, n_s), ops.transpose(x), 0)
    last = ops.view_3d(cx, dc1, d_inner, n_s, cx.nb[1], cx.nb[2], n_t * 4)
    g = Graph()
    g.expand(ops.set_rows(r, ops.cont(last, dc1 * d_inner, n_s), dst))
    y = ops.ssm_conv(cx, c)
    if extra_reader:                     # the concat read by another node: nothing fuses
        g.expand(ops.scale(cx, 0.5).set_output())
    if tail == "bias":
        y = ops.silu(ops.add(y, weight(dev, (d_inner,), rng)))
    elif tail == "silu":
        y = ops.silu(y)
    g.expand(y.set_output())
    return g, x, src, dst, r, y


@pytest.mark.parametrize("d_conv,d_inner,n_t,n_s,src,dst,tail", [
    (4, 48, 1, 1, [2], [2], ""),                 # a decoded token, the row kept (in place)
    (3, 40, 1, 2, [0, 1], [1, 0], ""),           # two sequences swapping rows (copy on write within the batch)
    (4, 48, 5, 2, [1, 3], [0, 3], ""),           # a prompt of 5 tokens each (the parallel kernel)
    (2, 16, 2, 3, [3, 3, 1], [0, 2, 1], ""),     # d_conv 2; two sequences from one row
    (4, 200, 1, 1, [1], [1], "bias"),            # mamba's bias and silu: 16-lane steps, an 8-lane one, scalars
    (4, 200, 3, 1, [0], [2], "bias"),            # the same over a prompt's tokens
    (4, 200, 19, 2, [0, 1], [1, 0], "bias"),     # a prompt past the stored inputs, runs of CONV_TOKENS, swapped rows
    (4, 72, 12, 1, [1], [1], "silu"),            # the same in place
    (4, 72, 1, 2, [0, 2], [0, 2], "silu"),
])
def test_conv_with_its_rolling_rows_fuses_to_the_same_bits(d_conv, d_inner, n_t, n_s, src, dst, tail):
    """The fusion pass turns mamba's / lfm2's convolution over the memory's rolling rows (get_rows, concat with the
    new inputs, ssm_conv, the last columns copied out and set_rows), and mamba's bias and silu after it, into one
    SSM_CONV_STATE node on the CPU: the same output bits and the same rows written (the others untouched) as the
    nodes run apart; the reference backend's kernel of the fused node agrees within float rounding."""
    from llampy.ggml.backend import tensor_data
    from llampy.ggml.backends.cpu.backend import CPUBackend
    from llampy.ggml.backends.reference import ReferenceBackend
    from llampy.ggml.sched import Scheduler
    from llampy.ggml.tensor import Op

    class Unfused(CPUBackend):
        def graph_optimize(self, graph_nodes, nodes):
            return nodes

    def run(dev):
        rng = np.random.default_rng(d_conv * 100 + n_t)
        g, x, s, d, r, y = _conv_layer(dev, d_conv, d_inner, n_t, n_s, 4, rng, tail=tail)
        sched = Scheduler([dev])
        sched.alloc_graph(g)
        tensor_data(x)[...] = rng.standard_normal(tensor_data(x).shape).astype(np.float32)
        tensor_data(s)[...] = np.array(src, np.int32).reshape(tensor_data(s).shape)
        tensor_data(d)[...] = np.array(dst, np.int32).reshape(tensor_data(d).shape)
        sched.graph_compute(g)
        return {n.op for n in g.nodes}, np.array(tensor_data(y)), np.array(tensor_data(r))

    ops_f, y_f, r_f = run(CPUBackend())
    ops_u, y_u, r_u = run(Unfused())
    assert Op.SSM_CONV_STATE in ops_f and not ops_f & {Op.SSM_CONV, Op.CONCAT, Op.GET_ROWS, Op.SET_ROWS, Op.CONT,
                                                       Op.ADD, Op.SILU}
    assert Op.SSM_CONV_STATE not in ops_u
    assert np.array_equal(y_f.view(np.uint32), y_u.view(np.uint32))
    assert np.array_equal(r_f.view(np.uint32), r_u.view(np.uint32))
    _, y_r, r_r = run(ReferenceBackend())
    np.testing.assert_allclose(y_f, y_r, rtol=1e-5, atol=1e-5)
    assert np.array_equal(r_f, r_r)


def test_conv_rows_not_fused_when_the_concat_has_another_reader():
    from llampy.ggml.backends.cpu.backend import CPUBackend
    from llampy.ggml.fusion import fuse
    from llampy.ggml.tensor import Op
    g, *_ = _conv_layer(CPUBackend(), 4, 16, 1, 1, 2, np.random.default_rng(0), extra_reader=True)
    g2, n = fuse(g, CPUBackend())
    assert Op.SSM_CONV_STATE not in {t.op for t in g2.nodes} and Op.SSM_CONV in {t.op for t in g2.nodes}


def _gate_graph(dev, head_dim, n_head, n_t, n_s, rng, extra_reader=False):
    """Mamba-2's tail after the scan (models/mamba2.py): z a view of the in-projection's rows, x a view of the
    convolution's, y = y + x * D, then swiglu(cont(z), y): (graph, the inputs, output)."""
    from llampy.ggml import ops
    from llampy.ggml.graph import Graph
    from llampy.ggml.tensor import Tensor
    from llampy.ggml.types import GGMLType as T
    from tests.ggml.fakes import weight
    d_inner = head_dim * n_head
    zx = Tensor(T.F32, (3 * d_inner + 5, n_t, n_s), name="zx").set_input()       # z, then x further in each row
    y = Tensor(T.F32, (head_dim, n_head, n_t, n_s), name="y").set_input()
    d = weight(dev, (1, n_head), rng)
    z = ops.view_4d(zx, head_dim, n_head, n_t, n_s, head_dim * 4, zx.nb[1], zx.nb[2], 0)
    x = ops.view_4d(zx, head_dim, n_head, n_t, n_s, head_dim * 4, zx.nb[1], zx.nb[2], (d_inner + 3) * 4)
    skip = ops.add(y, ops.mul(x, d))
    g = Graph()
    if extra_reader:                     # the skip read by another node: nothing fuses
        g.expand(ops.scale(skip, 0.5).set_output())
    out = ops.swiglu(ops.cont(z), skip)
    g.expand(out.set_output())
    return g, (zx, y), out


@pytest.mark.parametrize("head_dim,n_head,n_t,n_s", [(64, 4, 3, 2), (40, 3, 1, 1), (72, 2, 2, 1), (64, 32, 32, 1)])
def test_mamba2_gate_fuses_to_the_same_bits(head_dim, n_head, n_t, n_s):
    """swiglu(cont(z), y + x * D) after Mamba-2's scan becomes one SSM_GATE node on the CPU with the nodes' own bits
    (head_dim 64: 16-lane steps only; 40: an 8-lane step on AVX2 and scalars; 72: scalars after the vectors), one
    thread and several (64 x 32 x 32: the parallel build); the reference backend's kernel of the fused node agrees
    within float rounding."""
    import numba
    from llampy.ggml.backend import tensor_data
    from llampy.ggml.backends.cpu.backend import CPUBackend
    from llampy.ggml.backends.reference import ReferenceBackend
    from llampy.ggml.sched import Scheduler
    from llampy.ggml.tensor import Op

    class Unfused(CPUBackend):
        def graph_optimize(self, graph_nodes, nodes):
            return nodes

    def run(dev):
        rng = np.random.default_rng(head_dim + n_t)
        g, ins, out = _gate_graph(dev, head_dim, n_head, n_t, n_s, rng)
        sched = Scheduler([dev])
        sched.alloc_graph(g)
        for t in ins:
            tensor_data(t)[...] = (rng.standard_normal(tensor_data(t).shape) * 4).astype(np.float32)
        sched.graph_compute(g)
        return {n.op for n in g.nodes}, np.array(tensor_data(out))

    ops_u, o_u = run(Unfused())
    assert Op.SSM_GATE not in ops_u
    was = numba.get_num_threads()
    try:
        for th in (1, 2):
            numba.set_num_threads(min(th, numba.config.NUMBA_NUM_THREADS))
            ops_f, o_f = run(CPUBackend())
            assert Op.SSM_GATE in ops_f and not ops_f & {Op.ADD, Op.MUL, Op.CONT, Op.SWIGLU}
            assert np.array_equal(o_f.view(np.uint32), o_u.view(np.uint32))
    finally:
        numba.set_num_threads(was)
    _, o_r = run(ReferenceBackend())
    np.testing.assert_allclose(o_f, o_r, rtol=1e-5, atol=1e-5)


def test_mamba2_gate_not_fused_when_the_skip_has_another_reader():
    from llampy.ggml.backends.cpu.backend import CPUBackend
    from llampy.ggml.fusion import fuse
    from llampy.ggml.tensor import Op
    g, *_ = _gate_graph(CPUBackend(), 16, 2, 1, 1, np.random.default_rng(0), extra_reader=True)
    g2, n = fuse(g, CPUBackend())
    assert Op.SSM_GATE not in {t.op for t in g2.nodes} and Op.SWIGLU in {t.op for t in g2.nodes}
