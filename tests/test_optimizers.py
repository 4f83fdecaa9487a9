"""Optimizers beyond Adam on real DeepSpeed runs: every state key and scalar, bit-exact, at every stage.

Each source is a real run (gloo ranks on CPU) of an optimizer with the options that give it the
most state: AMSGrad's max_exp_avg_sq, SGD's nesterov momentum buffer, centered RMSprop with
momentum (square_avg, momentum_buffer, grad_avg), NAdam's 0-dim mu_product, Adamax's exp_inf,
DeepSpeed's CPU Lion and Adagrad (with offload, which they need), DeepSpeed's MuonWithAuxAdam
(momentum on the matrices' groups, which count no step; Adam moments and a step on the others). torch
Adagrad is absent: DeepSpeed 0.19.8 fails inside its own step with it at every ZeRO stage (IndexError
in get_flat_partition). Muon at ZeRO-1/2 keeps each rank's momentum as the whole momentum of every matrix
reaching its partition (a flat partition only with the optimizer offloaded): read, written and tested both ways.
Adadelta, Rprop, ASGD (0-dim eta and mu), torch's Adafactor and transformers' Adafactor were read as Adam before
(their state carried under Adam's settings, or refused with a traceback): each is its own flavour now, and state
no known flavour keeps is refused in one line. Adafactor sees ZeRO's flat partitions as vectors (an unfactored
second moment) and scales each update by the partition's RMS, so only a run with the same partitions steps alike.
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

import ucp
from tests.conftest import OPTIMIZER_SOURCES
from tests.support.checks import assert_every_state_equals_record, assert_same_training
from tests.support.fixtures import resume
from ucp.cli import main as cli
from ucp.errors import InputError
from ucp.harness import LoadSpec
from ucp.harness.fsdp import loaded_record_path, run_fsdp
from ucp.harness.model import TinyLM, build_param_groups
from ucp.io import torchfile
from ucp.model import flavours
from ucp.model.options import RestoreOptions
from ucp.targets.native.plan import plan_native
from ucp.universal import open_universal


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OPTIMIZER_SOURCES))
def test_every_state_key_and_scalar_reaches_the_universal_directory_bit_exact(source, universals, name):
    record = source(name).record
    assert record["state"], "the run kept no optimizer state: the test would prove nothing"
    # HF Adafactor's RMS: a statistic of each rank's partition that it recomputes before reading (not carried)
    scalars = {k for s in record["state_scalars"] for k in s} - {"step"} - set(_derived(name))
    with open_universal(universals(name)) as reader:
        for key, per_param in record["state"].items():
            for param, value in per_param.items():
                state = reader.read(param)
                assert key in state.optim, f"{param}: {key} is missing from the output"
                assert torch.equal(state.optim[key], value.float()), (key, param)
        for param in record["params"]:  # nothing beyond what the engine keeps, and every scalar
            state = reader.read(param)
            assert set(state.optim) == {k for k, per in record["state"].items() if param in per}, param
            assert set(state.scalars) == scalars, param
            for key in scalars:
                assert state.scalars[key].item() in {s[key] for s in record["state_scalars"]}, (param, key)
        assert all(torch.equal(reader.read(p).fp32, v) for p, v in record["params"].items())


def _derived(name: str) -> tuple[str, ...]:
    """The 0-dim state the source's optimizer recomputes before reading it (its flavour's ``derived``; the
    harness names its optimizers as the flavours do where they are one)."""
    flavour = flavours.FLAVOURS.get(OPTIMIZER_SOURCES[name]["optimizer"])
    return flavour.derived if flavour else ()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OPTIMIZER_SOURCES))
def test_state_right_after_restore_at_a_new_dp_equals_the_source(source, universals, name, tmp_path):
    built = source(name)
    out = tmp_path / "n"
    ucp.write_native(universals(name), out, dp=3, stage=built.spec.stage)
    after = resume(built, LoadSpec(str(out)), dp=3, steps=0, name="loaded", work=tmp_path)
    record = built.record
    assert_every_state_equals_record(after, record, derived=_derived(name))

    # the source's settings, each as it was (DeepSpeed's own ZeRO-3 offload load adds amsgrad=False to Lion's;
    # a JSON list of betas comes back as the tuple optimizers build; FusedAdam's stale group step is written
    # as the real count, which is all FusedAdam seeds new state from)
    def settings(group: dict) -> dict:
        stale = built.spec.optimizer == "ds-muon"
        return {k: list(v) if isinstance(v, tuple) else v for k, v in group.items() if not (stale and k == "step")}

    wanted = [settings(g) for g in record["group_hparams"]]
    assert [{k: settings(g)[k] for k in want} for g, want in zip(after["group_hparams"], wanted)] == wanted


@pytest.mark.parametrize(
    "name",
    [
        "z3-fp32-amsgrad",
        "z2-fp32-rmsprop",
        "z3-fp32-nadam",
        "z3-fp32-lion",
        "z3-fp32-muon",
        "z2-fp32-muon",
        "z1-fp32-adadelta",
        "z3-fp32-rprop",
        "z1-fp32-sf-adamw",
        "z3-fp32-sf-sgd",
    ],
)
@pytest.mark.slow
def test_new_dp_resume_matches_deepspeeds_native_resume_within_1e_5(source, universals, name, tmp_path):
    built = source(name)
    out = tmp_path / "n"
    ucp.write_native(universals(name), out, dp=3, stage=built.spec.stage)
    reference = resume(built, LoadSpec(str(built.path)), name="native", work=tmp_path)
    ours = resume(built, LoadSpec(str(out)), dp=3, name="ucp", work=tmp_path)
    assert_same_training(reference, ours, atol=1e-5)


@pytest.mark.parametrize(
    "name",
    [
        "z2-fp32-adagrad",
        "z1-bf16-nadam",
        "z2-bf16-asgd",
        "z3-fp32-adafactor",
        "z2-fp32-hf-adafactor",
        "z2-bf16-sf-adamw",
    ],
)
@pytest.mark.slow
def test_same_dp_resume_is_bit_identical_to_native_resume(source, universals, name, tmp_path):
    built = source(name)
    out = tmp_path / "n"
    ucp.write_native(universals(name), out, dp=2, stage=built.spec.stage)
    reference = resume(built, LoadSpec(str(built.path)), name="native", work=tmp_path)
    ours = resume(built, LoadSpec(str(out)), name="ucp", work=tmp_path)
    assert_same_training(reference, ours)


@pytest.mark.slow
def test_a_live_engine_at_a_new_dp_takes_sgd_momentum_from_ucp_restore(source, universals, tmp_path):
    built = source("z3-bf16-sgd")
    after = resume(
        built, LoadSpec(str(universals("z3-bf16-sgd")), kind="ucp"), dp=3, steps=0, name="live", work=tmp_path
    )
    for param, value in built.record["state"]["momentum_buffer"].items():
        assert torch.equal(after["state"]["momentum_buffer"][param], value), param


@pytest.mark.slow
def test_restoring_one_familys_state_into_another_is_refused_in_one_line(universals, tmp_path, capsys):
    code = cli(
        ["restore", str(universals("z3-bf16-sgd")), str(tmp_path / "n"), "--dp", "2", "--optimizer", "torch-adam"]
    )
    err = capsys.readouterr().err.strip()
    assert code != 0 and len(err.splitlines()) == 1, err
    assert "torch-sgd" in err and "torch-adam" in err
    assert not (tmp_path / "n").exists()


@pytest.mark.slow
def test_inspect_lists_each_groups_state_keys(universals, capsys):
    assert cli(["inspect", str(universals("z2-fp32-rmsprop"))]) == 0
    out = capsys.readouterr().out
    assert "optimizer torch-rmsprop" in out
    assert out.count("state: square_avg, momentum_buffer, grad_avg") == 2


@pytest.mark.slow
def test_muon_zero_2_momentum_is_whole_per_parameter_and_ranks_agree_on_shared_matrices(source):
    """The layout is real here (not a flat partition), and a matrix cut by the partition boundary exists."""
    built = source("z2-fp32-muon")
    files = sorted(built.tag_dir.glob("*optim_states.pt"))
    blocks = [torchfile.load(f)["optimizer_state_dict"] for f in files]
    sizes = [
        [
            (s["momentum_buffer"].numel(), b["single_partition_of_fp32_groups"][g].numel())
            for g, s in st.items()
            if "momentum_buffer" in s
        ]
        for b in blocks
        for st in [b["base_optimizer_state"]["state"]]
    ]
    assert all(sizes) and any(whole != flat for rank in sizes for whole, flat in rank), sizes
    copies = built.record["whole_copies"]
    assert copies and all(agree for _, agree in copies), copies


@pytest.mark.parametrize(
    ("name", "stage", "offload"),
    [
        ("z3-fp32-muon", 2, False),
        ("z2-fp32-muon", 3, False),
        ("z1-bf16-muon-offload", 2, False),
        ("z2-fp32-muon", 1, True),
    ],
)
@pytest.mark.slow
def test_muon_state_moves_between_zero_stages_and_layouts_bit_exact(source, universals, name, stage, offload, tmp_path):
    """ZeRO-3 -> ZeRO-2 (whole momentum per rank), ZeRO-2 -> ZeRO-3, offloaded -> not offloaded and back."""
    built = source(name)
    out = tmp_path / "n"
    ucp.write_native(universals(name), out, dp=3, stage=stage, offload=offload)
    after = resume(built, LoadSpec(str(out)), dp=3, steps=0, name="loaded", work=tmp_path, stage=stage, offload=offload)
    for key, per_param in built.record["state"].items():
        assert set(after["state"][key]) == set(per_param), key
        for param, value in per_param.items():
            assert torch.equal(after["state"][key][param].float(), value.float()), (key, param)


@pytest.mark.slow
@pytest.mark.parametrize(("offload", "said"), [(None, "without"), (True, "with")])
def test_the_plan_says_which_offload_setting_muon_momentum_is_written_for(universals, offload, said):
    """DeepSpeed silently zeroes a momentum laid out for the other setting: the plan says which run it fits
    (by default the source's: this run did not offload)."""
    with open_universal(universals("z2-fp32-muon")) as reader:
        plan = plan_native(reader.facts, RestoreOptions(dp=3, stage=2, offload=offload))
    assert any(f"as a run {said} optimizer offload" in note for note in plan.notes), plan.notes


@pytest.mark.slow
@pytest.mark.parametrize("name", ["z3-fp32-muon", "z2-fp32-muon"])
def test_a_live_engine_at_a_new_dp_takes_muon_and_adam_state_from_ucp_restore(source, universals, name, tmp_path):
    built = source(name)
    after = resume(built, LoadSpec(str(universals(name)), kind="ucp"), dp=3, steps=0, name="live", work=tmp_path)
    record = built.record
    assert set(record["state"]) == {"momentum_buffer", "exp_avg", "exp_avg_sq"}
    for key, per_param in record["state"].items():
        assert set(after["state"][key]) == set(per_param), key
        for param, value in per_param.items():
            assert torch.equal(after["state"][key][param], value), (key, param)

    # Muon's groups count no step, Adam's keep theirs: which flat tensors carry a step, and its value
    def steps(entries: list[dict]) -> tuple[bool, set]:
        return any("step" not in s for s in entries), {s["step"] for s in entries if "step" in s}

    assert steps(after["state_scalars"]) == steps(record["state_scalars"]) == (True, {3})


@pytest.mark.slow
@pytest.mark.parametrize("name", ["z2-bf16-asgd", "z2-fp32-hf-adafactor", "z3-fp32-adafactor", "z2-bf16-sf-adamw"])
def test_a_live_engine_at_a_new_dp_takes_the_state_from_ucp_restore(source, universals, name, tmp_path):
    built = source(name)
    after = resume(built, LoadSpec(str(universals(name)), kind="ucp"), dp=3, steps=0, name="live", work=tmp_path)
    assert_every_state_equals_record(after, built.record, derived=_derived(name))


@pytest.mark.slow
def test_asgd_scalars_are_carried_and_a_reset_starts_eta_at_the_groups_lr(universals):
    from ucp.transforms import ResetOptimizer, TransformedReader, plan_transforms

    with open_universal(universals("z2-bf16-asgd")) as reader:
        group = reader.facts.groups[1]
        state = reader.read(group.params[0])
        assert state.scalars["mu"].item() == 0.5 and state.scalars["eta"].item() != group.raw["lr"]
        plan = plan_transforms(reader.facts, [ResetOptimizer((re.escape(group.params[0]),))])
        fresh = TransformedReader(reader, plan).read(group.params[0])
    assert fresh.scalars["eta"].item() == pytest.approx(group.raw["lr"]) and fresh.scalars["mu"].item() == 1.0
    assert not any(v.any() for v in fresh.optim.values())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["z3-fp32-adafactor", "z2-fp32-hf-adafactor"])
def test_adafactor_restored_at_another_size_says_its_steps_follow_the_partitions(universals, name):
    with open_universal(universals(name)) as reader:
        same = plan_native(reader.facts, RestoreOptions(dp=2, stage=reader.facts.info.zero_stage))
        other = plan_native(reader.facts, RestoreOptions(dp=3, stage=reader.facts.info.zero_stage))
    assert not any("RMS of the tensor it steps" in n for n in same.notes)
    assert any("RMS of the tensor it steps" in n and "dp=3" in n for n in other.notes), other.notes


@pytest.mark.parametrize(
    "extra", [["--format", "dcp", "--optimizer", "torch-adafactor"], ["--dp", "2", "--stage", "0"]]
)
@pytest.mark.slow
def test_adafactor_state_of_flat_partitions_is_refused_where_the_optimizer_sees_whole_matrices(
    universals, tmp_path, capsys, extra
):
    """On a whole matrix Adafactor keeps its second moment factored; ZeRO's flat partitions hold it per element."""
    code = cli(["restore", str(universals("z3-fp32-adafactor")), str(tmp_path / "n"), *extra])
    err = capsys.readouterr().err.strip()
    assert code != 0 and len(err.splitlines()) == 1 and "factored" in err, err
    assert not (tmp_path / "n").exists()


@pytest.mark.slow
def test_restore_torch_refuses_adafactor_partitions_and_another_familys_state(source, universals):
    built = source("z3-fp32-adafactor")
    model = TinyLM(built.spec.model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for optimizer, said in (
        (torch.optim.Adafactor(build_param_groups(model, built.spec.param_groups, 0.1)), "factored"),
        (torch.optim.SGD(build_param_groups(model, built.spec.param_groups, 0.1), lr=0.1), "family"),
    ):
        with pytest.raises(InputError, match=said):
            ucp.restore_torch(model, optimizer, universals("z3-fp32-adafactor"))
        assert not optimizer.state
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters()), "refused, yet weights were copied"


@pytest.mark.slow
def test_a_dcp_output_is_written_for_the_sources_own_torch_optimizer(universals, tmp_path, capsys):
    assert cli(["restore", str(universals("z3-bf16-sgd")), str(tmp_path / "d"), "--format", "dcp"]) == 0
    assert "(torch-sgd, torch layout)" in capsys.readouterr().out
    keys = set(torch.distributed.checkpoint.FileSystemReader(str(tmp_path / "d")).read_metadata().state_dict_metadata)
    assert any(k.endswith(".momentum_buffer") for k in keys) and not any("exp_avg" in k for k in keys)


@pytest.mark.slow
def test_a_universal_directory_holding_state_its_flavour_does_not_keep_is_refused(universals, tmp_path, capsys):
    """What an older ucp wrote for an Adadelta run (read as torch Adam) no longer passes for Adam state."""
    import json
    import shutil

    doctored = tmp_path / "u"
    shutil.copytree(universals("z1-fp32-adadelta"), doctored)
    manifest = json.loads((doctored / "ucp.json").read_text())
    assert manifest["optimizer"]["flavour"] == "torch-adadelta"
    manifest["optimizer"]["flavour"] = "torch-adam"
    (doctored / "ucp.json").write_text(json.dumps(manifest))
    assert cli(["restore", str(doctored), str(tmp_path / "n"), "--dp", "2", "--no-space-check"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "acc_delta, square_avg, which torch-adam does not" in err, err
    assert not (tmp_path / "n").exists()


@pytest.mark.parametrize(
    "name",
    ["z3-fp32-nadam", "z2-fp32-rmsprop", "z1-fp32-adadelta", "z3-bf16-sgd", "z2-bf16-asgd", "z1-fp32-sf-adamw"],
)
@pytest.mark.slow
def test_fsdp2_takes_the_state_of_ucps_dcp_folder_and_trains_on_like_deepspeed(source, universals, name, tmp_path):
    """Out of DeepSpeed beyond Adam: ``--format dcp`` writes for the source's own torch optimizer (NAdam's and
    ASGD's 0-dim scalars, SGD without a step), and a real FSDP2 run of it loads every tensor bit for bit with
    get_state_dict / dcp.load / set_state_dict, then steps within 1e-5 of DeepSpeed's own resume (fp32). Rprop is
    absent: torch 2.13's Rprop fails inside its own step on FSDP2's sharded parameters, from scratch too."""
    built = source(name)
    out = tmp_path / "d"
    assert cli(["restore", str(universals(name)), str(out), "--format", "dcp"]) == 0
    record = tmp_path / "fsdp.pt"
    load = LoadSpec(str(out), kind="dcp")
    spec = replace(built.spec, steps=3, first_step=built.spec.steps, load=load, record=str(record), save_dir=None)
    run_fsdp(replace(spec, port=0), log_dir=tmp_path / "logs")
    loaded = torch.load(loaded_record_path(str(record)), weights_only=True)
    assert_every_state_equals_record(loaded, built.record)
    if built.spec.dtype == "fp32":  # bf16: FSDP2 and DeepSpeed follow different bf16 recipes after the load
        native = resume(built, LoadSpec(str(built.path)), name="native", work=tmp_path)
        assert_same_training(native, torch.load(record, weights_only=True), atol=1e-5)


@pytest.mark.slow
def test_schedule_free_state_is_not_reset_to_zeros(universals, tmp_path, capsys):
    """A fresh schedule-free optimizer starts z at the weights and its weight sums at their own values: zeros
    would pull every weight towards 0 at the next step."""
    code = cli(["restore", str(universals("z2-bf16-sf-adamw")), str(tmp_path / "n"), "--dp", "3", "--step", "reset"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and len(err.splitlines()) == 1 and "starts z at the weights" in err, err
    assert not (tmp_path / "n").exists()


@pytest.mark.slow
def test_zero_3_counts_a_schedule_free_step_per_sub_group_and_ucp_says_so(source, universals, capsys):
    """DeepSpeed 0.19.8's ZeRO-3 calls optimizer.step() once per sub-group; schedule-free counts each call in every
    group (k 6 after 3 steps here, and its weight_sum twice over). Carried as counted (a native ZeRO-3 resume goes
    on so), and said."""
    record = source("z3-fp32-sf-sgd").record
    assert {g["k"] for g in record["group_hparams"]} == {6}
    assert cli(["inspect", str(universals("z3-fp32-sf-sgd"))]) == 0
    assert "the param groups count 6 steps where the engine took 3" in capsys.readouterr().out
