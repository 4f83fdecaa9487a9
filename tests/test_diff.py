"""``ucp diff`` on real DeepSpeed checkpoints: equal across formats and DP sizes, and every kind of difference
named (a parameter's reset moments, steps, group settings, names on one side only)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import ucp
from ucp.cli import main as cli
from ucp.ops.diff import diff


@pytest.fixture(scope="module")
def restored(z3_bf16_dp2, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoint written anew at DP=3 (straight from the DeepSpeed files)."""
    out = tmp_path_factory.mktemp("diff") / "dp3"
    ucp.write_native(z3_bf16_dp2.path, out, dp=3)
    return out


def test_a_checkpoint_equals_its_universal_directory_and_its_restore_at_another_dp(
    z3_bf16_dp2, universals, restored, capsys
):
    assert cli(["diff", str(z3_bf16_dp2.path), str(universals("z3-bf16-dp2-adamw"))]) == 0
    assert capsys.readouterr().out.strip().endswith("bit for bit")
    assert cli(["diff", str(universals("z3-bf16-dp2-adamw")), str(restored), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["equal"] and report["params_compared"] == len(z3_bf16_dp2.record["module"])


def test_one_parameter_reset_by_a_migration_is_the_only_difference(z3_bf16_dp2, tmp_path, capsys):
    config = tmp_path / "reset.yaml"
    config.write_text(
        f"source: {z3_bf16_dp2.path}\nuniversal: {tmp_path / 'u'}\n"
        "transforms:\n  - reset_optimizer:\n      params: ['^norm[.]weight$']\n      step: keep\n"
    )
    assert cli(["migrate", str(config)]) == 0
    capsys.readouterr()
    report = diff(z3_bf16_dp2.path, tmp_path / "u")
    assert not report.equal
    assert [p.name for p in report.differing] == ["norm.weight"]
    changed = {t.key for t in report.differing[0].tensors if not t.within(0.0)}
    assert changed == {"exp_avg", "exp_avg_sq"}, report.differing[0]
    assert cli(["diff", str(z3_bf16_dp2.path), str(tmp_path / "u")]) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("norm.weight: exp_avg max abs") and "differ" in out.splitlines()[-1]


def test_steps_settings_and_names_that_differ_are_each_named(z3_bf16_dp2, z3_fp32_dp3, source, tmp_path):
    stepped = tmp_path / "step7"
    ucp.write_native(z3_bf16_dp2.path, stepped, dp=2, step=7)
    report = diff(z3_bf16_dp2.path, stepped)
    assert {p.steps for p in report.differing} == {(3, 7)}  # every trained parameter, no frozen one
    assert {p.name for p in report.differing} == set(z3_bf16_dp2.record["params"])

    other = diff(z3_bf16_dp2.path, z3_fp32_dp3.path, atol=1e9)  # another run of the model, another schedule
    assert not other.equal and not other.differing
    assert any("lr" in line for line in other.groups) and any("weight_decay" in line for line in other.groups)

    glu = diff(z3_bf16_dp2.path, source("tp2-z1-bf16-dp2-glu").path)  # another model, saved with TP=2
    assert "blocks.0.0.weight" in glu.only_a and "blocks.0.up.weight" in glu.only_b, (glu.only_a, glu.only_b)
    assert glu.counters["global_samples"] == (36, 72)  # engine counters too


def test_bad_input_is_one_line_with_exit_2(z3_bf16_dp2, tmp_path, capsys):
    assert cli(["diff", str(z3_bf16_dp2.path), str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ucp: error:") and len(err.splitlines()) == 1
