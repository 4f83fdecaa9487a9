"""One optimizer flavour: where the optimizer keeps its step, its scalars and its settings, and how a state
entry and a param group are written for it (the flavours themselves are :data:`ucp.model.flavours.FLAVOURS`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ucp.errors import InputError
from ucp.model.hyper import TORCH_KEYS, Hyper, group_value
from ucp.model.pieces import Pieces, Reserved

__all__ = ["ADAM_KEYS", "Flavour"]

logger = logging.getLogger(__name__)

#: the elementwise state an Adam keeps
ADAM_KEYS = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq"})
#: torch's switches a native file carries from a torch source (decoupled_weight_decay is Hyper's adam_w_mode)
_RUN_SWITCHES = sorted(TORCH_KEYS - {"decoupled_weight_decay"})


@dataclass(frozen=True)
class Flavour:
    """Where one optimizer keeps its step and scalars, and which keys its param groups carry."""

    name: str
    step_in_state: bool  # per-parameter step in state[p]["step"]
    step_in_group: bool  # group["step"] is read (apex) or carried stale (ds-fused-adam)
    float_step: bool  # the step is a float32 tensor (torch) rather than an int
    description: str
    family: str = "adam"  # flavours of one family keep state that means the same thing
    #: 0-dim per-tensor state -> its value at reset: a number, or the name of the group setting it starts at
    scalars: Mapping[str, float | str] = field(default_factory=dict)
    live: tuple[str, ...] = ()  # "module:Class" of the live optimizer objects of this flavour
    keys: frozenset[str] = ADAM_KEYS  # the elementwise state tensors it may keep
    #: 0-dim state the optimizer recomputes before it reads it (HF Adafactor's RMS of the tensor it steps): a
    #: value of one rank's partition, meaningless for another; not carried, and a loaded state without it is whole
    derived: tuple[str, ...] = ()
    #: a matrix's second moment is kept factored (rows, columns) when the optimizer sees it whole: the state
    #: is elementwise only on ZeRO's flat partitions, and its update scales by statistics of the tensor it steps
    factored: bool = False
    step_key: str = "step"  # the group key of a step kept in the group (schedule-free's "k")
    #: zero tensors and step 0 are what a fresh optimizer holds (schedule-free's z starts at the weights instead)
    zero_reset: bool = True

    @property
    def has_step(self) -> bool:
        return self.step_in_state or self.step_in_group

    def read_step(self, group: Mapping[str, Any], state: Mapping[str, Any]) -> int | None:
        """The step this optimizer would use for a state entry, or None when it has none (yet)."""
        if not self.has_step:
            return None
        raw = state.get("step") if self.step_in_state else group.get(self.step_key)
        if raw is None:
            return None
        value = float(raw.item() if torch.is_tensor(raw) else raw)
        if value < 0 or value != int(value):
            raise InputError(f"optimizer step {value} is not a non-negative whole number")
        return int(value)

    def group_has_step(self, group: Mapping[str, Any]) -> bool:
        """Whether this optimizer counts steps for a group: DeepSpeed Muon's own groups
        (``use_muon``) keep only a momentum, its Adam groups a step."""
        return self.has_step and not (self.family == "muon" and group.get("use_muon") is True)

    def zero12_whole_keys(self, group: Mapping[str, Any], *, offload: bool) -> tuple[str, ...]:
        """State keys this optimizer keeps per *whole* parameter at ZeRO-1/2 rather than as the rank's
        flat partition (``ucp.model.partition.zero12_whole_slots``): DeepSpeed Muon's momentum on its
        own groups, unless the optimizer is offloaded to CPU, where it is a flat partition (0.19.8)."""
        if offload or self.family != "muon" or group.get("use_muon") is not True:
            return ()
        return ("momentum_buffer",)

    def make_state(
        self,
        tensors: Mapping[str, torch.Tensor | Pieces | Reserved],
        step: int,
        scalars: Mapping[str, torch.Tensor] | None = None,
        *,
        with_step: bool = True,
    ) -> dict[str, Any]:
        """One flat tensor's optimizer state as this optimizer keeps it: its step where it reads it
        (``with_step`` False for a group without one, see :meth:`group_has_step`), its 0-dim scalars,
        then every state tensor by key, in order (torch's own order)."""
        state: dict[str, Any] = {}
        if self.step_in_state and with_step:
            state["step"] = torch.tensor(float(step), dtype=torch.float32) if self.float_step else int(step)
        state.update(scalars or {})
        state.update(tensors)
        return state

    def update_group(self, live: dict[str, Any], hyper: Hyper, step: int, raw: Mapping[str, Any]) -> dict[str, Any]:
        """A live optimizer's group with the checkpoint's hyperparameters; its own switches
        (foreach, fused, capturable, ...) stay as the new run set them."""
        if self.family != "adam":
            group = {k: v for k, v in live.items() if k != "params"}
            group.update({k: group_value(v) for k, v in raw.items() if k not in TORCH_KEYS | {"params", "step"}})
            if self.step_key != "step" and self.group_has_step(raw):
                group[self.step_key] = int(step)
            return group
        group = {k: v for k, v in live.items() if k != "params"}
        group.update(lr=hyper.lr, betas=tuple(hyper.betas), eps=hyper.eps, weight_decay=hyper.weight_decay)
        if "amsgrad" in group:
            group["amsgrad"] = hyper.amsgrad
        if "bias_correction" in group:
            group["bias_correction"] = hyper.bias_correction
        if self.step_in_group:
            current = group.get("step")
            group["step"] = torch.full_like(current, step) if torch.is_tensor(current) else int(step)
        group.update({k: v for k, v in hyper.extra.items() if k not in group or k == "initial_lr"})
        return group

    def make_group(self, hyper: Hyper, step: int, raw: Mapping[str, Any]) -> dict[str, Any]:
        """A param group (without ``params``) as this optimizer writes it in its state_dict.

        Beyond Adam, the source's own group is the group (ucp keeps it whole, ``raw``): a restore
        stays within a family, so its keys are the ones the optimizer reads."""
        if self.family != "adam":
            own = {k: group_value(v) for k, v in raw.items() if k not in ("params", "step")}
            if self.step_in_group and self.group_has_step(raw):
                own[self.step_key] = int(step)
            return own
        group: dict[str, Any] = {
            "lr": hyper.lr,
            "betas": tuple(hyper.betas),
            "eps": hyper.eps,
            "weight_decay": hyper.weight_decay,
        }
        if self.name == "torch-adam":
            group.update(
                amsgrad=hyper.amsgrad, maximize=False, foreach=None, capturable=False, differentiable=False, fused=None
            )
            # a torch source's own switches carry on, as DeepSpeed's native resume keeps them: fused and foreach
            # round differently, so dropping fused=True moved a same-size resume off the native one (1.2e-7)
            group.update({k: group_value(raw[k]) for k in _RUN_SWITCHES if k in raw})
            if hyper.adam_w_mode is not None:
                group["decoupled_weight_decay"] = hyper.adam_w_mode
        else:
            group["bias_correction"] = hyper.bias_correction
            if self.name == "ds-cpu-adam":
                group["amsgrad"] = hyper.amsgrad
        if self.step_in_group:
            # apex reads it; DeepSpeed FusedAdam only seeds new state from it, so the real count is safest
            group["step"] = int(step)
        group.update({k: v for k, v in hyper.extra.items() if k not in group})
        return group
