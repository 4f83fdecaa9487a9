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
the joined tensor would be, without ever joining it). DeepSpeed stand-ins
(:mod:`ucp.io.standins`) are pickled under DeepSpeed's own class names, so the rank files of a
native checkpoint load into stock DeepSpeed exactly like files DeepSpeed wrote.
"""

from __future__ import annotations

import copyreg
import io
import os
import pickle
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ucp.io.crc import crc32_combine
from ucp.io.standins import DSEnum, DSObject
from ucp.model.pieces import FileSpan, LazyTensor, PathSpan, Pieces, Span, part_numel

__all__ = ["WrittenFile", "write_torch_file", "data_pickle"]

_ALIGN = 64
_ZIP64_LIMIT = 0xFFFFFFFF
_DOS_DATE = 0x21  # 1980-01-01; a fixed stamp keeps output deterministic
_UTF8 = 0x800


@dataclass(frozen=True)
class WrittenFile:
    bytes: int
    crc32: str


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]  # ndarray is a buffer


_Chunk = memoryview | bytes | FileSpan | PathSpan | LazyTensor
_STREAMED = (FileSpan, PathSpan, LazyTensor)


class _Tensors:
    """What both picklers share: tensors pickled the way torch.save does, a rebuild call over a
    persistent storage id, with each storage's bytes (in pieces) kept as a record to write."""

    records: list[tuple[str, Sequence[_Chunk]]]

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageRef):
            key = str(len(self.records))
            self.records.append((key, obj.data))
            return ("storage", obj.storage_type, key, "cpu", obj.numel)
        return None

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, LazyTensor):
            numel = obj.nbytes // obj.dtype.itemsize
            return _rebuild(_StorageRef(_storage_type(obj.dtype), [obj] if numel else [], numel), obj.shape)
        if isinstance(obj, torch.Tensor):  # written from its own memory; no Pieces to build and check
            numel = obj.numel()
            own: list[_Chunk] = [_tensor_bytes(obj.detach())] if numel else []
            return _rebuild(_StorageRef(_storage_type(obj.dtype), own, numel), tuple(obj.shape))
        if isinstance(obj, Pieces):
            item = obj.dtype.itemsize
            data = [
                p if isinstance(p, (FileSpan, PathSpan)) else _tensor_bytes(p) for p in obj.parts if part_numel(p, item)
            ]
            return _rebuild(_StorageRef(_storage_type(obj.dtype), data, obj.numel), obj.shape)
        return NotImplemented


_NEWOBJ = copyreg.__newobj__  # type: ignore[attr-defined]  # protocol 2 NEWOBJ; the stubs leave it out


class _FastPickler(_Tensors, pickle.Pickler):
    """The C pickler. A DeepSpeed stand-in pickles under its own importable name in
    ``ucp.io.standins``; :func:`_pickle` then renames those globals to DeepSpeed's. Protocol 2 has
    no frames or offsets, so renaming a GLOBAL opcode's text is safe once each is known to occur
    exactly where the pickler put it."""

    def __init__(self, buffer: io.BytesIO) -> None:
        super().__init__(buffer, protocol=2)
        self.records = []
        self.used: set[type] = set()

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, DSEnum):
            self.used.add(type(obj))
            return (type(obj), (int(obj),))
        if isinstance(obj, DSObject):
            self.used.add(type(obj))
            return (_NEWOBJ, (type(obj),), dict(obj.__dict__))
        return super().reducer_override(obj)


# The pure-Python pickler: its save() is a hook for writing DeepSpeed's globals directly (the C one has
# none); the stubs leave it out, hence getattr. Used when the C pickler's renaming cannot be trusted.
_PyPickler: Any = pickle._Pickler


class _Pickler(_Tensors, _PyPickler):
    """The pure-Python pickler, DeepSpeed's globals written as GLOBAL opcodes of their own names."""

    def __init__(self, buffer: io.BytesIO) -> None:
        super().__init__(buffer, protocol=2)
        self.records = []

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        if isinstance(obj, _GlobalRef):
            self.write(pickle.GLOBAL + obj.module.encode() + b"\n" + obj.name.encode() + b"\n")
        elif isinstance(obj, DSEnum):
            self.save(_GlobalRef(obj.ds_name))
            self.save((int(obj),))
            self.write(pickle.REDUCE)
        elif isinstance(obj, DSObject):
            self.save(_GlobalRef(obj.ds_name))
            self.save(())
            self.write(pickle.NEWOBJ)
            self.save(dict(obj.__dict__))
            self.write(pickle.BUILD)
        else:
            super().save(obj, save_persistent_id)


_STANDIN_MODULE = DSObject.__module__.encode()


def _pickle(obj: Any) -> tuple[bytes, list[tuple[str, Sequence[_Chunk]]]]:
    """``obj``'s data.pkl and its storage records: the C pickler (tens of times faster on a
    model-states file's thousands of small objects), or the pure-Python one when a stand-in's
    name also turns up somewhere a GLOBAL opcode did not put it."""
    buffer = io.BytesIO()
    fast = _FastPickler(buffer)
    fast.dump(obj)
    data = buffer.getvalue()
    trusted = True
    for cls in fast.used:
        ours = pickle.GLOBAL + f"{cls.__module__}\n{cls.__qualname__}\n".encode()
        module, _, name = cls.ds_name.rpartition(".")  # type: ignore[attr-defined]  # every stand-in has one
        trusted = trusted and data.count(ours) == 1
        data = data.replace(ours, pickle.GLOBAL + f"{module}\n{name}\n".encode())
    if trusted and _STANDIN_MODULE not in data:
        return data, fast.records
    buffer = io.BytesIO()
    slow = _Pickler(buffer)
    slow.dump(obj)
    return buffer.getvalue(), slow.records


class _GlobalRef:
    """A dotted name pickled as a GLOBAL opcode, so no module needs importing to write it."""

    def __init__(self, dotted: str) -> None:
        self.module, _, self.name = dotted.rpartition(".")


def _rebuild(ref: _StorageRef, shape: tuple[int, ...]) -> tuple[Any, tuple]:
    """What torch.save pickles for a contiguous tensor over a whole storage."""
    return (torch._utils._rebuild_tensor_v2, (ref, 0, shape, _contiguous_strides(shape), False, _ordered_dict()))


def _storage_type(dtype: torch.dtype) -> Any:
    return getattr(torch, _storage_type_name(dtype))


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """What ``torch.empty(shape).stride()`` gives (a size-0 dim counts as 1, as in c10)."""
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


def _ordered_dict() -> Any:
    return OrderedDict()


_STORAGE_TYPES = {
    torch.float32: "FloatStorage",
    torch.bfloat16: "BFloat16Storage",
    torch.float16: "HalfStorage",
    torch.float64: "DoubleStorage",
    torch.int64: "LongStorage",
    torch.int32: "IntStorage",
    torch.int16: "ShortStorage",
    torch.int8: "CharStorage",
    torch.uint8: "ByteStorage",
    torch.bool: "BoolStorage",
}


def _storage_type_name(dtype: torch.dtype) -> str:
    try:
        return _STORAGE_TYPES[dtype]
    except KeyError:
        raise TypeError(f"cannot write tensors of dtype {dtype}") from None


@dataclass
class _StorageRef:
    storage_type: Any
    data: Sequence[_Chunk]  # the record's bytes, in pieces
    numel: int


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


def data_pickle(obj: Any) -> bytes:
    """The ``data.pkl`` record :func:`write_torch_file` writes for ``obj``: it depends on the tensors'
    shapes and dtypes, never their values, so a reader can recognise a file of a known layout by it."""
    return _pickle(obj)[0]


def write_torch_file(obj: Any, path: str | os.PathLike) -> WrittenFile:
    """Write ``obj`` to ``path`` in torch's zip format; returns its size and whole-file crc32."""
    path = Path(path)
    pickled, records = _pickle(obj)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        zip_out = _ZipStream(fd, path.stem.encode() or b"archive")
        zip_out.record(b"data.pkl", [pickled])
        for name, value in ((b".format_version", b"1"), (b".storage_alignment", b"64"), (b"byteorder", b"little")):
            zip_out.record(name, [value])
        data_crcs = [zip_out.record(b"data/" + key.encode(), parts) for key, parts in records]
        zip_out.record(b"version", [b"3\n"])
        serial = str(zlib.crc32(pickled, data_crcs[0] if data_crcs else 0)).zfill(40).encode()
        zip_out.record(b".data/serialization_id", [serial])
        size, crc = zip_out.finish()
    finally:
        os.close(fd)
    return WrittenFile(bytes=size, crc32=f"{crc & 0xFFFFFFFF:08x}")


class _ZipStream:
    """Zip records, in order, onto ``fd``: small buffers go out together in one ``writev``; a
    :class:`FileSpan` streams through a per-thread buffer, CRC'd while hot, and its record's local
    header, written first with a zero CRC, is patched once the CRC is known."""

    def __init__(self, fd: int, prefix: bytes) -> None:
        self.fd, self.prefix = fd, prefix
        self.offset = 0  # bytes placed so far, written or pending
        self.pending: list[memoryview | bytes] = []
        self.central: list[bytes] = []
        self.crc = 0  # of the whole file so far

    def record(self, name: bytes, parts: Sequence[_Chunk]) -> int:
        """Place one stored member; returns its crc32."""
        full = self.prefix + b"/" + name
        size = sum(p.nbytes if isinstance(p, _STREAMED) else len(p) for p in parts)
        start = self.offset
        streamed = any(isinstance(p, _STREAMED) for p in parts)
        crc = 0
        for part in parts if not streamed else ():
            crc = zlib.crc32(part, crc)  # type: ignore[arg-type]
        header = _local_header(full, size, crc, start)
        self._add(header)
        for part in parts:
            if isinstance(part, LazyTensor):
                data = _lazy_bytes(part)
                crc = zlib.crc32(data, crc)
                self._add(data)
                self._flush()  # the tensor goes as soon as it is written
            elif isinstance(part, (FileSpan, PathSpan)):
                self._flush()
                crc = _stream_span(self.fd, part, crc)
                self.offset += part.nbytes
            else:
                if streamed:
                    crc = zlib.crc32(part, crc)
                self._add(part)
        if streamed:
            self._flush()
            header = _local_header(full, size, crc, start)
            if os.pwrite(self.fd, header, start) != len(header):
                raise OSError(f"short write patching a zip header in {self.prefix.decode(errors='replace')}")
        self.crc = crc32_combine(zlib.crc32(header, self.crc), crc, size)
        self.central.append(_central_entry(full, size, crc, start))
        return crc

    def finish(self) -> tuple[int, int]:
        """Write the central directory; returns the file's size and crc32."""
        tail = b"".join(self.central)
        tail += _end_records(len(self.central), self.offset, len(tail))
        self._add(tail)
        self.crc = zlib.crc32(tail, self.crc)
        self._flush()
        return self.offset, self.crc

    def _add(self, data: memoryview | bytes) -> None:
        self.pending.append(data)
        self.offset += len(data)

    def _flush(self) -> None:
        _write_all(self.fd, self.pending)
        self.pending = []


def _lazy_bytes(lazy: LazyTensor) -> memoryview:
    """The bytes of a :class:`LazyTensor`, made now; it must be what it promised."""
    tensor = lazy.make()
    if tuple(tensor.shape) != tuple(lazy.shape) or tensor.dtype != lazy.dtype:
        raise ValueError(f"a lazy tensor promised {lazy.dtype} {lazy.shape}, made {tensor.dtype} {tuple(tensor.shape)}")
    return _tensor_bytes(tensor)


_CHUNK = 2 << 20
# One scratch buffer per writer thread, reused across files: allocating (and zero-filling) a fresh
# one per file would cost as much as the copy it serves. It dies with its thread.
_SCRATCH = threading.local()


def _stream_span(fd: int, span: Span, crc: int) -> int:
    """Copy a span onto ``fd`` chunk by chunk, CRC'ing each chunk while it is in cache; returns
    ``crc`` extended by the span. A :class:`PathSpan`'s file is open for just this copy, and its
    witness learns the span's own crc32 (its reader checks the source file with it, no second read)."""
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None:
        buf = _SCRATCH.buf = memoryview(bytearray(_CHUNK))
    done, own = 0, 0
    with span.opened() as source:
        while done < source.nbytes:
            chunk = buf[: min(_CHUNK, source.nbytes - done)]
            source.read_into(chunk, done)
            own = zlib.crc32(chunk, own)
            _write_all(fd, [chunk])
            done += len(chunk)
    witness = getattr(span, "witness", None)
    if witness is not None:
        witness(span.offset, span.nbytes, own)
    return crc32_combine(crc, own, span.nbytes)


_IOV_MAX = 1024
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
