"""numpy's own OpenBLAS, reached without going through numpy: its thread count, and ``sgemm``, a float32 matrix
product that Numba kernels call directly (a ``cblas_sgemm`` call through its address: no Python between the
products, so a kernel can issue many small ones, as the causal attention tiles do).

numpy's wheels bundle OpenBLAS with 64-bit integers and suffixed names (``scipy_cblas_sgemm64_`` in numpy 2,
``cblas_sgemm64_`` before). Where neither is found (a numpy linked against another BLAS), ``sgemm_address()`` is 0
and callers keep their numpy path.
"""
from __future__ import annotations

import ctypes
import glob
import os

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .simd import _elem_ptr

_LIB = None


def _openblas():
    """The bundled OpenBLAS as a ctypes library, or False."""
    global _LIB
    if _LIB is None:
        _LIB = False
        libdir = os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs")
        for path in sorted(glob.glob(os.path.join(libdir, "*openblas*.so*"))):
            try:
                _LIB = ctypes.CDLL(path)
                break
            except OSError:
                continue
    return _LIB


def _symbol(names):
    lib = _openblas()
    for name in names if lib else ():
        fn = getattr(lib, name, None)
        if fn is not None:
            return fn
    return None


def set_threads(n: int) -> bool:
    """Thread count of numpy's OpenBLAS, for the whole process (``llampy.tuning`` sets 1); False where it cannot be
    found."""
    fn = _symbol(("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
                  "openblas_set_num_threads64_", "openblas_set_num_threads"))
    if fn is None:
        return False
    fn.argtypes = [ctypes.c_int]
    fn(int(n))
    return True


def get_threads() -> int:
    """Thread count of numpy's OpenBLAS; 0 where it cannot be found."""
    fn = _symbol(("scipy_openblas_get_num_threads64_", "scipy_openblas_get_num_threads",
                  "openblas_get_num_threads64_", "openblas_get_num_threads"))
    if fn is None:
        return 0
    fn.restype = ctypes.c_int
    return int(fn())


_SGEMM = None


def sgemm_address() -> int:
    """Address of the bundled ``cblas_sgemm`` with 64-bit integers, or 0 where there is none (looked up once)."""
    global _SGEMM
    if _SGEMM is None:
        fn = _symbol(("scipy_cblas_sgemm64_", "cblas_sgemm64_"))
        _SGEMM = ctypes.cast(fn, ctypes.c_void_p).value if fn is not None else 0
    return _SGEMM


_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112


@intrinsic
def sgemm(typingctx, fn, trans_b, m, n, k, a, ao, lda, b, bo, ldb, beta, c, co, ldc):
    """C = A op(B) + beta C through the cblas_sgemm at address ``fn``, row-major: A is m x k from element ``ao`` of
    a (row stride lda), op(B) is k x n from element ``bo`` of b (B stored n x k and transposed when trans_b, row
    stride ldb), C m x n from element ``co`` of c (row stride ldc). a, b, c: float32 arrays; offsets and strides
    count elements. The caller keeps every row inside its array."""
    if not all(isinstance(x, types.Array) and x.dtype == types.float32 for x in (a, b, c)):
        return None
    sig = types.void(fn, trans_b, m, n, k, a, ao, lda, b, bo, ldb, beta, c, co, ldc)

    def codegen(context, builder, signature, args):
        i32, i64, f32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
        fp = f32.as_pointer()
        fnty = ir.FunctionType(ir.VoidType(), [i32, i32, i32, i64, i64, i64, f32, fp, i64, fp, i64, f32, fp, i64])
        target = builder.inttoptr(args[0], fnty.as_pointer())
        sa = signature.args

        def i(x, t):
            return context.cast(builder, x, t, types.int64)

        def f(x, t):
            return context.cast(builder, x, t, types.float32)
        tb = builder.select(builder.icmp_unsigned("!=", context.cast(builder, args[1], sa[1], types.int64),
                                                  ir.Constant(i64, 0)),
                            ir.Constant(i32, _TRANS), ir.Constant(i32, _NO_TRANS))
        builder.call(target, [
            ir.Constant(i32, _ROW_MAJOR), ir.Constant(i32, _NO_TRANS), tb,
            i(args[2], sa[2]), i(args[3], sa[3]), i(args[4], sa[4]), ir.Constant(f32, 1.0),
            _elem_ptr(context, builder, sa[5], args[5], i(args[6], sa[6]), f32), i(args[7], sa[7]),
            _elem_ptr(context, builder, sa[8], args[8], i(args[9], sa[9]), f32), i(args[10], sa[10]),
            f(args[11], sa[11]),
            _elem_ptr(context, builder, sa[12], args[12], i(args[13], sa[13]), f32), i(args[14], sa[14])])
        return context.get_dummy_value()
    return sig, codegen
