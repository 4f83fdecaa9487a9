"""Regions of a DCP folder's tensors, read chunk by chunk: what a reader needs when one logical tensor holds many
parameters (Megatron-Core stacks every layer's weight into one key and keeps the distributed optimizer's state as
flat buckets), so that reading one parameter reads the chunks that overlap it and no more.

Every chunk of a DCP shard file is a standalone ``torch.save`` archive at its byte range (DCP's default
``FileSystemWriter``); it is loaded with ``weights_only=True``, from the file's read-only mmap. Byte items (pickled
objects) are loaded the same way.
"""

from __future__ import annotations

import io
import math
import mmap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ucp.errors import CorruptFileError, InputError
from ucp.frameworks.dcp import METADATA, read_metadata
from ucp.io.allow_list import one_line

__all__ = ["DcpChunks"]


class DcpChunks:
    """A DCP folder's items by flat key (its ``.metadata`` read once): :meth:`region` of a tensor, :meth:`item` of a
    byte item. Call :meth:`close` when done."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.meta = read_metadata(path)
        self._maps: dict[str, tuple[Any, mmap.mmap]] = {}

    @property
    def entries(self) -> dict[str, Any]:
        """Every key to its storage record (``TensorStorageMetadata`` or ``BytesStorageMetadata``)."""
        return dict(self.meta.state_dict_metadata)

    def _bytes(self, index: Any) -> bytes:
        info = self.meta.storage_data.get(index)
        if info is None:
            raise InputError(f"{self.path}/{METADATA} names {index.fqn!r} at {index.offset} but stores no bytes for it")
        rel = str(info.relative_path)
        if rel not in self._maps:
            file = open(self.path / rel, "rb", buffering=0)  # noqa: SIM115 (kept open with its mapping)
            try:
                self._maps[rel] = (file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ))
            except (OSError, ValueError) as err:
                file.close()
                raise CorruptFileError(f"{self.path / rel} cannot be read: {one_line(err)}") from None
        return self._maps[rel][1][info.offset : info.offset + info.length]

    def _load(self, index: Any) -> Any:
        try:
            return torch.load(io.BytesIO(self._bytes(index)), weights_only=True, map_location="cpu")
        except Exception as err:  # torch raises many types for a damaged or unsafe item
            raise CorruptFileError(
                f"{self.path}: item {index.fqn!r} does not load as a torch object ({one_line(err, 160)})"
            ) from None

    def raw(self, key: str) -> bytes:
        """A byte item's bytes as saved, not unpickled (to be carried as they are)."""
        from torch.distributed.checkpoint.metadata import MetadataIndex

        return bytes(self._bytes(MetadataIndex(key)))

    def item(self, key: str) -> Any:
        """A byte item (a pickled object), unpickled with ``weights_only=True``."""
        from torch.distributed.checkpoint.metadata import MetadataIndex

        return self._load(MetadataIndex(key))

    def region(self, key: str, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
        """The box ``[offsets, offsets + sizes)`` of tensor ``key``, from every chunk that overlaps it; a box some
        element of which no chunk holds is refused (the checkpoint does not cover it)."""
        from torch.distributed.checkpoint.metadata import MetadataIndex

        meta = self.meta.state_dict_metadata[key]
        out = torch.empty(tuple(sizes), dtype=meta.properties.dtype)
        covered = 0
        for chunk in meta.chunks:
            lo = [max(o, c) for o, c in zip(offsets, chunk.offsets, strict=True)]
            hi = [min(o + s, c + n) for o, s, c, n in zip(offsets, sizes, chunk.offsets, chunk.sizes, strict=True)]
            if any(a >= b for a, b in zip(lo, hi, strict=True)):
                continue
            data = self._load(MetadataIndex(key, tuple(chunk.offsets)))
            if not torch.is_tensor(data) or tuple(data.shape) != tuple(chunk.sizes):
                raise CorruptFileError(
                    f"{self.path}: chunk {tuple(chunk.offsets)} of {key!r} is not its recorded shape"
                )
            src = tuple(slice(a - c, b - c) for a, b, c in zip(lo, hi, chunk.offsets, strict=True))
            dst = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets, strict=True))
            out[dst] = data[src]
            covered += math.prod(b - a for a, b in zip(lo, hi, strict=True))
        if covered != out.numel():
            raise InputError(f"{self.path}: the chunks of {key!r} do not cover {tuple(offsets)}+{tuple(sizes)}")
        return out

    def close(self) -> None:
        for file, mapping in self._maps.values():
            mapping.close()
            file.close()
        self._maps = {}
