"""verl's per-rank files read into whole tensors, without a process group and without unpickling anything but the
stand-ins of ``ucp.io.dist_standins``.

Each rank file is opened once (:class:`RankFiles`), its tensors views on a read-only mmap; a whole tensor is a
:class:`Whole`: its shape, dtype and the rank pieces it is copied from when a reader asks for it, so memory stays near
the tensor being read. A model entry is a ``DTensor`` (FSDP2, FSDP1 with a device mesh: Shard(0) on a 1-D mesh, rank
``r``'s rows in file ``r``), a ``ShardedTensor`` (FSDP1 without a mesh: each local shard at its offsets) or a plain
tensor (a buffer, the same on every rank).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ucp.errors import CorruptFileError, InputError
from ucp.io.dist_standins import DIST_GLOBALS, DTensorRecord, ShardedTensorRecord, ShardPlacement, WrapperRecord
from ucp.io.torchfile import TorchFile

__all__ = ["RankFiles", "Whole", "whole_entry", "is_sharded", "describe"]


@dataclass
class Whole:
    """A tensor assembled from rank pieces: ``boxes`` (an index of the whole tensor, a piece of that shape) and
    ``flats`` (a start in the flattened tensor, a 1-D piece). Built checked: the pieces cover every element once."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    boxes: list[tuple[tuple[slice, ...], torch.Tensor]] = field(default_factory=list)
    flats: list[tuple[int, torch.Tensor]] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def covered(self) -> int:
        return sum(t.numel() for _, t in self.boxes) + sum(t.numel() for _, t in self.flats)

    def copy_into(self, slot: torch.Tensor) -> None:
        """Fill ``slot`` (this shape; any dtype) from the pieces."""
        for index, piece in self.boxes:
            slot[index].copy_(piece)
        if self.flats:
            flat = slot.view(-1)
            for start, piece in self.flats:
                flat[start : start + piece.numel()].copy_(piece)

    def pieces(self) -> list[torch.Tensor]:
        return [t for _, t in self.boxes] + [t for _, t in self.flats]

    def tensor(self) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=self.dtype)
        self.copy_into(out)
        return out


def is_sharded(value: Any) -> bool:
    """A distributed tensor (a DTensor or a ShardedTensor), as opposed to a plain (replicated) one."""
    return isinstance(value, WrapperRecord)


def describe(value: Any) -> str:
    names: dict[type, str] = {DTensorRecord: "DTensor", ShardedTensorRecord: "ShardedTensor"}
    return names.get(type(value), type(value).__name__)


class RankFiles:
    """The ``W`` rank files of one kind (model, optim), opened once: ``objs[r]`` is rank ``r``'s pickled object."""

    def __init__(self, paths: Sequence[Path]) -> None:
        self.paths = list(paths)
        self._files: list[TorchFile] = []
        try:
            for path in self.paths:
                self._files.append(TorchFile(path, allow=DIST_GLOBALS))
        except BaseException:
            self.close()
            raise
        self.objs: list[Any] = [tf.obj for tf in self._files]

    def release(self, tensor: torch.Tensor) -> None:
        """Hand the pages under ``tensor`` (a piece of one of these files, already copied out) back to the kernel:
        the mapping's pages a read touched would else stay resident until the files are closed."""
        for tf in self._files:
            tf.release(tensor)

    def close(self) -> None:
        for tf in self._files:
            tf.close()
        self._files = []
        self.objs = []


def _shape(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(isinstance(d, int) and d >= 0 for d in value):
        raise CorruptFileError(f"{where}: its global shape {value!r} is not a shape")
    return tuple(value)


def _placed(value: Any, where: str, world: int) -> tuple[int, ...]:
    """One rank's DTensor: Shard(0) on a 1-D mesh of ``world`` ranks (else one line saying what it is); its shape."""
    spec = getattr(value, "_spec", None)
    placements = getattr(spec, "placements", None)
    if not isinstance(placements, tuple) or len(placements) != 1:
        dims = len(placements) if isinstance(placements, tuple) else "?"
        raise InputError(f"{where} is a DTensor on a {dims}-D device mesh (HSDP?); ucp reads Shard(0) on a 1-D mesh")
    place = placements[0]
    if type(place) is not ShardPlacement or getattr(place, "dim", None) != 0:
        dim = getattr(place, "dim", None)
        raise InputError(
            f"{where} is a DTensor placed as {type(place).__name__.removesuffix('Record')}"
            f"{f'(dim={dim})' if isinstance(dim, int) else ''}; ucp reads Shard(0) on a 1-D mesh"
        )
    mesh_ranks = getattr(getattr(spec, "mesh", None), "_flatten_rank_map", None)
    if isinstance(mesh_ranks, tuple) and len(mesh_ranks) != world:
        raise InputError(f"{where} is a DTensor on a mesh of {len(mesh_ranks)} ranks, saved in {world} files")
    return _shape(getattr(getattr(spec, "tensor_meta", None), "shape", None), where)


def _dtensor_rows(values: Sequence[Any], where: str) -> Whole:
    """A Shard(0) DTensor on a 1-D mesh of the folder's world size: rank r's rows in file r, in rank order."""
    whole: Whole | None = None
    row = 0
    for rank, value in enumerate(values):
        local = getattr(value, "_local_tensor", None)
        if type(value) is not DTensorRecord or not torch.is_tensor(local):
            raise CorruptFileError(f"{where}: rank 0 holds a DTensor, rank {rank} a {describe(value)}")
        shape = _placed(value, f"{where} (rank {rank})" if rank else where, len(values))
        whole = whole or Whole(shape, local.dtype)
        if not shape or shape != whole.shape or local.dtype != whole.dtype or tuple(local.shape[1:]) != shape[1:]:
            raise CorruptFileError(
                f"{where}: rank {rank} holds {tuple(local.shape)} {local.dtype} of a {shape} {whole.dtype} DTensor"
            )
        whole.boxes.append(((slice(row, row + local.shape[0]),), local))
        row += local.shape[0]
    assert whole is not None  # one value per rank, at least one rank
    if row != whole.shape[0]:
        raise CorruptFileError(f"{where}: the ranks hold {row} rows of a DTensor of {whole.shape[0]}")
    return whole


def _sharded_boxes(values: Sequence[Any], where: str) -> Whole:
    """A ShardedTensor: every rank's local shards at their offsets."""
    shape = _shape(tuple(getattr(values[0].metadata, "size", None) or ()), where)
    whole: Whole | None = None
    for rank, value in enumerate(values):
        if type(value) is not ShardedTensorRecord or not isinstance(value.local_shards, list):
            raise CorruptFileError(f"{where}: rank 0 holds a ShardedTensor, rank {rank} a {describe(value)}")
        for shard in value.local_shards:
            tensor, meta = getattr(shard, "tensor", None), getattr(shard, "metadata", None)
            offsets, sizes = getattr(meta, "shard_offsets", None), getattr(meta, "shard_sizes", None)
            if not torch.is_tensor(tensor) or not isinstance(offsets, list) or list(tensor.shape) != sizes:
                raise CorruptFileError(f"{where}: rank {rank} holds a shard that does not match its metadata")
            if len(offsets) != len(shape) or any(o < 0 or o + n > d for o, n, d in zip(offsets, sizes, shape)):
                raise CorruptFileError(f"{where}: rank {rank}'s shard at {offsets} lies outside {shape}")
            whole = whole or Whole(shape, tensor.dtype)
            whole.boxes.append((tuple(slice(o, o + n) for o, n in zip(offsets, sizes)), tensor))
    if whole is None:
        raise CorruptFileError(f"{where}: no rank holds a shard of it")
    return whole


def whole_entry(values: Sequence[Any], where: str) -> Whole:
    """One state-dict entry from every rank's value: a DTensor's rows, a ShardedTensor's shards, or a plain tensor
    (rank 0's, the same shape on every rank)."""
    first = values[0]
    if type(first) is DTensorRecord:
        whole = _dtensor_rows(values, where)
    elif type(first) is ShardedTensorRecord:
        whole = _sharded_boxes(values, where)
    elif torch.is_tensor(first):
        for rank, value in enumerate(values):
            if not torch.is_tensor(value) or is_sharded(value) or value.shape != first.shape:
                raise CorruptFileError(f"{where}: rank 0 holds a {tuple(first.shape)} tensor, rank {rank} does not")
        whole = Whole(tuple(first.shape), first.dtype, boxes=[((), first)])
    else:
        raise InputError(f"{where} is a {type(first).__name__}, not a tensor")
    if whole.covered() != whole.numel:
        raise CorruptFileError(f"{where}: the ranks hold {whole.covered()} of its {whole.numel} elements")
    return whole
