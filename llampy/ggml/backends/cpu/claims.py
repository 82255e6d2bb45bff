"""Work items handed out as threads ask for them (ggml's chunk counter, ``ggml_threadpool_chunk_add``).

Numba's ``prange`` splits its range over the threads up front, in equal runs: a thread that loses its core for a
while (another process, the host taking the virtual CPU) holds the whole op back while the other waits. A kernel
whose items are independent can instead run one worker per thread, each taking the next item from a shared
counter until none is left::

    counter = np.zeros(1, np.int64)
    for _ in prange(n_workers):             # n_workers = workers(n_items), from the caller
        while True:
            it = claim(counter)
            if it >= n_items:
                break
            ...item it...

Which thread computes an item changes no result.
"""
from __future__ import annotations

from llvmlite import ir
from numba import get_num_threads, types
from numba.np.ufunc import parallel as _parallel
from numba.extending import intrinsic


@intrinsic
def claim(typingctx, counter):
    """``counter[0] += 1`` as one atomic operation (a contiguous int64 array); returns the value before."""
    if not isinstance(counter, types.Array) or counter.dtype != types.int64:
        return None

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        return builder.atomic_rmw("add", ary.data, ir.Constant(ir.IntType(64), 1), "monotonic")
    return types.int64(counter), codegen


def workers(n_items: int) -> int:
    """As many workers as threads, at most one per item (a kernel's argument: a call to Numba's thread count
    inside a kernel would keep it out of the cache). Once Numba's pool runs, its thread count is read directly
    (``_get_num_threads``, 0.16 us) rather than through ``get_num_threads``, which checks the pool first (1.8 us, on
    every product of a decode step)."""
    try:
        n = _parallel._get_num_threads()
    except AttributeError:          # the pool is not started yet
        n = get_num_threads()
    return max(1, min(n, n_items))
