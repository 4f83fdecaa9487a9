"""A large tensor's bytes are copied by several threads in ranges (ucp.io.span_copy): the file is the one a single
thread writes, byte for byte, with the same crc32 in the zip and for the whole file, and the source's witness is
told each span's crc32."""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import torch

from ucp.io import span_copy
from ucp.io.torchzip import write_torch_file
from ucp.model.pieces import FileSpan, PathSpan, Pieces, file_stamp


def _source(tmp_path: Path, numel: int) -> tuple[Path, torch.Tensor]:
    tensor = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    path = tmp_path / "src.bin"
    path.write_bytes(b"x" * 100 + tensor.numpy().tobytes())  # the tensor at an offset no range is aligned to
    return path, tensor


def _write(tmp_path: Path, name: str, parts: tuple, numel: int) -> tuple[Path, str]:
    (tmp_path / name).mkdir()
    out = tmp_path / name / "fp32.pt"  # one file name: the zip's members are named after it
    written = write_torch_file({"t": Pieces(parts, (numel,), torch.float32), "n": 3}, out)
    return out, written.crc32


@pytest.mark.parametrize("threads", [1, 4])
def test_a_big_record_copied_in_ranges_is_the_file_one_thread_writes(tmp_path: Path, threads: int) -> None:
    numel = (span_copy.PARALLEL_MIN // 4) + 12345  # past the threshold, no multiple of a range
    src, tensor = _source(tmp_path, numel)
    witnessed: list[tuple[int, int, int]] = []
    half = 4 * (numel // 2)
    with open(src, "rb", buffering=0) as handle:
        stamp = file_stamp(src.stat())
        parts = (
            FileSpan(handle, 100, half),
            PathSpan(str(src), 100 + half, 4 * numel - half, stamp, witness=lambda *a: witnessed.append(a)),
        )
        default = span_copy.copy_threads()
        span_copy.set_copy_threads(1)
        one, one_crc = _write(tmp_path, "one", parts, numel)
        span_copy.set_copy_threads(threads)
        try:
            many, many_crc = _write(tmp_path, "many", parts, numel)
        finally:
            span_copy.set_copy_threads(default)
    assert one.read_bytes() == many.read_bytes()
    assert one_crc == many_crc == f"{zlib.crc32(many.read_bytes()) & 0xFFFFFFFF:08x}"
    loaded = torch.load(many, weights_only=True)
    assert torch.equal(loaded["t"], tensor) and loaded["n"] == 3
    own = zlib.crc32(src.read_bytes()[100 + half :])
    assert witnessed == [(100 + half, 4 * numel - half, own)] * 2


@pytest.mark.slow
def test_real_checkpoints_cross_with_every_tensor_copied_in_ranges(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the threshold at one byte and ranges of 4 KiB, every tensor of a real ZeRO-3 run (rank slices of every
    parameter, spans of several files) goes through the threads: the universal directory verifies against the
    source bit for bit, and a restore from it reads back equal."""
    import ucp
    from tests.support.fixtures import build
    from ucp.io import torchzip
    from ucp.ops.verify import verify_universal

    monkeypatch.setattr(torchzip, "PARALLEL_MIN", 1)
    monkeypatch.setattr(span_copy, "_RANGE", 4096)
    default = span_copy.copy_threads()
    span_copy.set_copy_threads(4)
    try:
        src = build(dp=2, stage=3, dtype="bf16", optimizer="torch-adamw", sub_group_size=60).path
        ucp.to_universal(src, tmp_path / "u")
        assert verify_universal(src, tmp_path / "u").ok
        ucp.write_native(tmp_path / "u", tmp_path / "dp3", dp=3)
        assert ucp.diff(src, tmp_path / "dp3").equal
    finally:
        span_copy.set_copy_threads(default)


@pytest.mark.parametrize("threads", [1, 3])
def test_many_small_spans_and_bytes_between_them_are_one_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    """A rank's flat buffer cut from thousands of parameters' slices: spans of two files and zero padding between
    them, in tasks that end inside spans, load as the joined tensor; every span's witness hears its own crc32."""
    monkeypatch.setattr(span_copy, "PARALLEL_MIN", 1)
    monkeypatch.setattr(span_copy, "_RANGE", 4096 + 8)
    monkeypatch.setattr(span_copy, "_CHUNK", 1024)
    src, tensor = _source(tmp_path, 50_000)
    stamp = file_stamp(src.stat())
    heard: dict[int, int] = {}
    parts: list = []
    expected: list[torch.Tensor] = []
    at = 0
    for i in range(600):
        n = 1 + (i * 37) % 150
        if at + n > tensor.numel():
            break
        parts.append(PathSpan(str(src), 100 + 4 * at, 4 * n, stamp, witness=lambda o, n, c: heard.__setitem__(o, c)))
        expected.append(tensor[at : at + n])
        at += n
        if i % 7 == 0:
            zeros = torch.zeros(1 + i % 5)
            parts.append(zeros)
            expected.append(zeros)
    numel = sum(t.numel() for t in expected)
    default = span_copy.copy_threads()
    span_copy.set_copy_threads(threads)
    try:
        out, crc = _write(tmp_path, "rank", tuple(parts), numel)
    finally:
        span_copy.set_copy_threads(default)
    assert crc == f"{zlib.crc32(out.read_bytes()) & 0xFFFFFFFF:08x}"
    assert torch.equal(torch.load(out, weights_only=True)["t"], torch.cat(expected))
    data = src.read_bytes()
    spans = [p for p in parts if isinstance(p, PathSpan)]
    assert heard == {p.offset: zlib.crc32(data[p.offset : p.offset + p.nbytes]) for p in spans}
