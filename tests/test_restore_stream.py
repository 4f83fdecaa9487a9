"""The streaming native restore: rank files written from the source's spans, sources checked from what was copied.

A universal file in ucp's own layout is found without unpickling (``io.tensor_record``) and its
crc32 is checked from the crc32s the writer computed while copying (``Reader.deferred_checks``).
These tests damage a real universal directory where each part of that check looks (the tensor's
bytes, the pickle before them, the zip directory after them) and restore it at every ZeRO stage:
each must fail in one line with nothing written. The restored bytes themselves are pinned by
tests/test_golden.py; a file taken by the fast path must give what the weights_only unpickler gives.
"""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_reliability import assert_one_line_error, run_cli
from ucp.io import torchfile
from ucp.io.tensor_record import SpanChecks, find_tensor_record
from ucp.io.torchpickle import data_pickle
from ucp.io.torchzip import write_torch_file
from ucp.model.pieces import Pieces
from ucp.universal.manifest import MANIFEST
from ucp.universal.reader import open_universal

pytestmark = pytest.mark.slow


def _victim(root: Path, pick: Any = max) -> Path:
    """The largest exp_avg.pt of a universal directory (its tensor spans several ranks' partitions), or with
    ``pick=min`` the smallest (read whole by the fast path, so checked at once rather than from the copies)."""
    manifest = json.loads((root / MANIFEST).read_text())
    entry = pick(
        (p for p in manifest["params"] if "exp_avg.pt" in p["files"]), key=lambda p: p["files"]["exp_avg.pt"]["bytes"]
    )
    return root / "zero" / entry["folder"] / "exp_avg.pt"


def _flip(path: Path, where: str) -> None:
    """Flip one bit: in the tensor's bytes, in data.pkl before them, or in the zip directory after them."""
    data = bytearray(path.read_bytes())
    tensor = torchfile.load(path)["param"]
    pickle = data_pickle({"param": Pieces.of(torch.zeros(tuple(tensor.shape)))})
    record = find_tensor_record(path, pickle, tensor.numel() * 4)
    assert record is not None, "ucp's own file must take the fast path"
    index = {
        "tensor": record.offset + record.nbytes // 2,
        "pickle": bytes(data).index(pickle) + len(pickle) // 2,
        "directory": len(data) - 30,
    }[where]
    data[index] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("where", ["tensor", "pickle", "directory"])
@pytest.mark.parametrize("stage", ["3", "2", "1"])
def test_a_damaged_universal_file_fails_the_restore_in_one_line_with_nothing_written(
    universals, tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str, stage: str
) -> None:
    root = tmp_path / "u"
    shutil.copytree(universals("z3-bf16-dp2-adamw"), root)
    victim = _victim(root)
    _flip(victim, where)
    out = tmp_path / "restored"
    code, err = run_cli(capsys, "restore", str(root), str(out), "--dp", "3", "--stage", stage)
    line = assert_one_line_error(code, err, victim.parent.name)
    assert "checksum" in line or "corrupt" in line, line
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["u"], "a staging folder was left behind"


@pytest.mark.parametrize("where", ["tensor", "pickle", "directory"])
def test_a_damaged_small_universal_file_fails_the_restore_in_one_line_with_nothing_written(
    universals, tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    root = tmp_path / "u"
    shutil.copytree(universals("z3-bf16-dp2-adamw"), root)
    victim = _victim(root, min)
    assert victim.stat().st_size <= 8192  # read whole by the fast path
    _flip(victim, where)
    out = tmp_path / "restored"
    code, err = run_cli(capsys, "restore", str(root), str(out), "--dp", "3")
    line = assert_one_line_error(code, err, victim.parent.name)
    assert "checksum" in line or "corrupt" in line, line
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["u"], "a staging folder was left behind"


def test_the_fast_path_gives_what_the_unpickler_gives_and_refuses_other_writers(universals, tmp_path: Path) -> None:
    root = universals("z3-bf16-dp2-adamw")
    reader = open_universal(root)
    try:
        for meta in reader.facts.params:
            path = reader.file_path(meta.name, "fp32.pt")
            tensor = torchfile.load(path)["param"]
            pickle = data_pickle({"param": Pieces.of(torch.zeros(tuple(tensor.shape)))})
            record = find_tensor_record(path, pickle, tensor.numel() * 4)
            assert record is not None, meta.name
            raw = path.read_bytes()
            found = torch.frombuffer(bytearray(raw[record.offset : record.offset + record.nbytes]), dtype=torch.float32)
            assert torch.equal(found.view(tensor.shape), tensor), meta.name
            assert record.file_crc(zlib.crc32(raw[record.offset : record.offset + record.nbytes])) == zlib.crc32(raw)
            # the same tensor in another writer's file, or another shape's pickle: not taken
            other = tmp_path / f"{len(list(tmp_path.iterdir()))}.pt"
            torch.save({"param": tensor.clone()}, other)
            assert find_tensor_record(other, pickle, tensor.numel() * 4) is None
            wrong = data_pickle({"param": Pieces.of(torch.zeros(tensor.numel() + 1))})
            assert find_tensor_record(path, wrong, tensor.numel() * 4) is None
    finally:
        reader.close()


def test_a_span_check_needs_every_byte_of_the_tensor_and_reads_what_was_not_copied(tmp_path: Path) -> None:
    path = tmp_path / "fp32.pt"
    values = torch.arange(1000, dtype=torch.float32)
    written = write_torch_file({"param": values}, path)
    pickle = data_pickle({"param": Pieces.of(torch.zeros(1000))})
    record = find_tensor_record(path, pickle, 4000)
    assert record is not None
    raw = path.read_bytes()

    def crc(lo: int, hi: int) -> int:
        return zlib.crc32(raw[record.offset + lo : record.offset + hi])

    answers: list[tuple[int, bool]] = []
    checks = SpanChecks(8, lambda slot, ok: answers.append((slot, ok)))
    whole = checks.add(0, record, written.crc32)
    for lo, hi in [(0, 1000), (1000, 2500), (2500, 4000), (1000, 2500)]:  # one span reported twice
        whole(record.offset + lo, hi - lo, crc(lo, hi))
    assert checks.confirm(0, path)
    checks.add(1, record, written.crc32)(record.offset + 400, 800, crc(400, 1200))  # the rest is read by confirm
    assert checks.open_slots() == [1] and checks.confirm(1, path)
    checks.add(2, record, written.crc32)(record.offset, 4000, crc(0, 4000) ^ 1)  # a copy that saw other bytes
    assert not checks.confirm(2, path)
    ranks = checks.add(3, record, written.crc32)
    for lo in range(0, 3500, 500):  # seven of eight ranks' slices in order: kept as one entry, not settled
        ranks(record.offset + lo, 500, crc(lo, lo + 500))
    assert len(checks._seen[3]) == 1 and checks.is_open(3)
    ranks(record.offset + 3500, 500, crc(3500, 4000))  # the last one covers the tensor: settled at once
    assert answers == [(0, True), (2, False), (3, True)] and 3 not in checks._seen
    ranks(record.offset, 500, crc(0, 500) ^ 1)  # after that, told once and nothing read
    out_of_order = checks.add(4, record, written.crc32)
    out_of_order(record.offset + 2000, 2000, crc(2000, 4000))
    out_of_order(record.offset, 2000, crc(0, 2000) ^ 1)
    assert answers[3:] == [(4, False)]
    merged_lie = checks.add(5, record, written.crc32)
    merged_lie(record.offset, 2000, crc(0, 2000))
    merged_lie(record.offset + 2000, 2000, crc(2000, 4000) ^ 1)
    assert answers[4:] == [(5, False)] and checks.open_slots() == [1]
    path.rename(tmp_path / "gone.pt")  # settled checks read nothing more; an open one needs the file
    assert checks.confirm(3, path) and not checks.confirm(4, path) and not checks.confirm(5, path)
    assert not checks.confirm(1, path)
    assert len(answers) == 5


def test_span_checks_keep_their_words_in_pages_made_when_a_slot_is_first_checked(tmp_path: Path) -> None:
    """A restore of a MoE holds a slot per file (4 x 10^5); its small files are read whole and never checked from
    spans, so the arrays of a check come in pages made on first use: slots either side of a page's edge keep their
    own words, and a million slots with two checked cost two pages."""
    path = tmp_path / "fp32.pt"
    written = write_torch_file({"param": torch.arange(3000, dtype=torch.float32)}, path)
    record = find_tensor_record(path, data_pickle({"param": Pieces.of(torch.zeros(3000))}), 12000)
    assert record is not None
    raw = path.read_bytes()
    good = zlib.crc32(raw[record.offset : record.offset + 12000])
    answers: list[tuple[int, bool]] = []
    checks = SpanChecks(10**6, lambda slot, ok: answers.append((slot, ok)))
    last, first = checks.add(1023, record, written.crc32), checks.add(1024, record, f"{int(written.crc32, 16) ^ 1:08x}")
    assert len(checks._pages) == 2 and checks.open_slots() == [1023, 1024]
    first(record.offset, 12000, good)
    last(record.offset, 12000, good)
    assert answers == [(1024, False), (1023, True)] and checks.stamp(1023) == record.stamp
