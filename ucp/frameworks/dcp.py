"""The one owner of torch.distributed.checkpoint's on-disk layout as ucp reads and writes it: the folder's files,
its ``.metadata`` read without unpickling anything but DCP's own classes, the top-level keys of the state dicts ucp
writes and reads (``get_state_dict``'s ``model``/``optim``), and items loaded with DCP's own loader in this process
(byte items with ``weights_only=True``). Megatron-Core's ``torch_dist`` folders are DCP folders too.
"""

from __future__ import annotations

import io
import os
import pickle
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from ucp.errors import CorruptFileError, InputError
from ucp.io.small_files import read_small

__all__ = [
    "METADATA",
    "MAX_METADATA_BYTES",
    "MODEL",
    "OPTIM",
    "SCHEDULER",
    "TRAIN_STATE",
    "UCP_KEY",
    "is_dcp",
    "read_metadata",
    "load_items",
    "cause",
    "DcpStore",
    "StateStore",
]

METADATA = ".metadata"
#: a model of a million tensors writes about a gigabyte of metadata; a larger one is damage
MAX_METADATA_BYTES = 1 << 30
MODEL, OPTIM, SCHEDULER, TRAIN_STATE, UCP_KEY = "model", "optim", "lr_scheduler", "train_state", "ucp"

_DCP = "torch.distributed.checkpoint"
#: the only globals a DCP .metadata pickle may name (torch 2.4 - 2.13 write these)
_ALLOWED = (
    {
        (f"{_DCP}.metadata", name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    }
    | {
        # Megatron-Core keeps every rank's save plan in the metadata (``all_local_plans``)
        (f"{_DCP}.planner", name)
        for name in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")
    }
    | {
        (f"{_DCP}.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
        ("collections", "OrderedDict"),
    }
)


def is_dcp(path: str | os.PathLike) -> bool:
    """A folder holding DCP's ``.metadata`` file."""
    return (Path(path) / METADATA).is_file()


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata dataclasses, torch sizes, dtypes and layouts; refuses anything else."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which DCP metadata never holds")


def read_metadata(path: Path) -> Any:
    """DCP's ``Metadata`` of a folder, read safely, with every shard file checked for presence and size."""
    from torch.distributed.checkpoint.metadata import Metadata

    file = path / METADATA
    raw = read_small(file, MAX_METADATA_BYTES, "torch.distributed.checkpoint metadata file")
    try:
        meta = _MetadataUnpickler(io.BytesIO(raw)).load()
    except Exception as err:  # any unpickling failure means: not DCP's metadata
        raise CorruptFileError(f"{file} is not a torch.distributed.checkpoint metadata file: {err}") from None
    if not isinstance(meta, Metadata) or not isinstance(meta.storage_data, dict):
        raise CorruptFileError(f"{file} is not a torch.distributed.checkpoint metadata file (no Metadata with storage)")
    if meta.planner_data is not None and not isinstance(meta.planner_data, dict):
        raise InputError(f"{file} holds key paths (planner_data) of an unknown kind")
    sizes: dict[str, int] = {}
    for index, info in meta.storage_data.items():
        rel = str(info.relative_path)
        if rel not in sizes:
            shard = path / rel
            if os.path.basename(rel) != rel or not shard.is_file():
                raise InputError(f"shard file {rel} is missing from {path}: {METADATA} lists it")
            sizes[rel] = shard.stat().st_size
        if info.transform_descriptors:
            raise InputError(
                f"{path}/{rel} is stored with transforms {info.transform_descriptors}; ucp reads plain DCP"
            )
        if info.offset + info.length > sizes[rel]:
            raise CorruptFileError(
                f"shard file {rel} in {path} is truncated: {index.fqn} needs bytes up to "
                f"{info.offset + info.length}, the file has {sizes[rel]}"
            )
    return meta


def load_items(path: Path, meta: Any, template: dict[str, Any]) -> None:
    """Fill ``template`` (nested, any subset of the checkpoint's keys) with DCP's own loader, in this
    process only; byte items are unpickled with ``weights_only=True``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class Reader_(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return meta

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            loaded = torch.load(value, weights_only=True)
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)

    try:
        with warnings.catch_warnings():  # no_dist is what we ask for; torch warns about it on every call
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(template, storage_reader=Reader_(path), planner=Planner(), no_dist=True)
    except Exception as err:
        raise CorruptFileError(f"reading {path} with torch.distributed.checkpoint failed: {cause(err)}") from None


def cause(err: BaseException) -> str:
    """DCP wraps each rank's failure; the first one is what went wrong."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, Mapping) and failures:
        first = next(iter(failures.values()))
        err = first[0] if isinstance(first, tuple) else first
    return f"{type(err).__name__}: {err}".splitlines()[0][:300]


class StateStore(Protocol):
    """One logical state dict as a reader sees it, wherever it is kept (DCP folders: :class:`DcpStore`; whole torch
    files: :class:`ucp.frameworks.torch_state.TorchStateStore`)."""

    #: every key path (top-level key first) to DCP's storage record of it (a tensor's size, dtype and chunks)
    paths: dict[tuple[Any, ...], Any]

    def load(self, template: dict[str, Any]) -> None:
        """Fill the nested ``template`` (any subset of :attr:`paths`): tensors in place, other leaves set."""

    def writers(self, top: str) -> int:
        """How many processes wrote the part holding ``top``."""

    def close(self) -> None:
        """Release the files."""


class DcpStore:
    """One logical state dict kept in one or several DCP folders, as a reader sees it.

    A Trainer or Accelerate FSDP folder keeps ``{"model": ...}`` in one DCP folder and ``{"optimizer": ...}`` in
    another; ``parts`` lists each folder with how its top-level keys are named for the reader (``{"optimizer":
    "optim"}``). :attr:`paths` maps every (renamed) key path to its storage metadata; :meth:`load` fills a nested
    template of renamed keys from the folders that hold them, with DCP's own loader (:func:`load_items`).
    """

    def __init__(self, parts: Sequence[tuple[Path, Mapping[str, str]]]) -> None:
        self.folders = [path for path, _ in parts]
        self._metas = [read_metadata(path) for path in self.folders]
        self._renames = [dict(rename) for _, rename in parts]
        self.paths: dict[tuple[Any, ...], Any] = {}
        self._home: dict[str, int] = {}  # renamed top-level key -> the part holding it
        for i, meta in enumerate(self._metas):
            if meta.planner_data is None:
                raise InputError(
                    f"{self.folders[i]}/{METADATA} has no key paths (planner_data): save with DCP's default planner"
                )
            for key, storage in meta.state_dict_metadata.items():
                where = meta.planner_data.get(key)
                if not isinstance(where, tuple) or not where:
                    raise InputError(f"{self.folders[i]}/{METADATA} gives no key path for {key!r}")
                top = self._renames[i].get(str(where[0]), str(where[0]))
                if self._home.setdefault(top, i) != i:
                    raise InputError(f"{self.folders[i]} and {self.folders[self._home[top]]} both hold {top!r}")
                self.paths[(top,) + tuple(where[1:])] = storage

    def load(self, template: dict[str, Any]) -> None:
        """Fill ``template`` (nested, renamed top-level keys) from the folders holding each part of it."""
        for i, meta in enumerate(self._metas):
            own = {v: k for k, v in self._renames[i].items()}
            part = {own.get(top, top): sub for top, sub in template.items() if self._home.get(top) == i}
            if part:
                load_items(self.folders[i], meta, part)
                for name, value in part.items():  # a top-level leaf (a byte item) is replaced, not filled
                    template[self._renames[i].get(name, name)] = value

    def writers(self, top: str) -> int:
        """How many processes wrote the part holding ``top`` (its shard files): the world size that saved it."""
        i = self._home.get(top, 0)
        return len({str(info.relative_path) for info in self._metas[i].storage_data.values()})

    def close(self) -> None:
        """DCP's loader opens the shard files per load: nothing stays open."""
