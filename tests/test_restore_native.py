"""ucp restore: universal -> native ZeRO-3 files that stock DeepSpeed loads with load_checkpoint(dir).

The reference is DeepSpeed's own native resume of the source checkpoint at its own DP size.
"""

from __future__ import annotations

import pytest
import torch

import ucp
from tests.support.checks import assert_same_training
from tests.support.fixtures import resume
from ucp.cli import main as cli
from ucp.harness import LoadSpec


def _restore(built, tmp_path, dp, **options):
    universal = tmp_path / "universal"
    if not universal.exists():
        ucp.to_universal(built.path, universal)
    out = tmp_path / f"dp{dp}"
    ucp.write_native(universal, out, dp=dp, **options)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["z3-bf16-dp2-adamw", "z3-fp32-dp3-adamw"])
def test_same_dp_resume_is_bit_identical_to_native_resume(source, native_resume, name, tmp_path):
    built = source(name)
    out = _restore(built, tmp_path, built.spec.dp)
    ours = resume(built, LoadSpec(str(out)), name="ucp", work=tmp_path)
    assert_same_training(native_resume(built), ours)


@pytest.mark.parametrize(
    "name, dp", [("z3-fp32-dp1-adamw", 4), ("z3-fp32-dp4-adam", 1), ("z3-fp32-dp2-adamw", 3), ("z3-fp32-dp3-adamw", 2)]
)
@pytest.mark.slow
def test_new_dp_resume_matches_native_resume_within_1e_5(source, native_resume, name, dp, tmp_path):
    built = source(name)
    out = _restore(built, tmp_path, dp)
    assert sorted(p.name for p in (out / (out / "latest").read_text()).iterdir() if "optim" in p.name) == sorted(
        f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(dp)
    )
    ours = resume(built, LoadSpec(str(out)), dp=dp, name="ucp", work=tmp_path)
    assert_same_training(native_resume(built), ours, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name, dp", [("z3-bf16-dp2-adamw", 3), ("z3-bf16-dp4-fused", 2), ("z3-bf16-dp2-cpuadam", 1)])
def test_state_right_after_load_at_new_dp_equals_source(source, name, dp, tmp_path):
    built = source(name)
    out = _restore(built, tmp_path, dp)
    after = resume(built, LoadSpec(str(out)), dp=dp, steps=0, name="loaded", work=tmp_path)
    record = built.record
    for key in ("params", "exp_avg", "exp_avg_sq"):
        for param, value in record[key].items():
            assert torch.equal(after[key][param], value), (key, param)
    for param, value in record["module"].items():  # frozen and low-precision weights too
        assert torch.equal(after["module"][param], value), param
    assert set(after["state_steps"]) == {float(built.spec.steps)}
    assert after["lrs"] == record["lrs"] and after["counters"] == record["counters"]
    assert all(torch.equal(v, after["buffers"][k]) for k, v in record["buffers"].items())


@pytest.mark.slow
def test_sub_groups_each_take_their_own_step_and_advance_by_one_per_step(source, tmp_path):
    built = source("z3-fp32-dp2-adamw")  # sub_group_size=60: six sub-groups
    out = _restore(built, tmp_path, 3)
    ours = resume(built, LoadSpec(str(out)), dp=3, steps=3, name="ucp", work=tmp_path)
    assert len(ours["state_steps"]) > 2 and set(ours["state_steps"]) == {6.0}  # never 3 + 3 x sub-groups


@pytest.mark.slow
def test_torch_adamw_checkpoint_resumes_under_deepspeed_fused_adam(source, native_resume, tmp_path):
    built = source("z3-fp32-dp2-adamw")
    out = _restore(built, tmp_path, 2, optimizer="ds-fused-adam")
    ours = resume(built, LoadSpec(str(out)), name="fused", work=tmp_path, optimizer="ds-fused-adam")
    assert set(ours["state_step_types"]) == {"int"} and set(ours["state_steps"]) == {6}
    reference = native_resume(built)
    for a, b in zip(reference["losses"], ours["losses"]):
        assert abs(a - b) < 1e-4
    for name, value in reference["params"].items():
        assert torch.allclose(ours["params"][name], value, rtol=0, atol=1e-5), name


@pytest.mark.slow
def test_fp32_checkpoint_restores_into_a_bf16_run(source, tmp_path):
    built = source("z3-fp32-dp2-adamw")
    out = _restore(built, tmp_path, 2, dtype="bf16")
    assert any(p.name.startswith("bf16_") for p in (out / "global_step3").iterdir())
    after = resume(built, LoadSpec(str(out)), steps=0, name="bf16", work=tmp_path, dtype="bf16")
    for name, value in built.record["params"].items():
        assert torch.equal(after["params"][name], value), name
        assert torch.equal(after["module"][name], value.to(torch.bfloat16)), name


@pytest.mark.slow
def test_restore_cli_writes_latest_and_tag_and_refuses_bad_options(z3_bf16_dp2, tmp_path, capsys):
    universal = tmp_path / "u"
    assert cli(["to-universal", str(z3_bf16_dp2.path), str(universal)]) == 0
    assert cli(["restore", str(universal), str(tmp_path / "n"), "--dp", "3", "--tag", "moved"]) == 0
    assert (tmp_path / "n" / "latest").read_text() == "moved"
    assert len(list((tmp_path / "n" / "moved").glob("bf16_zero_pp_rank_*_optim_states.pt"))) == 3
    capsys.readouterr()
    assert cli(["restore", str(universal), str(tmp_path / "n"), "--dp", "3"]) != 0
    assert cli(["restore", str(universal), str(tmp_path / "m"), "--dp", "2", "--step", "later"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("ucp: error: ") for line in err)
    assert not (tmp_path / "m").exists()


@pytest.mark.slow
def test_a_zero3_source_keeps_its_gradient_clipping_at_zero2(z3_bf16_dp2, tmp_path):
    """ZeRO-3 records no clip_grad, and DeepSpeed's ZeRO-1/2 loader takes the optim file's over its config:
    a ZeRO-3 -> ZeRO-2 restore writes the clipping the source run had, its config's or (left out, as here)
    DeepSpeed's default for the version that ran it: 1.0 from 0.19.3 on, none before (found by
    tests/test_autoep.py, where 0.0 made the resume stop clipping)."""
    from ucp.deepspeed.states import default_clipping
    from ucp.io.torchfile import load

    out = _restore(z3_bf16_dp2, tmp_path, 2, stage=2)
    tag = next(p for p in out.iterdir() if p.is_dir())
    optim = load(next(tag.glob("*zero_pp_rank_0_*optim_states.pt")))
    assert optim["optimizer_state_dict"]["clip_grad"] == 1.0
    assert (default_clipping("0.19.2"), default_clipping("0.19.3"), default_clipping("0.19.8+cpu")) == (0.0, 1.0, 1.0)
    assert default_clipping(None) == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["z2-bf16-dp3-adamw", "z1-fp32-dp2-adamw"])
def test_restore_without_stage_writes_the_sources_stage_which_its_own_run_loads(source, name, tmp_path, capsys):
    """ucp restore once wrote ZeRO-3 unless told: a ZeRO-1/2 run then failed in DeepSpeed's loader with a bare
    AssertionError. Now the source's stage is kept, and the source's own kind of run loads the output."""
    from ucp.io import torchfile

    built = source(name)
    universal = tmp_path / "u"
    ucp.to_universal(built.path, universal)
    assert cli(["restore", str(universal), str(tmp_path / "n"), "--dp", "2"]) == 0
    assert f"ZeRO-{built.spec.stage} checkpoint" in capsys.readouterr().out
    tag = (tmp_path / "n" / "latest").read_text().strip()
    optim = torchfile.load(sorted((tmp_path / "n" / tag).glob("*optim_states.pt"))[0])["optimizer_state_dict"]
    assert optim["zero_stage"] == built.spec.stage
    after = resume(built, LoadSpec(str(tmp_path / "n")), dp=2, steps=0, name="after", work=tmp_path)
    for param, value in built.record["params"].items():
        assert torch.equal(after["params"][param], value), param
    plan = ucp.write_native(universal, tmp_path / "api", dp=2)  # the API keeps it too
    assert plan.stage == built.spec.stage
