"""fp16 ZeRO-1/2/3 runs with a dynamic loss scale on real DeepSpeed, moved to another DP size.

fp16 trains on any CPU in torch; DeepSpeed 0.19.8 refuses it on CPUs without oneDNN fp16 kernels, a gate the
harness lifts (``ucp.harness.worker._allow_fp16_on_cpu``): the engines, FP16 optimizers and loss scalers are
DeepSpeed's own. Each run starts its scale at 2**20, so its first steps overflow and are skipped: DeepSpeed's
``skipped_steps`` and the optimizer's step disagree, and the scale the run came down to is state to carry.

Checked: the universal directory against the live engine (masters, moments, the applied step, skipped steps);
restored at DP 3 natively and live, every state, the loss scaler and the counters equal the source engine's after
the load; at the same DP, resumed bit-identically to DeepSpeed's own resume (the loss scaler's state included).

Without ZeRO (stage 0) DeepSpeed's FP16 wrappers keep the scale in their own fields and no hysteresis: such runs
(FP16_UnfusedOptimizer around torch AdamW, the fused FP16_Optimizer around DeepSpeed's FusedAdam) are read and
resumed bit-identically, natively and live; moved to ZeRO their scaler takes its minimum and hysteresis from the
run's config, and a ZeRO run moved to stage 0 keeps its scale and counters. A run that becomes fp16 gets a dynamic
scale (a bf16 run's static scale of 1 would switch scaling off).
"""

from __future__ import annotations

import json

import pytest

import ucp
from tests.support.checks import (
    assert_adam_universal_matches_record,
    assert_every_state_equals_record,
    assert_same_training,
)
from tests.support.fixtures import build, resume, universals_of
from ucp.cli import main as cli
from ucp.harness import LoadSpec

#: the scale starts far above what the gradients fit under, then halves on each overflow; 12 steps leave 7 applied
_FP16 = dict(dtype="fp16", dp=2, steps=12, loss_scale_power=20)
SOURCES = {f"z{stage}": dict(stage=stage, **_FP16) for stage in (1, 2, 3)}
#: without ZeRO: FP16_UnfusedOptimizer around torch AdamW, the fused FP16_Optimizer around DeepSpeed's FusedAdam
STAGE0 = {
    "z0-unfused": dict(stage=0, optimizer="torch-adamw", **_FP16),
    "z0-fused": dict(stage=0, optimizer="ds-fused-adam", **_FP16),
}
#: the wrapper fields a stage-0 run's scale is saved and loaded as
_WRAPPER = ("dynamic_loss_scale", "cur_scale", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window")


@pytest.fixture(scope="module")
def universal(tmp_path_factory):
    return universals_of({**SOURCES, **STAGE0}, tmp_path_factory.mktemp("fp16"))


@pytest.mark.slow
@pytest.mark.parametrize("name", SOURCES)
def test_an_fp16_run_reaches_the_universal_directory_bit_exact(universal, name):
    built = build(**SOURCES[name])
    record = built.record
    assert 0 < record["counters"]["skipped_steps"] < built.spec.steps, "no overflow: the test proves nothing"
    assert_adam_universal_matches_record(universal(name), record)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["native", "ucp"])
@pytest.mark.parametrize("name", SOURCES)
def test_restore_at_a_new_dp_keeps_every_state_and_the_loss_scale(universal, name, kind, tmp_path):
    built = build(**SOURCES[name])
    path = universal(name)
    if kind == "native":
        path = tmp_path / "n"
        ucp.write_native(universal(name), path, dp=3, stage=built.spec.stage)
    after = resume(built, LoadSpec(str(path), kind=kind), dp=3, steps=0, name="after", work=tmp_path)
    record = built.record
    assert_every_state_equals_record(after, record)
    assert after["loss_scaler"] == record["loss_scaler"] and after["counters"] == record["counters"]
    assert record["loss_scaler"]["cur_scale"] < 2.0 ** _FP16["loss_scale_power"]  # the scale the run came down to


@pytest.mark.slow
@pytest.mark.parametrize("name", SOURCES)
def test_same_dp_restore_resumes_bit_identically_to_deepspeeds_own_resume(universal, name, tmp_path):
    built = build(**SOURCES[name])
    ucp.write_native(universal(name), tmp_path / "n", dp=2, stage=built.spec.stage)
    reference = resume(built, LoadSpec(str(built.path)), name="native", work=tmp_path)
    assert_same_training(reference, resume(built, LoadSpec(str(tmp_path / "n")), name="ucp", work=tmp_path))
    live = LoadSpec(str(universal(name)), kind="ucp")
    assert_same_training(reference, resume(built, live, name="live", work=tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("name", STAGE0)
def test_a_run_without_zero_is_read_and_resumed_bit_identically(universal, name, tmp_path):
    built = build(**STAGE0[name])
    assert_adam_universal_matches_record(universal(name), built.record, built_steps=1)  # the wrapper's first step
    ucp.write_native(universal(name), tmp_path / "n", dp=3, stage=0)
    reference = resume(built, LoadSpec(str(built.path)), name="native", work=tmp_path)
    assert reference["loss_scaler"]["dynamic_loss_scale"], "a static scale: the test proves nothing"
    for path, kind in ((tmp_path / "n", "native"), (universal(name), "ucp")):  # every DP size loads a stage-0 file
        assert_same_training(reference, resume(built, LoadSpec(str(path), kind=kind), name=kind, work=tmp_path))


@pytest.mark.slow
def test_a_run_without_zero_moves_to_zero_with_its_scale(universal, tmp_path):
    built = build(**STAGE0["z0-unfused"])
    ucp.write_native(universal("z0-unfused"), tmp_path / "n", dp=3, stage=2)
    after = resume(built, LoadSpec(str(tmp_path / "n")), dp=3, steps=0, name="after", work=tmp_path, stage=2)
    assert_every_state_equals_record(after, built.record)
    source = built.record["loss_scaler"]
    scaler = after["loss_scaler"]
    assert scaler["dynamic"] and all(scaler[k] == source[k] for k in _WRAPPER[1:]), (scaler, source)
    # what the wrapper keeps no copy of comes from the run's config (the harness's hysteresis 1, minimum 1)
    assert (scaler["delayed_shift"], scaler["cur_hysteresis"], scaler["min_scale"]) == (1, 1, 1)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["native", "ucp"])
def test_a_zero_run_moves_to_stage_0_with_its_scale(universal, kind, tmp_path, capsys):
    built = build(**SOURCES["z2"])
    path = universal("z2")
    if kind == "native":
        path = tmp_path / "n"
        assert cli(["restore", str(universal("z2")), str(path), "--dp", "3", "--stage", "0"]) == 0
        assert "keep no loss-scale hysteresis" in capsys.readouterr().err
    after = resume(built, LoadSpec(str(path), kind=kind), dp=3, steps=0, name="after", work=tmp_path, stage=0)
    assert_every_state_equals_record(after, built.record)
    source, scaler = built.record["loss_scaler"], after["loss_scaler"]
    assert scaler["dynamic_loss_scale"] and all(scaler[k] == source[k] for k in _WRAPPER[1:]), (scaler, source)


@pytest.mark.slow
def test_a_run_that_becomes_fp16_scales_its_loss(tmp_path, capsys):
    """A bf16 run saves a static scale of 1, which DeepSpeed's load puts in place of an fp16 run's own scaler:
    written for fp16, ucp gives it the dynamic scale an fp16 config starts (the source's fp16 block, or
    DeepSpeed's defaults); restored live, the engine keeps its own. An fp16 run restored into a bf16 engine leaves
    its static scale alone."""
    built = build(dp=2, stage=2, dtype="bf16")
    assert cli(["reshard", str(built.path), str(tmp_path / "n"), "--dp", "2", "--dtype", "fp16"]) == 0
    assert "loss scaler starts dynamic from 2**16 (window 1000, hysteresis 2, minimum 1)" in capsys.readouterr().err
    load = LoadSpec(str(tmp_path / "n"))
    native = resume(built, load, steps=0, name="native", work=tmp_path, dtype="fp16")
    assert native["loss_scaler"]["dynamic"] and native["loss_scaler"]["cur_scale"] == 2.0**16
    live = resume(
        built,
        LoadSpec(str(built.path), kind="ucp"),
        steps=0,
        name="live",
        work=tmp_path,
        dtype="fp16",
        loss_scale_power=12,
    )
    assert live["loss_scaler"]["dynamic"] and live["loss_scaler"]["cur_scale"] == 2.0**12  # the engine's config's
    fp16 = build(**SOURCES["z2"])
    into_bf16 = resume(fp16, LoadSpec(str(fp16.path), kind="ucp"), steps=0, name="bf16", work=tmp_path, dtype="bf16")
    assert into_bf16["loss_scaler"] == {"cur_scale": 1.0, "dynamic": False}


@pytest.mark.slow
def test_the_loss_scale_crosses_a_dcp_folder_and_back(universal, tmp_path):
    """DCP keeps no loss scaler: ucp's DCP folder keeps it in train_state, says so, and reads it back."""
    built = build(**SOURCES["z2"])
    notes = " ".join(ucp.write_dcp(universal("z2"), tmp_path / "dcp").notes)
    assert "dynamic loss scale of 32768: DCP keeps no loss scaler; train_state.loss_scale holds it" in notes
    ucp.write_native(tmp_path / "dcp", tmp_path / "n", dp=3, stage=2)
    after = resume(built, LoadSpec(str(tmp_path / "n")), dp=3, steps=0, name="after", work=tmp_path)
    assert after["loss_scaler"] == built.record["loss_scaler"]
    assert_every_state_equals_record(after, built.record)


@pytest.mark.slow
def test_inspect_shows_the_loss_scale(tmp_path, capsys):
    built = build(**SOURCES["z2"])
    assert cli(["inspect", str(built.path)]) == 0
    line = (
        "loss scale dynamic, now 32768 (window 1000, hysteresis 1 of 1 left, minimum 1, last overflow at iteration 4)"
    )
    assert line in capsys.readouterr().out
    assert cli(["inspect", str(build(**STAGE0["z0-unfused"]).path), "--json"]) == 0
    scale = json.loads(capsys.readouterr().out)["loss_scale"]
    assert scale["dynamic"] and scale["cur_scale"] == 2**20 and scale["last_overflow_iter"] == -1
