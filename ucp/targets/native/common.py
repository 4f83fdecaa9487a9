"""What the native writers of every ZeRO stage share: the model-states fields, the param groups, the file write."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ucp.deepspeed import states as ds_states
from ucp.io.torchzip import write_torch_file
from ucp.model.records import Reader
from ucp.targets.native.plan import NativePlan

__all__ = ["model_states", "optimizer_groups", "zero_wrapper", "save_rank_file"]


def model_states(reader: Reader, plan: NativePlan, *, extra: Mapping[str, Any]) -> dict[str, Any]:
    """A model-states file's fields for this plan; at TP > 1 with the layout's ``universal_checkpoint_info``."""
    more = dict(extra)
    if plan.tp > 1:
        from ucp.targets.tensor_parallel import target_tp_info

        tp_fields = {
            "universal_checkpoint_info": target_tp_info(reader, plan.tp),
            "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": plan.tp},
        }
        more = {**tp_fields, **more}
    return ds_states.model_states(
        reader.facts, reader.extras(), reader.buffers(), dtype=plan.dtype, dp=plan.dp, tp=plan.tp, extra=more
    )


def zero_wrapper(reader: Reader, plan: NativePlan) -> dict[str, Any]:
    return ds_states.zero_wrapper(
        reader.extras(), source_dtype=reader.facts.info.dtype, dtype=plan.dtype, stage=plan.stage
    )


def optimizer_groups(reader: Reader, plan: NativePlan, members: list[list[int]], steps: list[int]) -> list[dict]:
    """The wrapped optimizer's param groups: target-flavour keys, each group's own hyperparameters."""
    groups = []
    for g, meta in enumerate(reader.facts.groups):
        group = plan.flavour.make_group(meta.hyper, steps[g], meta.raw)
        group["params"] = members[g]
        groups.append(group)
    return groups


def save_rank_file(obj: Mapping[str, Any], path: Path) -> None:
    """One rank file, through ucp's one torch-zip writer; its buffers are freed as the caller drops them."""
    write_torch_file(obj, path)
