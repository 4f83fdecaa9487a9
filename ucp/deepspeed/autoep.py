"""DeepSpeed AutoEP's checkpoint layout (0.19.8 ``expert_parallel`` config, ``AutoEPMoELayer``), ZeRO-1/2 and 3.

What a save at world size W with ``autoep_size`` E holds, as verified on real CPU/gloo runs
(tests/test_autoep.py; docs/format.md section 8):

- ``mp_rank_00_model_states.pt`` (rank 0): ``module`` without the experts' ``{module}.experts.w1/w2/w3``;
  ``param_shapes`` as rank 0 holds them, so an expert group lists the *local* fused tensors
  ``{module}.experts.w{1,2,3}`` of shape ``[L, ...]`` (L = experts / E); ``num_experts``: one count per MoE
  layer; ``ds_autoep_layers``: one entry per AutoEP layer (:class:`AutoEpLayer` reads it), rank 0's view,
  with the expert placement of every expert-parallel rank and the affine shard maps.
- ``layer_{l}_expert_{e}_mp_rank_00_model_states.pt``: expert ``e`` (global) of AutoEP layer ``l``, the
  fused tensors' slices ``{module}.experts.w{1,2,3}.{e}`` in the model dtype (written by the ranks of
  expert-data-parallel rank 0).
- ``zero_pp_rank_{r}_mp_rank_00_optim_states.pt``: as the legacy MoE layout (:mod:`ucp.deepspeed.moe`): dense
  groups over all W ranks; an expert group (``moe: True``, ``name: "ep_size_E"``) holds the rank's local fused
  tensors, partitioned over its expert-data-parallel ranks ``e, e+E, ...``.

At ZeRO-3 there are no expert files: every rank r writes ``zero_pp_rank_{r}_mp_rank_00_model_states.pt`` with
its own view of ``ds_autoep_layers`` (``checkpoint_format: "zero3_partitioned"``, its ``ep_rank`` and
``expert_data_parallel_rank``) and its optim file adds ``ds_zero_partition_groups``: per sub-group the ranks it
is partitioned over. Dense sub-groups span all W ranks; an expert sub-group holds the rank's local fused tensors,
each parameter partitioned on its own (``ceil(numel / (W/E))``) over its expert-data-parallel ranks.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ucp.errors import InputError

__all__ = [
    "AUTOEP_LAYERS",
    "autoep_record",
    "PARTITION_GROUPS",
    "partition_group_entry",
    "zero3_rank_entry",
    "Partition",
    "WEIGHTS",
    "AutoEpLayer",
    "autoep_entry",
    "autoep_layers",
    "expert_name",
    "expert_parts",
    "partition_of",
    "rank_view",
    "universal_info",
]

#: the model-states key listing the AutoEP layers (None when the run has none)
AUTOEP_LAYERS = "ds_autoep_layers"
#: the ZeRO-3 optim-states key (inside ``optimizer_state_dict``) naming each sub-group's partition group
PARTITION_GROUPS = "ds_zero_partition_groups"
#: ``checkpoint_format`` of each ``ds_autoep_layers`` entry, by whether the save is ZeRO-3
_FORMATS = {False: "per_expert_files", True: "zero3_partitioned"}
#: the fused expert tensors of every AutoEP layer, in the order DeepSpeed saves them
WEIGHTS = ("w1", "w2", "w3")
_EXPERT = re.compile(r"^(.*)\.(w[123])\.(\d+)$")


def expert_name(prefix: str, weight: str, expert: int) -> str:
    """The universal (and DeepSpeed expert-file) name of global expert ``expert``'s slice of a fused weight:
    ``{module}.experts.w1.{e}``."""
    return f"{prefix}.{weight}.{expert}"


def expert_parts(name: str) -> tuple[str, str, int] | None:
    """(expert key prefix, weight, global expert) of an expert slice's name, else None."""
    m = _EXPERT.match(name)
    return None if m is None else (m.group(1), m.group(2), int(m.group(3)))


@dataclass(frozen=True)
class AutoEpLayer:
    """One AutoEP layer as ``ds_autoep_layers`` records it."""

    layer: int  # moe_layer_id: the expert files' ``layer_{l}``
    module: str  # module_path
    prefix: str  # expert_key_prefix: ``{module}.experts``
    experts: int
    ep_size: int
    placement: tuple[tuple[int, ...], ...]  # per expert-parallel rank, its global experts in local order
    shapes: dict[str, tuple[int, ...]]  # fused weight -> logical shape [experts, ...]

    @property
    def local(self) -> int:
        return self.experts // self.ep_size

    def fused(self, weight: str) -> str:
        """The fused tensor's name, as the model and the optim files name it (local experts only)."""
        return f"{self.prefix}.{weight}"


def _int(entry: Mapping[str, Any], key: str, where: str) -> int:
    value = entry.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InputError(f"{where}: {key}={value!r}, expected a non-negative integer")
    return value


def _placement(entry: Mapping[str, Any], experts: int, ep_size: int, where: str) -> tuple[tuple[int, ...], ...]:
    raw = entry.get("expert_placement")
    ranks = raw.get("ranks") if isinstance(raw, Mapping) else None
    if not isinstance(ranks, list) or len(ranks) != ep_size:
        raise InputError(f"{where}: expert_placement should list {ep_size} expert-parallel ranks")
    by_rank = {r.get("rank"): r.get("experts") for r in ranks if isinstance(r, Mapping)}
    local = experts // ep_size
    # 0.19.8 names each expert file expp_rank * L + j, so only the contiguous placement it synthesizes is
    # consistent with those files (legacy_uniform_autoep_placement_descriptor)
    for rank in range(ep_size):
        if by_rank.get(rank) != list(range(rank * local, (rank + 1) * local)):
            raise InputError(
                f"{where}: expert-parallel rank {rank} holds experts {by_rank.get(rank)!r}; ucp reads the contiguous "
                "placement DeepSpeed 0.19.8 writes"
            )
    return tuple(tuple(range(rank * local, (rank + 1) * local)) for rank in range(ep_size))


def _shapes(
    entry: Mapping[str, Any], prefix: str, experts: int, ep_size: int, where: str
) -> dict[str, tuple[int, ...]]:
    """Each fused weight's logical shape, from the affine maps, which must give every rank its whole experts
    (an expert-tensor-parallel run cuts them further; not read yet)."""
    maps = entry.get("affine_maps")
    params = maps.get("params") if isinstance(maps, Mapping) else None
    if not isinstance(params, Mapping):
        raise InputError(f"{where}: affine_maps.params is missing")
    out: dict[str, tuple[int, ...]] = {}
    for weight in WEIGHTS:
        amap = params.get(f"{prefix}.{weight}")
        amap = amap if isinstance(amap, Mapping) else {}
        shape = amap.get("logical_shape")
        if not isinstance(shape, list) or not shape or shape[0] != experts:
            raise InputError(f"{where}: no affine map with a [{experts}, ...] logical shape for {prefix}.{weight}")
        local = [experts // ep_size, *shape[1:]]
        ranks = amap.get("ranks")
        if not isinstance(ranks, Mapping) or any(
            not isinstance(r, Mapping) or r.get("shard_shape") != local for r in ranks.values()
        ):
            raise InputError(
                f"{where}: {prefix}.{weight} is cut finer than whole experts per rank (expert tensor parallelism); "
                "ucp reads AutoEP runs with expert_tensor_parallel_size=1"
            )
        out[weight] = tuple(int(d) for d in shape)
    return out


def autoep_layers(model_states: Mapping[str, Any], where: str, *, zero3: bool = False) -> list[AutoEpLayer] | None:
    """The AutoEP layers a model-states file records, in ``moe_layer_id`` order; None when it has none.
    ``zero3``: the save is ZeRO-3, whose layers say ``zero3_partitioned`` (ZeRO-1/2's ``per_expert_files``)."""
    raw = model_states.get(AUTOEP_LAYERS)
    if raw is None:
        return None
    if not isinstance(raw, list) or not raw:
        raise InputError(f"{where}: {AUTOEP_LAYERS} should be a list of layers, got {type(raw).__name__}")
    out = []
    for i, entry in enumerate(raw):
        at = f"{where}: {AUTOEP_LAYERS}[{i}]"
        if not isinstance(entry, Mapping):
            raise InputError(f"{at} is not a mapping")
        fmt = entry.get("checkpoint_format")
        if fmt != _FORMATS[zero3]:
            raise InputError(
                f"{at}: checkpoint_format {fmt!r} in a ZeRO-{'3' if zero3 else '1/2'} save; DeepSpeed 0.19.8 writes "
                f"{_FORMATS[zero3]!r} there"
            )
        experts, ep_size = _int(entry, "num_experts", at), _int(entry, "ep_size", at)
        if ep_size < 1 or experts % ep_size or _int(entry, "num_local_experts", at) != experts // ep_size:
            raise InputError(f"{at}: {experts} experts do not split into num_local_experts at ep_size={ep_size}")
        prefix, module = entry.get("expert_key_prefix"), entry.get("module_path")
        if not isinstance(prefix, str) or not isinstance(module, str) or not prefix:
            raise InputError(f"{at}: expert_key_prefix and module_path should be names")
        out.append(
            AutoEpLayer(
                layer=_int(entry, "moe_layer_id", at),
                module=module,
                prefix=prefix,
                experts=experts,
                ep_size=ep_size,
                placement=_placement(entry, experts, ep_size, at),
                shapes=_shapes(entry, prefix, experts, ep_size, at),
            )
        )
    if sorted(x.layer for x in out) != list(range(len(out))) or len({x.prefix for x in out}) != len(out):
        raise InputError(f"{where}: {AUTOEP_LAYERS} layer ids or prefixes repeat")
    if len({x.ep_size for x in out}) != 1:
        raise InputError(f"{where}: AutoEP layers at several ep sizes; DeepSpeed 0.19.8 saves one")
    return sorted(out, key=lambda x: x.layer)


def rank_view(model_states: Mapping[str, Any], where: str) -> tuple[int, int]:
    """(expert-parallel rank, expert-data-parallel rank) of the rank that wrote a ZeRO-3 model-states file: each
    writes its own ``ds_autoep_layers`` view, the same for every layer."""
    raw = model_states.get(AUTOEP_LAYERS)
    if not isinstance(raw, list) or not raw or not all(isinstance(e, Mapping) for e in raw):
        raise InputError(f"{where}: {AUTOEP_LAYERS} should be a list of layers")
    views = {(_int(e, "ep_rank", where), _int(e, "expert_data_parallel_rank", where)) for e in raw}
    if len(views) != 1:
        raise InputError(f"{where}: its AutoEP layers disagree on the rank's ep_rank/expert_data_parallel_rank")
    return views.pop()


@dataclass(frozen=True)
class Partition:
    """One sub-group's ZeRO-3 partition group as ``ds_zero_partition_groups`` records it on one rank."""

    count: int  # partition_count: how many ranks share the sub-group
    rank: int  # partition_rank: this rank's index among them
    ranks: tuple[int, ...]  # partition_ranks: their global ranks


def partition_of(block: Mapping[str, Any], sub: int, where: str) -> Partition | None:
    """Sub-group ``sub``'s partition group from a ZeRO-3 optimizer block; None when the save records none (only
    AutoEP runs do: every other sub-group is partitioned over all ranks)."""
    raw = block.get(PARTITION_GROUPS)
    if raw is None:
        return None
    entry = raw[sub] if isinstance(raw, list) and 0 <= sub < len(raw) else None
    if not isinstance(entry, Mapping):
        raise InputError(f"{where}: {PARTITION_GROUPS} has no entry for sub-group {sub}")
    ranks = entry.get("partition_ranks")
    if not isinstance(ranks, list) or not all(isinstance(r, int) for r in ranks):
        raise InputError(f"{where}: {PARTITION_GROUPS}[{sub}].partition_ranks is not a list of ranks")
    part = Partition(_int(entry, "partition_count", where), _int(entry, "partition_rank", where), tuple(ranks))
    if part.count != len(part.ranks) or part.rank >= part.count:
        raise InputError(f"{where}: {PARTITION_GROUPS}[{sub}] is inconsistent: {dict(entry)}")
    return part


def _strides(shape: list[int]) -> list[int]:
    out = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        out[i] = out[i + 1] * shape[i + 1]
    return out


def autoep_entry(layer: AutoEpLayer, *, ep: int, world: int) -> dict[str, Any]:
    """The ``ds_autoep_layers`` entry DeepSpeed 0.19.8 saves for ``layer`` at ep size ``ep`` on ``world`` ranks, as
    rank 0 sees it (contiguous placement, one whole-experts piece per rank in each affine map)."""
    local = layer.experts // ep
    ranks = [list(range(p * local, (p + 1) * local)) for p in range(ep)]
    maps: dict[str, Any] = {}
    for weight in WEIGHTS:
        logical = [layer.experts, *layer.shapes[weight][1:]]
        shard = [local, *logical[1:]]
        inner = _strides(logical)[0]
        maps[layer.fused(weight)] = {
            "logical_shape": logical,
            "ranks": {
                p: {
                    "pieces": [
                        {
                            "dest": [0, _strides(shard)],
                            "locations": [p],
                            "shape": shard,
                            "source": [p * local * inner, _strides(logical)],
                        }
                    ],
                    "shard_shape": shard,
                }
                for p in range(ep)
            },
        }
    return {
        "moe_layer_id": layer.layer,
        "module_path": layer.module,
        "num_experts": layer.experts,
        "num_local_experts": local,
        "ep_size": ep,
        "expert_placement": {
            "version": 1,
            "num_experts": layer.experts,
            "ep_size": ep,
            "ranks": [{"rank": p, "experts": experts} for p, experts in enumerate(ranks)],
        },
        "affine_maps": {"version": 1, "params": maps},
        "expert_key_prefix": layer.prefix,
        "checkpoint_format": "per_expert_files",
        "checkpoint_format_version": None,
        "ep_group_name": f"ep_size_{ep}",
        "ep_rank": 0,
        "expert_data_parallel_rank": 0,
        "expert_data_parallel_world_size": world // ep,
        "global_expert_start": 0,
        "global_expert_end": local,
    }


def universal_info(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``universal_checkpoint_info`` DeepSpeed 0.19.8 adds to an AutoEP save's model states."""
    return {
        "universal_checkpoint_version": 0.4,
        "expert_parameter_patterns": [r".*\.experts\.w[123]$"],
        AUTOEP_LAYERS: entries,
    }


def autoep_record(layers: list[AutoEpLayer], world: int) -> dict[str, Any]:
    """What a reader records of the AutoEP layers (``extras()["autoep"]``, kept in state.pt and ucp.json;
    docs/format.md section 8): the world, the ep size, and per layer its place, experts and fused shapes."""
    return {
        "world": world,
        "ep_size": layers[0].ep_size,
        "layers": [
            {
                "layer": x.layer,
                "module": x.module,
                "prefix": x.prefix,
                "experts": x.experts,
                "ep_size": x.ep_size,
                "shapes": {w: list(s) for w, s in x.shapes.items()},
            }
            for x in layers
        ],
    }


def partition_group_entry(sub_group: int, ranks: list[int], part: int, family: str, name: str) -> dict[str, Any]:
    """One ``ds_zero_partition_groups`` entry as a ZeRO-3 engine of DeepSpeed 0.19.8 records it (it loads a file
    only when the list equals its own): sub-group ``sub_group`` partitioned over ``ranks``, this rank's ``part``;
    ``family`` is ``replicated`` (dense, name ``replicated``) or ``autoep_expert`` (its param group's name)."""
    return {
        "sub_group": sub_group,
        "partition_count": len(ranks),
        "partition_rank": part,
        "partition_ranks": ranks,
        "families": [family],
        "group_names": [name],
    }


def zero3_rank_entry(entry: Mapping[str, Any], *, ep: int, rank: int) -> dict[str, Any]:
    """A ``ds_autoep_layers`` entry (:func:`autoep_entry`) as ZeRO-3 rank ``rank`` saves it: each rank records its
    own expert-parallel and expert-data-parallel rank and its experts' global range."""
    p = rank % ep
    local = entry["num_local_experts"]
    return {
        **entry,
        "checkpoint_format": "zero3_partitioned",
        "checkpoint_format_version": 1,
        "ep_rank": p,
        "expert_data_parallel_rank": rank // ep,
        "global_expert_start": p * local,
        "global_expert_end": (p + 1) * local,
    }
