"""A universal file's checksum is taken window by window over its mapping, each window's pages handed back
(``ucp.io.crc.crc32_mapped``): the same crc32 as one pass, for any size around the window."""

from __future__ import annotations

import mmap
import zlib
from pathlib import Path

import pytest

from ucp.io import crc


@pytest.mark.parametrize("size", [1, 4096 * 3 - 1, 4096 * 3, 4096 * 3 + 1, 4096 * 10 + 17])
def test_the_windowed_crc_of_a_mapping_is_the_crc_of_the_file(tmp_path: Path, monkeypatch, size: int) -> None:
    monkeypatch.setattr(crc, "_WINDOW", 4096 * 3)  # page-aligned, as madvise needs
    data = bytes((i * 7919) % 251 for i in range(size))
    path = tmp_path / "f"
    path.write_bytes(data)
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY) as mapped:
        assert crc.crc32_mapped(mapped) == zlib.crc32(data)
        assert mapped[:] == data  # the dropped pages read back from the file
