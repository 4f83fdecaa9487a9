"""DeepSpeed's legacy mixture-of-experts layout (``deepspeed.moe.layer.MoE`` under ZeRO-1/2, 0.19.8).

What a save at world size W with expert-parallel size E holds, as verified on real runs (tests/test_moe.py):

- ``mp_rank_00_model_states.pt`` (written by rank 0): ``module`` without the experts (DeepSpeed drops every
  key of a MoE module holding ``expert`` except the gate's ``wg.weight``); ``param_shapes`` per param group
  as rank 0 holds them, so an expert group lists rank 0's *local* experts (``...deepspeed_experts.0.``
  .. ``L-1.``, L = experts / E); ``num_experts``: a list, one entry per MoE layer (an int means the pre-0.6
  layout).
- ``layer_{l}_expert_{e}_mp_rank_00_model_states.pt``: expert ``e`` (global index) of MoE layer ``l`` (its
  order among the model's MoE modules), its state dict under the *global* name
  ``{module}.deepspeed_moe.experts.deepspeed_experts.{e}.{name}``, in the model dtype. Written by the ranks
  of expert-data-parallel rank 0.
- ``zero_pp_rank_{r}_mp_rank_00_optim_states.pt`` for every rank r < W: ordinary ZeRO-1/2 flat groups,
  except that an expert param group (``moe: True``, ``name: "ep_size_E"``, made by
  ``split_params_into_different_moe_groups_for_optimizer``) holds rank r's local experts, partitioned over
  its expert-data-parallel group: ranks ``e, e+E, e+2E, ...`` hold experts ``e*L .. e*L+L-1`` (expert-parallel
  groups are runs of E consecutive ranks), rank r being partition ``r // E`` of ``W / E``. ``partition_count``
  is per group: W for a dense group, W / E for an expert group.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from ucp.errors import InputError

__all__ = [
    "EXPERT_INFIX",
    "expert_parts",
    "expert_name",
    "ep_size",
    "ep_group_name",
    "expert_ranks",
    "expert_order",
]

#: what sits between a MoE module's name and an expert's index in every expert parameter's name
EXPERT_INFIX = ".deepspeed_moe.experts.deepspeed_experts."
_EXPERT = re.compile(rf"^(.*){re.escape(EXPERT_INFIX)}(\d+)\.(.+)$")
_GROUP = re.compile(r"^ep_size_(\d+)$")


def expert_parts(name: str) -> tuple[str, int, str] | None:
    """(MoE module, expert index, name within the expert) of an expert parameter's name, else None."""
    m = _EXPERT.match(name)
    return None if m is None else (m.group(1), int(m.group(2)), m.group(3))


def expert_name(module: str, expert: int, rest: str) -> str:
    return f"{module}{EXPERT_INFIX}{expert}.{rest}"


def ep_size(group: Mapping[str, Any], where: str) -> int | None:
    """The expert-parallel size of an optimizer param group, from its name; None for a dense group."""
    if not group.get("moe"):
        return None
    name = group.get("name")
    m = _GROUP.match(name) if isinstance(name, str) else None
    if m is None or int(m.group(1)) < 1:
        raise InputError(f"{where}: a MoE param group named {name!r}; DeepSpeed names them 'ep_size_<E>'")
    return int(m.group(1))


def ep_group_name(size: int) -> str:
    """The param-group (and process-group) name DeepSpeed gives the experts of expert-parallel size ``size``."""
    return f"ep_size_{size}"


def expert_ranks(world: int, size: int, ep_rank: int) -> list[int]:
    """The ranks holding expert-parallel rank ``ep_rank``'s experts, in partition order (0.19.8
    ``get_ep_ranks``): its expert-data-parallel group."""
    if size < 1 or world % size:
        raise InputError(f"ep_size={size} does not divide the world size {world}")
    return list(range(ep_rank, world, size))


def expert_order(names: Iterable[str]) -> list[str]:
    """An expert param group's members as one rank's flat group orders them: MoE module by module (in the
    order they first appear), expert by expert, each expert's parameters in the order given."""
    names = list(names)
    modules: dict[str, int] = {}
    keys = []
    for name in names:
        parts = expert_parts(name)
        if parts is None:
            raise InputError(f"{name} is in a MoE param group but is not an expert parameter")
        keys.append((modules.setdefault(parts[0], len(modules)), parts[1]))
    return [name for _, name in sorted(zip(keys, names), key=lambda kv: kv[0])]
