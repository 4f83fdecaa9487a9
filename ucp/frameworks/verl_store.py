"""A verl actor folder seen as one DCP-shaped state dict (:class:`~ucp.frameworks.dcp.StateStore`), so that
:class:`ucp.sources.dcp.DcpSource` reads it as it reads a DCP folder.

The logical state dict is what ``get_state_dict`` would give for the run: ``model`` (every entry of the model files,
whole, by its clean FQN), ``optim`` (``state`` by FQN, ``param_groups`` naming their members by FQN:
``ucp.frameworks.verl_optim``), ``lr_scheduler`` (rank 0's ``extra_state``) and ``train_state`` (``step``: the
``global_step_N`` folder's N, when the folder is named so). The model and optimizer files are opened once, mmap-backed
(``ucp.frameworks.verl_files``); a tensor is assembled from its rank pieces only when a reader asks for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ucp.errors import CorruptFileError, InputError
from ucp.frameworks.dcp import MODEL, OPTIM, SCHEDULER, TRAIN_STATE
from ucp.frameworks.torch_state import flatten, set_leaf
from ucp.frameworks.verl import EXTRA, VerlFolder
from ucp.frameworks.verl import MODEL as MODEL_FILES
from ucp.frameworks.verl import OPTIM as OPTIM_FILES
from ucp.frameworks.verl_files import RankFiles, Whole, is_sharded, whole_entry
from ucp.frameworks.verl_optim import OptimState, read_optim
from ucp.io.dist_standins import DIST_GLOBALS, DTensorRecord
from ucp.io.torchfile import load

__all__ = ["VerlStore", "read_extra", "mesh_device"]


def read_extra(folder: VerlFolder, rank: int) -> Mapping[str, Any]:
    """Rank ``rank``'s ``extra_state`` (``{"lr_scheduler", "rng"}``): the RNG's numpy arrays stay inert records."""
    path = folder.paths(EXTRA)[rank]
    extra = load(path, allow=DIST_GLOBALS)
    if not isinstance(extra, Mapping) or "lr_scheduler" not in extra:
        raise CorruptFileError(f"{path} is not verl's extra state (no 'lr_scheduler')")
    return extra


def mesh_device(folder: VerlFolder) -> str | None:
    """The device type of the mesh rank 0's DTensors live on (cuda on a GPU run), or None (ShardedTensors)."""
    files = RankFiles(folder.paths(MODEL_FILES)[:1])
    try:
        for value in files.objs[0].values() if isinstance(files.objs[0], Mapping) else ():
            if type(value) is DTensorRecord:
                device = getattr(getattr(value._spec, "mesh", None), "_device_type", None)
                return device if isinstance(device, str) else None
        return None
    finally:
        files.close()


def _record(whole: Whole, chunks: int) -> Any:
    """DCP's storage record of a whole tensor (its chunks: one per rank piece, as a reader counts writers)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata

    size = torch.Size(whole.shape)
    chunk = ChunkStorageMetadata(offsets=torch.Size([0] * len(size)), sizes=size)
    return TensorStorageMetadata(properties=TensorProperties(dtype=whole.dtype), size=size, chunks=[chunk] * chunks)


class VerlStore:
    """``folder``'s files as one state dict; :attr:`paths`, :meth:`load`, :meth:`writers` and :meth:`close` are
    :class:`~ucp.frameworks.dcp.StateStore`'s. :attr:`names` tells DcpSource the buffers (plain tensors of the model
    files) and tied aliases (one object under two names); :attr:`optim` says which optimizer layout was read."""

    def __init__(self, folder: VerlFolder) -> None:
        self.folder = folder
        self.folders = [folder.actor]
        self._models = RankFiles(folder.paths(MODEL_FILES))
        self._optims: RankFiles | None = None
        try:
            self._optims = RankFiles(folder.paths(OPTIM_FILES))
            self._build()
        except BaseException:
            self.close()
            raise

    def _entries(self) -> dict[str, Whole]:
        """Every model entry, whole; the same keys on every rank."""
        objs = self._models.objs
        for rank, obj in enumerate(objs):
            if not isinstance(obj, Mapping) or not all(isinstance(k, str) for k in obj):
                raise CorruptFileError(f"{self._models.paths[rank]} is not a model state_dict")
            if list(obj) != list(objs[0]):
                raise CorruptFileError(f"{self._models.paths[rank]} holds other keys than rank 0's model file")
        return {k: whole_entry([o[k] for o in objs], f"{self._models.paths[0].name} {k}") for k in objs[0]}

    def _version(self, optims: list[Any]) -> int:
        if self.folder.fsdp_version is not None:
            return int(self.folder.fsdp_version)
        states = [v for e in optims[0].get("state", {}).values() if isinstance(e, Mapping) for v in e.values()]
        return 2 if any(type(v) is DTensorRecord for v in states) else 1  # no fsdp_config.json: the moments tell

    def _build(self) -> None:
        entries = self._entries()
        first = self._models.objs[0]
        owner_of: dict[int, str] = {}
        self.tied: dict[str, str] = {}
        params: list[tuple[str, Whole]] = []
        # FSDP1 at one process runs NO_SHARD: its model file holds plain tensors, every one a parameter here
        whole_model = self.folder.world == 1 and not any(is_sharded(v) for v in first.values())
        for name, whole in entries.items():
            if not (whole_model or is_sharded(first[name])):
                continue
            owner = owner_of.setdefault(id(first[name]), name)
            if owner != name:
                self.tied[name] = owner  # a tied alias: one parameter pickled under two names
            else:
                params.append((name, whole))
        self.buffers = [] if whole_model else [n for n in entries if not is_sharded(first[n])]
        assert self._optims is not None
        self.version = self._version(self._optims.objs)
        where = self._optims.paths[0].name.replace("rank_0", "rank_*")
        self.optim: OptimState = read_optim(params, self._optims.objs, self.version, where)
        self._big: dict[tuple[Any, ...], Whole] = {(MODEL, n): w for n, w in entries.items()}
        small: dict[tuple[Any, ...], Any] = {}
        for name, keys in self.optim.state.items():
            for key, whole in keys.items():
                (small if whole.shape == () else self._big)[(OPTIM, "state", name, key)] = whole
        small.update(flatten({"param_groups": self.optim.groups}, (OPTIM,)))
        schedulers = [read_extra(self.folder, r)["lr_scheduler"] for r in range(self.folder.world)]
        if any(s != schedulers[0] for s in schedulers):
            raise InputError(f"{self.folder.actor}: the ranks' extra_state files hold different lr scheduler states")
        small[(SCHEDULER,)] = schedulers[0]
        if self.folder.step is not None:
            small[(TRAIN_STATE, "step")] = self.folder.step
        self._small = small
        self.paths: dict[tuple[Any, ...], Any] = {w: _record(v, len(v.boxes) or 1) for w, v in self._big.items()}
        self.paths.update({w: _record(v, 1) if isinstance(v, Whole) else _bytes() for w, v in small.items()})

    @property
    def names(self) -> dict[str, Any]:
        """What DcpSource cannot tell from the state dict alone: the buffers and the tied aliases."""
        return {"buffers": list(self.buffers), "tied": dict(self.tied)}

    def load(self, template: Mapping[str, Any]) -> None:
        """Fill ``template`` (nested, any subset of :attr:`paths`): tensors in place, other leaves set."""
        for where, slot in flatten(template).items():
            value = self._big.get(where, self._small.get(where))
            if isinstance(value, Whole):
                if not torch.is_tensor(slot):
                    raise KeyError(where)
                value.copy_into(slot)
                for piece in value.pieces():  # memory stays near the tensors being read, not the files
                    for files in (self._models, self._optims):
                        if files is not None:
                            files.release(piece)
                continue
            set_leaf(template, where, value)

    def writers(self, top: str) -> int:
        return self.folder.world

    def close(self) -> None:
        self._models.close()
        if self._optims is not None:
            self._optims.close()


def _bytes() -> Any:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    return BytesStorageMetadata()
