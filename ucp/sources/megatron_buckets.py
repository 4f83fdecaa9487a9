"""The distributed optimizer's ``dp_reshardable`` state of a Megatron-Core checkpoint, per parameter.

Each model-parallel rank G (TP rank + TP size x PP stage) keeps its state as flat DDP buckets; which parameter lies
where is not recorded, only each bucket's size. :class:`BucketMap` rebuilds the placement as Megatron lays it out
(``ucp.frameworks.megatron.bucket_layout``) from the stage's parameters, their local TP shards and the layer order
of the spec that fills the recorded sizes exactly; a read then checks each master against the model's own weight,
so a wrong placement is refused, never carried.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ucp.errors import CorruptFileError, InputError
from ucp.frameworks.dcp_chunks import DcpChunks
from ucp.frameworks.megatron import (
    BUCKET,
    LAYER_ORDERS,
    Box,
    bucket_key,
    split_layer,
    stage_layers,
    stage_order,
)

__all__ = ["BucketMap", "Placed"]

_DISTRIBUTED = "optimizer.distributed.dp_group_idx_"


@dataclass(frozen=True)
class Placed:
    """One TP rank's shard of a parameter: its boxes in the parameter, its bucket and range in rank G's buffer."""

    group: int
    bucket: int
    start: int
    end: int
    boxes: list[Box]


def _sizes(item: Any, what: str) -> tuple[str, list[int]]:
    """(dtype pair, sizes) of a ``per_bucket_numel*`` item: ``[[{(param dtype, grad dtype): [n, ...]}]]``, one
    DDP buffer."""
    node = item
    while isinstance(node, list) and len(node) == 1:
        node = node[0]
    if not isinstance(node, Mapping) or len(node) != 1:
        raise InputError(f"{what}: ucp reads one DDP buffer per model-parallel rank, the checkpoint has {node!r:.80}")
    ((dtypes, sizes),) = node.items()
    if not isinstance(sizes, list) or not all(isinstance(n, int) for n in sizes):
        raise CorruptFileError(f"{what} is not a list of bucket sizes")
    return str(tuple(dtypes)), sizes


class BucketMap:
    """Where each parameter's state lies in the buckets of every model-parallel rank; see the module docstring."""

    def __init__(
        self,
        chunks: DcpChunks,
        shapes: Mapping[str, tuple[int, ...]],
        local: Mapping[str, list[list[Box]]],
        *,
        tp: int,
        pp: int,
        dp: int,
        layers: int,
    ) -> None:
        self.chunks = chunks
        entries = chunks.entries
        self.states = sorted({m.group(5) for k in entries if (m := BUCKET.match(k))} - {"param"})
        groups = sorted({int(m.group(1)) for k in entries if (m := BUCKET.match(k))})
        if groups != list(range(tp * pp)):
            raise InputError(f"{chunks.path}: optimizer buckets of dp groups {groups}, expected {tp * pp} (tp x pp)")
        self.dtypes = ""
        self.placed: dict[str, list[Placed]] = {}
        self.order = ""
        for group in groups:
            tp_rank, stage = group % tp, group // tp
            dtypes, unpadded = _sizes(
                chunks.item(self._object(group, "per_bucket_numel_unpadded")), f"dp group {group}"
            )
            self.dtypes = dtypes
            names = [n for n in shapes if n in local]
            placed = self._place(group, names, local, unpadded, stage_layers(layers, pp, stage), stage, pp, tp_rank, dp)
            for name, item in placed.items():
                self.placed.setdefault(name, []).append(item)

    def _object(self, group: int, what: str) -> str:
        prefix = f"{_DISTRIBUTED}{group}.{what}/shard_"
        found = [k for k in self.chunks.entries if k.startswith(prefix)]
        if len(found) != 1:
            raise InputError(f"{self.chunks.path}: no single {_DISTRIBUTED}{group}.{what} item")
        return found[0]

    def param_groups(self, group: int = 0) -> list[dict[str, Any]]:
        """The optimizer's param groups as dp group ``group`` saved them (hyperparameters and the step)."""
        item = self.chunks.item(self._object(group, "optimizer"))
        node = item[0] if isinstance(item, list) and len(item) == 1 else item
        groups = node.get("param_groups") if isinstance(node, Mapping) else None
        if not isinstance(groups, list) or not all(isinstance(g, Mapping) for g in groups):
            raise CorruptFileError(f"{self.chunks.path}: dp group {group}'s optimizer item holds no param groups")
        return [dict(g) for g in groups]

    def _place(
        self,
        group: int,
        names: Sequence[str],
        local: Mapping[str, list[list[Box]]],
        unpadded: Sequence[int],
        layers: range,
        stage: int,
        pp: int,
        tp_rank: int,
        dp: int,
    ) -> dict[str, Placed]:
        """The placement of rank ``group``'s parameters by the one layer order that fills its buckets exactly."""
        from ucp.frameworks.megatron import bucket_layout

        known = {sub for order in LAYER_ORDERS.values() for sub in order}
        odd = sorted(
            {split_layer(n)[0] for n in names if split_layer(n)[1] is not None} - {f"decoder.layers.{s}" for s in known}
        )
        if odd:
            raise InputError(f"{self.chunks.path}: layer tensors {odd[:3]} have no known place in Megatron's buffers")
        fits = []
        for spec, order in LAYER_ORDERS.items():
            params = stage_order(names, layers, stage, pp, order)
            sized = [(n, sum(_numel(b[1]) for b in local[n][tp_rank])) for n in params]
            layout = bucket_layout(sized, unpadded, dp)
            if layout is not None and self._cuts_fit(group, layout[0], layout[1], dp):
                fits.append((spec, params, layout[0]))
        if len({tuple(f[1]) for f in fits}) != 1:
            raise InputError(
                f"{self.chunks.path}: the parameters of dp group {group} fill its optimizer buckets "
                f"{list(unpadded)} in {'no' if not fits else 'more than one'} way ucp knows (layer specs: "
                f"{', '.join(LAYER_ORDERS)}); refused rather than guessed"
            )
        self.order = fits[0][0]
        return {n: Placed(group, b, s, e, local[n][tp_rank]) for n, (b, s, e) in fits[0][2].items()}

    def _cuts_fit(self, group: int, place: Mapping[str, tuple[int, int, int]], padded: Sequence[int], dp: int) -> bool:
        """Whether a placement explains where the saved chunks of each bucket begin: Megatron cuts a DP rank's share
        at the parameters' edges (and the padding between them), so every chunk starts at a parameter's start or
        end, or at a DP rank's share."""
        for bucket, size in enumerate(padded):
            edges = {0, *(r * size // dp for r in range(dp))}
            edges |= {e for b, s, e in place.values() if b == bucket} | {s for b, s, e in place.values() if b == bucket}
            meta = self.chunks.entries.get(bucket_key(group, 0, self.dtypes, bucket, "param"))
            if meta is None or any(chunk.offsets[0] not in edges for chunk in meta.chunks):
                return False
        return True

    def read(self, name: str, shape: tuple[int, ...], state: str) -> torch.Tensor:
        """State ``state`` (``param``: the fp32 master) of parameter ``name``, put together from every TP rank's
        shard."""
        out = torch.empty(shape, dtype=torch.float32)
        done: set[tuple[Box, ...]] = set()
        for placed in self.placed[name]:
            if tuple(placed.boxes) in done:  # replicated over TP: every rank keeps the same copy
                continue
            done.add(tuple(placed.boxes))
            key = bucket_key(placed.group, 0, self.dtypes, placed.bucket, state)
            flat = self.chunks.region(key, (placed.start,), (placed.end - placed.start,))
            at = 0
            for offsets, sizes in placed.boxes:
                n = _numel(sizes)
                out[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))] = flat[at : at + n].view(sizes)
                at += n
        return out


def _numel(sizes: Sequence[int]) -> int:
    n = 1
    for d in sizes:
        n *= d
    return n
