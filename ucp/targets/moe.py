"""Universal (or any reader of a MoE run) -> a native legacy-MoE ZeRO-1/2 checkpoint that DeepSpeed loads at
world size W with expert-parallel size E (``deepspeed.moe.layer.MoE(ep_size=E)``).

Call order: :func:`write_moe` checks the sizes against the run's MoE layers (the reader's ``extras()["moe"]``,
which :class:`~ucp.sources.moe.MoeSource` records), renames the expert param groups ``ep_size_E``, and plans
one ZeRO-1/2 write in which each expert group is cut in E sets (``NativePlan.zero12_sets``): set e holds
expert-parallel rank e's experts under their local names, partitioned over its W / E expert-data-parallel
ranks. The native writer then writes every rank file once (the dense groups over all W ranks), the
model-states file with rank 0's local param shapes and ``num_experts``; every expert gets its
``layer_L_expert_E`` file (:mod:`ucp.deepspeed.moe`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ucp.deepspeed.layout import LATEST, expert_file
from ucp.deepspeed.moe import ep_group_name, expert_name, expert_parts
from ucp.errors import ConfigError
from ucp.io.guard import OutputPolicy, guarded_output, weight_bytes
from ucp.io.pool import default_workers
from ucp.io.torchzip import write_torch_file
from ucp.model.options import RestoreOptions, options_with
from ucp.model.records import Facts, Reader, ReaderView, torch_dtype
from ucp.sources import opened
from ucp.targets.experts import expert_format, serves_experts
from ucp.targets.native import NativePlan, plan_native
from ucp.targets.native.plan import Zero12Sets
from ucp.targets.native.zero12 import write_zero12

__all__ = ["FORMAT", "MoeLayer", "moe_layers", "source_ep_size", "write_moe"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MoeLayer:
    """One MoE module of the run: its name, its order among the model's MoE modules, its expert count."""

    module: str
    layer: int
    experts: int


def moe_layers(reader: Reader) -> list[MoeLayer]:
    """The MoE layers a reader of a MoE run records, in layer order."""
    record = _record(reader)
    if not record.get("layers"):
        raise ConfigError("the checkpoint records no MoE layers: it was not read from a legacy DeepSpeed MoE run")
    return sorted(
        (MoeLayer(str(x["module"]), int(x["layer"]), int(x["experts"])) for x in record["layers"]),
        key=lambda x: x.layer,
    )


def _record(reader: Reader) -> Mapping[str, Any]:
    """The MoE layers the reader's facts record (empty when it holds none)."""
    layout = reader.facts.layout
    return layout.record if layout is not None and layout.kind == "moe" else {}


def source_ep_size(reader: Reader) -> int:
    """The expert-parallel size the MoE run was saved at, when every MoE layer shares one."""
    layers = _record(reader).get("layers")
    sizes = sorted({int(x["ep_size"]) for x in layers or () if isinstance(x, Mapping) and "ep_size" in x})
    if len(sizes) != 1:
        seen = f"ep_size {', '.join(map(str, sizes))}" if sizes else "no ep_size"
        raise ConfigError(f"the checkpoint's MoE layers record {seen}: give the new run's expert-parallel size (--ep)")
    return sizes[0]


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


class _RenamedGroups(ReaderView):
    """The reader with its expert param groups named ``ep_size_E``: DeepSpeed finds a group's
    expert-data-parallel ranks by that name."""

    def __init__(self, inner: Reader, experts: list[int], ep: int) -> None:
        facts = inner.facts
        groups = list(facts.groups)
        for g in experts:
            meta, name = groups[g], ep_group_name(ep)
            groups[g] = replace(
                meta,
                raw={**meta.raw, "name": name},
                hyper=replace(meta.hyper, extra={**meta.hyper.extra, "name": name}),
            )
        super().__init__(inner, replace(facts, groups=groups))


def _expert_sets(facts: Facts, g: int, layers: list[MoeLayer], ep: int) -> Zero12Sets:
    """Expert group g cut by expert-parallel rank: rank e's experts (``e * L .. e * L + L - 1`` of each
    layer, L = experts / ep), in the group's order, labelled by their local index."""
    local = {x.module: x.experts // ep for x in layers}
    names: list[list[str]] = [[] for _ in range(ep)]
    labels: list[list[str]] = [[] for _ in range(ep)]
    for name in facts.groups[g].params:
        module, index, rest = expert_parts(name) or ("", -1, "")
        e = index // local[module]
        names[e].append(name)
        labels[e].append(expert_name(module, index - e * local[module], rest))
    return Zero12Sets(tuple(map(tuple, names)), tuple(map(tuple, labels)))


def _check_sizes(layers: list[MoeLayer], world: int, ep: int) -> None:
    if ep < 1 or world % ep:
        raise ConfigError(f"ep_size={ep} must divide the number of ranks ({world}): DeepSpeed refuses it")
    for x in layers:
        if x.experts % ep:
            raise ConfigError(f"{x.module} has {x.experts} experts, which ep_size={ep} does not divide")


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
    overwrite: bool | OutputPolicy = False,
    workers: int | None = None,
    fsync: bool = False,
    **fields: Any,
) -> NativePlan:
    """Write ``out/latest`` and ``out/<tag>/`` for a legacy-MoE run of ``dp`` ranks at expert-parallel size ``ep``
    (``fsync``: flushed to disk before it is published)."""
    options = options_with(options, **fields)
    if options.stage not in (1, 2) or options.tp != 1:
        raise ConfigError("a MoE target is ZeRO-1 or ZeRO-2 at TP=1")
    with opened(source) as reader:
        layers = moe_layers(reader)
        _check_sizes(layers, options.dp, ep)
        _, experts = _split(reader.facts)
        view = _RenamedGroups(reader, experts, ep)
        plan = plan_native(view.facts, options)
        plan.zero12_sets = {g: _expert_sets(view.facts, g, layers, ep) for g in experts}
        plan.model_fields = {"num_experts": [x.experts for x in layers], "ds_autoep_layers": None}
        size = weight_bytes(reader.facts, plan.dtype)
        with guarded_output(out, reader.inputs, overwrite, size=size, durable=fsync) as root:
            tag_dir = root / plan.tag
            tag_dir.mkdir()
            write_zero12(view, plan, tag_dir, workers or default_workers())
            _write_experts(reader, tag_dir, experts, layers, plan.dtype)
            (root / LATEST).write_text(plan.tag)
        logger.debug("wrote a MoE checkpoint for %d ranks at ep_size=%d to %s", options.dp, ep, out)
        return plan


def _is_autoep(reader: Reader) -> bool:
    layout = reader.facts.layout
    return layout is not None and layout.kind == "autoep"


FORMAT = expert_format(
    name="deepspeed-moe",
    label="a DeepSpeed mixture-of-experts checkpoint (deepspeed.moe)",
    docs="format.md#expert-parallelism-legacy-deepspeedmoelayermoe",
    noun="a MoE",
    size="ep_size",
    write=write_moe,
    source_ep_size=source_ep_size,
    serves=serves_experts(_is_autoep, False),
)
