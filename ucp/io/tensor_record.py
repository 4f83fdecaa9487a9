"""Single-tensor files of a known layout, found without unpickling, and checked from copied spans.

A universal directory holds one small torch file per parameter and state key, written by ucp's own
deterministic writer: its ``data.pkl`` depends only on the tensor's shape and dtype. So a reader that
knows what a file must hold (the manifest says) compares the file's ``data.pkl`` with the bytes
ucp would write (:func:`ucp.io.torchzip.data_pickle`) and takes the tensor's place from the zip
directory: the same answer as the weights_only unpickler (byte-equal pickles unpickle alike) for a
few small reads. Anything unexpected (another writer, zip64, a damaged directory) returns None and
the caller parses the file the slow, general way.

:class:`SpanCheck` then checks the whole file's crc32 against the manifest from the crc32s a
writer computed anyway while streaming the tensor's bytes (``PathSpan.witness``): the head and tail
around the tensor are CRC'd here, gaps nobody copied are read, and ``crc32_combine`` joins them.
"""

from __future__ import annotations

import os
import struct
import threading
import zlib
from dataclasses import dataclass, field

from ucp.io.crc import crc32_combine
from ucp.model.pieces import file_stamp

__all__ = ["TensorRecord", "find_tensor_record", "SpanCheck"]

_WINDOW = 8192  # bytes read from each end of the file: ucp's headers and directory fit well inside
_EOCD = struct.Struct("<IHHHHIIH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_LOCAL = struct.Struct("<IHHHHHIIIHH")


@dataclass(frozen=True, slots=True)
class TensorRecord:
    """Where a file's one tensor lies, and the crc32s of the bytes around it."""

    offset: int
    nbytes: int
    size: int  # the whole file
    stamp: tuple[int, ...]  # ucp.model.pieces.file_stamp, taken on the open descriptor
    head_crc: int  # crc32 of bytes [0, offset)
    tail_crc: int  # crc32 of bytes [offset + nbytes, size)
    data: bytes | None = None  # the tensor's bytes, read along when the file is small

    def file_crc(self, data_crc: int) -> int:
        """The whole file's crc32, given the crc32 of the tensor's bytes."""
        crc = crc32_combine(self.head_crc, data_crc, self.nbytes)
        return crc32_combine(crc, self.tail_crc, self.size - self.offset - self.nbytes)


def find_tensor_record(path: str | os.PathLike, pickle_bytes: bytes, nbytes: int) -> TensorRecord | None:
    """The tensor of a torch file whose ``data.pkl`` is exactly ``pickle_bytes`` (one storage, key
    ``0``, of ``nbytes`` bytes, little-endian); None when the file is anything else or unreadable."""
    try:
        with open(path, "rb", buffering=0) as handle:
            stat = os.fstat(handle.fileno())
            size = stat.st_size
            fd = handle.fileno()
            head = os.pread(fd, min(size, _WINDOW), 0)
            tail_start = max(size - _WINDOW, 0)
            tail = head if tail_start == 0 else os.pread(fd, size - tail_start, tail_start)
    except OSError:
        return None
    if len(head) != min(size, _WINDOW) or len(tail) != size - tail_start:
        return None
    members = _members(tail, tail_start, size)
    if members is None:
        return None
    prefixes = {name.split("/", 1)[0] for name in members}
    if len(prefixes) != 1:
        return None
    prefix = prefixes.pop()
    pkl = _member_data(members.get(f"{prefix}/data.pkl"), head)
    data = _member_data(members.get(f"{prefix}/data/0"), head, check_bytes=False)
    order = _member_data(members.get(f"{prefix}/byteorder"), head)
    if pkl is None or data is None or order is None:
        return None
    if head[pkl[0] : pkl[0] + pkl[1]] != pickle_bytes or head[order[0] : order[0] + order[1]] != b"little":
        return None
    start, length = data
    end = start + length
    if length != nbytes or end > size or end < tail_start:
        return None
    small = size <= _WINDOW
    return TensorRecord(
        offset=start,
        nbytes=nbytes,
        size=size,
        stamp=file_stamp(stat),
        head_crc=zlib.crc32(head[:start]),
        tail_crc=zlib.crc32(tail[end - tail_start :]),
        data=head[start:end] if small else None,
    )


def _members(tail: bytes, tail_start: int, size: int) -> dict[str, tuple[int, int]] | None:
    """Each member's (local header offset, size) from a plain (not zip64, no comment) directory."""
    if len(tail) < _EOCD.size:
        return None
    sig, disk, cd_disk, _, count, cd_size, cd_offset, comment = _EOCD.unpack_from(tail, len(tail) - _EOCD.size)
    if sig != 0x06054B50 or disk or cd_disk or comment or cd_offset + cd_size != size - _EOCD.size:
        return None
    if cd_offset < tail_start:
        return None
    members: dict[str, tuple[int, int]] = {}
    pos = cd_offset - tail_start
    for _ in range(count):
        if pos + _CENTRAL.size > len(tail):
            return None
        fields = _CENTRAL.unpack_from(tail, pos)
        if fields[0] != 0x02014B50 or fields[4] != 0 or fields[8] != fields[9]:
            return None
        name_len, extra_len, comment_len = fields[10], fields[11], fields[12]
        name = tail[pos + _CENTRAL.size : pos + _CENTRAL.size + name_len].decode("utf-8", "replace")
        members[name] = (fields[16], fields[9])
        pos += _CENTRAL.size + name_len + extra_len + comment_len
    return members if pos == len(tail) - _EOCD.size else None


def _member_data(member: tuple[int, int] | None, head: bytes, check_bytes: bool = True) -> tuple[int, int] | None:
    """(data offset, size) of a member whose local header lies in ``head`` (and, with
    ``check_bytes``, whose data does too)."""
    if member is None:
        return None
    offset, length = member
    if offset + _LOCAL.size > len(head):
        return None
    fields = _LOCAL.unpack_from(head, offset)
    if fields[0] != 0x04034B50 or fields[4] != 0:
        return None
    start = offset + _LOCAL.size + fields[9] + fields[10]
    if start > len(head) or (check_bytes and start + length > len(head)):
        return None
    return start, length


#: guards every check's witnessed spans (one lock, not one per file: a restore keeps a check per file, 300,000 of
#: them for 10^5 parameters, and a witness holds it for a list append)
_WITNESS_LOCK = threading.Lock()


@dataclass(slots=True)
class SpanCheck:
    """A file whose tensor was handed out before its checksum was checked: writers report the
    crc32 of each span they copy (:meth:`witness`), and :meth:`confirm` checks the whole file."""

    path: str
    record: TensorRecord
    crc32: str  # what the manifest says, 8 hex digits
    _seen: list[tuple[int, int, int]] = field(default_factory=list)

    def witness(self, offset: int, nbytes: int, crc: int) -> None:
        with _WITNESS_LOCK:
            last = self._seen[-1] if self._seen else None
            if last is not None and last[0] + last[1] == offset:  # rank after rank: one entry, not one per rank
                self._seen[-1] = (last[0], last[1] + nbytes, crc32_combine(last[2], crc, nbytes))
            else:
                self._seen.append((offset, nbytes, crc))

    def confirm(self) -> bool:
        """True when the file's crc32 is the manifest's: the spans copied, plus what nobody copied
        read now (the file must still be the one found: same size, mtime, ctime and inode)."""
        record = self.record
        pos, end, crc = record.offset, record.offset + record.nbytes, 0
        try:
            with open(self.path, "rb", buffering=0) as handle:
                if file_stamp(os.fstat(handle.fileno())) != record.stamp:
                    return False
                for offset, nbytes, span_crc in sorted(self._seen, key=lambda s: (s[0], -s[1])):
                    if offset < pos or nbytes == 0:
                        continue  # copied twice (or inside a span already counted)
                    if offset > pos:
                        crc = _crc_range(handle.fileno(), pos, offset, crc)
                    crc = crc32_combine(crc, span_crc, nbytes)
                    pos = offset + nbytes
                if pos < end:
                    crc = _crc_range(handle.fileno(), pos, end, crc)
        except OSError:
            return False
        return pos <= end and f"{record.file_crc(crc) & 0xFFFFFFFF:08x}" == self.crc32


def _crc_range(fd: int, start: int, end: int, crc: int) -> int:
    """Extend ``crc`` by the file's bytes [start, end)."""
    buf = memoryview(bytearray(min(end - start, 4 << 20)))
    while start < end:
        got = os.preadv(fd, [buf[: min(len(buf), end - start)]], start)
        if got <= 0:
            raise OSError("file ends early")
        crc = zlib.crc32(buf[:got], crc)
        start += got
    return crc
