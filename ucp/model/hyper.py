"""A param group's hyperparameters as ucp records them (Adam's names), and the raw group beside
them: what a restore writes back into the new run's groups."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Hyper", "TORCH_KEYS", "group_value", "hyper_from_group", "raw_group"]

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


#: the group keys Hyper names; anything else is the optimizer's own (kept in ``raw``)
_CORE_KEYS = {"lr", "betas", "eps", "weight_decay", "amsgrad", "bias_correction", "params", "step"}
#: torch's per-run switches: how the new run computes, never taken from the source
TORCH_KEYS = {"maximize", "foreach", "capturable", "differentiable", "fused", "decoupled_weight_decay"}


def _json_value(value: Any) -> Any:
    """A group value as JSON holds it (tensors as numbers, tuples as lists, non-finite floats as text)."""
    if torch.is_tensor(value):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, tuple):
        return [_json_value(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    return value


def group_value(value: Any) -> Any:
    """A raw group value back as optimizers hold it: JSON lists were tuples (betas), repr'd floats were floats."""
    if isinstance(value, list):
        return tuple(group_value(v) for v in value)
    if isinstance(value, str) and value in ("inf", "-inf", "nan"):
        return float(value)
    return value


def raw_group(group: Mapping[str, Any]) -> dict[str, Any]:
    """A param group's own keys as JSON-ready values (kept in ucp.json so the same flavour restores exactly)."""
    return {k: _json_value(v) for k, v in group.items() if k != "params"}


def _real(value: Any) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        or (torch.is_tensor(value) and value.numel() == 1)
    )


def hyper_from_group(group: Mapping[str, Any], adam_w_mode: bool | None) -> Hyper:
    """Read a param group of any flavour into neutral hyperparameters."""
    if "decoupled_weight_decay" in group:
        adam_w_mode = bool(group["decoupled_weight_decay"])
    extra = {k: _json_value(v) for k, v in group.items() if k not in _CORE_KEYS | TORCH_KEYS}
    betas = group.get("betas", (0.9, 0.999))
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(_real(b) for b in betas)):
        betas = (0.9, 0.999)  # not Adam's pair (a family with other settings: its own group is kept whole)
    return Hyper(
        lr=float(_json_value(group["lr"])),
        betas=(float(betas[0]), float(betas[1])),
        eps=float(group["eps"]) if _real(group.get("eps")) else 1e-8,  # Adafactor's is a pair
        weight_decay=float(group.get("weight_decay", 0.0)),
        amsgrad=bool(group.get("amsgrad", False)),
        bias_correction=bool(group.get("bias_correction", True)),
        adam_w_mode=adam_w_mode,
        extra=extra,
    )
