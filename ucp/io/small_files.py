"""Small input files (``latest``, ``trainer_state.json``, DCP's ``.metadata``) read whole, within a bound.

Each is a few bytes to a few megabytes when a framework wrote it; a damaged or hostile one can be
any size, and reading it whole would fill memory before any check runs. So every such read stops at
a limit fitting what the file holds and refuses a larger file in one line.
"""

from __future__ import annotations

import os
from pathlib import Path

from ucp.errors import CorruptFileError, InputError

__all__ = ["read_small"]


def read_small(path: Path, limit: int, what: str) -> bytes:
    """``path``'s bytes, at most ``limit`` of them; a larger file is refused (``what`` names it)."""
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size > limit:
                raise CorruptFileError(f"{path} has {size:,} bytes; a {what} is at most {limit:,}")
            data = handle.read(limit + 1)
    except IsADirectoryError:
        raise CorruptFileError(f"{path} is a folder, not a {what}") from None
    except OSError as err:
        raise InputError(f"cannot read {path}: {err.strerror}") from None
    if len(data) > limit:  # grew while read
        raise CorruptFileError(f"{path} has more than {limit:,} bytes; a {what} is at most {limit:,}")
    return data
