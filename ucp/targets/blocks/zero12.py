"""ZeRO-1/2 rank buffers from per-parameter state: each param group is one flat tensor cut into DP partitions."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ucp.io.pool import parallel_map, state_bytes
from ucp.model.partition import Zero12Group
from ucp.model.pieces import Pieces
from ucp.model.records import PieceState, Reader
from ucp.model.steps import settle_steps
from ucp.targets.blocks.common import RankBuffers, check_state, merge_scalars

__all__ = ["zero12_buffers", "fill_zero12_ranks", "group_steps"]


def zero12_buffers(
    layouts: Sequence[Zero12Group],
    keys: Sequence[Sequence[str]],
    scalars: list[dict[str, torch.Tensor]],
    *,
    rank: int,
    whole: Sequence[Sequence[str]] = (),
    partitions: Sequence[int] | None = None,
) -> RankBuffers:
    """Rank ``rank``'s flat partitions: per param group, one tensor of the partition size per key,
    except the keys ``whole[g]`` kept per whole parameter (``Zero12Group.whole_slots``), sized so;
    ``scalars`` (per group, filled as members are read) is shared by every rank's buffers.
    ``partitions[g]``: the rank's partition of group g when that is not ``rank`` (an expert group)."""
    buffers = RankBuffers.of_sizes([layout.partition_size for layout in layouts], keys, scalars)
    for g, group_keys in enumerate(whole):
        for key in group_keys:
            if key in buffers.optim[g]:
                part = rank if partitions is None else partitions[g]
                buffers.optim[g][key] = torch.zeros(layouts[g].whole_size(part), dtype=torch.float32)
    return buffers


def fill_zero12_ranks(
    reader: Reader,
    layouts: list[Zero12Group],
    names: list[list[str]],
    ranks: dict[int, RankBuffers],
    *,
    keys: Sequence[Sequence[str]],
    moments: bool,
    workers: int,
    step_of: Callable[[PieceState], int],
    on_state: Callable[[str, PieceState], None] | None = None,
    whole: Sequence[Sequence[str]] = (),
) -> list[set[int]]:
    """Read every parameter of ``names`` (per param group, in flat order) once into the ranks' partitions
    (the keys ``whole[g]``, as in :func:`zero12_buffers`, into every rank whose partition it touches). From a
    reader that hands out spans only the slices the ranks hold are read: a live rank restoring a 4 GB embedding
    reads its partition of it, not the tensor.

    ``on_state(name, state)`` sees each state as it is read (the native writer takes the module
    weights from it). Returns, per param group, the set of steps its members carried.
    """
    steps: list[set[int]] = [set() for _ in layouts]
    # one list, shared by the ranks (checked even when no rank's partitions are wanted)
    shared_scalars = next(iter(ranks.values())).scalars if ranks else [{} for _ in layouts]
    where = {name: (g, i) for g, group in enumerate(names) for i, name in enumerate(group)}
    whole_keys = [set(whole[g]) if g < len(whole) else set() for g in range(len(layouts))]
    slots = [{r: layout.whole_slots(r) for r in ranks} if whole_keys[g] else {} for g, layout in enumerate(layouts)]

    def one(name: str) -> None:
        g, i = where[name]
        with reader.read_pieces(name, moments=moments) as state:
            check_state(name, state, keys[g], layouts[g].numels[i], moments=moments)
            spans = [s for s in layouts[g].spans(i) if s.rank in ranks]
            pairs: list[tuple[str | None, Pieces]] = [(None, state.fp32)]
            if moments:
                pairs += list(state.optim.items())
            for key, pieces in pairs:
                if key in whole_keys[g]:
                    for r, held in slots[g].items():
                        if i in held:
                            pieces.copy_to(ranks[r].optim[g][key].narrow(0, held[i], pieces.numel))
                    continue
                for span in spans:  # only the slices these ranks hold are read
                    buffers = ranks[span.rank]
                    target = buffers.fp32[g] if key is None else buffers.optim[g][key]
                    end = span.param_start + span.length
                    pieces.slice(span.param_start, end).copy_to(target.narrow(0, span.partition_start, span.length))
            steps[g].add(step_of(state))
            if moments:
                merge_scalars(name, state, shared_scalars[g], "ZeRO-1/2 param group")
            if on_state is not None:
                on_state(name, state)

    weight = state_bytes(reader.facts, moments=moments)
    for _ in parallel_map(one, [n for group in names for n in group], workers, desc="restore", weight=weight):
        pass
    return steps


def group_steps(steps: list[set[int]]) -> list[int]:
    """One step per param group: ZeRO-1/2 steps a whole group as one flat tensor."""
    return settle_steps(steps, "ZeRO-1/2 param group")
