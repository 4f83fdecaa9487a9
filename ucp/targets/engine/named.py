"""Tensors known by name and the torch optimizer that steps them: weights, optimizer state and group settings
from a reader. A plain model's parameters (:func:`ucp.restore_torch`), or the fp32 copies an engine without ZeRO
steps in place of its low-precision parameters (:mod:`ucp.targets.engine.zero0`).

Call order: :func:`stage_named` checks everything (names, shapes, dtypes, param groups, the optimizer's family)
and reads every tensor into new ones, changing nothing; :meth:`StagedNamed.apply` then copies them in, which cannot
fail on what was checked. A restore that fails therefore leaves the model and the optimizer as they were.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ucp.errors import InputError
from ucp.model import flavours
from ucp.model.cast import narrowed
from ucp.model.detect import detect_live
from ucp.model.records import Facts, ParamState, Reader
from ucp.targets.engine.common import check_shapes, match_groups

__all__ = ["stage_named", "StagedNamed", "OptimizerLike"]

logger = logging.getLogger(__name__)


class OptimizerLike(Protocol):
    """What :func:`stage_named` uses of an optimizer: a torch optimizer, or a stand-in over views of one's tensors."""

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...

    @property
    def state(self) -> MutableMapping[Any, Any]: ...


@dataclass
class StagedNamed:
    """What a restore will put into named tensors and their optimizer, read and checked, not applied yet."""

    weights: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (live tensor, new value)
    state: list[tuple[torch.Tensor, dict[str, Any]]] = field(default_factory=list)  # (live tensor, its new state)
    groups: list[tuple[dict[str, Any], dict[str, Any]]] = field(default_factory=list)  # (live group, its new fields)
    optimizer: OptimizerLike | None = None

    def apply(self) -> None:
        """Copy everything in: nothing here can fail on a restore :func:`stage_named` accepted."""
        with torch.no_grad():
            for param, value in self.weights:
                param.copy_(value)
        if self.optimizer is not None:
            for param, entry in self.state:
                self.optimizer.state[param] = entry
        for group, fields in self.groups:
            group.update(fields)


def check_param_names(names: set[str], facts: Facts, *, strict: bool, what: str = "model") -> None:
    """With ``strict``, the tensors given and the checkpoint's parameters are the same names."""
    expected = {m.name for m in facts.params}
    if strict and names != expected:
        extra, lost = sorted(names - expected), sorted(expected - names)
        raise InputError(
            f"parameters differ: the {what} has {len(extra)} not in the checkpoint {extra[:3]}, the checkpoint has "
            f"{len(lost)} not in the {what} {lost[:3]}; pass strict=False to restore the common ones"
        )


def stage_named(
    params: Mapping[str, torch.Tensor],
    optimizer: OptimizerLike | None,
    reader: Reader,
    *,
    flavour: str | None = None,
    strict: bool = True,
    step_of: Callable[[ParamState], int] | None = None,
) -> StagedNamed:
    """Check ``reader`` against the named tensors and their optimizer, and read what :meth:`StagedNamed.apply` then
    puts in: each named tensor's fp32 master (cast), and with ``optimizer`` its state where the flavour keeps it and
    its group's settings (``step_of`` overrides the steps). Tied aliases: name each tensor once."""
    facts = reader.facts
    check_param_names(set(params), facts, strict=strict)
    expected = {m.name for m in facts.params}
    held = {name: param for name, param in params.items() if name in expected}
    check_shapes({name: tuple(param.shape) for name, param in held.items()}, facts)
    for name, param in held.items():
        if not param.is_floating_point():
            raise InputError(f"{name} is {param.dtype} in the model: ucp restores floating-point weights only")
    names_of = {id(p): n for n, p in params.items()}
    live_members = [
        [names_of[id(p)] for p in g["params"] if id(p) in names_of]
        for g in (optimizer.param_groups if optimizer else [])
    ]
    matched = match_groups(reader, live_members, strict=strict) if optimizer else []
    kind = flavours.get(flavour) if flavour else detect_live(optimizer) if optimizer else None
    if kind is not None:
        flavours.check_family(facts.flavour, kind, any(g.state_keys for g in facts.groups), whole=True)
    staged = StagedNamed(optimizer=optimizer)
    given: dict[int | None, int] = {}  # each checkpoint group's step as its members were given it
    for name, param in held.items():
        state = reader.read(name, moments=optimizer is not None)
        if tuple(state.fp32.shape) != tuple(param.shape):
            raise InputError(
                f"{name}: the checkpoint's file holds shape {tuple(state.fp32.shape)}, its record says "
                f"{facts.param(name).shape}: the checkpoint is damaged"
            )
        # an fp16 run's own weights fit fp16; any other run's are checked before they are cast to it
        value = state.fp32.to(param.dtype) if facts.info.dtype == "fp16" else narrowed(name, state.fp32, param.dtype)
        staged.weights.append((param, value.to(param.device)))
        if optimizer is not None and kind is not None and state.optim and param.requires_grad:
            index = facts.param(name).group
            step = int(step_of(state)) if step_of else int(state.step or 0)
            given.setdefault(index, step)
            new = kind.make_state(
                {k: v.to(param.device) for k, v in state.optim.items()},
                step,
                state.scalars,
                with_step=index is None or kind.group_has_step(facts.groups[index].raw),
            )
            if torch.is_tensor(new.get("step")) and _on_device(optimizer, param):
                new["step"] = new["step"].to(param.device)
            staged.state.append((param, new))
    for g, group in enumerate(optimizer.param_groups if optimizer else []):
        source = matched[g]
        if source is None or kind is None:
            continue
        meta = facts.groups[source]
        if group.get("lr") != meta.hyper.lr:
            logger.info("param group %d: lr %s from the checkpoint replaces %s", g, meta.hyper.lr, group.get("lr"))
        fields = kind.update_group(group, meta.hyper, given.get(source, int(meta.step or 0)), meta.raw)
        staged.groups.append((group, {k: v for k, v in fields.items() if k != "params"}))
    return staged


def _on_device(optimizer: OptimizerLike, param: torch.Tensor) -> bool:
    """torch Adam keeps the step on the parameter's device when capturable or fused."""
    for group in optimizer.param_groups:
        if any(p is param for p in group["params"]):
            return bool(group.get("capturable") or group.get("fused"))
    return False
