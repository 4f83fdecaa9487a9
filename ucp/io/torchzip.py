"""ucp's one writer of torch files: torch.save-compatible, fast, deterministic, checksummed on the way out.

``torch.save`` stamps every file with a random serialization id (two runs never match byte for
byte) and copies each tensor through its own buffers. This writer emits the same zip layout torch
reads (``data.pkl`` + ``data/<key>`` records aligned to 64 bytes, zip64 when a record or offset
needs it), writes each tensor's bytes straight from its memory (or streams them from another file,
see :class:`FileSpan`), and computes the crc32 of every record once: the zip stores it, and
``crc32_combine`` turns the record CRCs into the whole file's crc32 for the manifest, without a
second pass over the data.

Anything ``torch.load(weights_only=True)`` can read back is fair game for ``obj``: dicts, lists,
tuples, numbers, strings and tensors (each written from its own contiguous storage), and
:class:`Pieces`, a tensor given as the pieces its bytes are concatenated from (written exactly as
the joined tensor would be, without ever joining it), and :class:`Cast`, pieces converted to another dtype chunk by
chunk as they are written. How objects are pickled (DeepSpeed stand-ins
under DeepSpeed's own class names, so the rank files of a native checkpoint load into stock
DeepSpeed exactly like files DeepSpeed wrote) is :mod:`ucp.io.torchpickle`'s.
"""

from __future__ import annotations

import functools
import os
import struct
import zlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from ucp.io.crc import crc32_combine
from ucp.io.span_copy import PARALLEL_MIN, copy_spans
from ucp.io.torchpickle import STREAMED, Chunk, Pickled, Stored, pickle_object, tensor_bytes
from ucp.model.pieces import Cast, FileSpan, LazyTensor, PathSpan, Reserved

__all__ = ["LaidFile", "WrittenFile", "lay_out", "write_pickled", "write_pickled_at", "write_torch_file"]

_ALIGN = 64
_ZIP64_LIMIT = 0xFFFFFFFF
_DOS_DATE = 0x21  # 1980-01-01; a fixed stamp keeps output deterministic
_UTF8 = 0x800
_RECRC_MAX = 4096  # an in-memory record this small is CRC'd again for the file's crc32 rather than combined


@dataclass(frozen=True)
class WrittenFile:
    bytes: int
    crc32: str


@functools.lru_cache(maxsize=1024)  # every file of a universal directory repeats its small records' headers
def _local_header(name: bytes, size: int, crc: int, offset: int) -> bytes:
    zip64 = size >= _ZIP64_LIMIT
    extra = struct.pack("<HHQQ", 0x0001, 16, size, size) if zip64 else b""
    pad = (-(offset + 30 + len(name) + len(extra) + 4)) % _ALIGN
    extra += b"FB" + struct.pack("<H", pad) + b"Z" * pad  # the padding field torch itself writes
    size32 = 0xFFFFFFFF if zip64 else size
    return (
        struct.pack(
            "<IHHHHHIIIHH",
            0x04034B50,
            45 if zip64 else 20,
            _UTF8,
            0,
            0,
            _DOS_DATE,
            crc,
            size32,
            size32,
            len(name),
            len(extra),
        )
        + name
        + extra
    )


_CENTRAL_BATCH = 4096  # central-directory entries made and sent together


@functools.lru_cache(maxsize=1024)  # as the local headers: the small records of many files repeat theirs
def _central_entry(name: bytes, size: int, crc: int, offset: int) -> bytes:
    fields = []
    if size >= _ZIP64_LIMIT:
        fields += [size, size]
    if offset >= _ZIP64_LIMIT:
        fields.append(offset)
    extra = struct.pack("<HH", 0x0001, 8 * len(fields)) + struct.pack(f"<{len(fields)}Q", *fields) if fields else b""
    version = 45 if fields else 20
    return (
        struct.pack(
            "<IHHHHHHIIIHHHHHII",
            0x02014B50,
            version,
            version,
            _UTF8,
            0,
            0,
            _DOS_DATE,
            crc,
            min(size, 0xFFFFFFFF),
            min(size, 0xFFFFFFFF),
            len(name),
            len(extra),
            0,
            0,
            0,
            0,
            min(offset, 0xFFFFFFFF),
        )
        + name
        + extra
    )


def _end_records(count: int, cd_offset: int, cd_size: int) -> bytes:
    out = b""
    if cd_offset + cd_size >= _ZIP64_LIMIT or count >= 0xFFFF:
        zip64_end = cd_offset + cd_size
        out += struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, count, count, cd_size, cd_offset)
        out += struct.pack("<IIQI", 0x07064B50, 0, zip64_end, 1)
    out += struct.pack(
        "<IHHHHIIH",
        0x06054B50,
        0,
        0,
        min(count, 0xFFFF),
        min(count, 0xFFFF),
        min(cd_size, 0xFFFFFFFF),
        min(cd_offset, 0xFFFFFFFF),
        0,
    )
    return out


def write_torch_file(obj: Any, path: str | os.PathLike) -> WrittenFile:
    """Write ``obj`` to ``path`` in torch's zip format; returns its size and whole-file crc32."""
    return write_pickled(pickle_object(obj), path)


def write_pickled(pickled_object: Pickled, path: str | os.PathLike) -> WrittenFile:
    """Write an object :func:`~ucp.io.torchpickle.pickle_object` pickled to ``path`` in torch's zip format (the
    archive named after the file, as torch names it): an object written to many files is pickled once."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        size, crc = _write_archive(pickled_object, fd, path.stem.encode() or b"archive", 0)
    finally:
        os.close(fd)
    return WrittenFile(bytes=size, crc32=f"{crc & 0xFFFFFFFF:08x}")


def write_pickled_at(pickled_object: Pickled, fd: int, base: int) -> int:
    """Write a pickled object as ``torch.save`` writes it into a stream (archive ``archive``), from offset ``base`` of
    the open file ``fd`` on, its tensors streamed like :func:`write_pickled`'s; returns its length. What a file of
    many such archives needs (a DCP ``.distcp`` file holds one per tensor); ``fd`` is left after it."""
    os.lseek(fd, base, os.SEEK_SET)
    size, _ = _write_archive(pickled_object, fd, b"archive", base)
    return size


def _write_archive(pickled_object: Pickled, fd: int, prefix: bytes, base: int) -> tuple[int, int]:
    zip_out = _ZipStream(fd, prefix, base)
    data_crcs = _write_head(zip_out, pickled_object)
    return _write_tail(zip_out, pickled_object[0], data_crcs)


def _write_head(zip_out: _ZipStream, pickled_object: Pickled) -> list[int]:
    """data.pkl, the small records torch reads first, and every storage record; returns the storages' crc32s (0 for
    a :class:`Reserved` one, not filled yet)."""
    pickled, records = pickled_object
    zip_out.record(b"data.pkl", [pickled])
    for name, value in ((b".format_version", b"1"), (b".storage_alignment", b"64"), (b"byteorder", b"little")):
        zip_out.record(name, [value])
    return [zip_out.record(b"data/" + key.encode(), parts) for key, parts in records]


def _write_tail(zip_out: _ZipStream, pickled: bytes, data_crcs: Sequence[int]) -> tuple[int, int]:
    """The records after the storages and the central directory; returns the file's size and crc32."""
    zip_out.record(b"version", [b"3\n"])
    serial = str(zlib.crc32(pickled, data_crcs[0] if data_crcs else 0)).zfill(40).encode()
    zip_out.record(b".data/serialization_id", [serial])
    return zip_out.finish()


class LaidFile:
    """A torch file laid out with its :class:`Reserved` records left empty: ``holes[r]`` is where record ``r``'s
    bytes go (offset in the file, length). The caller fills them through ``fd`` (``ucp.io.record_fill``), in any
    order, then calls :meth:`finish` with each one's crc32; until then the file is not a torch file."""

    def __init__(self, path: Path, pickled_object: Pickled) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            self._zip = _ZipStream(self.fd, path.stem.encode() or b"archive", 0)
            self._pickled = pickled_object[0]
            self._crcs = _write_head(self._zip, pickled_object)
        except BaseException:
            os.close(self.fd)
            raise
        self.holes: dict[Reserved, tuple[int, int]] = {
            hole.reserved: (hole.data_offset, hole.reserved.nbytes) for hole in self._zip.holes
        }

    def finish(self, crcs: dict[Reserved, int]) -> int:
        """Seal the file once every hole is filled (``crcs``: each hole's crc32) and close it; returns its size."""
        try:
            for hole in self._zip.holes:
                crc = crcs[hole.reserved]
                self._zip.patch(hole, crc)
                if hole.index < len(self._crcs):
                    self._crcs[hole.index] = crc
            size, _ = _write_tail(self._zip, self._pickled, self._crcs)
        finally:
            self.close()
        return size

    def close(self) -> None:
        """Close the file (a file not finished stays half-written: its caller's staging folder removes it)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def lay_out(pickled_object: Pickled, path: str | os.PathLike) -> LaidFile:
    """Write ``pickled_object`` to ``path`` as :func:`write_pickled` would, but for its :class:`Reserved` records,
    whose places are left for the caller to fill (see :class:`LaidFile`)."""
    return LaidFile(Path(path), pickled_object)


@dataclass(frozen=True)
class _Hole:
    """A :class:`Reserved` record's place: its local header at ``header`` (of the archive), its bytes at
    ``data_offset`` (of the file), its central-directory entry ``central``, its storage's index ``index``."""

    reserved: Reserved
    name: bytes
    header: int
    data_offset: int
    central: int
    index: int


class _ZipStream:
    """Zip records, in order, onto ``fd``: small buffers go out together in one ``writev``; a record
    of spans is copied through reused buffers, CRC'd while hot (:mod:`ucp.io.span_copy`), and its local
    header, written first with a zero CRC, is patched once the CRC is known."""

    def __init__(self, fd: int, prefix: bytes, base: int = 0) -> None:
        self.fd, self.prefix = fd, prefix
        self.base = base  # where the archive starts in the file (its own offsets count from there)
        self.offset = 0  # bytes placed so far, written or pending
        self.pending: list[memoryview | bytes] = []
        self._pending_bytes = 0
        # the central directory's entries (one per record: 10^5 for a MoE's model-states file), as columns: each
        # name after the prefix in one buffer (ending at _name_ends), its size, crc32 and local header's offset;
        # the entries themselves are made in batches when the directory is written (about 30 bytes a record
        # held, not the 95 of an entry)
        self._names = bytearray()
        self._name_ends = array("q")
        self._sizes = array("q")
        self._crcs = array("I")
        self._starts = array("q")
        self.crc = 0  # of the whole file so far (meaningless once a record is reserved)
        self.holes: list[_Hole] = []  # the Reserved records, in order
        self._storages = 0  # data/ records placed so far

    def record(self, name: bytes, stored: Sequence[Stored]) -> int:
        """Place one stored member; returns its crc32."""
        full = self.prefix + b"/" + name
        start = self.offset
        if name.startswith(b"data/"):
            self._storages += 1
        if len(stored) == 1 and isinstance(stored[0], Reserved):
            return self._reserve(full, stored[0], start)
        if any(isinstance(p, Reserved) for p in stored):
            raise ValueError("a reserved record holds nothing else")
        parts = cast("Sequence[Chunk]", stored)
        size = sum(p.nbytes if isinstance(p, STREAMED) else len(p) for p in parts)  # type: ignore[union-attr]
        streamed = any(isinstance(p, STREAMED) for p in parts)
        crc = 0
        for part in parts if not streamed else ():
            crc = zlib.crc32(part, crc)  # type: ignore[arg-type]
        header = _local_header(full, size, crc, start)
        self._add(header)
        if streamed and not any(isinstance(p, LazyTensor) for p in parts):
            # spans (and the bytes between them) in buffered tasks; a big record's tasks by several threads
            self._flush()
            spans = sum(p.nbytes for p in parts if isinstance(p, (FileSpan, PathSpan, Cast)))
            crc = copy_spans(self.fd, parts, self.base + self.offset, 0, parallel=spans >= PARALLEL_MIN)  # type: ignore[arg-type]
            self.offset += size
            os.lseek(self.fd, self.base + self.offset, os.SEEK_SET)
            parts = ()
        for part in parts:
            if isinstance(part, LazyTensor):
                data = _lazy_bytes(part)
                crc = zlib.crc32(data, crc)
                self._add(data)
                self._flush()  # the tensor goes as soon as it is written
            elif isinstance(part, (FileSpan, PathSpan, Cast)):
                self._flush()
                crc = copy_spans(self.fd, [part], self.base + self.offset, crc, parallel=False)
                self.offset += part.nbytes
                os.lseek(self.fd, self.base + self.offset, os.SEEK_SET)
            else:
                if streamed:
                    crc = zlib.crc32(part, crc)
                self._add(part)
        if streamed:
            self._flush()
            header = _local_header(full, size, crc, start)
            if os.pwrite(self.fd, header, self.base + start) != len(header):
                raise OSError(f"short write patching a zip header in {self.prefix.decode(errors='replace')}")
        if streamed or size > _RECRC_MAX:  # the bytes went by once: joined to the file's crc32 by their own
            self.crc = crc32_combine(zlib.crc32(header, self.crc), crc, size)
        else:  # a few bytes in memory: run on over them, cheaper than a combine
            self.crc = zlib.crc32(header, self.crc)
            for part in parts:
                self.crc = zlib.crc32(part, self.crc)  # type: ignore[arg-type]
        self._central(name, size, crc, start)
        return crc

    def _reserve(self, full: bytes, reserved: Reserved, start: int) -> int:
        """Place a record whose bytes are filled later: its header now (CRC 0, patched by :meth:`patch`)."""
        size = reserved.nbytes
        header = _local_header(full, size, 0, start)
        self._add(header)
        self._flush()
        data_offset = self.base + self.offset
        self.offset += size
        os.lseek(self.fd, self.base + self.offset, os.SEEK_SET)
        self.holes.append(_Hole(reserved, full, start, data_offset, len(self._starts), self._storages - 1))
        self._central(full[len(self.prefix) + 1 :], size, 0, start)
        return 0

    def patch(self, hole: _Hole, crc: int) -> None:
        """A reserved record's crc32, now known: into its local header and its central-directory entry."""
        size = hole.reserved.nbytes
        header = _local_header(hole.name, size, crc, hole.header)
        if os.pwrite(self.fd, header, self.base + hole.header) != len(header):
            raise OSError(f"short write patching a zip header in {self.prefix.decode(errors='replace')}")
        self._crcs[hole.central] = crc  # its central-directory entry is made with it when the directory is written

    def _central(self, name: bytes, size: int, crc: int, start: int) -> None:
        """Record ``name``'s (after the prefix) central-directory entry."""
        self._names += name
        self._name_ends.append(len(self._names))
        self._sizes.append(size)
        self._crcs.append(crc)
        self._starts.append(start)

    def finish(self) -> tuple[int, int]:
        """Write the central directory, its entries made and sent in batches; returns the file's size and crc32."""
        count, cd_offset, cd_size = len(self._starts), self.offset, 0
        prefix = self.prefix + b"/"
        names = self._names
        for first in range(0, count, _CENTRAL_BATCH):
            batch = b"".join(
                _central_entry(
                    prefix + names[self._name_ends[i - 1] if i else 0 : self._name_ends[i]],
                    self._sizes[i],
                    self._crcs[i],
                    self._starts[i],
                )
                for i in range(first, min(first + _CENTRAL_BATCH, count))
            )
            self._add(batch)
            self.crc = zlib.crc32(batch, self.crc)
            cd_size += len(batch)
        end = _end_records(count, cd_offset, cd_size)
        self._add(end)
        self.crc = zlib.crc32(end, self.crc)
        self._flush()
        return self.offset, self.crc

    def _add(self, data: memoryview | bytes) -> None:
        self.pending.append(data)
        self.offset += len(data)
        self._pending_bytes += len(data)
        if len(self.pending) >= _IOV_MAX or self._pending_bytes >= _PENDING_MAX:  # 10^5 small records: not all held
            self._flush()

    def _flush(self) -> None:
        _write_all(self.fd, self.pending)
        self.pending = []
        self._pending_bytes = 0


def _lazy_bytes(lazy: LazyTensor) -> memoryview:
    """The bytes of a :class:`LazyTensor`, made now; it must be what it promised."""
    tensor = lazy.make()
    if tuple(tensor.shape) != tuple(lazy.shape) or tensor.dtype != lazy.dtype:
        raise ValueError(f"a lazy tensor promised {lazy.dtype} {lazy.shape}, made {tensor.dtype} {tuple(tensor.shape)}")
    return tensor_bytes(tensor)


_IOV_MAX = 1024
_PENDING_MAX = 4 << 20  # small buffers gathered for one writev, at most
_MAX_WRITE = 1 << 30  # Linux moves at most ~2 GiB per write call; stay well under it


def _write_all(fd: int, buffers: list[memoryview | bytes]) -> None:
    """Write the buffers in order with as few system calls as the kernel allows."""
    pending = [memoryview(b).cast("B") if not isinstance(b, memoryview) else b for b in buffers if len(b)]
    while pending:
        batch, total = [], 0
        for view in pending[:_IOV_MAX]:
            batch.append(view[: _MAX_WRITE - total])
            total += len(batch[-1])
            if total >= _MAX_WRITE:
                break
        written = os.writev(fd, batch)
        while written:  # drop what went out; a short write leaves the rest of a buffer pending
            if written >= len(pending[0]):
                written -= len(pending.pop(0))
            else:
                pending[0] = pending[0][written:]
                written = 0
