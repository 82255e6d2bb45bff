"""LLVM's code pages out of the resident set once a kernel is loaded.

Numba links every kernel through LLVM, the cached ones too (their object code goes through LLVM's JIT linker), and
each first call touches more of libllvmlite: by the first token ~45 MiB of its code and read-only data are resident,
a sixth of the process's peak RSS on SmolLM2, and none of it runs again until another kernel loads. These pages
are clean file pages: the library file holds exactly their contents.

``install()`` wraps ``Dispatcher.compile`` (the path of every first call, cache hit or compilation). After it
returns, the library's mappings that are read-only and were never written (no private copies resident or swapped:
the relocated data is excluded) are dropped from this process with ``madvise(MADV_DONTNEED)``. They stay in the
page cache, so the next load maps them back without reading the disk. Measured (``llampy bench`` SmolLM2 pp512 +
tg128, peak RSS): 272 -> 233 MiB; 24 loads, 31 ms of madvise in all.

``LLAMPY_KEEP_LLVM_PAGES=1`` turns it off. Linux only; any failure leaves the pages as they are.
"""
from __future__ import annotations

import os
import re
import sys

_MADV_DONTNEED = 4
_installed = False
_ranges: list | None = None
_madvise = None


def clean_readonly_ranges(name: str = "libllvmlite") -> list:
    """(start, end) of this process's mappings of the file ``name`` that are not writable and hold no private
    (copied-on-write) pages, resident or swapped: the ones whose contents are the file's."""
    out, cur, ok = [], None, True
    with open("/proc/self/smaps") as f:
        for line in f:
            if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
                if cur is not None and ok:
                    out.append(cur)
                parts = line.split()
                cur, ok = None, True
                if name in line and "w" not in parts[1] and len(parts) > 5:
                    a, b = (int(x, 16) for x in parts[0].split("-"))
                    cur = (a, b)
            elif cur is not None and line.startswith(("Anonymous:", "Swap:", "Private_Dirty:")):
                if int(line.split()[1]) != 0:
                    ok = False
    if cur is not None and ok:
        out.append(cur)
    return out


def release() -> None:
    """Drop libllvmlite's clean read-only pages from this process (they stay in the page cache)."""
    global _ranges, _madvise
    if _ranges is None:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        _madvise = libc.madvise
        _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _ranges = clean_readonly_ranges()
    for a, b in _ranges:
        _madvise(a, b - a, _MADV_DONTNEED)


def install() -> None:
    """Release the pages after every kernel load or compilation (see the module doc)."""
    global _installed
    if _installed or not sys.platform.startswith("linux") or os.environ.get("LLAMPY_KEEP_LLVM_PAGES") == "1":
        return
    try:
        from numba.core.dispatcher import Dispatcher
        release()
    except Exception:       # no /proc, no libc madvise, a Numba without this method: keep the pages
        return
    compile_ = Dispatcher.compile

    def compile(self, sig):
        try:
            return compile_(self, sig)
        finally:
            try:
                release()
            except Exception:
                pass

    compile.__doc__ = compile_.__doc__
    Dispatcher.compile = compile
    _installed = True
