"""Single-tensor files of a known layout, found without unpickling, and checked from copied spans.

A universal directory holds one small torch file per parameter and state key, written by ucp's own
deterministic writer: its ``data.pkl`` depends only on the tensor's shape and dtype. So a reader that
knows what a file must hold (the manifest says) compares the file's ``data.pkl`` with the bytes
ucp would write (:func:`ucp.io.torchzip.data_pickle`) and takes the tensor's place from the zip
directory: the same answer as the weights_only unpickler (byte-equal pickles unpickle alike) for a
few small reads. Anything unexpected (another writer, zip64, a damaged directory) returns None and
the caller parses the file the slow, general way.

:class:`SpanChecks` then checks the whole file's crc32 against the manifest from the crc32s a
writer computed anyway while streaming the tensor's bytes (``PathSpan.witness``): the head and tail
around the tensor are CRC'd here, gaps nobody copied are read, and ``crc32_combine`` joins them.
"""

from __future__ import annotations

import os
import struct
import threading
import zlib
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from ucp.io.crc import crc32_combine
from ucp.io.zip_records import CENTRAL_ENTRY, END_RECORD
from ucp.model.pieces import file_stamp

__all__ = ["TensorRecord", "find_tensor_record", "SpanChecks"]

_WINDOW = 8192  # bytes read from each end of the file: ucp's headers and directory fit well inside
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
    if len(tail) < END_RECORD.size:
        return None
    sig, disk, cd_disk, _, count, cd_size, cd_offset, comment = END_RECORD.unpack_from(
        tail, len(tail) - END_RECORD.size
    )
    if sig != 0x06054B50 or disk or cd_disk or comment or cd_offset + cd_size != size - END_RECORD.size:
        return None
    if cd_offset < tail_start:
        return None
    members: dict[str, tuple[int, int]] = {}
    pos = cd_offset - tail_start
    for _ in range(count):
        if pos + CENTRAL_ENTRY.size > len(tail):
            return None
        fields = CENTRAL_ENTRY.unpack_from(tail, pos)
        if fields[0] != 0x02014B50 or fields[4] != 0 or fields[8] != fields[9]:
            return None
        name_len, extra_len, comment_len = fields[10], fields[11], fields[12]
        name = tail[pos + CENTRAL_ENTRY.size : pos + CENTRAL_ENTRY.size + name_len].decode("utf-8", "replace")
        members[name] = (fields[16], fields[9])
        pos += CENTRAL_ENTRY.size + name_len + extra_len + comment_len
    return members if pos == len(tail) - END_RECORD.size else None


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


#: guards every check's witnessed spans (one lock, not one per file: a restore of 10^5 parameters checks 300,000 files,
#: and a witness holds it for a few integer operations)
_WITNESS_LOCK = threading.Lock()

_OPEN, _GOOD, _BAD = 1, 2, 3  # a slot's state (0: no check)
_PAGE = 1024  # slots per page of a SpanChecks' arrays


class SpanChecks:
    """Files whose tensors were handed out before their checksums were checked, one numbered slot per file: writers
    report the crc32 of each span they copy (the witness :meth:`add` returns), and a file's check settles as soon as
    the spans reported cover its tensor, telling ``settled(slot, ok)`` once; :meth:`confirm` checks one that never
    settled, reading what nobody copied.

    A restore of 10^5 parameters hands out 300,000 files before copying any, so a check is a few machine words in
    arrays (77 bytes a slot), not an object (about 900 bytes with its record, stamp and path); the arrays come in
    pages of 1024 slots, each made when a slot of it is first checked (a MoE's many small files, read whole, are
    never checked this way and cost one byte each). The spans reported for a file not covered yet are the only
    thing kept per file, and only until it settles."""

    def __init__(self, slots: int, settled: Callable[[int, bool], None] | None = None) -> None:
        self._settled = settled
        self._state = bytearray(slots)
        # per page: the words of each slot (offset, nbytes, size, the four words of the stamp, bytes reported,
        # twice-copied ones twice), and its crcs (the manifest's crc32, head_crc, tail_crc)
        self._pages: dict[int, tuple[array[int], array[int]]] = {}
        self._seen: dict[int, list[tuple[int, int, int]]] = {}

    def add(self, slot: int, record: TensorRecord, crc32: str) -> Callable[[int, int, int], None]:
        """Check slot ``slot``: the file ``record`` found, whose crc32 must be ``crc32`` (8 hex digits). Returns the
        witness its spans carry (``PathSpan.witness``)."""
        if len(record.stamp) != 4:
            raise ValueError("a file stamp is four integers")
        with _WITNESS_LOCK:
            self._state[slot] = _OPEN
            words, crcs, i = self._page(slot)
            words[8 * i : 8 * i + 8] = array("q", (record.offset, record.nbytes, record.size, *record.stamp, 0))
            crcs[3 * i : 3 * i + 3] = array("I", (int(crc32, 16), record.head_crc, record.tail_crc))
            self._seen.pop(slot, None)
        return partial(self.witness, slot)

    def witness(self, slot: int, offset: int, nbytes: int, crc: int) -> None:
        """The writer copied the file's bytes [offset, offset + nbytes), whose crc32 is ``crc``."""
        with _WITNESS_LOCK:
            if self._state[slot] != _OPEN:
                return  # settled: a second copy of the same bytes
            seen = self._seen.setdefault(slot, [])
            last = seen[-1] if seen else None
            if last is not None and last[0] + last[1] == offset:  # rank after rank: one entry, not one per rank
                seen[-1] = (last[0], last[1] + nbytes, crc32_combine(last[2], crc, nbytes))
            else:
                seen.append((offset, nbytes, crc))
            words, _, i = self._page(slot)
            words[8 * i + 7] += nbytes
            if words[8 * i + 7] < words[8 * i + 1]:
                return
            joined = self._join(slot, None)
            if joined is None:
                return  # a gap left (some bytes were reported twice)
            ok = self._matches(slot, joined)
            self._state[slot] = _GOOD if ok else _BAD
            del self._seen[slot]
        if self._settled is not None:
            self._settled(slot, ok)

    def is_open(self, slot: int) -> bool:
        """Whether slot ``slot`` is checked and not settled."""
        return self._state[slot] == _OPEN

    def open_slots(self) -> list[int]:
        """The slots checked but not settled."""
        return [slot for slot, state in enumerate(self._state) if state == _OPEN]

    def stamp(self, slot: int) -> tuple[int, ...]:
        """The stamp the file had when it was found."""
        words, _, i = self._page(slot)
        return tuple(words[8 * i + 3 : 8 * i + 7])

    def confirm(self, slot: int, path: str | os.PathLike) -> bool:
        """True when the file's crc32 is the manifest's: the spans copied, plus what nobody copied read now from
        ``path`` (it must still be the file found: same size, mtime, ctime and inode)."""
        if self._state[slot] in (_GOOD, _BAD):
            return self._state[slot] == _GOOD
        try:
            with open(path, "rb", buffering=0) as handle:
                if file_stamp(os.fstat(handle.fileno())) != self.stamp(slot):
                    return False
                joined = self._join(slot, handle.fileno())
        except OSError:
            return False
        return joined is not None and self._matches(slot, joined)

    def _join(self, slot: int, fd: int | None) -> int | None:
        """The crc32 of the tensor's bytes from the spans reported, the gaps read from ``fd`` (None: no gap
        allowed, and None back if there is one)."""
        words, _, i = self._page(slot)
        offset, nbytes = words[8 * i], words[8 * i + 1]
        pos, end, crc = offset, offset + nbytes, 0
        for start, length, span_crc in sorted(self._seen.get(slot, ()), key=lambda s: (s[0], -s[1])):
            if start < pos or length == 0:
                continue  # copied twice (or inside a span already counted)
            if start > pos:
                if fd is None:
                    return None
                crc = _crc_range(fd, pos, start, crc)
            crc = crc32_combine(crc, span_crc, length)
            pos = start + length
        if pos < end:
            if fd is None:
                return None
            crc = _crc_range(fd, pos, end, crc)
        return crc if pos <= end else None

    def _page(self, slot: int) -> tuple[array[int], array[int], int]:
        """The arrays of ``slot``'s page, and its index in them."""
        number, i = divmod(slot, _PAGE)
        page = self._pages.get(number)
        if page is None:
            page = self._pages[number] = (array("q", bytes(8 * 8 * _PAGE)), array("I", bytes(4 * 3 * _PAGE)))
        return page[0], page[1], i

    def _matches(self, slot: int, data_crc: int) -> bool:
        words, crcs, i = self._page(slot)
        offset, nbytes, size = words[8 * i : 8 * i + 3]
        expected, head, tail = crcs[3 * i : 3 * i + 3]
        crc = crc32_combine(crc32_combine(head, data_crc, nbytes), tail, size - offset - nbytes)
        return crc & 0xFFFFFFFF == expected


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
