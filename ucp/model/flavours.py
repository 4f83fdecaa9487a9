"""Optimizer flavours: the one place that knows where each Adam keeps its step and its settings.

=================  ===============================  ===========================================
flavour            step lives in                     type
=================  ===============================  ===========================================
torch-adam         ``state[p]["step"]``              0-dim float32 tensor (torch.optim.Adam/AdamW)
ds-fused-adam      ``state[p]["step"]``              int; ``group["step"]`` is a stale copy (0)
ds-cpu-adam        ``state[p]["step"]``              int (DeepSpeedCPUAdam)
apex-fused-adam    ``group["step"]``                 int (an int tensor when capturable)
=================  ===============================  ===========================================

Call order for a target: ``flavour.make_group(hyper, step)`` for each param group (or
``flavour.update_group(live, hyper, step)`` for a live one), then ``flavour.make_state(tensors,
step)`` for each flat tensor the optimizer owns. Sources call :func:`detect` once on the optimizer's
state dict and then :meth:`Flavour.read_step` per state entry.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ucp.errors import InputError

__all__ = ["Hyper", "Flavour", "FLAVOURS", "get", "detect", "detect_live", "Detection", "hyper_from_group", "raw_group"]

logger = logging.getLogger(__name__)


@dataclass
class Hyper:
    """Adam hyperparameters of one param group, in flavour-neutral form."""

    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    amsgrad: bool = False
    bias_correction: bool = True
    adam_w_mode: bool | None = None  # None: the source did not say (client optimizer)
    extra: dict[str, Any] = field(default_factory=dict)  # other keys (initial_lr from schedulers, ...)

    def to_json(self) -> dict[str, Any]:
        return {
            "lr": self.lr,
            "betas": list(self.betas),
            "eps": self.eps,
            "weight_decay": self.weight_decay,
            "amsgrad": self.amsgrad,
            "bias_correction": self.bias_correction,
            "adam_w_mode": self.adam_w_mode,
            "extra": self.extra,
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Hyper:
        return cls(
            lr=float(raw["lr"]),
            betas=tuple(raw.get("betas", (0.9, 0.999))),
            eps=float(raw.get("eps", 1e-8)),
            weight_decay=float(raw.get("weight_decay", 0.0)),
            amsgrad=bool(raw.get("amsgrad", False)),
            bias_correction=bool(raw.get("bias_correction", True)),
            adam_w_mode=raw.get("adam_w_mode"),
            extra=dict(raw.get("extra", {})),
        )


_CORE_KEYS = {"lr", "betas", "eps", "weight_decay", "amsgrad", "bias_correction", "params", "step"}
_TORCH_KEYS = {"maximize", "foreach", "capturable", "differentiable", "fused", "decoupled_weight_decay"}


def _json_value(value: Any) -> Any:
    if torch.is_tensor(value):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, tuple):
        return [_json_value(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    return value


def raw_group(group: Mapping[str, Any]) -> dict[str, Any]:
    """A param group's own keys as JSON-ready values (kept in ucp.json so the same flavour restores exactly)."""
    return {k: _json_value(v) for k, v in group.items() if k != "params"}


def hyper_from_group(group: Mapping[str, Any], adam_w_mode: bool | None) -> Hyper:
    """Read a param group of any flavour into neutral hyperparameters."""
    if "decoupled_weight_decay" in group:
        adam_w_mode = bool(group["decoupled_weight_decay"])
    extra = {k: _json_value(v) for k, v in group.items() if k not in _CORE_KEYS | _TORCH_KEYS}
    return Hyper(
        lr=float(_json_value(group["lr"])),
        betas=tuple(float(b) for b in group.get("betas", (0.9, 0.999))),  # type: ignore[arg-type]
        eps=float(group.get("eps", 1e-8)),
        weight_decay=float(group.get("weight_decay", 0.0)),
        amsgrad=bool(group.get("amsgrad", False)),
        bias_correction=bool(group.get("bias_correction", True)),
        adam_w_mode=adam_w_mode,
        extra=extra,
    )


@dataclass(frozen=True)
class Flavour:
    """Where one optimizer keeps its step and which keys its param groups carry."""

    name: str
    step_in_state: bool  # per-parameter step in state[p]["step"]
    step_in_group: bool  # group["step"] is read (apex) or carried stale (ds-fused-adam)
    float_step: bool  # the step is a float32 tensor (torch) rather than an int
    description: str

    def read_step(self, group: Mapping[str, Any], state: Mapping[str, Any]) -> int | None:
        """The step this optimizer would use for a state entry, or None when it has none yet."""
        raw = state.get("step") if self.step_in_state else group.get("step")
        if raw is None:
            return None
        value = float(raw.item() if torch.is_tensor(raw) else raw)
        if value < 0 or value != int(value):
            raise InputError(f"optimizer step {value} is not a non-negative whole number")
        return int(value)

    def make_state(self, tensors: Mapping[str, torch.Tensor], step: int) -> dict[str, Any]:
        """One flat tensor's optimizer state as this optimizer keeps it: its step where it reads it, then
        every state tensor by key, in order."""
        state: dict[str, Any] = {}
        if self.step_in_state:
            state["step"] = torch.tensor(float(step), dtype=torch.float32) if self.float_step else int(step)
        state.update(tensors)
        return state

    def update_group(self, live: dict[str, Any], hyper: Hyper, step: int) -> dict[str, Any]:
        """A live optimizer's group with the checkpoint's hyperparameters; its own switches
        (foreach, fused, capturable, ...) stay as the new run set them."""
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

    def make_group(self, hyper: Hyper, step: int) -> dict[str, Any]:
        """A param group (without ``params``) as this optimizer writes it in its state_dict."""
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


FLAVOURS: dict[str, Flavour] = {
    f.name: f
    for f in (
        Flavour("torch-adam", True, False, True, "torch.optim.Adam / AdamW: per-parameter float32 step tensor"),
        Flavour(
            "ds-fused-adam",
            True,
            True,
            False,
            "DeepSpeed FusedAdam: per-parameter int step; group['step'] is a stale copy left at 0",
        ),
        Flavour("ds-cpu-adam", True, False, False, "DeepSpeedCPUAdam: per-parameter int step"),
        Flavour("apex-fused-adam", False, True, False, "Apex FusedAdam: one int step per param group"),
    )
}


def get(name: str) -> Flavour:
    try:
        return FLAVOURS[name]
    except KeyError:
        raise InputError(f"unknown optimizer flavour {name!r}; choose one of {', '.join(FLAVOURS)}") from None


@dataclass
class Detection:
    """What :func:`detect` concluded and why; warnings are surfaced by ``ucp inspect``."""

    flavour: Flavour | None
    adam_w_mode: bool | None
    reason: str
    warnings: list[str] = field(default_factory=list)


def _ds_config_optimizer(ds_config: Mapping[str, Any] | None) -> tuple[str | None, bool | None, bool]:
    """(type, adam_w_mode, offload) from a DeepSpeed config, where it names the optimizer."""
    if not isinstance(ds_config, Mapping):
        return None, None, False
    zero = ds_config.get("zero_optimization") or {}
    offload = (
        isinstance(zero, Mapping)
        and isinstance(zero.get("offload_optimizer"), Mapping)
        and zero["offload_optimizer"].get("device") in ("cpu", "nvme")
    )
    opt = ds_config.get("optimizer")
    if not isinstance(opt, Mapping) or not opt.get("type"):
        return None, None, bool(offload)
    kind = str(opt["type"]).lower()
    params = opt.get("params") or {}
    adam_w = params.get("adam_w_mode", kind == "adamw") if kind in ("adam", "adamw") else None
    return kind, adam_w, bool(offload)


def detect(
    optimizer_state: Mapping[str, Any], ds_config: Mapping[str, Any] | None = None, override: str | None = None
) -> Detection:
    """Tell the flavour from a (base) optimizer state dict: where the step lives and its type."""
    _, cfg_adam_w, offload = _ds_config_optimizer(ds_config)
    groups = list(optimizer_state.get("param_groups") or [])
    decoupled = {bool(g["decoupled_weight_decay"]) for g in groups if "decoupled_weight_decay" in g}
    if len(decoupled) == 1:  # torch >= 2.4 writes it: AdamW True, Adam False
        cfg_adam_w = decoupled.pop()
    states = list((optimizer_state.get("state") or {}).values())
    if override is not None:
        return Detection(get(override), cfg_adam_w, "given by the user")
    steps = [s.get("step") for s in states if isinstance(s, Mapping) and "step" in s]
    group_keys = set().union(*(g.keys() for g in groups)) if groups else set()
    warnings: list[str] = []
    if steps and all(torch.is_tensor(s) and s.is_floating_point() for s in steps):
        return Detection(FLAVOURS["torch-adam"], cfg_adam_w, "per-parameter float step tensors")
    if steps and all(isinstance(s, int) or (torch.is_tensor(s) and not s.is_floating_point()) for s in steps):
        if "step" in group_keys or (not offload and "amsgrad" not in group_keys):
            flavour = FLAVOURS["ds-fused-adam"]
            stale = [g.get("step") for g in groups if "step" in g]
            real = max(int(s) for s in steps if s is not None)
            if stale and any(int(v) != real for v in stale):
                warnings.append(
                    f"group['step'] reads {sorted({int(v) for v in stale})} while parameters took {real} steps: "
                    "DeepSpeed FusedAdam keeps its real counter per parameter; the stale group copy is ignored"
                )
            return Detection(flavour, cfg_adam_w, "per-parameter int steps with a group step key", warnings)
        return Detection(FLAVOURS["ds-cpu-adam"], cfg_adam_w, "per-parameter int steps, no group step")
    if not steps and groups and all("step" in g for g in groups):
        return Detection(FLAVOURS["apex-fused-adam"], cfg_adam_w, "group steps only")
    if not states:
        return Detection(None, cfg_adam_w, "the optimizer has taken no step yet")
    return Detection(None, cfg_adam_w, "no step found where any known Adam keeps it")


def detect_live(optimizer: Any) -> Flavour:
    """The flavour of a live optimizer object (the base optimizer inside a DeepSpeed engine)."""
    cls = type(optimizer)
    module = cls.__module__
    if module.startswith("apex.") and cls.__name__ == "FusedAdam":
        return FLAVOURS["apex-fused-adam"]
    if module.startswith("deepspeed.ops.adam") and cls.__name__ == "FusedAdam":
        return FLAVOURS["ds-fused-adam"]
    if module.startswith("deepspeed.ops.adam") and "CPUAdam" in cls.__name__:
        return FLAVOURS["ds-cpu-adam"]
    if isinstance(optimizer, torch.optim.Adam):  # AdamW subclasses Adam
        return FLAVOURS["torch-adam"]
    raise InputError(
        f"cannot tell where {cls.__module__}.{cls.__name__} keeps its step; pass optimizer= one of "
        f"{', '.join(FLAVOURS)}"
    )
