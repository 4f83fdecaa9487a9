"""DeepSpeed's own ds_to_universal output as a source: bit-exact against the live engine, and on
through ucp's universal format into a native checkpoint a real engine loads at a new DP size.

DeepSpeed runs here: ds_to_universal twice (cached for the session) and two loads with no step.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

import ucp
from tests.support.checks import assert_reader_matches_record, assert_state_equals_record
from tests.support.fixtures import resume
from ucp.cli import main as cli
from ucp.errors import InputError
from ucp.harness import LoadSpec
from ucp.sources import open_reader
from ucp.sources.ds_universal import DsUniversalSource

NAMES = ["z3-bf16-dp2-adamw", "z2-bf16-dp3-adamw"]


@pytest.fixture(scope="session")
def ds_universal(source, tmp_path_factory):
    """ds_universal(name) -> the folder holding `latest_universal`, made once per session."""
    made = {}

    def get(name):
        if name not in made:
            built = source(name)
            root = tmp_path_factory.mktemp(f"dsu-{name}")
            out = root / f"{built.tag_dir.name}_universal"
            # --inject_missing_state: ZeRO-1/2 conversion asserts a universal_checkpoint_info that plain
            # (non-Megatron) engines never save; stage 3 ignores the flag (DeepSpeed 0.19.8)
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "deepspeed.checkpoint.ds_to_universal",
                    "--input_folder",
                    str(built.tag_dir),
                    "--output_folder",
                    str(out),
                    "--num_extract_workers",
                    "1",
                    "--num_merge_workers",
                    "1",
                    "--inject_missing_state",
                ],
                capture_output=True,
                text=True,
                check=False,
                env={**os.environ, "DS_ACCELERATOR": "cpu"},
                timeout=600,
            )
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
            assert (root / "latest_universal").read_text() == out.name
            made[name] = root
        return made[name]

    return get


def _only_tag(root):
    return root / (root / "latest_universal").read_text().strip()


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_ds_universal_folder_reads_bit_exact_against_the_live_engine(source, ds_universal, name):
    built = source(name)
    reader = open_reader(ds_universal(name))
    try:
        assert isinstance(reader, DsUniversalSource)
        info = reader.facts.info
        assert (info.format, info.zero_stage, info.dp_world_size) == ("ds-universal", built.spec.stage, built.spec.dp)
        assert reader.facts.flavour == "torch-adam" and reader.facts.step == built.spec.steps
        # params, moments, steps, frozen params (from the copied model states), tied map, buffers, group hparams
        assert_reader_matches_record(reader, built.record)
        assert any(m.frozen for m in reader.facts.params)
    finally:
        reader.close()


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_groups_keep_their_own_lr_and_members(source, ds_universal, name):
    built = source(name)
    native = open_reader(built.path)
    ours = open_reader(_only_tag(ds_universal(name)))  # the output folder itself opens too
    try:
        assert len(ours.facts.groups) == len(native.facts.groups) == len(built.record["group_hparams"]) > 1
        for group, theirs, live in zip(ours.facts.groups, native.facts.groups, built.record["group_hparams"]):
            assert group.params == theirs.params and group.step == theirs.step == built.spec.steps
            assert (group.hyper.lr, group.hyper.weight_decay) == (live["lr"], live["weight_decay"])
            assert group.raw == theirs.raw
        assert len({g.hyper.lr for g in ours.facts.groups}) == len(ours.facts.groups)
        assert ours.extras() | {"clip_grad": None} == native.extras() | {"clip_grad": None}
    finally:
        native.close()
        ours.close()


@pytest.mark.slow
def test_folder_with_latest_and_latest_universal_reads_native_unless_tag_says(source, ds_universal, tmp_path):
    built = source("z3-bf16-dp2-adamw")
    shutil.copytree(built.path, tmp_path / "ck")
    shutil.copytree(_only_tag(ds_universal("z3-bf16-dp2-adamw")), tmp_path / "ck" / "u")
    (tmp_path / "ck" / "latest_universal").write_text("u")
    for tag, kind in ((None, "deepspeed"), ("u", "ds-universal")):
        reader = open_reader(tmp_path / "ck", tag=tag)
        try:
            assert reader.facts.info.format == kind
        finally:
            reader.close()


@pytest.mark.slow
@pytest.mark.parametrize("name, dp", [("z3-bf16-dp2-adamw", 3), ("z2-bf16-dp3-adamw", 2)])
def test_cli_to_universal_then_native_at_new_dp_loads_into_a_real_engine(source, ds_universal, name, dp, tmp_path):
    built = source(name)
    assert cli(["to-universal", str(ds_universal(name)), str(tmp_path / "u")]) == 0
    plan = ucp.write_native(tmp_path / "u", tmp_path / "n", dp=dp, stage=built.spec.stage)
    assert (plan.dp, plan.stage) == (dp, built.spec.stage)
    after = resume(built, LoadSpec(str(tmp_path / "n")), dp=dp, steps=0, name="after", work=tmp_path)
    assert_state_equals_record(after, built.record, steps=built.spec.steps)


def _drop(path):
    def damage(root):
        (root / path).unlink()

    return damage


def _drop_rank1_model_states(root):
    next(root.glob("zero_pp_rank_1_*model_states.pt")).unlink()


@pytest.mark.parametrize(
    "name, damage, message",
    [
        (
            "z3-bf16-dp2-adamw",
            _drop("zero/norm.bias/exp_avg.pt"),
            (
                r"^zero/norm.bias/exp_avg.pt is missing from .*: every optimized parameter needs fp32.pt, exp_avg.pt and "
                r"exp_avg_sq.pt; the folder is incomplete, so rerun ds_to_universal$"
            ),
        ),
        ("z2-bf16-dp3-adamw", _drop("zero/embed.weight/exp_avg_sq.pt"), r"zero/embed.weight/exp_avg_sq.pt is missing"),
        ("z2-bf16-dp3-adamw", _drop("zero/norm.bias/step.pt"), r"zero/norm.bias/step.pt is missing"),
        (
            "z3-bf16-dp2-adamw",
            _drop("zero/optimizer_state.pt"),
            r"zero/optimizer_state.pt is missing .* did not finish",
        ),
        (
            "z3-bf16-dp2-adamw",
            _drop_rank1_model_states,
            r"zero_pp_rank_1_mp_rank_00_model_states.pt is missing .* frozen parameter 'proj.weight'",
        ),
    ],
)
@pytest.mark.slow
def test_incomplete_folder_is_refused_in_one_line(ds_universal, name, damage, message, tmp_path, capsys):
    shutil.copytree(ds_universal(name), tmp_path / "d")
    damage(_only_tag(tmp_path / "d"))
    with pytest.raises(InputError, match=message) as err:
        open_reader(tmp_path / "d")
    assert "\n" not in str(err.value)
    assert cli(["to-universal", str(tmp_path / "d"), str(tmp_path / "u")]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0
    assert not (tmp_path / "u").exists()
