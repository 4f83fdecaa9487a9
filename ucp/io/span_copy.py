"""Copying a record's parts (byte spans of files, bytes in memory, pieces cast to another dtype) into an output
file: in tasks of about ``_RANGE`` bytes, each filling one reused buffer and writing it with one ``pwrite``, every
part CRC'd while hot.

A record of many small spans (a rank's flat buffer cut from 10^5 parameters' slices) costs a read per span and a
write per buffer, not a write and a task per span. A record of at least ``PARALLEL_MIN`` bytes (an embedding,
stacked experts, a module weight cast from its master) has its tasks copied by a pool of threads at their own
offsets; the parts' CRCs are combined in order, so the record's crc32 is the one a single pass gives, and each
:class:`PathSpan` witness learns its span's (a cast reads its spans without telling their witnesses: its bytes are
not theirs).

The writer that owns the output file (:mod:`ucp.io.torchzip`) hands a record's parts here; its file position is
left untouched (every write is positional), the caller moves it past the record. One shared pool serves every
writer thread: a parameter's writer waits on its tasks, never the reverse.
"""

from __future__ import annotations

import os
import threading
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import nullcontext
from functools import partial

import torch

from ucp.io.crc import crc32_combine
from ucp.io.read_ahead import ReadAhead
from ucp.model.pieces import Cast, FileSpan, PathSpan, Span

__all__ = ["PARALLEL_MIN", "Copied", "copy_threads", "set_copy_threads", "copy_spans", "read_witnessed", "write_all_at"]

#: a record whose spans hold at least this many bytes is copied by the pool
PARALLEL_MIN = 64 << 20
#: the bytes one task copies
_RANGE = 16 << 20
#: one buffer per thread; a bytes part at least this big is written from its own memory
_CHUNK = 2 << 20
_SCRATCH = threading.local()
_LOCK = threading.Lock()
_POOL: ThreadPoolExecutor | None = None
_THREADS = max(1, min(8, os.cpu_count() or 1))

#: what a record is copied from: spans of files, bytes already in memory, or pieces converted as they are copied
Copied = Span | Cast | bytes | memoryview


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


#: bytes ``[skip, skip + nbytes)`` of part ``index`` (a span, or bytes in memory): a plain tuple, made once per
#: span (a restore of 10^5 parameters from DP 4096 cuts millions of spans)
_Segment = tuple[int, Copied, int, int]
#: what a task gives back: the crc32 of all it wrote, and (index, crc32, nbytes) of each segment of a witnessed span
_TaskCrc = tuple[int, list[tuple[int, int, int]]]


def _witnessed(part: Copied) -> bool:
    """Whether a part's own crc32 is wanted (a :class:`PathSpan` whose reader checks its file from this copy)."""
    return type(part) is PathSpan and part.witness is not None


def write_all_at(fd: int, view: memoryview, at: int) -> None:
    """Write all of ``view`` at offset ``at`` of ``fd``."""
    while len(view):
        done = os.pwrite(fd, view, at)
        if done <= 0:
            raise OSError("pwrite wrote nothing")
        view, at = view[done:], at + done


def _scratch() -> memoryview:
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or len(buf) != _CHUNK:
        buf = _SCRATCH.buf = memoryview(bytearray(_CHUNK))
    return buf


def _copy_task(fd: int, segments: Sequence[_Segment], at: int) -> _TaskCrc:
    """Write ``segments`` one after another from offset ``at`` on; returns the crc32 of all of it, and each
    witnessed segment's own."""
    buf, fill, run = _scratch(), 0, 0
    own: list[tuple[int, int, int]] = []
    for index, part, skip, nbytes in segments:
        witnessed = _witnessed(part)
        start = 0 if witnessed else run  # a witnessed span's crc32 is its own, folded into the run after
        if isinstance(part, (FileSpan, PathSpan)) and nbytes <= _CHUNK - fill:  # fits: one read, no staging
            dst = buf[fill : fill + nbytes]
            part.read_into(dst, skip)
            crc, fill = zlib.crc32(dst, start), fill + nbytes
        elif isinstance(part, (FileSpan, PathSpan)):
            with nullcontext(part) if isinstance(part, FileSpan) else part.opened() as source:
                fill, at, crc = _fill(fd, buf, fill, at, nbytes, partial(_read, source, skip), start)
        elif isinstance(part, Cast):
            fill, at, crc = _fill(fd, buf, fill, at, nbytes, partial(_cast, part, skip), start)
        else:
            view = memoryview(part).cast("B")[skip : skip + nbytes]
            if nbytes < _CHUNK:
                fill, at, crc = _fill(fd, buf, fill, at, nbytes, partial(_put, view), start)
            else:  # big enough to go from its own memory
                write_all_at(fd, buf[:fill], at)
                at, fill = at + fill, 0
                write_all_at(fd, view, at)
                at, crc = at + nbytes, zlib.crc32(view, start)
        if witnessed:
            own.append((index, crc, nbytes))
            run = crc32_combine(run, crc, nbytes)
        else:
            run = crc
    write_all_at(fd, buf[:fill], at)
    return run, own


def _put(view: memoryview, dst: memoryview, done: int) -> None:
    dst[:] = view[done : done + len(dst)]


def _read(source: FileSpan, skip: int, dst: memoryview, done: int) -> None:
    source.read_into(dst, skip + done)


def _staging(dtype: torch.dtype, numel: int) -> torch.Tensor:
    """This thread's buffer for what a cast reads from files before converting (reused: a fresh one per chunk
    would leave freed chunks in every thread's malloc arena)."""
    buf = getattr(_SCRATCH, "staging", None)
    if buf is None or buf.dtype != dtype or buf.numel() < numel:
        buf = _SCRATCH.staging = torch.empty(max(numel, _CHUNK // 2), dtype=dtype)
    return buf


def _cast(part: Cast, skip: int, dst: memoryview, done: int) -> None:
    item = part.dtype.itemsize
    first, rest = divmod(skip + done, item)
    if rest or len(dst) % item:  # buffers and tasks are whole multiples of any element, and a cast is its own record
        raise ValueError(f"a cast record copied from byte {skip + done} for {len(dst)} bytes: not whole elements")
    numel = len(dst) // item
    part.fill(first, torch.frombuffer(dst, dtype=part.dtype), _staging(part.source.dtype, numel))


def _fill(
    fd: int, buf: memoryview, fill: int, at: int, nbytes: int, read: Callable[[memoryview, int], None], crc: int
) -> tuple[int, int, int]:
    """Move ``nbytes`` into ``buf`` behind its first ``fill`` bytes (``read(dst, done)`` fills ``dst`` with the
    bytes from ``done`` on), extending ``crc`` over them, writing ``buf`` at ``at`` each time it is full; returns
    the new fill, the new offset of ``buf`` and the crc32."""
    done = 0
    while done < nbytes:
        n = min(_CHUNK - fill, nbytes - done)
        read(buf[fill : fill + n], done)
        crc = zlib.crc32(buf[fill : fill + n], crc)
        fill, done = fill + n, done + n
        if fill == _CHUNK:
            write_all_at(fd, buf[:fill], at)
            at, fill = at + fill, 0
    return fill, at, crc


def _nbytes(part: Copied) -> int:
    return part.nbytes if isinstance(part, (FileSpan, PathSpan, Cast)) else memoryview(part).nbytes


def _tasks(parts: Sequence[Copied], at: int) -> list[tuple[list[_Segment], int, int]]:
    """The parts cut into tasks of about ``_RANGE`` bytes each, with each task's first output offset and bytes."""
    tasks: list[tuple[list[_Segment], int, int]] = []
    current: list[_Segment] = []
    start, fill = at, 0
    for index, part in enumerate(parts):
        size = _nbytes(part)
        if fill + size < _RANGE:  # most spans: whole, inside the task
            current.append((index, part, 0, size))
            fill += size
            continue
        skip = 0
        while skip < size:
            n = min(_RANGE - fill, size - skip)
            current.append((index, part, skip, n))
            skip, fill = skip + n, fill + n
            if fill == _RANGE:
                tasks.append((current, start, fill))
                current, start, fill = [], start + fill, 0
    if current:
        tasks.append((current, start, fill))
    return tasks


def copy_spans(fd: int, parts: Sequence[Copied], at: int, crc: int, *, parallel: bool = True) -> int:
    """Write ``parts`` (spans and byte strings) to ``fd`` from offset ``at`` on, by the pool when ``parallel`` and
    the pool has more than one thread, else in the caller; returns ``crc`` extended by everything written. Each
    :class:`PathSpan` witness learns its span's crc32."""
    tasks = _tasks(parts, at)
    results: list[_TaskCrc]
    if parallel and copy_threads() > 1 and len(tasks) > 1:
        pool = _pool()
        futures: list[Future[_TaskCrc]] = [pool.submit(_copy_task, fd, segs, start) for segs, start, _ in tasks]
        # every task is done before any result is read: a failed one must not leave others writing to ``fd``
        wait(futures)
        results = [f.result() for f in futures]
    else:
        results = [_copy_task(fd, segs, start) for segs, start, _ in tasks]
    own: dict[int, int] = {}  # a witnessed span's crc32, from its segments' (a span can cross tasks)
    for (_, _, task_bytes), (run, witnessed) in zip(tasks, results):
        crc = crc32_combine(crc, run, task_bytes)
        for index, seg_crc, nbytes in witnessed:
            own[index] = crc32_combine(own.get(index, 0), seg_crc, nbytes)
    for index, part_crc in own.items():
        part = parts[index]
        assert isinstance(part, PathSpan) and part.witness is not None
        part.witness(part.offset, part.nbytes, part_crc)
    return crc


def read_witnessed(parts: Sequence[Span | torch.Tensor], out: memoryview, ahead: ReadAhead | None = None) -> None:
    """Fill ``out`` with the parts' bytes, in order (tensors copied from memory), each :class:`PathSpan` witness told
    its span's crc32: a reader that hands out spans before checking their files then checks them from this read.
    ``ahead``: the caller's windows over open files, for a walk that reads each file forward in small steps."""
    pos = 0
    for part in parts:
        if isinstance(part, (FileSpan, PathSpan)):
            dst = out[pos : pos + part.nbytes]
            if ahead is not None and type(part) is FileSpan:
                ahead.read(part, dst)
            else:
                part.read_into(dst)
            if isinstance(part, PathSpan) and part.witness is not None:
                part.witness(part.offset, part.nbytes, zlib.crc32(dst))
            pos += part.nbytes
        else:
            data = memoryview(part.detach().reshape(-1).contiguous().view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]
            out[pos : pos + len(data)] = data
            pos += len(data)
    if pos != len(out):
        raise ValueError(f"parts of {pos} bytes read into {len(out)}")
