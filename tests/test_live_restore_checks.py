"""A restore into a live model checks everything first and, when it refuses, changes nothing.

``ucp.restore_torch`` into a plain model and optimizer, and ``ucp.restore`` into a live DeepSpeed engine, from a
real DeepSpeed checkpoint: a wrong shape, a missing name, an extra name, another param-group split, a buffer of
another shape, a scheduler that cannot take the state. Each refusal is one UcpError naming what differs (the
parameter and both shapes), and the model, the optimizer and the scheduler are bit for bit as before it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ucp
from tests.support.fixtures import Built
from ucp.harness import LoadSpec, run_ranks
from ucp.harness.model import TinyLM, build_param_groups, spec_batch
from ucp.harness.worker import lr_decay

NAME = "z3-fp32-dp3-adamw"  # three param groups, frozen and tied parameters, buffers, a scheduler


def _snapshot(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> dict[str, Any]:
    return copy.deepcopy(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        }
    )


def _equal(a: Any, b: Any) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _trained(built: Built, model: nn.Module | None = None, groups: int | None = None) -> tuple[Any, Any, Any]:
    """A model, optimizer and scheduler that already hold state of their own (one step), so that a half-done
    restore would show."""
    spec = built.spec
    model = model or TinyLM(spec.model)
    optimizer = torch.optim.AdamW(build_param_groups(model, groups or spec.param_groups, spec.lr), lr=spec.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_decay)
    model(spec_batch(spec, 0, rank=0, dp=1)).backward()
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler


def _wrong_shape(built: Built) -> nn.Module:
    model = TinyLM(built.spec.model)
    model.blocks[1][0] = nn.Linear(built.spec.model.hidden, built.spec.model.ffn + 7)
    model.blocks[1][2] = nn.Linear(built.spec.model.ffn + 7, built.spec.model.hidden)
    return model


def _missing(built: Built) -> nn.Module:
    return TinyLM(replace(built.spec.model, frozen=False))


def _extra(built: Built) -> nn.Module:
    model = TinyLM(built.spec.model)
    model.adapter = nn.Linear(built.spec.model.hidden, 3)
    return model


def _buffer(built: Built) -> nn.Module:
    model = TinyLM(built.spec.model)
    model.register_buffer("calls", torch.zeros(3, 2))  # (2,) in the run; the forward still broadcasts into it
    return model


CASES: dict[str, tuple[Callable[[Built], nn.Module], int | None, str]] = {
    "wrong shape": (_wrong_shape, None, r"blocks\.1\.0\.weight has shape \(23, 10\) in the checkpoint but \(30, 10\)"),
    "missing name": (_missing, None, r"parameters differ: .*proj"),
    "extra name": (_extra, None, r"parameters differ: the model has 2 not in the checkpoint"),
    "group count": (lambda b: TinyLM(b.spec.model), 1, r"param group 0 .* mixes members of checkpoint groups"),
    "buffer shape": (_buffer, None, r"buffer calls has shape \(2,\) in the checkpoint but \(3, 2\) in the model"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_restore_torch_refuses_in_one_line_and_changes_nothing(
    source: Callable[[str], Built], universals: Callable[[str], Path], case: str
) -> None:
    make, groups, message = CASES[case]
    built = source(NAME)
    model, optimizer, scheduler = _trained(built, make(built), groups)
    before = _snapshot(model, optimizer, scheduler)
    with pytest.raises(ucp.UcpError, match=message) as caught:
        ucp.restore_torch(model, optimizer, universals(NAME), scheduler=scheduler)
    assert "\n" not in str(caught.value)
    assert _equal(_snapshot(model, optimizer, scheduler), before), f"{case}: the model or optimizer changed"


@pytest.mark.slow
def test_restore_torch_refuses_a_scheduler_that_cannot_take_the_state_and_changes_nothing(
    source: Callable[[str], Built], universals: Callable[[str], Path]
) -> None:
    built = source(NAME)
    model, optimizer, _ = _trained(built)
    scheduler = torch.optim.lr_scheduler.SequentialLR(
        optimizer,
        [torch.optim.lr_scheduler.ConstantLR(optimizer), torch.optim.lr_scheduler.ConstantLR(optimizer)],
        milestones=[2],
    )
    before = _snapshot(model, optimizer, scheduler)
    with pytest.raises(ucp.UcpError, match="lr scheduler state does not load into SequentialLR"):
        ucp.restore_torch(model, optimizer, universals(NAME), scheduler=scheduler)
    assert _equal(_snapshot(model, optimizer, scheduler), before)


@pytest.mark.slow
def test_restore_torch_still_restores_what_it_checked(
    source: Callable[[str], Built], universals: Callable[[str], Path]
) -> None:
    """The check-first path takes the state exactly (over a model that already trained a step)."""
    built = source(NAME)
    model, optimizer, scheduler = _trained(built)
    ucp.restore_torch(model, optimizer, universals(NAME), scheduler=scheduler)
    record = built.record
    params = dict(model.named_parameters())
    for name, value in record["params"].items():
        assert torch.equal(params[name].detach(), value), name
        assert torch.equal(optimizer.state[params[name]]["exp_avg_sq"], record["exp_avg_sq"][name]), name
    assert scheduler.last_epoch == record["lr_scheduler"]["last_epoch"]


@pytest.mark.slow
def test_a_refused_live_engine_restore_leaves_the_engine_as_it_was(
    source: Callable[[str], Built], universals: Callable[[str], Path], tmp_path: Path
) -> None:
    """DeepSpeed ZeRO-3 at DP 2 over a model whose embedding has another vocabulary: ucp.restore refuses in one
    line, and the engine then holds exactly what the same run holds without the restore."""
    built = source("z3-fp32-dp2-adamw")
    other = replace(built.spec.model, vocab=built.spec.model.vocab + 1)
    base = replace(built.spec, model=other, steps=1, first_step=0, save_dir=None, load=None, port=0)
    records = {}
    for name, load in (
        ("plain", None),
        ("refused", LoadSpec(str(universals("z3-fp32-dp2-adamw")), "ucp", refused=True)),
    ):
        spec = replace(base, load=load, record=str(tmp_path / f"{name}.pt"))
        run_ranks(spec, log_dir=tmp_path / f"{name}-logs")
        records[name] = torch.load(spec.record, weights_only=True)
    message = records["refused"].pop("refused")
    assert message is not None and "\n" not in message
    assert "embed.weight has shape (37, 10) in the checkpoint but (38, 10) in the model" in message
    records["plain"].pop("refused")
    assert _equal(records["refused"], records["plain"])
