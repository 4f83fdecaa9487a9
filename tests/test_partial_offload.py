"""ZeRO-Offload++ (``offload_optimizer.ratio`` below 1, ZeRO-3) saves without the moments of its GPU sub-groups:
refused in one line that says why, never converted without them.

DeepSpeed 0.19.8 steps the first sub-groups of each rank on the GPU with a second torch AdamW and saves only its
CPU optimizer's state, so those sub-groups have no entry in the optim files (its own resume restarts their moments
at zero without a word). On a CPU every sub-group is stepped by the CPU optimizer, so such a save cannot be made
here: the checkpoint is a real ZeRO-3 CPU Adam one (3 param groups, so 3 sub-groups) given what marks such a save,
the ratio in its config and sub-group 0's state gone from every rank.
"""

from __future__ import annotations

import shutil

import pytest

from tests.support.files import resave
from ucp.cli import main as cli
from ucp.io.torchfile import load


@pytest.mark.slow
def test_a_partial_offload_save_without_its_gpu_moments_is_refused_saying_why(source, tmp_path, capsys) -> None:
    built = source("z3-bf16-dp2-cpuadam")
    folder = tmp_path / "ckpt"
    shutil.copytree(built.path, folder)
    tag = folder / built.tag_dir.name
    for path in tag.glob("*model_states.pt"):
        states = load(path)
        states["ds_config"]["zero_optimization"]["offload_optimizer"]["ratio"] = 0.5
        resave(states, path)
    for path in tag.glob("*optim_states.pt"):
        optim = load(path)
        del optim["optimizer_state_dict"]["optimizer_state_dict"]["state"][0]
        resave(optim, path)
    capsys.readouterr()
    for argv in (
        ["to-universal", str(folder), str(tmp_path / "u")],
        ["reshard", str(folder), str(tmp_path / "r"), "--dp", "1"],
    ):
        assert cli(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        assert "no optimizer state for sub-group 0" in err and "ratio=0.5 (ZeRO-Offload++)" in err, err
    assert not (tmp_path / "u").exists() and not (tmp_path / "r").exists()
