"""An fp16 run's loss scale, as DeepSpeed 0.19.8 keeps it, and the one a new fp16 run's config starts. Pure.

Two owners keep it. Under ZeRO the optimizer pickles its scaler object (``DynamicLossScaler``: the scale, the
iteration counters, the window and hysteresis; a static ``LossScaler``: the scale alone), and a load puts the
saved object in place of the new run's: the checkpoint's settings win over the new config's. Without ZeRO the
FP16 wrappers save the scale, the iteration counters, the factor and the window as fields of their state dict and
keep no hysteresis (an overflow halves the scale at once); a load sets those fields and keeps the rest.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ucp.model.options import Decided

__all__ = ["fp16_hysteresis_note", "fp16_start_note", "LossScale", "fresh_fp16_scale", "scale_from_wrapper"]

#: DeepSpeed 0.19.8's ``fp16`` defaults (``DeepSpeedFP16Config``)
_DEFAULTS = {
    "loss_scale": 0,
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "min_loss_scale": 1,
}


@dataclass(frozen=True)
class LossScale:
    """A loss scaler's numbers: a dynamic one's (every field) or a static one's (``cur_scale``)."""

    dynamic: bool
    cur_scale: float
    cur_iter: int = 0
    last_overflow_iter: int = -1
    scale_factor: float = 2.0
    scale_window: int = 1000
    min_scale: float = 1
    delayed_shift: int = 2  # the config's hysteresis: overflows tolerated before the scale is cut
    cur_hysteresis: int = 2  # how many of them are left
    consecutive_hysteresis: bool = False
    raise_error_at_min_scale: bool = True

    @classmethod
    def from_fields(cls, values: Mapping[str, Any]) -> LossScale:
        """From a scaler's attributes, others (DeepSpeed's ``dtype``) left out; TypeError when one is missing."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})

    def scaler_fields(self) -> dict[str, Any]:
        """The attributes of DeepSpeed's scaler object (``DynamicLossScaler``, or a static ``LossScaler``)."""
        if not self.dynamic:
            return {"cur_scale": self.cur_scale, "dynamic": False}
        return {
            "cur_scale": self.cur_scale,
            "dynamic": True,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "scale_factor": self.scale_factor,
            "scale_window": self.scale_window,
            "min_scale": self.min_scale,
            "delayed_shift": self.delayed_shift,
            "cur_hysteresis": self.cur_hysteresis,
            "consecutive_hysteresis": self.consecutive_hysteresis,
            "raise_error_at_min_scale": self.raise_error_at_min_scale,
        }

    def wrapper_fields(self) -> dict[str, Any]:
        """The fields DeepSpeed's FP16 wrappers (no ZeRO) save and load: no hysteresis, no minimum."""
        fields: dict[str, Any] = {"dynamic_loss_scale": self.dynamic, "cur_scale": self.cur_scale}
        fields["cur_iter"] = self.cur_iter
        if self.dynamic:
            fields.update(
                last_overflow_iter=self.last_overflow_iter,
                scale_factor=self.scale_factor,
                scale_window=self.scale_window,
            )
        return fields

    def problem(self) -> str | None:
        """What makes these numbers no scaler DeepSpeed could have saved (None when they are sound)."""
        numbers = {f.name: getattr(self, f.name) for f in fields(self)}
        flags = ("dynamic", "consecutive_hysteresis", "raise_error_at_min_scale")
        for name, value in numbers.items():
            if (name in flags) != isinstance(value, bool) or (
                name not in flags and not (isinstance(value, (int, float)) and math.isfinite(value))
            ):
                return f"{name} is {value!r:.40}"
        positive = ("cur_scale", "scale_factor", "scale_window", "min_scale") if self.dynamic else ("cur_scale",)
        for name in positive:
            if numbers[name] <= 0:
                return f"{name} is {numbers[name]!r}, not positive"
        return None

    def describe(self) -> str:
        """``dynamic from 2**16 (window 1000, hysteresis 2, minimum 1)``, or ``static at 128``."""
        if not self.dynamic:
            return f"static at {self.cur_scale:g}"
        power = math.log2(self.cur_scale) if self.cur_scale > 0 else 0
        start = f"2**{power:g}" if power == int(power) else f"{self.cur_scale:g}"
        return (
            f"dynamic from {start} (window {self.scale_window}, hysteresis {self.delayed_shift}, "
            f"minimum {self.min_scale:g})"
        )


def _fp16_block(ds_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The config's fp16 numbers over DeepSpeed's defaults (a value that is not a number, "auto", keeps the default)."""
    block = ds_config.get("fp16") if isinstance(ds_config, Mapping) else None
    out: dict[str, Any] = dict(_DEFAULTS)
    if isinstance(block, Mapping):
        for key, default in _DEFAULTS.items():
            value = block.get(key, default)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out[key] = value
        if isinstance(block.get("consecutive_hysteresis"), bool):
            out["consecutive_hysteresis"] = block["consecutive_hysteresis"]
    return out


def fresh_fp16_scale(ds_config: Mapping[str, Any] | None) -> LossScale:
    """The scaler a new fp16 run starts with under ``ds_config``'s ``fp16`` block (DeepSpeed's defaults for
    what it does not say): dynamic from ``2**initial_scale_power`` unless ``loss_scale`` fixes it."""
    block = _fp16_block(ds_config)
    if block["loss_scale"]:
        return LossScale(dynamic=False, cur_scale=float(block["loss_scale"]))
    hysteresis = int(block["hysteresis"])
    return LossScale(
        dynamic=True,
        cur_scale=float(2 ** int(block["initial_scale_power"])),
        scale_window=int(block["loss_scale_window"]),
        min_scale=block["min_loss_scale"],
        delayed_shift=hysteresis,
        cur_hysteresis=hysteresis,
        consecutive_hysteresis=bool(block.get("consecutive_hysteresis", False)),
    )


def scale_from_wrapper(fields: Mapping[str, Any], ds_config: Mapping[str, Any] | None) -> LossScale:
    """A wrapper's saved scale (its ``cur_scale``, counters, factor and window), with what it keeps no copy of
    (minimum, hysteresis) from the run's config: its hysteresis is whole, as a wrapper never uses it."""
    fresh = fresh_fp16_scale(ds_config)
    if not fields.get("dynamic_loss_scale"):
        return LossScale(dynamic=False, cur_scale=fields["cur_scale"], cur_iter=fields["cur_iter"])
    return replace(  # the numbers as saved (DeepSpeed starts the scale as an int, 2**power)
        fresh,
        dynamic=True,
        cur_scale=fields["cur_scale"],
        cur_iter=fields["cur_iter"],
        last_overflow_iter=fields["last_overflow_iter"],
        scale_factor=fields["scale_factor"],
        scale_window=fields["scale_window"],
    )


def fp16_hysteresis_note(decided: Decided) -> str | None:
    """An fp16 ZeRO run written without ZeRO: DeepSpeed's wrappers there keep no loss-scale hysteresis."""
    facts = decided.facts
    if decided.options.stage != 0 or decided.dtype != "fp16" or facts.info.dtype != "fp16" or not facts.info.zero_stage:
        return None
    return (
        "DeepSpeed's FP16 optimizer wrappers without ZeRO keep no loss-scale hysteresis: the scale, its "
        "counters and window are carried, and an overflow halves the scale at once from here on"
    )


def fp16_start_note(decided: Decided) -> str | None:
    """A run that becomes fp16 gets the scaler its config starts (DeepSpeed's load puts the checkpoint's in place)."""
    if decided.dtype != "fp16" or decided.facts.info.dtype == "fp16":
        return None
    return (
        f"the run becomes fp16: its loss scaler starts {fresh_fp16_scale(decided.facts.info.ds_config).describe()}, "
        "from the source config's fp16 block or DeepSpeed's defaults (DeepSpeed's load puts the checkpoint's "
        "scaler in place of the one the new run's config makes; ucp.restore(engine, ...) keeps the engine's)"
    )
