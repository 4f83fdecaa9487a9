"""What reading each file of a universal directory told, kept in a few machine words per file.

A reader that reads a file again (a restore reads each parameter's files once per task of ranks, after a pass that
checks them all) does not parse it again: it hands out what it learnt with the stamp the file had then (size,
mtime, ctime and inode: ``ucp.model.pieces.file_stamp``; :meth:`FileMemo.known`), and the span's read refuses a
file that changed since. A checksum match is kept under its stamp too. At 10^5 parameters that is 4 x 10^5 files;
a dict of path strings to tuples held about 350 bytes per file (105 MB for a MoE), this table holds 56.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence

__all__ = ["FileMemo"]

_WORDS = 7  # flags (_KNOWN, _VERIFIED), two values, the four words of the stamp
_KNOWN = 1  # the two values were read under the stamp
_VERIFIED = 2  # the file's checksum matched under the stamp


class FileMemo:
    """Two integers per file of parameter ``name`` and file ``key`` (an offset and a length, or a step), and whether
    its checksum matched, each valid while the file's stamp is the one it was learnt under."""

    def __init__(self, names: Sequence[str], keys: Sequence[str], index: Mapping[str, int] | None = None) -> None:
        """``index`` maps each name to its place in ``names``; a caller that has one (the manifest's table) passes
        it, and the memo holds no second dict of 10^5 names."""
        self._keys = list(keys)
        self._key = {key: j for j, key in enumerate(self._keys)}
        self._names = names
        self._index = {name: i for i, name in enumerate(names)} if index is None else index
        self._data = array("q", bytes(8 * _WORDS * len(names) * len(self._key)))

    @property
    def slots(self) -> int:
        """How many files the table has room for: one slot per parameter and file key."""
        return len(self._names) * len(self._key)

    def slot(self, name: str, key: str) -> int | None:
        """The file's number in this table (None: a parameter or key it does not know)."""
        i, j = self._index.get(name), self._key.get(key)
        return None if i is None or j is None else i * len(self._keys) + j

    def file_of(self, slot: int) -> tuple[str, str]:
        """The (parameter, file key) of a slot."""
        return self._names[slot // len(self._keys)], self._keys[slot % len(self._keys)]

    def _at(self, name: str, key: str) -> int | None:
        slot = self.slot(name, key)
        return None if slot is None else slot * _WORDS

    def known(self, name: str, key: str) -> tuple[int, int, tuple[int, ...]] | None:
        """The two values read from the file and the stamp it had then, whatever it has now: for a caller whose
        later read of the file refuses it if its stamp changed."""
        at = self._at(name, key)
        if at is None or not self._data[at] & _KNOWN:
            return None
        return self._data[at + 1], self._data[at + 2], self._stamp(at)

    def verified(self, name: str, key: str, stamp: tuple[int, ...] | None) -> bool:
        """Whether the file's checksum matched while it had this stamp."""
        return self._under(name, key, stamp, _VERIFIED) is not None

    def put(self, name: str, key: str, stamp: tuple[int, ...] | None, first: int, second: int) -> None:
        """Remember two values read from a file with this stamp (none kept without a stamp)."""
        at = self._at(name, key)
        if at is None or stamp is None or len(stamp) != 4:
            return
        flags = _KNOWN | (self._data[at] & _VERIFIED if self._stamp(at) == stamp else 0)
        self._data[at : at + _WORDS] = array("q", (flags, first, second, *stamp))

    def verify(self, name: str, key: str, stamp: tuple[int, ...] | None) -> None:
        """Remember that the file's checksum matched while it had this stamp."""
        at = self._at(name, key)
        if at is None or stamp is None or len(stamp) != 4:
            return
        if self._stamp(at) == stamp:
            self._data[at] |= _VERIFIED
        else:
            self._data[at : at + _WORDS] = array("q", (_VERIFIED, 0, 0, *stamp))

    def forget(self, name: str, key: str) -> None:
        at = self._at(name, key)
        if at is not None:
            self._data[at] = 0

    def _stamp(self, at: int) -> tuple[int, ...]:
        data = self._data
        return data[at + 3], data[at + 4], data[at + 5], data[at + 6]

    def _under(self, name: str, key: str, stamp: tuple[int, ...] | None, flag: int) -> int | None:
        """The file's place in the table, if ``flag`` was set under this stamp."""
        at = self._at(name, key)
        if at is None or stamp is None or len(stamp) != 4 or not self._data[at] & flag or self._stamp(at) != stamp:
            return None
        return at
