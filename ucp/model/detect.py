"""Which flavour wrote a checkpoint (from its state dict and DeepSpeed config) or owns a live
optimizer: keys only each optimizer writes, never a guess; unknown state is refused in one line."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ucp.errors import InputError
from ucp.model.flavours import FLAVOURS, Flavour, check_keys, get

if TYPE_CHECKING:
    from ucp.model.options import Decided

__all__ = [
    "wide_state_note",
    "nvme_note",
    "Detection",
    "detect",
    "detect_live",
    "offloads_optimizer",
    "round_robin_gradients",
    "mics_shard_size",
    "offloads_to_nvme",
    "partial_offload_ratio",
    "unsaved_state_note",
    "unsaved_state_reason",
    "LowPrecisionMasters",
    "low_precision_masters",
]

logger = logging.getLogger(__name__)


@dataclass
class Detection:
    """What :func:`detect` concluded and why; warnings are surfaced by ``ucp inspect``."""

    flavour: Flavour | None
    adam_w_mode: bool | None
    reason: str
    warnings: list[str] = field(default_factory=list)


def offloads_optimizer(ds_config: Mapping[str, Any] | None) -> bool:
    """Whether a DeepSpeed config offloads the optimizer (``zero_optimization.offload_optimizer`` to cpu or nvme)."""
    zero = ds_config.get("zero_optimization") if isinstance(ds_config, Mapping) else None
    offload = zero.get("offload_optimizer") if isinstance(zero, Mapping) else None
    return isinstance(offload, Mapping) and offload.get("device") in ("cpu", "nvme")


def offloads_to_nvme(ds_config: Mapping[str, Any] | None) -> bool:
    """Whether a DeepSpeed config swaps the optimizer state to NVMe (ZeRO-Infinity): then a checkpoint's optim
    files hold no fp32 masters or moments, its ``offloaded_tensors`` swap files do."""
    zero = ds_config.get("zero_optimization") if isinstance(ds_config, Mapping) else None
    offload = zero.get("offload_optimizer") if isinstance(zero, Mapping) else None
    return isinstance(offload, Mapping) and offload.get("device") == "nvme"


def partial_offload_ratio(ds_config: Mapping[str, Any] | None) -> float | None:
    """ZeRO-Offload++'s ``offload_optimizer.ratio`` when below 1 (ZeRO-3): the share of each rank's sub-groups its
    CPU optimizer steps; DeepSpeed 0.19.8 steps the others on the GPU with a second torch AdamW whose state its
    checkpoints do not hold. None when the whole optimizer is offloaded, or not at all."""
    if not offloads_optimizer(ds_config):
        return None
    ratio = ds_config["zero_optimization"]["offload_optimizer"].get("ratio")  # type: ignore[index]
    return float(ratio) if isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and ratio < 1 else None


def unsaved_state_reason(ds_config: Mapping[str, Any] | None) -> str:
    """Why a trained run's save holds no optimizer state: the modes whose optimizer steps in a process of its own,
    out of the engine's state dict (both seen in real DeepSpeed 0.19.8 saves on an H200: empty ``state``, no
    step), or a save that left it out."""
    zero = ds_config.get("zero_optimization") if isinstance(ds_config, Mapping) else None
    offload = zero.get("offload_optimizer") if isinstance(zero, Mapping) else None
    zenflow = zero.get("zenflow") if isinstance(zero, Mapping) else None
    if isinstance(offload, Mapping) and offload.get("super_offload") is True:
        return (
            "SuperOffload (offload_optimizer.super_offload) steps its CPU Adam in a worker process whose moments "
            "and step DeepSpeed 0.19.8 does not save"
        )
    if isinstance(zenflow, Mapping) and zenflow.get("overlap_step") is True:
        return (
            "ZenFlow's overlap_step steps its CPU Adam in an optimizer process whose moments and step DeepSpeed "
            "0.19.8 does not save"
        )
    return "the optimizer's state was not saved"


def unsaved_state_note(ds_config: Mapping[str, Any] | None, applied_steps: int, reset: str | None = None) -> str | None:
    """What to say of a save whose optimizer holds no state after ``applied_steps`` steps (None before any);
    ``reset``: ucp wrote it with the optimizer reset, for that flavour."""
    if reset is not None:
        return (
            f"ucp wrote this checkpoint with the optimizer reset (ucp restore --step reset): {reset} starts every "
            "moment at zero and every step at 0 when a run loads it; restore it again with --step reset"
        )
    if applied_steps <= 0:
        return None
    return (
        f"the engine applied {applied_steps} optimizer steps, but the save holds no optimizer state: "
        f"{unsaved_state_reason(ds_config)}; it carries the weights alone, and any resume from it, DeepSpeed's own "
        "included, starts the moments at zero (a restore says so with --step reset)"
    )


def round_robin_gradients(ds_config: Mapping[str, Any] | None) -> bool:
    """Whether a DeepSpeed config flattens ZeRO-1/2 groups in round-robin order
    (``zero_optimization.round_robin_gradients``; ``ucp.model.partition.round_robin_order``)."""
    zero = ds_config.get("zero_optimization") if isinstance(ds_config, Mapping) else None
    return isinstance(zero, Mapping) and zero.get("round_robin_gradients") is True


def mics_shard_size(ds_config: Mapping[str, Any] | None) -> int:
    """MiCS's shard size (``zero_optimization.mics_shard_size``, ZeRO-3, DeepSpeed before 0.19.8): the run
    partitioned its parameters and optimizer state over groups of this many ranks; 0 when off."""
    zero = ds_config.get("zero_optimization") if isinstance(ds_config, Mapping) else None
    size = zero.get("mics_shard_size") if isinstance(zero, Mapping) else None
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else 0


@dataclass(frozen=True)
class LowPrecisionMasters:
    """DeepSpeed's masters kept below fp32 (``bf16_master_weights_and_grads``, ``fp16_master_weights_and_grads``)."""

    masters: str  # bf16 | fp16: the dtype of the flat master partitions in the optim files
    state: str  # the dtype of the optimizer's moments: fp32 (CPU Adam's fp32_optimizer_states) or bf16
    option: str  # the config key that asked for it

    @property
    def wide_state(self) -> bool:
        """The moments are wider than the masters: DeepSpeed 0.19.8's own load casts them down to the masters'."""
        return self.state == "fp32"


def low_precision_masters(ds_config: Mapping[str, Any] | None) -> LowPrecisionMasters | None:
    """What a DeepSpeed config says of its masters, or None for fp32 masters (the default). DeepSpeed 0.19.8
    allows bf16 masters with fp32 moments only under ZeRO-Offload with CPU Adam, and ``bf16_optimizer_states``
    keeps the moments bf16 too; fp16 masters need CPU Adam (fp32 moments)."""
    if not isinstance(ds_config, Mapping):
        return None
    for section, dtype in (("bf16", "bf16"), ("bfloat16", "bf16"), ("fp16", "fp16")):
        block = ds_config.get(section)
        option = f"{'fp16' if dtype == 'fp16' else 'bf16'}_master_weights_and_grads"
        if isinstance(block, Mapping) and block.get("enabled", False) and block.get(option) is True:
            state = "bf16" if dtype == "bf16" and block.get("bf16_optimizer_states") is True else "fp32"
            return LowPrecisionMasters(dtype, state, option)
    return None


def _ds_config_optimizer(ds_config: Mapping[str, Any] | None) -> tuple[str | None, bool | None, bool]:
    """(type, adam_w_mode, offload) from a DeepSpeed config, where it names the optimizer."""
    if not isinstance(ds_config, Mapping):
        return None, None, False
    offload = offloads_optimizer(ds_config)
    opt = ds_config.get("optimizer")
    if not isinstance(opt, Mapping) or not opt.get("type"):
        return None, None, offload
    kind = str(opt["type"]).lower()
    params = opt.get("params") or {}
    adam_w = params.get("adam_w_mode", kind == "adamw") if kind in ("adam", "adamw") else None
    return kind, adam_w, offload


#: group settings only one optimizer has (checked before the looser tests below)
_SIGNATURES = (
    ({"rho"}, "torch-adadelta"),
    ({"etas", "step_sizes"}, "torch-rprop"),
    ({"lambd", "t0"}, "torch-asgd"),
    ({"beta2_decay"}, "torch-adafactor"),
    ({"clip_threshold", "decay_rate"}, "hf-adafactor"),
    ({"weight_sum", "lr_max", "silent_sgd_phase"}, "sf-radam"),
    ({"weight_sum", "lr_max", "betas"}, "sf-adamw"),
    ({"weight_sum", "lr_max", "momentum"}, "sf-sgd"),
)


def _detect_beyond_adam(group_keys: set[str], states: list[Any], steps: list[Any]) -> tuple[str, str] | None:
    """(flavour, reason) for the optimizers that are not Adam, told by the keys only they write."""
    state_keys = {k for s in states if isinstance(s, Mapping) for k in s}
    int_steps = bool(steps) and all(
        isinstance(s, int) or (torch.is_tensor(s) and not s.is_floating_point()) for s in steps
    )
    torch_groups = {"foreach", "maximize", "differentiable"} & group_keys
    for signature, name in _SIGNATURES:
        if signature <= group_keys:
            return name, f"param groups carry {' and '.join(sorted(signature))}"
    if "use_muon" in group_keys:
        if steps and not int_steps:
            return "ds-muon-torch-adam", "param groups carry use_muon; the Adam groups keep float step tensors"
        return "ds-muon", "param groups carry use_muon (DeepSpeed MuonWithAuxAdam)"
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


def _a_number(value: Any) -> bool:
    """A step as optimizers keep it: an int, a float, or a one-element tensor."""
    if torch.is_tensor(value):
        return value.numel() == 1
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def detect(
    optimizer_state: Mapping[str, Any], ds_config: Mapping[str, Any] | None = None, override: str | None = None
) -> Detection:
    """Tell the flavour from a (base) optimizer state dict: where the step lives and its type; state that
    flavour does not keep is refused in one line (:func:`ucp.model.flavours.check_keys`)."""
    found = _detect(optimizer_state, ds_config, override)
    if found.flavour is None:
        return found
    entries = [s for s in (optimizer_state.get("state") or {}).values() if isinstance(s, Mapping)]
    zero_dim = {k for s in entries for k, v in s.items() if k != "step" and torch.is_tensor(v) and v.dim() == 0}
    keys = {k for s in entries for k in s if k != "step"} - zero_dim
    check_keys(found.flavour.name, keys, zero_dim)
    derived = sorted(zero_dim & set(found.flavour.derived))
    if derived:
        found.warnings.append(
            f"{', '.join(derived)} is not carried: {found.flavour.name} recomputes it from the weights at every step "
            "before it reads it (a value of each rank's partition, not of a parameter)"
        )
    return found


def _detect(optimizer_state: Mapping[str, Any], ds_config: Mapping[str, Any] | None, override: str | None) -> Detection:
    _, cfg_adam_w, offload = _ds_config_optimizer(ds_config)
    groups = list(optimizer_state.get("param_groups") or [])
    decoupled = {bool(g["decoupled_weight_decay"]) for g in groups if "decoupled_weight_decay" in g}
    if len(decoupled) == 1:  # torch >= 2.4 writes it: AdamW True, Adam False
        cfg_adam_w = decoupled.pop()
    states = list((optimizer_state.get("state") or {}).values())
    if override is not None:
        return Detection(get(override), cfg_adam_w, "given by the user")
    steps = [s.get("step") for s in states if isinstance(s, Mapping) and "step" in s]
    odd = [s for s in steps if not _a_number(s)]
    if odd:  # read as "no step found", the steps would be dropped: damage, said in one line
        raise InputError(f"an optimizer state entry's step is {odd[0]!r:.40}, not a number: the file is damaged")
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


def wide_state_note(decided: Decided) -> str | None:
    """Low-precision masters with fp32 moments: DeepSpeed's own load casts the moments; ucp's live restore keeps
    them."""
    low = low_precision_masters(decided.facts.info.ds_config)
    if low is None or not low.wide_state or decided.options.stage == 0 or decided.options.reset:
        return None
    return (
        f"the source kept {low.masters} masters with fp32 moments ({low.option}): if the new run keeps "
        f"{low.masters} masters too, DeepSpeed 0.19.8's load_checkpoint casts the moments to {low.masters}; "
        "ucp.restore(engine, ...) keeps them fp32"
    )


def nvme_note(decided: Decided) -> str | None:
    """A source that swapped its optimizer to NVMe: the files written hold every state themselves."""
    if not offloads_to_nvme(decided.facts.info.ds_config) or decided.options.stage == 0:
        return None
    return (
        "the source swapped its optimizer to NVMe; these files hold every state themselves: load them in a "
        "run that offloads the optimizer to CPU memory or keeps it on the accelerator (an NVMe-offload run loads "
        "only its own saves' offloaded_tensors/, and DeepSpeed 0.19.8 resumes those wrong: docs/format.md)"
    )
