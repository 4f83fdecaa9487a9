"""Universal (or any reader) -> a native ZeRO-1/2 checkpoint that stock DeepSpeed loads at DP=N.

Call order: ``ucp.targets.native.write_plan`` calls :func:`write_zero12` for stage 1 or 2 inside
its staged output folder. Here each parameter is read once and scattered into every rank's flat
partitions (``ucp.targets.blocks.zero12``, shared with the live-engine target); then one ``mp_rank_MM_model_states.pt`` (the low-precision module, frozen parameters and
all) and N ``*zero_pp_rank_R_mp_rank_MM_optim_states.pt`` files are written with every field
DeepSpeedZeroOptimizer writes, recomputed for N. BF16_Optimizer engines load the same files.
Under tensor parallelism this runs once per TP rank MM, on that rank's view of the parameters.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path

import torch

from ucp.deepspeed import states as ds_states
from ucp.deepspeed.layout import model_file, optim_file
from ucp.errors import InputError
from ucp.model.partition import zero12_group
from ucp.model.records import ParamState, Reader, torch_dtype
from ucp.targets.blocks.zero12 import fill_zero12_ranks, group_steps, zero12_buffers
from ucp.targets.native.common import model_states, optimizer_groups, save_rank_file, zero_wrapper
from ucp.targets.native.plan import NativePlan, param_step

__all__ = ["write_zero12"]

logger = logging.getLogger(__name__)


def _flat_names(reader: Reader, plan: NativePlan) -> tuple[list[list[str]], list[str]]:
    """Members of each flat group, and the parameters DeepSpeed keeps outside them (frozen, or
    trainable with zero elements: DeepSpeed 0.19.8 ``is_optimized_parameter``)."""
    facts = reader.facts
    flat = [[n for n in names if facts.param(n).numel > 0] for names in plan.group_names]
    kept = {n for names in flat for n in names}
    outside = [m.name for m in facts.params if m.name not in kept]
    return flat, outside


def write_zero12(reader: Reader, plan: NativePlan, tag_dir: Path, workers: int) -> None:
    """Write TP rank ``plan.mp_rank``'s files of a stage-1/2 checkpoint for ``plan.dp`` ranks into ``tag_dir``."""
    facts = reader.facts
    dp = plan.dp
    names, outside = _flat_names(reader, plan)
    layouts = [zero12_group([facts.param(n).numel for n in group], dp) for group in names]
    moments = not plan.reset_moments
    keys = [facts.groups[g].state_keys if moments else () for g in range(len(names))]
    lp = torch_dtype(plan.dtype)
    weights: dict[str, torch.Tensor] = {}

    def keep_weight(name: str, state: ParamState) -> None:
        weights[name] = state.fp32.to(lp)

    scalars: list[dict[str, torch.Tensor]] = [{} for _ in layouts]
    whole = plan.whole_keys(facts) if moments else []
    ranks = {r: zero12_buffers(layouts, keys, scalars, rank=r, whole=whole) for r in range(dp)}
    seen = fill_zero12_ranks(
        reader,
        layouts,
        names,
        ranks,
        keys=keys,
        moments=moments,
        workers=workers,
        step_of=lambda state: param_step(plan, state),
        on_state=keep_weight,
        whole=whole,
    )
    steps = group_steps(seen)
    groups = optimizer_groups(reader, plan, [[g] for g in range(len(names))], steps)
    frozen = OrderedDict((n, reader.read(n, moments=False).fp32.to(lp)) for n in outside)

    module: OrderedDict[str, torch.Tensor] = OrderedDict()
    for meta in facts.params:
        module[meta.name] = weights[meta.name] if meta.name in weights else frozen[meta.name]
    for alias, owner in facts.tied.items():
        if owner not in module:
            raise InputError(f"tied parameter {alias!r} points at {owner!r}, which the checkpoint does not hold")
        module[alias] = module[owner]
    module.update(reader.buffers())
    stage2 = plan.stage == 2
    shapes = {n: torch.Size(t.shape) for n, t in frozen.items()}
    frozen_states = (
        ds_states.frozen_fields(shapes, frozen, excluded=facts.info.frozen_excluded)
        if stage2
        else {"frozen_param_shapes": None, "frozen_param_fragments": None}  # stage 1: frozen weights in the module
    )
    states = model_states(
        reader,
        plan,
        extra={
            "param_shapes": [OrderedDict((n, torch.Size(facts.param(n).shape)) for n in group) for group in names],
            "frozen_param_shapes": frozen_states["frozen_param_shapes"],
            "shared_params": dict(facts.tied),
            "frozen_param_fragments": frozen_states["frozen_param_fragments"],
        },
    )
    states["module"] = module
    config = ds_states.config_for_stage(facts.info.ds_config, plan.stage)
    states["ds_config"] = config
    save_rank_file(states, tag_dir / model_file(plan.mp_rank))

    wrapper = zero_wrapper(reader, plan)
    clip_grad = ds_states.clip_grad(reader.extras(), facts.info.ds_config)
    for r in range(dp):
        buffers = ranks.pop(r)
        block = ds_states.zero12_optim_block(
            wrapper=wrapper,
            flavour=plan.flavour,
            fp32=buffers.fp32,
            optim=buffers.optim,
            scalars=buffers.scalars,
            layouts=layouts,
            names=names,
            index=r,
            steps=steps,
            groups=groups,
            clip_grad=clip_grad,
            ds_version=facts.info.ds_version,
            moments=moments,
        )
        save_rank_file(
            ds_states.optim_file_dict(block, config, facts.info.ds_version),
            tag_dir / optim_file(r, plan.mp_rank, bf16=plan.dtype == "bf16"),
        )
    logger.debug("wrote a ZeRO-%d checkpoint for dp=%d to %s", plan.stage, dp, tag_dir)
