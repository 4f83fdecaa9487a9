"""Write torch.save-compatible files fast and deterministically, checksummed on the way out.

``torch.save`` stamps every file with a random serialization id (two runs never match byte for
byte) and copies each tensor through its own buffers. This writer emits the same zip layout torch
reads (``data.pkl`` + ``data/<key>`` records aligned to 64 bytes, zip64 when a record or offset
needs it), writes each tensor's bytes straight from its memory, and computes the crc32 of every
record once: the zip stores it, and ``crc32_combine`` turns the record CRCs into the whole file's
crc32 for the manifest, without a second pass over the data.

Anything ``torch.load(weights_only=True)`` can read back is fair game for ``obj``: dicts, lists,
tuples, numbers, strings and tensors (each written from its own contiguous storage).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import io
import os
import pickle
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["WrittenFile", "write_torch_file", "crc32_combine"]

_ALIGN = 64
_ZIP64_LIMIT = 0xFFFFFFFF
_DOS_DATE = 0x21  # 1980-01-01; a fixed stamp keeps output deterministic
_UTF8 = 0x800


@dataclass(frozen=True)
class WrittenFile:
    bytes: int
    crc32: str


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


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


class _Pickler(pickle._Pickler):  # type: ignore[misc,name-defined]
    """Pickles tensors the way torch.save does: a rebuild call over a persistent storage id."""

    def __init__(self, buffer: io.BytesIO) -> None:
        super().__init__(buffer, protocol=2)
        self.records: list[tuple[str, memoryview]] = []

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageRef):
            key = str(len(self.records))
            self.records.append((key, obj.data))
            return ("storage", obj.storage_type, key, "cpu", obj.numel)
        return None

    def reducer_override(self, obj: Any) -> Any:
        if torch.is_tensor(obj):
            data = obj.detach().contiguous()
            ref = _StorageRef(getattr(torch, _storage_type_name(data.dtype)), _tensor_bytes(data), data.numel())
            return (torch._utils._rebuild_tensor_v2,
                    (ref, 0, tuple(data.shape), tuple(data.stride()), False, _ordered_dict()))
        return NotImplemented


def _ordered_dict() -> Any:
    from collections import OrderedDict

    return OrderedDict()


_STORAGE_TYPES = {
    torch.float32: "FloatStorage", torch.bfloat16: "BFloat16Storage", torch.float16: "HalfStorage",
    torch.float64: "DoubleStorage", torch.int64: "LongStorage", torch.int32: "IntStorage",
    torch.int16: "ShortStorage", torch.int8: "CharStorage", torch.uint8: "ByteStorage", torch.bool: "BoolStorage",
}


def _storage_type_name(dtype: torch.dtype) -> str:
    try:
        return _STORAGE_TYPES[dtype]
    except KeyError:
        raise TypeError(f"cannot write tensors of dtype {dtype}") from None


@dataclass
class _StorageRef:
    storage_type: Any
    data: memoryview
    numel: int


def _local_header(name: bytes, size: int, crc: int, offset: int) -> bytes:
    zip64 = size >= _ZIP64_LIMIT
    extra = struct.pack("<HHQQ", 0x0001, 16, size, size) if zip64 else b""
    pad = (-(offset + 30 + len(name) + len(extra) + 4)) % _ALIGN
    extra += b"FB" + struct.pack("<H", pad) + b"Z" * pad  # the padding field torch itself writes
    size32 = 0xFFFFFFFF if zip64 else size
    return struct.pack("<IHHHHHIIIHH", 0x04034B50, 45 if zip64 else 20, _UTF8, 0, 0, _DOS_DATE, crc, size32,
                       size32, len(name), len(extra)) + name + extra


def _central_entry(name: bytes, size: int, crc: int, offset: int) -> bytes:
    fields = []
    if size >= _ZIP64_LIMIT:
        fields += [size, size]
    if offset >= _ZIP64_LIMIT:
        fields.append(offset)
    extra = struct.pack("<HH", 0x0001, 8 * len(fields)) + struct.pack(f"<{len(fields)}Q", *fields) if fields else b""
    version = 45 if fields else 20
    return struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, version, version, _UTF8, 0, 0, _DOS_DATE, crc,
                       min(size, 0xFFFFFFFF), min(size, 0xFFFFFFFF), len(name), len(extra), 0, 0, 0, 0,
                       min(offset, 0xFFFFFFFF)) + name + extra


def _end_records(count: int, cd_offset: int, cd_size: int) -> bytes:
    out = b""
    if cd_offset + cd_size >= _ZIP64_LIMIT or count >= 0xFFFF:
        zip64_end = cd_offset + cd_size
        out += struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, count, count, cd_size, cd_offset)
        out += struct.pack("<IIQI", 0x07064B50, 0, zip64_end, 1)
    out += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, min(count, 0xFFFF), min(count, 0xFFFF),
                       min(cd_size, 0xFFFFFFFF), min(cd_offset, 0xFFFFFFFF), 0)
    return out


def write_torch_file(obj: Any, path: str | os.PathLike) -> WrittenFile:
    """Write ``obj`` to ``path`` in torch's zip format; returns its size and whole-file crc32."""
    path = Path(path)
    buffer = io.BytesIO()
    pickler = _Pickler(buffer)
    pickler.dump(obj)
    data_crcs = [zlib.crc32(data) for _, data in pickler.records]
    serial = str(zlib.crc32(buffer.getbuffer(), data_crcs[0] if data_crcs else 0)).zfill(40).encode()
    prefix = path.stem.encode() or b"archive"
    records: list[tuple[bytes, memoryview | bytes, int]] = [
        (b"data.pkl", buffer.getvalue(), zlib.crc32(buffer.getbuffer())),
        (b".format_version", b"1", zlib.crc32(b"1")),
        (b".storage_alignment", b"64", zlib.crc32(b"64")),
        (b"byteorder", b"little", zlib.crc32(b"little")),
    ]
    records += [(b"data/" + key.encode(), data, crc) for (key, data), crc in zip(pickler.records, data_crcs)]
    records += [(b"version", b"3\n", zlib.crc32(b"3\n")), (b".data/serialization_id", serial, zlib.crc32(serial))]
    offset = 0
    file_crc = 0
    central = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for name, data, crc in records:
            full = prefix + b"/" + name
            size = len(data)
            header = _local_header(full, size, crc, offset)
            _write_all(fd, header)
            _write_all(fd, data)
            file_crc = crc32_combine(zlib.crc32(header, file_crc), crc, size)
            central.append(_central_entry(full, size, crc, offset))
            offset += len(header) + size
        tail = b"".join(central)
        tail += _end_records(len(central), offset, len(tail))
        _write_all(fd, tail)
        file_crc = zlib.crc32(tail, file_crc)
        offset += len(tail)
    finally:
        os.close(fd)
    return WrittenFile(bytes=offset, crc32=f"{file_crc & 0xFFFFFFFF:08x}")


def _write_all(fd: int, data: memoryview | bytes) -> None:
    view = memoryview(data).cast("B") if not isinstance(data, memoryview) else data
    while len(view):
        written = os.write(fd, view[: 1 << 30])
        view = view[written:]
