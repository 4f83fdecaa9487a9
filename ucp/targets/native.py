"""Universal (or any reader) -> a native ZeRO checkpoint that stock DeepSpeed loads at DP=N.

Call order: :func:`plan_native` fixes every choice (DP, stage, flavour, dtype, sub-groups, step)
as plain data and checks it; :func:`write_native` reads each parameter once, scatters it into every
rank's flat buffers, and writes ``OUT/latest`` plus ``OUT/<tag>/`` atomically. A new engine then
loads it with a plain ``engine.load_checkpoint(OUT)``.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from ucp import flavors, torchfile
from ucp.atomic import staged_output
from ucp.errors import ConfigError
from ucp.partition import Zero3Layout, zero3_layout, zero3_partition_size, zero3_rank_span
from ucp.records import DTYPES, Facts, ParamState, Reader, torch_dtype
from ucp.sources import open_reader
from ucp.targets.zero3 import fill_ranks, optim_block, sub_group_steps
from ucp.universal import default_workers

__all__ = ["NativePlan", "plan_native", "write_native", "DS_DEFAULT_SUB_GROUP_SIZE"]

logger = logging.getLogger(__name__)

#: DeepSpeed's default ``zero_optimization.sub_group_size`` (0.19.8).
DS_DEFAULT_SUB_GROUP_SIZE = 1_000_000_000


@dataclass
class NativePlan:
    """Every decision of a native write, as data: what ``ucp restore --dry-run`` would show."""

    dp: int
    stage: int
    flavour: flavors.Flavour
    dtype: str
    tag: str
    sub_group_size: int
    step: int | None  # the step written for every optimized parameter (None: each keeps its own)
    reset_moments: bool
    group_names: list[list[str]]
    layout: Zero3Layout | None = None
    notes: list[str] = field(default_factory=list)
    tp: int = 1  # tensor-parallel degree of the checkpoint written
    mp_rank: int = 0  # the TP rank whose files are being written


def plan_native(facts: Facts, *, dp: int, stage: int = 3, optimizer: str | None = None, dtype: str | None = None,
                tag: str | None = None, sub_group_size: int | None = None, step: int | str | None = "keep",
                tp: int = 1) -> NativePlan:
    """Check the options against the checkpoint and fix every choice of the write."""
    problems = []
    if not isinstance(dp, int) or dp < 1:
        problems.append(f"--dp must be a positive integer, got {dp!r}")
    if not isinstance(tp, int) or tp < 1:
        problems.append(f"--tp must be a positive integer, got {tp!r}")
    elif tp > 1 and stage == 3:
        problems.append("--tp > 1 needs --stage 1 or 2: DeepSpeed's tensor parallelism (AutoTP) trains with ZeRO "
                        "stages 0-2")
    if stage not in (1, 2, 3):
        problems.append(f"--stage must be 1, 2 or 3, got {stage!r}")
    dtype = dtype or facts.info.dtype
    if dtype not in DTYPES:
        problems.append(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    name = optimizer or facts.flavour
    if name is None:
        problems.append("the source's optimizer flavour is unknown; name it with --optimizer "
                        f"({', '.join(flavors.FLAVOURS)})")
    elif name not in flavors.FLAVOURS:
        problems.append(f"unknown optimizer flavour {name!r}; choose one of {', '.join(flavors.FLAVOURS)}")
    reset = step == "reset"
    if step in (None, "keep"):
        fixed = None
    elif reset:
        fixed = 0
    elif isinstance(step, int) and not isinstance(step, bool) and step >= 0:
        fixed = step
    else:
        problems.append(f"step must be 'keep', 'reset' or a non-negative integer, got {step!r}")
        fixed = None
    if problems:
        raise ConfigError("; ".join(problems))
    if sub_group_size is not None and sub_group_size < 1:
        raise ConfigError(f"sub_group_size must be positive, got {sub_group_size}")
    size = sub_group_size or facts.info.sub_group_size or DS_DEFAULT_SUB_GROUP_SIZE
    group_names = [list(g.params) for g in facts.groups]
    plan = NativePlan(dp=dp, stage=stage, flavour=flavors.get(name), dtype=dtype,
                      tag=tag or f"global_step{facts.info.global_steps}", sub_group_size=size, step=fixed,
                      reset_moments=reset, group_names=group_names, tp=tp)
    if stage == 3:
        numels = [[facts.param(n).numel for n in names] for names in group_names]
        plan.layout = zero3_layout(numels, dp, size)
    if name != facts.flavour and facts.flavour is not None:
        plan.notes.append(f"optimizer state converted from {facts.flavour} to {name}")
    if "/" in plan.tag or plan.tag in ("", ".", ".."):
        raise ConfigError(f"tag {plan.tag!r} is not a folder name")
    return plan


def _rank_optim_name(plan: NativePlan, rank: int) -> str:
    prefix = "bf16_" if plan.dtype == "bf16" else ""
    return f"{prefix}zero_pp_rank_{rank}_mp_rank_{plan.mp_rank:02d}_optim_states.pt"


def write_native(source: Reader | str | os.PathLike, out: str | os.PathLike, *, dp: int, stage: int = 3,
                 optimizer: str | None = None, dtype: str | None = None, tag: str | None = None,
                 sub_group_size: int | None = None, step: int | str | None = "keep", overwrite: bool = False,
                 workers: int | None = None, fsync: bool = False, tp: int = 1) -> NativePlan:
    """Write ``out/latest`` and ``out/<tag>/`` for a DeepSpeed engine of DP size ``dp`` (and TP degree ``tp``).

    At ``tp`` > 1 each TP rank's files hold its shards, cut by the rules the checkpoint records
    (``ucp.tp``); the model-states files carry a ``universal_checkpoint_info`` describing them.
    """
    reader = open_reader(source) if isinstance(source, (str, os.PathLike)) else source
    try:
        plan = plan_native(reader.facts, dp=dp, stage=stage, optimizer=optimizer, dtype=dtype, tag=tag,
                           sub_group_size=sub_group_size, step=step, tp=tp)
        if plan.stage != 3:
            from ucp.targets.native12 import write_native12
            from ucp.targets.tensor_parallel import TpShardReader, rank_layouts

            with staged_output(out, overwrite=overwrite, durable=fsync) as root:
                (root / plan.tag).mkdir()
                for mp_rank in range(plan.tp):
                    view = TpShardReader(reader, rank_layouts(reader, plan.tp, mp_rank), tp=plan.tp, rank=mp_rank)
                    write_native12(view, replace(plan, mp_rank=mp_rank), root / plan.tag,
                                   workers or default_workers())
                (root / "latest").write_text(plan.tag)
            return plan
        with staged_output(out, overwrite=overwrite, durable=fsync) as root:
            tag_dir = root / plan.tag
            tag_dir.mkdir()
            _write_zero3(reader, plan, tag_dir, workers or default_workers())
            (root / "latest").write_text(plan.tag)
        logger.info("wrote a ZeRO-3 checkpoint for dp=%d to %s", plan.dp, out)
        return plan
    finally:
        if reader is not source:
            reader.close()


def param_step(plan: NativePlan, state: ParamState) -> int:
    """The step a target writes for one parameter under the plan."""
    if plan.step is not None:
        return plan.step
    return int(state.step or 0)


def lp_placeholder(dtype: str) -> torch.Tensor:
    """ZeRO-3 model-states files hold an empty tensor where each partitioned parameter goes."""
    return torch.empty(0, dtype=torch_dtype(dtype))


def model_states(reader: Reader, plan: NativePlan, *, extra: dict[str, Any]) -> dict[str, Any]:
    """The fields of a model-states file every stage shares (engine counters, scheduler, buffers)."""
    facts = reader.facts
    extras = reader.extras()
    info = facts.info
    module: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    for meta in facts.params:
        module[meta.name] = lp_placeholder(plan.dtype)
    for alias in facts.tied:
        module[alias] = lp_placeholder(plan.dtype)
    buffers = reader.buffers()
    module.update(buffers)
    states: dict[str, Any] = {
        "module": module,
        "buffer_names": list(facts.buffer_names),
        "optimizer": None,
        "lr_scheduler": extras.get("lr_scheduler"),
        "data_sampler": extras.get("data_sampler"),
        "random_ltd": extras.get("random_ltd"),
        "sparse_tensor_module_names": set(),
        "skipped_steps": info.skipped_steps,
        "global_steps": info.global_steps,
        "global_samples": info.global_samples if info.global_samples is not None else 0,
        "dp_world_size": plan.dp,
        "mp_world_size": plan.tp,
        "ds_config": info.ds_config,
        "ds_version": info.ds_version,
    }
    if plan.tp > 1:
        from ucp.targets.tensor_parallel import target_tp_info

        states["universal_checkpoint_info"] = target_tp_info(reader, plan.tp)
        states["checkpoint_parallel_dimensions"] = {"pp_degree": 1, "tp_degree": plan.tp}
    states.update(extra)
    states.update(extras.get("client_state") or {})
    return states


def zero_block(reader: Reader, plan: NativePlan) -> dict[str, Any]:
    """The ZeRO wrapper fields shared by every rank's optim file."""
    extras = reader.extras()
    scaler = extras.get("loss_scaler")
    if scaler is None or plan.dtype != reader.facts.info.dtype:
        scaler = torchfile.LossScaler(cur_scale=1.0, dynamic=False)
    return {
        "zero_stage": torchfile.ZeroStageEnum(plan.stage),
        "loss_scaler": scaler,
        "dynamic_loss_scale": extras.get("dynamic_loss_scale") is True and plan.dtype == "fp16",
        "overflow": False,
    }


def optimizer_groups(reader: Reader, plan: NativePlan, members: list[list[int]], steps: list[int]) -> list[dict]:
    """The wrapped optimizer's param groups: target-flavour keys, each group's own hyperparameters."""
    groups = []
    for g, meta in enumerate(reader.facts.groups):
        group = plan.flavour.make_group(meta.hyper, steps[g])
        group["params"] = members[g]
        groups.append(group)
    return groups


def _write_zero3(reader: Reader, plan: NativePlan, tag_dir: Path, workers: int) -> None:
    """Rank by rank when the reader can hand out slices (``read_pieces``): each pass reads just that
    rank's share, so memory is one rank's buffers; otherwise every parameter is read once into all
    ranks' buffers together."""
    facts = reader.facts
    layout = plan.layout
    assert layout is not None
    dp = plan.dp
    moments = not plan.reset_moments
    frozen = [m for m in facts.params if m.frozen]
    frozen_full = {m.name: reader.read(m.name, moments=False).fp32.reshape(-1) for m in frozen}
    param_shapes: list[OrderedDict] = [OrderedDict() for _ in layout.sub_group_numel]
    for g, names in enumerate(plan.group_names):
        for i, name in enumerate(names):
            param_shapes[layout.slots[g][i].sub_group][name] = torch.Size(facts.param(name).shape)
    lp = torch_dtype(plan.dtype)
    wrapper = zero_block(reader, plan)
    batches = [[rank] for rank in range(dp)] if hasattr(reader, "read_pieces") else [list(range(dp))]
    settled: tuple[list[int], list[dict]] | None = None
    for batch in batches:
        ranks, seen = fill_ranks(reader, layout, plan.group_names, batch, moments=moments, workers=workers,
                                 step_of=lambda state: param_step(plan, state))
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
            states = model_states(reader, plan, extra={
                "param_shapes": param_shapes,
                "frozen_param_shapes": OrderedDict((m.name, torch.Size(m.shape)) for m in frozen),
                "shared_params": dict(facts.tied),
                "frozen_param_fragments": fragments,
            })
            torchfile.save(states, tag_dir / f"zero_pp_rank_{rank}_mp_rank_{plan.mp_rank:02d}_model_states.pt")
            _save_optim(tag_dir / _rank_optim_name(plan, rank), facts, optim_block(
                wrapper=wrapper, flavour=plan.flavour, buffers=ranks.pop(rank), steps=steps, groups=groups, dp=dp,
                moments=moments or bool(plan.step)))
        del ranks  # before the next pass allocates its rank's buffers


def _save_optim(path: Path, facts: Facts, block: dict[str, Any]) -> None:
    """A rank's optim file; its buffers are freed as soon as this returns."""
    torchfile.save({"optimizer_state_dict": block, "ds_config": facts.info.ds_config,
                    "ds_version": facts.info.ds_version}, path)
