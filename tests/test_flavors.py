"""Optimizer flavours at the state-dict level: where each keeps its step, read and written.

Apex FusedAdam needs CUDA to run; its layout (one int step per param group, none per parameter) is
produced and read here on real DeepSpeed checkpoints, and a real Apex run is marked ``gpu``.
"""

from __future__ import annotations

import copy

import pytest
import torch

import ucp
from tests.support.files import resave
from ucp.errors import InputError
from ucp.io.torchfile import load
from ucp.model.detect import detect, detect_live
from ucp.sources import open_reader


def _zero3_optim(path):
    return sorted(path.glob("*zero_pp_rank_*_optim_states.pt"))


@pytest.mark.parametrize(
    "flavour, step_in_state, step_type",
    [
        ("torch-adam", True, torch.Tensor),
        ("ds-fused-adam", True, int),
        ("ds-cpu-adam", True, int),
        ("apex-fused-adam", False, None),
    ],
)
@pytest.mark.slow
def test_native_files_put_the_step_where_each_flavour_reads_it(universals, tmp_path, flavour, step_in_state, step_type):
    ucp.write_native(universals("z3-bf16-dp2-adamw"), tmp_path / "n", dp=3, optimizer=flavour)
    files = _zero3_optim(tmp_path / "n" / "global_step3")
    assert len(files) == 3
    inner = load(files[0])["optimizer_state_dict"]["optimizer_state_dict"]
    for state in inner["state"].values():
        assert ("step" in state) == step_in_state
        if step_in_state:
            assert isinstance(state["step"], step_type) and float(state["step"]) == 3
    for group in inner["param_groups"]:
        if flavour in ("apex-fused-adam", "ds-fused-adam"):
            assert group["step"] == 3 and isinstance(group["step"], int)
        else:
            assert "step" not in group
        assert ("bias_correction" in group) == (flavour != "torch-adam")


@pytest.mark.slow
def test_apex_layout_reads_back_bit_exact_with_its_group_step(source, universals, tmp_path):
    built = source("z3-bf16-dp2-adamw")
    ucp.write_native(universals("z3-bf16-dp2-adamw"), tmp_path / "apex", dp=2, optimizer="apex-fused-adam")
    reader = open_reader(tmp_path / "apex")
    assert reader.facts.flavour == "apex-fused-adam" and reader.facts.step == 3
    record = built.record
    for name, value in record["exp_avg"].items():
        state = reader.read(name)
        assert torch.equal(state.optim["exp_avg"], value) and torch.equal(state.fp32, record["params"][name])
        assert state.step == 3


@pytest.mark.slow
def test_detection_tells_every_flavour_apart_on_a_real_state_dict(source):
    built = source("z3-bf16-dp2-adamw")
    base = load(_zero3_optim(built.tag_dir)[0])["optimizer_state_dict"]["optimizer_state_dict"]
    assert detect(base).flavour.name == "torch-adam"
    fused = copy.deepcopy(base)
    for state in fused["state"].values():
        state["step"] = int(state["step"])
    for group in fused["param_groups"]:
        group["step"] = 0  # DeepSpeed FusedAdam's stale copy
        group["bias_correction"] = True
    found = detect(fused)
    assert found.flavour.name == "ds-fused-adam" and any("stale" in w for w in found.warnings)
    cpu = copy.deepcopy(fused)
    for group in cpu["param_groups"]:
        del group["step"]
    assert detect(cpu, {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}).flavour.name == "ds-cpu-adam"
    apex = copy.deepcopy(base)
    for state in apex["state"].values():
        del state["step"]
    for group in apex["param_groups"]:
        group["step"] = 3
    found = detect(apex)
    assert found.flavour.name == "apex-fused-adam"
    assert found.flavour.read_step(apex["param_groups"][0], apex["state"][0]) == 3
    assert detect({"state": {}, "param_groups": base["param_groups"]}).flavour is None
    assert detect(base, override="ds-cpu-adam").flavour.name == "ds-cpu-adam"
    # a step that is no number (found by fuzzing a stage-0 file): read as "no step found" it was dropped silently
    damaged = copy.deepcopy(fused)
    damaged["state"][1]["step"] = None
    with pytest.raises(InputError, match="step is None, not a number: the file is damaged"):
        detect(damaged)


@pytest.mark.slow
def test_converting_an_apex_checkpoint_keeps_its_step_and_moments(source, tmp_path):
    built = source("z3-bf16-dp2-adamw")
    ckpt = tmp_path / "ckpt"
    import shutil

    shutil.copytree(built.path, ckpt)
    for path in _zero3_optim(ckpt / built.tag_dir.name):
        raw = load(path)
        inner = raw["optimizer_state_dict"]["optimizer_state_dict"]
        for state in inner["state"].values():
            del state["step"]
        for group in inner["param_groups"]:
            group["step"] = 3
            group["bias_correction"] = True
        resave(raw, path)
    manifest = ucp.to_universal(ckpt, tmp_path / "u")
    assert manifest["optimizer"]["flavour"] == "apex-fused-adam" and manifest["optimizer"]["step"] == 3
    moments = ucp.load_optimizer_moments(ckpt)
    for name, value in built.record["exp_avg_sq"].items():
        assert torch.equal(moments[name]["exp_avg_sq"], value) and moments[name]["step"] == 3


def _apex_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import apex.optimizers  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.gpu
@pytest.mark.skipif(not _apex_available(), reason="Apex FusedAdam needs CUDA and apex")
def test_real_apex_fused_adam_reads_the_restored_group_step(universals):
    from apex.optimizers import FusedAdam

    from ucp.harness.model import TinyLM, build_param_groups
    from ucp.harness.spec import ModelSpec

    model = TinyLM(ModelSpec()).cuda()
    optimizer = FusedAdam(build_param_groups(model, 2, 1e-2), lr=1e-2, betas=(0.9, 0.95))
    ucp.restore_torch(model, optimizer, universals("z3-fp32-dp2-adamw"))
    assert all(group["step"] == 3 for group in optimizer.param_groups)
    model(torch.randint(0, 37, (4, 9), device="cuda")).backward()
    optimizer.step()
    assert all(int(group["step"]) == 4 for group in optimizer.param_groups)


def _schedule_free(name, params):
    import schedulefree

    optimizer = getattr(schedulefree, name)(params, lr=1e-2)
    optimizer.train()
    return optimizer


def _hf_adafactor(params):
    from transformers.optimization import Adafactor

    return Adafactor(params, lr=1e-3, beta1=0.9, relative_step=False, scale_parameter=False)


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda p: torch.optim.AdamW(p), "torch-adam"),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), "torch-sgd"),
        (lambda p: torch.optim.RMSprop(p, momentum=0.5, centered=True), "torch-rmsprop"),
        (lambda p: torch.optim.NAdam(p), "torch-nadam"),
        (lambda p: torch.optim.RAdam(p), "torch-radam"),
        (lambda p: torch.optim.Adamax(p), "torch-adamax"),
        (lambda p: torch.optim.Adagrad(p), "torch-adagrad"),
        (lambda p: torch.optim.Adadelta(p), "torch-adadelta"),
        (lambda p: torch.optim.Rprop(p), "torch-rprop"),
        (lambda p: torch.optim.ASGD(p), "torch-asgd"),
        (lambda p: torch.optim.Adafactor(p), "torch-adafactor"),
        (_hf_adafactor, "hf-adafactor"),
        (lambda p: _schedule_free("AdamWScheduleFree", p), "sf-adamw"),
        (lambda p: _schedule_free("RAdamScheduleFree", p), "sf-radam"),
        (lambda p: _schedule_free("SGDScheduleFree", p), "sf-sgd"),
    ],
)
def test_detection_names_each_optimizer_from_its_own_state_dict(make, name):
    """Flat vectors, as ZeRO hands them to the optimizer; Adadelta, Rprop, ASGD and both Adafactors were read as
    Adam (their state carried under Adam's settings) before each had its flavour, schedule-free ones as RAdam."""
    flat = [torch.nn.Parameter(torch.randn(12)), torch.nn.Parameter(torch.randn(5))]
    optimizer = make(flat)
    for p in flat:
        p.grad = torch.randn_like(p)
    optimizer.step()
    found = detect(optimizer.state_dict())
    assert found.flavour.name == name, found.reason
    assert detect_live(optimizer).name == name


def test_state_no_known_optimizer_keeps_is_refused_not_carried_as_adams():
    """bitsandbytes' 8-bit Adam layout (quantized moments, absmax per block, a code map): int steps and betas
    made it pass for DeepSpeed FusedAdam with its moments dropped."""
    groups = [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "params": [0]}]
    state = {"step": 3, "state1": torch.zeros(256, dtype=torch.uint8), "state2": torch.zeros(256, dtype=torch.uint8)}
    state |= {"absmax1": torch.ones(1), "absmax2": torch.ones(1), "qmap1": torch.zeros(256)}
    with pytest.raises(InputError, match="absmax1, absmax2, qmap1, state1, state2, which ds-fused-adam does not"):
        detect({"param_groups": groups, "state": {0: state}})
    nadam = {"step": torch.tensor(3.0), "exp_avg": torch.zeros(4), "exp_avg_sq": torch.zeros(4)}
    nadam |= {"mu_product": torch.tensor(0.9), "extra_scalar": torch.tensor(1.0)}
    nadam_groups = [{**groups[0], "momentum_decay": 4e-3, "foreach": None}]
    with pytest.raises(InputError, match="extra_scalar, which torch-nadam does not"):
        detect({"param_groups": nadam_groups, "state": {0: nadam}})
