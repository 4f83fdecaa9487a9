"""ucp.restore(engine, universal) into live engines, and ucp.restore_torch into plain PyTorch."""

from __future__ import annotations

import pytest
import torch

import ucp
from tests.support.checks import assert_same_training
from tests.support.fixtures import resume
from ucp.harness import LoadSpec
from ucp.harness.model import TinyLM, build_param_groups, spec_batch
from ucp.harness.worker import lr_decay


@pytest.mark.slow
@pytest.mark.parametrize("name", ["z3-bf16-dp2-adamw", "z3-fp32-dp3-adamw"])
def test_restore_into_live_engine_at_same_dp_is_bit_identical_to_native_resume(
    source, native_resume, universals, name, tmp_path
):
    built = source(name)
    ours = resume(built, LoadSpec(str(universals(name)), kind="ucp"), name="live", work=tmp_path)
    assert_same_training(native_resume(built), ours)


@pytest.mark.slow
@pytest.mark.parametrize("name, dp", [("z3-fp32-dp2-adamw", 3), ("z3-fp32-dp4-adam", 2), ("z3-fp32-dp1-adamw", 2)])
def test_restore_into_live_engine_at_new_dp_matches_native_resume(
    source, native_resume, universals, name, dp, tmp_path
):
    built = source(name)
    ours = resume(built, LoadSpec(str(universals(name)), kind="ucp"), dp=dp, name="live", work=tmp_path)
    assert_same_training(native_resume(built), ours, atol=1e-5)
    assert set(ours["state_steps"]) == {float(built.spec.steps + 3)}  # source + K, never + K x sub-groups


@pytest.mark.slow
@pytest.mark.parametrize("name, dtype", [("z3-fp32-dp3-adamw", "fp32"), ("z2-bf16-dp3-adamw", "bf16")])
def test_an_engine_without_zero_takes_the_state_and_trains_on(source, native_resume, universals, name, dtype, tmp_path):
    """Stage 0 (no ZeRO, DeepSpeed's default): fp32 runs the client optimizer, bf16 DeepSpeed's
    FP16_UnfusedOptimizer over fp32 copies; at DP 2 from DP 3. fp32 trains on within 1e-5 of the native
    resume; bf16 is not compared, since DeepSpeed 0.19.8's bf16 engines without ZeRO and with ZeRO-2 part
    from the same weights already (1.4e-2 on fp32 masters after 3 steps from one initialisation)."""
    built, load = source(name), LoadSpec(str(universals(name)), kind="ucp")
    after = resume(built, load, dp=2, stage=0, dtype=dtype, steps=0, name="after", work=tmp_path)
    record = built.record
    for key in ("params", "exp_avg", "exp_avg_sq", "module"):
        for param, value in record[key].items():
            assert torch.equal(after[key][param], value), (key, param)
    assert [g["lr"] for g in after["group_hparams"]] == [g["lr"] for g in record["group_hparams"]]
    assert after["counters"] == record["counters"] and set(after["state_steps"]) == {3.0}
    ours = resume(built, load, dp=2, stage=0, dtype=dtype, name="live", work=tmp_path)
    assert set(ours["state_steps"]) == {6.0} and ours["counters"]["global_steps"] == 6
    if dtype == "fp32":
        assert_same_training(native_resume(built), ours, atol=1e-5)


@pytest.mark.slow
def test_state_right_after_restore_equals_source_and_groups_keep_own_lr(source, universals, tmp_path):
    built = source("z3-fp32-dp3-adamw")  # three groups with their own lr and weight_decay
    after = resume(
        built, LoadSpec(str(universals("z3-fp32-dp3-adamw")), kind="ucp"), dp=2, steps=0, name="after", work=tmp_path
    )
    record = built.record
    for key in ("params", "exp_avg", "exp_avg_sq"):
        for name, value in record[key].items():
            assert torch.equal(after[key][name], value), (key, name)
    for name, value in record["module"].items():
        assert torch.equal(after["module"][name], value), name
    assert [(g["lr"], g["weight_decay"]) for g in after["group_hparams"]] == [
        (g["lr"], g["weight_decay"]) for g in record["group_hparams"]
    ]
    assert len({g["lr"] for g in after["group_hparams"]}) == 3
    assert after["counters"] == record["counters"] and set(after["state_steps"]) == {3.0}


@pytest.mark.slow
def test_torch_adamw_checkpoint_into_deepspeed_fused_adam_engine_and_back(source, universals, tmp_path):
    built = source("z3-fp32-dp2-adamw")
    fused = resume(
        built,
        LoadSpec(str(universals("z3-fp32-dp2-adamw")), kind="ucp"),
        steps=0,
        name="fused",
        work=tmp_path,
        optimizer="ds-fused-adam",
    )
    assert set(fused["state_step_types"]) == {"int"} and set(fused["state_steps"]) == {3}
    for name, value in built.record["exp_avg"].items():
        assert torch.equal(fused["exp_avg"][name], value), name
    # and back: a DeepSpeed FusedAdam checkpoint into a torch AdamW engine
    fused_src = source("z3-bf16-dp4-fused")
    back = resume(
        fused_src,
        LoadSpec(str(universals("z3-bf16-dp4-fused")), kind="ucp"),
        dp=2,
        steps=0,
        name="back",
        work=tmp_path,
        optimizer="torch-adamw",
    )
    assert set(back["state_step_types"]) == {"Tensor"} and set(back["state_steps"]) == {3.0}
    for name, value in fused_src.record["params"].items():
        assert torch.equal(back["params"][name], value), name


@pytest.mark.slow
def test_restore_torch_into_plain_model_matches_universal(source, universals):
    built = source("z3-fp32-dp3-adamw")
    spec = built.spec
    model = TinyLM(spec.model)
    optimizer = torch.optim.AdamW(build_param_groups(model, spec.param_groups, spec.lr), lr=spec.lr, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_decay)
    ucp.restore_torch(model, optimizer, universals("z3-fp32-dp3-adamw"), scheduler=scheduler)
    record = built.record
    params = dict(model.named_parameters())
    for name, value in record["params"].items():
        assert torch.equal(params[name].detach(), value), name
        state = optimizer.state[params[name]]
        assert torch.equal(state["exp_avg"], record["exp_avg"][name]) and float(state["step"]) == spec.steps
    assert [g["lr"] for g in optimizer.param_groups] == record["lrs"]
    assert scheduler.last_epoch == record["lr_scheduler"]["last_epoch"]
    assert torch.equal(model.calls, record["buffers"]["calls"])
    # and it trains on: one plain step from the restored state
    tokens = spec_batch(spec, spec.steps, rank=0, dp=1)
    model(tokens).backward()
    optimizer.step()
    assert float(optimizer.state[params["embed.weight"]]["step"]) == spec.steps + 1


@pytest.mark.slow
def test_restore_refuses_a_model_with_different_parameters(source, universals):
    built = source("z3-fp32-dp3-adamw")
    spec = built.spec
    model = TinyLM(type(spec.model)(**{**spec.model.__dict__, "frozen": False}))
    with pytest.raises(ucp.UcpError, match="parameters differ"):
        ucp.restore_torch(model, None, universals("z3-fp32-dp3-adamw"))
