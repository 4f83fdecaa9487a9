"""Handing freed heap memory back to the system.

Unpickling a save's rank files makes and drops millions of small objects (one tree per rank, trimmed as each is
checked); glibc keeps the freed pages in its heaps, so the peak of reading stays resident through the whole
conversion. ``malloc_trim(0)`` returns every free page, in the middle of a heap too. Elsewhere (musl, macOS) it is
a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable

__all__ = ["give_back_freed"]


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim  # type: ignore[no-any-return]


def give_back_freed() -> None:
    """Return the heap's free pages to the system (glibc), after a phase that freed many small objects."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
