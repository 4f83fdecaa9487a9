"""Universal (or any reader) -> a native ZeRO-1/2 checkpoint that stock DeepSpeed loads at DP=N.

Call order: ``ucp.targets.native.write_native`` fixes the plan and, for stage 1 or 2, calls
:func:`write_native12` inside its staged output folder. Here each parameter is read once and
scattered into every rank's flat partitions (:func:`fill_zero12_ranks`, shared with the live-engine
target); then one ``mp_rank_MM_model_states.pt`` (the low-precision module, frozen parameters and
all) and N ``*zero_pp_rank_R_mp_rank_MM_optim_states.pt`` files are written with every field
DeepSpeedZeroOptimizer writes, recomputed for N. BF16_Optimizer engines load the same files.
Under tensor parallelism this runs once per TP rank MM, on that rank's view of the parameters.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

import torch

from ucp import torchfile
from ucp.errors import InputError
from ucp.flavors import Flavour
from ucp.partition import Zero12Group, zero12_group
from ucp.records import ParamState, Reader, torch_dtype
from ucp.targets.native import NativePlan, model_states, optimizer_groups, param_step, zero_block
from ucp.targets.steps import settle_steps
from ucp.targets.zero3 import RankBuffers
from ucp.universal import parallel_map

__all__ = ["write_native12", "zero12_rank", "fill_zero12_ranks", "group_steps", "zero12_block"]

logger = logging.getLogger(__name__)


def zero12_rank(layouts: list[Zero12Group]) -> RankBuffers:
    """One rank's flat partitions: one tensor of the partition size per param group."""
    return RankBuffers.of_sizes([layout.partition_size for layout in layouts])


def fill_zero12_ranks(reader: Reader, layouts: list[Zero12Group], names: list[list[str]],
                      ranks: dict[int, RankBuffers], *, moments: bool, workers: int,
                      step_of: Callable[[ParamState], int],
                      on_state: Callable[[str, ParamState], None] | None = None) -> list[set[int]]:
    """Read every parameter of ``names`` (per param group, in flat order) once into the ranks' partitions.

    ``on_state(name, state)`` sees each state as it is read (the native writer takes the module
    weights from it). Returns, per param group, the set of steps its members carried.
    """
    steps: list[set[int]] = [set() for _ in layouts]
    where = {name: (g, i) for g, group in enumerate(names) for i, name in enumerate(group)}

    def one(name: str) -> None:
        g, i = where[name]
        state = reader.read(name, moments=moments)
        if moments and state.exp_avg is None:
            raise InputError(f"{name} has no optimizer moments in the source; restore with step reset")
        if state.fp32.numel() != layouts[g].numels[i]:
            raise InputError(f"{name}: the source holds {state.fp32.numel()} elements, the target layout "
                             f"{layouts[g].numels[i]}")
        pairs = [("fp32", state.fp32)]
        if moments:
            pairs += [("exp_avg", state.exp_avg), ("exp_avg_sq", state.exp_avg_sq)]
        spans = [s for s in layouts[g].spans(i) if s.rank in ranks]
        for key, tensor in pairs:
            values = tensor.reshape(-1)
            for span in spans:
                target = getattr(ranks[span.rank], key)[g]
                target.narrow(0, span.partition_start, span.length).copy_(
                    values[span.param_start : span.param_start + span.length])
        steps[g].add(step_of(state))
        if on_state is not None:
            on_state(name, state)

    for _ in parallel_map(one, [n for group in names for n in group], workers, desc="restore"):
        pass
    return steps


def group_steps(steps: list[set[int]]) -> list[int]:
    """One step per param group: ZeRO-1/2 steps a whole group as one flat tensor."""
    return settle_steps(steps, "ZeRO-1/2 param group")


def zero12_block(*, wrapper: dict[str, Any], flavour: Flavour, rank: RankBuffers, layouts: list[Zero12Group],
                 names: list[list[str]], index: int, steps: list[int], groups: list[dict[str, Any]],
                 clip_grad: float, ds_version: str | None, moments: bool,
                 alignment_paddings: list[list[int]] | None = None) -> dict[str, Any]:
    """The dict DeepSpeedZeroOptimizer saves for one rank (and its ``load_state_dict`` takes back)."""
    state = {}
    if moments:
        for g, step in enumerate(steps):
            state[g] = flavour.make_state(rank.exp_avg[g], rank.exp_avg_sq[g], step)
    paddings = [layout.padding(index) for layout in layouts]
    mappings = []
    for g, layout in enumerate(layouts):
        mapping = OrderedDict()
        for i, name in enumerate(names[g]):
            where = layout.rank_slice(i, index)
            if where is not None:
                mapping[name] = torchfile.FragmentAddress(numel=where[1], start=where[0])
        mappings.append(mapping)
    if alignment_paddings is None:
        alignment_paddings = [[0] * len(group) for group in names]
    return {
        "loss_scaler": wrapper["loss_scaler"],
        "dynamic_loss_scale": wrapper["dynamic_loss_scale"],
        "overflow": wrapper["overflow"],
        "clip_grad": clip_grad,
        "base_optimizer_state": {"state": state, "param_groups": groups},
        # DeepSpeedZeroOptimizer strips the end padding; its loader (and BF16_Optimizer's) pads it back
        "single_partition_of_fp32_groups": [rank.fp32[g][: layout.partition_size - paddings[g]]
                                            for g, layout in enumerate(layouts)],
        "zero_stage": wrapper["zero_stage"],
        "group_paddings": paddings,
        "param_alignment_paddings": alignment_paddings,
        "partition_count": [layout.dp for layout in layouts],
        "ds_version": ds_version,
        "param_slice_mappings": mappings,
    }


def _clip_grad(reader: Reader) -> float:
    value = reader.extras().get("clip_grad")
    if value is None:
        value = reader.facts.info.ds_config.get("gradient_clipping", 0.0)
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0


def _ds_config(config: dict[str, Any], stage: int) -> dict[str, Any]:
    """The source's config with the stage it is now written for."""
    out = dict(config)
    zero = dict(out.get("zero_optimization") or {})
    zero["stage"] = stage
    out["zero_optimization"] = zero
    return out


def _flat_names(reader: Reader, plan: NativePlan) -> tuple[list[list[str]], list[str]]:
    """Members of each flat group, and the parameters DeepSpeed keeps outside them (frozen, or
    trainable with zero elements: DeepSpeed 0.19.8 ``is_optimized_parameter``)."""
    facts = reader.facts
    flat = [[n for n in names if facts.param(n).numel > 0] for names in plan.group_names]
    kept = {n for names in flat for n in names}
    outside = [m.name for m in facts.params if m.name not in kept]
    return flat, outside


def write_native12(reader: Reader, plan: NativePlan, tag_dir: Path, workers: int) -> None:
    """Write TP rank ``plan.mp_rank``'s files of a stage-1/2 checkpoint for ``plan.dp`` ranks into ``tag_dir``."""
    facts = reader.facts
    dp = plan.dp
    names, outside = _flat_names(reader, plan)
    layouts = [zero12_group([facts.param(n).numel for n in group], dp) for group in names]
    moments = not plan.reset_moments
    lp = torch_dtype(plan.dtype)
    weights: dict[str, torch.Tensor] = {}

    def keep_weight(name: str, state: ParamState) -> None:
        weights[name] = state.fp32.to(lp)

    ranks = {r: zero12_rank(layouts) for r in range(dp)}
    seen = fill_zero12_ranks(reader, layouts, names, ranks, moments=moments, workers=workers,
                             step_of=lambda state: param_step(plan, state), on_state=keep_weight)
    steps = group_steps(seen)
    groups = optimizer_groups(reader, plan, [[g] for g in range(len(names))], steps)
    frozen = OrderedDict((n, reader.read(n, moments=False).fp32.to(lp)) for n in outside)

    module: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    for meta in facts.params:
        module[meta.name] = weights[meta.name] if meta.name in weights else frozen[meta.name]
    for alias, owner in facts.tied.items():
        if owner not in module:
            raise InputError(f"tied parameter {alias!r} points at {owner!r}, which the checkpoint does not hold")
        module[alias] = module[owner]
    module.update(reader.buffers())
    stage2 = plan.stage == 2
    states = model_states(reader, plan, extra={
        "param_shapes": [OrderedDict((n, torch.Size(facts.param(n).shape)) for n in group) for group in names],
        "frozen_param_shapes": OrderedDict((n, torch.Size(t.shape)) for n, t in frozen.items()) if stage2 else None,
        "shared_params": dict(facts.tied),
        "frozen_param_fragments": frozen if stage2 else None,
    })
    states["module"] = module
    config = _ds_config(facts.info.ds_config, plan.stage)
    states["ds_config"] = config
    torchfile.save(states, tag_dir / f"mp_rank_{plan.mp_rank:02d}_model_states.pt")

    wrapper = zero_block(reader, plan)
    clip_grad = _clip_grad(reader)
    prefix = "bf16_" if plan.dtype == "bf16" else ""
    for r in range(dp):
        block = zero12_block(wrapper=wrapper, flavour=plan.flavour, rank=ranks.pop(r), layouts=layouts, names=names,
                             index=r, steps=steps, groups=groups, clip_grad=clip_grad,
                             ds_version=facts.info.ds_version, moments=moments or bool(plan.step))
        torchfile.save({"optimizer_state_dict": block, "ds_config": config, "ds_version": facts.info.ds_version},
                       tag_dir / f"{prefix}zero_pp_rank_{r}_mp_rank_{plan.mp_rank:02d}_optim_states.pt")
    logger.info("wrote a ZeRO-%d checkpoint for dp=%d to %s", plan.stage, dp, tag_dir)
