"""Low-precision masters (DeepSpeed's ``bf16_master_weights_and_grads``, ``fp16_master_weights_and_grads``) on real
DeepSpeed runs: bf16 at ZeRO-1/2/3, fp16 at ZeRO-2 (the one stage DeepSpeed allows it at, with CPU Adam under
ZeRO-Offload; an fp16 run with a dynamic loss scale and skipped steps).

Two real set-ups: CPU Adam under ZeRO-Offload keeps fp32 moments for its bf16 masters (``fp32_optimizer_states``,
DeepSpeed's only way to run bf16 masters without ``bf16_optimizer_states``), and torch AdamW with
``bf16_optimizer_states`` keeps bf16 moments. The optim files then hold bf16 (fp16) flat masters. Read exactly; written back
at the same size they resume bit-identically to DeepSpeed's own resume, and at another size they load what
DeepSpeed's own load holds. DeepSpeed 0.19.8's own load casts CPU Adam's fp32 moments to the masters' dtype (torch's
``load_state_dict`` casts state to the parameter's dtype), so its resume drifts from the uninterrupted run;
``ucp.restore`` into the live engine keeps them fp32 and resumes bit-identically to it.
"""

from __future__ import annotations

import pytest
import torch

import ucp
from tests.support.checks import assert_every_state_equals_record, assert_reader_holds_every_state, assert_same_training
from tests.support.fixtures import Built, build, resume, universals_of
from ucp.cli import main as cli
from ucp.harness import LoadSpec
from ucp.model.detect import LowPrecisionMasters, low_precision_masters
from ucp.universal import open_universal

_CPU_ADAM = dict(dtype="bf16", master="bf16", optimizer="ds-cpu-adam", offload=True)
_BF16_STATES = dict(dtype="bf16", master="bf16-states", optimizer="torch-adamw")
_FP16 = dict(dtype="fp16", master="fp16", optimizer="ds-cpu-adam", offload=True, steps=12, loss_scale_power=20)
SOURCES = {
    "z2-cpu-adam": dict(dp=2, stage=2, **_CPU_ADAM),
    "z3-cpu-adam": dict(dp=2, stage=3, **_CPU_ADAM),
    "z2-fp16-cpu-adam": dict(dp=2, stage=2, **_FP16),
    "z1-bf16-states": dict(dp=2, stage=1, **_BF16_STATES),
    "z3-bf16-states": dict(dp=2, stage=3, **_BF16_STATES),
}
CPU_ADAM = ["z2-cpu-adam", "z3-cpu-adam", "z2-fp16-cpu-adam"]


@pytest.fixture(scope="module")
def universal(tmp_path_factory):
    return universals_of(SOURCES, tmp_path_factory.mktemp("universal"))


def _files_hold_low_precision_masters(built: Built) -> bool:
    """The optim files really hold the run's bf16 or fp16 masters (the run is what the test says it is)."""
    from ucp.io import torchfile

    first = sorted(built.tag_dir.glob("*optim_states.pt"))[0]
    block = torchfile.load(first)["optimizer_state_dict"]
    masters = block.get("single_partition_of_fp32_groups") or block.get("fp32_flat_groups")
    return all(t.dtype == _dtype(built) for t in masters)


def _dtype(built: Built) -> torch.dtype:
    return torch.float16 if built.spec.dtype == "fp16" else torch.bfloat16


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SOURCES))
def test_low_precision_masters_and_every_moment_reach_the_universal_directory_bit_exact(universal, name):
    built = build(**SOURCES[name])
    assert _files_hold_low_precision_masters(built)
    record = built.record
    assert record["state"], "the run kept no optimizer state"
    if built.spec.dtype == "fp16":  # overflows skipped steps: the step counters disagree
        assert 0 < record["counters"]["skipped_steps"] < built.spec.steps, record["counters"]
    with open_universal(universal(name)) as reader:
        assert_reader_holds_every_state(reader, record)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SOURCES))
def test_same_dp_restore_resumes_bit_identically_to_deepspeeds_own_resume(universal, name, tmp_path):
    built = build(**SOURCES[name])
    ucp.write_native(universal(name), tmp_path / "n", dp=2, stage=built.spec.stage)
    reference = resume(built, LoadSpec(str(built.path)), name="native", work=tmp_path)
    ours = resume(built, LoadSpec(str(tmp_path / "n")), name="ucp", work=tmp_path)
    assert_same_training(reference, ours)


@pytest.mark.slow
@pytest.mark.parametrize("through", ["universal", "reshard"])
@pytest.mark.parametrize("name", ["z2-cpu-adam", "z3-bf16-states", "z2-fp16-cpu-adam"])
def test_a_new_dp_loads_what_deepspeeds_own_load_of_the_source_holds(universal, name, through, tmp_path):
    built = build(**SOURCES[name])
    if through == "universal":
        ucp.write_native(universal(name), tmp_path / "n", dp=3, stage=built.spec.stage)
    else:  # straight from the rank files, no universal copy
        assert cli(["reshard", str(built.path), str(tmp_path / "n"), "--dp", "3"]) == 0
    native = resume(built, LoadSpec(str(built.path)), steps=0, name="native", work=tmp_path)
    ours = resume(built, LoadSpec(str(tmp_path / "n")), dp=3, steps=0, name="ucp", work=tmp_path)
    assert_every_state_equals_record(ours, native)


@pytest.mark.slow
@pytest.mark.parametrize("name", CPU_ADAM)
def test_live_restore_keeps_cpu_adams_fp32_moments_where_deepspeeds_load_cuts_them(universal, name, tmp_path):
    built = build(**SOURCES[name])
    record = built.record
    for dp in (2, 3):
        after = resume(
            built, LoadSpec(str(universal(name)), kind="ucp"), dp=dp, steps=0, name=f"live{dp}", work=tmp_path
        )
        assert_every_state_equals_record(after, record)
    native = resume(built, LoadSpec(str(built.path)), steps=0, name="native", work=tmp_path)
    # pinned: DeepSpeed 0.19.8's own load holds the moments cut to the masters' dtype
    cut = {p: v.to(_dtype(built)).float() for p, v in record["state"]["exp_avg_sq"].items()}
    assert all(torch.equal(native["state"]["exp_avg_sq"][p], v) for p, v in cut.items())
    assert any(not torch.equal(v, record["state"]["exp_avg_sq"][p]) for p, v in cut.items())


@pytest.mark.slow
@pytest.mark.parametrize("name", CPU_ADAM)
def test_live_restore_resumes_like_the_uninterrupted_run_bit_for_bit(universal, name, tmp_path):
    built = build(**SOURCES[name])
    steps = built.spec.steps
    whole = build(**{**SOURCES[name], "steps": steps + 3}).record
    ours = resume(built, LoadSpec(str(universal(name)), kind="ucp"), name="live", work=tmp_path)
    assert_same_training({**whole, "losses": whole["losses"][steps:]}, ours)
    # DeepSpeed's own resume steps on moments cut to the masters' dtype and leaves the uninterrupted run
    native = resume(built, LoadSpec(str(built.path)), name="native", work=tmp_path)
    assert any(not torch.equal(v, native["params"][p]) for p, v in whole["params"].items())


@pytest.mark.slow
def test_inspect_and_restore_say_the_source_kept_bf16_masters(universal, tmp_path, capsys):
    built = build(**SOURCES["z2-cpu-adam"])
    assert cli(["inspect", str(built.path)]) == 0
    assert "masters bf16 (bf16_master_weights_and_grads), optimizer state fp32" in capsys.readouterr().out
    assert cli(["inspect", str(universal("z3-bf16-states")), "--json"]) == 0
    assert '"state": "bf16"' in capsys.readouterr().out
    assert cli(["restore", str(universal("z2-cpu-adam")), str(tmp_path / "n"), "--dp", "3", "--stage", "2"]) == 0
    err = capsys.readouterr().err
    assert "casts the moments to bf16" in err and "ucp.restore(engine" in err


@pytest.mark.parametrize(
    "config, expected",
    [
        ({}, None),
        ({"bf16": {"enabled": True}}, None),
        ({"bf16": {"enabled": False, "bf16_master_weights_and_grads": True}}, None),
        (
            {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}},
            LowPrecisionMasters("bf16", "fp32", "bf16_master_weights_and_grads"),
        ),
        (
            {"bfloat16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}},
            LowPrecisionMasters("bf16", "bf16", "bf16_master_weights_and_grads"),
        ),
        (
            {"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}},
            LowPrecisionMasters("fp16", "fp32", "fp16_master_weights_and_grads"),
        ),
        ({"bf16": "yes"}, None),
    ],
)
def test_low_precision_masters_reads_deepspeeds_config(config, expected):
    assert low_precision_masters(config) == expected
