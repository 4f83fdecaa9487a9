"""Steps for flat optimizer tensors: one count per flat tensor, chosen per parameter.

An optimizer steps a flat tensor (a ZeRO-3 sub-group, a ZeRO-1/2 param group) as one, so all its
members must carry the same step. Targets collect each member's step with :func:`step_chooser`'s
function and settle them with :func:`settle_steps`.
"""

from __future__ import annotations

from collections.abc import Callable

from ucp.errors import StepConflictError
from ucp.model.options import parse_step
from ucp.model.records import ParamState, PieceState

__all__ = ["settle_steps", "step_chooser"]


def step_chooser(step: int | str | None) -> Callable[[ParamState | PieceState], int]:
    """``keep`` (or None): each parameter's own step; ``reset``: 0; an int: that step for all."""
    policy = parse_step(step)
    if policy == "keep":
        return lambda state: int(state.step or 0)
    fixed = 0 if policy == "reset" else int(policy)
    return lambda state: fixed


def settle_steps(seen: list[set[int]], unit: str) -> list[int]:
    """One step per flat tensor from the steps its members carried; refuse members that disagree."""
    out = []
    for index, steps in enumerate(seen):
        if len(steps) > 1:
            raise StepConflictError(
                f"parameters sharing {unit} {index} have different steps {sorted(steps)}, but "
                "the optimizer keeps one step for them; give an explicit step"
            )
        out.append(next(iter(steps)) if steps else 0)
    return out
