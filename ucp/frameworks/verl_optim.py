"""verl's optimizer files (``optimizer.state_dict()`` of each rank, keys the positions in ``model.parameters()``) read
as the state of each parameter, by name.

verl builds one AdamW over ``model.parameters()`` (verl/workers/config/optimizer.py) and saves its raw state dict per
rank; no parameter name is recorded. What an index means depends on the wrapping:

* FSDP2: index ``i`` is the ``i``-th parameter; each moment a Shard(0) DTensor like the parameter.
* FSDP1, ``use_orig_params=True``: index ``i`` is the ``i``-th parameter too; each moment the 1-D slice of the
  flattened parameter that lies in the rank's flat shard (no entry on a rank holding none of it).
* FSDP1, ``use_orig_params=False`` (verl's default): index ``u`` is the ``u``-th flat parameter (root unit first,
  then each decoder layer: ``ucp.model.fsdp_shards.units_in_order``); each moment the rank's padded 1-D flat shard.
  The unit layout is not recorded: it is inferred from the names and checked against every rank's flat size.

Parameters are in the order of the model file's sharded entries (``state_dict`` order is ``parameters()`` order for
parameters; a tied alias, the same object in the pickle, counts once).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ucp.errors import CorruptFileError, InputError
from ucp.frameworks.verl_files import Whole, is_sharded, whole_entry
from ucp.model.fsdp_shards import flat_chunk, flat_offsets, rank_pieces, units_in_order

__all__ = ["OptimState", "read_optim", "FSDP2", "FSDP1_FLAT", "FSDP1_ORIG"]

FSDP2, FSDP1_FLAT, FSDP1_ORIG = "fsdp2", "fsdp1-flat", "fsdp1-orig-params"


@dataclass
class OptimState:
    """The optimizer's groups (members by name), each parameter's state by key, and which layout it was read from."""

    groups: list[dict[str, Any]]
    state: dict[str, dict[str, Whole]]
    layout: str


def _check(optims: Sequence[Any], where: str) -> tuple[list[dict[str, Any]], int]:
    """Every rank's dict is an optimizer state dict with the same groups; verl's one group lists 0..n-1."""
    for rank, optim in enumerate(optims):
        if not isinstance(optim, Mapping) or not isinstance(optim.get("state"), Mapping):
            raise CorruptFileError(f"{where} rank {rank} is not an optimizer state_dict (no 'state')")
        groups = optim.get("param_groups")
        if not isinstance(groups, list) or not all(isinstance(g, Mapping) for g in groups):
            raise CorruptFileError(f"{where} rank {rank} has no param_groups list")
    groups = [dict(g) for g in optims[0]["param_groups"]]
    if len(groups) != 1:
        raise InputError(
            f"{where} holds {len(groups)} param groups; verl builds one AdamW group over model.parameters(), and "
            "with several ucp cannot tell which parameter each index is"
        )
    ids = groups[0].get("params")
    if not isinstance(ids, list) or ids != list(range(len(ids))):
        raise CorruptFileError(f"{where}: param_groups[0]['params'] is not 0..n-1")
    return groups, len(ids)


def _scalar_state(entry: Mapping[str, Any]) -> dict[str, Whole]:
    """An entry's 0-dim tensors (the step), the same on every rank."""
    return {
        k: whole_entry([v], k) for k, v in entry.items() if torch.is_tensor(v) and not is_sharded(v) and v.dim() == 0
    }


def _fsdp2(params: Sequence[tuple[str, Whole]], optims: Sequence[Any], where: str) -> dict[str, dict[str, Whole]]:
    state: dict[str, dict[str, Whole]] = {}
    for index, (name, param) in enumerate(params):
        entries = [o["state"].get(index) for o in optims]
        if all(e is None for e in entries):
            continue
        if any(not isinstance(e, Mapping) for e in entries):
            raise CorruptFileError(f"{where}: the state of {name} (index {index}) is missing on some ranks")
        own = _scalar_state(entries[0])
        for key in [k for k in entries[0] if k not in own]:
            whole = whole_entry([e.get(key) for e in entries], f"{where} state {index}.{key} ({name})")
            if whole.shape != param.shape:
                raise InputError(
                    f"{where}: state {key!r} of index {index} has shape {whole.shape}, {name} {param.shape}"
                )
            own[key] = whole
        state[name] = own
    return state


def _orig_params(params: Sequence[tuple[str, Whole]], optims: Sequence[Any], where: str) -> dict[str, dict[str, Whole]]:
    """FSDP1 use_orig_params: a parameter's moment is its ranks' 1-D slices, concatenated in rank order."""
    state: dict[str, dict[str, Whole]] = {}
    for index, (name, param) in enumerate(params):
        present = [e for o in optims if isinstance(e := o["state"].get(index), Mapping)]
        if not present:
            continue
        own = _scalar_state(present[0])
        for key in [k for k in present[0] if k not in own]:
            parts: list[torch.Tensor] = [p for e in present if torch.is_tensor(p := e.get(key))]
            if len(parts) != len(present) or not all(not is_sharded(p) and p.dim() == 1 for p in parts):
                raise CorruptFileError(f"{where}: state {index}.{key} ({name}) is not 1-D slices on every rank")
            whole, start = Whole(param.shape, parts[0].dtype), 0
            for part in parts:
                whole.flats.append((start, part))
                start += part.numel()
            if start != param.numel:
                raise InputError(
                    f"{where}: the ranks hold {start} elements of {key} of {name}, which has {param.numel}"
                )
            own[key] = whole
        state[name] = own
    return state


def _flat_units(params: Sequence[tuple[str, Whole]], optims: Sequence[Any], where: str) -> dict[str, dict[str, Whole]]:
    """FSDP1 flat parameters: each unit's padded flat shards, cut back into its parameters."""
    shapes = dict(params)
    state: dict[str, dict[str, Whole]] = {}
    for index, (prefix, members) in enumerate(units_in_order([n for n, _ in params])):
        starts, total = flat_offsets([shapes[n].numel for n in members])
        chunk = flat_chunk(total, len(optims))
        entries = [o["state"].get(index) for o in optims]
        if not all(isinstance(e, Mapping) for e in entries):
            continue  # a unit never stepped (frozen): no state on any rank
        own = _scalar_state(entries[0])
        for key in [k for k in entries[0] if k not in own]:
            shards = [e.get(key) for e in entries]
            if not all(
                torch.is_tensor(s) and not is_sharded(s) and s.dim() == 1 and s.numel() == chunk for s in shards
            ):
                sizes = [tuple(s.shape) if torch.is_tensor(s) else type(s).__name__ for s in shards]
                raise InputError(
                    f"{where}: flat parameter {index} ({prefix or 'the root unit'}: {len(members)} parameters, {total} "
                    f"elements) would be {chunk} per rank, the files hold {sizes}: its FSDP units are not verl's "
                    "default (one per decoder layer, the rest in the root)"
                )
            for name, start in zip(members, starts):
                whole = Whole(shapes[name].shape, shards[0].dtype)
                for rank, inner, at, length in rank_pieces(start, shapes[name].numel, chunk):
                    whole.flats.append((at, shards[rank][inner : inner + length]))
                state.setdefault(name, {}).update(own)
                state[name][key] = whole
    return state


def _fsdp1_layout(params: Sequence[tuple[str, Whole]], optims: Sequence[Any], count: int, where: str) -> str:
    """Flat parameters or original ones: the index count says (units or parameters), the sizes decide a tie."""
    units = len(units_in_order([n for n, _ in params]))
    if count == len(params) and count != units:
        return FSDP1_ORIG
    if count == units and count != len(params):
        return FSDP1_FLAT
    if count == units == len(params):
        first = next((e for e in optims[0]["state"].values() if isinstance(e, Mapping)), {})
        moment = next((v for v in first.values() if torch.is_tensor(v) and v.dim() == 1), None)
        chunk = flat_chunk(params[0][1].numel, len(optims))
        return FSDP1_FLAT if moment is not None and moment.numel() == chunk else FSDP1_ORIG
    raise InputError(
        f"{where} lists {count} parameters: neither the model's {len(params)} (use_orig_params) nor its {units} FSDP "
        "units under verl's default wrap policy (one per decoder layer, the rest in the root)"
    )


def read_optim(params: Sequence[tuple[str, Whole]], optims: Sequence[Any], version: int, where: str) -> OptimState:
    """The optimizer state of ``params`` (name, whole parameter, in ``model.parameters()`` order) from every rank's
    optimizer state dict, for FSDP ``version`` 1 or 2."""
    groups, count = _check(optims, where)
    if version == 2:
        if count != len(params):
            raise InputError(f"{where} lists {count} parameters, the model file holds {len(params)}")
        layout, state = FSDP2, _fsdp2(params, optims, where)
    else:
        layout = _fsdp1_layout(params, optims, count, where)
        read = _flat_units if layout == FSDP1_FLAT else _orig_params
        state = read(params, optims, where)
    groups[0]["params"] = [name for name, _ in params]
    return OptimState(groups, state, layout)
