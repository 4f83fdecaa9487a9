"""A torch zip file's records on its read-only mapping (``ucp.io.torchfile``): where each member's bytes lie,
checked before any is used, and each storage the pickle asks for as a zero-copy view of its record."""

from __future__ import annotations

import logging
import mmap
import struct
import zlib
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ucp.errors import CorruptFileError

__all__ = ["CENTRAL_ENTRY", "END_RECORD", "ZIP_MAGIC", "Handed", "Records", "storage_loader", "zip_records"]

logger = logging.getLogger(__name__)

ZIP_MAGIC = b"PK\x03\x04"
#: What a storage loader hands out, per storage: (key, storage, bytes the record must hold, persistent id).
Handed = tuple[str, torch.UntypedStorage, int, Any]
#: storages of at most this many bytes (one 0-dim tensor) are copied out of the mapping, not viewed
COPY_MAX = 8
END_RECORD = struct.Struct("<IHHHHIIH")  # a zip's end of central directory record
_ZIP64_LOCATOR = struct.Struct("<IIQI")
_ZIP64_EOCD = struct.Struct("<IQHHIIQQQQ")
CENTRAL_ENTRY = struct.Struct("<IHHHHHHIIIHHHHHII")  # a central directory entry, its name after
_LOCAL = struct.Struct("<I22xHH")  # a local header's signature, name length, extra length
_LOCAL_SIG = 0x04034B50
_ZIP64_EXTRA = 0x0001
_FULL = 0xFFFFFFFF


class Records:
    """Each zip member's (data offset, length) in the file. Members ``<archive>/data/<n>`` for n = 0, 1, 2... in
    order (every storage torch or ucp writes) are two words in arrays; any other member is a dict entry. A MoE's
    ZeRO-3 model-states file has 10^5 members: as ``zipfile`` reads them (a ZipInfo each) and a dict of them, that
    was 65 MB while the file opened; here 1.6."""

    def __init__(self) -> None:
        self._archive: str | None = None
        self._offsets = array("q")
        self._lengths = array("q")
        self._named: dict[str, tuple[int, int]] = {}

    def __len__(self) -> int:
        return len(self._offsets) + len(self._named)

    def _number(self, name: str) -> int | None:
        """n of ``<archive>/data/<n>`` written plainly, the archive being the first member's; else None."""
        archive, sep, rest = name.partition("/data/")
        if not sep or archive != self._archive or not rest.isdigit() or not rest.isascii():
            return None
        return int(rest) if rest == "0" or rest[0] != "0" else None

    def add(self, name: str, start: int, length: int) -> None:
        if self._archive is None:
            self._archive = name.split("/", 1)[0]
        if self._number(name) == len(self._offsets) and name not in self._named:  # the next number: new
            self._offsets.append(start)
            self._lengths.append(length)
        elif name in self:
            raise ValueError(f"member {name!r} is given twice")
        else:
            self._named[name] = (start, length)

    def get(self, name: str) -> tuple[int, int] | None:
        n = self._number(name)
        if n is not None and n < len(self._offsets):
            return self._offsets[n], self._lengths[n]
        return self._named.get(name)

    def __getitem__(self, name: str) -> tuple[int, int]:
        found = self.get(name)
        if found is None:
            raise KeyError(name)
        return found

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.get(name) is not None


def zip_records(path: Path, mm: mmap.mmap, size: int) -> tuple[Records, str]:
    """Map each zip member to (data offset, length); members are stored uncompressed by torch. Also returns
    the name of the pickle (``.../data.pkl``). The central directory is read here, zip64 included, with the checks
    ``zipfile`` makes and a few more (every member stored, where its local header says, inside the file)."""
    # read from the mapping, not the path: no second descriptor, no second read of the directory's pages
    damaged = CorruptFileError(f"{path} is truncated or corrupt: its zip directory is missing or damaged")
    directory = _directory(mm, size)
    if directory is None:
        raise damaged
    count, cd_offset, cd_end = directory
    records = Records()
    pickle_name = ""
    pickle_crc = 0
    pos = cd_offset
    for _ in range(count):
        if pos + CENTRAL_ENTRY.size > cd_end:
            raise damaged
        fields = CENTRAL_ENTRY.unpack_from(mm, pos)
        name_len, extra_len, comment_len = fields[10], fields[11], fields[12]
        end = pos + CENTRAL_ENTRY.size + name_len + extra_len + comment_len
        if fields[0] != 0x02014B50 or end > cd_end:
            raise damaged
        name_at = pos + CENTRAL_ENTRY.size
        name = mm[name_at : name_at + name_len].decode("utf-8" if fields[3] & 0x800 else "cp437", "replace")
        compressed, length, head = fields[8], fields[9], fields[16]
        if _FULL in (compressed, length, head):  # zip64: the real values are in the extra field
            extra = mm[name_at + name_len : name_at + name_len + extra_len]
            wide = _zip64_values(extra, [v == _FULL for v in (length, compressed, head)])
            if wide is None:
                raise damaged
            length, compressed, head = (w if w is not None else v for w, v in zip(wide, (length, compressed, head)))
        if fields[4] != 0 or fields[3] & 1 or compressed != length:
            raise CorruptFileError(f"{path}: member {name!r} is compressed or damaged; not a torch.save file")
        if head + _LOCAL.size > size or _LOCAL.unpack_from(mm, head)[0] != _LOCAL_SIG:
            raise CorruptFileError(f"{path} is truncated or corrupt: bad local header for {name!r}")
        _, local_name, local_extra = _LOCAL.unpack_from(mm, head)
        start = head + _LOCAL.size + local_name + local_extra
        if start + length > size:
            raise CorruptFileError(f"{path} is truncated: {name!r} runs past the end of the file")
        try:
            records.add(name, start, length)
        except ValueError as err:
            raise CorruptFileError(f"{path} is corrupt: {err}") from None
        if name.endswith("/data.pkl") and name.count("/") == 1:
            pickle_name = name
            pickle_crc = fields[7]
        pos = end
    if pos != cd_end:
        raise damaged
    if not pickle_name:
        raise CorruptFileError(f"{path} has no data.pkl; not a torch.save file")
    start, length = records[pickle_name]
    # torch writes CRC 0 when crc32 is switched off (torch.serialization.set_crc32_options)
    with memoryview(mm) as view:  # no copy of a pickle of 10^5 tensors
        crc = zlib.crc32(view[start : start + length]) if pickle_crc else 0
    if crc != pickle_crc:
        raise CorruptFileError(f"{path} is corrupt: the checksum of {pickle_name} does not match")
    prefix = pickle_name[: -len("data.pkl")]
    order = records.get(prefix + "byteorder")
    if order is not None and bytes(mm[order[0] : order[0] + order[1]]) != b"little":
        raise CorruptFileError(f"{path} was written big-endian; ucp reads little-endian files only")
    return records, pickle_name


def _directory(mm: mmap.mmap, size: int) -> tuple[int, int, int] | None:
    """(member count, start, end) of the central directory, from the end records (zip64 where they say so);
    None when they are missing or do not fit the file."""
    at = size - END_RECORD.size
    if at < 0:
        return None
    if mm[at : at + 4] != b"PK\x05\x06":  # a comment after the end record: search back as far as one can reach
        at = mm.rfind(b"PK\x05\x06", max(0, size - END_RECORD.size - 0xFFFF), size - END_RECORD.size + 4)
        if at < 0:
            return None
    sig, disk, cd_disk, _, count, cd_size, cd_offset, comment = END_RECORD.unpack_from(mm, at)
    if disk or cd_disk or at + END_RECORD.size + comment != size:
        return None
    locator = at - _ZIP64_LOCATOR.size
    if locator >= 0 and mm[locator : locator + 4] == b"PK\x06\x07":
        _, _, end64, _ = _ZIP64_LOCATOR.unpack_from(mm, locator)
        if end64 + _ZIP64_EOCD.size > locator or mm[end64 : end64 + 4] != b"PK\x06\x06":
            return None
        fields = _ZIP64_EOCD.unpack_from(mm, end64)
        if fields[4] or fields[5] or fields[6] != fields[7]:
            return None
        count, cd_size, cd_offset = fields[7], fields[8], fields[9]
        at = end64
    if cd_offset + cd_size > at or count > cd_size // CENTRAL_ENTRY.size:
        return None
    return count, cd_offset, cd_offset + cd_size


def _zip64_values(extra: bytes, wide: list[bool]) -> list[int | None] | None:
    """The 8-byte values a central entry's zip64 extra field holds, in order, for each field marked ``wide``
    (its 4-byte field reads 0xFFFFFFFF); None where the field is missing or short."""
    if not any(wide):
        return [None] * len(wide)
    pos = 0
    while pos + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, pos)
        if tag == _ZIP64_EXTRA:
            body = extra[pos + 4 : pos + 4 + length]
            out: list[int | None] = []
            at = 0
            for flag in wide:
                if flag and at + 8 > len(body):
                    return None
                out.append(struct.unpack_from("<Q", body, at)[0] if flag else None)
                at += 8 if flag else 0
            return out
        pos += 4 + length
    return None


def storage_loader(
    path: Path, mm: mmap.mmap, records: Records, prefix: str
) -> tuple[Callable[[Any], torch.storage.TypedStorage], list[Handed]]:
    """The unpickler's ``persistent_load``: each storage a zero-copy view of its record, checked
    against the record's length; and the list of (key, storage, bytes, persistent id) it hands out,
    because torch grows an empty storage that a tensor overruns (checked once the pickle is read)."""
    storages: dict[str, torch.storage.TypedStorage] = {}
    sizes: list[Handed] = []
    # one empty storage per dtype, for every record of no bytes: a ZeRO-3 model-states file has one per parameter
    empty: dict[torch.dtype, torch.storage.TypedStorage] = {}

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
        if not nbytes:
            typed = empty.get(dtype)  # (an empty storage is falsy: no ``or``)
            if typed is None:
                typed = empty[dtype] = torch.storage.TypedStorage(
                    wrap_storage=torch.UntypedStorage(0), dtype=dtype, _internal=True
                )
        else:
            if nbytes > COPY_MAX:
                raw = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=record[0]).untyped_storage()
            else:
                copied = bytearray(mm[record[0] : record[0] + nbytes])
                raw = torch.frombuffer(copied, dtype=torch.uint8).untyped_storage()
            typed = torch.storage.TypedStorage(wrap_storage=raw, dtype=dtype, _internal=True)
        storages[key] = typed
        sizes.append((key, typed._untyped_storage, nbytes, saved_id))
        return typed

    return persistent_load, sizes
