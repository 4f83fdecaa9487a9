"""fp16 ZeRO-1/2/3 runs with a dynamic loss scale on real DeepSpeed, moved to another DP size.

fp16 trains on any CPU in torch; DeepSpeed 0.19.8 refuses it on CPUs without oneDNN fp16 kernels, a gate the
harness lifts (``ucp.harness.worker._allow_fp16_on_cpu``): the engines, FP16 optimizers and loss scalers are
DeepSpeed's own. Each run starts its scale at 2**20, so its first steps overflow and are skipped: DeepSpeed's
``skipped_steps`` and the optimizer's step disagree, and the scale the run came down to is state to carry.

Checked: the universal directory against the live engine (masters, moments, the applied step, skipped steps);
restored at DP 3 natively and live, every state, the loss scaler and the counters equal the source engine's after
the load; at the same DP, resumed bit-identically to DeepSpeed's own resume (the loss scaler's state included).
"""

from __future__ import annotations

import pytest

import ucp
from tests.support.checks import (
    assert_adam_universal_matches_record,
    assert_every_state_equals_record,
    assert_same_training,
)
from tests.support.fixtures import build, resume, universals_of
from ucp.harness import LoadSpec

#: the scale starts far above what the gradients fit under, then halves on each overflow; 12 steps leave 7 applied
_FP16 = dict(dtype="fp16", dp=2, steps=12, loss_scale_power=20)
SOURCES = {f"z{stage}": dict(stage=stage, **_FP16) for stage in (1, 2, 3)}


@pytest.fixture(scope="module")
def universal(tmp_path_factory):
    return universals_of(SOURCES, tmp_path_factory.mktemp("fp16"))


@pytest.mark.parametrize("name", SOURCES)
def test_an_fp16_run_reaches_the_universal_directory_bit_exact(universal, name):
    built = build(**SOURCES[name])
    record = built.record
    assert 0 < record["counters"]["skipped_steps"] < built.spec.steps, "no overflow: the test proves nothing"
    assert_adam_universal_matches_record(universal(name), record)


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


@pytest.mark.parametrize("name", SOURCES)
def test_same_dp_restore_resumes_bit_identically_to_deepspeeds_own_resume(universal, name, tmp_path):
    built = build(**SOURCES[name])
    ucp.write_native(universal(name), tmp_path / "n", dp=2, stage=built.spec.stage)
    reference = resume(built, LoadSpec(str(built.path)), name="native", work=tmp_path)
    assert_same_training(reference, resume(built, LoadSpec(str(tmp_path / "n")), name="ucp", work=tmp_path))
    live = LoadSpec(str(universal(name)), kind="ucp")
    assert_same_training(reference, resume(built, live, name="live", work=tmp_path))
