"""Each rank's flat tensors as pieces of the source's own spans, for the streaming native writers.

A reader that streams (``Reader.streams``) hands out every parameter's state as spans of its
files, valid until it closes. :func:`locate` takes them all once (checking each against its flat
group, settling steps and scalars, and verifying the files as the reader does); :func:`flat_pieces`
then lays one rank's flat tensor out of slices of those spans and zeros for the padding. The
torch-zip writer copies the bytes straight from the source files into the rank file, so memory holds
spans and metadata, never a rank's share of the data.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ucp.io.pool import parallel_map, typical_state_bytes
from ucp.io.span_copy import Copied
from ucp.io.torchpickle import tensor_bytes
from ucp.model.cast import check_fits_pieces
from ucp.model.pieces import Cast, FileSpan, LazyTensor, Part, PathSpan, Pieces
from ucp.model.records import PieceState, Reader, ReaderView
from ucp.targets.blocks.common import check_state, merge_scalars

__all__ = [
    "Located",
    "Held",
    "locate",
    "flat_pieces",
    "copied_parts",
    "module_weight",
    "read_weight",
    "refuse_fp16_overflow",
]

#: a module weight as a writer takes it: the fp32 spans themselves, or a cast made when the file reaches it
Weight = torch.Tensor | Pieces | LazyTensor | Cast


@dataclass
class Located:
    """Every member's state as pieces, and what each flat group's members agree on."""

    states: dict[str, PieceState]
    steps: list[set[int]]  # per flat group: the steps its members carry (settled by the caller)
    scalars: list[dict[str, torch.Tensor]]  # per flat group: the optimizer's 0-dim scalars


def locate(
    reader: Reader,
    members: Sequence[Sequence[tuple[str, int]]],
    keys: Sequence[Sequence[str]],
    *,
    moments: bool,
    workers: int,
    step_of: Callable[[PieceState], int],
    unit: str,
    keep: int | None = None,
) -> Located:
    """Take every member's pieces: ``members[f]`` lists flat group f's ``(name, numel)``, ``keys[f]``
    its state keys; ``unit`` names a flat group in messages (``"ZeRO-3 sub-group"``). ``keep``: keep the pieces of
    members cut in several parts (the spans of a source saved at a large DP, work to find again) while they hold at
    most this many parts in all, and no member whose every state is one part (a universal file: found again with a
    stat); a writer reads the others again in their turn, so memory is bounded whatever the count of parameters and
    ranks. None keeps every member's."""
    if not reader.streams:
        raise TypeError("locate needs a reader whose pieces stay valid until it closes (Reader.streams)")
    where = {name: (f, numel) for f, group in enumerate(members) for name, numel in group}
    located = Located({}, [set() for _ in members], [{} for _ in members])
    budget = [keep]  # parts still to keep, None: no limit

    def one(name: str) -> None:
        f, numel = where[name]
        with reader.read_pieces(name, moments=moments) as state:
            check_state(name, state, keys[f], numel, moments=moments)
            if budget[0] is None:
                located.states[name] = state
            else:
                parts = len(state.fp32.parts) + sum(len(p.parts) for p in state.optim.values())
                with lock:
                    if 1 + len(state.optim) < parts <= budget[0]:
                        budget[0] -= parts
                        located.states[name] = state
            located.steps[f].add(step_of(state))
            if moments:
                merge_scalars(name, state, located.scalars[f], unit)

    lock = threading.Lock()
    grain = typical_state_bytes(reader.facts, moments=moments)  # checking a parameter is Python work
    for _ in parallel_map(one, list(where), workers, desc="check", grain=grain):
        pass
    return located


def flat_pieces(size: int, placed: Iterable[tuple[int, Pieces]]) -> Pieces:
    """A flat fp32 tensor of ``size`` elements: each ``(offset, pieces)`` at its offset, zeros in
    every gap and after the last (the padding DeepSpeed keeps zero)."""
    parts: list[Part] = []
    pos = 0
    for offset, pieces in sorted(placed, key=lambda item: item[0]):
        if offset < pos or pieces.dtype != torch.float32:
            raise ValueError(f"flat pieces overlap at element {offset} or are not float32")
        if offset > pos:
            parts.append(torch.zeros(offset - pos, dtype=torch.float32))
        parts.extend(pieces.parts)
        pos = offset + pieces.numel
    if pos > size:
        raise ValueError(f"flat pieces reach element {pos}, past the tensor's {size}")
    if size > pos:
        parts.append(torch.zeros(size - pos, dtype=torch.float32))
    return Pieces(tuple(parts), (size,), torch.float32)


def copied_parts(pieces: Pieces) -> list[Copied]:
    """Pieces as a copy into a file takes them: spans as they are, tensors as their bytes."""
    return [p if isinstance(p, (FileSpan, PathSpan)) else tensor_bytes(p) for p in pieces.parts]


class Held(ReaderView):
    """A reader that does not stream, offered as one that does: each state is read whole when asked,
    so a writer that lays files out of spans takes it too (memory then holds what it keeps)."""

    def __init__(self, inner: Reader) -> None:
        super().__init__(inner, inner.facts)
        self.streams = True

    @contextmanager
    def read_pieces(self, name: str, *, moments: bool = True) -> Iterator[PieceState]:
        yield PieceState.of(self.inner.read(name, moments=moments))


def module_weight(state: PieceState, lp: torch.dtype) -> Weight:
    """A module weight from its fp32 master: the spans themselves in fp32, else cast chunk by chunk as the file
    is written (memory holds a buffer, not the weight)."""
    master = state.fp32
    if lp == torch.float32:
        return master
    return Cast(master, lp)


def read_weight(reader: Reader, name: str, lp: torch.dtype) -> Weight:
    """A parameter no flat group holds (a frozen one), in the run's dtype: read when the file reaches it."""
    shape = tuple(reader.facts.param(name).shape)
    if not reader.streams:
        return reader.read(name, moments=False).fp32.to(lp)
    return LazyTensor(shape, lp, lambda: reader.read(name, moments=False).fp32.to(lp).reshape(shape))


def refuse_fp16_overflow(reader: Reader, names: Iterable[str]) -> None:
    """Before an fp16 run's files are written or a live fp16 model takes anything: refuse a weight fp16 would
    turn to inf (``ucp.model.cast``). One read of those masters, a chunk at a time; none for an fp16 source,
    whose weights fit."""
    if reader.facts.info.dtype == "fp16":
        return
    for name in names:
        with reader.read_pieces(name, moments=False) as state:
            check_fits_pieces(name, state.fp32, torch.float16)
