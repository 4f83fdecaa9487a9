"""The checks a ZeRO-1/2 save's rank files pass before any parameter is placed: which wrapper wrote them at
which stage, every rank there, one run, and the same param groups on every rank (``ucp.sources.zero12``)."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import torch

from ucp.deepspeed.fields import as_int, need_list, need_mapping
from ucp.deepspeed.optim_states import check_rank_count
from ucp.errors import InputError
from ucp.io.torchfile import TorchFile

__all__ = [
    "BASE_STATE",
    "FP32_PARTITIONS",
    "Base",
    "base_state",
    "check_param_groups",
    "check_ranks",
    "has_moments",
    "mapped_shapes",
    "zero12_stage",
]

logger = logging.getLogger(__name__)

FP32_PARTITIONS = "single_partition_of_fp32_groups"
BASE_STATE = "base_optimizer_state"

#: one rank's torch optimizer state of its flat partitions: its param groups and per-group state
Base = tuple[list[Mapping[str, Any]], Mapping[Any, Any]]


def zero12_stage(
    optim: list[TorchFile], blocks: list[Mapping[str, Any]], head: Mapping[str, Any], model_name: str, tag_dir: Path
) -> tuple[int, str, bool]:
    """The ZeRO stage and which wrapper wrote the files: 'zero' (DeepSpeedZeroOptimizer) or 'bf16'; and whether
    a BF16_Optimizer wrote them without ZeRO (stage 0)."""
    kinds = set()
    stages = set()
    for tf, block in zip(optim, blocks):
        for key in (BASE_STATE, FP32_PARTITIONS):
            if key not in block:
                raise InputError(f"{tf.path.name} has no {key}: not a ZeRO-1/2 optim-states file")
        if block.get("zero_stage") is None:
            kinds.add("bf16")  # BF16_Optimizer writes no zero_stage
            continue
        kinds.add("zero")
        stage = as_int(block["zero_stage"], f"{tf.path.name}: zero_stage")
        if stage == 3:
            raise InputError(
                f"{tf.path.name} says zero_stage=3, but its folder holds a ZeRO-1/2 model file "
                f"({model_name}) and no per-rank model states; the checkpoint mixes stages"
            )
        if stage not in (1, 2):
            raise InputError(
                f"{tf.path.name}: zero_stage={stage} is not supported: ucp reads ZeRO stage 1, 2 and 3 checkpoints"
            )
        stages.add(stage)
    if len(kinds) > 1:
        raise InputError(
            f"{tag_dir} mixes files of DeepSpeedZeroOptimizer and BF16_Optimizer: ranks from different runs are mixed"
        )
    if len(stages) > 1:
        raise InputError(f"rank files disagree on zero_stage ({sorted(stages)}): ranks from different runs are mixed")
    kind = kinds.pop()
    if kind == "zero":
        return stages.pop(), kind, False
    zero = (head.get("ds_config") or {}).get("zero_optimization") or {}
    stage = as_int(zero.get("stage", 0), "ds_config zero_optimization.stage") if isinstance(zero, Mapping) else 0
    if stage not in (0, 1):
        raise InputError(
            f"{model_name}: ds_config says zero stage {stage}, but the optim files were "
            "written by BF16_Optimizer (stage 0 or 1)"
        )
    return 1, kind, stage == 0


def mapped_shapes(
    optim: list[TorchFile],
    blocks: list[Mapping[str, Any]],
    shapes_of: Callable[[Collection[str]], Mapping[str, tuple[int, ...]]],
    model_name: str,
) -> list[OrderedDict[str, torch.Size]]:
    """param_shapes rebuilt: each group's members in flat order (rank by rank, by slice start, as the ranks'
    ``param_slice_mappings`` place them; checked against the layout later) and their shapes from ``shapes_of``."""
    placed: list[dict[str, tuple[int, int]]] = []
    for rank, (tf, block) in enumerate(zip(optim, blocks)):
        mappings = block.get("param_slice_mappings")
        if mappings is None:
            raise InputError(
                f"{tf.path.name}: neither it nor {model_name} names the parameters (no param_slice_mappings, "
                "no param_shapes): not converted"
            )
        for g, mapping in enumerate(need_list(mappings, f"{tf.path.name}: param_slice_mappings")):
            placed += [{} for _ in range(g + 1 - len(placed))]
            for pname, address in need_mapping(mapping, f"{tf.path.name}: param_slice_mappings[{g}]").items():
                start = as_int(getattr(address, "start", None), f"{tf.path.name}: slice start of {pname!r}")
                placed[g].setdefault(str(pname), (rank, start))
    order = [sorted(group, key=group.__getitem__) for group in placed]
    shapes = shapes_of([n for names in order for n in names])
    for names in order:
        for pname in names:
            if pname not in shapes:
                raise InputError(
                    f"{model_name}: a stage-0 BF16_Optimizer save records no param_shapes, and no layer file "
                    f"holds {pname!r} (a TiedLayerSpec given a forward_fn gets none): its shape is unknown; not converted"
                )
    return [OrderedDict((n, torch.Size(shapes[n])) for n in names) for names in order]


def check_ranks(
    optim: list[TorchFile],
    blocks: list[Mapping[str, Any]],
    head: Mapping[str, Any],
    rank_file: Callable[[int], str],
    tag_dir: Path,
    only: Collection[int] | None,
    model_name: str,
) -> None:
    """Every rank's optim file is there (of the param groups ``only``, where given), as many as the model
    states' dp_world_size."""
    dp = len(optim)
    names = [t.path.name for t in optim]  # once: a save of 4096 ranks checks each against all
    for tf, block in zip(optim, blocks):
        check_rank_count(block, tf.path.name, names, rank_file, tag_dir, only)
    world = head.get("dp_world_size")
    if world is not None and as_int(world, "dp_world_size") != dp:
        raise InputError(
            f"{model_name} says dp_world_size={as_int(world, 'dp_world_size')}, but {dp} "
            "optim rank files were found: files from different runs are mixed"
        )


def base_state(tf: TorchFile, block: Mapping[str, Any]) -> Base:
    """The torch optimizer state of the flat partitions: its param groups and per-group state."""
    name = tf.path.name
    base = block[BASE_STATE]
    if isinstance(base, (list, tuple)):
        raise InputError(
            f"{name} was saved with zero_optimization.elastic_checkpoint=true, which keeps no param "
            "groups; ucp reads the default (rigid) ZeRO-1/2 checkpoints"
        )
    base = need_mapping(base, f"{name}: {BASE_STATE}")
    groups = [
        need_mapping(g, f"{name}: a param group")
        for g in need_list(base.get("param_groups") or [], f"{name}: param_groups")
    ]
    for g, group in enumerate(groups):
        members = [
            as_int(p, f"{name}: param group {g} params entry")
            for p in need_list(group.get("params", []), f"{name}: param group {g} params")
        ]
        if members != [g]:
            raise InputError(
                f"{name}: param group {g} holds flat tensors {members}, expected [{g}]: not a "
                "ZeRO-1/2 optimizer (one flat partition per group)"
            )
    state = need_mapping(base.get("state") or {}, f"{name}: optimizer state")
    return groups, state


def check_param_groups(
    optim: list[TorchFile], blocks: list[Mapping[str, Any]], bases: list[Base], shapes: list[Mapping[str, Any]]
) -> None:
    """Every rank has one param group per param_shapes entry, and the same alignment paddings."""
    groups_raw = bases[0][0]
    if len(groups_raw) != len(shapes):
        raise InputError(f"{optim[0].path.name} has {len(groups_raw)} param groups, but param_shapes has {len(shapes)}")
    for tf, (rank_groups, _) in zip(optim[1:], bases[1:]):
        if len(rank_groups) != len(groups_raw):
            raise InputError(
                f"{tf.path.name} and {optim[0].path.name} have different numbers of param "
                "groups: ranks from different runs are mixed"
            )
    for pad_list in (b.get("param_alignment_paddings") for b in blocks[1:]):
        if pad_list != blocks[0].get("param_alignment_paddings"):
            raise InputError("rank files disagree on param_alignment_paddings: ranks from different runs are mixed")


def has_moments(optim: list[TorchFile], bases: list[Base]) -> bool:
    """Every rank holds optimizer state, or none does: whether they do."""
    head_state = bases[0][1]
    moments = bool(head_state)
    for tf, (_, rank_state) in zip(optim, bases):
        if bool(rank_state) != moments:
            raise InputError(
                f"{tf.path.name} {'has' if rank_state else 'lacks'} optimizer moments but "
                f"{optim[0].path.name} {'has' if head_state else 'lacks'} them: ranks from different "
                "saves are mixed"
            )
    return moments
