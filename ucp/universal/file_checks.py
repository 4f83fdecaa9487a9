"""A universal directory's files checked without unpickling them: the size the manifest claims (one stat), and
the files of ucp's own layout, whose ``data.pkl`` ucp would write byte for byte, found by it
(``ucp.universal.reader``)."""

from __future__ import annotations

import functools
import logging
import math
import os
import struct
import zlib
from pathlib import Path
from stat import S_ISREG

import torch

from ucp.errors import ChecksumError, CorruptFileError
from ucp.io.tensor_record import find_tensor_record
from ucp.io.torchpickle import data_pickle
from ucp.model.pieces import PathSpan, Pieces, file_stamp
from ucp.universal.file_names import MANIFEST
from ucp.universal.manifest import FileEntry

__all__ = ["FP32_BYTES", "check_file", "param_pickle", "small_step", "stamp_of", "step_pickle"]

logger = logging.getLogger(__name__)

FP32_BYTES = 4


def check_file(file: Path, claim: FileEntry) -> None:
    """A file the manifest lists: there, a plain file, of the size it gives (one stat)."""
    try:
        st = os.lstat(file)
    except OSError:
        raise CorruptFileError(f"{file} is missing from the universal directory; {MANIFEST} lists it") from None
    if not S_ISREG(st.st_mode):
        raise CorruptFileError(f"{file} is not a plain file; a universal directory holds only plain files")
    if st.st_size != claim.bytes:
        raise ChecksumError(
            f"{file} has {st.st_size:,} bytes; {MANIFEST} says {claim.bytes:,}: the file changed or is corrupt"
        )


def small_step(path: Path, claim: FileEntry, *, verify: bool) -> tuple[float, tuple[int, ...]] | None:
    """step.pt as ucp writes it, read and (``verify``) checked without unpickling, and the stamp the file had when
    read; None for any other file."""
    record = find_tensor_record(path, step_pickle(), FP32_BYTES)
    if record is None or record.data is None or record.size != claim.bytes:
        return None
    if verify and f"{record.file_crc(zlib.crc32(record.data)) & 0xFFFFFFFF:08x}" != claim.crc32:
        raise ChecksumError(f"{path} does not match its checksum in {MANIFEST}: the file changed or is corrupt")
    return float(struct.unpack("<f", record.data)[0]), record.stamp


@functools.lru_cache(maxsize=256)
def param_pickle(shape: tuple[int, ...]) -> bytes:
    """The data.pkl ucp writes for a parameter file of this shape (its values never enter it)."""
    nbytes = math.prod(shape) * FP32_BYTES
    return data_pickle({"param": Pieces((PathSpan("", 0, nbytes, ()),), shape, torch.float32)})


@functools.lru_cache(maxsize=1)
def step_pickle() -> bytes:
    """The data.pkl of step.pt as ucp writes it: a bare 0-dim float32 tensor."""
    return data_pickle(torch.zeros((), dtype=torch.float32))


def stamp_of(path: Path) -> tuple[int, ...] | None:
    try:
        return file_stamp(path.stat())
    except OSError:
        return None
