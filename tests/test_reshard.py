"""``ucp reshard``: a DeepSpeed checkpoint to another DP size (and stage) in one pass, with no universal
directory: the same checkpoint, file for file and object for object, as to-universal followed by restore."""

from __future__ import annotations

import json

import pytest

from tests.support.digest import tree
from ucp.cli import main as cli


@pytest.mark.slow
def test_reshard_writes_what_to_universal_then_restore_writes(source, tmp_path, capsys):
    src = source("z2-bf16-dp3-adamw").path
    assert cli(["reshard", str(src), str(tmp_path / "direct"), "--dp", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["stage"] == 2 and result["dp"] == 2, result  # the source's stage is kept
    assert cli(["to-universal", str(src), str(tmp_path / "u")]) == 0
    assert cli(["restore", str(tmp_path / "u"), str(tmp_path / "two"), "--dp", "2", "--stage", "2"]) == 0
    direct, two = tree(tmp_path / "direct"), tree(tmp_path / "two")
    assert sorted(direct) == sorted(two)
    for name, entry in two.items():
        assert direct[name].get("content", direct[name]["sha256"]) == entry.get("content", entry["sha256"]), name


@pytest.mark.slow
def test_reshard_needs_a_dp_size(source, tmp_path, capsys):
    assert cli(["reshard", str(source("z2-bf16-dp3-adamw").path), str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "reshard needs --dp" in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "x").exists()


@pytest.mark.slow
def test_the_python_api_reshards_as_the_cli_does(source, tmp_path):
    """ucp.reshard keeps the source's stage and writes the CLI's bytes."""
    import ucp

    src = source("z2-bf16-dp3-adamw").path
    plan = ucp.reshard(src, tmp_path / "api", dp=2)
    assert (plan.stage, plan.dp) == (2, 2)
    assert cli(["-q", "reshard", str(src), str(tmp_path / "cli"), "--dp", "2"]) == 0
    api, by_cli = tree(tmp_path / "api"), tree(tmp_path / "cli")
    assert sorted(api) == sorted(by_cli)
    for name, entry in by_cli.items():
        assert api[name]["sha256"] == entry["sha256"], name
