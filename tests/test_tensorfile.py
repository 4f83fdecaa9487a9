"""ucp.io.torchzip, ucp.model.pieces and the copy-free paths built on it.

The promises kept here: a tensor given as pieces (in-memory slices or spans of a file on disk) is
written byte for byte as the joined tensor would be, with the crc32 of the bytes on disk; slicing
and joining pieces is exact; the ZeRO-3 fast path (rank slices streamed from the shards) writes the
same universal directory as the whole-tensor path; a universal file read again by one reader is
not checksummed again unless it changed.
"""

from __future__ import annotations

import os
import random
import shutil
import zlib
from pathlib import Path

import pytest
import torch

from ucp.errors import ChecksumError, CorruptFileError
from ucp.io.torchzip import write_torch_file
from ucp.model.pieces import FileSpan, Pieces
from ucp.model.records import Reader, ReaderView
from ucp.sources import open_reader
from ucp.universal.reader import open_universal
from ucp.universal.writer import write_universal


def _raw_file(tmp_path: Path, tensor: torch.Tensor, lead: bytes = b"xyz") -> Path:
    """A file holding ``lead`` then the tensor's bytes, so spans start at odd offsets."""
    path = tmp_path / "raw.bin"
    path.write_bytes(lead + tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return path


def _mixed_pieces(handle, tensor: torch.Tensor, lead: int = 3) -> Pieces:
    """``tensor`` as a span, an in-memory slice and another span."""
    flat = tensor.reshape(-1)
    item = flat.element_size()
    return Pieces(
        (
            FileSpan(handle, lead, 10 * item),
            flat[10:30],
            FileSpan(handle, lead + 30 * item, (flat.numel() - 30) * item),
        ),
        tuple(tensor.shape),
        tensor.dtype,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pieces_are_written_byte_for_byte_as_the_joined_tensor(tmp_path: Path, dtype: torch.dtype) -> None:
    tensor = torch.randn(300, 70).to(dtype)  # 21000 elements: several MB-sized chunks are not needed to split
    with open(_raw_file(tmp_path, tensor), "rb", buffering=0) as handle:
        flat = tensor.reshape(-1)
        shapes = {
            "whole": tensor,
            "slices": Pieces((flat[:7], flat[7:20000], flat[20000:]), tuple(tensor.shape), dtype),
            "spans": _mixed_pieces(handle, tensor),
        }
        written = {}
        for name, value in shapes.items():
            (tmp_path / name).mkdir()
            written[name] = write_torch_file({"param": value, "other": [torch.arange(3)]}, tmp_path / name / "t.pt")
    blobs = {name: (tmp_path / name / "t.pt").read_bytes() for name in shapes}
    assert blobs["slices"] == blobs["whole"] and blobs["spans"] == blobs["whole"]
    for name, info in written.items():
        assert info.bytes == len(blobs[name]) and info.crc32 == f"{zlib.crc32(blobs[name]):08x}"
    loaded = torch.load(tmp_path / "spans" / "t.pt", weights_only=True)
    assert loaded["param"].dtype == dtype and torch.equal(loaded["param"], tensor)


@pytest.mark.parametrize(
    "start,end", [(0, 1000), (0, 0), (5, 9), (9, 10), (10, 30), (9, 31), (29, 31), (250, 900), (999, 1000)]
)
def test_pieces_slice_and_join_are_exact(tmp_path: Path, start: int, end: int) -> None:
    tensor = torch.randn(10, 100)
    with open(_raw_file(tmp_path, tensor), "rb", buffering=0) as handle:
        pieces = _mixed_pieces(handle, tensor)
        assert torch.equal(pieces.join(), tensor)
        part = pieces.slice(start, end)
        assert torch.equal(part.join(), tensor.reshape(-1)[start:end])
        wider = torch.empty(end - start, dtype=torch.float64)
        part.copy_to(wider)
        assert torch.equal(wider, tensor.reshape(-1)[start:end].double())


def test_a_slice_found_by_bisection_is_every_slice_of_many_parts_empty_ones_included() -> None:
    """Pieces.slice starts at its first part by bisection (a parameter cut across thousands of ranks): every
    range of parts of sizes 0 to 17, empty parts at either end and in the middle, gives the joined elements."""
    rng = random.Random(0)
    for _ in range(200):
        sizes = [rng.choice([0, 0, 1, 2, 5, 17]) for _ in range(rng.randint(0, 9))]
        bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        parts = tuple(torch.arange(bounds[i], bounds[i + 1], dtype=torch.float32) for i in range(len(sizes)))
        pieces = Pieces(parts, (bounds[-1],), torch.float32)
        for _ in range(8):
            start = rng.randint(0, bounds[-1])
            end = rng.randint(start, bounds[-1])
            assert torch.equal(pieces.slice(start, end).join(), torch.arange(start, end, dtype=torch.float32))


def test_pieces_refuse_parts_that_do_not_make_the_shape() -> None:
    with pytest.raises(ValueError):
        Pieces((torch.zeros(5),), (2, 3), torch.float32)
    with pytest.raises(ValueError):
        Pieces((torch.zeros(6, dtype=torch.bfloat16),), (2, 3), torch.float32)


def test_a_span_past_the_end_of_a_truncated_file_is_a_one_line_corrupt_file_error(tmp_path: Path) -> None:
    tensor = torch.randn(100)
    path = _raw_file(tmp_path, tensor)
    with open(path, "rb", buffering=0) as handle:
        pieces = _mixed_pieces(handle, tensor)
        with open(path, "r+b") as shrink:
            shrink.truncate(200)
        with pytest.raises(CorruptFileError) as err:
            pieces.join()
    assert "truncated" in str(err.value) and "\n" not in str(err.value)


class _WholeTensors(ReaderView):
    """The same source through ``read`` alone (whole tensors), as a non-streaming reader gives it."""

    streams = False
    read_pieces = Reader.read_pieces


@pytest.mark.slow
@pytest.mark.parametrize("name", ["z3-bf16-dp2-adamw", "z2-bf16-dp3-adamw", "z1-bf16-dp2-bf16opt"])
def test_fast_path_writes_the_same_universal_directory_as_the_whole_tensor_path(
    source, name: str, tmp_path: Path
) -> None:
    fast, whole = tmp_path / "fast" / "u", tmp_path / "whole" / "u"
    reader = open_reader(source(name).path)
    try:
        assert reader.streams
        write_universal(reader, fast)
        write_universal(_WholeTensors(reader, reader.facts), whole)
    finally:
        reader.close()
    files = sorted(p.relative_to(fast) for p in (fast / "zero").rglob("*.pt"))
    assert files and files == sorted(p.relative_to(whole) for p in (whole / "zero").rglob("*.pt"))
    for rel in files:
        assert (fast / rel).read_bytes() == (whole / rel).read_bytes(), rel


@pytest.mark.slow
@pytest.mark.parametrize("name", ["z3-fp32-dp3-adamw", "z2-bf16-dp3-adamw"])
def test_pieces_match_read_bit_for_bit(source, name: str) -> None:
    reader = open_reader(source(name).path)
    try:
        for meta in reader.facts.params:
            whole = reader.read(meta.name)
            with reader.read_pieces(meta.name) as pieces:
                assert torch.equal(pieces.fp32.join(), whole.fp32), meta.name
                assert list(pieces.optim) == list(whole.optim) == ([] if meta.frozen else ["exp_avg", "exp_avg_sq"])
                for key, a in whole.optim.items():
                    assert torch.equal(pieces.optim[key].join(), a), (meta.name, key)
                assert pieces.step == whole.step
    finally:
        reader.close()


@pytest.mark.slow
def test_universal_reader_checks_a_file_once_and_refuses_it_once_it_changed(universals, tmp_path: Path) -> None:
    root = tmp_path / "u"
    shutil.copytree(universals("z3-bf16-dp2-adamw"), root)
    reader = open_universal(root)
    name = next(m.name for m in reader.facts.params if not m.frozen)
    with reader.read_pieces(name) as first:
        expected = first.optim["exp_avg"].join()
    with reader.read_pieces(name) as again:
        assert torch.equal(again.optim["exp_avg"].join(), expected)
    path = reader.file_path(name, "exp_avg.pt")
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01  # same size, new bytes
    stat = path.stat()
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # a clock coarser than the test
    with reader.read_pieces(name) as changed, pytest.raises(ChecksumError, match="changed after it was checked"):
        changed.optim["exp_avg"].join()  # handed out as checked, refused when read
    with pytest.raises(ChecksumError):
        reader.read(name)


def test_deferred_checks_settle_as_the_copies_cover_each_file(
    universals, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inside ``deferred_checks`` a file's check settles once the copies reported cover its tensor: it leaves the
    pending checks then (a 10^5-parameter restore holds only the checks of files in flight), a good file counts as
    verified, and a damaged one fails the block by name and is parsed and checked again when read again."""
    from ucp.io import tensor_record
    from ucp.io.span_copy import read_witnessed

    monkeypatch.setattr(tensor_record, "_WINDOW", 1024)  # these files, not read whole: checked from the copies
    root = tmp_path / "u"
    shutil.copytree(universals("z3-bf16-dp2-adamw"), root)
    reader = open_universal(root)
    name = max((m for m in reader.facts.params if not m.frozen), key=lambda m: m.numel).name
    assert reader.facts.param(name).numel * 4 > 1024

    def copy_all(pieces: Pieces, halves: bool) -> torch.Tensor:
        out = torch.empty(pieces.numel, dtype=torch.float32)
        view = memoryview(out.numpy()).cast("B")
        cut = pieces.numel // 2 if halves else pieces.numel
        for lo, hi in ((cut, pieces.numel), (0, cut)):  # the second half first: out of order
            if hi > lo:
                read_witnessed(pieces.slice(lo, hi).parts, view[4 * lo : 4 * hi])
        return out

    def is_open(key: str) -> bool:
        slot = reader._memo.slot(name, key)
        return reader._pending is not None and slot is not None and reader._pending.is_open(slot)

    with reader.deferred_checks():
        with reader.read_pieces(name) as state:
            assert is_open("exp_avg.pt")
            copied = copy_all(state.optim["exp_avg"], halves=True)
            assert not is_open("exp_avg.pt")  # settled before the block ends
            assert is_open("fp32.pt")  # not copied yet: checked when the block ends
    assert torch.equal(copied, reader.read(name).optim["exp_avg"].flatten())
    assert reader._memo.verified(name, "exp_avg.pt", reader._stamp_now(name, "exp_avg.pt"))
    assert reader._memo.verified(name, "fp32.pt", reader._stamp_now(name, "fp32.pt"))

    path = reader.file_path(name, "exp_avg_sq.pt")
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01  # same size, new bytes in the tensor's last element or the zip directory
    stat = path.stat()
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    fresh = open_universal(root, verify=False)  # opens without checking every file up front
    fresh.verify = True
    for _ in range(2):  # refused, and refused again: the failed file is not remembered as found
        with pytest.raises(ChecksumError, match="exp_avg_sq.pt"), fresh.deferred_checks():
            with fresh.read_pieces(name) as state:
                copy_all(state.optim["exp_avg_sq"], halves=False)


@pytest.mark.parametrize("decoy", ["", "cucp.io.standins\nLossScaler\n", "ucp.io.standins"])
def test_deepspeed_stand_ins_are_written_under_deepspeed_names_whatever_the_strings_around_them(
    tmp_path: Path, decoy: str
) -> None:
    """The C pickler writes stand-ins under their ucp names and renames them; a string that looks like
    one of those names must neither be renamed nor let a ucp name through (the pure pickler takes over)."""
    import pickletools
    import zipfile

    from ucp.io import standins, torchfile

    obj = {
        "loss_scaler": standins.LossScaler(cur_scale=65536.0, cur_iter=7),
        "again": standins.LossScaler(cur_scale=1.0, cur_iter=0),
        "zero_stage": standins.ZeroStageEnum(3),
        "note": decoy,
        "weights": torch.arange(6, dtype=torch.float32).reshape(2, 3),
    }
    path = tmp_path / "states.pt"
    write_torch_file(obj, path)
    with zipfile.ZipFile(path) as zf:
        pickled = zf.read("states/data.pkl")
    globals_ = {arg for op, arg, _ in pickletools.genops(pickled) if op.name == "GLOBAL"}
    assert "deepspeed.runtime.fp16.loss_scaler LossScaler" in globals_
    assert "deepspeed.runtime.zero.config ZeroStageEnum" in globals_
    assert not any(name.startswith("ucp") for name in globals_), globals_
    back = torchfile.load(path)
    assert back["note"] == decoy
    assert back["loss_scaler"] == obj["loss_scaler"] and back["again"] == obj["again"]
    assert int(back["zero_stage"]) == 3 and isinstance(back["zero_stage"], standins.ZeroStageEnum)
    assert torch.equal(back["weights"], obj["weights"])
