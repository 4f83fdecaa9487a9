"""The checks a ZeRO-3 save's rank files pass before any parameter is placed: one stage and every rank
there, one save, and the same sub-group layout and flat buffers on every rank (``ucp.sources.zero3``)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ucp.deepspeed.autoep import PARTITION_GROUPS, partition_of
from ucp.deepspeed.fields import as_int, check_one_version, need_list, need_mapping, need_tensor, tensor_shape
from ucp.deepspeed.model_states import check_model_states, engine_counters
from ucp.deepspeed.optim_states import check_rank_count, check_scaler_fields, stage_of
from ucp.errors import InputError
from ucp.io.torchfile import TorchFile

__all__ = [
    "Inner",
    "check_model_rank",
    "check_models",
    "check_partitions",
    "check_scalers",
    "check_stage_and_ranks",
    "flat_groups",
    "inner_state",
    "sub_group_layout",
]

logger = logging.getLogger(__name__)

#: one rank's torch optimizer state inside its ZeRO block: its param groups and per-sub-group state
Inner = tuple[list[Mapping[str, Any]], Mapping[Any, Any]]


def check_stage_and_ranks(
    optim: list[TorchFile],
    blocks: list[Mapping[str, Any]],
    rank_file: Callable[[int], str],
    tag_dir: Path,
    *,
    limited: bool,
) -> None:
    """Every optim file says stage 3, and the rank count adds up (``limited``: some param groups only, where
    a save recording its partition groups is checked by :func:`check_partitions` instead)."""
    names = [t.path.name for t in optim]  # once: a save of 4096 ranks checks each against all
    for tf, block in zip(optim, blocks):
        try:
            stage = stage_of(block)
        except InputError as err:
            raise InputError(f"{tf.path.name}: {err}") from None
        if stage != 3:
            raise InputError(
                f"{tf.path.name} says zero_stage={stage}, but its folder holds ZeRO-3 model files "
                "(per-rank zero_pp_rank_*_model_states.pt); the checkpoint mixes stages"
            )
        if not limited or PARTITION_GROUPS not in block:  # else checked by check_partitions
            check_rank_count(block, tf.path.name, names, rank_file, tag_dir)


def check_partitions(optim: list[TorchFile], blocks: list[Mapping[str, Any]], subs: list[int]) -> None:
    """Where the save records each sub-group's partition group (AutoEP), every sub-group read must be
    partitioned over exactly the files read, file i holding partition i."""
    for i, (tf, block) in enumerate(zip(optim, blocks)):
        for sub in subs:
            part = partition_of(block, sub, tf.path.name)
            if part is not None and (part.count, part.rank) != (len(optim), i):
                raise InputError(
                    f"{tf.path.name}: sub-group {sub} is partition {part.rank} of {part.count} (ranks "
                    f"{list(part.ranks)}), but it is read as {i} of {len(optim)} files: a rank file is "
                    "missing or extra, or the files are another group's (AutoEP experts: their expert-data-"
                    "parallel ranks)"
                )


#: what is read from the model-states file of a rank after the first, once it is checked against the first
RANK_MODEL_KEYS = ("frozen_param_fragments", "ds_config", "ds_version")


def check_model_rank(opened: list[TorchFile], tf: TorchFile) -> None:
    """Check one rank's model-states file as it is opened (``opened``: the ranks before it) and, after the
    first, keep only :data:`RANK_MODEL_KEYS` of its tree. Every rank repeats the module dict and
    ``param_shapes``: kept for every rank they would cost ranks x parameters objects (4096 x 10^5 for a MoE
    saved at DP 4096), so memory would follow the model instead of one rank's metadata. A file that repeats the
    pickle of the rank before byte for byte (``TorchFile.repeats``) passed these checks with it; opened with
    ``keep=RANK_MODEL_KEYS`` it holds just those."""
    if opened and tf.repeats:
        tf.obj = {key: tf.obj[key] for key in RANK_MODEL_KEYS if key in tf.obj}
        return
    obj = check_model_states(tf.obj, tf.path.name, "not a ZeRO-3 model-states file")
    if not opened:
        return
    head_tf = opened[0]
    head, first = head_tf.obj, head_tf.path.name
    counters, other = engine_counters(head), engine_counters(obj)
    for key in ("global_steps", "global_samples", "skipped_steps"):
        if other[key] != counters[key]:
            raise InputError(
                f"{tf.path.name} is at {key}={other[key]} but {first} is at {counters[key]}: "
                "rank files from different saves (tags) are mixed in one folder"
            )
    if obj["param_shapes"] != head["param_shapes"]:
        raise InputError("model-states files disagree on param_shapes: ranks from different runs are mixed")
    frozen = {k: tensor_shape(v) for k, v in (head.get("frozen_param_shapes") or {}).items()}
    theirs = {k: tensor_shape(v) for k, v in (obj.get("frozen_param_shapes") or {}).items()}
    if theirs != frozen:
        raise InputError(
            f"{tf.path.name} and {first} disagree on frozen_param_shapes: ranks from different runs are mixed"
        )
    tf.obj = {key: obj[key] for key in RANK_MODEL_KEYS if key in obj}


def check_models(model: list[TorchFile], optim: list[TorchFile]) -> list[Mapping[str, Any]]:
    """Each rank's model-states object (checked one by one as opened, :func:`check_model_rank`), and one
    DeepSpeed version across every file of the save."""
    models = [tf.obj for tf in model]
    check_one_version(models + [tf.obj for tf in optim if isinstance(tf.obj, Mapping)])
    return models


def check_scalers(optim: list[TorchFile], blocks: list[Mapping[str, Any]]) -> None:
    """Every rank's loss-scaler fields are well formed."""
    for tf, block in zip(optim, blocks):
        check_scaler_fields(block, tf.path.name)


def inner_state(tf: TorchFile, block: Mapping[str, Any]) -> Inner:
    """The torch optimizer state inside a ZeRO block: its param groups and per-sub-group state."""
    name = tf.path.name
    inner = need_mapping(block.get("optimizer_state_dict"), f"{name}: optimizer_state_dict.optimizer_state_dict")
    groups = [
        need_mapping(g, f"{name}: a param group")
        for g in need_list(inner.get("param_groups") or [], f"{name}: param_groups")
    ]
    for g, group in enumerate(groups):
        for sub in need_list(group.get("params", []), f"{name}: param group {g} params"):
            as_int(sub, f"{name}: param group {g} params entry")
    state = need_mapping(inner.get("state") or {}, f"{name}: optimizer state")
    return groups, state


def sub_group_layout(optim: list[TorchFile], inners: list[Inner]) -> list[list[int]]:
    """The sub-groups of each param group, the same on every rank."""
    layout = [[int(s) for s in g.get("params", [])] for g in inners[0][0]]
    for tf, (rank_groups, _) in zip(optim[1:], inners[1:]):
        if [[int(s) for s in g.get("params", [])] for g in rank_groups] != layout:
            raise InputError(
                f"{tf.path.name} and {optim[0].path.name} group their sub-groups differently: "
                "ranks from different runs are mixed"
            )
    return layout


def flat_groups(optim: list[TorchFile], blocks: list[Mapping[str, Any]], subs: int) -> list[list[torch.Tensor]]:
    """Each rank's flat fp32 buffer per sub-group, checked to be flat tensors."""
    flat = [need_list(b.get("fp32_flat_groups"), f"{tf.path.name}: fp32_flat_groups") for tf, b in zip(optim, blocks)]
    for tf, rank_flat in zip(optim, flat):
        if len(rank_flat) != subs:
            raise InputError(
                f"{tf.path.name} holds fp32_flat_groups for {len(rank_flat)} sub-groups, but param_shapes has {subs}"
            )
        for sub, tensor in enumerate(rank_flat):
            need_tensor(tensor, f"{tf.path.name}: fp32_flat_groups[{sub}]")
            if tensor.dim() != 1:
                raise InputError(
                    f"{tf.path.name}: fp32_flat_groups[{sub}] has shape {tuple(tensor.shape)}; expected a flat buffer"
                )
    return flat
