"""Writing a checkpoint without ZeRO (``--stage 0``, DeepSpeed's default): checked against what DeepSpeed itself
writes and loads.

A stage-0 source written back at stage 0 gives DeepSpeed's own file, tensor for tensor, and resumes bit-identically
to DeepSpeed's native resume. ZeRO sources written at stage 0 and another DP size load into a stage-0 engine holding
the source engine's state bit for bit, and train within 1e-5 of DeepSpeed's native ZeRO resume (fp32: the engines
agree within 1.2e-7 from one state, measured); the fused FP16_Optimizer's flat groups too. What is not written yet
(pipeline and expert targets) is refused in one line before anything is written; fp16: tests/test_fp16.py. TP:
tests/test_zero0_tp.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import ucp
from tests.support.checks import (
    assert_every_state_equals_record,
    assert_same_training,
    assert_same_tree,
    assert_state_equals_record,
)
from tests.support.fixtures import Built, build, resume
from ucp.cli import main as cli
from ucp.errors import ConfigError
from ucp.harness import LoadSpec
from ucp.io.torchfile import load
from ucp.sources import open_reader

#: the harness model's frozen projection, named for a stage-0 fp32 source (see tests/test_zero0.py)
FROZEN = ["proj.weight", "proj.bias"]
MODEL_FILE = "mp_rank_00_model_states.pt"


def _stage0_run(dtype: str, optimizer: str = "torch-adamw") -> Built:
    return build(dp=2, stage=0, dtype=dtype, optimizer=optimizer)


def _model_states(root: Path) -> dict[str, Any]:
    tag = (root / "latest").read_text().strip()
    return load(root / tag / MODEL_FILE)


@pytest.mark.parametrize(
    "dtype, optimizer",
    # fp32: the client optimizer; bf16: FP16_UnfusedOptimizer, or FP16_Optimizer (flat groups) around FusedAdam
    [("fp32", "torch-adamw"), ("bf16", "torch-adamw"), ("bf16", "ds-fused-adam")],
)
@pytest.mark.slow
def test_stage0_source_written_at_stage0_is_deepspeeds_own_file_and_resumes_bit_identically(dtype, optimizer, tmp_path):
    built = _stage0_run(dtype, optimizer)
    with open_reader(built.path, frozen=FROZEN) as reader:
        ucp.write_native(reader, tmp_path / "n", dp=2, stage=0)
    ours, theirs = _model_states(tmp_path / "n"), _model_states(built.path)
    # DeepSpeed always saves its parallel dimensions (ucp's native targets: at TP > 1 only); ucp writes the
    # empty set older versions saved as sparse_tensor_module_names, which 0.19.8 hands back as client state
    theirs.pop("checkpoint_parallel_dimensions")
    assert ours.pop("sparse_tensor_module_names") == set()
    if optimizer == "ds-fused-adam":  # FusedAdam's stale group step (0) is written as the real count
        for group in theirs["optimizer"]["optimizer_state_dict"]["param_groups"]:
            assert group["step"] == 0
            group["step"] = built.spec.steps + 1
    assert set(ours) == set(theirs)
    for key in theirs:
        assert_same_tree(ours[key], theirs[key], key)
    native = resume(built, LoadSpec(str(built.path)), name="native", work=tmp_path)
    again = resume(built, LoadSpec(str(tmp_path / "n")), name="ucp", work=tmp_path)
    assert_same_training(native, again)


@pytest.mark.parametrize(
    "name, dp",
    [("z3-fp32-dp3-adamw", 2), ("z1-fp32-dp2-adamw", 3), ("z2-fp32-rmsprop", 3), ("z3-fp32-nadam", 1)],
)
@pytest.mark.slow
def test_zero_run_written_without_zero_at_new_dp_resumes_like_deepspeeds_native_resume(
    name, dp, source, universals, native_resume, tmp_path
):
    built = source(name)
    out = tmp_path / "n"
    assert cli(["restore", str(universals(name)), str(out), "--dp", str(dp), "--stage", "0"]) == 0
    model = _model_states(out)
    assert model["param_shapes"] is None and model["ds_config"]["zero_optimization"]["stage"] == 0
    assert list(model["optimizer"]) == ["state", "param_groups"]  # the client optimizer's own state_dict
    after = resume(built, LoadSpec(str(out)), dp=dp, steps=0, name="after", work=tmp_path, stage=0)
    assert_every_state_equals_record(after, built.record)
    ours = resume(built, LoadSpec(str(out)), dp=dp, name="ucp", work=tmp_path, stage=0)
    assert_same_training(native_resume(built), ours, atol=1e-5)


@pytest.mark.slow
def test_bf16_zero_run_written_without_zero_holds_the_source_state_and_trains_as_a_live_restore_does(
    source, universals, tmp_path
):
    """FP16_UnfusedOptimizer's fp32 copies take the masters; the step is the source's (a bf16 stage-0 run of its
    own would be one ahead: DeepSpeed's wrapper steps once when it is built). DeepSpeed's bf16 engines without ZeRO
    and with it reduce gradients differently (3 steps at DP 3: 2.7e-4 apart from one state, measured), so the
    training reference is the same stage-0 engine given the same state by ``ucp.restore``."""
    name = "z2-bf16-dp3-adamw"
    built = source(name)
    out = tmp_path / "n"
    assert cli(["reshard", str(built.path), str(out), "--dp", "2", "--stage", "0"]) == 0
    model = _model_states(out)
    assert (model["optimizer"]["dynamic_loss_scale"], model["optimizer"]["cur_scale"]) == (False, 1.0)
    assert model["optimizer"]["cur_iter"] == built.spec.steps
    assert [len(g) for g in model["optimizer"]["fp32_groups"]] == [
        len(g["params"]) for g in model["optimizer"]["optimizer_state_dict"]["param_groups"]
    ]
    after = resume(built, LoadSpec(str(out)), dp=2, steps=0, name="after", work=tmp_path, stage=0)
    assert_state_equals_record(after, built.record, steps=built.spec.steps)
    ours = resume(built, LoadSpec(str(out)), dp=2, name="ucp", work=tmp_path, stage=0)
    live = resume(built, LoadSpec(str(universals(name)), kind="ucp"), dp=2, name="live", work=tmp_path, stage=0)
    assert_same_training(live, ours)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fused_adam_run_written_without_zero_loads_every_state_bit_for_bit(dtype, source, universals, tmp_path):
    """DeepSpeed FusedAdam without ZeRO: in fp32 the client optimizer (a step per parameter and the group's copy),
    in bf16 inside DeepSpeed's fused FP16_Optimizer (one flat master and state per param group); each loads the
    bf16 ZeRO-3 DP 4 source's state bit for bit, at the source's step."""
    name = "z3-bf16-dp4-fused"
    built = source(name)
    out = tmp_path / "n"
    ucp.write_native(universals(name), out, dp=2, stage=0, dtype=dtype)
    optimizer = _model_states(out)["optimizer"]
    inner = optimizer if dtype == "fp32" else optimizer["optimizer_state_dict"]
    assert {g["step"] for g in inner["param_groups"]} == {built.spec.steps}
    if dtype == "bf16":
        assert [len(g["params"]) for g in inner["param_groups"]] == [1] * len(inner["param_groups"])
        assert optimizer["clip_grad"] == 1.0  # DeepSpeed's default since 0.19.3, which the source ran with
    after = resume(built, LoadSpec(str(out)), dp=2, steps=0, name="after", work=tmp_path, stage=0, dtype=dtype)
    for key in ("params", "exp_avg", "exp_avg_sq"):
        assert set(after[key]) == set(built.record[key]), key
        for param, value in built.record[key].items():
            assert torch.equal(after[key][param], value), (key, param)
    assert set(after["state_steps"]) == {built.spec.steps}


@pytest.mark.slow
def test_live_restore_into_a_fused_stage0_engine_equals_loading_the_native_file(source, universals, tmp_path):
    """``ucp.restore`` into DeepSpeed's fused FP16_Optimizer (bf16 FusedAdam without ZeRO) fills each member's
    slice of the flat masters and state: the same state, and the same 3 steps bit for bit, as the engine's own
    ``load_checkpoint`` of the stage-0 file ucp writes (two independent paths)."""
    name = "z3-bf16-dp4-fused"
    built = source(name)
    live = LoadSpec(str(universals(name)), kind="ucp")
    after = resume(built, live, dp=2, steps=0, name="after", work=tmp_path, stage=0)
    assert_state_equals_record(after, built.record, steps=built.spec.steps)
    ucp.write_native(universals(name), tmp_path / "n", dp=2, stage=0)
    native = resume(built, LoadSpec(str(tmp_path / "n")), dp=2, name="native", work=tmp_path, stage=0)
    assert_same_training(native, resume(built, live, dp=2, name="live", work=tmp_path, stage=0))


@pytest.mark.slow
def test_bf16_fused_and_unfused_stage0_files_of_one_state_train_alike(source, universals, tmp_path):
    """The flat FP16_Optimizer file and the per-parameter FP16_UnfusedOptimizer one hold the same state: 3 steps
    of FusedAdam and torch AdamW from them agree within 1e-5 (the two optimizers round differently)."""
    name = "z3-bf16-dp4-fused"
    built = source(name)
    ucp.write_native(universals(name), tmp_path / "fused", dp=2, stage=0)
    ucp.write_native(universals(name), tmp_path / "unfused", dp=2, stage=0, optimizer="torch-adam")
    fused = resume(built, LoadSpec(str(tmp_path / "fused")), dp=2, name="fused", work=tmp_path, stage=0)
    unfused = resume(
        built,
        LoadSpec(str(tmp_path / "unfused")),
        dp=2,
        name="unfused",
        work=tmp_path,
        stage=0,
        optimizer="torch-adamw",
    )
    assert_same_training(fused, unfused, atol=1e-5, steps=False)


@pytest.mark.slow
def test_pipeline_target_at_stage0_is_refused(universals, tmp_path):
    from ucp.targets.pipeline import PipelineLayout, write_pipeline

    with open_reader(universals("z1-fp32-dp2-adamw")) as reader:
        layout = PipelineLayout((0, 2, 4))
        with pytest.raises(ConfigError, match="ZeRO-1"):
            write_pipeline(reader, tmp_path / "n", layout, dp=1, stage=0)
    assert not (tmp_path / "n").exists()
