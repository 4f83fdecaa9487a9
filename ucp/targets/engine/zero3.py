"""Universal -> a live ZeRO-3 DeepSpeed engine on this rank: its own flat layout, DeepSpeed's own loader."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ucp.deepspeed import states as ds_states
from ucp.errors import InputError
from ucp.model import flavours
from ucp.model.detect import detect_live
from ucp.model.partition import Zero3Layout, Zero3Slot, zero3_rank_span
from ucp.model.records import ParamState, PieceState, Reader
from ucp.targets.blocks.zero3 import fill_ranks, sub_group_keys, sub_group_steps
from ucp.targets.engine.common import (
    check_names,
    copy_pieces,
    dp_rank_and_size,
    keep_wide_state,
    live_groups,
    loss_scaler_wrapper,
    match_groups,
    place_steps_on_device,
)

__all__ = ["restore_zero3"]

logger = logging.getLogger(__name__)


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
    layout = Zero3Layout(
        dp=dp_rank_and_size(opt.dp_process_group)[1],
        slots=tuple(tuple(s) for s in slots),
        sub_group_numel=tuple(sub_numel),
        sub_group_of_group=tuple(sub_group_of_group),
    )
    return layout, names


def restore_zero3(
    engine: Any,
    reader: Reader,
    *,
    optimizer: str | None,
    load_optimizer_states: bool,
    strict: bool,
    workers: int,
    step_of: Callable[[ParamState | PieceState], int],
) -> None:
    if getattr(engine.optimizer, "swap_optimizer", False):
        raise InputError(
            "this engine swaps its optimizer state to NVMe (offload_optimizer.device=nvme): ucp restores into "
            "engines that keep it in CPU memory (device=cpu) or on the accelerator, not into swap files"
        )
    check_names(engine, reader, strict=strict)
    opt = engine.optimizer
    base = opt.optimizer
    flavour = flavours.get(optimizer) if optimizer else detect_live(base)
    flavours.check_family(reader.facts.flavour, flavour, load_optimizer_states)
    layout, names = _live_zero3_layout(engine)
    for g, group in enumerate(names):
        for name in group:
            meta = reader.facts.param(name)
            if meta.numel != layout.slots[g][names[g].index(name)].numel:
                raise InputError(
                    f"{name} has {meta.numel} elements in the checkpoint but "
                    f"{layout.slots[g][names[g].index(name)].numel} in the engine"
                )
    matched = match_groups(reader, names, strict=strict)
    rank, dp = dp_rank_and_size(opt.dp_process_group)[0], layout.dp
    keys = sub_group_keys(reader, layout, matched, moments=load_optimizer_states)
    buffers, seen = fill_ranks(
        reader, layout, names, [rank], keys=keys, moments=load_optimizer_states, workers=workers, step_of=step_of
    )
    steps = sub_group_steps(seen)
    members = [layout.sub_groups_in(g) for g in range(len(names))]
    group_step = [max((steps[s] for s in members[g]), default=0) for g in range(len(members))]
    groups = live_groups(reader, base.param_groups, matched, flavour, group_step)
    for g, entry in enumerate(groups):
        entry["params"] = members[g]
    device = opt.fp32_partitioned_groups_flat[0].device if opt.fp32_partitioned_groups_flat else torch.device("cpu")
    wrapper = loss_scaler_wrapper(opt, reader, 3)
    block = ds_states.zero3_optim_block(
        wrapper=wrapper,
        flavour=flavour,
        fp32=buffers[rank].fp32,
        optim=buffers[rank].optim,
        scalars=buffers[rank].scalars,
        steps=steps,
        groups=groups,
        dp=dp,
        moments=load_optimizer_states,
    )
    if load_optimizer_states:
        place_steps_on_device(block, groups, device)
    if hasattr(opt, "checkpoint_event_prologue"):
        opt.checkpoint_event_prologue()
    opt.load_state_dict(
        [block if r == rank else None for r in range(dp)],
        load_optimizer_states=load_optimizer_states,
        load_from_fp32_weights=True,
    )
    if load_optimizer_states:
        # ZeRO-3 lends the optimizer its fp32 sub-group partitions only while it loads
        order = [s for g in groups for s in g["params"]]
        keep_wide_state(base, block["optimizer_state_dict"], [opt.fp32_partitioned_groups_flat[s] for s in order])
    _restore_frozen_zero3(engine, reader, rank, dp)
    if hasattr(opt, "checkpoint_event_epilogue"):
        opt.checkpoint_event_epilogue()


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
        with reader.read_pieces(name, moments=False) as state:  # the rank's slice alone is read
            if hasattr(param, "ds_tensor"):
                start, end = zero3_rank_span(meta.numel, dp, rank)
                target = param.ds_tensor.data.view(-1)
                target.zero_()
                copy_pieces(state.fp32.slice(start, end), target[: end - start])
            else:
                copy_pieces(state.fp32, param.data.view(-1))
