"""Each rank's flat partitions of a ZeRO-1/2 save: checked against its param groups' layouts at the save's DP
size, with the optimizer state keys, scalars and step every rank keeps per group, and a parameter's slices
read out of them (``ucp.sources.zero12``)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ucp.deepspeed.fields import as_int, need_list, need_mapping, need_tensor
from ucp.deepspeed.optim_states import check_slice_mappings, flat_state_keys, rank_scalars
from ucp.errors import InputError
from ucp.io.torchfile import TorchFile
from ucp.model.detect import Detection
from ucp.model.partition import Zero12Group
from ucp.model.pieces import Pieces
from ucp.sources.common import file_pieces
from ucp.sources.zero12_rank_files import BASE_STATE, FP32_PARTITIONS, Base

__all__ = ["GroupState", "check_group_sizes", "group_steps", "partition_pieces", "whole_pieces"]

logger = logging.getLogger(__name__)


@dataclass
class GroupState:
    """Per param group, the optimizer state keys and the 0-dim scalars every rank holds."""

    keys: list[tuple[str, ...]]
    scalars: list[dict[str, torch.Tensor]]


def check_group_sizes(
    optim: list[TorchFile],
    shapes: list[Mapping[str, Any]],
    blocks: list[Mapping[str, Any]],
    layouts: list[Zero12Group],
    states: list[Mapping[Any, Any]],
    *,
    reads: Callable[[int], bool],
    whole_keys: list[tuple[str, ...]],
    derived: Collection[str],
    original_layout: Callable[[int], tuple[list[str], Zero12Group] | None],
) -> GroupState:
    """Every rank's buffers must be exactly the sizes the parameters imply at this DP size (of the groups
    ``reads`` takes; ``whole_keys``: the state each group keeps whole per parameter)."""
    dp = len(optim)
    out = GroupState(keys=[() for _ in layouts], scalars=[{} for _ in layouts])
    for rank, (tf, block, state) in enumerate(zip(optim, blocks, states)):
        name = tf.path.name
        fp32 = need_list(block[FP32_PARTITIONS], f"{name}: {FP32_PARTITIONS}")
        group_paddings = need_list(block.get("group_paddings") or [], f"{name}: group_paddings")
        if len(fp32) != len(shapes) or len(group_paddings) != len(shapes):
            raise InputError(
                f"{name} holds {len(fp32)} fp32 partitions and {len(group_paddings)} group paddings, "
                f"but param_shapes has {len(shapes)} param groups"
            )
        mappings = block.get("param_slice_mappings")
        for g, layout in enumerate(layouts):
            if not reads(g):
                continue
            size, pad = layout.partition_size, layout.padding(rank)
            have_pad = as_int(group_paddings[g], f"{name}: group_paddings[{g}]")
            tensor = need_tensor(fp32[g], f"{name}: {FP32_PARTITIONS}[{g}]")
            if tensor.dim() != 1 or tensor.numel() not in (size - pad, size) or have_pad != pad:
                raise InputError(
                    f"param group {g} on rank {rank} holds {tensor.numel()} fp32 elements with padding {have_pad}, "
                    f"but its parameters ({layout.numel} elements) split at dp={dp} give partitions of {size} "
                    f"with padding {pad}: the group sizes do not add up (param_shapes do not match the shards)"
                )
            if state:
                entry = need_mapping(state.get(g), f"{name}: optimizer state of param group {g}")
                whole = {key: layout.whole_size(rank) for key in whole_keys[g]}
                out.keys[g] = flat_state_keys(
                    entry, size, f"{name}: param group {g}", out.keys[g] if rank else None, whole
                )
                where = f"{name}: param group {g}"
                out.scalars[g] = rank_scalars(entry, out.scalars[g] if rank else None, where, derived)
            if mappings is not None:
                mapping = need_list(mappings, f"{name}: param_slice_mappings")[g]
                where = f"{name}: param group {g}"
                check_slice_mappings(mapping, list(shapes[g]), layout, rank, where, original_layout(g))
    return out


def group_steps(groups_raw: list[Mapping[str, Any]], bases: list[Base], detection: Detection) -> list[int | None]:
    """Each param group's step, checked across ranks (the highest wins, with a warning)."""
    steps: list[int | None] = []
    for g, group in enumerate(groups_raw):
        seen: set[int | None] = set()
        for _, rank_state in bases:
            entry = rank_state.get(g, {})
            seen.add(detection.flavour.read_step(group, entry) if detection.flavour else None)
        if len(seen) > 1:
            detection.warnings.append(f"param group {g} has different steps across ranks: {sorted(map(str, seen))}")
        steps.append(max((s for s in seen if s is not None), default=None))
    return steps


def partition_pieces(
    optim: list[TorchFile], layout: Zero12Group, g: int, i: int, shape: tuple[int, ...], pick: Any
) -> Pieces:
    """One flat state of member ``i`` of param group ``g`` as its slices of the ranks' flat partitions, in order
    (``pick(block, g)``: the flat state in a rank's optimizer block)."""
    parts = []
    for span in layout.spans(i):
        tf = optim[span.rank]
        parts.append(
            (tf, pick(tf.obj["optimizer_state_dict"], g).detach().narrow(0, span.partition_start, span.length))
        )
    return file_pieces(parts, shape)


def whole_pieces(
    optim: list[TorchFile], layout: Zero12Group, g: int, i: int, key: str, shape: tuple[int, ...], pname: str
) -> Pieces:
    """A state kept whole per parameter (``Zero12Group.whole_slots``): the copy of the first rank
    holding it; every other rank's copy must be the same bytes, or the ranks come from different runs."""
    numel = layout.numels[i]
    copies = []
    for rank, tf in enumerate(optim):
        slot = layout.whole_slots(rank).get(i)
        if slot is not None:
            flat = tf.obj["optimizer_state_dict"][BASE_STATE]["state"][g][key].detach()
            copies.append((tf, flat.narrow(0, slot, numel)))
    for tf, copy in copies[1:]:
        if not torch.equal(copy, copies[0][1]):
            raise InputError(
                f"{pname}: its {key} in {tf.path.name} differs from the copy in {copies[0][0].path.name} "
                "(each rank keeps it whole, and they should agree): ranks from different saves are mixed"
            )
    return file_pieces(copies[:1], shape)
