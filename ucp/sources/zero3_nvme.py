"""ZeRO-Infinity's NVMe swap files read in place of the empty sub-groups a ZeRO-3 save leaves behind
(``offload_optimizer.device: nvme``; ``ucp.sources.zero3``)."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ucp.deepspeed.fields import tensor_shape
from ucp.deepspeed.layout import NVME_FOLDER, nvme_swap_file
from ucp.errors import InputError
from ucp.io.rawfile import RawTensorFile
from ucp.io.torchfile import TorchFile
from ucp.model.partition import zero3_partition_size
from ucp.sources.zero3_rank_files import Inner

__all__ = ["SwapFiles", "swap_in"]

logger = logging.getLogger(__name__)

#: (rank, sub-group, state key or None for the masters) -> its NVMe swap file
SwapFiles = dict[tuple[int, int, str | None], RawTensorFile]

_DS_ID = re.compile(r"\d+_\d+")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _sub_numel(members: Mapping[str, Any], dp: int) -> int:
    """A sub-group's elements on each rank: its members' ZeRO-3 partitions."""
    return sum(zero3_partition_size(math.prod(tensor_shape(shape)), dp) for shape in members.values())


def swap_in(
    optim: list[TorchFile],
    tag_dir: Path,
    flat: list[list[torch.Tensor]],
    inners: list[Inner],
    shapes: list[Mapping[str, Any]],
    swap: SwapFiles,
) -> list[Inner]:
    """ZeRO-Infinity (``offload_optimizer.device: nvme``) saves a sub-group large enough to swap (1 MiB at
    least, per rank) as an empty flat tensor and empty state tensors: its masters and moments are the
    swap files DeepSpeed copies into the tag folder. Put those files' tensors in their place (``flat``
    in place; returns ``inners`` with their state), each a view on its file (opened into ``swap``)."""
    out: list[Inner] = []
    for rank, (groups, rank_state) in enumerate(inners):
        state = dict(rank_state)
        for sub, members in enumerate(shapes):
            numel = _sub_numel(members, len(flat))
            if flat[rank][sub].numel() or not numel:
                continue
            ds_id = getattr(flat[rank][sub], "ds_id", None)
            name = optim[rank].path.name
            if not isinstance(ds_id, str) or not _DS_ID.fullmatch(ds_id):
                raise InputError(
                    f"{name}: sub-group {sub} is swapped to NVMe, but its flat tensor names no swap file "
                    f"(ds_id {ds_id!r})"
                )
            what = f"rank {rank}'s sub-group {sub} is in NVMe swap files (DeepSpeed copies them to {NVME_FOLDER}/)"
            flat[rank][sub] = _open_swap(swap, tag_dir, rank, sub, ds_id, None, flat[rank][sub].dtype, numel, what)
            entry = state.get(sub)
            if isinstance(entry, Mapping):
                swapped = dict(entry)
                for key, value in entry.items():
                    if torch.is_tensor(value) and value.dim() == 1 and not value.numel():
                        if not isinstance(key, str) or not _KEY.fullmatch(key):
                            raise InputError(f"{name}: sub-group {sub} has a state named {key!r}")
                        swapped[key] = _open_swap(swap, tag_dir, rank, sub, ds_id, key, value.dtype, numel, what)
                state[sub] = swapped
        out.append((groups, state))
    return out


def _open_swap(
    swap: SwapFiles,
    tag_dir: Path,
    rank: int,
    sub: int,
    ds_id: str,
    key: str | None,
    dtype: torch.dtype,
    numel: int,
    what: str,
) -> torch.Tensor:
    raw = RawTensorFile(nvme_swap_file(tag_dir, rank, ds_id, key), dtype, numel, what=what)
    swap[(rank, sub, key)] = raw
    return raw.tensor
