"""What the native writers of every ZeRO stage share: the model-states fields, the param groups, the file write."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from ucp.deepspeed import states as ds_states
from ucp.errors import InputError
from ucp.io.torchzip import write_torch_file
from ucp.model.records import Reader
from ucp.targets.blocks.stream import Weight
from ucp.targets.native.plan import NativePlan

__all__ = ["model_states", "module_of", "optimizer_groups", "zero_wrapper", "save_rank_file"]


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


def module_of(reader: Reader, weights: Mapping[str, Weight], *, apart: Collection[str] = ()) -> OrderedDict[str, Any]:
    """A model-states file's ``module``: every parameter's weight (``weights``, by name) in model order but
    those kept ``apart`` (in files of their own), each tied alias as its owner's very tensor, the buffers."""
    facts = reader.facts
    module: OrderedDict[str, Any] = OrderedDict()
    for meta in facts.params:
        if meta.name not in apart:
            module[meta.name] = weights[meta.name]
    for alias, owner in facts.tied.items():
        if owner not in module:
            raise InputError(f"tied parameter {alias!r} points at {owner!r}, which the checkpoint does not hold")
        module[alias] = module[owner]
    module.update(reader.buffers())
    return module


def zero_wrapper(reader: Reader, plan: NativePlan) -> dict[str, Any]:
    info = reader.facts.info
    return ds_states.zero_wrapper(
        reader.extras(), source_dtype=info.dtype, dtype=plan.dtype, stage=plan.stage, ds_config=info.ds_config
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
