"""Universal -> a torch.distributed.checkpoint (DCP) folder that FSDP2 and plain torch runs load.

The folder holds what ``get_state_dict(model, optimizer)`` gives for the same model, written by
DCP's own ``FileSystemWriter``, so a run resumes with the standard lines at any world size (DCP
reshards on load)::

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=OUT)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

With ``layout="torchtitan"`` it holds what torchtitan's CheckpointManager (0.3) loads instead: model
FQNs at the top level, ``optimizer`` flattened as its OptimizersContainer keeps it, ``lr_scheduler``
as ``{"last_epoch"}``, ``train_state`` as ``{"step", "ntokens_seen"}`` (load it with
``exclude_from_loading=["dataloader"]``: no source has torchtitan's dataloader state).

Besides ``model`` and ``optim`` it holds ``lr_scheduler`` (the scheduler's state_dict),
``train_state`` (``step``, ``global_samples``, ``skipped_steps``) and ``ucp`` (a JSON string:
tied aliases, buffers, model dtype) so that :class:`ucp.sources.dcp.DcpSource` reads it back
exactly (docs/format.md, section 6).

Call order: :func:`write_dcp` opens a reader, :func:`plan_dcp` lays out every entry from the facts
alone (tensors as meta tensors, small values real), then DCP's writer asks for each tensor as it
writes it and the reader reads that parameter then: memory stays near one parameter.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from ucp.deepspeed import states as ds_states
from ucp.errors import ConfigError, InputError
from ucp.frameworks.dcp import MODEL, OPTIM, SCHEDULER, TRAIN_STATE, UCP_KEY, read_metadata
from ucp.io.guard import OutputPolicy, guarded_output, universal_bytes
from ucp.io.timing import phase
from ucp.model import flavours
from ucp.model.option_table import DCP_LAYOUTS, Option
from ucp.model.options import StepPolicy, parse_step
from ucp.model.records import Facts, Reader
from ucp.sources import opened
from ucp.targets.dcp_save import Fetch, save_state
from ucp.targets.format import Request, TargetFormat, Written
from ucp.transforms import ResetOptimizer, TransformedReader, plan_transforms

__all__ = [
    "FORMAT",
    "write_dcp",
    "plan_dcp",
    "prepare",
    "source_optimizer",
    "DcpPlan",
    "DCP_OPTIMIZERS",
    "DCP_LAYOUTS",
]

logger = logging.getLogger(__name__)

#: what --optimizer may name for a DCP output: torch optimizers (AdamW is Adam with decoupled decay) and the
#: schedule-free ones, which keep their state as torch's do
DCP_OPTIMIZERS = ("torch-adamw", *(name for name in flavours.FLAVOURS if name.startswith(("torch-", "sf-"))))
#: torchtitan's key for the optimizer (torchtitan.components.checkpoint.OPTIMIZER)
TT_OPTIMIZER = "optimizer"


@dataclass
class DcpPlan:
    """The state dict to save: tensors are meta tensors, ``lazy`` says where each one's data comes from."""

    state: dict[str, Any]
    #: flattened DCP key -> (parameter name, "fp32" or an optimizer state key); buffers are real tensors
    lazy: dict[str, tuple[str, str]] = field(default_factory=dict)
    flavour: str = "torch-adam"
    layout: str = "torch"
    notes: list[str] = field(default_factory=list)


def _flavour(optimizer: str) -> tuple[flavours.Flavour, bool | None]:
    """The flavour whose state torch keeps, and AdamW's decoupled weight decay where it applies."""
    if optimizer not in DCP_OPTIMIZERS:
        raise ConfigError(f"--optimizer for a DCP output must be one of {', '.join(DCP_OPTIMIZERS)}, got {optimizer!r}")
    if optimizer == "torch-adamw":
        return flavours.FLAVOURS["torch-adam"], True
    return flavours.get(optimizer), (False if optimizer == "torch-adam" else None)


def _reset(reader: Reader) -> Reader:
    """``reader`` with every parameter's optimizer state reset (ucp.transforms' reset of a migration)."""
    return TransformedReader(reader, plan_transforms(reader.facts, [ResetOptimizer((".*",))]))


def source_optimizer(facts: Facts) -> str:
    """The torch optimizer a DCP output is written for when none is named: the source's own where torch has
    it (SGD stays SGD), else AdamW (Adam where the source's Adam did not decouple its weight decay)."""
    if facts.flavour in DCP_OPTIMIZERS and flavours.FLAVOURS[facts.flavour].family != "adam":
        return facts.flavour
    return "torch-adam" if {g.hyper.adam_w_mode for g in facts.groups} == {False} else "torch-adamw"


def _meta(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _groups(facts: Facts, kind: flavours.Flavour, adam_w: bool | None, plan: DcpPlan) -> list[dict[str, Any]]:
    """param_groups as the torch optimizer's state_dict has them, members named by FQN."""
    groups = []
    for meta in facts.groups:
        hyper = meta.hyper
        if adam_w is not None and kind.family == "adam":
            if hyper.adam_w_mode is not None and hyper.adam_w_mode != adam_w and hyper.weight_decay:
                plan.notes.append(
                    f"group {meta.index}: the source used {'decoupled' if hyper.adam_w_mode else 'L2'} weight "
                    f"decay; the output follows --optimizer ({'AdamW' if adam_w else 'Adam'})"
                )
            hyper = replace(hyper, adam_w_mode=adam_w)
        group = kind.make_group(hyper, int(meta.step or 0), meta.raw)
        group["params"] = list(meta.params)
        groups.append(group)
    return groups


def _optim_state(
    facts: Facts, kind: flavours.Flavour, steps: Mapping[str, int | None], plan: DcpPlan, prefix: str
) -> dict[str, dict[str, Any]]:
    """Each trained parameter's optimizer state by FQN (meta tensors; ``prefix`` + FQN + key is lazy)."""
    params = {p.name: p for p in facts.params}
    state: dict[str, dict[str, Any]] = {}
    for group in facts.groups:
        if group.step is None and kind.has_step:
            continue  # never stepped: torch keeps no state yet
        if not group.state_keys:
            continue
        for name in group.params:
            tensors = {k: _meta(params[name].shape) for k in group.state_keys}
            scalars = {k: _meta(()) for k in kind.scalars}
            for key in (*scalars, *tensors):
                plan.lazy[f"{prefix}{name}.{key}"] = (name, key)
            own = steps.get(name, group.step)  # a migration's reset restarts one parameter's step
            state[name] = kind.make_state(tensors, int(own if own is not None else group.step or 0), scalars)
    return state


def _model(facts: Facts, buffers: Mapping[str, torch.Tensor], plan: DcpPlan, prefix: str) -> dict[str, Any]:
    """Model entries by FQN as ``model.state_dict()`` has them: parameters, tied aliases, buffers."""
    params = {p.name for p in facts.params}
    for alias, owner in facts.tied.items():
        if owner not in params:
            raise InputError(f"tied alias {alias!r} points at {owner!r}, which is not a parameter of the checkpoint")
    model: dict[str, Any] = {}
    for meta in facts.params:
        model[meta.name] = _meta(meta.shape)
        plan.lazy[f"{prefix}{meta.name}"] = (meta.name, "fp32")
    for alias, owner in facts.tied.items():
        model[alias] = model[owner]  # torch reports the alias with the owner's tensor
        plan.lazy[f"{prefix}{alias}"] = (owner, "fp32")
    model.update(buffers)
    return model


def _torchtitan(plan: DcpPlan, model: dict[str, Any], optim: dict[str, Any], extras: Mapping[str, Any]) -> None:
    """torchtitan's CheckpointManager layout (0.3): model FQNs at the top level; ``optimizer`` as
    OptimizersContainer flattens it (``state.FQN.KEY``, ``param_groups.FQN.KEY``); ``lr_scheduler``
    as LRSchedulersContainer keeps it (``last_epoch``); ``train_state`` as its Trainer does."""
    flat: dict[str, Any] = {}
    for name, state in optim["state"].items():
        flat.update({f"state.{name}.{key}": value for key, value in state.items()})
    for group in optim["param_groups"]:
        values = {k: v for k, v in group.items() if k != "params"}
        values.setdefault("initial_lr", values.get("lr"))  # torchtitan always runs a LambdaLR, which adds it
        for name in group["params"]:
            flat.update({f"param_groups.{name}.{key}": value for key, value in values.items()})
    train = plan.state[TRAIN_STATE]
    scheduler = extras.get("lr_scheduler")
    epoch = scheduler.get("last_epoch") if isinstance(scheduler, Mapping) else None
    if epoch is None:
        epoch = train["step"]
        plan.notes.append(f"the source has no lr scheduler state; lr_scheduler.last_epoch is the step, {epoch}")
    plan.notes.append("train_state.ntokens_seen is not recorded by the source; written as 0 (torchtitan logs it)")
    plan.state = {
        **model,
        TT_OPTIMIZER: flat,
        SCHEDULER: {"last_epoch": int(epoch)},
        TRAIN_STATE: {"step": int(train["step"]), "ntokens_seen": 0},
        UCP_KEY: plan.state[UCP_KEY],
    }


def plan_dcp(
    facts: Facts,
    buffers: Mapping[str, torch.Tensor],
    extras: Mapping[str, Any],
    optimizer: str | None = None,
    *,
    steps: Mapping[str, int | None] | None = None,
    layout: str = "torch",
    step: int | None = None,
    reset: bool = False,
    optim_key: str = OPTIM,
) -> DcpPlan:
    """Lay out the DCP state dict from the facts alone (no parameter is read). ``steps`` overrides
    single parameters' steps (torch keeps one per parameter); ``layout`` is one of DCP_LAYOUTS; ``step``
    gives every parameter that step; ``reset``: the facts are of a reset reader (zero state, step 0);
    ``optim_key``: the optimizer's top-level key in the torch layout (Accelerate's FSDP save: ``optimizer``)."""
    if layout not in DCP_LAYOUTS:
        raise ConfigError(f"--dcp-layout must be one of {', '.join(DCP_LAYOUTS)}, got {layout!r}")
    optimizer = optimizer or source_optimizer(facts)
    kind, adam_w = _flavour(optimizer)
    has_state = any(g.state_keys for g in facts.groups)
    source = flavours.FLAVOURS.get(facts.flavour or "")
    if reset and has_state and source is not None and source.family != kind.family:
        raise ConfigError(
            f"--step reset writes {source.name}'s own state, zeroed, where a DCP folder keeps it; a {optimizer} run "
            "starts afresh from the weights alone: dcp.load({'model': ...}) from a folder written without --optimizer"
        )
    flavours.check_family(facts.flavour, kind, has_state, whole=True)
    plan = DcpPlan(state={}, flavour=optimizer, layout=layout)
    if reset and has_state:
        plan.notes.append("the optimizer state is reset: zero tensors and step 0")
    if step is not None:
        steps = {name: step for g in facts.groups for name in g.params}
    titan = layout == "torchtitan"
    model = _model(facts, buffers, plan, "" if titan else f"{MODEL}.")
    prefix = f"{TT_OPTIMIZER}.state." if titan else f"{optim_key}.state."
    optim = {
        "state": _optim_state(facts, kind, steps or {}, plan, prefix),
        "param_groups": _groups(facts, kind, adam_w, plan),
    }
    info = facts.info
    train: dict[str, Any] = {
        "step": info.global_steps,
        "global_samples": info.global_samples or 0,
        "skipped_steps": info.skipped_steps,
    }
    scale = ds_states.loss_scale_of(extras.get("loss_scaler")) if info.dtype == "fp16" else None
    if scale is not None:
        plan.notes.append(
            f"the source trained in fp16 with a {'dynamic' if scale.dynamic else 'static'} loss scale of "
            f"{scale.cur_scale:g}: DCP keeps no loss scaler; "
            + (
                "train_state.loss_scale holds it (torch.amp.GradScaler(init_scale=...) continues it; ucp reads it back)"
                if layout == "torch"
                else "torchtitan's train_state has no place for it"
            )
        )
        if layout == "torch":
            train["loss_scale"] = scale.scaler_fields()
    record = {"format_version": 1, "dtype": info.dtype, "tied": facts.tied, "buffers": list(facts.buffer_names)}
    plan.state = {MODEL: model, optim_key: optim, TRAIN_STATE: train, UCP_KEY: json.dumps(record, sort_keys=True)}
    if titan:
        _torchtitan(plan, model, optim, extras)
    elif extras.get("lr_scheduler") is not None:
        plan.state[SCHEDULER] = extras["lr_scheduler"]
    return plan


def prepare(
    reader: Reader,
    optimizer: str | None,
    step: StepPolicy,
    *,
    layout: str = "torch",
    steps: Mapping[str, int | None] | None = None,
    optim_key: str = OPTIM,
) -> tuple[Reader, DcpPlan]:
    """The reader to write from (``reader``, or it with its optimizer state reset when ``step`` says ``reset``) and
    the plan of the state dict (:func:`plan_dcp`) by ``step``: ``keep``, ``reset``, or one step for all."""
    policy = parse_step(step)
    if policy == "reset":
        reader = _reset(reader)
    plan = plan_dcp(
        reader.facts,
        reader.buffers(),
        reader.extras(),
        optimizer,
        steps=reader.param_steps() if steps is None else steps,
        layout=layout,
        step=policy if isinstance(policy, int) else None,
        reset=policy == "reset",
        optim_key=optim_key,
    )
    return reader, plan


def write_dcp(
    source: str | os.PathLike | Reader,
    out: str | os.PathLike,
    *,
    optimizer: str | None = None,
    tag: str | None = None,
    layout: str = "torch",
    steps: Mapping[str, int | None] | None = None,
    step: StepPolicy = "keep",
    overwrite: bool | OutputPolicy = False,
    fsync: bool = False,
) -> DcpPlan:
    """Write ``source`` (universal directory, DeepSpeed or DCP checkpoint, or a reader) as a DCP folder
    at ``out`` for ``optimizer`` (None: :func:`source_optimizer`) in ``layout`` (DCP_LAYOUTS); OUT appears
    whole or not at all.
    ``steps`` overrides single parameters' steps (a migration's resets); ``step``: ``keep`` each parameter's,
    ``reset`` the optimizer (zero state and step 0: what a fresh torch optimizer holds after its first
    state init), or one step for all. Returns the plan (with its notes)."""
    if optimizer is not None:
        _flavour(optimizer)  # refuse a bad name before anything is opened
    if layout not in DCP_LAYOUTS:
        raise ConfigError(f"--dcp-layout must be one of {', '.join(DCP_LAYOUTS)}, got {layout!r}")
    with opened(source, tag=tag) as opened_reader:
        reader, plan = prepare(opened_reader, optimizer, step, layout=layout, steps=steps)
        size = universal_bytes(reader.facts)
        with guarded_output(out, reader.inputs, overwrite, size=size, durable=fsync, check=read_metadata) as root:
            with phase("write the DCP folder"):
                save_state(plan.state, plan.lazy, root, Fetch(reader), fsync)
    logger.debug("wrote a DCP checkpoint (%s) to %s", plan.flavour, out)
    return plan


def _write(reader: Reader, out: Path, request: Request) -> Written:
    layout = request.get("dcp_layout") or "torch"
    plan = write_dcp(
        reader, out, optimizer=request.get("optimizer"), step=request.get("step"), layout=layout,
        overwrite=request.overwrite, fsync=request.fsync,
    )  # fmt: skip
    summary = f"wrote a torch.distributed.checkpoint folder ({plan.flavour}, {layout} layout) to {out}"
    return Written(summary, list(plan.notes), {"format": "dcp", "optimizer": plan.flavour, "layout": layout})


def _refusal(options: list[Option], request: Request) -> str:
    flags = [o.flag for o in options]
    one = len(flags) == 1
    return (
        f"{', '.join(flags)} describe{'s' if one else ''} a DeepSpeed output; a DCP folder holds fp32 masters that FSDP2 "
        f"loads at any world size: drop --format dcp, or {'it' if one else 'them'}"
    )


FORMAT = TargetFormat(
    name="dcp",
    label="a torch.distributed.checkpoint folder (FSDP2, torchtitan)",
    docs="format.md#6-torchdistributedcheckpoint-fsdp2",
    write=_write,
    serves=lambda reader, request: False,  # only when asked for (--format dcp, format: dcp)
    refusal=_refusal,
)
