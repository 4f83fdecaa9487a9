"""The ``optimizer`` entry of a stage-0 save read apart: the torch optimizer's state_dict inside DeepSpeed's FP16
wrappers (their fp32 masters and loss scale), its param groups and its state by index (``ucp.sources.zero0``)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from ucp.deepspeed.fields import as_int, need_list, need_mapping, need_tensor
from ucp.deepspeed.optim_states import FUSED_MASTERS, STEP_KEY, UNFUSED_INNER, UNFUSED_MASTERS, flat_state_scalars
from ucp.deepspeed.states import scaler_object
from ucp.errors import InputError
from ucp.model.loss_scale import scale_from_wrapper
from ucp.sources.zero0_placement import unflatten

__all__ = ["entry_keys", "param_groups", "unwrap"]

logger = logging.getLogger(__name__)

_INNER, _MASTERS, _FLAT_MASTERS = UNFUSED_INNER, UNFUSED_MASTERS, FUSED_MASTERS
#: the loss-scale fields DeepSpeed's FP16 wrappers save (the last three with a dynamic scale only)
_WRAPPER_SCALE = ("cur_scale", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window")


def unwrap(
    opt: Mapping[str, Any],
    candidates: list[tuple[str, torch.Tensor]],
    head_config: Mapping[str, Any],
    name: str,
) -> tuple[Mapping[str, Any], list[list[torch.Tensor]] | None, dict[str, Any] | None]:
    """The torch optimizer's state_dict and, under DeepSpeed's FP16 wrappers, its fp32 masters per group
    (the fused one's flat groups cut per parameter, see :func:`~ucp.sources.zero0_placement.unflatten`); the
    wrapper's loss scale (as the scaler a ZeRO run keeps, its minimum and hysteresis from ``head_config``, the
    run's DeepSpeed config) and gradient clipping are returned third, for ``extras`` (None without a wrapper).
    ``name``: the file, for messages."""
    fused = _FLAT_MASTERS in opt
    if not fused and _MASTERS not in opt:
        if not {"state", "param_groups"} <= set(opt):
            raise InputError(
                f"{name}: optimizer holds {sorted(map(str, opt))[:6]}, neither a torch optimizer's state_dict "
                "nor one of DeepSpeed's FP16 optimizer wrappers': the file is damaged or not from DeepSpeed"
            )
        return opt, None, None
    dynamic = opt.get("dynamic_loss_scale", False)  # the fused wrapper saves no scale when it does not scale
    if not isinstance(dynamic, bool):
        raise InputError(f"{name}: optimizer dynamic_loss_scale is {dynamic!r:.40}, not a flag: file damaged")
    numbers = {"cur_scale": 1.0, "cur_iter": 0} | {k: opt[k] for k in _WRAPPER_SCALE if k in opt}
    for key in ("cur_scale", "cur_iter", *(_WRAPPER_SCALE[2:] if dynamic else ())):
        value = numbers.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InputError(f"{name}: optimizer {key} is {value!r:.40}, not a number: file damaged")
    # the wrapper keeps no minimum or hysteresis: those come from the run's fp16 config, the hysteresis whole
    scale = scale_from_wrapper({"dynamic_loss_scale": dynamic, **numbers}, head_config)
    if scale.problem() is not None:
        raise InputError(f"{name}: the optimizer's loss scale is damaged: {scale.problem()}")
    zero: dict[str, Any] = {"loss_scaler": scaler_object(scale), "dynamic_loss_scale": dynamic}
    clip = opt.get("clip_grad")
    if isinstance(clip, (int, float)) and not isinstance(clip, bool):
        zero["clip_grad"] = float(clip)
    inner = need_mapping(opt.get(_INNER), f"{name}: optimizer {_INNER}")
    if fused:
        flats = [
            need_tensor(t, f"{name}: optimizer {_FLAT_MASTERS}[{g}]")
            for g, t in enumerate(need_list(opt[_FLAT_MASTERS], f"{name}: optimizer {_FLAT_MASTERS}"))
        ]
        unflat, masters = unflatten(inner, flats, candidates, name)
        return unflat, masters, zero
    masters = [
        [need_tensor(t, f"{name}: optimizer {_MASTERS}[{g}]") for t in need_list(group, f"{name}: {_MASTERS}[{g}]")]
        for g, group in enumerate(need_list(opt[_MASTERS], f"{name}: optimizer {_MASTERS}"))
    ]
    return inner, masters, zero


def param_groups(
    inner: Mapping[str, Any], name: str
) -> tuple[list[Mapping[str, Any]], list[list[int]], Mapping[int, Any]]:
    """Param groups, each group's optimizer indices, and the state by index: every index in one group
    only, and state for every index or for none."""
    groups = [
        need_mapping(g, f"{name}: a param group")
        for g in need_list(inner.get("param_groups") or [], f"{name}: optimizer param_groups")
    ]
    members = [
        [
            as_int(p, f"{name}: param group {g} params entry")
            for p in need_list(group.get("params"), f"{name}: param group {g} params")
        ]
        for g, group in enumerate(groups)
    ]
    listed = [i for m in members for i in m]
    if len(set(listed)) != len(listed):
        raise InputError(f"{name}: the optimizer's param groups list an index twice: the file is damaged")
    raw_state = need_mapping(inner.get("state") or {}, f"{name}: optimizer state")
    state = {as_int(k, f"{name}: optimizer state index"): v for k, v in raw_state.items()}
    stray = sorted(set(state) - set(listed))
    if stray:
        raise InputError(
            f"{name}: the optimizer holds state for {len(state)} parameters, its param groups list {len(listed)}: "
            f"index {stray[0]} is in no group; the file is damaged"
        )
    missing = sorted(set(listed) - set(state))
    if state and missing:
        raise InputError(
            f"{name}: the optimizer holds state for {len(state)} of the {len(listed)} parameters its param groups "
            f"list (index {missing[0]} has none: a parameter that never got a gradient?); ucp cannot place it"
        )
    return groups, members, state


def entry_keys(entry: Any, where: str) -> tuple[tuple[str, ...], tuple[int, ...] | None]:
    """A parameter's elementwise state keys (every key but the step and 0-dim scalars) and their shape."""
    entry = need_mapping(entry, where)
    keys = tuple(k for k in entry if k != STEP_KEY and k not in flat_state_scalars(entry))
    shapes = set()
    for key in keys:
        value = entry[key]
        if not torch.is_tensor(value) or not value.is_floating_point() or value.layout != torch.strided:
            raise InputError(
                f"{where}: optimizer state {key!r} is a {type(value).__name__}, not a floating tensor shaped like "
                "its parameter: ucp refuses the checkpoint rather than drop it"
            )
        shapes.add(tuple(value.shape))
    if len(shapes) > 1:
        raise InputError(f"{where}: optimizer state tensors have different shapes {sorted(shapes)}: file damaged")
    return keys, (shapes.pop() if shapes else None)
