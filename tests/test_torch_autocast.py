"""DeepSpeed's ``torch_autocast`` (0.16+): the model stays fp32 and torch autocast computes in bf16, so ZeRO
partitions fp32 parameters and keeps no separate low-precision copy. Real runs at ZeRO-1 and ZeRO-3 read
bit-exact, load at another DP bit for bit, and resume at their own DP bit-identically to DeepSpeed's own resume
(at another DP the bf16 compute follows the new batch split: 4e-3 apart after 3 steps, measured, as any change of
DP size moves a bf16 run)."""

from __future__ import annotations

import pytest
import torch

import ucp
from tests.support.checks import assert_every_state_equals_record, assert_same_training
from tests.support.fixtures import build, resume
from ucp.harness import LoadSpec
from ucp.universal import open_universal

AUTOCAST = {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_a_torch_autocast_run_moves_to_another_dp_and_resumes_like_deepspeed_itself(stage, tmp_path):
    built = build(dp=2, stage=stage, dtype="fp32", optimizer="torch-adamw", ds_config=AUTOCAST)
    record = built.record
    ucp.to_universal(built.path, tmp_path / "u")
    with open_universal(tmp_path / "u") as reader:
        assert reader.facts.info.dtype == "fp32"
        for name, value in record["params"].items():
            state = reader.read(name)
            assert torch.equal(state.fp32, value), name
            assert all(torch.equal(state.optim[k], record["state"][k][name]) for k in record["state"]), name
    ucp.write_native(tmp_path / "u", tmp_path / "n", dp=3)
    loaded = resume(built, LoadSpec(str(tmp_path / "n")), dp=3, steps=0, name="loaded", work=tmp_path)
    assert_every_state_equals_record(loaded, record)
    ucp.write_native(tmp_path / "u", tmp_path / "same", dp=2)
    native = resume(built, LoadSpec(str(built.path)), name="native", work=tmp_path)
    ours = resume(built, LoadSpec(str(tmp_path / "same")), name="ucp", work=tmp_path)
    assert_same_training(native, ours)
