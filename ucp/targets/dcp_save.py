"""Writing a planned state dict with DCP's own writer, each tensor read when the writer reaches it: the DCP target's
folders, and a Trainer or Accelerate FSDP folder's two (``ucp.targets.hf_fsdp``).

:class:`Fetch` reads a parameter once for all the tensors the writer asks of it in a row; :func:`save_state` hands
DCP a state dict of meta tensors and resolves each one through it, grouped by parameter, so memory stays near one
parameter.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ucp.errors import InputError
from ucp.model.pieces import Pieces
from ucp.model.records import PieceState, Reader

__all__ = ["Fetch", "save_state"]


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
        if self.last is None or self.last[0] != key:
            self.last = None
            self.last = (key, pieces.join(torch.float32))
        return self.last[1]


def save_state(
    state: dict[str, Any],
    lazy: Mapping[str, tuple[str, str]],
    root: Path,
    fetch: Callable[[str, str], torch.Tensor],
    fsync: bool,
) -> None:
    """``state`` saved by DCP's own writer into ``root`` (one file, this process): each meta tensor's data is
    ``fetch(*lazy[key])``, asked for when the writer reaches it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
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

    writer = FileSystemWriter(root, single_file_per_rank=True, sync_files=fsync, thread_count=1)
    with warnings.catch_warnings():  # no_dist is what we ask for; torch warns about it on every call
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=writer, planner=Planner(), no_dist=True)
