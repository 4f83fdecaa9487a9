"""Copying one large record's spans with several threads: a tensor of gigabytes (an embedding, stacked experts) is
cut into ranges that threads copy with ``pread`` / ``pwrite`` at their own offsets, each range CRC'd while hot;
the range CRCs are combined in order, so the record's crc32 is the one a single pass gives.

The writer that owns the output file (:mod:`ucp.io.torchzip`) hands a record's parts here when they are big enough
to be worth it; its file position is left untouched (every write is positional), the caller moves it past the
record. One shared pool serves every writer thread: a parameter's writer waits on its ranges, never the reverse.
"""

from __future__ import annotations

import os
import threading
import zlib
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

from ucp.io.crc import crc32_combine
from ucp.model.pieces import FileSpan, PathSpan, Span

__all__ = ["PARALLEL_MIN", "copy_threads", "set_copy_threads", "copy_spans"]

#: a record whose spans hold at least this many bytes is copied by the pool
PARALLEL_MIN = 64 << 20
#: the bytes one task copies
_RANGE = 16 << 20
_CHUNK = 2 << 20
_SCRATCH = threading.local()
_LOCK = threading.Lock()
_POOL: ThreadPoolExecutor | None = None
_THREADS = max(1, min(8, os.cpu_count() or 1))


def copy_threads() -> int:
    """How many threads copy one large record (default: the cores, up to 8)."""
    return _THREADS


def set_copy_threads(threads: int) -> None:
    """Set the pool's size (``--workers``: the same budget as the parameters' pool); 1 copies in the caller."""
    global _POOL, _THREADS
    with _LOCK:
        if threads != _THREADS and _POOL is not None:
            _POOL.shutdown(wait=True)
            _POOL = None
        _THREADS = max(1, threads)


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(_THREADS, thread_name_prefix="ucp-copy")
        return _POOL


def _pwrite_all(fd: int, view: memoryview, at: int) -> None:
    while len(view):
        done = os.pwrite(fd, view, at)
        if done <= 0:
            raise OSError("pwrite wrote nothing")
        view, at = view[done:], at + done


def _copy_range(fd: int, span: Span, skip: int, nbytes: int, at: int) -> int:
    """Bytes ``[skip, skip + nbytes)`` of ``span`` to ``fd`` at ``at``; their crc32."""
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None:
        buf = _SCRATCH.buf = memoryview(bytearray(_CHUNK))
    done, crc = 0, 0
    with span.opened() as source:
        while done < nbytes:
            chunk = buf[: min(_CHUNK, nbytes - done)]
            source.read_into(chunk, skip + done)
            crc = zlib.crc32(chunk, crc)
            _pwrite_all(fd, chunk, at + done)
            done += len(chunk)
    return crc


def copy_spans(fd: int, parts: Sequence[Span | bytes | memoryview], at: int, crc: int) -> int:
    """Write ``parts`` (spans and small byte strings) to ``fd`` from offset ``at`` on, the spans in ranges by the
    pool; returns ``crc`` extended by everything written. Each :class:`PathSpan` witness learns its span's crc32."""
    pieces: list[tuple[list[tuple[Future[int] | int, int]], Span | None]] = []
    pool = _pool()
    for part in parts:
        if isinstance(part, (FileSpan, PathSpan)):
            ranges: list[tuple[Future[int] | int, int]] = []
            for skip in range(0, part.nbytes, _RANGE):
                n = min(_RANGE, part.nbytes - skip)
                ranges.append((pool.submit(_copy_range, fd, part, skip, n, at + skip), n))
            pieces.append((ranges, part))
            at += part.nbytes
        else:
            view = memoryview(part).cast("B")
            _pwrite_all(fd, view, at)
            pieces.append(([(zlib.crc32(view), len(view))], None))
            at += len(view)
    # every range is done before any result is read: a failed one must not leave others writing to ``fd``
    wait([done for ranges, _ in pieces for done, _ in ranges if isinstance(done, Future)])
    for ranges, span in pieces:
        own = 0
        for done, n in ranges:
            own = crc32_combine(own, done.result() if isinstance(done, Future) else done, n)
        witness = getattr(span, "witness", None)
        if witness is not None and span is not None:
            witness(span.offset, span.nbytes, own)
        crc = crc32_combine(crc, own, sum(n for _, n in ranges))
    return crc
