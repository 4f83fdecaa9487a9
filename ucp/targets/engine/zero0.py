"""A live engine without ZeRO (stage 0, DeepSpeed's default): every rank holds the whole model and optimizer.

fp32: the optimizer is the client's own, over the module's parameters. bf16 without ZeRO: DeepSpeed 0.19.8
wraps it in FP16_UnfusedOptimizer, which steps fp32 copies (``fp32_groups``, in step with the module's
``fp16_groups``), or, around DeepSpeed or Apex FusedAdam, in FP16_Optimizer, which steps one flat fp32 copy
per param group (``fp32_groups_flat``): the masters and optimizer state go to the copies and the module takes
them cast, as its own ``load_state_dict`` leaves them. In fp16 the wrapper keeps its loss scale in its own
fields (``loss_scale_config``): a checkpoint that ran in fp16 sets them as the wrapper's ``load_state_dict``
does; another keeps the ones the engine's config made.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ucp.deepspeed import states as ds_states
from ucp.errors import InputError
from ucp.model.detect import detect_live
from ucp.model.records import ParamState, Reader
from ucp.targets.engine.common import check_names
from ucp.targets.engine.named import stage_named

__all__ = ["restore_zero0"]

#: the wrappers DeepSpeed puts around the client optimizer without ZeRO, whose fp32 copies ucp fills: one per
#: parameter, or one flat tensor per param group (the fused wrapper, around DeepSpeed or Apex FusedAdam)
_FP32_COPIES = ("FP16_UnfusedOptimizer",)
_FLAT_COPIES = ("FP16_Optimizer",)


def restore_zero0(
    engine: Any,
    reader: Reader,
    *,
    optimizer: str | None,
    load_optimizer_states: bool,
    strict: bool,
    step_of: Callable[[ParamState], int] | None = None,
) -> None:
    """Load ``reader``'s weights (and optimizer state) into a live stage-0 engine on this rank."""
    check_names(engine, reader, strict=strict)
    opt = engine.optimizer
    module: dict[str, torch.Tensor] = dict(engine.module.named_parameters())
    wrapper = type(opt).__name__
    if wrapper in _FLAT_COPIES:
        named = _restore_flat(opt, module, reader, optimizer, load_optimizer_states, strict, step_of)
    else:
        if wrapper in _FP32_COPIES:
            copies: dict[int, torch.Tensor] = {
                id(lp): hp
                for lp_group, hp_group in zip(opt.fp16_groups, opt.fp32_groups)
                for lp, hp in zip(lp_group, hp_group)
            }
            named, inner = {name: copies.get(id(param), param) for name, param in module.items()}, opt.optimizer
        elif isinstance(opt, torch.optim.Optimizer):
            named, inner = module, opt
        else:
            raise InputError(
                f"{wrapper} is not an optimizer ucp restores without ZeRO (the client's torch optimizer, or "
                "DeepSpeed's bf16 wrappers FP16_UnfusedOptimizer and FP16_Optimizer)"
            )
        stage_named(
            named, inner if load_optimizer_states else None, reader, flavour=optimizer, strict=strict, step_of=step_of
        ).apply()
    with torch.no_grad():
        for name, param in module.items():
            if named[name] is not param:  # the module's bf16 weight from its restored fp32 copy
                param.copy_(named[name].to(param.dtype))
    if wrapper in _FP32_COPIES + _FLAT_COPIES:
        _restore_scale(opt, reader)


def _restore_scale(opt: Any, reader: Reader) -> None:
    """An fp16 wrapper's loss scale from a checkpoint that ran in fp16 (the fields its ``load_state_dict`` sets)."""
    config = getattr(opt, "loss_scale_config", None)
    if getattr(opt, "low_precision_dtype", None) != torch.float16 or reader.facts.info.dtype != "fp16":
        return
    scale = ds_states.loss_scale_of(reader.extras().get("loss_scaler"))
    if config is None or scale is None:
        return
    for key, value in scale.wrapper_fields().items():
        setattr(config, key, value)


def _restore_flat(
    opt: Any,
    module: dict[str, torch.Tensor],
    reader: Reader,
    flavour: str | None,
    load_optimizer_states: bool,
    strict: bool,
    step_of: Callable[[ParamState], int] | None,
) -> dict[str, torch.Tensor]:
    """FP16_Optimizer steps one flat fp32 master per param group (its members' masters one after the other):
    each member's master and state are loaded into its slice of the group's flat tensors, through
    :func:`stage_named` over per-member views, and the per-member state is then joined into the flat state.
    Returns each parameter's loaded tensor (its slice of the masters; a frozen one itself)."""
    inner = opt.optimizer
    name_of = {id(param): name for name, param in module.items()}
    views: list[list[torch.Tensor]] = []
    named: dict[str, torch.Tensor] = {}
    for lp_group, flat in zip(opt.fp16_groups, opt.fp32_groups_flat):
        at, row = 0, []
        for lp in lp_group:
            # a trained member's slice (stage_named gives optimizer state to tensors that require grad)
            view = flat.detach()[at : at + lp.numel()].view(lp.shape).requires_grad_()
            named[name_of[id(lp)]] = view
            row.append(view)
            at += lp.numel()
        views.append(row)
    held = dict(module)
    held.update(named)  # frozen parameters are loaded in place, trained ones into their slice of the masters
    shim = _PerMember([{**group, "params": row} for group, row in zip(inner.param_groups, views)])
    kind = flavour or detect_live(inner).name
    shimmed = shim if load_optimizer_states else None
    stage_named(held, shimmed, reader, flavour=kind, strict=strict, step_of=step_of).apply()
    if not load_optimizer_states:
        return held
    for g, (group, flat, row) in enumerate(zip(inner.param_groups, opt.fp32_groups_flat, views)):
        group.update({k: v for k, v in shim.param_groups[g].items() if k != "params"})
        entries = [shim.state[view] for view in row if view in shim.state]
        if not entries:
            continue
        if len(entries) != len(row):
            raise InputError(f"param group {g}: the checkpoint holds optimizer state for some of its members only")
        inner.state[flat] = _joined(entries, g)
    return held


class _PerMember:
    """A stand-in optimizer over per-member views, for :func:`stage_named`: its param groups and state."""

    def __init__(self, param_groups: list[dict[str, Any]]) -> None:
        self.param_groups = param_groups
        self.state: dict[torch.Tensor, dict[str, Any]] = {}


def _joined(entries: list[dict[str, Any]], group: int) -> dict[str, Any]:
    """Per-member optimizer state as the one flat tensor's: elementwise tensors joined in member order, the
    step and 0-dim scalars one for all (members that disagree cannot share a flat tensor)."""
    out: dict[str, Any] = {}
    for key, value in entries[0].items():
        if torch.is_tensor(value) and value.dim() > 0:
            out[key] = torch.cat([e[key].reshape(-1) for e in entries])
            continue
        values = {float(e[key]) for e in entries}
        if len(values) > 1:
            raise InputError(
                f"param group {group}: its members carry different {key!r} {sorted(values)}, but DeepSpeed's fused "
                "FP16_Optimizer steps them as one flat tensor: give an explicit step"
            )
        out[key] = value
    return out
