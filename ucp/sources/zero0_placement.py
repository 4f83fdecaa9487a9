"""Where a stage-0 save's optimizer entries belong: its module's parameters in model order, found by shape
and, where there are fp32 masters, by value (``ucp.sources.zero0``, whose docstring says why)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ucp.deepspeed.fields import as_int, check_name, need_list, need_mapping
from ucp.deepspeed.optim_states import FUSED_MASTERS
from ucp.errors import InputError

__all__ = ["Want", "candidates", "place", "unflatten"]

logger = logging.getLogger(__name__)

#: one optimizer entry as the placement looks for it: its shape (None: unknown) and fp32 master (None: none)
Want = tuple[tuple[int, ...] | None, torch.Tensor | None]


def _view(tensor: torch.Tensor) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    return tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride())


def candidates(module: Mapping[str, Any], buffer_names: Sequence[str]) -> dict[str, torch.Tensor]:
    """The module's parameters in model order: every tensor but the buffers, a tied alias (the same bytes
    as an earlier entry) left out, as ``named_parameters`` leaves it out."""
    skip = set(buffer_names)
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    out: dict[str, torch.Tensor] = {}
    for pname, value in module.items():
        if pname in skip or not torch.is_tensor(value):
            continue
        check_name(pname, "module")
        view = _view(value)
        if value.numel() and view in seen:
            continue
        seen.add(view)
        out[pname] = value
    return out


def unflatten(
    inner: Mapping[str, Any], flats: list[torch.Tensor], trainable: list[tuple[str, torch.Tensor]], where: str
) -> tuple[dict[str, Any], list[list[torch.Tensor]]]:
    """DeepSpeed's fused FP16_Optimizer (bf16/fp16 with DeepSpeed or Apex FusedAdam) steps one flat fp32 tensor
    per param group: its members' masters one after the other in group order, no padding, and the inner
    optimizer's state entry g holds group g's flat state. The members are the module's trainable parameters in
    model order whose weight is the next slice of a group's flat master rounded to the model dtype, bit for bit;
    returned as FP16_UnfusedOptimizer keeps them (a state_dict by parameter index, masters per group), as views."""
    groups = [
        need_mapping(g, f"{where}: a param group")
        for g in need_list(inner.get("param_groups"), f"{where}: optimizer param_groups")
    ]
    if len(groups) != len(flats):
        raise InputError(f"{where}: {len(flats)} flat fp32 groups, {len(groups)} param groups: the file is damaged")
    for g, flat in enumerate(flats):
        if flat.dtype != torch.float32 or flat.dim() != 1:
            raise InputError(
                f"{where}: {FUSED_MASTERS}[{g}] is a {flat.dtype} tensor of {flat.dim()} dims, not a flat fp32 master"
            )
    state = need_mapping(inner.get("state") or {}, f"{where}: optimizer state")
    by_index = {as_int(k, f"{where}: optimizer state index"): v for k, v in state.items()}
    at = [0] * len(flats)
    members: list[list[tuple[int, torch.Size]]] = [[] for _ in flats]
    for pname, value in trainable:
        n = value.numel()
        fits = [
            g
            for g, flat in enumerate(flats)
            if n
            and at[g] + n <= flat.numel()
            and value.is_floating_point()
            and torch.equal(flat[at[g] : at[g] + n].to(value.dtype), value.detach().reshape(-1))
        ]
        if len(fits) > 1:
            raise InputError(
                f"{where}: {pname!r} fits the flat fp32 masters of param groups {fits} alike: name the frozen "
                "parameters (--frozen NAME...) or restore from a ZeRO checkpoint of the run"
            )
        if fits:
            members[fits[0]].append((at[fits[0]], value.shape))
            at[fits[0]] += n
    short = [g for g, flat in enumerate(flats) if at[g] != flat.numel()]
    if short:
        g = short[0]
        raise InputError(
            f"{where}: the module's parameters in model order fill {at[g]} of the {flats[g].numel()} elements of "
            f"param group {g}'s flat fp32 master: the file is damaged, or its param groups do not follow the model's "
            "parameter order"
        )
    unflat: dict[int, dict[str, Any]] = {}
    out_groups: list[dict[str, Any]] = []
    masters: list[list[torch.Tensor]] = []
    for g, flat in enumerate(flats):
        flat_index = need_list(groups[g].get("params"), f"{where}: param group {g} params")
        if len(flat_index) != 1:
            raise InputError(
                f"{where}: param group {g} lists {len(flat_index)} tensors beside a flat fp32 master: the fused "
                "wrapper steps one per group; the file is damaged"
            )
        entry = need_mapping(
            by_index.get(as_int(flat_index[0], "a param group's index"), {}), f"{where}: optimizer state {g}"
        )
        first = len(unflat)
        out_groups.append({**groups[g], "params": list(range(first, first + len(members[g])))})
        masters.append([flat[start : start + shape.numel()].view(shape) for start, shape in members[g]])
        for start, shape in members[g]:
            unflat[len(unflat)] = {
                key: value[start : start + shape.numel()].view(shape)
                if torch.is_tensor(value) and value.dim() == 1 and value.numel() == flat.numel()
                else value
                for key, value in entry.items()
            }
    return {"state": unflat, "param_groups": out_groups}, masters


def _fits(want: Want, value: torch.Tensor, with_values: bool) -> bool:
    shape, master = want
    if shape is not None and tuple(value.shape) != shape:
        return False
    if with_values and master is not None:
        return value.is_floating_point() and torch.equal(master.detach().to(value.dtype), value.detach())
    return True


def place(
    want: list[list[Want]],
    candidates: list[tuple[str, torch.Tensor]],
    with_values: bool,
    where: str,
) -> list[list[str]]:
    """Each group's members as module parameter names, in model order: the earliest and the latest fitting
    embedding of the group in the candidates must be the same one (then no other exists) and groups must not
    share a parameter; otherwise refused, naming what could not be told apart."""
    out: list[list[str]] = []
    owner: dict[str, int] = {}
    for g, row in enumerate(want):
        early: list[int] = []
        at = 0
        for j, item in enumerate(row):
            while at < len(candidates) and not _fits(item, candidates[at][1], with_values):
                at += 1
            if at == len(candidates):
                shape = "unknown shape" if item[0] is None else f"shape {list(item[0])}"
                raise InputError(
                    f"{where}: param group {g} entry {j} ({shape}) matches no module parameter left in model order"
                    + (" (by shape and fp32 master value)" if with_values else " (by shape)")
                    + ": the optimizer's param groups do not follow the model's parameter order, or the file is damaged"
                )
            early.append(at)
            at += 1
        late: list[int] = []
        at = len(candidates) - 1
        for item in reversed(row):
            while not _fits(item, candidates[at][1], with_values):
                at -= 1
            late.append(at)
            at -= 1
        late.reverse()
        if early != late:
            unsure = sorted({candidates[i][0] for a, b in zip(early, late) if a != b for i in range(a, b + 1)})
            raise InputError(
                f"{where}, param group {g}: a stage-0 checkpoint does not name the parameters its optimizer state belongs to, "
                f"and {unsure[:4]} fit it in more than one way (a frozen parameter shaped like a trained one?): name "
                "the frozen parameters (--frozen NAME..., or open_reader(CKPT, frozen=[...]))"
            )
        names = [candidates[i][0] for i in early]
        for pname in names:
            if pname in owner:
                raise InputError(
                    f"{where}: {pname!r} fits both param group {owner[pname]} and param group {g}: name the frozen parameters "
                    "(Python: open_reader(CKPT, frozen=[...]))"
                )
            owner[pname] = g
        out.append(names)
    return out
