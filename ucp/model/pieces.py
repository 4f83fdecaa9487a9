"""A tensor given as the pieces its bytes are concatenated from: slices of tensors or byte spans of files.

Lets a parameter's rank slices go from the shards straight into an output record (or into a
target rank's flat buffer) without ever joining them in memory.
"""

from __future__ import annotations

import bisect
import io
import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property

import torch

from ucp.errors import ChecksumError, CorruptFileError

__all__ = [
    "FileSpan",
    "PathSpan",
    "Span",
    "Part",
    "Pieces",
    "LazyTensor",
    "Cast",
    "Reserved",
    "Placeholder",
    "part_numel",
    "nbytes_of",
    "file_stamp",
    "open_checked",
]


@dataclass(frozen=True, slots=True)
class FileSpan:
    """``nbytes`` bytes at ``offset`` of an open file, copied with ``pread`` through a small reused
    buffer: nothing is mapped, so a span adds nothing to resident memory, and CRC and write both
    see bytes still hot in cache (measured 2x less CPU for the CRC than over a cold mmap)."""

    file: io.RawIOBase  # kept open by its owner (ucp.io.torchfile.TorchFile); closed -> ValueError, never another file
    offset: int
    nbytes: int

    def read_into(self, view: memoryview, skip: int = 0) -> None:
        """Fill ``view`` with the span's bytes from ``skip`` on."""
        _pread_into(self.file.fileno(), view, self.offset + skip, getattr(self.file, "name", "a file"))

    def narrow(self, skip: int, nbytes: int) -> FileSpan:
        """``nbytes`` of this span from byte ``skip`` on."""
        return FileSpan(self.file, self.offset + skip, nbytes)

    @contextmanager
    def opened(self) -> Iterator[FileSpan]:
        """The span, ready to read (its file is already open)."""
        yield self


@dataclass(frozen=True, slots=True)
class PathSpan:
    """``nbytes`` bytes at ``offset`` of the file at ``path``, opened only while they are copied.

    What a reader hands out when its spans must outlive any open file: a restore holds every
    parameter's spans while it writes rank after rank, and one descriptor per file would run out.
    ``stamp`` (:func:`file_stamp`) is the file as it was found; a file that changed since is
    refused when opened, never read. ``witness(offset, nbytes, crc32)``, when given, is told the
    crc32 of the bytes a writer streamed from the span: the reader checks the file with it later
    instead of reading it twice.
    """

    path: str
    offset: int
    nbytes: int
    stamp: tuple[int, ...]
    witness: Callable[[int, int, int], None] | None = field(default=None, compare=False, repr=False)

    def narrow(self, skip: int, nbytes: int) -> PathSpan:
        """``nbytes`` of this span from byte ``skip`` on."""
        return PathSpan(self.path, self.offset + skip, nbytes, self.stamp, self.witness)

    @contextmanager
    def opened(self) -> Iterator[FileSpan]:
        """The span on an open file, for as long as the ``with`` block runs."""
        try:
            handle = open(self.path, "rb", buffering=0)
        except OSError as err:
            raise CorruptFileError(f"cannot open {self.path}: {err.strerror}") from None
        with handle:
            if file_stamp(os.fstat(handle.fileno())) != self.stamp:
                raise ChecksumError(f"{self.path} changed after it was checked: the input changed during the run")
            yield FileSpan(handle, self.offset, self.nbytes)

    def read_into(self, view: memoryview, skip: int = 0) -> None:
        """Fill ``view`` with the span's bytes from ``skip`` on, opening the file for this one read (by descriptor:
        a restore at 10^5 parameters x DP ranks makes millions of these reads of a few KB)."""
        fd = open_checked(self.path, self.stamp)
        try:
            _pread_into(fd, view, self.offset + skip, self.path)
        finally:
            os.close(fd)


def open_checked(path: str, stamp: tuple[int, ...]) -> int:
    """A descriptor for reading ``path``, which must still be the file :func:`file_stamp` stamped ``stamp``; the
    caller closes it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as err:
        raise CorruptFileError(f"cannot open {path}: {err.strerror}") from None
    try:
        if file_stamp(os.fstat(fd)) != stamp:
            raise ChecksumError(f"{path} changed after it was checked: the input changed during the run")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _pread_into(fd: int, view: memoryview, offset: int, name: str) -> None:
    """Fill ``view`` from ``offset`` of ``fd``; a file that ends first was truncated after it was opened."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise CorruptFileError(f"{name} ends inside a tensor it holds: it was truncated after it was opened")
        done += got


Span = FileSpan | PathSpan
Part = torch.Tensor | FileSpan | PathSpan


@dataclass(frozen=True, eq=False)
class LazyTensor:
    """A tensor made only when a writer reaches it, then dropped: a module's low-precision weights
    (a cast of each fp32 master) cost one parameter of memory at a time instead of the model's.
    ``make()`` must return a tensor of exactly ``shape`` and ``dtype``."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], torch.Tensor] = field(repr=False)

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.shape, self.dtype)


@dataclass(frozen=True, eq=False)
class Cast:
    """:class:`Pieces` written converted to ``dtype``, a bounded chunk at a time: a module's bf16 weight cast
    from its fp32 master's spans costs a small buffer while it is written, not the tensor (a 128256 x 8192
    embedding would otherwise take 4.2 GB of fp32 and 2.1 GB of bf16 at once)."""

    source: Pieces
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.source.shape

    @property
    def nbytes(self) -> int:
        return self.source.numel * self.dtype.itemsize

    def fill(self, start: int, out: torch.Tensor, staging: torch.Tensor | None = None) -> None:
        """Elements ``[start, start + out.numel())`` of the flat source, converted into the 1-D ``out``
        (``staging``: a reused buffer of the source's dtype for what is read from files)."""
        self.source.slice(start, start + out.numel()).copy_to(out, staging)


@dataclass(frozen=True, eq=False)
class Reserved:
    """A flat tensor whose place in a file is laid out now and whose bytes are filled later, in order, by whoever
    holds it (``ucp.io.torchzip.lay_out``): a ZeRO-3 restore lays out every rank file of a group of ranks first,
    then reads each parameter once and writes its rank slices into all of them. Compared by identity: each one
    names one record."""

    numel: int
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.numel,)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


class Placeholder:
    """An empty one-dimensional tensor of ``dtype`` as a file holds it, without a tensor: a ZeRO-3 model-states file
    holds one for each parameter (10^5 for a MoE, where a tensor object costs about half a kilobyte and this 48
    bytes). Pickled exactly as ``torch.empty(0, dtype=dtype)``, with a storage record of its own."""

    __slots__ = ("dtype",)
    shape = (0,)
    nbytes = 0

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


def nbytes_of(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of a tensor of ``shape`` and ``dtype``."""
    return math.prod(shape) * dtype.itemsize


def file_stamp(stat: os.stat_result) -> tuple[int, ...]:
    """A file's identity for "is this still the file that was checked": a rewrite changes mtime and
    ctime, a replacement the inode."""
    return (stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino)


@dataclass(frozen=True)
class Pieces:
    """A tensor of ``shape`` whose flat (row-major) data is ``parts`` concatenated, all of ``dtype``.

    Lets a ZeRO-3 parameter's rank slices go from the shards straight into an output record:
    :func:`write_torch_file` writes it byte for byte as it would write :meth:`join`'s result.
    """

    parts: tuple[Part, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        numel = 1
        for d in self.shape:
            numel *= d
        item, total, whole = self.dtype.itemsize, 0, True
        for p in self.parts:  # one pass: a restore makes one per parameter, state and rank
            if isinstance(p, (FileSpan, PathSpan)):
                whole = whole and p.nbytes % item == 0
                total += p.nbytes // item
            else:
                whole = whole and p.dtype == self.dtype
                total += p.numel()
        if not whole or total != numel:
            raise ValueError(f"pieces {self.parts!r:.200} do not make a {self.dtype} tensor of shape {self.shape}")

    @classmethod
    def _trusted(cls, parts: tuple[Part, ...], shape: tuple[int, ...], dtype: torch.dtype) -> Pieces:
        """Pieces made from pieces already checked (a slice): the checks of ``__init__`` would cost more than the
        slicing itself, once per parameter, state and rank."""
        made = object.__new__(cls)
        object.__setattr__(made, "parts", parts)
        object.__setattr__(made, "shape", shape)
        object.__setattr__(made, "dtype", dtype)
        return made

    @classmethod
    def of(cls, tensor: torch.Tensor) -> Pieces:
        """A whole tensor as one piece."""
        return cls((tensor.reshape(-1),), tuple(tensor.shape), tensor.dtype)

    @property
    def numel(self) -> int:
        return sum(part_numel(p, self.dtype.itemsize) for p in self.parts)

    def join(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor itself, in new memory (converted to ``dtype`` when given); spans are read into place."""
        out = torch.empty(self.numel, dtype=dtype or self.dtype)
        self.copy_to(out)
        return out.view(self.shape)

    def copy_to(self, out: torch.Tensor, staging: torch.Tensor | None = None) -> None:
        """Fill the contiguous 1-D ``out`` with the flat data, converting dtype; spans are read into place, or
        through ``staging`` (1-D, of this dtype, reused; else allocated) when converting."""
        item = self.dtype.itemsize
        offset = 0
        for part in self.parts:
            n = part_numel(part, item)
            target = out.narrow(0, offset, n)
            if isinstance(part, (FileSpan, PathSpan)):
                if out.dtype == self.dtype:
                    staging_n = target
                elif staging is not None and staging.numel() >= n and staging.dtype == self.dtype:
                    staging_n = staging[:n]
                else:
                    staging_n = torch.empty(n, dtype=self.dtype)
                if n:
                    part.read_into(memoryview(staging_n.view(torch.uint8).numpy()).cast("B"))  # type: ignore[arg-type]
                if staging_n is not target:
                    target.copy_(staging_n)
            else:
                target.copy_(part.reshape(-1))
            offset += n

    @cached_property
    def _starts(self) -> list[int]:
        """Each part's first flat element, and the total last: found once, so that a slice starts at its first
        part by bisection (a parameter cut across 4096 ranks, sliced for each of 2048 new ones)."""
        starts, offset = [], 0
        for part in self.parts:
            starts.append(offset)
            offset += part_numel(part, self.dtype.itemsize)
        starts.append(offset)
        return starts

    def slice(self, start: int, end: int) -> Pieces:
        """Flat elements ``[start, end)`` as pieces (shape ``(end - start,)``), still without a copy."""
        item = self.dtype.itemsize
        starts = self._starts
        parts: list[Part] = []
        index = max(bisect.bisect_right(starts, start) - 1, 0)
        while index < len(self.parts) and starts[index] < end:
            part, offset = self.parts[index], starts[index]
            lo, hi = max(start - offset, 0), min(end, starts[index + 1]) - offset
            if hi > lo:
                parts.append(
                    part.narrow(lo * item, (hi - lo) * item)
                    if isinstance(part, (FileSpan, PathSpan))
                    else part.reshape(-1)[lo:hi]
                )
            index += 1
        if not 0 <= start <= end <= starts[-1]:
            raise ValueError(f"elements [{start}, {end}) are not inside pieces of {starts[-1]}")
        return Pieces._trusted(tuple(parts), (end - start,), self.dtype)


def part_numel(part: Part, itemsize: int) -> int:
    return part.nbytes // itemsize if isinstance(part, (FileSpan, PathSpan)) else part.numel()
