"""Reading many small spans of files into memory with few system calls.

A target written from 10^5 small parameters reads each one's slice of every source rank's flat buffer: a few KB
each, millions of reads in all, at about 10 µs of ``pread`` apiece. Those slices lie next to each other in
their files (a rank's flat buffer is its members' slices in order), so a batch of them is read file by file in
offset order, each run of adjacent spans with one ``preadv`` into the spans' own destinations (a gap of at most
:data:`GAP_MAX` bytes between two spans is read into a scratch buffer rather than breaking the run).
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Sequence

import torch

from ucp.model.pieces import FileSpan, PathSpan, Span, open_checked, pread_into

__all__ = ["GAP_MAX", "read_many", "read_witnessed"]

#: bytes between two spans of one file read and dropped rather than splitting their ``preadv``
GAP_MAX = 64 << 10
#: buffers one ``preadv`` fills (Linux's IOV_MAX)
_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024)
#: where gaps are read to (their bytes are never looked at, so threads may share it)
_GAP = memoryview(bytearray(GAP_MAX))

#: a read: a span and where its bytes go
_Read = tuple[Span, memoryview]


def read_witnessed(parts: Sequence[Span | torch.Tensor], out: memoryview) -> None:
    """Fill ``out`` with the parts' bytes, in order (tensors copied from memory), each :class:`PathSpan` witness told
    its span's crc32: a reader that hands out spans before checking their files then checks them from this read."""
    read_many([(parts, out)])


def read_many(jobs: Sequence[tuple[Sequence[Span | torch.Tensor], memoryview]]) -> None:
    """:func:`read_witnessed` for each (parts, out) of ``jobs``, the file spans of them all read together: each file
    once (a :class:`PathSpan`'s opened once and checked against its stamp), in offset order, adjacent spans with
    one ``preadv``."""
    by_file: dict[object, list[_Read]] = {}
    for parts, out in jobs:
        pos = 0
        for part in parts:
            if isinstance(part, (FileSpan, PathSpan)):
                if part.nbytes:
                    key = (part.path, part.stamp) if isinstance(part, PathSpan) else id(part.file)
                    by_file.setdefault(key, []).append((part, out[pos : pos + part.nbytes]))
                pos += part.nbytes
            else:
                data = memoryview(part.detach().reshape(-1).contiguous().view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]
                out[pos : pos + len(data)] = data
                pos += len(data)
        if pos != len(out):
            raise ValueError(f"parts of {pos} bytes read into {len(out)}")
    for reads in by_file.values():
        first = reads[0][0]
        if isinstance(first, PathSpan):
            _read_path(first, reads)
        else:
            _read_runs(first.file.fileno(), reads, getattr(first.file, "name", "a file"))


def _read_path(first: PathSpan, reads: list[_Read]) -> None:
    """The reads of one file named by path: opened once, refused if it changed since it was checked, and each
    witnessed span's crc32 told to its witness."""
    fd = open_checked(first.path, first.stamp)
    try:
        _read_runs(fd, reads, first.path)
    finally:
        os.close(fd)
    for span, dst in reads:
        assert isinstance(span, PathSpan)
        if span.witness is not None:
            span.witness(span.offset, span.nbytes, zlib.crc32(dst))


def _read_runs(fd: int, reads: list[_Read], name: str) -> None:
    """One file's reads in offset order, a run of spans at most :data:`GAP_MAX` apart with one ``preadv``."""
    reads.sort(key=lambda r: r[0].offset)
    run: list[memoryview] = []
    start = end = 0
    for span, dst in reads:
        gap = span.offset - end
        if run and 0 <= gap <= GAP_MAX and len(run) < _IOV_MAX - 1:
            if gap:
                run.append(_GAP[:gap])
            run.append(dst)
        else:
            if run:
                _preadv_all(fd, run, start, name)
            run, start = [dst], span.offset
        end = span.offset + span.nbytes
    if run:
        _preadv_all(fd, run, start, name)


def _preadv_all(fd: int, views: list[memoryview], offset: int, name: str) -> None:
    """Fill ``views`` from ``offset`` on; a short read (the end of the file, or the kernel's cap on one call) is
    finished view by view."""
    got = os.preadv(fd, views, offset) if len(views) > 1 else None
    if got is None:
        pread_into(fd, views[0], offset, name)
        return
    pos = 0
    for view in views:
        if pos + len(view) > got:
            skip = max(0, got - pos)
            pread_into(fd, view[skip:], offset + pos + skip, name)
        pos += len(view)
