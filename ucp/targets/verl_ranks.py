"""What each rank's files of a verl actor folder hold, built from a DCP plan (``ucp.targets.dcp.plan_dcp``): the model
file (``model.state_dict()``), the optimizer file (``optimizer.state_dict()``, keys the positions in
``model.parameters()``) for FSDP2 or FSDP1 (flat parameters, verl's default), every tensor a :class:`LazyTensor` read
when the file writer reaches it.

verl builds one AdamW over ``model.parameters()``, so the optimizer file's indices follow the model's parameter order;
a plan gives that order only where the source's one param group lists every parameter in it (its torch optimizer was
built over ``model.parameters()``). Anything else is refused in one line (:func:`verl_layout`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ucp.errors import ConfigError
from ucp.frameworks.verl_dtensor import RankMesh
from ucp.model.fsdp_shards import flat_chunk, flat_offsets, units_in_order
from ucp.model.pieces import LazyTensor
from ucp.model.records import Facts
from ucp.targets.dcp_save import Fetch

__all__ = ["VerlLayout", "verl_layout", "model_file", "optim_file"]

#: (parameter name, "fp32" or a state key) -> the tensor, whole or as pieces (ucp.targets.dcp_save.Fetch)
Fetcher = Fetch


@dataclass
class VerlLayout:
    """A plan in verl's terms: the parameters in ``model.parameters()`` order, the model entries, each parameter's
    optimizer state (meta tensors stand for tensors to read), and the one param group."""

    names: list[str]
    shapes: dict[str, tuple[int, ...]]
    model: dict[str, Any]
    state: dict[str, dict[str, Any]]
    group: dict[str, Any]


def verl_layout(facts: Facts, plan_state: Mapping[str, Any], optim_key: str) -> VerlLayout:
    """The plan's state as verl's files need it; refuses what verl's one AdamW group cannot hold in order."""
    frozen = [p.name for p in facts.params if p.frozen]
    groups = plan_state[optim_key]["param_groups"]
    if len(groups) != 1:
        raise ConfigError(
            f"the source has {len(groups)} param groups; verl's actor optimizer is one group over model.parameters() "
            "(its files keep positions, not names), so ucp writes a verl checkpoint from a one-group source only"
        )
    if frozen:
        raise ConfigError(
            f"the source has frozen parameters ({', '.join(frozen[:3])}); verl's optimizer lists every parameter in "
            "model order, which the source does not record for frozen ones"
        )
    names = list(groups[0]["params"])
    shapes = {p.name: tuple(p.shape) for p in facts.params}
    flat = [n for n in names if not shapes[n]]
    if flat:
        raise ConfigError(f"{flat[0]} is a 0-dim parameter; FSDP shards every parameter along dim 0")
    group = {k: v for k, v in groups[0].items() if k != "params"}
    return VerlLayout(names, shapes, dict(plan_state["model"]), dict(plan_state[optim_key]["state"]), group)


def _rows(fetch: Fetcher, name: str, key: str, start: int, end: int, shape: tuple[int, ...]) -> LazyTensor:
    """A rank's rows [start, end) of ``name``'s ``key`` tensor, read when written (those rows alone)."""
    local = (end - start, *shape[1:])
    row = math.prod(shape[1:])
    return LazyTensor(
        local,
        torch.float32,
        lambda: fetch.pieces(name, key).slice(start * row, end * row).join(torch.float32).view(local),
    )


def _dtensor(mesh: RankMesh, fetch: Fetcher, name: str, key: str, shape: tuple[int, ...]) -> Any:
    start, end = mesh.rows(shape)
    return mesh.dtensor(shape, torch.float32, _rows(fetch, name, key, start, end, shape))


def model_file(
    layout: VerlLayout, mesh: RankMesh, fetch: Fetcher, plan_lazy: Mapping[str, tuple[str, str]], *, plain: bool
) -> dict:
    """``model.state_dict()`` of rank ``mesh.rank``: every parameter a Shard(0) DTensor (FSDP2, and FSDP1 with a
    mesh alike), or with ``plain`` a whole tensor (FSDP1 at one process runs NO_SHARD: its sharded state dict holds
    plain tensors); a tied alias the same object as its owner, a buffer the plain tensor every rank holds."""
    out: dict[str, Any] = {}
    made: dict[str, Any] = {}
    for entry, value in layout.model.items():
        if not (torch.is_tensor(value) and value.is_meta):
            out[entry] = value  # a buffer
            continue
        name, _ = plan_lazy[f"model.{entry}"]
        shape = layout.shapes[name]
        if name not in made:
            made[name] = (
                _rows(fetch, name, "fp32", 0, shape[0], shape) if plain else _dtensor(mesh, fetch, name, "fp32", shape)
            )
        out[entry] = made[name]
    return out


def _lazy_keys(state: Mapping[str, Any]) -> list[str]:
    return [k for k, v in state.items() if torch.is_tensor(v) and v.is_meta]


def _fsdp2_state(layout: VerlLayout, mesh: RankMesh, fetch: Fetcher) -> dict[int, dict[str, Any]]:
    """Per parameter index: its small state as planned (the step), each moment a DTensor like the parameter."""
    out: dict[int, dict[str, Any]] = {}
    for index, name in enumerate(layout.names):
        planned = layout.state.get(name)
        if planned is None:
            continue
        lazy = set(_lazy_keys(planned))
        shape = layout.shapes[name]
        out[index] = {k: (_dtensor(mesh, fetch, name, k, shape) if k in lazy else v) for k, v in planned.items()}
    return out


def _flat_shard(fetch: Fetcher, members: list[tuple[str, int, int]], key: str, lo: int, chunk: int) -> LazyTensor:
    """Elements [lo, lo + chunk) of a unit's flat ``key`` tensor (``members``: name, start, numel), zero-padded."""

    def make() -> torch.Tensor:
        shard = torch.zeros(chunk, dtype=torch.float32)
        for name, start, numel in members:
            a, b = max(lo, start), min(lo + chunk, start + numel)
            if a < b:  # the member's elements this shard holds, read into place
                fetch.pieces(name, key).slice(a - start, b - start).copy_to(shard[a - lo : b - lo])
        return shard

    return LazyTensor((chunk,), torch.float32, make)


def _fsdp1_state(layout: VerlLayout, mesh: RankMesh, fetch: Fetcher) -> tuple[dict[int, dict[str, Any]], int]:
    """Per FSDP unit (root first, then each decoder layer): its members' state as one padded flat shard."""
    out: dict[int, dict[str, Any]] = {}
    units = units_in_order(layout.names)
    for index, (_, names) in enumerate(units):
        planned = [layout.state.get(n) for n in names]
        if all(p is None for p in planned):
            continue
        if any(p is None for p in planned) or len({str(_small(p)) for p in planned}) != 1:
            raise ConfigError(f"the parameters of FSDP unit {index} ({names[0]}, ...) differ in step or state keys")
        numels = [int(torch.Size(layout.shapes[n]).numel()) for n in names]
        starts, total = flat_offsets(numels)
        chunk = flat_chunk(total, mesh.world)
        members = list(zip(names, starts, numels))
        first = planned[0]
        assert first is not None
        lazy = set(_lazy_keys(first))
        out[index] = {
            k: (_flat_shard(fetch, members, k, mesh.rank * chunk, chunk) if k in lazy else v) for k, v in first.items()
        }
    return out, len(units)


def _small(state: Mapping[str, Any] | None) -> dict[str, Any]:
    """A state's non-tensor-of-data part, to compare units' members (steps, key set)."""
    if state is None:
        return {}
    return {k: (float(v) if torch.is_tensor(v) and not v.is_meta else "tensor") for k, v in state.items()}


def optim_file(layout: VerlLayout, mesh: RankMesh, fetch: Fetcher, version: int) -> dict[str, Any]:
    """``optimizer.state_dict()`` of rank ``mesh.rank`` for FSDP ``version``."""
    if version == 2:
        state, count = _fsdp2_state(layout, mesh, fetch), len(layout.names)
    else:
        state, count = _fsdp1_state(layout, mesh, fetch)
    return {"state": state, "param_groups": [{**layout.group, "params": list(range(count))}]}
