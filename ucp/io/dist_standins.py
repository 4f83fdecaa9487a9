"""Inert stand-ins for the torch.distributed and numpy classes that a verl FSDP checkpoint's pickles name.

verl's ``FSDPCheckpointManager`` ``torch.save``\\ s each rank's ``model.state_dict()`` and ``optimizer.state_dict()``
as they are: under FSDP2 (and FSDP1 with a device mesh) every entry is a ``DTensor`` (its local rows, a spec naming
a ``DeviceMesh`` and placements), under FSDP1 without a mesh a ``ShardedTensor``; the ``extra_state`` file holds
numpy's RNG state. Reading them with torch's own classes would need ``import torch.distributed.tensor`` (and, for a
``ShardedTensor``, a process group of the save's world size). Here each of those names maps to a stand-in that only
records what the pickle says: the same weights_only unpickler builds them, nothing of torch.distributed or numpy runs,
and no process group is needed. Only :class:`ucp.io.torchfile.TorchFile` callers that pass :data:`DIST_GLOBALS`
(``ucp.frameworks.verl``) accept these names; every other read refuses them as before.

The wrappers (:class:`DTensorRecord`, :class:`ShardedTensorRecord`) must be torch.Tensor subclasses: torch's
``_rebuild_wrapper_subclass`` (on its default allow-list) builds them as storage-less wrapper tensors. Any operation
on one raises; their fields (``_local_tensor``, ``_spec``; ``local_shards``, ``metadata``) are what a reader reads.
The names and fields are torch 2.13's (verl 0.9.1 saves), seen in real files: a later torch may pickle others.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ucp.errors import UnsafeFileError
from ucp.io.standins import DSObject

__all__ = [
    "DIST_GLOBALS",
    "WrapperRecord",
    "DTensorRecord",
    "ShardedTensorRecord",
    "ShardPlacement",
    "TensorMetaRecord",
    "NdarrayRecord",
]

_TENSOR = "torch.distributed.tensor"
_SHARD = "torch.distributed._shard"


class WrapperRecord(torch.Tensor):
    """A storage-less wrapper tensor standing in for a distributed tensor subclass: it holds fields, runs nothing."""

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        raise TypeError(f"{cls.__name__} is an inert record of a pickled tensor; read its fields instead")


class DTensorRecord(WrapperRecord):
    """A ``DTensor``: ``_local_tensor`` (this rank's part, a real tensor) and ``_spec`` (a :class:`DTensorSpec`)."""

    _local_tensor: torch.Tensor
    _spec: Any


class _Inert(DSObject):
    """An attribute bag built by NEWOBJ (arguments kept in ``args``) and BUILD (its fields)."""

    def __new__(cls, *args: Any) -> _Inert:
        obj = super().__new__(cls)
        obj.__dict__["args"] = args
        return obj

    def __init__(self, *args: Any) -> None:  # REDUCE calls the class: its arguments are kept by __new__
        pass


class ProcessGroupStateRecord(_Inert):
    ds_name = f"{_SHARD}.sharded_tensor.api.ShardedTensor.ProcessGroupState"


class ShardedTensorRecord(WrapperRecord):
    """A ``ShardedTensor``: its ``__setstate__`` tuple kept as fields (local shards, global metadata, the process
    group state at save, the sharding spec), never checked against a process group."""

    ProcessGroupState = ProcessGroupStateRecord
    local_shards: list[Any]
    metadata: Any

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, tuple) or len(state) != 5:
            raise UnsafeFileError("a ShardedTensor's pickled state is not the 5 fields torch writes")
        self.local_shards, self.metadata, self.pg_state, self.spec, _ = state


def _inert(name: str) -> type[_Inert]:
    """A bag standing in for the class of dotted ``name``."""
    return type(name.rpartition(".")[2] + "Record", (_Inert,), {"ds_name": name, "__module__": __name__})


class ShardPlacement(_Inert):
    """DTensor's ``Shard(dim)`` placement (its ``dim`` field)."""

    ds_name = f"{_TENSOR}.placement_types.Shard"


class TensorMetaRecord(NamedTuple):
    """``TensorMeta(shape, stride, dtype)``: the DTensor's global shape."""

    shape: Any
    stride: Any
    dtype: Any


class _ShardOrderEntry(NamedTuple):
    tensor_dim: Any
    mesh_dims: Any


class _TensorProperties(_Inert):
    """``TensorProperties``: pickled as a 5-tuple state (dtype, layout, requires_grad, memory format, pinned)."""

    ds_name = f"{_SHARD}.sharded_tensor.metadata.TensorProperties"

    def __setstate__(self, state: Any) -> None:
        self.__dict__["state"] = state


class _MemFormat(int):
    """``MEM_FORMAT_ENCODING(i)``: an enum member, kept as its number."""


class NdarrayRecord(_Inert):
    """A numpy array of an RNG state: ``state`` is numpy's pickled ``(version, shape, dtype, fortran, bytes)``."""

    ds_name = "numpy.ndarray"

    def __setstate__(self, state: Any) -> None:
        self.__dict__["state"] = state


class _Dtype(_Inert):
    ds_name = "numpy.dtype"

    def __setstate__(self, state: Any) -> None:
        self.__dict__["state"] = state


def _reconstruct(cls: Any, shape: Any, typecode: Any) -> NdarrayRecord:
    """numpy's ``_reconstruct(ndarray, (0,), b"b")``: an empty record, filled by BUILD."""
    if cls is not NdarrayRecord:
        raise UnsafeFileError("numpy's _reconstruct is asked for something other than an ndarray")
    return NdarrayRecord()


def _getattr(obj: Any, name: str) -> Any:
    """``getattr`` as a ShardedTensor pickle uses it (its nested ``ProcessGroupState`` class), and for nothing else."""
    if obj is ShardedTensorRecord and name == "ProcessGroupState":
        return ProcessGroupStateRecord
    raise UnsafeFileError(
        f"the pickle calls getattr(..., {str(name)[:40]!r}), which ucp allows only for a ShardedTensor"
    )


_BAGS = [
    f"{_TENSOR}._dtensor_spec.DTensorSpec",
    "torch.distributed.device_mesh.DeviceMesh",
    "torch.distributed._mesh_layout._MeshLayout",
    "torch.distributed._mesh_layout._FlatLayout",
    f"{_TENSOR}.placement_types.Replicate",
    f"{_TENSOR}.placement_types.Partial",
    f"{_TENSOR}.placement_types._StridedShard",
    f"{_SHARD}.sharded_tensor.shard.Shard",
    f"{_SHARD}.metadata.ShardMetadata",
    f"{_SHARD}.sharded_tensor.metadata.ShardedTensorMetadata",
    f"{_SHARD}.sharding_spec.chunk_sharding_spec.ChunkShardingSpec",
    "torch.distributed.remote_device._remote_device",
]

#: every name a verl checkpoint's pickles may give, with what it means here (torch's ``safe_globals`` pairs)
DIST_GLOBALS: tuple[tuple[Any, str], ...] = (
    (DTensorRecord, f"{_TENSOR}.DTensor"),
    (ShardedTensorRecord, f"{_SHARD}.sharded_tensor.api.ShardedTensor"),
    (ProcessGroupStateRecord, ProcessGroupStateRecord.ds_name),
    (ShardPlacement, ShardPlacement.ds_name),
    (TensorMetaRecord, f"{_TENSOR}._dtensor_spec.TensorMeta"),
    (_ShardOrderEntry, f"{_TENSOR}._dtensor_spec.ShardOrderEntry"),
    (_TensorProperties, _TensorProperties.ds_name),
    (_MemFormat, f"{_SHARD}.sharded_tensor.metadata.MEM_FORMAT_ENCODING"),
    (_getattr, "builtins.getattr"),
    (NdarrayRecord, "numpy.ndarray"),
    (_Dtype, "numpy.dtype"),
    (_reconstruct, "numpy._core.multiarray._reconstruct"),
    (_reconstruct, "numpy.core.multiarray._reconstruct"),
    *((_inert(name), name) for name in _BAGS),
)
