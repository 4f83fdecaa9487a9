"""What the ZeRO readers share beyond DeepSpeed's fields: rank slices as pieces, param-group records."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import torch

from ucp.model.hyper import hyper_from_group, raw_group
from ucp.model.partition import zero3_rank_span
from ucp.model.pieces import FileSpan, Pieces
from ucp.model.records import GroupMeta

__all__ = ["zero3_slices", "zero3_pieces", "file_pieces", "zero3_gather", "group_meta", "SpanSource"]


def zero3_slices(fragment_of: Callable[[int], torch.Tensor], numel: int, dp: int) -> list[torch.Tensor]:
    """A parameter's ZeRO-3 rank slices, without copying them (views on the fragments).

    ``fragment_of(rank)`` is asked only for ranks that hold part of the parameter, and must give at
    least that many elements (the rest is padding, left out). Those ranks are always 0..k-1 (the
    ceil split leaves only trailing ranks empty), so slice r is rank r's.
    """
    slices = []
    for rank in range(dp):
        start, end = zero3_rank_span(numel, dp, rank)
        if end > start:
            slices.append(fragment_of(rank).detach().reshape(-1)[: end - start])
    return slices


def zero3_pieces(fragment_of: Callable[[int], torch.Tensor], numel: int, shape: tuple[int, ...], dp: int) -> Pieces:
    """A parameter as its ZeRO-3 rank slices (:func:`zero3_slices`) in one :class:`Pieces`."""
    parts = zero3_slices(fragment_of, numel, dp)
    return Pieces(tuple(parts), shape, parts[0].dtype if parts else torch.float32)


class SpanSource(Protocol):
    """A file whose tensors are views on it: :class:`TorchFile`, or a raw swap file (``ucp.io.rawfile``)."""

    def span(self, tensor: torch.Tensor) -> FileSpan | None: ...


def file_pieces(parts: Iterable[tuple[SpanSource, torch.Tensor]], shape: tuple[int, ...]) -> Pieces:
    """A parameter's flat state from slices of its shards, in order, as fp32 :class:`Pieces`.

    When every slice lies in its file, the pieces are byte spans of the files (the universal writer
    streams them from disk; nothing is mapped or copied); otherwise the slices themselves. The
    universal format is fp32: a low-precision state is converted, at the cost of one copy.
    """
    parts = list(parts)
    tensors = tuple(t for _, t in parts)
    dtype = tensors[0].dtype if tensors else torch.float32
    spans = [tf.span(t) for tf, t in parts]
    pieces = Pieces(tuple(spans) if spans and all(spans) else tensors, tuple(shape), dtype)  # type: ignore[arg-type]
    return pieces if dtype == torch.float32 else Pieces.of(pieces.join(torch.float32))


def zero3_gather(
    fragment_of: Callable[[int], torch.Tensor], numel: int, shape: tuple[int, ...], dp: int
) -> torch.Tensor:
    """A parameter from its ZeRO-3 partitions, as fp32 in its real shape (see :func:`zero3_pieces`)."""
    return zero3_pieces(fragment_of, numel, shape, dp).join(torch.float32)


def group_meta(
    index: int,
    group: Mapping[str, Any],
    names: list[str],
    step: int | None,
    adam_w_mode: bool | None,
    state_keys: tuple[str, ...] = (),
) -> GroupMeta:
    """A DeepSpeed param group as the pipeline's record: neutral hyperparameters plus its own keys."""
    return GroupMeta(
        index=index,
        hyper=hyper_from_group(group, adam_w_mode),
        raw=raw_group(group),
        params=names,
        step=step,
        state_keys=state_keys,
    )
