"""Two of Numba's compile-time copies made cheaper: most of a cold start was spent in ``copy.deepcopy``.

1. The inliner. The kernels are built from small ``@njit(inline="always")`` functions, inlined at the Numba IR
   level so that the block format (``kind``) is a constant when the loops are typed. Every inline copies the
   callee's IR twice (``InlineWorker.inline_ir``), block by block, each block with its own ``copy.deepcopy``; each
   of those copies the function's whole scope again (every ``ir.Var`` holds the scope), so one inline costs
   blocks x variables. cProfile of compiling ``_rest_q5_0`` (29 s under the profiler): 16 s in these copies, ~2 s
   in LLVM. Here the blocks of one callee copy share one deepcopy memo: the scope and each variable are copied
   once and shared by the copied blocks, as they are shared in the callee (the inliner already treats the equal
   scope copies as the one scope it asserts a function has).
2. Copy propagation (``ir_utils.copy_propagate``) deep-copies its data-flow state, a dict of sets of variable
   name pairs, once per fixed-point round; ``alias map`` analysis does the same with sets of names. Strings and
   tuples of strings are immutable, so a copy of the sets is the same value: made here without walking every
   tuple (3.2 of the 15.7 s of compiling ``mv_q4_k_x8`` under the profiler).

The compiled code is the same (the kernels' assembly compared equal, symbol names aside). Measured with an empty
cache (benchmarks/README.md, entry 33): ``_rest_q5_0`` 12.6 -> 7.9 s; ``llampy run`` to the first token, Gemma 3
63 -> 41 s. ``LLAMPY_NUMBA_STOCK_COPIES=1`` turns both off; with a Numba not laid out this way they do nothing.
"""
from __future__ import annotations

import copy
import os

_installed = False


class _InlineCopy:
    """Stands in for the ``copy`` module inside numba.core.inline_closurecall: while ``memos`` is set (during one
    ``inline_ir``), blocks of the same scope are deep-copied with one shared memo."""

    def __init__(self, block_type):
        self.block_type = block_type
        self.memos = None

    def deepcopy(self, x, memo=None):
        if memo is None and self.memos is not None and isinstance(x, self.block_type):
            memo = self.memos.setdefault(id(x.scope), {})
        return copy.deepcopy(x, memo)

    def __getattr__(self, name):
        return getattr(copy, name)


def _immutable_key(v) -> bool:
    return type(v) is str or (type(v) is tuple and all(type(e) is str for e in v))


class _SetsCopy:
    """Stands in for the ``copy`` module inside numba.core.ir_utils: a deep copy of a dict of sets of strings or
    tuples of strings is a dict of copied sets; anything else goes to ``copy.deepcopy``."""

    def deepcopy(self, x, memo=None):
        if memo is None and type(x) is dict and all(
                type(s) is set and all(_immutable_key(e) for e in s) for s in x.values()):
            return {k: set(s) for k, s in x.items()}
        return copy.deepcopy(x, memo)

    def __getattr__(self, name):
        return getattr(copy, name)


def install() -> None:
    global _installed
    if _installed or os.environ.get("LLAMPY_NUMBA_STOCK_COPIES") == "1":
        return
    _installed = True
    try:
        from numba.core import inline_closurecall as icc, ir, ir_utils
        inline_ir = icc.InlineWorker.inline_ir
        laid_out = icc.copy is copy and ir_utils.copy is copy
    except Exception:        # a Numba laid out differently: leave its compiler alone
        return
    if not laid_out:
        return
    shim = _InlineCopy(ir.Block)

    def inline_ir_shared(self, *args, **kwargs):
        outer, shim.memos = shim.memos, {}
        try:
            return inline_ir(self, *args, **kwargs)
        finally:
            shim.memos = outer

    inline_ir_shared.__doc__ = inline_ir.__doc__
    icc.copy = shim
    icc.InlineWorker.inline_ir = inline_ir_shared
    ir_utils.copy = _SetsCopy()
