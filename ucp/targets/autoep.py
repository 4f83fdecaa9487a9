"""Universal (or any reader of an AutoEP run) -> a native AutoEP ZeRO-1/2 or ZeRO-3 checkpoint that DeepSpeed loads at
world size W with ``expert_parallel.autoep_size`` E.

Call order: :func:`write_autoep` reads the run's AutoEP layers (the reader's ``extras()["autoep"]``, which
:class:`~ucp.sources.autoep.AutoEpSource` records) and checks the sizes; :class:`_FusedExperts` shows the reader with
each expert group's per-expert parameters stacked into the fused tensors ``{module}.experts.w1/w2/w3`` that each
expert-parallel rank holds (``[L, ...]``, L = experts / E) and the group renamed ``ep_size_E``; one ZeRO-1/2 write
cuts that group in E sets (``NativePlan.zero12_sets``, as the legacy MoE target does), set p holding rank p's fused
tensors under their local names, partitioned over its W / E expert-data-parallel ranks. The model-states file gets
``num_experts``, ``ds_autoep_layers`` and ``universal_checkpoint_info`` for the new sizes, and every expert its
``layer_L_expert_E`` file (:mod:`ucp.deepspeed.autoep`). At ZeRO-3 the same sets go to the ZeRO-3 writer, each
fused tensor partitioned on its own over the set's ranks; there are no expert files, and every rank's model states
carry its own view of the layers (``zero3_partitioned``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ucp.deepspeed.autoep import (
    AUTOEP_LAYERS,
    WEIGHTS,
    AutoEpLayer,
    autoep_entry,
    expert_name,
    expert_parts,
    universal_info,
    zero3_rank_entry,
)
from ucp.deepspeed.layout import LATEST, expert_file
from ucp.deepspeed.moe import ep_group_name
from ucp.deepspeed.states import config_for_stage
from ucp.errors import ConfigError, InputError
from ucp.io.guard import OutputPolicy, guarded_output, weight_bytes
from ucp.io.pool import default_workers
from ucp.io.torchzip import write_torch_file
from ucp.model.options import RestoreOptions, options_with
from ucp.model.records import GroupMeta, ParamMeta, ParamState, Reader, ReaderView, torch_dtype
from ucp.sources import opened
from ucp.targets.experts import expert_format, serves_experts
from ucp.targets.native import NativePlan, plan_native
from ucp.targets.native.plan import Zero12Sets
from ucp.targets.native.zero3 import write_zero3
from ucp.targets.native.zero12 import write_zero12

__all__ = ["FORMAT", "autoep_layers_of", "is_autoep", "source_ep_size", "write_autoep"]

logger = logging.getLogger(__name__)


def autoep_layers_of(reader: Reader) -> list[AutoEpLayer]:
    """The AutoEP layers a reader of an AutoEP run records, in layer order."""
    layout = reader.facts.layout
    record = layout.record if layout is not None and layout.kind == "autoep" else {}
    if not record.get("layers"):
        raise ConfigError("the checkpoint records no AutoEP layers: it was not read from a DeepSpeed AutoEP run")
    return sorted(
        (
            AutoEpLayer(
                layer=int(x["layer"]),
                module=str(x["module"]),
                prefix=str(x["prefix"]),
                experts=int(x["experts"]),
                ep_size=int(x["ep_size"]),
                placement=(),
                shapes={w: tuple(int(d) for d in s) for w, s in x["shapes"].items()},
            )
            for x in record["layers"]
        ),
        key=lambda x: x.layer,
    )


def is_autoep(reader: Reader) -> bool:
    """The reader records AutoEP layers (an AutoEP checkpoint, or a universal directory made from one): only
    :func:`write_autoep` writes what its run loads (fused experts under their local names)."""
    layout = reader.facts.layout
    return layout is not None and layout.kind == "autoep"


def source_ep_size(reader: Reader) -> int:
    """The ``autoep_size`` the AutoEP run was saved at (DeepSpeed 0.19.8 saves all layers at one)."""
    return autoep_layers_of(reader)[0].ep_size


def _check_sizes(layers: list[AutoEpLayer], world: int, ep: int) -> None:
    if ep < 1 or world % ep:
        raise ConfigError(f"autoep_size={ep} must divide the number of ranks ({world}): DeepSpeed refuses it")
    for x in layers:
        if x.experts % ep:
            raise ConfigError(f"{x.module} has {x.experts} experts, which autoep_size={ep} does not divide")


class _FusedExperts(ReaderView):
    """The reader with each expert group's experts stacked into the fused tensors of each expert-parallel rank:
    ``{prefix}.{w}@ep{p}`` of shape ``[L, ...]``, labelled ``{prefix}.{w}`` in the rank files."""

    def __init__(self, inner: Reader, layers: list[AutoEpLayer], ep: int) -> None:
        facts = inner.facts
        by_prefix = {x.prefix: x for x in layers}
        self.members: dict[str, list[str]] = {}
        self.sets: dict[int, Zero12Sets] = {}
        groups: list[GroupMeta] = []
        params: list[ParamMeta] = []
        for meta in facts.groups:
            if not meta.raw.get("moe"):
                groups.append(meta)
                params += [facts.param(n) for n in meta.params]
                continue
            pairs = _fused_pairs(meta, by_prefix)
            names: list[list[str]] = [[] for _ in range(ep)]
            for p in range(ep):
                for x, weight in pairs:
                    local = x.experts // ep
                    fused = f"{x.fused(weight)}@ep{p}"
                    self.members[fused] = [expert_name(x.prefix, weight, e) for e in range(p * local, (p + 1) * local)]
                    first = facts.param(self.members[fused][0])
                    params.append(replace(first, name=fused, shape=(local, *first.shape)))
                    names[p].append(fused)
            labels = tuple(tuple(n.rsplit("@", 1)[0] for n in set_names) for set_names in names)
            self.sets[meta.index] = Zero12Sets(tuple(map(tuple, names)), labels)
            name = ep_group_name(ep)
            groups.append(
                replace(
                    meta,
                    params=[n for set_names in names for n in set_names],
                    raw={**meta.raw, "name": name},
                    hyper=replace(meta.hyper, extra={**meta.hyper.extra, "name": name}),
                )
            )
        params += [p for p in facts.params if p.frozen]
        super().__init__(inner, replace(facts, groups=groups, params=params))

    def param_steps(self) -> dict[str, int | None]:
        steps = self.inner.param_steps()
        return {m.name: steps[self.members[m.name][0] if m.name in self.members else m.name] for m in self.facts.params}

    def read(self, name: str, *, moments: bool = True) -> ParamState:
        members = self.members.get(name)
        if members is None:
            return self.inner.read(name, moments=moments)
        states = [self.inner.read(m, moments=moments) for m in members]
        if len({s.step for s in states}) != 1 or len({tuple(s.optim) for s in states}) != 1:
            raise InputError(f"the experts stacked into {name} disagree on their step or state keys")
        return ParamState(
            fp32=torch.stack([s.fp32 for s in states]),
            optim={k: torch.stack([s.optim[k] for s in states]) for k in states[0].optim},
            step=states[0].step,
            scalars=dict(states[0].scalars),
        )

    def reads_whole(self, name: str) -> bool:
        return name in self.members  # the stacked experts


def _fused_pairs(meta: GroupMeta, layers: Mapping[str, AutoEpLayer]) -> list[tuple[AutoEpLayer, str]]:
    """The (layer, weight) fused tensors an expert group holds, in its order; each with all its experts."""
    seen: dict[tuple[str, str], set[int]] = {}
    for name in meta.params:
        parts = expert_parts(name)
        if parts is None or parts[0] not in layers:
            raise ConfigError(f"{name} is in an expert param group but is not an AutoEP expert slice")
        seen.setdefault((parts[0], parts[1]), set()).add(parts[2])
    out = []
    for (prefix, weight), experts in seen.items():
        x = layers[prefix]
        if experts != set(range(x.experts)):
            raise ConfigError(f"param group {meta.index} holds only some experts of {x.fused(weight)}")
        out.append((x, weight))
    return out


def _write_experts(reader: Reader, tag_dir: Path, layers: list[AutoEpLayer], dtype: str) -> None:
    """One ``layer_L_expert_E`` file per expert: its three slices in the run's dtype, under global names."""
    lp = torch_dtype(dtype)
    for x in layers:
        for e in range(x.experts):
            names = [expert_name(x.prefix, w, e) for w in WEIGHTS]
            weights = {n: reader.read(n, moments=False).fp32.to(lp) for n in names}
            write_torch_file(weights, tag_dir / expert_file(x.layer, e))


def _model_fields(reader: Reader, layers: list[AutoEpLayer], world: int, ep: int, stage: int) -> dict[str, Any]:
    """The AutoEP fields every model-states file shares, with rank 0's layer view at ZeRO-1/2 (its one file)."""
    config = config_for_stage(reader.facts.info.ds_config, stage)
    if isinstance(config.get("expert_parallel"), Mapping):
        config = {**config, "expert_parallel": {**config["expert_parallel"], "autoep_size": ep}}
    fields = {
        "num_experts": [x.experts for x in layers],
        "ds_config": config,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
    }
    return fields if stage == 3 else {**fields, **_layer_fields(layers, world, ep, None)}


def _layer_fields(layers: list[AutoEpLayer], world: int, ep: int, rank: int | None) -> dict[str, Any]:
    """``ds_autoep_layers`` and ``universal_checkpoint_info``: rank 0's ZeRO-1/2 view (``rank`` None), or at ZeRO-3
    rank ``rank``'s own (DeepSpeed 0.19.8 writes each rank's expert-parallel and expert-data-parallel rank there)."""
    entries = [autoep_entry(x, ep=ep, world=world) for x in layers]
    if rank is not None:
        entries = [zero3_rank_entry(e, ep=ep, rank=rank) for e in entries]
    return {AUTOEP_LAYERS: entries, "universal_checkpoint_info": universal_info(entries)}


def write_autoep(
    source: Reader | str | os.PathLike,
    out: str | os.PathLike,
    options: RestoreOptions | None = None,
    *,
    ep: int,
    overwrite: bool | OutputPolicy = False,
    workers: int | None = None,
    fsync: bool = False,
    **fields: Any,
) -> NativePlan:
    """Write ``out/latest`` and ``out/<tag>/`` for an AutoEP run of ``dp`` ranks at ``autoep_size`` ``ep``, ZeRO-1, 2
    or 3 (``fsync``: flushed to disk before it is published)."""
    options = options_with(options, **fields)
    if options.stage not in (1, 2, 3) or options.tp != 1:
        raise ConfigError("an AutoEP target is ZeRO-1, 2 or 3 at TP=1")
    with opened(source) as reader:
        layers = autoep_layers_of(reader)
        _check_sizes(layers, options.dp, ep)
        view = _FusedExperts(reader, layers, ep)
        plan = plan_native(view.facts, options, sets=view.sets)
        plan.model_fields = _model_fields(reader, layers, options.dp, ep, options.stage)
        workers = workers or default_workers()
        size = weight_bytes(reader.facts, plan.dtype)
        with guarded_output(out, reader.inputs, overwrite, size=size, durable=fsync) as root:
            tag_dir = root / plan.tag
            tag_dir.mkdir()
            if plan.stage == 3:
                write_zero3(view, plan, tag_dir, workers, rank_fields=lambda r: _layer_fields(layers, plan.dp, ep, r))
            else:
                write_zero12(view, plan, tag_dir, workers)
                _write_experts(reader, tag_dir, layers, plan.dtype)
            (root / LATEST).write_text(plan.tag)
        logger.debug("wrote an AutoEP checkpoint for %d ranks at autoep_size=%d to %s", options.dp, ep, out)
        return plan


FORMAT = expert_format(
    name="deepspeed-autoep",
    label="a DeepSpeed AutoEP checkpoint (expert_parallel)",
    docs="format.md#expert-parallelism-autoep-0198-expert_parallel-config",
    noun="an AutoEP",
    size="autoep_size",
    write=write_autoep,
    source_ep_size=source_ep_size,
    serves=serves_experts(is_autoep, True),
)
