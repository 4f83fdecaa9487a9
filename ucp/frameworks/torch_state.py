"""One logical state dict kept in whole torch files, seen as a DCP folder is seen (:class:`~ucp.frameworks.dcp.DcpStore`).

Accelerate's FULL_STATE_DICT save (Trainer's too) writes the model's full state dict to ``pytorch_model_fsdp.bin``
and the optimizer's (``{"state": {fqn: {...}}, "param_groups": [...]}``, every key a clean FQN) to
``optimizer.bin``: the same content a SHARDED save keeps in two DCP folders, in one chunk per tensor. Giving both the
same key paths and storage records lets one reader (:class:`ucp.sources.dcp.DcpSource`) read either; the files are
opened once, their tensors views on a read-only mmap (:class:`ucp.io.torchfile.TorchFile`), so memory stays near the
tensors being copied out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ucp.errors import InputError
from ucp.io.torchfile import TorchFile

__all__ = ["TorchStateStore", "flatten", "set_leaf"]


def flatten(obj: Any, prefix: tuple[Any, ...] = ()) -> dict[tuple[Any, ...], Any]:
    """Key paths to leaves, as DCP flattens a state dict: mappings are walked, a list is walked (its indices as
    strings) when it holds a mapping or a list (``param_groups``), else it is one leaf (a group's ``params``)."""
    if isinstance(obj, Mapping):
        items: Any = ((str(k), v) for k, v in obj.items())
    elif isinstance(obj, (list, tuple)) and any(isinstance(v, (Mapping, list, tuple)) for v in obj):
        items = ((str(i), v) for i, v in enumerate(obj))
    else:
        return {prefix: obj}
    out: dict[tuple[Any, ...], Any] = {}
    for key, value in items:
        out.update(flatten(value, (*prefix, key)))
    return out


def set_leaf(template: Any, where: tuple[Any, ...], value: Any) -> None:
    """Put ``value`` at key path ``where`` of the nested ``template`` (a leaf that is no tensor to fill)."""
    node = template
    for part in where[:-1]:
        node = node[part]
    node[where[-1]] = value


def _storage(value: Any) -> Any:
    """DCP's record of one leaf: a tensor's shape and dtype in one chunk, or a byte item."""
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    if not torch.is_tensor(value):
        return BytesStorageMetadata()
    size = torch.Size(value.shape)
    chunk = ChunkStorageMetadata(offsets=torch.Size([0] * len(size)), sizes=size)
    return TensorStorageMetadata(properties=TensorProperties(dtype=value.dtype), size=size, chunks=[chunk])


class TorchStateStore:
    """``parts`` lists each torch file with the top-level key its content stands under (``("model")`` for a model
    state dict, ``("optim")`` for an optimizer's); :attr:`paths`, :meth:`load` and :meth:`writers` are
    :class:`~ucp.frameworks.dcp.DcpStore`'s. Call :meth:`close` when done."""

    def __init__(self, parts: Sequence[tuple[Path, str]]) -> None:
        self.folders = [path for path, _ in parts]
        self._files: list[TorchFile] = []
        self._leaves: dict[tuple[Any, ...], Any] = {}
        self.paths: dict[tuple[Any, ...], Any] = {}
        try:
            for path, top in parts:
                tf = TorchFile(path)
                self._files.append(tf)
                if not isinstance(tf.obj, Mapping):
                    raise InputError(f"{path} holds a {type(tf.obj).__name__}, not a state dict")
                self._leaves.update(flatten(tf.obj, (top,)))
        except BaseException:
            self.close()
            raise
        self.paths = {where: _storage(value) for where, value in self._leaves.items()}

    def load(self, template: dict[str, Any]) -> None:
        """Fill ``template`` (nested, any subset of the key paths): tensors in place, other leaves set."""
        for where, slot in flatten(template).items():
            value = self._leaves[where]
            if torch.is_tensor(slot) and torch.is_tensor(value):
                slot.copy_(value)
            else:
                set_leaf(template, where, value)

    def writers(self, top: str) -> int:
        """Whole files: one writer, whatever the world size that saved them."""
        return 1

    def close(self) -> None:
        for tf in self._files:
            tf.close()
        self._files = []
