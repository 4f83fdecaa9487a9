"""The native ZeRO-3 writer: per-rank model-states and optim-states files for ``plan.dp`` ranks."""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path

import torch

from ucp.deepspeed import states as ds_states
from ucp.deepspeed.layout import optim_file, zero3_model_file
from ucp.errors import InputError
from ucp.model.partition import zero3_partition_size, zero3_rank_span
from ucp.model.records import Reader, torch_dtype
from ucp.targets.blocks.zero3 import fill_ranks, sub_group_keys, sub_group_steps
from ucp.targets.native.common import model_states, optimizer_groups, save_rank_file, zero_wrapper
from ucp.targets.native.plan import NativePlan, param_step

__all__ = ["write_zero3"]

logger = logging.getLogger(__name__)


def write_zero3(reader: Reader, plan: NativePlan, tag_dir: Path, workers: int) -> None:
    """Rank by rank when the reader streams (each pass reads just that rank's share, so memory is one
    rank's buffers); otherwise every parameter is read once into all ranks' buffers together."""
    facts = reader.facts
    layout = plan.layout
    if layout is None:
        raise InputError("a ZeRO-3 plan carries its layout")  # plan_native always sets it at stage 3
    dp = plan.dp
    moments = not plan.reset_moments
    keys = sub_group_keys(reader, layout, moments=moments)
    frozen = [m for m in facts.params if m.frozen]
    frozen_full = {m.name: reader.read(m.name, moments=False).fp32.reshape(-1) for m in frozen}
    param_shapes: list[OrderedDict] = [OrderedDict() for _ in layout.sub_group_numel]
    for g, names in enumerate(plan.group_names):
        for i, name in enumerate(names):
            param_shapes[layout.slots[g][i].sub_group][name] = torch.Size(facts.param(name).shape)
    lp = torch_dtype(plan.dtype)
    wrapper = zero_wrapper(reader, plan)
    batches = [[rank] for rank in range(dp)] if reader.streams else [list(range(dp))]
    settled: tuple[list[int], list[dict]] | None = None
    for batch in batches:
        ranks, seen = fill_ranks(
            reader,
            layout,
            plan.group_names,
            batch,
            keys=keys,
            moments=moments,
            workers=workers,
            step_of=lambda state: param_step(plan, state),
        )
        if settled is None:  # every pass sees every parameter's step; the first settles them
            steps = sub_group_steps(seen)
            members = [layout.sub_groups_in(g) for g in range(len(plan.group_names))]
            group_steps = [max((steps[s] for s in subs), default=0) for subs in members]
            settled = steps, optimizer_groups(reader, plan, members, group_steps)
        steps, groups = settled
        for rank in batch:
            fragments = OrderedDict()
            for meta in frozen:
                start, end = zero3_rank_span(meta.numel, dp, rank)
                fragment = torch.zeros(zero3_partition_size(meta.numel, dp), dtype=lp)
                fragment[: end - start].copy_(frozen_full[meta.name][start:end])
                fragments[meta.name] = fragment
            frozen_states = ds_states.frozen_fields(
                {m.name: torch.Size(m.shape) for m in frozen}, fragments, excluded=facts.info.frozen_excluded
            )
            states = model_states(
                reader,
                plan,
                extra={
                    "param_shapes": param_shapes,
                    "frozen_param_shapes": frozen_states["frozen_param_shapes"],
                    "shared_params": dict(facts.tied),
                    "frozen_param_fragments": frozen_states["frozen_param_fragments"],
                },
            )
            save_rank_file(states, tag_dir / zero3_model_file(rank, plan.mp_rank))
            buffers = ranks.pop(rank)
            block = ds_states.zero3_optim_block(
                wrapper=wrapper,
                flavour=plan.flavour,
                fp32=buffers.fp32,
                optim=buffers.optim,
                scalars=buffers.scalars,
                steps=steps,
                groups=groups,
                dp=dp,
                moments=moments,
            )
            save_rank_file(
                ds_states.optim_file_dict(block, facts.info.ds_config, facts.info.ds_version),
                tag_dir / optim_file(rank, plan.mp_rank, bf16=plan.dtype == "bf16"),
            )
            del buffers, block  # this rank's buffers go before the next pass allocates its own
        del ranks
    logger.debug("wrote a ZeRO-3 checkpoint for dp=%d to %s", plan.dp, tag_dir)
