"""ZeRO-Infinity's NVMe-offloaded optimizer state is refused in one line, never converted without it.

A ZeRO-3 run with ``offload_optimizer.device: nvme`` keeps its fp32 masters and moments in swap files, which
DeepSpeed copies into the tag folder's ``offloaded_tensors/`` when it saves; its optim files hold no such state.
Building one needs DeepSpeed's async_io op (libaio), which these machines lack, so the checkpoints here are real
ZeRO-3 ones given what marks such a save: the swap folder, or the config naming nvme.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.support.files import resave
from ucp.cli import main as cli
from ucp.io.torchfile import load


def _refused(folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    for argv in (["to-universal", str(folder), str(tmp_path / "u")], ["inspect", str(folder)]):
        assert cli(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "NVMe swap files" in err and "offloaded_tensors" in err, err
    assert not (tmp_path / "u").exists()


def test_a_save_holding_nvme_swap_files_is_refused(z3_bf16_dp2, tmp_path, capsys) -> None:
    folder = tmp_path / "ckpt"
    shutil.copytree(z3_bf16_dp2.path, folder)
    (folder / "global_step3" / "offloaded_tensors" / "rank0").mkdir(parents=True)
    _refused(folder, tmp_path, capsys)


def test_a_save_whose_config_offloads_the_optimizer_to_nvme_is_refused(z3_bf16_dp2, tmp_path, capsys) -> None:
    folder = tmp_path / "ckpt"
    shutil.copytree(z3_bf16_dp2.path, folder)
    for path in folder.glob("global_step3/*model_states.pt"):
        states = load(path)
        states["ds_config"]["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": "/nvme"}
        resave(states, path)
    _refused(folder, tmp_path, capsys)
