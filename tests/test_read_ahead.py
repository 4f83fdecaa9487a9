"""ucp.io.read_ahead: small spans of open files read through windows give the bytes straight reads give."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from ucp.errors import CorruptFileError
from ucp.io import read_ahead
from ucp.io.read_ahead import PER_FILE, WINDOW, ReadAhead
from ucp.model.pieces import FileSpan


def _file(path: Path, nbytes: int, seed: int) -> bytes:
    data = random.Random(seed).randbytes(nbytes)
    path.write_bytes(data)
    return data


def test_spans_walked_forward_in_several_streams_read_the_file_s_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three regions of each of two files read forward side by side (a rank file's masters and two moments) in
    spans of up to 8 KB, then spans anywhere: every byte as the file holds it, and the walk in far fewer reads
    than spans."""
    files = [_file(tmp_path / f"rank{r}", 3 * WINDOW + 1000, r) for r in range(2)]
    handles = [open(tmp_path / f"rank{r}", "rb", buffering=0) for r in range(2)]
    reads: list[int] = []
    counted = read_ahead._pread_some

    def count(span: FileSpan, buffer: memoryview) -> int:
        reads.append(span.offset)
        return counted(span, buffer)

    monkeypatch.setattr(read_ahead, "_pread_some", count)
    ahead = ReadAhead()
    rng = random.Random(0)
    at = [[0, WINDOW, 2 * WINDOW] for _ in files]
    spans = 0
    try:
        while any(pos < (k + 1) * WINDOW for row in at for k, pos in enumerate(row)):
            for r, handle in enumerate(handles):
                for k in range(3):
                    start = at[r][k]
                    n = min(rng.randint(1, WINDOW // 32), (k + 1) * WINDOW - start)
                    if n <= 0:
                        continue
                    out = memoryview(bytearray(n))
                    ahead.read(FileSpan(handle, start, n), out)
                    assert bytes(out) == files[r][start : start + n], (r, k, start, n)
                    at[r][k] += n
                    spans += 1
        walked = len(reads)
        for _ in range(50):  # anywhere, in any order, the tail of the file included
            r, start = rng.randrange(2), rng.randrange(len(files[0]))
            n = min(rng.randint(1, WINDOW // 4), len(files[0]) - start)
            out = memoryview(bytearray(n))
            ahead.read(FileSpan(handles[r], start, n), out)
            assert bytes(out) == files[r][start : start + n]
    finally:
        for handle in handles:
            handle.close()
    assert walked <= 2 * 6 < spans // 5  # the forward walk: a read or two per region walked, not one per span
    assert all(len(ws) <= PER_FILE for ws in ahead._windows.values())


def test_a_large_span_and_a_span_past_the_end_read_straight(tmp_path: Path) -> None:
    data = _file(tmp_path / "f", WINDOW + 10, 7)
    with open(tmp_path / "f", "rb", buffering=0) as handle:
        ahead = ReadAhead()
        out = memoryview(bytearray(WINDOW))
        ahead.read(FileSpan(handle, 5, WINDOW), out)
        assert bytes(out) == data[5 : 5 + WINDOW] and not ahead._windows  # straight: no window made
        out = memoryview(bytearray(20))
        with pytest.raises(CorruptFileError, match="truncated"):
            ahead.read(FileSpan(handle, WINDOW, 20), out)  # 10 bytes left: the file ends inside the span


def test_without_budget_for_a_window_a_span_reads_straight(tmp_path: Path) -> None:
    data = _file(tmp_path / "f", 4096, 3)
    with open(tmp_path / "f", "rb", buffering=0) as handle:
        ahead = ReadAhead(budget=0)
        out = memoryview(bytearray(100))
        ahead.read(FileSpan(handle, 10, 100), out)
        assert bytes(out) == data[10:110]
        assert ahead._windows[id(handle)] == []
