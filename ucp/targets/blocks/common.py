"""One rank's flat buffers, and how a parameter's state reaches them, for every ZeRO stage."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ucp.errors import InputError
from ucp.model.records import PieceState

__all__ = ["RankBuffers", "check_state"]


@dataclass
class RankBuffers:
    """One rank's flat fp32 masters and optimizer state: per flat group (a ZeRO-3 sub-group, a
    ZeRO-1/2 param group) one fp32 tensor and one tensor per state key the group keeps."""

    fp32: list[torch.Tensor]
    optim: list[dict[str, torch.Tensor]]

    @classmethod
    def of_sizes(cls, sizes: Sequence[int], keys: Sequence[Sequence[str]]) -> RankBuffers:
        """Zeroed buffers: ``sizes[i]`` elements for flat group i, with ``keys[i]`` state tensors."""
        return cls(
            [torch.zeros(n, dtype=torch.float32) for n in sizes],
            [{k: torch.zeros(n, dtype=torch.float32) for k in ks} for n, ks in zip(sizes, keys)],
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
