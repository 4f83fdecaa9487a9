"""A ZeRO-3 save's sub-groups: where each optimized parameter sits in its sub-group's flat buffers, and the
optimizer state each sub-group keeps on every rank (``ucp.sources.zero3``)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ucp.deepspeed.fields import need_mapping, tensor_shape
from ucp.deepspeed.optim_states import flat_state_keys, rank_scalars
from ucp.errors import InputError
from ucp.io.torchfile import TorchFile
from ucp.model.detect import partial_offload_ratio
from ucp.model.partition import zero3_partition_size
from ucp.sources.zero3_rank_files import Inner

__all__ = ["SubGroupState", "Where", "place", "sub_group_state"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)  # one per parameter: 10^5 for a MoE
class Where:
    """Where an optimized parameter sits: its sub-group, and its partition's offset and size in each rank's
    flat buffer of that sub-group."""

    sub_group: int
    offset: int
    size: int
    numel: int
    shape: tuple[int, ...]


def place(
    layout: list[list[int]],
    shapes: list[Mapping[str, Any]],
    flat: list[list[torch.Tensor]],
    reads: Callable[[int], bool],
) -> tuple[dict[str, Where], dict[int, int]]:
    """Where every optimized parameter of a param group read (``reads``) sits, and each sub-group's param group."""
    where: dict[str, Where] = {}
    sub_of_group: dict[int, int] = {}
    for g, subs in enumerate(layout):
        for sub in subs:
            if not 0 <= sub < len(shapes):
                raise InputError(f"param group {g} names sub-group {sub}, but param_shapes has {len(shapes)}")
            if sub in sub_of_group:
                raise InputError(f"sub-group {sub} belongs to param groups {sub_of_group[sub]} and {g}")
            sub_of_group[sub] = g
    for sub, members in enumerate(shapes):
        if sub in sub_of_group and not reads(sub_of_group[sub]):
            continue  # partitioned over other ranks: another reader places it
        offset = 0
        for name, raw_shape in members.items():
            shape = tensor_shape(raw_shape)
            numel = 1
            for d in shape:
                numel *= d
            size = zero3_partition_size(numel, len(flat))
            if name in where:
                raise InputError(f"parameter {name!r} appears twice in param_shapes")
            where[name] = Where(sub, offset, size, numel, shape)
            offset += size
        for rank, rank_flat in enumerate(flat):
            have = rank_flat[sub].numel()
            if have != offset:
                raise InputError(
                    f"sub-group {sub} on rank {rank} holds {have} elements, but its parameters' "
                    f"partitions add up to {offset} at dp={len(flat)}: the shapes do not match the shards"
                )
        if sub not in sub_of_group:
            raise InputError(f"sub-group {sub} belongs to no param group in the optimizer state")
    return where, sub_of_group


def _why_missing(ds_config: Mapping[str, Any]) -> str:
    """Why a sub-group's optimizer state can be missing from a whole save: ZeRO-Offload++."""
    ratio = partial_offload_ratio(ds_config)
    if ratio is None:
        return ""
    return (
        f": saved with offload_optimizer.ratio={ratio:g} (ZeRO-Offload++), DeepSpeed 0.19.8 steps the first "
        "sub-groups of each rank on the GPU with a second optimizer and saves only its CPU optimizer's "
        "moments, so these files do not hold them; save with ratio 1 to move the run"
    )


@dataclass
class SubGroupState:
    """Whether the save holds optimizer moments, and per sub-group its state keys and 0-dim scalars."""

    has_moments: bool
    keys: dict[int, tuple[str, ...]]
    scalars: dict[int, dict[str, torch.Tensor]]


def sub_group_state(
    optim: list[TorchFile],
    inners: list[Inner],
    flat: list[list[torch.Tensor]],
    subs: list[int],
    ds_config: Mapping[str, Any],
    derived: Collection[str],
) -> SubGroupState:
    """Optimizer state: every sub-group read on every rank, the same keys everywhere, or none at all."""
    head_state = inners[0][1]
    out = SubGroupState(
        has_moments=bool(head_state),
        keys={sub: () for sub in range(len(flat[0]))},
        scalars={sub: {} for sub in range(len(flat[0]))},
    )
    for rank, (tf, (_, rank_state)) in enumerate(zip(optim, inners)):
        if bool(rank_state) != out.has_moments:
            raise InputError(
                f"{tf.path.name} {'has' if rank_state else 'lacks'} optimizer moments but "
                f"{optim[0].path.name} {'has' if head_state else 'lacks'} them: ranks from different "
                "saves are mixed"
            )
        if not out.has_moments:
            continue
        for sub in subs:
            entry = rank_state.get(sub)
            if entry is None:
                raise InputError(f"{tf.path.name} has no optimizer state for sub-group {sub}{_why_missing(ds_config)}")
            entry = need_mapping(entry, f"{tf.path.name}: optimizer state of sub-group {sub}")
            out.keys[sub] = flat_state_keys(
                entry,
                flat[rank][sub].numel(),
                f"{tf.path.name}: sub-group {sub}",
                out.keys[sub] if rank else None,
            )
            where = f"{tf.path.name}: sub-group {sub}"
            out.scalars[sub] = rank_scalars(entry, out.scalars[sub] if rank else None, where, derived)
    return out
