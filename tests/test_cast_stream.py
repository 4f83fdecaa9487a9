"""A weight cast from its fp32 master is written chunk by chunk (``ucp.model.pieces.Cast``), never whole in memory:
the torch file and the safetensors file hold exactly the cast of the joined master, whatever the chunk and task
sizes and the threads; ucp's safetensors files are the library's byte for byte; the fp16 range check over pieces
reports what the check over the whole tensor reports."""

from __future__ import annotations

import contextlib
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ucp.errors import ConfigError
from ucp.io import span_copy
from ucp.io.safetensors_file import Entry, write_safetensors
from ucp.io.torchzip import write_torch_file
from ucp.model import cast
from ucp.model.pieces import Cast, PathSpan, Pieces, file_stamp


def _master(tmp_path: Path, numel: int) -> tuple[Pieces, torch.Tensor]:
    """An fp32 master as three pieces: two spans of one file (at an odd offset) with a tensor in memory between."""
    tensor = torch.randn(numel, generator=torch.Generator().manual_seed(1)) * 100
    path = tmp_path / "master.bin"
    path.write_bytes(b"x" * 36 + tensor.numpy().tobytes())
    stamp = file_stamp(path.stat())
    a, b = numel // 3, 2 * numel // 3
    parts = (
        PathSpan(str(path), 36, 4 * a, stamp),
        tensor[a:b].clone(),
        PathSpan(str(path), 36 + 4 * b, 4 * (numel - b), stamp),
    )
    return Pieces(parts, (numel,), torch.float32), tensor


@pytest.fixture(params=[1, 3], ids=["one-thread", "three-threads"])
def small_chunks(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Buffers of 4 KiB and tasks of 12 KiB (so a tensor of a few thousand elements is many chunks and tasks),
    copied by one thread or by three."""
    threads = request.param
    monkeypatch.setattr(span_copy, "_CHUNK", 4 << 10)
    monkeypatch.setattr(span_copy, "_RANGE", 12 << 10)
    monkeypatch.setattr(span_copy, "PARALLEL_MIN", 0)
    default = span_copy.copy_threads()
    span_copy.set_copy_threads(threads)
    yield
    span_copy.set_copy_threads(default)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_cast_record_is_the_cast_of_the_joined_master(tmp_path: Path, small_chunks: None, dtype) -> None:
    master, tensor = _master(tmp_path, 10_007)
    out = tmp_path / "w.pt"
    written = write_torch_file({"w": Cast(master, dtype), "n": 1}, out)
    loaded = torch.load(out, weights_only=True)
    assert loaded["w"].dtype == dtype and torch.equal(loaded["w"], tensor.to(dtype))
    assert written.crc32 == f"{zlib.crc32(out.read_bytes()) & 0xFFFFFFFF:08x}"
    assert zipfile.ZipFile(out).testzip() is None  # every member's crc32 in the zip is right


def test_safetensors_files_are_the_librarys_byte_for_byte(tmp_path: Path, small_chunks: None) -> None:
    """Tensors of several dtypes, given in model order: ucp lays them out as the library does (widest dtype
    first, then by name) and writes the same header and bytes; a cast and a tensor in memory both stream."""
    master, tensor = _master(tmp_path, 5_003)
    tensors = {
        "z.weight": tensor.to(torch.bfloat16),
        "a.count": torch.arange(7, dtype=torch.int64),
        "m.scale": torch.randn(3, 5, dtype=torch.float32),
        "b.mask": torch.tensor([True, False, True]),
        "e.empty": torch.empty(0, 4, dtype=torch.float16),
    }
    save_file(tensors, str(tmp_path / "lib.safetensors"), metadata={"format": "pt"})
    entries = [Entry(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]

    @contextlib.contextmanager
    def fetch(entry: Entry):
        yield Cast(master, torch.bfloat16) if entry.name == "z.weight" else tensors[entry.name]

    size = write_safetensors(tmp_path / "ucp.safetensors", entries, fetch, {"format": "pt"}, workers=2)
    ours = (tmp_path / "ucp.safetensors").read_bytes()
    assert ours == (tmp_path / "lib.safetensors").read_bytes() and size == len(ours)
    assert torch.equal(load_file(tmp_path / "ucp.safetensors")["z.weight"], tensor.to(torch.bfloat16))


def test_a_safetensors_file_refuses_a_tensor_that_is_not_what_its_header_says(tmp_path: Path) -> None:
    @contextlib.contextmanager
    def fetch(entry: Entry):
        yield torch.zeros(4, dtype=torch.float32)

    with pytest.raises(ValueError, match="handed"):
        write_safetensors(tmp_path / "x.safetensors", [Entry("w", (5,), torch.float32)], fetch)


def test_the_fp16_check_over_pieces_counts_what_the_whole_check_counts(tmp_path: Path, monkeypatch) -> None:
    master, tensor = _master(tmp_path, 9_001)
    tensor[[5, 4000, 8999]] = torch.tensor([7e4, -9e4, 1e5])  # in the first span, the memory part, the last span
    master = Pieces((tensor[:4000].clone(), tensor[4000:].clone()), (9_001,), torch.float32)
    monkeypatch.setattr(cast, "_CHUNK", 1000)
    with pytest.raises(ConfigError) as whole:
        cast.check_fits("w", tensor, torch.float16)
    with pytest.raises(ConfigError) as pieces:
        cast.check_fits_pieces("w", master, torch.float16)
    assert str(pieces.value) == str(whole.value) and "(3 of its values)" in str(whole.value)
    cast.check_fits_pieces("w", Pieces.of(tensor.clamp(-6e4, 6e4)), torch.float16)  # fits: nothing raised
    cast.check_fits_pieces("w", master, torch.bfloat16)  # bf16 holds it
