"""The global batch across a change of DP size: which per-device batch and accumulation keep it.

A resumed run that changes ``micro x accumulation x DP`` sees other samples per step (Trainer and
most data loaders place the data from the step count alone) and trains with another effective
batch; DeepSpeed refuses ``train_batch_size`` that does not factor. Pure arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ucp.model.options import Decided

__all__ = ["global_batch_note", "global_batch_advice"]


def _procs(n: int) -> str:
    return f"{n} process" if n == 1 else f"{n} processes"


def _pairs(per_rank: int) -> list[tuple[int, int]]:
    return [(b, per_rank // b) for b in range(1, per_rank + 1) if per_rank % b == 0]


def global_batch_advice(
    micro: int, accum: int, old_dp: int, new_dp: int, *, spell: Callable[[int, int], str], verb: str = "set"
) -> str | None:
    """One line: the global batch ``micro * accum * old_dp``, what the same settings give at ``new_dp``,
    and the (at most two) settings closest to ``micro`` that keep it, each written by ``spell(micro, accum)``;
    None when nothing changes."""
    total = micro * accum * old_dp
    if micro * accum * new_dp == total:
        return None
    head = (
        f"the global batch was {total} ({micro} per device x {accum} accumulation x {_procs(old_dp)}); "
        f"at {_procs(new_dp)} the same settings give {micro * accum * new_dp}"
    )
    if total % new_dp:
        return f"{head}, and no setting keeps {total} at {_procs(new_dp)} (it is not a multiple of {new_dp})"
    options = sorted(_pairs(total // new_dp), key=lambda p: (abs(p[0] - micro), -p[0]))
    return f"{head}; to keep {total} {verb} " + ", or ".join(spell(b, a) for b, a in options[:2])


def global_batch_note(decided: Decided) -> str | None:
    """The DeepSpeed settings that keep the source's global batch at the new DP size (from its saved config)."""
    facts = decided.facts
    config = facts.info.ds_config or {}
    micro, accum = config.get("train_micro_batch_size_per_gpu"), config.get("gradient_accumulation_steps", 1)
    if not isinstance(micro, int) or not isinstance(accum, int) or isinstance(micro, bool) or micro < 1 or accum < 1:
        return None
    return global_batch_advice(
        micro,
        accum,
        facts.info.batch_ranks,
        decided.options.dp,
        spell=lambda b, a: f"train_micro_batch_size_per_gpu={b}, gradient_accumulation_steps={a}",
    )
