"""ZeRO-1/2 runs with ``zero_optimization.round_robin_gradients`` on real DeepSpeed.

The option flattens each param group's members in round-robin order over the DP ranks, so the flat
layout changes with the DP size. DeepSpeed 0.19.8 maps the fragments (``param_slice_mappings``,
``safe_get_full_fp32_param``, ds_to_universal) walking the members in their original order: those give
other parameters' bytes. The harness records such runs from the flat buffers themselves (checked here
against the module's fp32 weights). ucp reads the flat buffers in param_shapes' order, gives the groups
their original order, writes the new run's round-robin order for its DP size, and refuses what
ds_to_universal made of such a run.
"""

from __future__ import annotations

import json

import pytest
import torch

import ucp
from tests.support.checks import assert_reader_holds_every_state, assert_same_training, assert_state_equals_record
from tests.support.ds_convert import ds_to_universal
from tests.support.fixtures import build, resume, universals_of
from ucp.cli import main as cli
from ucp.errors import ConfigError, InputError
from ucp.harness import LoadSpec
from ucp.model.partition import round_robin_order
from ucp.sources import open_reader
from ucp.universal import open_universal

SOURCES = {
    "z2-bf16-dp2": dict(dp=2, stage=2, dtype="bf16", round_robin=True),
    "z1-fp32-dp3": dict(dp=3, stage=1, dtype="fp32", round_robin=True),
}


@pytest.fixture(scope="module")
def universal(tmp_path_factory):
    return universals_of(SOURCES, tmp_path_factory.mktemp("round-robin"))


def test_round_robin_order_is_deepspeeds():
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    for dp in range(1, 6):
        for count in range(10):
            members = [f"p{i}" for i in range(count)]
            theirs, _ = DeepSpeedZeroOptimizer._round_robin_reorder(None, members, dp)
            assert [members[i] for i in round_robin_order(count, dp)] == theirs, (count, dp)


@pytest.mark.slow
def test_the_record_is_the_module_and_deepspeeds_own_mapping_is_not():
    """An fp32 run's module weights are its masters: the harness's record equals them, DeepSpeed's
    safe_get_full_fp32_param does not (0.19.8; pinned so the record's detour stays needed)."""
    record = build(**SOURCES["z1-fp32-dp3"]).record
    assert all(torch.equal(value, record["module"][name]) for name, value in record["params"].items())
    theirs = record["deepspeed_fp32"]
    assert any(not torch.equal(value, record["module"][name]) for name, value in theirs.items())


@pytest.mark.slow
@pytest.mark.parametrize("name", SOURCES)
def test_every_state_reaches_the_universal_directory_bit_exact(universal, name):
    record = build(**SOURCES[name]).record
    with open_universal(universal(name)) as reader:
        assert_reader_holds_every_state(reader, record)
        for group in reader.facts.groups:  # the original order (the model's), not the flat buffer's
            assert group.params == [n for n in record["names"] if n in set(group.params)]


CASES = [  # source, new dp, round_robin_gradients of the new run, how it is loaded
    ("z2-bf16-dp2", 3, True, "native"),
    ("z2-bf16-dp2", 3, True, "ucp"),
    ("z2-bf16-dp2", 2, False, "native"),
    ("z1-fp32-dp3", 2, True, "native"),
    ("z1-fp32-dp3", 4, False, "ucp"),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, dp, round_robin, kind", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_restore_at_a_new_dp_loads_every_state_bit_exact(universal, tmp_path, name, dp, round_robin, kind):
    built = build(**SOURCES[name])
    path = universal(name)
    if kind == "native":
        path = tmp_path / "n"
        stage = SOURCES[name]["stage"]
        ucp.write_native(universal(name), path, dp=dp, stage=stage, round_robin_gradients=round_robin)
    load = LoadSpec(str(path), kind=kind)
    after = resume(built, load, dp=dp, steps=0, name="after", work=tmp_path, round_robin=round_robin)
    assert_state_equals_record(after, built.record, steps=3)


@pytest.mark.slow
def test_same_dp_restore_resumes_bit_identically_to_deepspeeds_own_resume(universal, tmp_path):
    built = build(**SOURCES["z2-bf16-dp2"])
    ucp.write_native(universal("z2-bf16-dp2"), tmp_path / "n", dp=2, stage=2)
    reference = resume(built, LoadSpec(str(built.path)), name="native", work=tmp_path)
    assert_same_training(reference, resume(built, LoadSpec(str(tmp_path / "n")), name="ucp", work=tmp_path))
    live = LoadSpec(str(universal("z2-bf16-dp2")), kind="ucp")
    assert_same_training(reference, resume(built, live, name="live", work=tmp_path))


@pytest.mark.slow
def test_reshard_writes_the_new_dps_round_robin_order(tmp_path):
    built = build(**SOURCES["z2-bf16-dp2"])
    ucp.reshard(built.path, tmp_path / "n", dp=3)
    after = resume(built, LoadSpec(str(tmp_path / "n")), dp=3, steps=0, name="after", work=tmp_path)
    assert_state_equals_record(after, built.record, steps=3)


@pytest.mark.slow
def test_a_plain_run_restores_into_a_round_robin_one(tmp_path):
    built = build(dp=2, stage=2, dtype="bf16")
    ucp.reshard(built.path, tmp_path / "n", dp=3, round_robin_gradients=True)
    after = resume(built, LoadSpec(str(tmp_path / "n")), dp=3, steps=0, name="after", work=tmp_path, round_robin=True)
    assert_state_equals_record(after, built.record, steps=3)


@pytest.mark.slow
def test_ucp_reads_its_own_round_robin_files(universal, tmp_path):
    """ucp writes the true param_slice_mappings (DeepSpeed's name other bytes); both read alike."""
    source = universal("z1-fp32-dp3")
    ucp.write_native(source, tmp_path / "n", dp=2, stage=1)
    with open_universal(source) as want, open_reader(tmp_path / "n") as got:
        assert [g.params for g in got.facts.groups] == [g.params for g in want.facts.groups]
        for meta in want.facts.params:
            a, b = want.read(meta.name), got.read(meta.name)
            assert torch.equal(a.fp32, b.fp32) and a.optim.keys() == b.optim.keys(), meta.name
            assert all(torch.equal(a.optim[k], b.optim[k]) for k in a.optim), meta.name


@pytest.mark.slow
def test_deepspeeds_universal_folder_of_a_round_robin_run_is_refused(tmp_path):
    """ds_to_universal cuts such a run at its wrong mappings: parameters get other parameters' bytes."""
    built = build(**SOURCES["z2-bf16-dp2"])
    tag = next(p for p in built.path.iterdir() if p.is_dir())
    done = ds_to_universal(tag, tmp_path / "ds")
    assert done.returncode == 0, done.stderr[-2000:]
    wrong = torch.load(tmp_path / "ds" / "zero" / "blocks.0.0.weight" / "fp32.pt", weights_only=False)
    assert not torch.equal(
        wrong["param"] if isinstance(wrong, dict) else wrong, built.record["params"]["blocks.0.0.weight"]
    )
    with pytest.raises(InputError, match="round_robin_gradients"):
        ucp.to_universal(tmp_path / "ds", tmp_path / "u")
    assert not (tmp_path / "u").exists()


@pytest.mark.slow
def test_round_robin_is_refused_for_other_stages(universal, tmp_path):
    with pytest.raises(ConfigError, match="round_robin_gradients applies to ZeRO-1/2, not ZeRO-3"):
        ucp.write_native(universal("z2-bf16-dp2"), tmp_path / "n", dp=2, stage=3, round_robin_gradients=True)
    assert not (tmp_path / "n").exists()


@pytest.mark.slow
def test_the_cli_and_the_migration_yaml_say_and_set_it(universal, tmp_path, capsys):
    source = universal("z2-bf16-dp2")
    assert cli(["inspect", str(source), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["round_robin_gradients"] is True
    assert cli(["restore", str(source), str(tmp_path / "kept"), "--dp", "3"]) == 0
    assert "the new run must set it too" in capsys.readouterr().err
    plan = tmp_path / "move.yaml"
    plan.write_text(f"source: {source}\ntarget: {{dp: 3, round_robin_gradients: false, output: {tmp_path / 'off'}}}\n")
    assert cli(["migrate", str(plan)]) == 0
    capsys.readouterr()
    for out, want in (("kept", True), ("off", False)):
        assert cli(["inspect", str(tmp_path / out), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["round_robin_gradients"] is want, out
    with open_reader(tmp_path / "kept") as kept, open_reader(tmp_path / "off") as off:
        assert [g.params for g in kept.facts.groups] == [g.params for g in off.facts.groups]
        for meta in kept.facts.params:
            assert torch.equal(kept.read(meta.name).fp32, off.read(meta.name).fp32), meta.name
    assert (
        cli(["restore", str(source), str(tmp_path / "z3"), "--dp", "2", "--stage", "3", "--round-robin-gradients"]) == 2
    )
    assert "applies to ZeRO-1/2" in capsys.readouterr().err
