"""crc32 of a concatenation from the crc32s of its parts (zlib's crc32_combine), for one-pass checksums, and of a
mapped file without keeping it resident."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import zlib
from typing import Any

__all__ = ["crc32_combine", "crc32_mapped"]

#: bytes of a mapping checksummed before their pages are handed back
_WINDOW = 32 << 20


def crc32_mapped(data: mmap.mmap) -> int:
    """zlib.crc32 of a whole mapping, window by window, each window's pages dropped once summed: checking a
    4 GB file costs one window of resident memory, not the file (they are re-read from the page cache if
    touched again)."""
    crc = 0
    view = memoryview(data)
    try:
        for start in range(0, len(data), _WINDOW):
            end = min(start + _WINDOW, len(data))
            crc = zlib.crc32(view[start:end], crc)
            if len(data) > _WINDOW:
                try:
                    data.madvise(mmap.MADV_DONTNEED, start, end - start)
                except (OSError, ValueError):  # advisory only
                    pass
    finally:
        view.release()
    return crc


def _load_zlib_combine() -> Any:
    name = ctypes.util.find_library("z")
    try:
        lib = ctypes.CDLL(name or "libz.so.1")
        fn = getattr(lib, "crc32_combine64", None) or lib.crc32_combine
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_ulong
    fn.argtypes = [ctypes.c_ulong, ctypes.c_ulong, ctypes.c_int64]
    return fn


_ZLIB_COMBINE = _load_zlib_combine()


def _gf2_times(matrix: list[int], vector: int) -> int:
    total, i = 0, 0
    while vector:
        if vector & 1:
            total ^= matrix[i]
        vector >>= 1
        i += 1
    return total


def _gf2_square(matrix: list[int]) -> list[int]:
    return [_gf2_times(matrix, matrix[n]) for n in range(32)]


def _crc32_combine_py(crc1: int, crc2: int, len2: int) -> int:
    """zlib's crc32_combine in Python (used only where libz cannot be loaded)."""
    if len2 <= 0:
        return crc1
    odd = [0xEDB88320] + [1 << n for n in range(31)]
    even = _gf2_square(odd)
    odd = _gf2_square(even)
    while True:
        even = _gf2_square(odd)
        if len2 & 1:
            crc1 = _gf2_times(even, crc1)
        len2 >>= 1
        if not len2:
            break
        odd = _gf2_square(even)
        if len2 & 1:
            crc1 = _gf2_times(odd, crc1)
        len2 >>= 1
        if not len2:
            break
    return crc1 ^ crc2


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """crc32 of A+B from crc32(A), crc32(B) and len(B)."""
    if _ZLIB_COMBINE is not None:
        return int(_ZLIB_COMBINE(crc1, crc2, len2)) & 0xFFFFFFFF
    return _crc32_combine_py(crc1, crc2, len2)
