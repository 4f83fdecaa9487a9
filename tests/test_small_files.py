"""Small input files are read within a bound: a huge or absurdly nested one is one line, never a memory blow-up or traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_reliability import assert_one_line_error, run_cli
from ucp.errors import CorruptFileError, InputError
from ucp.io.small_files import read_small


def test_read_small_reads_within_the_limit_and_refuses_past_it(tmp_path: Path) -> None:
    file = tmp_path / "f"
    file.write_bytes(b"x" * 100)
    assert read_small(file, 100, "thing") == b"x" * 100
    with pytest.raises(CorruptFileError, match="at most 99"):
        read_small(file, 99, "thing")
    with pytest.raises(CorruptFileError, match="is a folder"):
        read_small(tmp_path, 99, "thing")
    with pytest.raises(InputError, match="cannot read"):
        read_small(tmp_path / "missing", 99, "thing")


@pytest.mark.slow
def test_a_huge_latest_file_is_one_line(z3_bf16_dp2, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(z3_bf16_dp2.path, ckpt)
    with open(ckpt / "latest", "wb") as handle:  # sparse: 1 GB on paper, nothing on disk
        handle.truncate(1 << 30)
    code, err = run_cli(capsys, "inspect", str(ckpt))
    assert_one_line_error(code, err, "latest", "too large", "--tag")


@pytest.mark.parametrize("text", ["[" * 200_000, '{"a": ' + '"x' * 10 + "}"], ids=["nested", "broken"])
def test_an_unreadable_trainer_state_is_one_input_error(tmp_path: Path, text: str) -> None:
    from ucp.frameworks.hf import _read_state

    (tmp_path / "trainer_state.json").write_text(text)
    with pytest.raises(InputError, match="not readable JSON"):
        _read_state(tmp_path)


def test_an_oversized_dcp_metadata_file_is_refused_before_unpickling(tmp_path: Path, monkeypatch) -> None:
    from ucp.frameworks import dcp

    (tmp_path / dcp.METADATA).write_bytes(b"\x80\x02" + b"N" * 4096)
    monkeypatch.setattr(dcp, "MAX_METADATA_BYTES", 1024)
    with pytest.raises(CorruptFileError, match="at most 1,024"):
        dcp.read_metadata(tmp_path)
