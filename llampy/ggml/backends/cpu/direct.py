"""A plan's call that is one Numba kernel call with its arguments fixed at bind time: ``Direct(kernel, *args)``.

A decoded token runs a few hundred bound calls, most of them small (SmolLM2: 363, of 1-70 us each). Each pays
Python's frame for the binder's closure, then Numba's dispatcher typing every argument before the compiled code runs:
0.65-0.72 us of CPU for seven arrays (a read-only weight, from the mapped file, takes the dispatcher's slow path).
``Direct`` runs ``kernel(*args)`` through the dispatcher until the kernel has been compiled for those argument types
(a plan's first run, or a cached kernel's load), then ``resolve()`` gives ``functools.partial(entry_point, *args)``:
the compiled function's own wrapper, which unboxes the arguments and runs (0.32 us for the same seven; no Python
frame of ours, no type dispatch). The arguments are the plan's bound views, the same objects every run, so the
types the dispatcher would find are the ones resolved.

A binder returns a ``Direct`` where its call is exactly one kernel call, or gives its checked closure a
``direct`` attribute: the tuple of calls (``Direct`` or any callable) that the closure makes when its check passes
(``matmul``'s products, under the row limit they were bound at). The plan resolves them after its first run
(``resolve_calls``)."""
from __future__ import annotations

import functools


def prange_only() -> dict:
    """Numba's ``parallel=`` options for a kernel whose only parallel loop is its ``prange``: with
    ``parallel=True`` Numba also turns each array allocation and array expression of the kernel's serial part
    (``np.zeros``, ``a[:] = b``, element-wise arithmetic) into a parallel region of its own, started and joined
    on every call. A decode step's whole-row product (``dot_whole``) lays out its activations that way before its
    ``prange``: ~4.5 us of a call on one thread and ~6 us on two went to those regions (Q4_1, 8 activation rows,
    192 to 1536 weight rows: 27.1 -> 21.2 us at 192 rows, two threads), some 210 calls in a SmolLM2 step. The
    same loops, run by the calling thread, give the same values. A new dict on every call: Numba's
    ``ParallelOptions`` empties the dict it is given."""
    return dict(comprehension=False, reduction=False, inplace_binop=False, setitem=False, numpy=False,
                stencil=False, fusion=False, prange=True)


class Prepare:
    """A step that the calls after it in a run rely on, which another step of the same ``key`` repeats for nothing:
    refilling the cos/sin tables of a positions input, testing that an input's row indices are in range. Steps of
    one key do the same thing over memory that no node of the graph writes (its inputs, its weights), and nothing
    else in the run writes what they prepare, so ``resolve_calls`` keeps the first of each key in a plan and drops
    the others (the checked closures still make every one)."""
    __slots__ = ("fn", "key")

    def __init__(self, fn, key):
        self.fn = fn
        self.key = key

    def __call__(self):
        return self.fn()


class Direct:
    """kernel(*args) for a Numba dispatcher ``kernel``; ``resolve()``: the same call bound to its compiled entry
    point once there is one for these arguments, else this object."""
    __slots__ = ("kernel", "args")

    def __init__(self, kernel, *args):
        self.kernel = kernel
        self.args = args

    def __call__(self):
        return self.kernel(*self.args)

    @property
    def direct(self) -> tuple:
        return (self,)

    def resolve(self):
        k = self.kernel
        overloads = getattr(k, "overloads", None)
        if overloads is None:
            return self
        cres = overloads.get(tuple(k.typeof_pyval(a) for a in self.args))
        if cres is None or cres.objectmode:
            return self
        return functools.partial(cres.entry_point, *self.args)


def resolve_calls(calls: list) -> list:
    """The plan's calls with each one that says what it runs (``direct``) replaced by those calls, resolved; a
    ``Prepare`` of a key met before is dropped."""
    out = []
    done = set()
    for c in calls:
        d = getattr(c, "direct", None)
        if d is None:
            out.append(c)
            continue
        for x in d:
            if isinstance(x, Prepare):
                if x.key not in done:
                    done.add(x.key)
                    out.append(x.fn)
            else:
                out.append(x.resolve() if isinstance(x, Direct) else x)
    return out
