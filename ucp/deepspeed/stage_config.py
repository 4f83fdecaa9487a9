"""What the stage a checkpoint is written for changes besides its files: the DeepSpeed config written with it
(MiCS's keys dropped, round-robin and ZenFlow as written) and, without ZeRO, the note on what every rank loads."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ucp.model.options import Decided

__all__ = ["MICS_KEYS", "config_for_stage", "stage0_note"]

logger = logging.getLogger(__name__)

#: MiCS's settings (DeepSpeed before 0.19.8, which refuses them), which a written config leaves out
MICS_KEYS = ("mics_shard_size", "mics_hierarchical_params_gather")


def config_for_stage(
    config: Mapping[str, Any], stage: int, *, round_robin: bool | None = None, zenflow: bool | None = None
) -> dict[str, Any]:
    """The source's config with the stage it is now written for (and, given, the round_robin_gradients
    its ZeRO-1/2 files are laid out for, or whether its ZeRO-3 files are a ZenFlow run's, matrices transposed:
    a reader of them tells by the ``zenflow`` block). MiCS's keys go: the files are plain ZeRO, and DeepSpeed
    0.19.8 refuses a config that names them."""
    out = dict(config)
    zero = {k: v for k, v in (out.get("zero_optimization") or {}).items() if k not in MICS_KEYS}
    zero["stage"] = stage
    if round_robin is not None and (round_robin or "round_robin_gradients" in zero):
        zero["round_robin_gradients"] = round_robin
    if zenflow is False:
        zero.pop("zenflow", None)
    elif zenflow:
        zero.setdefault("zenflow", {})
    out["zero_optimization"] = zero
    return out


def stage0_note(decided: Decided) -> str | None:
    """Without ZeRO every rank loads one model-states file (its TP rank's)."""
    if decided.options.stage != 0:
        return None
    files = (
        "the one mp_rank_00_model_states.pt" if decided.options.tp == 1 else "its TP rank's mp_rank_XX_model_states.pt"
    )
    return (
        f"without ZeRO every rank loads {files}: the checkpoint serves any DP size, and the new run's optimizer "
        "must hold the trained parameters in the source's group order"
    )
