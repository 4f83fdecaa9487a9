"""Tensor-parallel layouts: how one parameter's full tensor is laid across TP ranks. Pure, no I/O.

Two descriptions meet here. A :class:`TpRule` says what kind of parameter it is (replicated,
averaged, or split along a dim, possibly as several fused sub-parameters, possibly with padded
vocabulary rows), independent of the TP degree: it is what the universal manifest keeps, so a
checkpoint can be cut again for any degree. A :class:`RankLayout` says, for one degree and one
rank, exactly which blocks of the full tensor the rank's shard holds (DeepSpeed's "affine map"
pieces: offset + strides on both sides). Merging and splitting both run on rank layouts, so one
pair of functions (:func:`gather`, :func:`scatter`) serves every kind.

DeepSpeed's ``universal_checkpoint_info`` (written by AutoTP and Megatron-DeepSpeed) is parsed by
:func:`rules_from_info`: its pattern lists become rules, its affine map (when present) exact layouts.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "TpRule",
    "Piece",
    "RankLayout",
    "shard_widths",
    "rank_layout",
    "layouts_for",
    "gather",
    "scatter",
    "rules_from_info",
    "affine_layouts",
    "full_shape",
    "TpInfoError",
    "REPLICATED",
]

KINDS = ("replicated", "average", "split")


class TpInfoError(ValueError):
    """The tensor-parallel description is inconsistent with the tensors it describes."""


@dataclass(frozen=True)
class TpRule:
    """What a parameter is under tensor parallelism, for any TP degree.

    ``split``: the tensor is cut along ``dim``. ``parts`` lists the full sizes of fused
    sub-parameters along ``dim`` (gate/up, q/k/v): each part is cut separately and a rank holds its
    piece of every part, in order. ``vocab``: dim 0 holds this many real rows; the rest up to
    ``padded`` is padding that the universal tensor drops and a TP layout puts back (zeros).
    """

    kind: str = "replicated"
    dim: int = 0
    parts: tuple[int, ...] = ()
    vocab: int | None = None
    padded: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise TpInfoError(f"unknown tensor-parallel kind {self.kind!r}; one of {', '.join(KINDS)}")

    @property
    def split(self) -> bool:
        return self.kind == "split"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind}
        if self.split:
            out["dim"] = self.dim
            if self.parts:
                out["parts"] = list(self.parts)
            if self.vocab is not None:
                out.update(vocab=self.vocab, padded=self.padded)
        return out

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> TpRule:
        try:
            return cls(
                kind=str(raw.get("kind", "split")),
                dim=int(raw.get("dim", 0)),
                parts=tuple(int(p) for p in raw.get("parts") or ()),
                vocab=None if raw.get("vocab") is None else int(raw["vocab"]),
                padded=None if raw.get("padded") is None else int(raw["padded"]),
            )
        except (TypeError, ValueError, AttributeError) as err:
            raise TpInfoError(f"bad tensor-parallel rule {dict(raw)!r}: {err}") from None


REPLICATED = TpRule()


@dataclass(frozen=True)
class Piece:
    """One block: ``shape`` elements read at (offset, strides) in one tensor, written in the other."""

    shape: tuple[int, ...]
    full_offset: int
    full_strides: tuple[int, ...]
    shard_offset: int
    shard_strides: tuple[int, ...]


@dataclass(frozen=True)
class RankLayout:
    """Which blocks of the full tensor one TP rank's shard holds."""

    shard_shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    replicated: bool = False  # every rank holds the whole tensor
    average: bool = False  # ... and the full value is the mean of the ranks' copies


def shard_widths(size: int, tp: int) -> list[int]:
    """Near-even split, the first ``size % tp`` ranks one larger (DeepSpeed AutoTP's default, and
    Megatron's even split whenever it divides)."""
    return [size // tp + (1 if r < size % tp else 0) for r in range(tp)]


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return tuple(reversed(strides))


def _split_shape(rule: TpRule, full_shape: Sequence[int]) -> list[int]:
    """The full shape as the TP ranks see it: vocab rows padded back to ``padded``."""
    shape = list(full_shape)
    if rule.vocab is not None:
        if rule.dim != 0 or shape[0] != rule.vocab:
            raise TpInfoError(f"vocab rule expects {rule.vocab} rows on dim 0, the tensor has shape {tuple(shape)}")
        shape[0] = rule.padded if rule.padded is not None else rule.vocab
    return shape


def rank_layout(rule: TpRule, full_shape: Sequence[int], tp: int, rank: int) -> RankLayout:
    """The blocks TP ``rank`` of ``tp`` holds of a parameter whose full (unpadded) shape is ``full_shape``."""
    full_shape = tuple(int(d) for d in full_shape)
    if not rule.split or tp == 1:
        whole = Piece(full_shape, 0, _contiguous_strides(full_shape), 0, _contiguous_strides(full_shape))
        return RankLayout(full_shape, (whole,), replicated=True, average=rule.kind == "average")
    shape = _split_shape(rule, full_shape)
    dim = rule.dim if rule.dim >= 0 else rule.dim + len(shape)
    if not 0 <= dim < len(shape):
        raise TpInfoError(f"split dim {rule.dim} is out of range for shape {tuple(full_shape)}")
    parts = rule.parts or (shape[dim],)
    if sum(parts) != shape[dim]:
        raise TpInfoError(
            f"sub-parameter sizes {list(parts)} do not add up to {shape[dim]} (dim {dim} of {tuple(full_shape)})"
        )
    full_strides = _contiguous_strides(full_shape)
    widths = [shard_widths(p, tp) for p in parts]
    shard_shape = list(shape)
    shard_shape[dim] = sum(w[rank] for w in widths)
    shard_strides = _contiguous_strides(shard_shape)
    pieces = []
    part_start, shard_at = 0, 0
    for size, w in zip(parts, widths):
        start = part_start + sum(w[:rank])
        block = list(shape)
        block[dim] = w[rank]
        if rule.vocab is not None:  # padding rows exist only in the shard; the full tensor has vocab rows
            block[dim] = max(0, min(w[rank], rule.vocab - start))
        if block[dim] > 0:
            pieces.append(
                Piece(
                    tuple(block), start * full_strides[dim], full_strides, shard_at * shard_strides[dim], shard_strides
                )
            )
        part_start += size
        shard_at += w[rank]
    return RankLayout(tuple(shard_shape), tuple(pieces))


def layouts_for(rule: TpRule, full_shape: Sequence[int], tp: int) -> list[RankLayout]:
    return [rank_layout(rule, full_shape, tp, r) for r in range(tp)]


def gather(shards: Sequence[torch.Tensor], layouts: Sequence[RankLayout], full_shape: Sequence[int]) -> torch.Tensor:
    """The full tensor from every TP rank's shard (merge). Replicated: rank 0's copy; averaged: the mean."""
    if len(shards) != len(layouts):
        raise TpInfoError(f"{len(shards)} shards for {len(layouts)} rank layouts")
    for r, (shard, layout) in enumerate(zip(shards, layouts)):
        if tuple(shard.shape) != tuple(layout.shard_shape):
            raise TpInfoError(
                f"TP rank {r} holds shape {tuple(shard.shape)}, its layout says {tuple(layout.shard_shape)}"
            )
    if layouts[0].average:
        total = shards[0].clone()
        for shard in shards[1:]:
            total += shard
        return total / len(shards)
    if layouts[0].replicated:
        return shards[0].contiguous().clone()
    full = torch.empty(tuple(full_shape), dtype=shards[0].dtype)
    flat = full.reshape(-1)
    covered = 0
    for shard, layout in zip(shards, layouts):
        src = shard.contiguous().reshape(-1)
        for p in layout.pieces:
            flat.as_strided(p.shape, p.full_strides, p.full_offset).copy_(
                src.as_strided(p.shape, p.shard_strides, p.shard_offset)
            )
            covered += math.prod(p.shape)
    if covered != full.numel():
        raise TpInfoError(f"the rank layouts cover {covered} of {full.numel()} elements of shape {tuple(full_shape)}")
    return full


def scatter(full: torch.Tensor, layout: RankLayout) -> torch.Tensor:
    """One TP rank's shard of ``full`` (split). Padding rows come out as zeros."""
    if layout.replicated:
        return full.contiguous().clone()
    shard = torch.zeros(layout.shard_shape, dtype=full.dtype)
    flat, src = shard.reshape(-1), full.contiguous().reshape(-1)
    for p in layout.pieces:
        flat.as_strided(p.shape, p.shard_strides, p.shard_offset).copy_(
            src.as_strided(p.shape, p.full_strides, p.full_offset)
        )
    return shard


# -- DeepSpeed's universal_checkpoint_info ----------------------------------------------------
def _match(patterns: Iterable[str], name: str) -> str | None:
    for pattern in patterns:
        if re.match(pattern, name):
            return pattern
    return None


def full_shape(rule: TpRule, rank_shapes: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """The full (unpadded) shape of a parameter from its TP ranks' shard shapes."""
    shape = list(rank_shapes[0])
    if rule.split and len(rank_shapes) > 1:
        dim = rule.dim if rule.dim >= 0 else rule.dim + len(shape)
        shape[dim] = sum(int(s[dim]) for s in rank_shapes)
    if rule.vocab is not None:
        shape[0] = rule.vocab
    return tuple(int(d) for d in shape)


def rules_from_info(info: Mapping[str, Any], rank_shapes: Mapping[str, Sequence[Sequence[int]]]) -> dict[str, TpRule]:
    """Rules from DeepSpeed's ``universal_checkpoint_info`` pattern lists (versions up to 0.4).

    ``rank_shapes`` maps each parameter to its shard shape on every TP rank; they fill in what the
    patterns leave out (the full size of a split dim, of the padded vocabulary, of equal
    sub-parameters). A parameter no pattern names is split on dim 0, as DeepSpeed's converter does.
    """
    replicated = list(info.get("tp_replicated_parameter_patterns") or [])
    average = list(info.get("parameter_to_average_patterns") or [])
    row = list(info.get("parameter_with_row_parallelism_patterns") or [])
    vocab = list(info.get("vocabulary_parameter_patterns") or [])
    two_subs = list(info.get("parameter_with_2_sub_params_cat_dim_0") or [])
    sub_params = list(info.get("parameter_with_sub_params") or [])
    widths = dict(info.get("sub_param_shard_widths") or {})
    rules: dict[str, TpRule] = {}
    for name, shapes in rank_shapes.items():

        def total(dim: int, shapes: Sequence[Sequence[int]] = shapes) -> int:
            return sum(int(s[dim]) for s in shapes)

        if _match(replicated, name):
            rules[name] = REPLICATED
        elif _match(average, name):
            rules[name] = TpRule("average")
        elif (
            sub := next(((s, p) for s in sub_params for p in (s.get("patterns") or []) if re.match(p, name)), None)
        ) is not None:
            spec, pattern = sub
            dim = int(spec.get("partition_dim", 0))
            dims = list(spec.get("shape") or [])
            at = dims[dim] if dim < len(dims) else None
            if pattern in widths:
                parts = tuple(sum(int(w) for w in ws) for ws in widths[pattern])
            elif isinstance(at, (list, tuple)):
                parts = tuple(int(p) for p in at)
            elif isinstance(at, int) and at > 0 and total(dim) % at == 0:
                parts = (total(dim) // at,) * at
            else:
                raise TpInfoError(f"{name}: sub-parameter shape {dims!r} gives no sizes at partition_dim {dim}")
            rules[name] = TpRule("split", dim=dim, parts=parts)
        elif _match(two_subs, name):
            rules[name] = TpRule("split", dim=0, parts=(total(0) // 2,) * 2)
        elif _match(vocab, name):
            original = info.get("original_vocab_size")
            if original is None:
                raise TpInfoError(
                    f"{name} is a vocabulary parameter but universal_checkpoint_info has no original_vocab_size"
                )
            rules[name] = TpRule("split", dim=0, vocab=int(original), padded=total(0))
        else:
            rules[name] = TpRule("split", dim=1 if _match(row, name) else 0)
    return rules


def affine_layouts(info: Mapping[str, Any], name: str, tp: int) -> tuple[tuple[int, ...], list[RankLayout]] | None:
    """(full shape, per-rank layouts) from the affine map of ``universal_checkpoint_info``, if it names ``name``."""
    amap = info.get("affine_map") or {}
    version = amap.get("version", 1)
    if not isinstance(version, int) or version > 1:
        raise TpInfoError(f"universal_checkpoint_info has affine map version {version!r}; ucp reads version 1")
    params = amap.get("params") or {}
    found = [p for p in params if re.match(p, name)]
    if not found:
        return None
    if len(found) > 1:
        raise TpInfoError(f"{name} matches {len(found)} affine-map patterns: {found[:3]}")
    entry = params[found[0]]
    try:
        full_shape = tuple(int(d) for d in entry["logical_shape"])
        ranks = {int(r): v for r, v in entry["ranks"].items()}
        layouts = []
        for r in range(tp):
            raw = ranks[r]
            pieces = []
            for p in raw["pieces"]:
                if float(p.get("scale", 1.0)) != 1.0:
                    raise TpInfoError(
                        f"{name}: a scaled affine piece (scale {p['scale']}); ucp converts unscaled layouts only"
                    )
                (src_off, src_strides), (dst_off, dst_strides) = p["source"], p["dest"]
                pieces.append(
                    Piece(
                        tuple(int(d) for d in p["shape"]),
                        int(src_off),
                        tuple(map(int, src_strides)),
                        int(dst_off),
                        tuple(map(int, dst_strides)),
                    )
                )
            everywhere = all(len(p.get("locations") or ()) == tp for p in raw["pieces"])
            layouts.append(
                RankLayout(
                    tuple(int(d) for d in raw["shard_shape"]),
                    tuple(pieces),
                    replicated=everywhere and tuple(raw["shard_shape"]) == full_shape,
                )
            )
    except (KeyError, TypeError, ValueError) as err:
        raise TpInfoError(f"{name}: malformed affine map entry ({type(err).__name__}: {err})") from None
    return full_shape, layouts
