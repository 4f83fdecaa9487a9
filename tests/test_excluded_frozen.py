"""Checkpoints saved with ``exclude_frozen_parameters=True``, as PEFT/LoRA runs save them (Trainer passes it
for a PEFT model): the frozen base weights are not in the files. The restored run takes them from its own
model (the base it starts from) and everything trained from ucp, at a new DP size, through a native
checkpoint (DeepSpeed's ``load_module_strict=False``, as Trainer loads PEFT runs) or the live engine.

The runs are real DeepSpeed runs (bf16, the test model's frozen projection plays the LoRA base).
"""

from __future__ import annotations

import pytest
import torch

import ucp
from tests.support.fixtures import build, resume
from ucp.harness import LoadSpec
from ucp.universal import open_universal


@pytest.fixture(scope="module", params=[3, 2], ids=["zero3", "zero2"])
def excluded(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    built = build(dp=2, stage=request.param, dtype="bf16", optimizer="torch-adamw", exclude_frozen=True)
    universal = tmp_path_factory.mktemp("excluded") / "u"
    ucp.to_universal(built.path, universal)
    return built, universal


@pytest.mark.slow
def test_the_universal_directory_says_the_frozen_weights_were_excluded(excluded):
    built, universal = excluded
    frozen = set(built.record["module"]) - set(built.record["params"]) - set(built.record["tied"])
    assert frozen, "the model has no frozen parameter: the test would prove nothing"
    with open_universal(universal) as reader:
        assert not frozen & {m.name for m in reader.facts.params}
        assert any("exclude_frozen_parameters" in w for w in reader.facts.warnings), reader.facts.warnings


@pytest.mark.slow
@pytest.mark.parametrize("route", ["native", "live"])
def test_a_new_dp_run_keeps_its_base_weights_and_takes_the_trained_state(excluded, route, tmp_path):
    built, universal = excluded
    if route == "native":
        ucp.write_native(universal, tmp_path / "n", dp=3, stage=built.spec.stage)
        load = LoadSpec(str(tmp_path / "n"), strict=False)
    else:
        load = LoadSpec(str(universal), kind="ucp", strict=False)
    after = resume(built, load, dp=3, steps=0, name=route, work=tmp_path)
    record = built.record
    for name, value in record["module"].items():  # trained weights from ucp, the frozen base as the run built it
        assert torch.equal(after["module"][name], value), name
    for key in ("params", "exp_avg", "exp_avg_sq"):
        for name, value in record[key].items():
            assert torch.equal(after[key][name], value), (key, name)
