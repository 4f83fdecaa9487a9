"""Where FSDP puts each element, as numbers: Shard(0) rows per rank, and FSDP1's flat parameters.

FSDP2's ``DTensor``\\ s (and FSDP1's sharded state dict) split a tensor along dim 0 as ``torch.chunk`` does, a rank
past the last chunk holding no rows. FSDP1 with ``use_orig_params=False`` keeps one flat parameter per FSDP unit:
the unit's parameters flattened and concatenated in module order (torch ``fsdp/_flat_param.py``; no alignment padding
without ``use_orig_params``), padded with zeros to a multiple of the world size, rank ``r`` holding the ``r``-th of
``world`` equal parts; its optimizer state is laid out the same way. Pure: numbers in, numbers out.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

__all__ = ["row_bounds", "flat_chunk", "flat_offsets", "rank_pieces", "unit_of", "units_in_order"]

#: a decoder layer's module path: what verl's default wrap policy (the model's ``_no_split_modules``) makes an FSDP
#: unit in the Hugging Face models it trains (``model.layers.3``, ``transformer.h.3``, ``model.visual.blocks.3``)
_LAYER = re.compile(r"^(.*?(?:^|\.)(?:layers|layer|h|blocks)\.\d+)\.")


def row_bounds(rows: int, world: int) -> list[tuple[int, int]]:
    """Each rank's [start, end) rows of a Shard(0) split of ``rows`` over ``world`` ranks (``torch.chunk``'s sizes;
    ranks past the last chunk hold none)."""
    chunk = -(-rows // world) if rows else 0
    return [(min(r * chunk, rows), min((r + 1) * chunk, rows)) for r in range(world)]


def flat_chunk(total: int, world: int) -> int:
    """The elements each rank holds of a flat parameter of ``total`` elements (padded to a multiple of ``world``)."""
    return math.ceil(total / world)


def flat_offsets(numels: Sequence[int]) -> tuple[list[int], int]:
    """Each parameter's start in its unit's unpadded flat parameter, and the flat parameter's length."""
    starts, total = [], 0
    for n in numels:
        starts.append(total)
        total += n
    return starts, total


def rank_pieces(start: int, numel: int, chunk: int) -> list[tuple[int, int, int, int]]:
    """The pieces of elements [start, start + numel) of a flat parameter split in ``chunk``-sized rank shards:
    (rank, offset in that rank's shard, offset in the parameter, length)."""
    out = []
    pos, end = start, start + numel
    while pos < end:
        rank, inner = divmod(pos, chunk)
        length = min(chunk - inner, end - pos)
        out.append((rank, inner, pos - start, length))
        pos += length
    return out


def unit_of(name: str) -> str:
    """The FSDP unit a parameter belongs to under verl's default wrap policy: its decoder layer's path, or ``""``
    (the root unit) for every parameter outside a layer."""
    match = _LAYER.match(name)
    return match.group(1) if match else ""


def units_in_order(names: Sequence[str]) -> list[tuple[str, list[str]]]:
    """FSDP1's flat parameters in ``model.parameters()`` order: the root unit's first (when it holds any), then each
    layer's in module order, each with its parameters in module order."""
    units: dict[str, list[str]] = {"": []}
    for name in names:
        units.setdefault(unit_of(name), []).append(name)
    return [(prefix, members) for prefix, members in units.items() if members]
