"""What reading each file of a universal directory told, kept in a few machine words per file.

A reader that reads a file again (a restore reads each parameter's files once per task of ranks, after a pass that
checks them all) does not parse it again while it is still the file it parsed: same size, mtime, ctime and inode
(``ucp.model.pieces.file_stamp``); a file that changed is parsed and checked again. At 10^5 parameters that is
4 x 10^5 files; a dict of path strings to tuples held about 350 bytes per file (105 MB for a MoE), this table
holds 56.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

__all__ = ["FileMemo"]

_WORDS = 7  # known (0/1), two values, the four words of the stamp


class FileMemo:
    """Two integers per file of parameter ``name`` and file ``key`` (an offset and a length, or a step), valid while
    the file's stamp is the one they were read under."""

    def __init__(self, names: Iterable[str], keys: Sequence[str]) -> None:
        self._key = {key: j for j, key in enumerate(keys)}
        self._base = {name: i * len(self._key) for i, name in enumerate(names)}
        self._data = array("q", bytes(8 * _WORDS * len(self._base) * len(self._key)))

    def _at(self, name: str, key: str) -> int | None:
        base, j = self._base.get(name), self._key.get(key)
        return None if base is None or j is None else (base + j) * _WORDS

    def get(self, name: str, key: str, stamp: tuple[int, ...] | None) -> tuple[int, int] | None:
        """The two values read from the file, if it is still the file they were read from."""
        at = self._at(name, key)
        if at is None or stamp is None or len(stamp) != 4 or not self._data[at]:
            return None
        data = self._data
        if (data[at + 3], data[at + 4], data[at + 5], data[at + 6]) != stamp:
            return None
        return data[at + 1], data[at + 2]

    def put(self, name: str, key: str, stamp: tuple[int, ...] | None, first: int, second: int) -> None:
        """Remember two values read from a file with this stamp (none kept without a stamp)."""
        at = self._at(name, key)
        if at is None or stamp is None or len(stamp) != 4:
            return
        self._data[at : at + _WORDS] = array("q", (1, first, second, *stamp))

    def forget(self, name: str, key: str) -> None:
        at = self._at(name, key)
        if at is not None:
            self._data[at] = 0
