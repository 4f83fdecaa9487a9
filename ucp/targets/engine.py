"""Universal -> a live DeepSpeed engine at any DP size, steps where its optimizer reads them.

Call order (every rank calls :func:`restore` together, like ``engine.load_checkpoint``): read the
engine's own flat layout (its sub-groups, partition sizes and parameter names), match its param
groups to the checkpoint's by member names, build this rank's ZeRO block from the universal state,
and hand it to DeepSpeed's own ``load_state_dict`` (the path a native resume takes, so the fp32
masters, moments, steps and refreshed low-precision weights land exactly as DeepSpeed puts them).
Frozen parameters, buffers, the lr scheduler and engine counters follow.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

import torch

from ucp import flavors
from ucp.errors import InputError
from ucp.partition import Zero3Layout, Zero3Slot, zero3_rank_span
from ucp.records import ParamState, Reader
from ucp.sources import open_reader
from ucp.targets.steps import step_chooser
from ucp.targets.zero3 import fill_ranks, optim_block, sub_group_steps
from ucp.universal import default_workers

__all__ = ["restore", "match_groups"]

logger = logging.getLogger(__name__)


def match_groups(reader: Reader, live_members: list[list[str]], *, strict: bool) -> list[int | None]:
    """For each live param group, the checkpoint group holding its members (matched by names)."""
    owner = {name: g.index for g in reader.facts.groups for name in g.params}
    matched: list[int | None] = []
    for i, names in enumerate(live_members):
        found = {owner.get(n) for n in names}
        missing = [n for n in names if n not in owner]
        if missing and strict:
            raise InputError(f"param group {i} of the engine holds {missing[0]!r}, which the checkpoint does not "
                             "optimize; start DeepSpeed with the checkpoint's parameters or pass strict=False")
        found.discard(None)
        if len(found) > 1:
            raise InputError(f"param group {i} of the engine mixes members of checkpoint groups {sorted(found)}; "
                             "DeepSpeed must be started with the same param groups as the checkpoint")
        matched.append(found.pop() if found else None)
    return matched


def _live_zero3_layout(engine: Any) -> tuple[Zero3Layout, list[list[str]]]:
    """The flat layout of a live ZeRO-3 engine, read off the engine itself."""
    opt = engine.optimizer
    names_of = engine.param_names
    group_count = len(opt.optimizer.param_groups)
    slots: list[list[Zero3Slot]] = [[] for _ in range(group_count)]
    names: list[list[str]] = [[] for _ in range(group_count)]
    sub_numel, sub_group_of_group = [], []
    for sub, members in enumerate(opt.fp16_groups):
        group = int(opt.sub_group_to_group_id[sub])
        offset = 0
        for param in members:
            size = int(param.partition_numel())
            slots[group].append(Zero3Slot(group, sub, offset, size, int(param.ds_numel)))
            names[group].append(names_of[param])
            offset += size
        sub_numel.append(offset)
        sub_group_of_group.append(group)
    layout = Zero3Layout(dp=_dp_size(engine), slots=tuple(tuple(s) for s in slots),
                         sub_group_numel=tuple(sub_numel), sub_group_of_group=tuple(sub_group_of_group))
    return layout, names


def _dp_size(engine: Any) -> int:
    import deepspeed.comm as dist

    return dist.get_world_size(group=engine.optimizer.dp_process_group)


def _dp_rank(engine: Any) -> int:
    import deepspeed.comm as dist

    return dist.get_rank(group=engine.optimizer.dp_process_group)


def restore(engine: Any, universal_dir: str | os.PathLike | Reader, *, optimizer: str | None = None,
            load_optimizer_states: bool = True, strict: bool = True, step: int | str = "keep",
            workers: int | None = None) -> dict[str, Any]:
    """Restore a universal directory (or any checkpoint ucp reads) into a live DeepSpeed engine.

    ``optimizer`` names the engine's flavour when its class does not tell. With
    ``load_optimizer_states=False`` only weights (and frozen params and buffers) are restored.
    ``step`` is ``keep`` (each parameter's own), ``reset`` (0) or an integer for every parameter.
    Returns the checkpoint's client state, as ``engine.load_checkpoint`` does.
    """
    step_of = step_chooser(step)
    source = open_reader(universal_dir) if isinstance(universal_dir, (str, os.PathLike)) else universal_dir
    try:
        from ucp.targets.tensor_parallel import live_tp_view

        reader = live_tp_view(engine, source)  # this rank's shards under tensor parallelism
        stage = int(engine.zero_optimization_stage())
        if stage != 3:
            from ucp.targets.engine12 import restore_zero12

            restore_zero12(engine, reader, optimizer=optimizer, load_optimizer_states=load_optimizer_states,
                           strict=strict, workers=workers or default_workers(), step_of=step_of)
        else:
            _restore_zero3(engine, reader, optimizer=optimizer, load_optimizer_states=load_optimizer_states,
                           strict=strict, workers=workers or default_workers(), step_of=step_of)
        _restore_common(engine, reader, strict=strict)
        return dict(reader.extras().get("client_state") or {})
    finally:
        if source is not universal_dir:
            source.close()


def _check_names(engine: Any, reader: Reader, *, strict: bool) -> None:
    facts = reader.facts
    ours = {m.name for m in facts.params}
    theirs = set(engine.param_names.values()) - set(facts.tied)
    if strict and ours != theirs:
        extra = sorted(theirs - ours)
        lost = sorted(ours - theirs)
        what = f"the engine has {extra[0]!r}, which the checkpoint lacks" if extra else \
            f"the checkpoint has {lost[0]!r}, which the engine lacks"
        raise InputError(f"parameters differ: {what} ({len(extra)} extra, {len(lost)} missing); pass strict=False "
                         "to restore the common ones")


def _restore_zero3(engine: Any, reader: Reader, *, optimizer: str | None, load_optimizer_states: bool,
                   strict: bool, workers: int, step_of: Callable[[ParamState], int]) -> None:
    _check_names(engine, reader, strict=strict)
    opt = engine.optimizer
    base = opt.optimizer
    flavour = flavors.get(optimizer) if optimizer else flavors.detect_live(base)
    layout, names = _live_zero3_layout(engine)
    for g, group in enumerate(names):
        for name in group:
            meta = reader.facts.param(name)
            if meta.numel != layout.slots[g][names[g].index(name)].numel:
                raise InputError(f"{name} has {meta.numel} elements in the checkpoint but "
                                 f"{layout.slots[g][names[g].index(name)].numel} in the engine")
    matched = match_groups(reader, names, strict=strict)
    rank, dp = _dp_rank(engine), layout.dp
    buffers, seen = fill_ranks(reader, layout, names, [rank], moments=load_optimizer_states, workers=workers,
                               step_of=step_of)
    steps = sub_group_steps(seen)
    members = [layout.sub_groups_in(g) for g in range(len(names))]
    groups = []
    for g, live in enumerate(base.param_groups):
        source = matched[g]
        hyper = reader.facts.groups[source].hyper if source is not None else flavors.hyper_from_group(live, None)
        step = max((steps[s] for s in members[g]), default=0)
        group = flavour.update_group(live, hyper, step)
        group["params"] = members[g]
        groups.append(group)
    device = opt.fp32_partitioned_groups_flat[0].device if opt.fp32_partitioned_groups_flat else torch.device("cpu")
    wrapper = {"zero_stage": 3, "loss_scaler": opt.loss_scaler, "dynamic_loss_scale": opt.dynamic_loss_scale,
               "overflow": False}
    extras = reader.extras()
    if extras.get("loss_scaler") is not None and hasattr(extras["loss_scaler"], "__dict__"):
        opt.loss_scaler.__dict__.update(extras["loss_scaler"].__dict__)
    block = optim_block(wrapper=wrapper, flavour=flavour, buffers=buffers[rank], steps=steps, groups=groups, dp=dp,
                        moments=load_optimizer_states)
    if load_optimizer_states:
        _place_steps_on_device(block, groups, device)
    if hasattr(opt, "checkpoint_event_prologue"):
        opt.checkpoint_event_prologue()
    opt.load_state_dict([block if r == rank else None for r in range(dp)],
                        load_optimizer_states=load_optimizer_states, load_from_fp32_weights=True)
    _restore_frozen_zero3(engine, reader, rank, dp)
    if hasattr(opt, "checkpoint_event_epilogue"):
        opt.checkpoint_event_epilogue()


def _place_steps_on_device(block: dict[str, Any], groups: list[dict[str, Any]], device: torch.device) -> None:
    """torch Adam keeps a capturable/fused step on the parameter's device."""
    if not any(g.get("capturable") or g.get("fused") for g in groups):
        return
    for state in block["optimizer_state_dict"]["state"].values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].to(device)


def _restore_frozen_zero3(engine: Any, reader: Reader, rank: int, dp: int) -> None:
    names_of = engine.param_names
    for param in engine.module.parameters():
        name = names_of.get(param)
        if name is None or param.requires_grad or name in reader.facts.tied:
            continue
        try:
            meta = reader.facts.param(name)
        except KeyError:
            continue
        full = reader.read(name, moments=False).fp32.reshape(-1)
        if hasattr(param, "ds_tensor"):
            start, end = zero3_rank_span(meta.numel, dp, rank)
            target = param.ds_tensor.data.view(-1)
            target.zero_()
            target[: end - start].copy_(full[start:end])
        else:
            param.data.copy_(full.view(param.shape))


def _restore_common(engine: Any, reader: Reader, *, strict: bool) -> None:
    """Buffers, the lr scheduler and the engine's counters."""
    buffers = reader.buffers()
    for name, buf in engine.module.named_buffers():
        if name in buffers:
            buf.data.copy_(buffers[name].to(buf.dtype))
        elif strict and name in reader.facts.buffer_names:
            raise InputError(f"buffer {name!r} is missing from the checkpoint")
    extras = reader.extras()
    if engine.lr_scheduler is not None and extras.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(extras["lr_scheduler"])
    info = reader.facts.info
    engine.global_steps = info.global_steps
    engine.skipped_steps = info.skipped_steps
    if info.global_samples is not None:
        engine.global_samples = info.global_samples
