"""ZeRO-3 rank blocks built from per-parameter state: shared by the native and live-engine targets.

Call order: :func:`fill_ranks` reads each optimized parameter once and copies its slice into every
wanted rank's flat buffers (:class:`RankBuffers`); :func:`sub_group_steps` settles one step per
sub-group; :func:`optim_block` assembles what DeepSpeed's ``_rigid_load_state_dict`` takes for one rank.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch

from ucp.errors import InputError
from ucp.flavors import Flavour
from ucp.partition import Zero3Layout, Zero3Slot, zero3_rank_span
from ucp.records import PieceState, Reader
from ucp.targets.steps import settle_steps
from ucp.tensorfile import Pieces
from ucp.universal import parallel_map

__all__ = ["RankBuffers", "fill_ranks", "read_state", "sub_group_steps", "optim_block"]


@dataclass
class RankBuffers:
    """One rank's flat fp32 masters and Adam moments, one tensor per flat group (ZeRO-3 sub-group or
    ZeRO-1/2 param group)."""

    fp32: list[torch.Tensor]
    exp_avg: list[torch.Tensor]
    exp_avg_sq: list[torch.Tensor]

    @classmethod
    def of_sizes(cls, sizes: list[int]) -> "RankBuffers":
        def make() -> list[torch.Tensor]:
            return [torch.zeros(n, dtype=torch.float32) for n in sizes]

        return cls(make(), make(), make())

    @classmethod
    def zeros(cls, layout: Zero3Layout) -> "RankBuffers":
        return cls.of_sizes(list(layout.sub_group_numel))


def _scatter(state: PieceState, slot: Zero3Slot, dp: int, ranks: dict[int, RankBuffers], moments: bool) -> None:
    """Each wanted rank's slice of a parameter into its flat buffers, read straight into place."""
    pairs = [("fp32", state.fp32)]
    if moments:
        pairs += [("exp_avg", state.exp_avg), ("exp_avg_sq", state.exp_avg_sq)]
    for key, pieces in pairs:
        for rank, buffers in ranks.items():
            start, end = zero3_rank_span(slot.numel, dp, rank)
            if end > start:
                pieces.slice(start, end).copy_to(getattr(buffers, key)[slot.sub_group].narrow(0, slot.offset,
                                                                                            end - start))


@contextmanager
def read_state(reader: Reader, name: str, *, moments: bool) -> Iterator[PieceState]:
    """A parameter's state as :class:`Pieces`: from ``read_pieces`` when the reader has it (a target
    then reads only the slices it needs), else wrapping ``read``'s whole tensors."""
    read_pieces = getattr(reader, "read_pieces", None)
    if read_pieces is not None:
        with read_pieces(name, moments=moments) as state:
            yield state
        return
    whole = reader.read(name, moments=moments)
    yield PieceState(fp32=Pieces.of(whole.fp32), step=whole.step,
                     exp_avg=Pieces.of(whole.exp_avg) if whole.exp_avg is not None else None,
                     exp_avg_sq=Pieces.of(whole.exp_avg_sq) if whole.exp_avg_sq is not None else None)


def fill_ranks(reader: Reader, layout: Zero3Layout, names: list[list[str]], ranks: Iterable[int], *,
               moments: bool, workers: int, step_of: Any) -> tuple[dict[int, RankBuffers], list[set[int]]]:
    """Read every parameter of ``names`` (per param group, in layout order) once into the ranks' buffers.

    ``step_of(state)`` gives the step to record for a parameter. Returns the buffers and, per
    sub-group, the set of steps its members carried.
    """
    buffers = {rank: RankBuffers.zeros(layout) for rank in ranks}
    steps: list[set[int]] = [set() for _ in layout.sub_group_numel]
    slots = {name: layout.slots[g][i] for g, group in enumerate(names) for i, name in enumerate(group)}

    def one(name: str) -> None:
        with read_state(reader, name, moments=moments) as state:
            if moments and state.exp_avg is None:
                raise InputError(f"{name} has no optimizer moments in the source; restore with step reset")
            if tuple(state.fp32.shape) != tuple(reader.facts.param(name).shape):
                raise InputError(f"{name}: state has shape {tuple(state.fp32.shape)}, expected "
                                 f"{reader.facts.param(name).shape}")
            _scatter(state, slots[name], layout.dp, buffers, moments)
            steps[slots[name].sub_group].add(step_of(state))

    for _ in parallel_map(one, [n for group in names for n in group], workers, desc="restore"):
        pass
    return buffers, steps


def sub_group_steps(steps: list[set[int]]) -> list[int]:
    """One step per flat sub-group: the optimizer steps a sub-group as one tensor."""
    return settle_steps(steps, "ZeRO-3 sub-group")


def optim_block(*, wrapper: dict[str, Any], flavour: Flavour, buffers: RankBuffers, steps: list[int],
                groups: list[dict[str, Any]], dp: int, moments: bool) -> dict[str, Any]:
    """The dict DeepSpeed's ZeRO-3 optimizer saves for one rank (and loads back)."""
    state = {}
    if moments:
        for sub, step in enumerate(steps):
            state[sub] = flavour.make_state(buffers.exp_avg[sub], buffers.exp_avg_sq[sub], step)
    inner = {"state": state, "param_groups": groups}
    return {**wrapper, "partition_count": dp, "optimizer_state_dict": inner, "fp32_flat_groups": buffers.fp32}
