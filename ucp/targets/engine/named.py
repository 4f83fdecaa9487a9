"""Tensors known by name and the torch optimizer that steps them: weights, optimizer state and group settings
from a reader. A plain model's parameters (:func:`ucp.restore_torch`), or the fp32 copies an engine without ZeRO
steps in place of its low-precision parameters (:mod:`ucp.targets.engine.zero0`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, Protocol

import torch

from ucp.errors import InputError
from ucp.model import flavours
from ucp.model.detect import detect_live
from ucp.model.records import ParamState, Reader
from ucp.targets.blocks.stream import refuse_fp16_overflow
from ucp.targets.engine.common import match_groups

__all__ = ["load_named", "OptimizerLike"]

logger = logging.getLogger(__name__)


class OptimizerLike(Protocol):
    """What :func:`load_named` uses of an optimizer: a torch optimizer, or a stand-in over views of one's tensors."""

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...

    @property
    def state(self) -> MutableMapping[Any, Any]: ...


def load_named(
    params: Mapping[str, torch.Tensor],
    optimizer: OptimizerLike | None,
    reader: Reader,
    *,
    flavour: str | None = None,
    strict: bool = True,
    step_of: Callable[[ParamState], int] | None = None,
) -> None:
    """Copy each named tensor's fp32 master in (cast), and with ``optimizer`` its state where the flavour keeps
    it and its group's settings (``step_of`` overrides the steps). Tied aliases: name each tensor once."""
    facts = reader.facts
    expected = {m.name for m in facts.params}
    if strict and set(params) != expected:
        extra, lost = sorted(set(params) - expected), sorted(expected - set(params))
        raise InputError(
            f"parameters differ: model has {extra[:3]} not in the checkpoint, checkpoint has "
            f"{lost[:3]} not in the model; pass strict=False to restore the common ones"
        )
    refuse_fp16_overflow(reader, [n for n, p in params.items() if n in expected and p.dtype == torch.float16])
    names_of = {id(p): n for n, p in params.items()}
    live_members = [
        [names_of[id(p)] for p in g["params"] if id(p) in names_of]
        for g in (optimizer.param_groups if optimizer else [])
    ]
    matched = match_groups(reader, live_members, strict=strict) if optimizer else []
    kind = flavours.get(flavour) if flavour else detect_live(optimizer) if optimizer else None
    if kind is not None:  # before any tensor is touched
        flavours.check_family(facts.flavour, kind, any(g.state_keys for g in facts.groups), whole=True)
    given: dict[int | None, int] = {}  # each checkpoint group's step as its members were given it
    for name, param in params.items():
        if name not in expected:
            continue
        state = reader.read(name, moments=optimizer is not None)
        with torch.no_grad():
            param.copy_(state.fp32.to(param.dtype))
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
            optimizer.state[param] = new
    for g, group in enumerate(optimizer.param_groups if optimizer else []):
        source = matched[g]
        if source is None or kind is None:
            continue
        meta = facts.groups[source]
        if group.get("lr") != meta.hyper.lr:
            logger.info("param group %d: lr %s from the checkpoint replaces %s", g, meta.hyper.lr, group.get("lr"))
        group.update(
            {
                k: v
                for k, v in kind.update_group(
                    group, meta.hyper, given.get(source, int(meta.step or 0)), meta.raw
                ).items()
                if k != "params"
            }
        )


def _on_device(optimizer: OptimizerLike, param: torch.Tensor) -> bool:
    """torch Adam keeps the step on the parameter's device when capturable or fused."""
    for group in optimizer.param_groups:
        if any(p is param for p in group["params"]):
            return bool(group.get("capturable") or group.get("fused"))
    return False
