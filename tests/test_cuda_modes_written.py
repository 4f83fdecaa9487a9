"""DeepSpeed's CUDA-only modes as real saves from an H200 (tests/test_cuda_modes.py wrote them; kept in
tests/data/gpu-written.tgz), read on a CPU: what ucp carries from each, what it says, what it refuses.

What those saves showed (DeepSpeed 0.19.8, torch 2.11.0+cu130):

- ZenFlow at ZeRO-3 transposes every matrix before partitioning it: masters, moments, ``param_shapes`` and frozen
  weights are the model's transposes (the 37x10 embedding saved as 10x37). ucp reads them in the model's shape
  and writes them back transposed for a ZenFlow ZeRO-3 run (the default when the source was one) or as they are
  for any other (``--no-zenflow``).
- SuperOffload and ZenFlow's ``overlap_step`` step their CPU Adam in a process of their own: the save holds the
  weights and masters but no optimizer state, after 4 and 2 applied steps.
- ZeRO-Offload++ (``ratio`` 0.5) saves no state for the sub-groups its GPU optimizer steps; DeepSpeed's own
  ``safe_get_full_optimizer_state`` raises KeyError on them.
- FastPersist (``checkpoint.writer`` type ``fast``) at ZeRO-1/2 names each file ``NAME-R.N`` (part R of N data
  parallel writers), which DeepSpeed's load does not look for; at ZeRO-3 its files are plain torch files.
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import ucp
from tests.support.checks import assert_adam_universal_matches_record
from tests.support.fixtures import Built, resume
from tests.support.gpu_written import gpu_written_root, written
from ucp.cli import main as cli
from ucp.errors import InputError
from ucp.harness import LoadSpec
from ucp.io.torchfile import load
from ucp.model.zenflow import ZENFLOW_Z3_NOTE
from ucp.sources import open_reader
from ucp.universal import open_universal

pytestmark = pytest.mark.slow


def _mode(name: str) -> Built:
    return written(gpu_written_root() / "modes" / name)


def _t(tensor: torch.Tensor) -> torch.Tensor:
    """A record's tensor in the model's shape (ZenFlow ZeRO-3 records hold matrices transposed)."""
    return tensor.t() if tensor.dim() == 2 else tensor


def _files(folder: Path, pattern: str) -> Path:
    (path,) = folder.glob(f"*/{pattern}")
    return path


# -- ZenFlow at ZeRO-3 ---------------------------------------------------------------------------------------------


def test_zenflow_zero3_reads_every_matrix_in_the_models_shape_bit_exact(tmp_path):
    built = _mode("zenflow-z3")
    record = built.record
    assert record["params"]["embed.weight"].shape == (10, 37)  # the run's own layout: transposed
    ucp.to_universal(built.path, tmp_path / "u")
    with open_universal(tmp_path / "u") as reader:
        assert ZENFLOW_Z3_NOTE in reader.facts.warnings
        assert reader.facts.param("embed.weight").shape == (37, 10)
        assert reader.facts.param("proj.weight").frozen  # a square frozen matrix: transposed too
        for name, master in record["params"].items():
            state = reader.read(name)
            assert torch.equal(state.fp32, _t(master)), name
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(state.optim[key], _t(record[key][name])), (name, key)
        assert torch.equal(reader.read("proj.weight").fp32, _t(record["module"]["proj.weight"]).float())


def test_zenflow_zero3_exports_the_models_shapes_and_says_why(tmp_path, capsys):
    from safetensors.torch import load_file

    built = _mode("zenflow-z3")
    capsys.readouterr()
    assert cli(["export", str(built.path), str(tmp_path / "m.safetensors"), "--dtype", "fp32"]) == 0
    assert f"note: {ZENFLOW_Z3_NOTE}" in capsys.readouterr().err
    weights = load_file(tmp_path / "m.safetensors")
    assert torch.equal(weights["embed.weight"], _t(built.record["params"]["embed.weight"]))
    assert torch.equal(weights["proj.weight"], _t(built.record["module"]["proj.weight"]).float())


def test_zenflow_zero3_rewritten_for_zenflow_is_the_sources_own_bytes_and_without_it_the_models_shapes(tmp_path):
    built = _mode("zenflow-z3")
    assert cli(["reshard", str(built.path), str(tmp_path / "same"), "--dp", "1"]) == 0
    assert cli(["reshard", str(built.path), str(tmp_path / "plain"), "--dp", "2", "--no-zenflow"]) == 0
    assert cli(["reshard", str(tmp_path / "plain"), str(tmp_path / "back"), "--dp", "1", "--zenflow"]) == 0
    source = load(_files(built.path, "bf16_*optim_states.pt"))["optimizer_state_dict"]
    for out in ("same", "back"):  # straight, and through a plain ZeRO-3 layout at dp 2 and back
        ours = load(_files(tmp_path / out, "bf16_*optim_states.pt"))["optimizer_state_dict"]
        for a, b in zip(source["fp32_flat_groups"], ours["fp32_flat_groups"], strict=True):
            assert torch.equal(a, b), out
        for sub, state in source["optimizer_state_dict"]["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(state[key], ours["optimizer_state_dict"]["state"][sub][key]), (out, sub, key)
        model = load(_files(tmp_path / out, "zero_pp_rank_0_*model_states.pt"))
        assert model["param_shapes"] == load(_files(built.path, "*model_states.pt"))["param_shapes"], out
    plain = load(_files(tmp_path / "plain", "zero_pp_rank_0_*model_states.pt"))
    assert plain["param_shapes"][0]["embed.weight"] == (37, 10)
    assert "zenflow" not in plain["ds_config"]["zero_optimization"]


def test_zenflow_zero3_moves_to_a_plain_zero3_run_at_dp_2_with_every_state_in_place(tmp_path):
    built = _mode("zenflow-z3")
    out = tmp_path / "n"
    assert cli(["restore", str(built.path), str(out), "--dp", "2", "--no-zenflow"]) == 0
    plain = Built(built.path, built.record_path, replace(built.spec, device="cpu", zenflow=0, ds_config=None))
    after = resume(plain, LoadSpec(str(out)), dp=2, steps=0, name="loaded", work=tmp_path)
    record = built.record
    for name, master in record["params"].items():
        assert torch.equal(after["params"][name], _t(master)), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(after[key][name], _t(record[key][name])), (name, key)
    assert set(after["state_steps"]) == {float(built.record["state_steps"][0])}


# -- saves without optimizer state -------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "why"), [("superoffload", "SuperOffload"), ("zenflow-overlap-z2", "overlap_step")])
def test_a_save_whose_optimizer_ran_in_its_own_process_says_its_state_is_missing(name, why, tmp_path, capsys):
    built = _mode(name)
    record = built.record
    assert all(v is None for v in record["exp_avg"].values())  # the live engine held none either
    with open_reader(built.path) as reader:
        note = next(w for w in reader.facts.warnings if "holds no optimizer state" in w)
        applied = record["counters"]["global_steps"] - record["counters"]["skipped_steps"]
        assert why in note and f"applied {applied} optimizer steps" in note
        for param, master in record["params"].items():
            fp32 = reader.read(param).fp32
            if name == "superoffload":
                assert torch.equal(fp32, master), param
            else:  # ZenFlow: the weights the run computed with (ucp.model.zenflow)
                assert torch.equal(fp32.bfloat16(), record["module"][param]), param
    capsys.readouterr()
    assert cli(["restore", str(built.path), str(tmp_path / "n"), "--dp", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and why in err and "--step reset" in err, err
    assert not (tmp_path / "n").exists()
    argv = [
        "restore",
        str(built.path),
        str(tmp_path / "n"),
        "--dp",
        "2",
        "--step",
        "reset",
        "--optimizer",
        "ds-cpu-adam",
    ]
    assert cli(argv) == 0
    with open_reader(built.path) as source, open_reader(tmp_path / "n") as reader:  # the masters, no moments
        assert not any(g.state_keys for g in reader.facts.groups)
        for param in record["params"]:
            assert torch.equal(reader.read(param).fp32, source.read(param).fp32), param


# -- ZeRO-Offload++ ------------------------------------------------------------------------------------------------


def test_a_partial_offload_save_from_a_gpu_is_refused_in_one_line_naming_the_ratio(tmp_path, capsys):
    built = _mode("offload-pp")
    assert any(v is None for v in built.record["exp_avg"].values())  # DeepSpeed's own accessor found none
    capsys.readouterr()
    assert cli(["to-universal", str(built.path), str(tmp_path / "u")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "ratio=0.5 (ZeRO-Offload++)" in err, err
    assert not (tmp_path / "u").exists()


# -- FastPersist -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [2, 3])
def test_a_fastpersist_save_reads_bit_exact(stage, tmp_path):
    built = _mode(f"fastpersist-z{stage}")
    names = sorted(p.name for p in next(built.path.glob("global_step*")).iterdir())
    assert all(n.endswith("-0.1") for n in names) == (stage == 2), names
    ucp.to_universal(built.path, tmp_path / "u")
    assert_adam_universal_matches_record(tmp_path / "u", built.record)


def test_a_fastpersist_zero2_save_becomes_files_deepspeed_loads_at_dp_2(tmp_path):
    built = _mode("fastpersist-z2")
    out = tmp_path / "n"
    ucp.write_native(built.path, out, dp=2, stage=2, optimizer="torch-adam")
    plain = Built(built.path, built.record_path, replace(built.spec, device="cpu", ds_config=None))
    after = resume(plain, LoadSpec(str(out)), dp=2, steps=0, name="loaded", work=tmp_path)
    for key in ("params", "exp_avg", "exp_avg_sq"):
        for name, value in built.record[key].items():
            assert torch.equal(after[key][name], value), (key, name)


def test_a_fastpersist_save_split_over_several_writers_is_refused_in_one_line(tmp_path, capsys):
    built = _mode("fastpersist-z2")
    folder = tmp_path / "ckpt"
    shutil.copytree(built.path, folder)
    tag = next(folder.glob("global_step*"))
    for part in tag.iterdir():  # what two data-parallel writers name their parts
        part.rename(part.with_name(part.name.replace("-0.1", "-0.2")))
    capsys.readouterr()
    assert cli(["to-universal", str(folder), str(tmp_path / "u")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "split over 2 data-parallel writers" in err, err
    with pytest.raises(InputError):
        open_reader(folder)
