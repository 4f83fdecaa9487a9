"""Universal (or any reader) -> a DeepSpeed checkpoint without ZeRO (stage 0, DeepSpeed's default).

Call order: ``ucp.targets.native.write_plan`` calls :func:`write_zero0` for stage 0 inside its staged
output folder. Without ZeRO every rank holds the whole model and optimizer, so one file,
``mp_rank_00_model_states.pt`` (one per TP rank), serves any DP size: the module in the run's dtype (frozen weights,
tied aliases and buffers too) and ``optimizer``, what the new engine's optimizer loads. In fp32 that is
the client torch optimizer's own ``state_dict()``: state by parameter index, param groups in the
source's order with their members in its order (which is how DeepSpeed's loader and torch's match
them to the new run's parameters). In bf16 and fp16 DeepSpeed 0.19.8 wraps the optimizer: FP16_UnfusedOptimizer
keeps the same state_dict beside the fp32 masters per group; for DeepSpeed or Apex FusedAdam its fused
FP16_Optimizer steps one flat fp32 master per group (members one after the other, no padding), so the
state is written flat too. Tensors are the reader's spans, copied straight into the file (a reader that
does not stream is read once, parameter by parameter).

At TP > 1 every TP rank has its own such file (``mp_rank_MM_model_states.pt``) of its shards, with the
``universal_checkpoint_info`` describing them. In fp16 the wrapper's fields carry the loss scale (the wrappers keep
no hysteresis or minimum: the new run's config gives those).
"""

from __future__ import annotations

import logging
from itertools import accumulate
from pathlib import Path
from typing import Any

import torch

from ucp.deepspeed import states as ds_states
from ucp.deepspeed.layout import model_file
from ucp.model.loss_scale import LossScale, fresh_fp16_scale
from ucp.model.pieces import Pieces
from ucp.model.records import PieceState, Reader, torch_dtype
from ucp.model.steps import settle_steps
from ucp.targets.blocks.common import merge_scalars
from ucp.targets.blocks.stream import (
    Held,
    Weight,
    flat_pieces,
    locate,
    module_weight,
    read_weight,
    refuse_fp16_overflow,
)
from ucp.targets.native.common import model_states, module_of, optimizer_groups, save_rank_file
from ucp.targets.native.plan import FUSED_WRAPPED, NativePlan, Share, param_step

__all__ = ["write_zero0", "WRITTEN_DTYPES"]

logger = logging.getLogger(__name__)

#: the dtypes a stage-0 checkpoint is written in: fp32 (the client optimizer), bf16 and fp16 (DeepSpeed's wrappers)
WRITTEN_DTYPES = ("fp32", "bf16", "fp16")


def write_zero0(reader: Reader, plan: NativePlan, tag_dir: Path, workers: int, share: Share = Share()) -> None:
    """Write TP rank ``plan.mp_rank``'s one model-states file of a stage-0 checkpoint into ``tag_dir`` (``reader``:
    that rank's view of the shards at TP > 1; under a ``share``, unit ``mp_rank``)."""
    if plan.dtype not in WRITTEN_DTYPES:
        raise ValueError(f"plan_native refuses a stage-0 plan in {plan.dtype}")
    if plan.dtype == "fp16":
        refuse_fp16_overflow(reader, [m.name for m in reader.facts.params])
    mine = share.mine(plan.mp_rank)
    if not mine and not reader.streams:
        return  # a reader that does not stream checks what it reads; nothing is read here
    facts = reader.facts
    moments = not plan.reset_moments
    order = [name for names in plan.group_names for name in names]
    members = [[(name, facts.param(name).numel)] for name in order]  # one "flat group" per parameter
    keys = [facts.groups[g].state_keys if moments else () for g, names in enumerate(plan.group_names) for _ in names]
    view = reader if reader.streams else Held(reader)
    with view.deferred_checks(share.elsewhere if share.checked is not None else None):
        located = locate(
            view,
            members,
            keys,
            moments=moments,
            workers=workers,
            step_of=lambda state: param_step(plan, state),
            unit="parameter",
        )
        if not mine:
            return  # the other processes write the file; this one checked its share of the source on the way
        states = [located.states[name] for name in order]
        steps = [next(iter(seen)) for seen in located.steps]
        firsts = list(accumulate((len(names) for names in plan.group_names), initial=0))
        spans = [range(a, b) for a, b in zip(firsts, firsts[1:])]
        if plan.dtype != "fp32" and plan.flavour.name in FUSED_WRAPPED:
            optimizer = _fused(reader, plan, states, steps, located.scalars, spans, moments)
        else:
            groups = optimizer_groups(
                reader,
                plan,
                [list(span) for span in spans],
                [_group_step(plan, [steps[i] for i in span]) for span in spans],
            )
            optimizer = ds_states.client_state_dict(
                flavour=plan.flavour,
                optim=[state.optim for state in states],
                steps=steps,
                scalars=located.scalars,
                groups=groups,
                moments=moments,
            )
            if plan.dtype != "fp32":
                masters = [[states[i].fp32 for i in span] for span in spans]
                optimizer = ds_states.unfused_wrapper(optimizer, masters, scale=_wrapper_scale(reader, plan))
        lp = torch_dtype(plan.dtype)
        weights = {name: module_weight(state, lp) for name, state in located.states.items()}
        save_rank_file(_model_file(reader, plan, weights, optimizer), tag_dir / model_file(plan.mp_rank))
    logger.debug("wrote a checkpoint without ZeRO (%s) to %s", plan.dtype, tag_dir)


def _fused(
    reader: Reader,
    plan: NativePlan,
    states: list[PieceState],
    steps: list[int],
    scalars: list[dict[str, torch.Tensor]],
    spans: list[range],
    moments: bool,
) -> dict[str, Any]:
    """FP16_Optimizer's dict: per param group one flat fp32 master, its members' one after the other (no
    padding), stepped as one tensor with one step and one set of scalars."""
    facts = reader.facts
    flat_steps = settle_steps([{steps[i] for i in span} for span in spans], "param group")
    flat_scalars: list[dict[str, torch.Tensor]] = [{} for _ in spans]
    flats: list[Pieces] = []
    optim: list[dict[str, Pieces]] = []
    for g, span in enumerate(spans):
        offsets = list(accumulate((states[i].fp32.numel for i in span), initial=0))
        size = offsets[-1]
        flats.append(flat_pieces(size, [(o, states[i].fp32) for o, i in zip(offsets, span)]))
        keys = facts.groups[g].state_keys if moments else ()
        optim.append({k: flat_pieces(size, [(o, states[i].optim[k]) for o, i in zip(offsets, span)]) for k in keys})
        for i in span:
            if moments:
                merge_scalars(plan.group_names[g][i - span.start], states[i], flat_scalars[g], "param group")
    groups = optimizer_groups(reader, plan, [[g] for g in range(len(spans))], flat_steps)
    inner = ds_states.client_state_dict(
        flavour=plan.flavour, optim=optim, steps=flat_steps, scalars=flat_scalars, groups=groups, moments=moments
    )
    clip = ds_states.clip_grad(reader.extras(), facts.info.ds_config, facts.info.ds_version)
    scale = _wrapper_scale(reader, plan) if plan.dtype == "fp16" else None
    return ds_states.fused_wrapper(inner, flats, clip_grad=clip, scale=scale)


def _group_step(plan: NativePlan, steps: list[int]) -> int:
    """A param group's step: one for all its members where the optimizer reads it from the group (Apex),
    else the newest (DeepSpeed FusedAdam's stale copy; torch keeps none)."""
    if plan.flavour.step_in_group and not plan.flavour.step_in_state:
        return settle_steps([set(steps)], "param group")[0]
    return max(steps, default=0)


def _wrapper_scale(reader: Reader, plan: NativePlan) -> LossScale:
    """The loss scale the wrapper is written with. fp16: the source's when it ran in fp16 (a ZeRO run's scaler
    or a wrapper's), else what the source config's fp16 block (or DeepSpeed's defaults) starts. bf16: a static
    scale, the source's when it ran in bf16, else 1; its iteration count is the engine's step count."""
    facts = reader.facts
    saved = ds_states.loss_scale_of(reader.extras().get("loss_scaler")) if facts.info.dtype == plan.dtype else None
    if plan.dtype == "fp16":
        return saved if saved is not None else fresh_fp16_scale(facts.info.ds_config)
    cur_scale = saved.cur_scale if saved is not None else 1.0
    return LossScale(dynamic=False, cur_scale=cur_scale, cur_iter=facts.info.global_steps)


def _model_file(reader: Reader, plan: NativePlan, weights: dict[str, Weight], optimizer: Any) -> dict[str, Any]:
    """The fields a stage-0 engine saves: the whole module and its optimizer; no ZeRO shapes (None)."""
    facts = reader.facts
    lp = torch_dtype(plan.dtype)
    others = {m.name: read_weight(reader, m.name, lp) for m in facts.params if m.name not in weights}
    none = dict.fromkeys(("param_shapes", "frozen_param_shapes", "shared_params", "frozen_param_fragments"))
    states = model_states(reader, plan, extra=none)
    states["module"] = module_of(reader, {**weights, **others})
    states["optimizer"] = optimizer
    states["ds_config"] = ds_states.config_for_stage(facts.info.ds_config, 0)
    return states
