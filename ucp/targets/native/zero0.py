"""Universal (or any reader) -> a DeepSpeed checkpoint without ZeRO (stage 0, DeepSpeed's default).

Call order: ``ucp.targets.native.write_plan`` calls :func:`write_zero0` for stage 0 inside its staged
output folder. Without ZeRO every rank holds the whole model and optimizer, so one file,
``mp_rank_00_model_states.pt``, serves any DP size: the module in the run's dtype (frozen weights,
tied aliases and buffers too) and ``optimizer``, what the new engine's optimizer loads. In fp32 that is
the client torch optimizer's own ``state_dict()``: state by parameter index, param groups in the
source's order with their members in its order (which is how DeepSpeed's loader and torch's match
them to the new run's parameters). In bf16 it is DeepSpeed 0.19.8's FP16_UnfusedOptimizer's, which
wraps the same state_dict with the fp32 masters per group. Tensors are the reader's spans, copied
straight into the file (a reader that does not stream is read once, parameter by parameter).

Not written: fp16 (the wrapper's dynamic loss scale), tensor parallelism, and DeepSpeed's fused
FP16_Optimizer (bf16/fp16 with DeepSpeed or Apex FusedAdam, which keeps one flat master per group).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ucp.deepspeed import states as ds_states
from ucp.deepspeed.layout import model_file
from ucp.model.records import Reader, torch_dtype
from ucp.model.steps import settle_steps
from ucp.targets.blocks.stream import Held, Weight, locate, module_weight, read_weight
from ucp.targets.native.common import model_states, module_of, optimizer_groups, save_rank_file
from ucp.targets.native.plan import NativePlan, Share, param_step

__all__ = ["write_zero0", "WRITTEN_DTYPES"]

logger = logging.getLogger(__name__)

#: the dtypes a stage-0 checkpoint is written in: fp32 (the client optimizer) and bf16 (FP16_UnfusedOptimizer)
WRITTEN_DTYPES = ("fp32", "bf16")


def write_zero0(reader: Reader, plan: NativePlan, tag_dir: Path, workers: int, share: Share = Share()) -> None:
    """Write the one model-states file of a stage-0 checkpoint into ``tag_dir`` (under a ``share``: unit 0)."""
    if plan.dtype not in WRITTEN_DTYPES or plan.tp != 1:
        raise ValueError(f"plan_native refuses a stage-0 plan in {plan.dtype} at TP={plan.tp}")
    if not share.mine(0):
        return
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
        steps = [next(iter(seen)) for seen in located.steps]
        at = 0
        indices: list[list[int]] = []
        for names in plan.group_names:
            indices.append(list(range(at, at + len(names))))
            at += len(names)
        groups = optimizer_groups(
            reader, plan, indices, [_group_step(plan, [steps[i] for i in idx]) for idx in indices]
        )
        states = [located.states[name] for name in order]
        optimizer = ds_states.zero0_optimizer(
            flavour=plan.flavour,
            optim=[state.optim for state in states],
            steps=steps,
            scalars=located.scalars,
            groups=groups,
            moments=moments,
            masters=None if plan.dtype == "fp32" else [[states[i].fp32 for i in idx] for idx in indices],
            cur_scale=_static_scale(reader, plan),
            cur_iter=facts.info.global_steps,
        )
        lp = torch_dtype(plan.dtype)
        weights = {name: module_weight(state, lp) for name, state in located.states.items()}
        save_rank_file(_model_file(reader, plan, weights, optimizer), tag_dir / model_file(0))
    logger.debug("wrote a checkpoint without ZeRO (%s) to %s", plan.dtype, tag_dir)


def _group_step(plan: NativePlan, steps: list[int]) -> int:
    """A param group's step: one for all its members where the optimizer reads it from the group (Apex),
    else the newest (DeepSpeed FusedAdam's stale copy; torch keeps none)."""
    if plan.flavour.step_in_group and not plan.flavour.step_in_state:
        return settle_steps([set(steps)], "param group")[0]
    return max(steps, default=0)


def _static_scale(reader: Reader, plan: NativePlan) -> float:
    """FP16_UnfusedOptimizer's static loss scale in bf16: the source's when it ran in bf16, else 1."""
    scaler = reader.extras().get("loss_scaler")
    if scaler is None or reader.facts.info.dtype != plan.dtype:
        return 1.0
    return float(getattr(scaler, "cur_scale", 1.0))


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
