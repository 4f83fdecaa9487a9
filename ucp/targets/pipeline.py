"""Universal (or any reader) -> a native pipeline-parallel checkpoint that DeepSpeed's PipelineEngine loads
at PP x TP x DP (ZeRO-0/1), given the new run's layer partition.

Call order: :class:`PipelineLayout` says which layers each stage holds (DeepSpeed's ``PipelineModule.parts``)
and which layers use each tied module; :func:`write_pipeline` plans one ZeRO-1 write and, per stage and TP
rank, hands the stage's parameters (a view of the reader, cut for the TP rank by the recorded rules) to the
ZeRO-1/2 native writer under the mp rank ``stage * tp + tp_rank``, then moves the module out of that
model-states file into layer files, as PipelineEngine saves them (:mod:`ucp.deepspeed.pipeline`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from ucp.deepspeed.layout import LATEST, layer_file, model_file
from ucp.deepspeed.pipeline import PARALLEL_DIMS, TIED_PREFIX
from ucp.errors import ConfigError
from ucp.io.guard import OutputPolicy, guarded_output, weight_bytes
from ucp.io.pool import default_workers
from ucp.io.torchfile import load
from ucp.io.torchzip import write_torch_file
from ucp.model.options import RestoreOptions, options_with
from ucp.model.records import Facts, Reader, ReaderView
from ucp.model.stages import METHODS, balanced_parts, uniform_parts
from ucp.sources import opened
from ucp.targets.format import Request, TargetFormat, Written
from ucp.targets.native import NativePlan, native_written, plan_native
from ucp.targets.native.zero12 import write_zero12
from ucp.targets.tensor_parallel import TpShardReader, rank_layouts

__all__ = ["FORMAT", "PipelineLayout", "StageView", "layout_of", "write_pipeline"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PipelineLayout:
    """The new run's partition: stage ``s`` holds layers ``parts[s] .. parts[s+1]-1`` (what
    ``PipelineModule.parts`` holds after ``partition_method`` ran); ``tied`` maps each TiedLayerSpec key to
    the layers using it."""

    parts: tuple[int, ...]
    tied: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        parts = list(self.parts)
        if len(parts) < 2 or parts[0] != 0 or any(b <= a for a, b in zip(parts, parts[1:])):
            raise ConfigError(
                f"layer partition {parts} is not one: it starts at 0 and rises stage by stage (PipelineModule.parts, "
                "e.g. 0,3,6 for 2 stages of 3 layers)"
            )
        for key, layers in self.tied.items():
            if not layers or any(layer < 0 for layer in layers):
                raise ConfigError(f"tied module {key!r} needs the indices of the layers using it, e.g. {key}=0,5")

    @classmethod
    def parse(cls, parts: str, tied: Sequence[str] = ()) -> PipelineLayout:
        """From the command line's spelling: ``"0,3,6"`` and ``["embed=0,5"]``."""
        try:
            bounds = tuple(int(x) for x in parts.split(","))
        except ValueError:
            raise ConfigError("--pp-parts: give comma-separated layer indices (--pp-parts 0,3,6)") from None
        return cls(bounds, cls.parse_tied(tied))

    @staticmethod
    def parse_tied(tied: Sequence[str]) -> dict[str, tuple[int, ...]]:
        """``["embed=0,5"]`` (``--pp-tied``) as ``{"embed": (0, 5)}``."""
        try:
            keyed = [item.split("=", 1) for item in tied]
            layers = {key: tuple(int(x) for x in value.split(",")) for key, value in keyed}
        except ValueError:
            raise ConfigError("--pp-tied: give a key and comma-separated layer indices (--pp-tied embed=0,5)") from None
        if len(layers) != len(tied):
            raise ConfigError("--pp-tied names a tied module twice")
        return layers

    @property
    def pp(self) -> int:
        return len(self.parts) - 1

    def stage_of_layer(self, layer: int) -> int:
        for stage in range(self.pp):
            if self.parts[stage] <= layer < self.parts[stage + 1]:
                return stage
        raise ConfigError(f"layer {layer} is outside the partition {list(self.parts)}")

    def layers_of(self, name: str) -> tuple[int, ...]:
        """The layers holding a parameter or buffer named as PipelineModule names it."""
        if name.startswith(TIED_PREFIX):
            key = name[len(TIED_PREFIX) :].split(".", 1)[0]
            if key not in self.tied:
                raise ConfigError(
                    f"{name} belongs to tied module {key!r}; give the layers using it (PipelineLayout.tied; "
                    f"ucp restore --pp-tied {key}=0,5)"
                )
            return tuple(self.tied[key])
        head = name.split(".", 1)[0]
        if not head.isdigit():
            raise ConfigError(f"{name} is not a PipelineModule name ('<layer>.<name>' or 'tied_modules.<key>.<name>')")
        return (int(head),)

    def stages_of(self, name: str) -> list[int]:
        return sorted({self.stage_of_layer(layer) for layer in self.layers_of(name)})

    @classmethod
    def by_method(
        cls, method: str, pp: int, layers: int, tied: Mapping[str, Sequence[int]], facts: Facts
    ) -> PipelineLayout:
        """The partition a PipelineModule with ``partition_method=method`` makes of ``layers`` layer specs
        (every entry of its ``layers`` list, functions included: the checkpoint cannot tell how many
        there are) on ``pp`` stages; ``parameters`` weighs each layer by the trainable elements
        ``facts`` give it (a tied module's at every layer using it, as DeepSpeed counts them)."""
        fixed: dict[str, tuple[int, ...]] = {key: tuple(used) for key, used in tied.items()}
        if method == "uniform":
            parts = uniform_parts(layers, pp)
        elif method == "parameters":
            probe = cls((0, max(layers, 1)), fixed)
            weights = [0] * layers
            for meta in facts.params:
                for layer in () if meta.frozen else probe.layers_of(meta.name):
                    if layer >= layers:
                        raise ConfigError(f"{meta.name} is in layer {layer}, but the model has {layers} layers")
                    weights[layer] += meta.numel
            parts = balanced_parts(weights, pp)
        else:
            raise ConfigError(
                f"partition method {method!r}: ucp reproduces {' and '.join(METHODS)}; give the layer partition "
                "itself for any other (PipelineModule.parts)"
            )
        if len(set(parts)) != len(parts):
            raise ConfigError(f"{layers} layers cannot fill {pp} pipeline stages ({method} partition {parts})")
        return cls(tuple(parts), fixed)


class StageView(ReaderView):
    """The reader seen as one stage's model: the parameters (group by group, in order) and buffers that
    ``holds`` names. A stage's files are written from one; a live PipelineEngine stage restores from one
    built from its module's names (:mod:`ucp.targets.engine.pipeline`)."""

    def __init__(self, inner: Reader, holds: Callable[[str], bool]) -> None:
        facts = inner.facts
        if facts.tied:
            raise ConfigError("a pipeline target cannot carry tied aliases; tie layers with TiedLayerSpec")
        keep = {p.name for p in facts.params if holds(p.name)}
        self._buffers = [n for n in facts.buffer_names if holds(n)]
        super().__init__(inner, _stage_facts(facts, keep, self._buffers))

    def buffers(self) -> dict[str, torch.Tensor]:
        every = self.inner.buffers()
        return {n: every[n] for n in self._buffers if n in every}


class _StageReader(StageView):
    """The reader seen as stage ``stage`` of ``layout``."""

    def __init__(self, inner: Reader, layout: PipelineLayout, stage: int) -> None:
        super().__init__(inner, lambda name: stage in layout.stages_of(name))


def _stage_facts(facts: Facts, keep: set[str], buffers: list[str]) -> Facts:
    groups = [replace(g, params=[n for n in g.params if n in keep]) for g in facts.groups]
    params = [p for p in facts.params if p.name in keep]
    rules = {n: r for n, r in facts.tp_rules.items() if n in keep}
    return replace(facts, groups=groups, params=params, buffer_names=buffers, tp_rules=rules)


def _local(name: str) -> str:
    """A name within its layer's state dict: without ``<layer>.`` or ``tied_modules.<key>.``."""
    if name.startswith(TIED_PREFIX):
        return name[len(TIED_PREFIX) :].split(".", 1)[1]
    return name.split(".", 1)[1]


def _to_layer_files(tag_dir: Path, layout: PipelineLayout, stage: int, tp: int, tp_rank: int) -> None:
    """Move a stage's module (one TP rank's shards of it) from its model-states file into one file per
    layer (every layer of the stage gets one, empty when it holds nothing: PipelineEngine loads a file
    for every module layer; ``-model_YY`` in the names only under TP, as DeepSpeed's topologies do)."""
    path = tag_dir / model_file(stage * tp + tp_rank)
    states: dict[str, Any] = dict(load(path))
    module = states["module"]
    for layer in range(layout.parts[stage], layout.parts[stage + 1]):
        held = {_local(name): value for name, value in module.items() if layer in layout.layers_of(name)}
        write_torch_file(held, tag_dir / layer_file(layer, tp_rank if tp > 1 else None))
    states.update(module=None, mp_world_size=layout.pp * tp)
    states[PARALLEL_DIMS] = {"pp_degree": layout.pp, "tp_degree": tp}
    path.unlink()
    write_torch_file(states, path)


def _tp_views(stage: Reader, tp: int) -> list[Reader]:
    """The stage as each TP rank holds it (the stage itself at TP=1, so that it streams)."""
    if tp == 1:
        return [stage]
    return [TpShardReader(stage, rank_layouts(stage, tp, t), tp=tp, rank=t) for t in range(tp)]


def write_pipeline(
    source: Reader | str | os.PathLike,
    out: str | os.PathLike,
    layout: PipelineLayout,
    options: RestoreOptions | None = None,
    *,
    overwrite: bool | OutputPolicy = False,
    workers: int | None = None,
    fsync: bool = False,
    **fields: Any,
) -> NativePlan:
    """Write ``out/latest`` and ``out/<tag>/`` for a PipelineEngine at ``layout.pp`` stages x ``tp`` x ``dp``
    (``tp`` > 1 cuts each stage's parameters by the rules the reader records, as a TP restore does)."""
    options = options_with(options, **fields)
    if options.stage != 1:
        raise ConfigError(
            "a pipeline target is ZeRO-1: PipelineEngine refuses ZeRO-2/3, and ucp does not write its stage-0 files yet"
        )
    with opened(source) as reader:
        views = [_StageReader(reader, layout, s) for s in range(layout.pp)]
        placed = {p.name for view in views for p in view.facts.params}
        missing = [p.name for p in reader.facts.params if p.name not in placed]
        if missing:
            raise ConfigError(f"{missing[0]} is on no stage of the partition {list(layout.parts)}")
        plan = plan_native(reader.facts, options)
        size = weight_bytes(reader.facts, plan.dtype)
        with guarded_output(out, reader.inputs, overwrite, size=size, durable=fsync) as root:
            tag_dir = root / plan.tag
            tag_dir.mkdir()
            for stage, view in enumerate(views):
                for tp_rank, shard in enumerate(_tp_views(view, options.tp)):
                    stage_plan = replace(plan_native(view.facts, options), mp_rank=stage * options.tp + tp_rank)
                    write_zero12(shard, stage_plan, tag_dir, workers or default_workers())
                    _to_layer_files(tag_dir, layout, stage, options.tp, tp_rank)
            (root / LATEST).write_text(plan.tag)
        return plan


def layout_of(request: Request, facts: Facts) -> PipelineLayout:
    """The new run's partition from a request's ``pp``, ``pp_parts`` or ``pp_partition`` + ``pp_layers``, and
    ``pp_tied`` (``ucp restore --pp``), each problem in one line."""
    parts, method, layers = request.get("pp_parts"), request.get("pp_partition"), request.get("pp_layers")
    pp, tied_given = int(request.get("pp")), list(request.get("pp_tied") or ())
    if (parts is None) == (method is None):
        raise ConfigError(
            "--pp needs the new run's layer partition: --pp-parts 0,3,6 (its PipelineModule.parts) or "
            "--pp-partition uniform|parameters --pp-layers N (its partition_method), and --pp-tied KEY=LAYERS for "
            "each TiedLayerSpec key"
        )
    if method is not None and layers is None:
        raise ConfigError("--pp-partition needs --pp-layers: the length of the PipelineModule's layer list")
    if parts is not None:
        layout = PipelineLayout.parse(parts, tied_given)
        if layout.pp != pp:
            raise ConfigError(f"--pp-parts {parts} cuts {layout.pp} stages, but --pp is {pp}")
        return layout
    return PipelineLayout.by_method(method, pp, int(layers), PipelineLayout.parse_tied(tied_given), facts)


def _write(reader: Reader, out: Path, request: Request) -> Written:
    """A PipelineEngine checkpoint: ZeRO-1 unless asked (PipelineEngine runs ZeRO-0/1)."""
    layout = layout_of(request, reader.facts)
    options = request.restore_options(1)
    plan = write_pipeline(
        reader, out, layout, options, overwrite=request.overwrite, workers=request.workers, fsync=request.fsync
    )
    sizes = f"pp={layout.pp} x " + (f"tp={plan.tp} x " if plan.tp > 1 else "") + f"dp={plan.dp}"
    return native_written(
        plan, out, noun="a pipeline", layout=sizes, format="deepspeed-pipeline", pp=layout.pp, parts=list(layout.parts)
    )


FORMAT = TargetFormat(
    name="deepspeed-pipeline",
    label="a DeepSpeed pipeline checkpoint (PipelineEngine)",
    docs="format.md#pipeline-parallelism-deepspeedpipepipelinemodule-pipelineengine",
    write=_write,
    serves=lambda reader, request: request.has("pp"),
)
