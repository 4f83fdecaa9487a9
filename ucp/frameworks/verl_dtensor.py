"""The DTensors a verl FSDP2 (or FSDP1-with-mesh) rank file holds, made without a process group.

verl saves ``model.state_dict()`` and ``optimizer.state_dict()`` with every parameter and moment a ``DTensor``:
Shard(0) on the 1-D ``fsdp`` mesh ``init_device_mesh(device, (W,), mesh_dim_names=["fsdp"])``, which spans the whole
world and so uses the default process group. Its ``load_checkpoint`` gives those DTensors to ``load_state_dict``, whose
copy into the live DTensors checks that both meshes are equal (ranks, layout, device type, dim names).

Here each rank's mesh is a real ``DeviceMesh`` built as torch builds a submesh (``_init_backend=False``: no process
group is made or looked up) with the rank given, and the default group's name recorded as the mesh's dim group, as
``init_device_mesh`` records it for a world-spanning mesh. A DTensor is written as torch pickles one
(:class:`ucp.io.torchpickle.WrapperTensor`) with its local rows made when the file writer reaches them. Limits: torch
2.13's private mesh fields (the pickle then holds what torch 2.13's DeviceMesh holds; a later torch may pickle and
compare meshes differently), a 1-D mesh only, the default group named ``"0"`` (torch names the first process group
so), the CPU as the storages' device.
"""

from __future__ import annotations

from typing import Any

import torch

from ucp.io.torchpickle import WrapperTensor
from ucp.model.fsdp_shards import row_bounds
from ucp.model.pieces import LazyTensor

__all__ = ["RankMesh", "DEFAULT_GROUP", "MESH_DIM"]

#: the default process group's name, which a world-spanning 1-D DeviceMesh records as its dim group (torch 2.13)
DEFAULT_GROUP = "0"
#: verl's mesh dimension name (verl/workers/engine/fsdp/utils.py create_device_mesh)
MESH_DIM = "fsdp"


class RankMesh:
    """Rank ``rank`` of ``world``'s mesh on ``device`` (cuda, cpu, npu: the new run's device type), and the DTensors
    of that rank's files."""

    def __init__(self, world: int, rank: int, device: str) -> None:
        from torch.distributed.device_mesh import DeviceMesh

        self.world, self.rank = world, rank
        mesh = DeviceMesh(device, torch.arange(world), mesh_dim_names=(MESH_DIM,), _init_backend=False, _rank=rank)
        # as torch's own DeviceMesh.from_group does for a mesh it builds
        mesh._dim_group_names = [DEFAULT_GROUP]  # type: ignore[list-item]  # a GroupName is a str
        self.mesh = mesh

    def rows(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """This rank's [start, end) rows of a tensor of ``shape`` (Shard(0), torch.chunk's sizes)."""
        return row_bounds(shape[0], self.world)[self.rank]

    def dtensor(self, shape: tuple[int, ...], dtype: torch.dtype, local: LazyTensor | torch.Tensor) -> WrapperTensor:
        """A Shard(0) DTensor of global ``shape`` whose local rows are ``local``."""
        from torch.distributed.tensor import DTensor, Shard
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

        meta = TensorMeta(torch.Size(shape), _strides(shape), dtype)
        spec = DTensorSpec(self.mesh, (Shard(0),), tensor_meta=meta)
        state: dict[str, Any] = {"_local_tensor": local, "_spec": spec}
        return WrapperTensor(DTensor, tuple(shape), dtype, state)


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))
