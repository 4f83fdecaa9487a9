"""DeepSpeed's optim-states files: the ZeRO block, its stage and partition count, and each flat
tensor's optimizer state (keys, scalars, step), checked, once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import torch

from ucp.deepspeed.fields import as_int, need_list, need_mapping, need_tensor, tensor_shape
from ucp.deepspeed.layout import UNIVERSAL_OPTIM
from ucp.errors import InputError
from ucp.io.standins import DynamicLossScaler, LossScaler
from ucp.io.torchfile import TorchFile
from ucp.model.partition import Zero12Group, zero3_partition_size, zero12_group

__all__ = [
    "rank_scalars",
    "check_scaler_fields",
    "zero12_layouts",
    "check_slice_mappings",
    "read_universal_optimizer_state",
    "check_zero3_membership",
    "STEP_KEY",
    "SUPPORTED_STAGES",
    "UNFUSED_INNER",
    "UNFUSED_MASTERS",
    "FUSED_MASTERS",
    "check_rank_count",
    "flat_state_keys",
    "flat_state_scalars",
    "missing_ranks",
    "optimizer_block",
    "partition_count",
    "same_scalars",
    "show_scalars",
    "stage_of",
]


#: Where torch optimizers (and DeepSpeed's) keep a per-tensor step; every other key is state.
STEP_KEY = "step"


#: FP16_UnfusedOptimizer.state_dict()'s keys (0.19.8; DeepSpeed's wrapper without ZeRO in bf16/fp16): the inner
#: torch optimizer's state_dict, and the fp32 masters of the trainable parameters per param group
UNFUSED_INNER = "optimizer_state_dict"
UNFUSED_MASTERS = "fp32_groups"
#: FP16_Optimizer.state_dict()'s key (0.19.8, the fused wrapper: DeepSpeed or Apex FusedAdam without ZeRO in
#: bf16/fp16): one flat fp32 master per param group; the inner state_dict is under UNFUSED_INNER too
FUSED_MASTERS = "fp32_groups_flat"


#: ZeRO stages whose checkpoints ucp reads.
SUPPORTED_STAGES = (1, 2, 3)


def optimizer_block(tf: TorchFile) -> Mapping[str, Any]:
    """The ZeRO optimizer's dict inside an optim-states file."""
    obj = tf.obj
    block = obj.get("optimizer_state_dict") if isinstance(obj, Mapping) else None
    if not isinstance(block, Mapping):
        raise InputError(f"{tf.path.name} has no optimizer_state_dict: not a ZeRO optim-states file")
    return block


def stage_of(block: Mapping[str, Any]) -> int:
    stage = block.get("zero_stage")
    if stage is None:
        raise InputError("optim-states file does not say its zero_stage")
    stage = as_int(stage, "zero_stage")
    if stage not in SUPPORTED_STAGES:
        raise InputError(f"zero_stage={stage} is not supported: ucp reads ZeRO stage 1, 2 and 3 checkpoints")
    return stage


def partition_count(block: Mapping[str, Any], groups: Collection[int] | None = None) -> int:
    """DeepSpeed writes an int (ZeRO-3) or one count per param group (ZeRO-1/2); ``groups`` limits a list
    to those groups (a MoE run partitions its expert groups over fewer ranks than the others)."""
    count = block.get("partition_count")
    if isinstance(count, (list, tuple)):
        counts = [as_int(c, "partition_count") for g, c in enumerate(count) if groups is None or g in groups]
        if len(set(counts)) != 1:
            raise InputError(f"param groups were partitioned differently: partition_count={counts}")
        count = counts[0]
    if count is None:
        raise InputError("optim-states file does not say its partition_count")
    count = as_int(count, "partition_count")
    if count < 1:
        raise InputError(f"partition_count={count} is not a positive number of ranks")
    return count


def check_rank_count(
    block: Mapping[str, Any],
    file: str,
    found: list[str],
    rank_file: Callable[[int], str],
    where: object,
    groups: Collection[int] | None = None,
) -> None:
    """A rank file's partition_count (of ``groups``, default all) must match the rank files found in
    ``where``: missing ones are named (a bounded list), extra ones too."""
    try:
        count = partition_count(block, groups)
    except InputError as err:
        raise InputError(f"{file}: {err}") from None
    dp = len(found)
    have = f"{dp} rank file{'s were' if dp > 1 else ' was'} found"
    if count > dp:
        raise InputError(
            f"{missing_ranks(rank_file, dp, count)} missing from {where}: {file} says partition_count={count}, but {have}"
        )
    if count < dp:
        extra = found[count:]
        what = f"{', '.join(extra)} are extra rank files" if len(extra) > 1 else f"{extra[0]} is an extra rank file"
        raise InputError(
            f"{what} in {where}: {file} says partition_count={count}, but {have}; remove the extra files or check "
            "they belong to this run"
        )


def missing_ranks(rank_file: Callable[[int], str], found: int, count: int) -> str:
    """'rank file X is' / 'rank files X, Y, Z and N more are': a bounded list, whatever count claims."""
    names = [rank_file(r) for r in range(found, min(count, found + 3))]
    if count - found > len(names):
        names.append(f"and {count - found - len(names)} more")
    return f"rank files {', '.join(names)} are" if len(names) > 1 else f"rank file {names[0]} is"


def _is_scalar(value: Any) -> bool:
    return torch.is_tensor(value) and value.dim() == 0 and value.is_floating_point()


def flat_state_scalars(entry: Mapping[str, Any], derived: Collection[str] = ()) -> dict[str, torch.Tensor]:
    """The 0-dim floating entries of a flat tensor's optimizer state besides the step (NAdam's
    ``mu_product``): one value for every parameter the flat tensor holds. ``derived``: scalars the optimizer
    recomputes before reading them (a statistic of the tensor it steps), left out."""
    return {k: v for k, v in entry.items() if k != STEP_KEY and k not in derived and _is_scalar(v)}


def same_scalars(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    """Bit-equal scalars (NaN-safe): what ranks stepped together must hold."""
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def show_scalars(scalars: Mapping[str, torch.Tensor]) -> str:
    return "{" + ", ".join(f"{k}: {v.item()!r}" for k, v in scalars.items()) + "}"


def flat_state_keys(
    entry: Mapping[str, Any],
    size: int,
    where: str,
    expected: tuple[str, ...] | None = None,
    sizes: Mapping[str, int] | None = None,
) -> tuple[str, ...]:
    """The state keys of one flat tensor's optimizer entry, in its order: every key but the step and
    the 0-dim scalars (:func:`flat_state_scalars`) must be a flat floating tensor of the partition's
    ``size`` (elementwise state, which ucp can cut anew), or the checkpoint is refused; nothing is
    ever dropped. ``expected``: what rank 0 holds; ``sizes``: keys held in another layout, and their size."""
    keys = tuple(k for k in entry if k != STEP_KEY and not _is_scalar(entry[k]))
    for key in keys:
        value = entry[key]
        want = (sizes or {}).get(key, size)
        if not torch.is_tensor(value) or not value.is_floating_point() or value.dim() != 1 or value.numel() != want:
            kind = (
                f"a {str(value.dtype).replace('torch.', '')} tensor of shape {tuple(value.shape)}"
                if torch.is_tensor(value)
                else f"a {type(value).__name__}"
            )
            raise InputError(
                f"{where}: optimizer state {key!r} is {kind}, not a flat tensor of the "
                f"{'whole parameters' if key in (sizes or {}) else 'partition'}' {want} elements: ucp cannot "
                "reshard it elementwise, so it refuses the checkpoint rather than drop it"
            )
    if expected is not None and keys != expected:
        raise InputError(
            f"{where} holds optimizer state {list(keys)}, rank 0 holds {list(expected)}: ranks from "
            "different runs are mixed"
        )
    return keys


def read_universal_optimizer_state(root: Path) -> dict[str, Any]:
    """The small fields of a ds_to_universal folder's zero/optimizer_state.pt: stage, partition count, param
    groups, loss scaler, and for ZeRO-3 the per-sub-group steps and rank 0's flat sizes (its shards stay
    unread on the mmap)."""
    path = root / UNIVERSAL_OPTIM
    if not path.is_file():
        raise InputError(
            f"{UNIVERSAL_OPTIM} is missing from {root}: ds_to_universal writes it after merging the "
            "parameters, so the run did not finish; rerun ds_to_universal"
        )
    with TorchFile(path) as tf:
        obj = need_mapping(tf.obj, f"{UNIVERSAL_OPTIM}")
        stage = obj.get("zero_stage")
        # BF16_Optimizer writes no zero_stage; ds_to_universal then takes stage 1, as here
        stage = 1 if stage is None else as_int(stage, f"{UNIVERSAL_OPTIM}: zero_stage")
        if stage not in (1, 2, 3):
            raise InputError(f"{UNIVERSAL_OPTIM} says zero_stage={stage}; ucp reads ZeRO stage 1, 2 and 3 checkpoints")
        out: dict[str, Any] = {"zero_stage": stage, "partition_count": partition_count(obj)}
        out["param_groups"] = [
            dict(need_mapping(g, f"{UNIVERSAL_OPTIM}: a param group"))
            for g in need_list(obj.get("param_groups"), f"{UNIVERSAL_OPTIM}: param_groups")
        ]
        for key in ("loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad", "ds_version"):
            out[key] = obj.get(key)
        check_scaler_fields(out, UNIVERSAL_OPTIM)
        if stage == 3:
            inner = need_mapping(obj.get("optimizer_state_dict"), f"{UNIVERSAL_OPTIM}: optimizer_state_dict")
            state = need_mapping(inner.get("state") or {}, f"{UNIVERSAL_OPTIM}: optimizer state")
            # only the steps: rank 0's moment shards stay unread on the mmap
            out["state"] = {
                sub: {
                    k: (v.clone() if torch.is_tensor(v) else v)
                    for k, v in need_mapping(entry, f"{UNIVERSAL_OPTIM}: state of sub-group {sub}").items()
                    if k == "step"
                }
                for sub, entry in state.items()
            }
            flat = obj.get("fp32_flat_groups")
            out["flat_numels"] = (
                None
                if flat is None
                else [
                    need_tensor(t, f"{UNIVERSAL_OPTIM}: fp32_flat_groups[{i}]").numel()
                    for i, t in enumerate(need_list(flat, f"{UNIVERSAL_OPTIM}: fp32_flat_groups"))
                ]
            )
        return out


def check_zero3_membership(
    layout: list[list[int]], shapes: list[Mapping[str, Any]], numels: list[int] | None, dp: int
) -> dict[int, int]:
    """ds_to_universal's ZeRO-3 param groups own each param_shapes sub-group exactly once, and rank 0's
    flat sizes (``numels``, when present) are what those parameters' partitions add up to at ``dp``.
    Returns each sub-group's param group."""
    sub_of_group: dict[int, int] = {}
    for g, subs in enumerate(layout):
        for sub in subs:
            if not 0 <= sub < len(shapes):
                raise InputError(
                    f"{UNIVERSAL_OPTIM}: param group {g} names sub-group {sub}, but param_shapes has {len(shapes)}"
                )
            if sub in sub_of_group:
                raise InputError(
                    f"{UNIVERSAL_OPTIM}: sub-group {sub} belongs to param groups {sub_of_group[sub]} and {g}"
                )
            sub_of_group[sub] = g
    for sub in range(len(shapes)):
        if sub not in sub_of_group:
            raise InputError(f"sub-group {sub} of param_shapes belongs to no param group in {UNIVERSAL_OPTIM}")
    if numels is not None:
        # rank 0's own shards ride along: their sizes tell whether param_shapes fit this dp
        if len(numels) != len(shapes):
            raise InputError(
                f"{UNIVERSAL_OPTIM} holds fp32_flat_groups for {len(numels)} sub-groups, but "
                f"param_shapes has {len(shapes)}: files of different checkpoints are mixed"
            )
        for sub, members in enumerate(shapes):
            want = sum(zero3_partition_size(math.prod(tensor_shape(s)), dp) for s in members.values())
            if numels[sub] != want:
                raise InputError(
                    f"sub-group {sub} holds {numels[sub]} elements on rank 0, but its parameters' "
                    f"partitions add up to {want} at dp={dp}: files of different checkpoints are mixed"
                )
    return sub_of_group


def zero12_layouts(shapes: list[Mapping[str, Any]], paddings: Any, dp: int, file_name: str) -> list[Zero12Group]:
    """Each ZeRO-1/2 param group's flat layout at ``dp`` from its members' shapes (``param_shapes``) and,
    where the file records them, their alignment paddings (``param_alignment_paddings``)."""
    layouts = []
    for g, members in enumerate(shapes):
        numels = [math.prod(tensor_shape(shape)) for shape in members.values()]
        pads = None
        if paddings is not None:
            where = f"{file_name}: param_alignment_paddings"
            pads = [as_int(p, where) for p in need_list(need_list(paddings, where)[g], f"{where}[{g}]")]
            if len(pads) != len(numels):
                raise InputError(
                    f"{where}[{g}] has {len(pads)} entries, but param group {g} has {len(numels)} parameters"
                )
        layouts.append(zero12_group(numels, dp, param_paddings=pads))
    return layouts


def check_slice_mappings(
    mapping: Any,
    names: list[str],
    layout: Zero12Group,
    rank: int,
    where: str,
    round_robin: tuple[list[str], Zero12Group] | None = None,
) -> None:
    """A rank's ``param_slice_mappings`` for one group must be the slices ucp's layout gives (params in
    param_shapes order, aligned to 2 x dp); anything else is a layout this ucp does not know.

    ``round_robin``: the group's members in their original order and the layout they would have in it.
    DeepSpeed 0.19.8 maps a ``round_robin_gradients`` group's fragments walking its members in that order,
    though the flat buffer holds them in round-robin order (param_shapes' order): its mappings name other
    parameters' bytes. Either mapping is accepted (ucp writes the true one); the flat buffer is read by
    param_shapes' order, which the module's weights prove.
    """
    mapping = need_mapping(mapping, f"{where}: param_slice_mappings")
    found = {
        k: (
            as_int(getattr(v, "start", None), f"{where}: slice start"),
            as_int(getattr(v, "numel", None), f"{where}: slice numel"),
        )
        for k, v in mapping.items()
    }
    accepted = [(names, layout)] + ([round_robin] if round_robin is not None else [])
    if not any(found == _slices(members, members_layout, rank) for members, members_layout in accepted):
        raise InputError(
            f"{where}: param_slice_mappings do not match the flat layout ucp expects (params in "
            "param_shapes order, aligned to 2 x dp): a layout this ucp does not know"
        )


def _slices(names: list[str], layout: Zero12Group, rank: int) -> dict[str, tuple[int, int]]:
    """name -> (start, numel) of each member's slice on ``rank``, as param_slice_mappings hold them."""
    out = {}
    for i, pname in enumerate(names):
        span = layout.rank_slice(i, rank)
        if span is not None:
            out[pname] = span
    return out


def rank_scalars(
    entry: Mapping[str, Any], rank0: Mapping[str, torch.Tensor] | None, where: str, derived: Collection[str] = ()
) -> dict[str, torch.Tensor]:
    """A flat tensor's 0-dim optimizer scalars (:func:`flat_state_scalars`), which every rank stepped
    together and so must hold bit-equal to rank 0's (``rank0``; None on rank 0 itself)."""
    scalars = flat_state_scalars(entry, derived)
    if rank0 is not None and not same_scalars(scalars, rank0):
        raise InputError(
            f"{where} holds optimizer scalars {show_scalars(scalars)}, rank 0 holds {show_scalars(rank0)}: "
            "ranks from different saves are mixed"
        )
    return scalars


def check_scaler_fields(block: Mapping[str, Any], where: str) -> None:
    """The loss-scaler fields of a ZeRO block: a DeepSpeed scaler (or none) and booleans."""
    scaler = block.get("loss_scaler")
    if scaler is not None and not isinstance(scaler, (LossScaler, DynamicLossScaler)):
        raise InputError(
            f"{where}: loss_scaler is a {type(scaler).__name__}, not a DeepSpeed loss scaler: the file is "
            "damaged or not from DeepSpeed"
        )
    for key in ("dynamic_loss_scale", "overflow"):
        if block.get(key) is not None and not isinstance(block[key], bool):
            raise InputError(
                f"{where}: {key} is a {type(block[key]).__name__}, not a bool: the file is damaged or not from DeepSpeed"
            )
