"""ZeRO-1/2: to-universal bit-exact against the live engine, and back out at any DP size, into native
files, live engines and ZeRO-3, checked against DeepSpeed's own native resume.

DeepSpeed runs here (besides the three source builds): one native resume, three 3-step resumes
and five loads with no step.
"""

from __future__ import annotations

import shutil

import pytest
import torch

import ucp
from tests.support.checks import assert_reader_matches_record, assert_same_training, assert_state_equals_record
from tests.support.files import resave
from tests.support.fixtures import resume
from ucp.errors import InputError
from ucp.harness import LoadSpec
from ucp.io.torchfile import load
from ucp.sources import open_reader

Z12 = ["z1-fp32-dp2-adamw", "z2-bf16-dp3-adamw", "z1-bf16-dp2-bf16opt"]


@pytest.mark.slow
@pytest.mark.parametrize("name", Z12)
def test_to_universal_is_bit_exact_against_the_live_engine(source, universals, name):
    built = source(name)
    reader = open_reader(built.path)
    try:
        assert reader.facts.info.zero_stage == built.spec.stage
        assert len(reader.facts.groups) == built.spec.param_groups
        assert_reader_matches_record(reader, built.record)
    finally:
        reader.close()
    universal = open_reader(universals(name))
    assert universal.facts.info.zero_stage == built.spec.stage
    assert_reader_matches_record(universal, built.record)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["z2-bf16-dp3-adamw", "z1-bf16-dp2-bf16opt"])
def test_same_dp_rewrite_reproduces_every_field_deepspeed_wrote(source, universals, name, tmp_path):
    built = source(name)
    dp, stage = built.spec.dp, built.spec.stage
    plan = ucp.write_native(universals(name), tmp_path / "n", dp=dp, stage=stage)
    ours, theirs = tmp_path / "n" / plan.tag, built.tag_dir
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir())
    model = load(ours / "mp_rank_00_model_states.pt")
    expected = load(theirs / "mp_rank_00_model_states.pt")
    for key in (
        "param_shapes",
        "frozen_param_shapes",
        "shared_params",
        "buffer_names",
        "dp_world_size",
        "global_steps",
        "global_samples",
        "lr_scheduler",
    ):
        assert model[key] == expected[key], key
    assert set(model["module"]) == set(expected["module"])
    for key, value in expected["module"].items():
        assert model["module"][key].dtype == value.dtype and torch.equal(model["module"][key], value), key
    for rank in range(dp):
        file = next(p.name for p in theirs.iterdir() if f"zero_pp_rank_{rank}_" in p.name)
        mine, real = load(ours / file)["optimizer_state_dict"], load(theirs / file)["optimizer_state_dict"]
        for key in ("group_paddings", "partition_count", "param_slice_mappings", "clip_grad"):
            assert mine[key] == real[key], (rank, key)
        base, real_base = mine["base_optimizer_state"], real["base_optimizer_state"]
        for g, tensor in enumerate(real["single_partition_of_fp32_groups"]):  # BF16_Optimizer keeps the padding
            used = real_base["state"][g]["exp_avg"].numel() - real["group_paddings"][g]
            assert torch.equal(mine["single_partition_of_fp32_groups"][g], tensor[:used]), (rank, g)
        assert [dict(g) for g in base["param_groups"]] == [dict(g) for g in real_base["param_groups"]]
        for g, state in real_base["state"].items():
            for key, value in state.items():
                assert torch.equal(base["state"][g][key], value), (rank, g, key)


@pytest.mark.slow
@pytest.mark.parametrize("dp, stage", [(1, 2), (3, 1), (4, 2)])
def test_native_rewrite_at_any_dp_reads_back_bit_exact(source, universals, dp, stage, tmp_path):
    built = source("z1-fp32-dp2-adamw")
    ucp.write_native(universals("z1-fp32-dp2-adamw"), tmp_path / "n", dp=dp, stage=stage)
    reader = open_reader(tmp_path / "n")
    try:
        assert (reader.facts.info.dp_world_size, reader.facts.info.zero_stage) == (dp, stage)
        assert_reader_matches_record(reader, built.record)
    finally:
        reader.close()


def _break_shapes(tag):
    model = load(tag / "mp_rank_00_model_states.pt")
    group = model["param_shapes"][0]
    first = next(iter(group))
    group[first] = torch.Size([group[first][0] + 1, *group[first][1:]])
    resave(model, tag / "mp_rank_00_model_states.pt")


def _mix_versions(tag):
    path = next(tag.glob("*zero_pp_rank_1_*"))
    optim = load(path)
    optim["ds_version"] = optim["optimizer_state_dict"]["ds_version"] = "0.18.0"
    resave(optim, path)


def _say_stage3(tag):
    path = next(tag.glob("*zero_pp_rank_0_*"))
    optim = load(path)
    optim["optimizer_state_dict"]["zero_stage"] = type(optim["optimizer_state_dict"]["zero_stage"])(3)
    resave(optim, path)


def _drop_last_rank(tag):
    next(tag.glob("*zero_pp_rank_1_*")).unlink()


@pytest.mark.parametrize(
    "damage, message",
    [
        (_break_shapes, "group sizes do not add up"),
        (_mix_versions, "different DeepSpeed versions"),
        (_say_stage3, "mixes stages"),
        (_drop_last_rank, "rank file zero_pp_rank_1_mp_rank_00_optim_states.pt is missing .* partition_count=2"),
    ],
)
@pytest.mark.slow
def test_reader_refuses_inconsistent_checkpoints_in_one_line(source, damage, message, tmp_path):
    shutil.copytree(source("z1-fp32-dp2-adamw").path, tmp_path / "ck")
    tag = tmp_path / "ck" / (tmp_path / "ck" / "latest").read_text().strip()
    damage(tag)
    with pytest.raises(InputError, match=message) as err:
        open_reader(tmp_path / "ck")
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_same_dp_resume_is_bit_identical_to_native_resume(source, native_resume, universals, tmp_path):
    built = source("z1-fp32-dp2-adamw")
    ucp.write_native(universals("z1-fp32-dp2-adamw"), tmp_path / "n", dp=2, stage=1)
    ours = resume(built, LoadSpec(str(tmp_path / "n")), name="ucp", work=tmp_path)
    assert_same_training(native_resume(built), ours)


@pytest.mark.slow
def test_new_dp_resume_matches_native_resume_within_1e_5(source, native_resume, universals, tmp_path):
    built = source("z1-fp32-dp2-adamw")
    plan = ucp.write_native(universals("z1-fp32-dp2-adamw"), tmp_path / "n", dp=3, stage=1)
    assert sorted(p.name for p in (tmp_path / "n" / plan.tag).glob("*optim_states.pt")) == [
        f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(3)
    ]
    ours = resume(built, LoadSpec(str(tmp_path / "n")), dp=3, name="ucp", work=tmp_path)
    assert_same_training(native_resume(built), ours, atol=1e-5)


@pytest.mark.slow
def test_restore_into_live_stage1_engine_at_new_dp_matches_native_resume(source, native_resume, universals, tmp_path):
    built = source("z1-fp32-dp2-adamw")
    ours = resume(built, LoadSpec(str(universals("z1-fp32-dp2-adamw")), kind="ucp"), dp=1, name="live", work=tmp_path)
    assert_same_training(native_resume(built), ours, atol=1e-5)
    assert set(ours["state_steps"]) == {float(built.spec.steps + 3)}


@pytest.mark.slow
def test_state_right_after_live_restore_at_new_dp_equals_source_and_groups_keep_own_lr(source, universals, tmp_path):
    built = source("z2-bf16-dp3-adamw")  # three groups with their own lr and weight_decay
    after = resume(
        built, LoadSpec(str(universals("z2-bf16-dp3-adamw")), kind="ucp"), dp=2, steps=0, name="after", work=tmp_path
    )
    assert_state_equals_record(after, built.record, steps=built.spec.steps)
    assert len({g["lr"] for g in after["group_hparams"]}) == 3


@pytest.mark.slow
def test_bf16_optimizer_checkpoint_loads_natively_at_new_dp(source, universals, tmp_path):
    built = source("z1-bf16-dp2-bf16opt")
    ucp.write_native(universals("z1-bf16-dp2-bf16opt"), tmp_path / "n", dp=3, stage=1)
    after = resume(built, LoadSpec(str(tmp_path / "n")), dp=3, steps=0, name="after", work=tmp_path)
    assert_state_equals_record(after, built.record, steps=built.spec.steps)


@pytest.mark.slow
def test_zero3_checkpoint_becomes_zero2_and_loads_in_a_stage2_engine(source, universals, tmp_path):
    built = source("z3-fp32-dp3-adamw")  # three groups
    ucp.write_native(universals("z3-fp32-dp3-adamw"), tmp_path / "n", dp=2, stage=2)
    assert not list((tmp_path / "n").glob("*/zero_pp_rank_*_model_states.pt"))
    after = resume(built, LoadSpec(str(tmp_path / "n")), dp=2, steps=0, name="after", work=tmp_path, stage=2)
    assert_state_equals_record(after, built.record, steps=built.spec.steps)


@pytest.mark.slow
def test_zero2_checkpoint_becomes_zero3_and_loads_in_a_stage3_engine(source, universals, tmp_path):
    built = source("z2-bf16-dp3-adamw")
    ucp.write_native(universals("z2-bf16-dp3-adamw"), tmp_path / "n", dp=2, stage=3)
    after = resume(built, LoadSpec(str(tmp_path / "n")), dp=2, steps=0, name="after", work=tmp_path, stage=3)
    assert_state_equals_record(after, built.record, steps=built.spec.steps)


@pytest.mark.slow
def test_deepspeed_load_universal_reads_a_ucp_dir_made_from_a_stage2_checkpoint(source, universals, tmp_path):
    built = source("z2-bf16-dp3-adamw")
    after = resume(
        built,
        LoadSpec(str(universals("z2-bf16-dp3-adamw")), kind="ds-universal"),
        dp=2,
        steps=0,
        name="after",
        work=tmp_path,
    )
    # DeepSpeed's ZeRO-1/2 universal loader (0.19.8) never loads `module`, so buffers stay as the new
    # engine built them; everything it does load must be exact
    assert_state_equals_record(after, built.record, steps=built.spec.steps, buffers=False)
