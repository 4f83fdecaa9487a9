"""A torch zip file's records on its read-only mapping (``ucp.io.torchfile``): where each member's bytes lie,
checked before any is used, and each storage the pickle asks for as a zero-copy view of its record."""

from __future__ import annotations

import logging
import mmap
import struct
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ucp.errors import CorruptFileError
from ucp.io.allow_list import one_line

__all__ = ["ZIP_MAGIC", "Handed", "Records", "storage_loader", "zip_records"]

logger = logging.getLogger(__name__)

ZIP_MAGIC = b"PK\x03\x04"
#: What a storage loader hands out, per storage: (key, storage, bytes the record must hold, persistent id).
Handed = tuple[str, torch.UntypedStorage, int, Any]
#: storages of at most this many bytes (one 0-dim tensor) are copied out of the mapping, not viewed
COPY_MAX = 8
#: each zip member's (data offset, length) in the file
Records = dict[str, tuple[int, int]]


def zip_records(path: Path, mm: mmap.mmap, size: int) -> tuple[Records, str]:
    """Map each zip member to (data offset, length); members are stored uncompressed by torch. Also returns
    the name of the pickle (``.../data.pkl``)."""
    # read from the mapping, not the path: no second descriptor, no second read of the directory's pages
    if not zipfile.is_zipfile(mm):  # type: ignore[arg-type]  # mmap is a seekable file object
        raise CorruptFileError(f"{path} is truncated or corrupt: its zip directory is missing or damaged")
    try:
        with zipfile.ZipFile(mm) as zf:  # type: ignore[call-overload]
            infos = zf.infolist()
    except Exception as err:  # zipfile raises BadZipFile, ValueError, struct.error, UnicodeDecodeError...
        raise CorruptFileError(f"{path} is truncated or corrupt: {one_line(err, 120)}") from None
    records: Records = {}
    pickle_name = ""
    pickle_crc = 0
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
            raise CorruptFileError(f"{path}: member {info.filename!r} is compressed or damaged; not a torch.save file")
        head = info.header_offset
        if head < 0 or head + 30 > size or mm[head : head + 4] != ZIP_MAGIC:
            raise CorruptFileError(f"{path} is truncated or corrupt: bad local header for {info.filename!r}")
        name_len, extra_len = struct.unpack("<HH", mm[head + 26 : head + 30])
        start = head + 30 + name_len + extra_len
        if info.file_size < 0 or start + info.file_size > size:
            raise CorruptFileError(f"{path} is truncated: {info.filename!r} runs past the end of the file")
        records[info.filename] = (start, info.file_size)
        if info.filename.endswith("/data.pkl") and info.filename.count("/") == 1:
            pickle_name = info.filename
            pickle_crc = info.CRC
    if not pickle_name:
        raise CorruptFileError(f"{path} has no data.pkl; not a torch.save file")
    start, length = records[pickle_name]
    # torch writes CRC 0 when crc32 is switched off (torch.serialization.set_crc32_options)
    if pickle_crc and zlib.crc32(mm[start : start + length]) != pickle_crc:
        raise CorruptFileError(f"{path} is corrupt: the checksum of {pickle_name} does not match")
    prefix = pickle_name[: -len("data.pkl")]
    order = records.get(prefix + "byteorder")
    if order is not None and bytes(mm[order[0] : order[0] + order[1]]) != b"little":
        raise CorruptFileError(f"{path} was written big-endian; ucp reads little-endian files only")
    return records, pickle_name


def storage_loader(
    path: Path, mm: mmap.mmap, records: Records, prefix: str
) -> tuple[Callable[[Any], torch.storage.TypedStorage], list[Handed]]:
    """The unpickler's ``persistent_load``: each storage a zero-copy view of its record, checked
    against the record's length; and the list of (key, storage, bytes, persistent id) it hands out,
    because torch grows an empty storage that a tensor overruns (checked once the pickle is read)."""
    storages: dict[str, torch.storage.TypedStorage] = {}
    sizes: list[Handed] = []

    def persistent_load(saved_id: Any) -> torch.storage.TypedStorage:
        if not isinstance(saved_id, tuple) or len(saved_id) != 5 or saved_id[0] != "storage":
            raise CorruptFileError(f"{path}: unexpected persistent id {saved_id!r:.80}")
        _, storage_type, key, _location, numel = saved_id
        dtype = getattr(storage_type, "dtype", None)
        if not isinstance(dtype, torch.dtype) or not isinstance(key, str) or not isinstance(numel, int):
            raise CorruptFileError(f"{path}: malformed storage reference {saved_id!r:.80}")
        if key in storages:
            return storages[key]
        record = records.get(f"{prefix}data/{key}")
        if record is None:
            raise CorruptFileError(f"{path}: storage {key} is missing from the archive")
        nbytes = numel * dtype.itemsize
        if numel < 0 or nbytes > record[1]:
            raise CorruptFileError(f"{path}: storage {key} holds {record[1]} bytes, needs {nbytes}")
        # A frombuffer view per record: zero-copy like a slice of the whole mapping, but copying from
        # a slice of one big UntypedStorage was measured 10-30x slower (torch 2.13, CPU). A 0-dim counter
        # or scalar is copied instead: read after the file's pages were dropped, it would map a whole folio
        # of the file back in (DP 4096: 500 MiB of RSS for one step counter per rank file).
        if nbytes > COPY_MAX:
            raw = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=record[0]).untyped_storage()
        elif nbytes:
            raw = torch.frombuffer(bytearray(mm[record[0] : record[0] + nbytes]), dtype=torch.uint8).untyped_storage()
        else:
            raw = torch.UntypedStorage(0)
        typed = torch.storage.TypedStorage(wrap_storage=raw, dtype=dtype, _internal=True)
        storages[key] = typed
        sizes.append((key, raw, nbytes, saved_id))
        return typed

    return persistent_load, sizes
