"""Give freed host memory back to the operating system during long CPU runs.

Poisson sampling makes every logical batch a different size, so each step allocates activation and per-example
gradient buffers of new shapes. glibc's malloc raises its mmap threshold after the first large frees, after which
those buffers come from the heap, and the heap's free space stays mapped and fragments: a bk loop on MiniLM's SNLI
head grew from 1.0 to 2.4 GB in 120 Poisson-sized steps with no tensor alive (``docs/pitfalls.md``).
``malloc_trim(0)`` every few steps returns that free space: flat at ~0.9 GB, for ~9 % more time in that loop.
Not an allocator of our own: one libc call, a no-op where libc has no ``malloc_trim`` (macOS, musl).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

#: CPU model-task steps between two trims (every step costs ~25 % of a MiniLM head step; every 10th, ~9 %)
TRIM_EVERY = 10


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        fn = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def release_free_memory() -> bool:
    """Return the heap's free pages to the OS; False where libc has no ``malloc_trim``."""
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True
