"""Assertions shared by the tests: what a converted state must equal, bit for bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ucp.model.records import Reader
from ucp.universal import open_universal

__all__ = [
    "assert_adam_universal_matches_record",
    "assert_reader_matches_record",
    "assert_same_training",
    "assert_state_equals_record",
]


def assert_reader_matches_record(reader: Reader, record: dict[str, Any], *, steps: int | None = None) -> None:
    """Every tensor the reader gives equals what the live engine held, in its real shape."""
    facts = reader.facts
    trainable = set(record["params"])
    assert {m.name for m in facts.params if not m.frozen} == trainable
    for meta in facts.params:
        state = reader.read(meta.name)
        if meta.frozen:
            expected = record["module"][meta.name]
            assert state.fp32.shape == expected.shape, meta.name
            assert torch.equal(state.fp32, expected.float()), meta.name
            continue
        assert list(state.optim) == ["exp_avg", "exp_avg_sq"], (meta.name, list(state.optim))
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state.optim[key], record[key][meta.name]), (meta.name, key)
        assert state.fp32.shape == record["params"][meta.name].shape, meta.name
        assert torch.equal(state.fp32, record["params"][meta.name]), meta.name
        assert state.step == (steps if steps is not None else int(record["state_steps"][0])), meta.name
    assert facts.tied == record["tied"]
    buffers = reader.buffers()
    assert set(buffers) == set(facts.buffer_names)
    for name, value in buffers.items():
        assert torch.equal(value, record["buffers"][name]), name
    for group, live in zip(facts.groups, record["group_hparams"]):
        assert group.hyper.lr == live["lr"] and group.hyper.weight_decay == live["weight_decay"]
        assert tuple(group.hyper.betas) == tuple(live["betas"]) and group.hyper.eps == live["eps"]


def assert_reader_holds_every_state(reader: Reader, record: dict[str, Any]) -> None:
    """The reader gives exactly the trained parameters the live engine held, each one's fp32 master and every
    optimizer state key its group keeps bit for bit (any optimizer; a state kept in bf16 widened exactly)."""
    assert {m.name for m in reader.facts.params if not m.frozen} == set(record["params"])
    for param, value in record["params"].items():
        state = reader.read(param)
        assert torch.equal(state.fp32, value), param
        assert set(state.optim) == {k for k, per in record["state"].items() if param in per}, param
        for key in state.optim:
            assert torch.equal(state.optim[key], record["state"][key][param].float()), (param, key)


def assert_adam_universal_matches_record(universal: Path, record: dict[str, Any], *, built_steps: int = 0) -> None:
    """An Adam run's universal directory holds what its live engine held: every trained parameter and both
    moments bit for bit, the optimizer's step (the applied steps: an fp16 run's overflows count none; plus
    ``built_steps``, the steps its wrapper took when built: DeepSpeed's bf16/fp16 ones without ZeRO take one) on
    every parameter, and DeepSpeed's skipped-step counter."""
    counters = record["counters"]
    applied = counters["global_steps"] - counters["skipped_steps"] + built_steps
    with open_universal(universal) as reader:
        assert reader.facts.step == applied and reader.facts.info.skipped_steps == counters["skipped_steps"]
        for param, value in record["params"].items():
            state = reader.read(param)
            assert torch.equal(state.fp32, value), param
            assert set(state.optim) == {"exp_avg", "exp_avg_sq"}, param
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(state.optim[key], record[key][param].float()), (param, key)
            assert state.step == applied, param


def assert_same_training(
    reference: dict[str, Any], other: dict[str, Any], *, atol: float = 0.0, steps: bool = True
) -> None:
    """Losses, fp32 masters, moments, steps, lrs, counters and the loss scaler agree (exactly when atol == 0).

    ``steps`` False leaves out the per-tensor steps and scalars (a run of another flavour keeps its step
    elsewhere: the caller checks it there)."""

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        return torch.equal(a, b) if atol == 0 else torch.allclose(a, b, rtol=0, atol=atol)

    assert len(reference["losses"]) == len(other["losses"])
    for a, b in zip(reference["losses"], other["losses"]):
        assert (a == b) if atol == 0 else abs(a - b) <= atol * 10, (reference["losses"], other["losses"])
    for key in ("params", "exp_avg", "exp_avg_sq"):
        for name, value in reference[key].items():
            if value is None:  # an optimizer without this key (SGD has no exp_avg)
                assert other[key][name] is None, (key, name)
                continue
            assert close(value, other[key][name]), (key, name, (value - other[key][name]).abs().max().item())
    for key, per_param in reference.get("state", {}).items():  # every key the optimizer keeps
        assert set(other["state"][key]) == set(per_param), key
        for name, value in per_param.items():
            assert close(value, other["state"][key][name]), (key, name)
    if steps and "state_scalars" in reference:  # the step and 0-dim state (mu_product) of every flat tensor
        ours = {k: sorted({s[k] for s in other["state_scalars"] if k in s}) for s in other["state_scalars"] for k in s}
        theirs = {
            k: sorted({s[k] for s in reference["state_scalars"] if k in s})
            for s in reference["state_scalars"]
            for k in s
        }
        assert ours.keys() == theirs.keys(), (ours, theirs)
        for k, values in theirs.items():
            assert len(values) == len(ours[k]) and all(abs(a - b) <= max(atol, 0) for a, b in zip(values, ours[k])), k
    for name, value in reference["module"].items():
        assert value.shape == other["module"][name].shape, name
    if steps:
        assert set(other["state_steps"]) == set(reference["state_steps"]), (
            other["state_steps"],
            reference["state_steps"],
        )
    if reference.get("loss_scaler") is not None and other.get("loss_scaler") is not None:  # both ZeRO runs (not
        # FSDP2, not stage 0): the loss scale the run came down to (fp16) and its counters
        assert other.get("loss_scaler") == reference["loss_scaler"], (
            other.get("loss_scaler"),
            reference["loss_scaler"],
        )
    assert other["lrs"] == reference["lrs"]
    assert other["counters"] == reference["counters"]
    assert other["lr_scheduler"]["last_epoch"] == reference["lr_scheduler"]["last_epoch"]
    for name, value in reference["buffers"].items():
        assert torch.equal(value, other["buffers"][name]), name


def assert_every_state_equals_record(
    after: dict[str, Any], record: dict[str, Any], derived: tuple[str, ...] = ()
) -> None:
    """A freshly loaded engine holds every state key, master, step and 0-dim scalar of the source engine, bit
    for bit, of the type the optimizer keeps (any optimizer; the steps as a set of values over the tensors).
    ``derived``: 0-dim state the optimizer recomputes before reading it, absent after a load."""
    for key, per_param in record["state"].items():
        assert set(after["state"].get(key, {})) == set(per_param), key
        for param, value in per_param.items():
            assert torch.equal(after["state"][key][param], value), (key, param)
    for param, value in record["params"].items():
        assert torch.equal(after["params"][param], value), param

    def scalars(entries: list[dict]) -> dict:  # value set per key, and whether some tensor carries none
        return {
            k: ({s[k] for s in entries if k in s}, any(k not in s for s in entries))
            for s in entries
            for k in s
            if k not in derived
        }

    assert scalars(after["state_scalars"]) == scalars(record["state_scalars"])
    assert not {k for s in after["state_scalars"] for k in s} & set(derived)
    assert set(after["state_step_types"]) == set(record["state_step_types"])


def assert_state_equals_record(after, record, *, steps, buffers=True):
    """What a freshly loaded engine holds equals what the source engine held, bit for bit."""
    for key in ("params", "exp_avg", "exp_avg_sq"):
        assert set(after[key]) == set(record[key]), key
        for name, value in record[key].items():
            assert torch.equal(after[key][name], value), (key, name)
    for name, value in record["module"].items():  # low-precision weights and frozen parameters too
        assert after["module"][name].dtype == value.dtype and torch.equal(after["module"][name], value), name
    assert set(after["state_steps"]) == {float(steps)}
    assert after["lrs"] == record["lrs"] and after["counters"] == record["counters"]
    assert [(g["lr"], g["weight_decay"]) for g in after["group_hparams"]] == [
        (g["lr"], g["weight_decay"]) for g in record["group_hparams"]
    ]
    if buffers:
        assert all(torch.equal(v, after["buffers"][k]) for k, v in record["buffers"].items())


def assert_same_tree(ours: Any, theirs: Any, where: str = "") -> None:
    """Two object trees (a checkpoint file's) equal: tensors bit for bit with their dtype and shape, dict keys
    as sets (a torch optimizer's ``state``: in order too), everything else by value."""
    if torch.is_tensor(theirs):
        assert torch.is_tensor(ours) and ours.dtype == theirs.dtype and torch.equal(ours, theirs), where
    elif isinstance(theirs, dict):
        assert list(ours) == list(theirs) if where.endswith("state") else set(ours) == set(theirs), where
        for key in theirs:
            assert_same_tree(ours[key], theirs[key], f"{where}.{key}")
    elif isinstance(theirs, (list, tuple)):
        assert len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert_same_tree(a, b, f"{where}[{i}]")
    else:
        assert ours == theirs, where
