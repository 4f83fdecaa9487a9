"""Writing a planned state dict in DCP's layout, each tensor streamed from the source when the writer reaches it: the
DCP target's folders, a Trainer or Accelerate FSDP folder's two (``ucp.targets.hf_fsdp``), and Megatron's
``torch_dist`` (``ucp.targets.megatron``).

:class:`Fetch` finds a parameter's pieces once for all the tensors the writer asks of it in a row; :func:`save_state`
hands DCP's planner a state dict of meta tensors, grouped by parameter; :func:`streaming_writer` keeps DCP's planner
and metadata but writes each tensor itself, from those pieces, a bounded chunk at a time (torch's own writer holds a
whole file's tensors until it closes it), so memory stays near a chunk, not a parameter or a file.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ucp.errors import InputError
from ucp.io.torchpickle import pickle_object
from ucp.io.torchzip import write_pickled_at
from ucp.model.pieces import Cast, Pieces
from ucp.model.records import PieceState, Reader

__all__ = ["Fetch", "save_state", "streaming_writer"]

_DISTCP = ".distcp"  # DCP's file suffix


class Fetch:
    """A parameter's state as pieces of the source's files, found when a writer first asks for one of its tensors
    (the last parameter's kept); each tensor is read when asked: whole (:meth:`__call__`, the last one kept, for DCP's
    writer) or in part (:meth:`pieces`, for a rank's rows). Memory stays near one tensor, or one rank's share of one,
    not a parameter's every state. A reader that does not stream is read whole, as before. ``moments=False``: the
    weights alone are asked for (a model file)."""

    def __init__(self, reader: Reader, *, moments: bool = True) -> None:
        self.reader = reader
        self.moments = moments
        self.name: str | None = None
        self.state: PieceState | None = None
        self.last: tuple[str, torch.Tensor] | None = None  # the key last read whole, and its tensor

    def pieces(self, name: str, key: str) -> Pieces:
        """``name``'s ``key`` ("fp32", a state key or a scalar) as pieces in its real shape, without reading it."""
        if self.name != name or self.state is None:
            self.state = self.last = None  # the last parameter's tensors go first
            if self.reader.streams:  # its spans stay valid until the reader closes
                with self.reader.read_pieces(name, moments=self.moments) as state:
                    self.state = state
            else:
                self.state = PieceState.of(self.reader.read(name, moments=self.moments))
            self.name = name
        state = self.state
        if key == "fp32":
            return state.fp32
        found = state.optim.get(key)
        if found is not None:
            return found
        scalar = state.scalars.get(key)
        if scalar is None:
            raise InputError(f"{name}: the checkpoint holds no optimizer state {key!r} for it")
        return Pieces.of(scalar)

    def __call__(self, name: str, key: str) -> torch.Tensor:
        """``name``'s ``key`` as a whole fp32 tensor in its real shape."""
        pieces = self.pieces(name, key)
        if len(pieces.parts) == 1 and isinstance(pieces.parts[0], torch.Tensor) and pieces.dtype == torch.float32:
            return pieces.parts[0].view(pieces.shape)  # a reader that does not stream: its tensor, not a copy
        if self.last is None or self.last[0] != key:
            self.last = None
            self.last = (key, pieces.join(torch.float32))
        return self.last[1]


def save_state(
    state: dict[str, Any],
    lazy: Mapping[str, tuple[str, str]],
    root: Path,
    fetch: Fetch,
    fsync: bool,
) -> None:
    """``state`` saved by DCP's own writer into ``root`` (one file, this process): each meta tensor's data is
    ``fetch(*lazy[key])``, asked for when the writer reaches it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    first: dict[str, int] = {}  # each parameter's place in the plan, so all its tensors are written together
    for name, _ in lazy.values():
        first.setdefault(name, len(first))

    class Planner(DefaultSavePlanner):
        def finish_plan(self, new_plan: Any) -> Any:
            # DCP writes items in plan order: grouped by parameter, each one is read once, not once for
            # the model entry and again for its optimizer state
            def rank(item: Any) -> int:
                where = lazy.get(item.index.fqn)
                return -1 if where is None else first[where[0]]

            return super().finish_plan(dataclasses.replace(new_plan, items=sorted(new_plan.items, key=rank)))

        def resolve_data(self, write_item: Any) -> Any:
            where = lazy.get(write_item.index.fqn)
            if where is None:
                return super().resolve_data(write_item)
            return fetch(*where).detach().contiguous()

    def pieces_of(write_item: Any) -> Pieces | None:
        where = lazy.get(write_item.index.fqn)
        if where is None or any(write_item.tensor_data.chunk.offsets):  # a lazy entry is a whole tensor
            return None
        return fetch.pieces(*where)

    writer = streaming_writer(root, fsync, pieces_of)
    with warnings.catch_warnings():  # no_dist is what we ask for; torch warns about it on every call
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=writer, planner=Planner(), no_dist=True)


def streaming_writer(root: Path, fsync: bool, pieces_of: Callable[[Any], Pieces | Cast | None]) -> Any:
    """DCP's ``FileSystemWriter`` (one ``.distcp`` file, this process), each tensor written as ``torch.save`` writes
    it but streamed from ``pieces_of(write_item)`` a bounded chunk at a time (None, or pieces not of the item's
    sizes and dtype: the planner's tensor). torch's own
    writer keeps every tensor of a file in memory until the file is closed (torch 2.13): a whole checkpoint, here."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.storage import WriteResult

    class Writer(FileSystemWriter):
        def write_data(self, plan: Any, planner: Any) -> torch.futures.Future[list[WriteResult]]:
            name = f"{plan.storage_data.prefix}0{_DISTCP}"
            results: list[WriteResult] = []
            fd = os.open(Path(self.path) / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                offset = 0
                for item in plan.items:
                    length = _write_item(fd, offset, item, planner, pieces_of)
                    results.append(WriteResult(item.index, length, _StorageInfo(name, offset, length)))
                    offset += length
                if fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            done: torch.futures.Future[list[WriteResult]] = torch.futures.Future()
            done.set_result(results)
            return done

    return Writer(root, single_file_per_rank=True, sync_files=fsync, thread_count=1)


def _write_item(fd: int, offset: int, item: Any, planner: Any, pieces_of: Callable[[Any], Pieces | Cast | None]) -> int:
    """One write item at ``offset`` of ``fd``: its bytes, or its tensor as a torch archive; returns its length."""
    from torch.distributed.checkpoint.planner import WriteItemType

    if item.type == WriteItemType.BYTE_IO:
        data = planner.resolve_data(item).getbuffer()
        written = 0
        while written < len(data):
            done = os.pwrite(fd, data[written:], offset + written)
            if done <= 0:
                raise OSError(f"pwrite wrote nothing at byte {offset + written} of a DCP file")
            written += done
        return len(data)
    source = pieces_of(item)
    data = item.tensor_data
    if source is None or tuple(source.shape) != tuple(data.chunk.sizes) or source.dtype != data.properties.dtype:
        tensor = planner.resolve_data(item).detach().contiguous()  # what DCP's own writer would save
        return write_pickled_at(pickle_object(tensor), fd, offset)
    return write_pickled_at(pickle_object(source), fd, offset)
