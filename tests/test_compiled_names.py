"""Models compiled before ``deepspeed.initialize``: ``torch.compile(model)`` wraps the module as ``_orig_mod``, so
DeepSpeed saves every name under it. Real runs (the eager backend: the wrapper without a compiler): a live
restore matches the names across the wrapper either way, an export writes the names a plain model has, and a
native restore keeps them, saying so."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import ucp
from tests.support.checks import assert_every_state_equals_record
from tests.support.fixtures import build, resume
from ucp.cli import main as cli
from ucp.harness import LoadSpec
from ucp.harness.model import TinyLM, build_param_groups
from ucp.model.names import without_wrapper

COMPILED = dict(dp=2, stage=2, dtype="fp32", optimizer="torch-adamw", compiled=True)
PLAIN = dict(dp=2, stage=3, dtype="fp32", optimizer="torch-adamw")


def _plain_names(record: dict[str, Any]) -> dict[str, Any]:
    """A record with every name as an uncompiled model has it."""
    out = dict(record)
    out["params"] = {without_wrapper(n): v for n, v in record["params"].items()}
    out["state"] = {k: {without_wrapper(n): v for n, v in per.items()} for k, per in record["state"].items()}
    return out


@pytest.mark.slow
def test_a_compiled_runs_checkpoint_names_everything_under_the_wrapper():
    record = build(**COMPILED).record
    assert record["params"] and all(n.startswith("_orig_mod.") for n in record["params"])


@pytest.mark.slow
@pytest.mark.parametrize(("source", "into_compiled"), [(COMPILED, False), (PLAIN, True)])
def test_a_live_restore_matches_names_across_the_wrapper(source, into_compiled, tmp_path):
    built = build(**source)
    after = resume(
        built, LoadSpec(str(built.path), kind="ucp"), dp=3, steps=0, name="live", work=tmp_path, compiled=into_compiled
    )
    assert all(n.startswith("_orig_mod.") == into_compiled for n in after["params"])
    assert_every_state_equals_record(_plain_names(after), _plain_names(built.record))
    assert torch.equal(
        after["buffers"]["_orig_mod.calls" if into_compiled else "calls"],
        built.record["buffers"]["calls" if into_compiled else "_orig_mod.calls"],
    )


@pytest.mark.slow
def test_restore_torch_takes_a_compiled_runs_state_into_a_plain_model():
    built = build(**COMPILED)
    model = TinyLM(built.spec.model)
    optimizer = torch.optim.AdamW(build_param_groups(model, built.spec.param_groups, 0.1), betas=(0.9, 0.95))
    ucp.restore_torch(model, optimizer, built.path)
    record = _plain_names(built.record)
    for name, param in model.named_parameters():
        if name in record["params"]:
            assert torch.equal(param.detach(), record["params"][name]), name
            assert torch.equal(optimizer.state[param]["exp_avg"], record["state"]["exp_avg"][name]), name


@pytest.mark.slow
def test_an_export_writes_the_names_a_plain_model_has(tmp_path, capsys):
    from safetensors.torch import load_file

    built = build(**COMPILED)
    assert cli(["export", str(built.path), str(tmp_path / "m.safetensors"), "--dtype", "fp32"]) == 0
    assert "note: names written without torch.compile's _orig_mod. wrapper" in capsys.readouterr().err
    model = TinyLM(built.spec.model)
    result = model.load_state_dict(load_file(tmp_path / "m.safetensors"), strict=False)
    assert not result.unexpected_keys and result.missing_keys == ["head.weight"]  # safetensors keeps a tie once
    for name, param in model.named_parameters():
        want = _plain_names(built.record)["params"].get(name)
        assert want is None or torch.equal(param.detach(), want), name


@pytest.mark.slow
def test_a_native_restore_keeps_the_names_and_a_compiled_run_loads_them(tmp_path, capsys):
    built = build(**COMPILED)
    out = tmp_path / "n"
    assert cli(["restore", str(built.path), str(out), "--dp", "3"]) == 0
    assert "_orig_mod. wrapper" in capsys.readouterr().err
    after = resume(built, LoadSpec(str(out)), dp=3, steps=0, name="native", work=tmp_path)
    assert_every_state_equals_record(after, built.record)
