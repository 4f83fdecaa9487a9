"""A torch file laid out with reserved records, filled later in any order (``ucp.io.torchzip.lay_out``,
``ucp.io.record_fill``): once finished it is byte for byte the file ucp's writer gives for the same tensors, and
torch loads it; a record filled short or past its end is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ucp.io.record_fill import RecordFill
from ucp.io.torchpickle import pickle_object, tensor_bytes
from ucp.io.torchzip import lay_out, write_torch_file
from ucp.model.pieces import Reserved


def test_a_laid_file_filled_out_of_order_is_the_written_file(tmp_path: Path) -> None:
    a, b = torch.randn(1000), torch.randn(5000)
    holes = Reserved(a.numel(), torch.float32), Reserved(b.numel(), torch.float32)
    obj = {"flat": [holes[0], holes[1]], "step": 3, "kept": torch.arange(7)}
    laid = lay_out(pickle_object(obj), tmp_path / "laid.pt")
    crcs = {}
    for hole, tensor in reversed(list(zip(holes, (a, b)))):  # the second record first
        offset, nbytes = laid.holes[hole]
        fill = RecordFill(laid.fd, offset, nbytes, memoryview(bytearray(1024)))
        data = tensor_bytes(tensor)
        fill.put(data[:100])
        fill.zeros(0)
        fill.put(data[100:3000])  # larger than the buffer: from its own memory
        fill.put(data[3000:])
        crcs[hole] = fill.close()
    laid.finish(crcs)
    (tmp_path / "w").mkdir()  # the same name: torch names the archive after the file
    written = write_torch_file({"flat": [a, b], "step": 3, "kept": torch.arange(7)}, tmp_path / "w" / "laid.pt")
    assert (tmp_path / "laid.pt").read_bytes() == (tmp_path / "w" / "laid.pt").read_bytes()
    assert written.bytes == (tmp_path / "laid.pt").stat().st_size
    loaded = torch.load(tmp_path / "laid.pt", weights_only=True)
    assert torch.equal(loaded["flat"][0], a) and torch.equal(loaded["flat"][1], b) and loaded["step"] == 3


def test_a_record_filled_short_or_past_its_end_is_refused(tmp_path: Path) -> None:
    hole = Reserved(10, torch.float32)
    laid = lay_out(pickle_object({"x": hole}), tmp_path / "x.pt")
    offset, nbytes = laid.holes[hole]
    fill = RecordFill(laid.fd, offset, nbytes, memoryview(bytearray(16)))
    fill.zeros(36)
    with pytest.raises(ValueError, match="overflow"):
        fill.zeros(8)
    with pytest.raises(ValueError, match="filled with 36"):
        fill.close()
    with pytest.raises(ValueError, match="cannot go back"):
        fill.zeros_to(8)
    laid.close()


def test_many_small_records_go_out_in_batches_and_the_file_is_whole(tmp_path: Path) -> None:
    """A ZeRO-3 model-states file of a MoE holds 10^5 empty records: the writer sends small records out in batches
    (not all held until the end) and keeps the central directory in one buffer, patching reserved entries in place.
    The file must be the same, record for record, as a laid-out one, and torch and zipfile must read it whole."""
    import zipfile

    from ucp.model.pieces import Placeholder

    hole = Reserved(3000, torch.float32)
    values = torch.randn(3000)
    small = {f"p{i}": Placeholder(torch.bfloat16) if i % 3 else torch.full((i % 5,), float(i)) for i in range(3000)}
    laid = lay_out(pickle_object({"module": small, "flat": hole}), tmp_path / "many.pt")
    offset, nbytes = laid.holes[hole]
    fill = RecordFill(laid.fd, offset, nbytes, memoryview(bytearray(4096)))
    fill.put(tensor_bytes(values))
    laid.finish({hole: fill.close()})
    (tmp_path / "w").mkdir()
    write_torch_file({"module": small, "flat": values}, tmp_path / "w" / "many.pt")
    assert (tmp_path / "many.pt").read_bytes() == (tmp_path / "w" / "many.pt").read_bytes()
    with zipfile.ZipFile(tmp_path / "many.pt") as archive:
        assert archive.testzip() is None  # every record's CRC, the reserved one's patched in its central entry too
        assert len(archive.namelist()) > 3000
    loaded = torch.load(tmp_path / "many.pt", weights_only=True)
    assert torch.equal(loaded["flat"], values)
    for i in (0, 1, 2, 2999):
        expected = torch.empty(0, dtype=torch.bfloat16) if i % 3 else torch.full((i % 5,), float(i))
        assert loaded["module"][f"p{i}"].dtype == expected.dtype and torch.equal(loaded["module"][f"p{i}"], expected)
