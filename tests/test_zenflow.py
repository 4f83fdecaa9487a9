"""DeepSpeed ZenFlow runs (``zero_optimization.zenflow``: ZeRO-2, the optimizer offloaded to CPU, its CPU Adam from
the config), real ones on CPU/gloo ranks.

ZenFlow's selective optimizer updates the top columns of each matrix (and each vector whole) every step on the
bf16 weights; its fp32 masters catch up only at the next selection. The saved masters are stale there, the module's
weights are the run's model: ucp takes the weight where it is not its master's rounding (``ucp.model.zenflow``).
Restored from the masters alone the run steps back (first loss 8.006 against 7.834, DP 2). DeepSpeed itself does
not save the selective optimizer's moments, and its columns depend on the partitioning, so ZenFlow runs at two DP
sizes part after the first step (measured from scratch: 9.185 at DP 2, 9.183 at DP 1, 9.178 at DP 3): a resume at
another DP starts from the same model and moments, not the same later losses. ``overlap_step`` (an optimizer
process of its own) cannot start on CPU/gloo ranks, and ZenFlow at ZeRO-3 needs CUDA: neither is run here.
"""

from __future__ import annotations

import pytest
import torch

import ucp
from tests.support.fixtures import build, resume
from ucp.harness import LoadSpec
from ucp.model.zenflow import ZENFLOW_NOTE
from ucp.universal import open_universal

RUN = dict(dp=2, stage=2, dtype="bf16", optimizer="ds-cpu-adam", offload=True, zenflow=2, steps=4)


@pytest.fixture(scope="module")
def universal(tmp_path_factory):
    out = tmp_path_factory.mktemp("zenflow") / "u"
    ucp.to_universal(build(**RUN).path, out)
    return out


def _newer_weights(record) -> int:
    """How many values the live weights hold that are not their master's rounding (the run is what the test says)."""
    return sum(int((v.bfloat16() != record["module"][n]).sum()) for n, v in record["params"].items())


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_the_master_is_the_weight_where_zenflow_updated_the_weight_and_every_moment_is_kept(universal, stage, tmp_path):
    built = build(**{**RUN, "stage": stage})
    record = built.record
    assert record["module"]["blocks.0.0.weight"].dtype == torch.bfloat16
    assert _newer_weights(record) > 0
    if stage != RUN["stage"]:
        universal = tmp_path / "u"
        ucp.to_universal(built.path, universal)
    with open_universal(universal) as reader:
        assert ZENFLOW_NOTE in reader.facts.warnings
        assert {m.name for m in reader.facts.params if not m.frozen} == set(record["params"])
        for name, master in record["params"].items():
            state = reader.read(name)
            weight = record["module"][name]
            # the model the run computed with, exactly
            assert torch.equal(state.fp32.bfloat16(), weight), name
            agrees = master.bfloat16() == weight
            assert torch.equal(state.fp32[agrees], master[agrees]), name  # the master's fp32 bits where it is current
            assert torch.equal(state.fp32[~agrees], weight[~agrees].float()), name
            assert set(state.optim) == {k for k, per in record["state"].items() if name in per}, name
            for key in state.optim:
                assert torch.equal(state.optim[key], record["state"][key][name].float()), (name, key)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["live", "native"])
def test_same_dp_restore_loads_deepspeeds_own_weights_and_moments_and_takes_its_first_step(universal, how, tmp_path):
    built = build(**RUN)
    record = built.record
    if how == "live":
        load = LoadSpec(str(universal), kind="ucp")
    else:
        ucp.write_native(universal, tmp_path / "n", dp=2, stage=2)
        load = LoadSpec(str(tmp_path / "n"))
    own = LoadSpec(str(built.path))
    native = resume(built, own, steps=0, name="native", work=tmp_path)
    ours = resume(built, load, steps=0, name=how, work=tmp_path)
    with open_universal(universal) as reader:
        for name in record["params"]:
            assert torch.equal(ours["module"][name], native["module"][name]), name
            for key, per in native["state"].items():
                assert torch.equal(ours["state"][key][name], per[name]), (key, name)
            assert torch.equal(ours["params"][name], reader.read(name, moments=False).fp32), name
            # pinned: DeepSpeed's own load keeps the stale masters
            assert torch.equal(native["params"][name], record["params"][name]), name
    # the first step is DeepSpeed's own and the uninterrupted run's; later ones part from DeepSpeed's resume, which
    # keeps the stale masters (its restarted step counter skips the sync a new selection makes)
    theirs = resume(built, own, steps=1, name="native-step", work=tmp_path)["losses"]
    first = resume(built, load, steps=1, name=f"{how}-step", work=tmp_path)["losses"]
    whole = build(**{**RUN, "steps": RUN["steps"] + 1}).record
    assert first == theirs == whole["losses"][-1:]


@pytest.mark.slow
@pytest.mark.parametrize("dp", [1, 3])
def test_a_new_dp_starts_from_the_runs_weights_and_moments(universal, dp, tmp_path):
    built = build(**RUN)
    record = built.record
    ucp.write_native(universal, tmp_path / "n", dp=dp, stage=2)
    after = resume(built, LoadSpec(str(tmp_path / "n")), dp=dp, steps=0, name="load", work=tmp_path)
    for name in record["params"]:
        assert torch.equal(after["module"][name], record["module"][name]), name
        for key, per in record["state"].items():
            assert torch.equal(after["state"][key][name], per[name]), (key, name)
    with open_universal(universal) as reader:
        assert all(torch.equal(after["params"][n], reader.read(n, moments=False).fp32) for n in record["params"])
    first = resume(built, LoadSpec(str(tmp_path / "n")), dp=dp, steps=1, name="step", work=tmp_path)["losses"][0]
    whole = build(**{**RUN, "steps": RUN["steps"] + 1}).record
    assert abs(first - whole["losses"][-1]) < 1e-6
