"""Optimizer flavours: the one place that knows where each optimizer keeps its step, its scalars and its settings.

=================  ==========  ===========================  ==========================================
flavour            family      step lives in                 state besides the step
=================  ==========  ===========================  ==========================================
torch-adam         adam        ``state[p]["step"]`` float    exp_avg, exp_avg_sq (+ max_exp_avg_sq)
ds-fused-adam      adam        ``state[p]["step"]`` int      same; ``group["step"]`` is a stale copy
ds-cpu-adam        adam        ``state[p]["step"]`` int      same
apex-fused-adam    adam        ``group["step"]`` int         same
torch-sgd          sgd         none                          momentum_buffer
torch-rmsprop      rmsprop     ``state[p]["step"]`` float    square_avg (+ momentum_buffer, grad_avg)
torch-nadam        nadam       ``state[p]["step"]`` float    mu_product (0-dim), exp_avg, exp_avg_sq
torch-radam        radam       ``state[p]["step"]`` float    exp_avg, exp_avg_sq
torch-adamax       adamax      ``state[p]["step"]`` float    exp_avg, exp_inf
torch-adagrad      adagrad     ``state[p]["step"]`` float    sum
ds-cpu-adagrad     ds-adagrad  ``state[p]["step"]`` int      exp_avg_sq (a running sum of squares)
ds-lion            lion        ``state[p]["step"]`` int      exp_avg
=================  ==========  ===========================  ==========================================

State means the same thing within a family, so a restore may move between its flavours (a torch
AdamW run resumed under DeepSpeed FusedAdam); across families it is refused (the state would be
read as something it is not), unless the user resets the optimizer.

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

__all__ = [
    "Hyper",
    "Flavour",
    "FLAVOURS",
    "check_family",
    "get",
    "detect",
    "detect_live",
    "Detection",
    "hyper_from_group",
    "raw_group",
]

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


def _group_value(value: Any) -> Any:
    """A raw group value back as optimizers hold it: JSON lists were tuples (betas), repr'd floats were floats."""
    if isinstance(value, list):
        return tuple(_group_value(v) for v in value)
    if isinstance(value, str) and value in ("inf", "-inf", "nan"):
        return float(value)
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
    """Where one optimizer keeps its step and scalars, and which keys its param groups carry."""

    name: str
    step_in_state: bool  # per-parameter step in state[p]["step"]
    step_in_group: bool  # group["step"] is read (apex) or carried stale (ds-fused-adam)
    float_step: bool  # the step is a float32 tensor (torch) rather than an int
    description: str
    family: str = "adam"  # flavours of one family keep state that means the same thing
    scalars: Mapping[str, float] = field(default_factory=dict)  # 0-dim per-tensor state -> its value at reset
    live: tuple[str, ...] = ()  # "module:Class" of the live optimizer objects of this flavour

    @property
    def has_step(self) -> bool:
        return self.step_in_state or self.step_in_group

    def read_step(self, group: Mapping[str, Any], state: Mapping[str, Any]) -> int | None:
        """The step this optimizer would use for a state entry, or None when it has none (yet)."""
        if not self.has_step:
            return None
        raw = state.get("step") if self.step_in_state else group.get("step")
        if raw is None:
            return None
        value = float(raw.item() if torch.is_tensor(raw) else raw)
        if value < 0 or value != int(value):
            raise InputError(f"optimizer step {value} is not a non-negative whole number")
        return int(value)

    def make_state(
        self, tensors: Mapping[str, torch.Tensor], step: int, scalars: Mapping[str, torch.Tensor] | None = None
    ) -> dict[str, Any]:
        """One flat tensor's optimizer state as this optimizer keeps it: its step where it reads it,
        its 0-dim scalars, then every state tensor by key, in order (torch's own order)."""
        state: dict[str, Any] = {}
        if self.step_in_state:
            state["step"] = torch.tensor(float(step), dtype=torch.float32) if self.float_step else int(step)
        state.update(scalars or {})
        state.update(tensors)
        return state

    def update_group(self, live: dict[str, Any], hyper: Hyper, step: int, raw: Mapping[str, Any]) -> dict[str, Any]:
        """A live optimizer's group with the checkpoint's hyperparameters; its own switches
        (foreach, fused, capturable, ...) stay as the new run set them."""
        if self.family != "adam":
            group = {k: v for k, v in live.items() if k != "params"}
            group.update({k: _group_value(v) for k, v in raw.items() if k not in _TORCH_KEYS | {"params", "step"}})
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
            own = {k: _group_value(v) for k, v in raw.items() if k not in ("params", "step")}
            if self.step_in_group:
                own["step"] = int(step)
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
        Flavour("torch-sgd", False, False, False, "torch.optim.SGD: no step", "sgd", live=("torch.optim:SGD",)),
        Flavour(
            "torch-rmsprop",
            True,
            False,
            True,
            "torch.optim.RMSprop: float32 step",
            "rmsprop",
            live=("torch.optim:RMSprop",),
        ),
        Flavour(
            "torch-nadam",
            True,
            False,
            True,
            "torch.optim.NAdam: float32 step and a 0-dim mu_product per parameter",
            "nadam",
            scalars={"mu_product": 1.0},
            live=("torch.optim:NAdam",),
        ),
        Flavour(
            "torch-radam", True, False, True, "torch.optim.RAdam: float32 step", "radam", live=("torch.optim:RAdam",)
        ),
        Flavour(
            "torch-adamax",
            True,
            False,
            True,
            "torch.optim.Adamax: float32 step",
            "adamax",
            live=("torch.optim:Adamax",),
        ),
        Flavour(
            "torch-adagrad",
            True,
            False,
            True,
            "torch.optim.Adagrad: float32 step",
            "adagrad",
            live=("torch.optim:Adagrad",),
        ),
        Flavour(
            "ds-cpu-adagrad",
            True,
            False,
            False,
            "DeepSpeedCPUAdagrad: int step; exp_avg_sq is its running sum of squared gradients",
            "ds-adagrad",
            live=("deepspeed.ops.adagrad:DeepSpeedCPUAdagrad",),
        ),
        Flavour(
            "ds-lion",
            True,
            False,
            False,
            "DeepSpeed FusedLion / DeepSpeedCPULion: int step",
            "lion",
            live=("deepspeed.ops.lion:FusedLion", "deepspeed.ops.lion:DeepSpeedCPULion"),
        ),
    )
}


def check_family(source: str | None, target: Flavour, groups_state: bool) -> None:
    """A restore may move between flavours of one family; across families the state would be read
    as something it is not, so it is refused (one line) unless no optimizer state is restored."""
    if source is None or not groups_state or source not in FLAVOURS:
        return
    if FLAVOURS[source].family != target.family:
        raise InputError(
            f"the checkpoint holds {source} state ({FLAVOURS[source].family} family); {target.name} "
            f"({target.family} family) would read it as something it is not: restore into a "
            f"{FLAVOURS[source].family} optimizer, or reset the optimizer state"
        )


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


def _detect_beyond_adam(group_keys: set[str], states: list[Any], steps: list[Any]) -> tuple[str, str] | None:
    """(flavour, reason) for the optimizers that are not Adam, told by the keys only they write."""
    state_keys = {k for s in states if isinstance(s, Mapping) for k in s}
    int_steps = bool(steps) and all(
        isinstance(s, int) or (torch.is_tensor(s) and not s.is_floating_point()) for s in steps
    )
    torch_groups = {"foreach", "maximize", "differentiable"} & group_keys
    if {"nesterov", "dampening"} <= group_keys:
        return "torch-sgd", "param groups carry nesterov and dampening"
    if {"centered", "alpha"} <= group_keys:
        return "torch-rmsprop", "param groups carry centered and alpha"
    if "momentum_decay" in group_keys or "mu_product" in state_keys:
        return "torch-nadam", "param groups carry momentum_decay"
    if {"lr_decay", "initial_accumulator_value"} <= group_keys:
        return "torch-adagrad", "param groups carry lr_decay and initial_accumulator_value"
    if "exp_inf" in state_keys:
        return "torch-adamax", "state holds exp_inf"
    if torch_groups and "betas" in group_keys and "amsgrad" not in group_keys and not int_steps:
        return "torch-radam", "torch param groups with betas but no amsgrad, and no exp_inf"
    if int_steps and "betas" not in group_keys and state_keys - {"step"} == {"exp_avg_sq"}:
        return "ds-cpu-adagrad", "int steps, exp_avg_sq only, param groups without betas"
    if int_steps and "betas" in group_keys and "eps" not in group_keys:
        return "ds-lion", "int steps, param groups with betas but no eps"
    return None


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
    other = _detect_beyond_adam(group_keys, states, steps)
    if other is not None:
        return Detection(FLAVOURS[other[0]], cfg_adam_w, other[1])
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
    for flavour in FLAVOURS.values():
        for live in flavour.live:
            where, _, name = live.partition(":")
            if module.startswith(where) and cls.__name__ == name:
                return flavour
    raise InputError(
        f"cannot tell where {cls.__module__}.{cls.__name__} keeps its step; pass optimizer= one of "
        f"{', '.join(FLAVOURS)}"
    )
