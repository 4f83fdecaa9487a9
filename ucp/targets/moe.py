"""Universal (or any reader of a MoE run) -> a native legacy-MoE ZeRO-1/2 checkpoint that DeepSpeed loads at
world size W with expert-parallel size E (``deepspeed.moe.layer.MoE(ep_size=E)``).

Call order: :func:`write_moe` checks the sizes against the run's MoE layers (the reader's ``extras()["moe"]``,
which :class:`~ucp.sources.moe.MoeSource` records), then hands two kinds of views to the ZeRO-1/2 native
writer: the dense param groups at W ranks, written in place; and, per expert-parallel rank e, the expert
param groups holding e's experts under local names at W / E ranks, written to a scratch folder. Each rank
file r then takes its dense groups from the first and its expert groups from expert-parallel rank r % E's
file r // E (:func:`ucp.deepspeed.moe.merge_optim_blocks`); the model-states file gets rank 0's local
param shapes and ``num_experts``, and every expert its ``layer_L_expert_E`` file (:mod:`ucp.deepspeed.moe`).
The rank files are written twice (the native writer knows one DP size per checkpoint).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ucp.deepspeed.layout import LATEST, expert_file, model_file, optim_file
from ucp.deepspeed.moe import ep_group_name, expert_name, expert_order, expert_parts, merge_optim_blocks
from ucp.errors import ConfigError
from ucp.io.atomic import staged_output
from ucp.io.pool import default_workers
from ucp.io.torchfile import load
from ucp.io.torchzip import write_torch_file
from ucp.model.options import RestoreOptions
from ucp.model.records import Facts, GroupMeta, ParamMeta, ParamState, PieceState, Reader, ReaderView, torch_dtype
from ucp.sources import open_reader
from ucp.sources.moe import MOE_EXTRAS
from ucp.targets.native import NativePlan, plan_native
from ucp.targets.native.zero12 import write_zero12

__all__ = ["MoeLayer", "moe_layers", "write_moe"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MoeLayer:
    """One MoE module of the run: its name, its order among the model's MoE modules, its expert count."""

    module: str
    layer: int
    experts: int


def moe_layers(reader: Reader) -> list[MoeLayer]:
    """The MoE layers a reader of a MoE run records, in layer order."""
    record = reader.extras().get(MOE_EXTRAS)
    if not isinstance(record, Mapping) or not record.get("layers"):
        raise ConfigError("the checkpoint records no MoE layers: it was not read from a legacy DeepSpeed MoE run")
    return sorted(
        (MoeLayer(str(x["module"]), int(x["layer"]), int(x["experts"])) for x in record["layers"]),
        key=lambda x: x.layer,
    )


def _split(facts: Facts) -> tuple[list[int], list[int]]:
    """The dense and the expert param groups (``moe: True``); each holds only its own kind of parameter."""
    dense: list[int] = []
    experts: list[int] = []
    for g, group in enumerate(facts.groups):
        moe = bool(group.raw.get("moe"))
        (experts if moe else dense).append(g)
        wrong = [n for n in group.params if (expert_parts(n) is not None) != moe]
        if wrong:
            kind = "an expert" if moe else "a dense"
            raise ConfigError(f"{wrong[0]} is in {kind} param group ({g}) but is {'not ' if moe else ''}an expert")
    return dense, experts


def _group_facts(facts: Facts, groups: list[GroupMeta], params: list[ParamMeta], buffers: list[str]) -> Facts:
    """Facts of some param groups, renumbered from 0, with these parameters (frozen ones included)."""
    renumber = {g.index: i for i, g in enumerate(groups)}
    groups = [replace(g, index=i) for i, g in enumerate(groups)]
    params = [replace(p, group=None if p.group is None else renumber[p.group]) for p in params]
    return replace(facts, groups=groups, params=params, buffer_names=buffers, tied={}, tp_rules={})


class _DenseView(ReaderView):
    """The reader without its experts: the dense param groups, frozen parameters and buffers."""

    def __init__(self, inner: Reader, dense: list[int]) -> None:
        facts = inner.facts
        keep = {n for g in dense for n in facts.groups[g].params}
        params = [p for p in facts.params if p.name in keep or p.frozen]
        groups = [replace(facts.groups[g], index=g) for g in dense]
        super().__init__(inner, _group_facts(facts, groups, params, list(facts.buffer_names)))

    def param_steps(self) -> dict[str, int | None]:
        return Reader.param_steps(self)


class _ExpertView(ReaderView):
    """Expert-parallel rank ``ep_rank``'s experts under their local names, in its expert groups."""

    def __init__(self, inner: Reader, groups: list[int], layers: list[MoeLayer], ep: int, ep_rank: int) -> None:
        facts = inner.facts
        local = {x.module: x.experts // ep for x in layers}
        self._global: dict[str, str] = {}
        metas = []
        for g in groups:
            names = []
            for name in facts.groups[g].params:
                module, index, rest = expert_parts(name) or ("", -1, "")
                if ep_rank * local[module] <= index < (ep_rank + 1) * local[module]:
                    names.append(expert_name(module, index - ep_rank * local[module], rest))
                    self._global[names[-1]] = name
            # DeepSpeed finds a group's expert-data-parallel ranks by its name, ep_size_<E>
            meta = facts.groups[g]
            raw = {**meta.raw, "name": ep_group_name(ep)}
            hyper = replace(meta.hyper, extra={**meta.hyper.extra, "name": ep_group_name(ep)})
            metas.append(replace(meta, index=g, raw=raw, hyper=hyper, params=expert_order(names)))
        params = [replace(facts.param(self._global[n]), name=n) for m in metas for n in m.params]
        super().__init__(inner, _group_facts(facts, metas, params, []))

    def read(self, name: str, *, moments: bool = True) -> ParamState:
        return self.inner.read(self._global[name], moments=moments)

    @contextmanager
    def read_pieces(self, name: str, *, moments: bool = True) -> Iterator[PieceState]:
        with self.inner.read_pieces(self._global[name], moments=moments) as state:
            yield state

    def param_steps(self) -> dict[str, int | None]:
        return Reader.param_steps(self)

    def buffers(self) -> dict[str, torch.Tensor]:
        return {}


def _check_sizes(layers: list[MoeLayer], world: int, ep: int) -> None:
    if ep < 1 or world % ep:
        raise ConfigError(f"ep_size={ep} must divide the number of ranks ({world}): DeepSpeed refuses it")
    for x in layers:
        if x.experts % ep:
            raise ConfigError(f"{x.module} has {x.experts} experts, which ep_size={ep} does not divide")


def _merge_files(tag_dir: Path, scratch: list[Path], dense: list[int], experts: list[int], plan: NativePlan) -> None:
    """Each rank file: its dense groups as written, its expert groups from its expert-parallel rank's file."""
    ep, bf16 = len(scratch), plan.dtype == "bf16"
    count = len(dense) + len(experts)
    for rank in range(plan.dp):
        path = tag_dir / optim_file(rank, bf16=bf16)
        mine: dict[str, Any] = dict(load(path))
        theirs = load(scratch[rank % ep] / optim_file(rank // ep, bf16=bf16))
        block = merge_optim_blocks(
            [(mine["optimizer_state_dict"], dense), (theirs["optimizer_state_dict"], experts)], count
        )
        path.unlink()
        write_torch_file({**mine, "optimizer_state_dict": block}, path)


def _merge_model(tag_dir: Path, scratch: Path, dense: list[int], experts: list[int], layers: list[MoeLayer]) -> None:
    """The model-states file: rank 0's param shapes of every group (its experts local), ``num_experts``."""
    path = tag_dir / model_file(0)
    states: dict[str, Any] = dict(load(path))
    local = load(scratch / model_file(0))["param_shapes"]
    shapes: list[Any] = [None] * (len(dense) + len(experts))
    for i, g in enumerate(dense):
        shapes[g] = states["param_shapes"][i]
    for i, g in enumerate(experts):
        shapes[g] = local[i]
    states.update(param_shapes=shapes, num_experts=[x.experts for x in layers], ds_autoep_layers=None)
    path.unlink()
    write_torch_file(states, path)


def _write_experts(reader: Reader, tag_dir: Path, experts: list[int], layers: list[MoeLayer], dtype: str) -> None:
    """One ``layer_L_expert_E`` file per expert: its weights in the run's dtype, under global names."""
    order = {x.module: x.layer for x in layers}
    files: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    lp = torch_dtype(dtype)
    for g in experts:
        for name in reader.facts.groups[g].params:
            module, index, _ = expert_parts(name) or ("", -1, "")
            files.setdefault((order[module], index), {})[name] = reader.read(name, moments=False).fp32.to(lp)
    for (layer, index), weights in sorted(files.items()):
        write_torch_file(weights, tag_dir / expert_file(layer, index))


def write_moe(
    source: Reader | str | os.PathLike,
    out: str | os.PathLike,
    options: RestoreOptions | None = None,
    *,
    ep: int,
    overwrite: bool = False,
    workers: int | None = None,
    **fields: Any,
) -> NativePlan:
    """Write ``out/latest`` and ``out/<tag>/`` for a legacy-MoE run of ``dp`` ranks at expert-parallel size ``ep``."""
    options = RestoreOptions(**fields) if options is None else replace(options, **fields)
    if options.stage not in (1, 2) or options.tp != 1:
        raise ConfigError("a MoE target is ZeRO-1 or ZeRO-2 at TP=1")
    reader = open_reader(source) if isinstance(source, (str, os.PathLike)) else source
    try:
        layers = moe_layers(reader)
        _check_sizes(layers, options.dp, ep)
        dense, experts = _split(reader.facts)
        plan = plan_native(reader.facts, options)
        workers = workers or default_workers()
        with staged_output(out, overwrite=overwrite, durable=False) as root:
            tag_dir = root / plan.tag
            tag_dir.mkdir()
            view = _DenseView(reader, dense)
            write_zero12(view, plan_native(view.facts, options, batch_note=False), tag_dir, workers)
            scratch = [root / f".experts-{e}" for e in range(ep)]
            for e, folder in enumerate(scratch):
                folder.mkdir()
                part = _ExpertView(reader, experts, layers, ep, e)
                part_plan = plan_native(part.facts, replace(options, dp=options.dp // ep), batch_note=False)
                write_zero12(part, part_plan, folder, workers)
            _merge_files(tag_dir, scratch, dense, experts, plan)
            _merge_model(tag_dir, scratch[0], dense, experts, layers)
            for folder in scratch:
                shutil.rmtree(folder)
            _write_experts(reader, tag_dir, experts, layers, plan.dtype)
            (root / LATEST).write_text(plan.tag)
        logger.debug("wrote a MoE checkpoint for %d ranks at ep_size=%d to %s", options.dp, ep, out)
        return plan
    finally:
        if reader is not source:
            reader.close()
