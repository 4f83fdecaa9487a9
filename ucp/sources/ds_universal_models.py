"""The model-states files ds_to_universal copies into its folder: opened and checked to be one checkpoint's,
and the frozen ZeRO-3 parameters found in them, for which it writes no folder (``ucp.sources.ds_universal``)."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ucp.deepspeed.fields import as_int, check_name, tensor_shape
from ucp.deepspeed.layout import ds_universal_model_files
from ucp.deepspeed.model_states import check_model_states, zero3_frozen_fragment
from ucp.errors import InputError
from ucp.io.torchfile import TorchFile
from ucp.model.partition import zero3_rank_span
from ucp.model.records import dtype_name
from ucp.sources.ds_universal_groups import OPTIM_NAME

__all__ = ["open_models", "zero3_frozen"]

logger = logging.getLogger(__name__)


def open_models(root: Path, stage: int, dp: int, models: dict[int, TorchFile]) -> Mapping[str, Any]:
    """Open the copied model-states files (rank -> file, into ``models``) and return rank 0's object."""
    for rank, path in ds_universal_model_files(root, stage, dp).items():
        models[rank] = TorchFile(path)
    head = models[0].obj
    name = models[0].path.name
    check_model_states(
        head,
        name,
        "not a ZeRO model-states file (a pipeline-parallel checkpoint keeps its weights elsewhere and is not supported)",
    )
    if head.get("mp_world_size") is not None and as_int(head["mp_world_size"], f"{name}: mp_world_size") > 1:
        raise InputError(
            f"{name} says mp_world_size={head['mp_world_size']}: tensor-parallel ds_to_universal "
            "output is not supported yet"
        )
    world = head.get("dp_world_size")
    if world is not None and as_int(world, f"{name}: dp_world_size") != dp:
        raise InputError(
            f"{name} says dp_world_size={world}, but zero/{OPTIM_NAME} says partition_count={dp}: files "
            "of different checkpoints are mixed"
        )
    for rank, tf in models.items():
        if rank and (not isinstance(tf.obj, Mapping) or tf.obj.get("param_shapes") != head["param_shapes"]):
            raise InputError(
                f"{tf.path.name} and {name} disagree on param_shapes: files of different checkpoints are mixed"
            )
    return head


def zero3_frozen(
    root: Path, models: Mapping[int, TorchFile], head: Mapping[str, Any], dp: int, warnings: list[str]
) -> dict[str, tuple[tuple[int, ...], str | None]]:
    """Frozen parameters live only in the model states, one partition per rank file: each one's shape and
    dtype (a note in ``warnings`` where a rank's file, holding none of them, is missing)."""
    name0 = models[0].path.name
    out: dict[str, tuple[tuple[int, ...], str | None]] = {}
    listed = head.get("frozen_param_shapes") or {}
    for pname, shape in listed.items():
        check_name(pname, f"{name0}: frozen_param_shapes")
        shape = tensor_shape(shape)
        numel = math.prod(shape)
        frozen_dtype = None
        for rank in range(dp):
            start, end = zero3_rank_span(numel, dp, rank)
            if end <= start:
                continue
            tf = models.get(rank)
            if tf is None:
                raise InputError(
                    f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt is missing from {root}: "
                    f"it holds rank {rank}'s part of frozen parameter {pname!r}, and ds_to_universal "
                    "writes no folder for frozen ZeRO-3 parameters; copy every rank's model states "
                    "from the source tag folder"
                )
            fragment = zero3_frozen_fragment(tf, pname, numel, dp, rank)
            frozen_dtype = frozen_dtype or dtype_name(fragment.dtype)
        out[pname] = (shape, frozen_dtype)
    missing = [r for r in range(dp) if r not in models]
    if missing:
        warnings.append(
            f"model states of dp rank(s) {missing} are missing from {root}; nothing needed was "
            "in them (no frozen parameter has a part there)"
        )
    return out
