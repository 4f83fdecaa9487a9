"""Filling a reserved record of a laid-out torch file (:func:`ucp.io.torchzip.lay_out`) front to back.

A ZeRO-3 restore at 10^5 parameters writes each rank's flat buffers from 10^5 slices of a few KB: written one by one
that is a system call per parameter, state and rank. A :class:`RecordFill` gathers them in one buffer and writes it
with one ``pwrite`` when full, CRC'ing each slice as it arrives, so the record's crc32 is known when its last byte
is; a slice of spans too large to gather is copied straight from its files (:func:`ucp.io.span_copy.copy_spans`,
by the pool when it is large).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

from ucp.io.crc import crc32_combine
from ucp.io.span_copy import PARALLEL_MIN, Copied, copy_spans, write_all_at

__all__ = ["RecordFill"]

_ZEROS = memoryview(bytes(1 << 20))


class RecordFill:
    """The ``nbytes`` bytes at ``offset`` of ``fd``, written in order through a buffer of ``buffer`` bytes."""

    def __init__(self, fd: int, offset: int, nbytes: int, buffer: memoryview) -> None:
        self.fd, self.offset, self.nbytes = fd, offset, nbytes
        self.buf = buffer
        self.fill = 0  # bytes gathered in the buffer
        self.done = 0  # bytes of the record placed: written or gathered
        self.crc = 0

    def put(self, data: memoryview) -> None:
        """Append bytes from memory."""
        n = len(data)
        self._room(n)
        self.crc = zlib.crc32(data, self.crc)
        if n > len(self.buf):  # too big to gather: from its own memory
            self._flush()
            write_all_at(self.fd, data, self.offset + self.done)
        else:
            if n > len(self.buf) - self.fill:
                self._flush()
            self.buf[self.fill : self.fill + n] = data
            self.fill += n
        self.done += n

    def zeros(self, nbytes: int) -> None:
        """Append ``nbytes`` zero bytes (the padding of a partition, the gap before a member's slot)."""
        while nbytes > 0:
            n = min(nbytes, len(_ZEROS))
            self.put(_ZEROS[:n])
            nbytes -= n

    def zeros_to(self, position: int) -> None:
        """Append zeros up to byte ``position`` of the record."""
        if position < self.done:
            raise ValueError(f"a record filled to byte {self.done} cannot go back to {position}")
        self.zeros(position - self.done)

    def copy(self, parts: Sequence[Copied]) -> None:
        """Append spans of files (and bytes), copied straight from the files: for slices too large to gather."""
        nbytes = sum(p.nbytes if not isinstance(p, (bytes, memoryview)) else len(p) for p in parts)
        self._room(nbytes)
        self._flush()
        crc = copy_spans(self.fd, parts, self.offset + self.done, 0, parallel=nbytes >= PARALLEL_MIN)
        self.crc = crc32_combine(self.crc, crc, nbytes)
        self.done += nbytes

    def close(self) -> int:
        """Write what is gathered; the record must be full. Returns its crc32."""
        self._flush()
        if self.done != self.nbytes:
            raise ValueError(f"a record of {self.nbytes} bytes was filled with {self.done}")
        return self.crc

    def _room(self, n: int) -> None:
        if self.done + n > self.nbytes:
            raise ValueError(f"{n} more bytes overflow a record of {self.nbytes} filled to {self.done}")

    def _flush(self) -> None:
        if self.fill:
            write_all_at(self.fd, self.buf[: self.fill], self.offset + self.done - self.fill)
            self.fill = 0
