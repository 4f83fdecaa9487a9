"""ZeRO-3 rank buffers from per-parameter state: each rank holds ``ceil(numel/dp)`` of every parameter."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from ucp.io.pool import parallel_map, state_bytes
from ucp.model.partition import Zero3Layout, Zero3Slot, zero3_rank_span
from ucp.model.records import PieceState, Reader
from ucp.model.steps import settle_steps
from ucp.targets.blocks.common import RankBuffers, check_state, merge_scalars

__all__ = ["zero3_buffers", "fill_ranks", "sub_group_steps", "sub_group_keys"]


def sub_group_keys(
    reader: Reader, layout: Zero3Layout, matched: list[int | None] | None = None, moments: bool = True
) -> list[tuple[str, ...]]:
    """The state keys of each sub-group: its param group's (``matched[g]``: the source group of live group g)."""
    if not moments:
        return [() for _ in layout.sub_group_numel]
    groups = reader.facts.groups
    out = []
    for g in layout.sub_group_of_group:
        source = g if matched is None else matched[g]
        out.append(groups[source].state_keys if source is not None else ())
    return out


def zero3_buffers(
    layout: Zero3Layout, keys: list[tuple[str, ...]], scalars: list[dict[str, torch.Tensor]]
) -> RankBuffers:
    return RankBuffers.of_sizes(list(layout.sub_group_numel), keys, scalars)


def _scatter(state: PieceState, slot: Zero3Slot, dp: int, ranks: dict[int, RankBuffers]) -> None:
    """Each wanted rank's slice of a parameter into its flat buffers, read straight into place."""
    for rank, buffers in ranks.items():
        start, end = zero3_rank_span(slot.numel, dp, rank)
        if end <= start:
            continue
        targets = [(state.fp32, buffers.fp32[slot.sub_group])]
        targets += [(state.optim[k], t) for k, t in buffers.optim[slot.sub_group].items()]
        for pieces, flat in targets:
            pieces.slice(start, end).copy_to(flat.narrow(0, slot.offset, end - start))


def fill_ranks(
    reader: Reader,
    layout: Zero3Layout,
    names: list[list[str]],
    ranks: Iterable[int],
    *,
    keys: list[tuple[str, ...]],
    moments: bool,
    workers: int,
    step_of: Callable[[PieceState], int],
) -> tuple[dict[int, RankBuffers], list[set[int]]]:
    """Read every parameter of ``names`` (per param group, in layout order) once into the ranks' buffers.

    ``keys`` are each sub-group's state keys; ``step_of(state)`` gives the step to record for a
    parameter. Returns the buffers and, per sub-group, the set of steps its members carried.
    """
    scalars: list[dict[str, torch.Tensor]] = [{} for _ in layout.sub_group_numel]
    buffers = {rank: zero3_buffers(layout, keys, scalars) for rank in ranks}
    steps: list[set[int]] = [set() for _ in layout.sub_group_numel]
    slots = {name: layout.slots[g][i] for g, group in enumerate(names) for i, name in enumerate(group)}

    def one(name: str) -> None:
        slot = slots[name]
        with reader.read_pieces(name, moments=moments) as state:
            check_state(name, state, keys[slot.sub_group], slot.numel, moments=moments)
            _scatter(state, slot, layout.dp, buffers)
            steps[slot.sub_group].add(step_of(state))
            if moments:
                merge_scalars(name, state, scalars[slot.sub_group], "ZeRO-3 sub-group")

    weight = state_bytes(reader.facts, moments=moments)
    for _ in parallel_map(one, [n for group in names for n in group], workers, desc="restore", weight=weight):
        pass
    return buffers, steps


def sub_group_steps(steps: list[set[int]]) -> list[int]:
    """One step per flat sub-group: the optimizer steps a sub-group as one tensor."""
    return settle_steps(steps, "ZeRO-3 sub-group")
