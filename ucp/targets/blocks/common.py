"""One rank's flat buffers, and how a parameter's state reaches them, for every ZeRO stage."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ucp.deepspeed.optim_states import same_scalars, show_scalars
from ucp.errors import InputError
from ucp.model.records import ParamState, PieceState

__all__ = ["RankBuffers", "check_state", "merge_scalars"]


@dataclass
class RankBuffers:
    """One rank's flat fp32 masters and optimizer state: per flat group (a ZeRO-3 sub-group, a
    ZeRO-1/2 param group) one fp32 tensor and one tensor per state key the group keeps."""

    fp32: list[torch.Tensor]
    optim: list[dict[str, torch.Tensor]]
    #: per flat group, the optimizer's 0-dim scalars (NAdam's mu_product): one value for all its members
    scalars: list[dict[str, torch.Tensor]] = field(default_factory=list)

    @classmethod
    def of_sizes(
        cls, sizes: Sequence[int], keys: Sequence[Sequence[str]], scalars: list[dict[str, torch.Tensor]]
    ) -> RankBuffers:
        """Zeroed buffers: ``sizes[i]`` elements for flat group i, with ``keys[i]`` state tensors;
        ``scalars`` is shared by the ranks (every rank's flat group holds the same ones)."""
        return cls(
            [torch.zeros(n, dtype=torch.float32) for n in sizes],
            [{k: torch.zeros(n, dtype=torch.float32) for k in ks} for n, ks in zip(sizes, keys)],
            scalars,
        )


def merge_scalars(name: str, state: PieceState | ParamState, into: dict[str, torch.Tensor], what: str) -> None:
    """Record a member's scalars as its flat group's; members that disagree cannot share one flat tensor."""
    if not into:
        into.update(state.scalars)
    if not same_scalars(into, state.scalars):
        raise InputError(
            f"{name} carries optimizer scalars {show_scalars(state.scalars)}, but other members of its {what} "
            f"carry {show_scalars(into)}: one flat tensor holds one value; restore with the source's grouping"
        )


def check_state(name: str, state: PieceState, keys: Sequence[str], numel: int, *, moments: bool) -> None:
    """A parameter's state must fit its flat group: the right size and, when the optimizer state is
    restored, exactly the group's state keys."""
    if state.fp32.numel != numel:
        raise InputError(f"{name}: the source holds {state.fp32.numel} elements, the target layout {numel}")
    if not moments:
        return
    if not state.optim:
        raise InputError(f"{name} has no optimizer moments in the source; restore with step reset")
    if set(state.optim) != set(keys):
        raise InputError(
            f"{name} carries optimizer state {sorted(state.optim)}, but its param group keeps "
            f"{sorted(keys)}: the source's groups do not match the target's"
        )
