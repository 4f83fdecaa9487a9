"""Universal -> a live ZeRO-1/2 DeepSpeed engine (DeepSpeedZeroOptimizer or BF16_Optimizer) at any DP size.

Call order (``ucp.targets.engine.restore`` calls :func:`restore_zero12` on every rank together):
read the engine's own flat layout (members of each param group, their offsets, this rank's
partition size), match its param groups to the checkpoint's by member names, build this rank's
block as DeepSpeed saves it, and hand it to the optimizer's own ``load_state_dict`` (the rigid path
of a native resume: torch optimizer state, then the fp32 partition). ``update_lp_params`` then
refreshes the low-precision weights from the fp32 masters; frozen parameters are copied last.
``restore`` itself restores buffers, the scheduler and the counters afterwards.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ucp.deepspeed import states as ds_states
from ucp.errors import InputError
from ucp.model import flavours
from ucp.model.detect import detect_live
from ucp.model.partition import Zero12Group
from ucp.model.records import ParamState, PieceState, Reader
from ucp.model.steps import step_chooser
from ucp.targets.blocks.common import RankBuffers
from ucp.targets.blocks.zero12 import fill_zero12_ranks, group_steps, zero12_buffers
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

__all__ = ["restore_zero12", "live_zero12_layout"]

logger = logging.getLogger(__name__)


def _wrapper_groups(opt: Any) -> tuple[list[list[Any]], list[torch.Tensor], list[list[int]] | None]:
    """(low-precision params of each group in flat order, this rank's fp32 partitions, per-param offsets)."""
    if hasattr(opt, "round_robin_bit16_groups"):  # DeepSpeedZeroOptimizer (stage 1/2)
        return (
            list(opt.round_robin_bit16_groups),
            list(opt.single_partition_of_fp32_groups),
            [list(o) for o in getattr(opt, "round_robin_bit16_offsets", [])] or None,
        )
    if hasattr(opt, "bf16_groups") and hasattr(opt, "fp32_groups_flat_partition"):  # BF16_Optimizer
        return list(opt.bf16_groups), list(opt.fp32_groups_flat_partition), None
    raise InputError(
        f"{type(opt).__name__} is not a ZeRO-1/2 optimizer ucp knows (DeepSpeedZeroOptimizer, BF16_Optimizer)"
    )


def live_zero12_layout(engine: Any) -> tuple[list[Zero12Group], list[list[str]], int]:
    """The flat layout of a live ZeRO-1/2 engine, read off the engine: layouts, member names, this rank."""
    opt = engine.optimizer
    lp_groups, hp_groups, offsets = _wrapper_groups(opt)
    rank, dp = dp_rank_and_size(opt.dp_process_group)
    layouts, names = [], []
    for g, (params, partition) in enumerate(zip(lp_groups, hp_groups)):
        numels = [int(p.numel()) for p in params]
        if offsets is not None:
            starts = offsets[g]
        else:
            starts = [sum(numels[:i]) for i in range(len(numels))]
        end = starts[-1] + numels[-1] if numels else 0
        size = int(partition.numel())
        if end > size * dp:
            raise InputError(
                f"param group {g} of the engine holds {end} elements but {dp} partitions of {size}: "
                "a ZeRO-1/2 layout ucp does not know"
            )
        layouts.append(Zero12Group(dp, tuple(numels), tuple(starts), end, size))
        names.append([engine.param_names[p] for p in params])
    return layouts, names, rank


def restore_zero12(
    engine: Any,
    reader: Reader,
    *,
    optimizer: str | None,
    load_optimizer_states: bool,
    strict: bool,
    workers: int,
    step_of: Callable[[ParamState | PieceState], int] | None = None,
) -> None:
    """Load ``reader``'s weights (and optimizer state) into a live stage-1/2 engine on this rank."""
    check_names(engine, reader, strict=strict)
    opt = engine.optimizer
    flavour = flavours.get(optimizer) if optimizer else detect_live(opt.optimizer)
    flavours.check_family(reader.facts.flavour, flavour, load_optimizer_states)
    layouts, live_names, rank = live_zero12_layout(engine)
    names = _held_names(reader, layouts, live_names)
    matched = match_groups(reader, live_names, strict=strict)
    keys = [reader.facts.groups[m].state_keys if m is not None and load_optimizer_states else () for m in matched]
    offload = bool(getattr(opt, "cpu_offload", False))
    whole = [flavour.zero12_whole_keys(group, offload=offload) for group in opt.optimizer.param_groups]
    for g, group_keys in enumerate(whole):
        if group_keys and keys[g] and names[g] != live_names[g]:
            raise InputError(
                f"param group {g} keeps {', '.join(group_keys)} whole per parameter, and the checkpoint holds "
                f"only {len(names[g])} of its {len(live_names[g])} members: restore it with strict=True"
            )
    mine = _from_live(opt, layouts, keys, rank, whole)
    seen = fill_zero12_ranks(
        reader,
        _held_layouts(layouts, live_names, names),
        names,
        {rank: mine},
        keys=keys,
        moments=load_optimizer_states,
        workers=workers,
        step_of=step_of or step_chooser("keep"),
        whole=whole,
    )
    steps = group_steps(seen)
    groups = live_groups(reader, opt.optimizer.param_groups, matched, flavour, steps)
    for g, entry in enumerate(groups):
        entry["params"] = [g]
    block = _optim_block(opt, reader, flavour, mine, layouts, live_names, rank, steps, groups, load_optimizer_states)
    if hasattr(opt, "checkpoint_event_prologue"):
        opt.checkpoint_event_prologue()
    # the rigid path reads only this rank's entry (param_alignment_paddings equal the engine's)
    _, dp = dp_rank_and_size(opt.dp_process_group)
    opt.load_state_dict(
        [block if r == rank else None for r in range(dp)],
        load_optimizer_states=load_optimizer_states,
        load_from_fp32_weights=True,
    )
    if load_optimizer_states:
        keep_wide_state(
            opt.optimizer, block["base_optimizer_state"], [p for g in opt.optimizer.param_groups for p in g["params"]]
        )
    opt.update_lp_params()
    _restore_frozen(engine, reader)
    if hasattr(opt, "checkpoint_event_epilogue"):
        opt.checkpoint_event_epilogue()


def _held_names(reader: Reader, layouts: list[Zero12Group], live_names: list[list[str]]) -> list[list[str]]:
    """Each live group's members that the checkpoint holds, their sizes checked against the engine's."""
    facts = reader.facts
    known = {m.name for m in facts.params}
    names = []
    for g, group in enumerate(live_names):
        for i, name in enumerate(group):
            if name in known and facts.param(name).numel != layouts[g].numels[i]:
                raise InputError(
                    f"{name} has {facts.param(name).numel} elements in the checkpoint but "
                    f"{layouts[g].numels[i]} in the engine"
                )
        names.append([n for n in group if n in known])
    return names


def _from_live(
    opt: Any, layouts: list[Zero12Group], keys: list[tuple[str, ...]], rank: int, whole: list[tuple[str, ...]]
) -> RankBuffers:
    """This rank's buffers, starting from what the engine holds, so parameters the checkpoint lacks
    (strict=False) keep their values."""
    _, hp_groups, _ = _wrapper_groups(opt)
    mine = zero12_buffers(layouts, keys, [{} for _ in layouts], rank=rank, whole=whole)
    for g, partition in enumerate(hp_groups):
        mine.fp32[g].copy_(partition.detach().view(-1).float().cpu())
        live = opt.optimizer.state.get(partition, {})
        for key, flat in mine.optim[g].items():
            if torch.is_tensor(live.get(key)) and live[key].numel() == flat.numel():
                flat.copy_(live[key].detach().float().cpu())
    return mine


def _held_layouts(layouts: list[Zero12Group], live_names: list[list[str]], names: list[list[str]]) -> list[Zero12Group]:
    """A layout for the members the checkpoint holds, at their live offsets."""
    held = []
    for g, layout in enumerate(layouts):
        index = [live_names[g].index(n) for n in names[g]]
        held.append(
            Zero12Group(
                layout.dp,
                tuple(layout.numels[i] for i in index),
                tuple(layout.offsets[i] for i in index),
                layout.numel,
                layout.partition_size,
            )
        )
    return held


def _optim_block(
    opt: Any,
    reader: Reader,
    flavour: flavours.Flavour,
    mine: RankBuffers,
    layouts: list[Zero12Group],
    live_names: list[list[str]],
    rank: int,
    steps: list[int],
    groups: list[dict[str, Any]],
    moments: bool,
) -> dict[str, Any]:
    """This rank's entry of the ZeRO-1/2 optimizer state, as the engine's load_state_dict reads it."""
    import deepspeed

    _, hp_groups, _ = _wrapper_groups(opt)
    block = ds_states.zero12_optim_block(
        wrapper=loss_scaler_wrapper(opt, reader, 2 if getattr(opt, "partition_gradients", False) else 1),
        flavour=flavour,
        fp32=mine.fp32,
        optim=mine.optim,
        scalars=mine.scalars,
        layouts=layouts,
        names=live_names,
        index=rank,
        steps=steps,
        groups=groups,
        clip_grad=getattr(opt, "clip_grad", 0.0),
        ds_version=deepspeed.__version__,
        moments=moments,
        alignment_paddings=getattr(opt, "round_robin_bit16_padding", None),
    )
    # the fp32 partitions go in whole (padding included) and on the engine's device
    block["single_partition_of_fp32_groups"] = [t.to(p.device) for t, p in zip(mine.fp32, hp_groups)]
    if moments:
        device = hp_groups[0].device if hp_groups else torch.device("cpu")
        place_steps_on_device(block, groups, device)
    return block


def _restore_frozen(engine: Any, reader: Reader) -> None:
    """Parameters outside the flat groups (frozen, or empty) hold full copies on every rank."""
    names_of = engine.param_names
    opt = engine.optimizer
    lp_groups, _, _ = _wrapper_groups(opt)
    flat = {id(p) for group in lp_groups for p in group}
    for param in engine.module.parameters():
        name = names_of.get(param)
        if name is None or id(param) in flat or name in reader.facts.tied:
            continue
        try:
            reader.facts.param(name)
        except KeyError:
            continue
        with reader.read_pieces(name, moments=False) as state, torch.no_grad():  # read into place, cast as copied
            copy_pieces(state.fp32, param.data.view(-1))
