"""What the live-engine restores of every ZeRO stage share: group matching, name checks, steps, counters."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from itertools import chain
from typing import Any

import torch

from ucp.errors import InputError
from ucp.model.flavours import Flavour
from ucp.model.hyper import hyper_from_group
from ucp.model.names import has_wrapper, wrapper_renames
from ucp.model.pieces import Pieces
from ucp.model.records import Facts, Reader
from ucp.transforms import RenameTable, TransformedReader, plan_transforms

__all__ = [
    "as_live_names",
    "match_groups",
    "check_names",
    "check_shapes",
    "check_buffers",
    "check_engine",
    "place_steps_on_device",
    "restore_common",
    "dp_rank_and_size",
    "live_groups",
    "loss_scaler_wrapper",
    "keep_wide_state",
]

logger = logging.getLogger(__name__)


def as_live_names(reader: Reader, module: torch.nn.Module) -> Reader:
    """``reader`` under the names ``module`` has, where they differ only by torch.compile's ``_orig_mod.``
    wrapper (a run compiled before deepspeed.initialize restored into one that is not, or the other way);
    otherwise ``reader`` itself, for the usual name checks."""
    facts = reader.facts
    saved = [m.name for m in facts.params] + list(facts.tied) + list(facts.buffer_names)
    live = [n for n, _ in module.named_parameters(remove_duplicate=False)] + [n for n, _ in module.named_buffers()]
    table = wrapper_renames(saved, live)
    if not table:
        return reader
    logger.warning(
        "the checkpoint's names %s torch.compile's _orig_mod. wrapper and the model's %s: matched without it",
        "carry" if has_wrapper(table) else "lack",
        "do not" if has_wrapper(table) else "do",
    )
    return TransformedReader(reader, plan_transforms(facts, [RenameTable(table)]))


def match_groups(reader: Reader, live_members: list[list[str]], *, strict: bool) -> list[int | None]:
    """For each live param group, the checkpoint group holding its members (matched by names)."""
    owner = {name: g.index for g in reader.facts.groups for name in g.params}
    matched: list[int | None] = []
    for i, names in enumerate(live_members):
        found: set[int] = {owner[n] for n in names if n in owner}
        missing = [n for n in names if n not in owner]
        if missing and strict:
            raise InputError(
                f"param group {i} of the engine holds {missing[0]!r}, which the checkpoint does not "
                "optimize; start DeepSpeed with the checkpoint's parameters or pass strict=False"
            )
        if len(found) > 1:
            raise InputError(
                f"param group {i} of the engine mixes members of checkpoint groups {sorted(found)}; "
                "DeepSpeed must be started with the same param groups as the checkpoint"
            )
        matched.append(found.pop() if found else None)
    return matched


def check_names(engine: Any, reader: Reader, *, strict: bool) -> None:
    facts = reader.facts
    ours = {m.name for m in facts.params}
    theirs = set(engine.param_names.values()) - set(facts.tied)
    if strict and ours != theirs:
        extra = sorted(theirs - ours)
        lost = sorted(ours - theirs)
        what = (
            f"the engine has {extra[0]!r}, which the checkpoint lacks"
            if extra
            else f"the checkpoint has {lost[0]!r}, which the engine lacks"
        )
        raise InputError(
            f"parameters differ: {what} ({len(extra)} extra, {len(lost)} missing); pass strict=False "
            "to restore the common ones"
        )


def _shape(shape: tuple[int, ...]) -> str:
    return f"({', '.join(map(str, shape))})" if len(shape) != 1 else f"({shape[0]},)"


def check_shapes(live: Mapping[str, tuple[int, ...]], facts: Facts) -> None:
    """Every parameter both hold has the same shape in the checkpoint and the model (``live``: name -> shape);
    refused in one line naming the first that differs and both shapes, before anything is changed."""
    known = {m.name: m.shape for m in facts.params}
    wrong = [
        (name, known[name], tuple(shape))
        for name, shape in live.items()
        if name in known and known[name] != tuple(shape)
    ]
    if wrong:
        name, saved, have = wrong[0]
        more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
        raise InputError(
            f"{name} has shape {_shape(saved)} in the checkpoint but {_shape(have)} in the model{more}: the checkpoint "
            "is of another model or configuration; nothing was restored"
        )


def check_buffers(
    live: Mapping[str, tuple[int, ...]], reader: Reader, buffers: Mapping[str, torch.Tensor], *, strict: bool
) -> None:
    """The model's buffers against the checkpoint's (``live``: name -> shape): each one both hold has one shape,
    and with ``strict`` each one the checkpoint records is there."""
    for name, shape in live.items():
        if name in buffers and tuple(buffers[name].shape) != tuple(shape):
            raise InputError(
                f"buffer {name} has shape {_shape(tuple(buffers[name].shape))} in the checkpoint but {_shape(tuple(shape))} "
                "in the model; nothing was restored"
            )
        if strict and name not in buffers and name in reader.facts.buffer_names:
            raise InputError(f"buffer {name!r} is missing from the checkpoint")


def check_engine(engine: Any, reader: Reader, *, strict: bool) -> None:
    """What a live restore checks before any stage's code changes the engine: every parameter's and buffer's
    shape (a ZeRO-3 parameter's is its ``ds_shape``; the engine holds only a partition), and with ``strict``
    that no buffer the checkpoint records is missing."""
    shapes = {
        name: tuple(param.ds_shape if hasattr(param, "ds_shape") else param.shape)
        for param, name in engine.param_names.items()
    }
    check_shapes(shapes, reader.facts)
    live = {name: tuple(buf.shape) for name, buf in engine.module.named_buffers()}
    check_buffers(live, reader, reader.buffers(), strict=strict)


def place_steps_on_device(block: dict[str, Any], groups: list[dict[str, Any]], device: torch.device) -> None:
    """torch Adam keeps a capturable/fused step on the parameter's device."""
    if not any(g.get("capturable") or g.get("fused") for g in groups):
        return
    for state in block["optimizer_state_dict"]["state"].values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].to(device)


def restore_common(engine: Any, reader: Reader, *, strict: bool) -> None:
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


def dp_rank_and_size(process_group: Any) -> tuple[int, int]:
    """This rank and the size of the engine's data-parallel group."""
    import deepspeed.comm as dist

    return dist.get_rank(group=process_group), dist.get_world_size(group=process_group)


def live_groups(
    reader: Reader, live: list[dict[str, Any]], matched: list[int | None], flavour: Flavour, steps: list[int]
) -> list[dict[str, Any]]:
    """The new run's param groups with the checkpoint's settings and steps: a live group the
    checkpoint lacks (``matched`` None) keeps its own settings. ``params`` is left to the stage."""
    groups = []
    for g, group in enumerate(live):
        source = matched[g]
        hyper = reader.facts.groups[source].hyper if source is not None else hyper_from_group(group, None)
        raw = reader.facts.groups[source].raw if source is not None else {}
        groups.append(flavour.update_group(group, hyper, steps[g], raw))
    return groups


#: an engine's parameter dtype as ucp names it
_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def loss_scaler_wrapper(opt: Any, reader: Reader, stage: int) -> dict[str, Any]:
    """The ZeRO wrapper fields of the optimizer block, with the checkpoint's loss scaler state moved
    into the engine's own scaler object (it keeps its class, the checkpoint gives its numbers), when the
    checkpoint ran in the engine's dtype: an engine of another dtype keeps the scaler its config made (a bf16
    run's static 1 would switch an fp16 engine's scaling off, an fp16 run's scale would scale a bf16 engine)."""
    scaler = getattr(opt, "loss_scaler", None)
    saved = reader.extras().get("loss_scaler")
    dtype = getattr(opt, "dtype", None)
    same_dtype = isinstance(dtype, torch.dtype) and _DTYPE_NAMES.get(dtype) == reader.facts.info.dtype
    if scaler is not None and saved is not None and hasattr(saved, "__dict__") and same_dtype:
        scaler.__dict__.update(saved.__dict__)
    return {
        "zero_stage": stage,
        "loss_scaler": scaler,
        "dynamic_loss_scale": getattr(opt, "dynamic_loss_scale", False),
        "overflow": False,
    }


def keep_wide_state(base: Any, saved: Mapping[str, Any], tensors: Sequence[torch.Tensor]) -> None:
    """Give back, after ``base.load_state_dict(saved)``, the exact state an optimizer keeps wider than its tensors
    (``tensors``: the flat tensors it steps, in the order of ``saved``'s param groups' members).

    torch's ``Optimizer.load_state_dict`` casts every floating state tensor to its parameter's dtype. With bf16
    masters (DeepSpeed's ``bf16_master_weights_and_grads``) DeepSpeed's CPU Adam and Adagrad keep fp32 moments
    (``fp32_optimizer_states``, their default): the cast cuts them to bf16 and the optimizer steps on those from
    then on. DeepSpeed 0.19.8's own resume does exactly that; a restore through ucp keeps them fp32.
    """
    if not getattr(base, "fp32_optimizer_states", False):
        return
    saved_ids = chain.from_iterable(g["params"] for g in saved["param_groups"])
    for index, param in zip(saved_ids, tensors):
        entry, live = saved["state"].get(index, {}), base.state.get(param, {})
        for key, value in entry.items():
            if key == "step" or not torch.is_tensor(value) or not value.is_floating_point() or key not in live:
                continue
            if live[key].dtype != torch.float32:
                live[key] = value.to(device=live[key].device, dtype=torch.float32, copy=True)


def copy_pieces(pieces: Pieces, target: torch.Tensor) -> None:
    """``pieces`` into the contiguous 1-D ``target``: read straight into place when it is in host memory, through
    host memory into an accelerator's (a frozen parameter of a live engine on a GPU)."""
    if target.device.type == "cpu":
        pieces.copy_to(target)
    else:
        target.copy_(pieces.join(target.dtype))
