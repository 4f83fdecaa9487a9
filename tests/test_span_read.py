"""Reading many spans with few system calls (ucp.io.span_read): every byte lands where it belongs, whatever the
spans' order, gaps, overlaps and count, and a file that changed or was cut is refused."""

from __future__ import annotations

import os
import random
import zlib
from pathlib import Path

import pytest
import torch

from ucp.errors import ChecksumError, CorruptFileError
from ucp.io.span_read import GAP_MAX, read_many, read_witnessed
from ucp.model.pieces import FileSpan, PathSpan, file_stamp


def _file(path: Path, size: int, seed: int) -> bytes:
    data = random.Random(seed).randbytes(size)
    path.write_bytes(data)
    return data


def test_spans_in_any_order_with_gaps_overlaps_and_more_than_one_call_can_take(tmp_path):
    a, b = _file(tmp_path / "a", 3 * GAP_MAX, 1), _file(tmp_path / "b", 5000, 2)
    rng = random.Random(3)
    with open(tmp_path / "a", "rb", buffering=0) as fa, open(tmp_path / "b", "rb", buffering=0) as fb:
        jobs, want = [], []
        # 3000 adjacent 3-byte spans (past IOV_MAX), then gaps small and large, overlaps, empty spans, a tensor
        for i in range(3000):
            jobs.append(([FileSpan(fa, 3 * i, 3)], memoryview(bytearray(3))))
            want.append(a[3 * i : 3 * i + 3])
        for offset, size in [(9100, 10), (9200, 7), (9200 + GAP_MAX, 5), (2 * GAP_MAX + 17, 100), (9105, 50), (40, 0)]:
            jobs.append(([FileSpan(fa, offset, size)], memoryview(bytearray(size))))
            want.append(a[offset : offset + size])
        tensor = torch.arange(6, dtype=torch.float32)
        cuts = sorted(rng.sample(range(1, 4999), 6))
        parts = [FileSpan(fb, x, y - x) for x, y in zip([0, *cuts], [*cuts, 5000])]
        mixed = [parts[3], tensor, parts[0], FileSpan(fa, 7, 11), *parts[1:3], *parts[4:]]
        expect = b"".join(
            bytes(tensor.numpy().tobytes())
            if p is tensor
            else (a if p.file is fa else b)[p.offset : p.offset + p.nbytes]
            for p in mixed
        )
        jobs.append((mixed, memoryview(bytearray(len(expect)))))
        want.append(expect)
        order = list(range(len(jobs)))
        rng.shuffle(order)
        read_many([jobs[i] for i in order])
    assert [bytes(out) for _, out in jobs] == want


def test_a_path_span_tells_its_witness_and_refuses_a_changed_or_cut_file(tmp_path):
    path = tmp_path / "f"
    data = _file(path, 4096, 4)
    stamp = file_stamp(os.stat(path))
    told = []
    spans = [PathSpan(str(path), x, 512, stamp, lambda *t: told.append(t)) for x in (0, 512, 2048)]
    out = memoryview(bytearray(3 * 512))
    read_witnessed(spans, out)
    assert bytes(out) == data[:1024] + data[2048:2560]
    assert sorted(told) == [(x, 512, zlib.crc32(data[x : x + 512])) for x in (0, 512, 2048)]

    with pytest.raises(CorruptFileError, match="truncated"):
        read_many([([PathSpan(str(path), 4000, 200, stamp)], memoryview(bytearray(200)))])
    os.truncate(path, 1000)
    with pytest.raises(ChecksumError, match="changed after it was checked"):
        read_many([([PathSpan(str(path), 0, 512, stamp)], memoryview(bytearray(512)))])


def test_parts_that_do_not_fill_their_buffer_are_refused(tmp_path):
    _file(tmp_path / "f", 100, 5)
    with open(tmp_path / "f", "rb", buffering=0) as f, pytest.raises(ValueError, match="read into"):
        read_many([([FileSpan(f, 0, 10)], memoryview(bytearray(11)))])
