"""The migration config's schema: one dataclass per YAML mapping, with the checks of each field."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ucp.errors import ConfigError
from ucp.migrate.checking import Check, Node, checked
from ucp.migrate.issues import Issue, KeyPath, Origin
from ucp.model.option_table import DCP_OPTIMIZER_NAMES, FOLDERS, FORMAT_NAMES, OPTIONS, Option, not_taken
from ucp.model.options import RestoreOptions
from ucp.model.records import DTYPES, Facts
from ucp.model.stages import METHODS
from ucp.targets.pipeline import PipelineLayout
from ucp.transforms import Drop, Rename, ResetOptimizer, Step

EXPORT_FORMATS = ("safetensors", "torch")
EXPORT_SUFFIXES = {"safetensors": (".safetensors",), "torch": (".bin", ".pt", ".pth")}  # else OUT is a folder
SIZE_PATTERN = re.compile(r"^\s*(\d+(\.\d*)?|\.\d+)\s*([kmgt]i?b|b)?\s*$", re.IGNORECASE)


def _positive(value: int) -> Iterator[tuple[KeyPath, str]]:
    if value < 1:
        yield (), f"must be a positive integer, got {value}"


def _one_of(choices: Iterable[Any]) -> Check:
    choices = tuple(choices)

    def check(value: Any) -> Iterator[tuple[KeyPath, str]]:
        if value is not None and value not in choices:
            names = [str(c) for c in choices]
            # "adamw" names the tail of several flavours (sf-adamw, torch-adamw): each of them, else the closest
            close = [n for n in names if n.split("-", 1)[-1] == str(value)] or difflib.get_close_matches(
                str(value), names, n=1
            )
            hint = f" (did you mean {' or '.join(map(repr, close[:3]))}?)" if close else ""
            yield (), f"must be one of {', '.join(map(str, choices))}, got {value!r}{hint}"

    return check


def _regex(value: str) -> Iterator[tuple[KeyPath, str]]:
    try:
        re.compile(value)
    except re.error as err:
        yield (), f"{value!r} is not a valid regular expression: {err}"


def _patterns(value: Any) -> Iterator[tuple[KeyPath, str]]:
    if not isinstance(value, list):
        return  # None, or a mapping form that checks its own
    if not value:
        yield (), "must list at least one regular expression"
    for j, pattern in enumerate(value):
        for _, message in _regex(pattern):
            yield (j,), message


def _step_value(value: str | int) -> Iterator[tuple[KeyPath, str]]:
    if isinstance(value, str) and value not in ("keep", "reset"):
        yield (), f"must be keep, reset or a non-negative integer, got {value!r}"
    elif isinstance(value, int) and value < 0:
        yield (), f"must be keep, reset or a non-negative integer, got {value}"


def _tag(value: str | None) -> Iterator[tuple[KeyPath, str]]:
    if value is not None and (not value or "/" in value or value in (".", "..")):
        yield (), f"{value!r} is not a folder name"


def _size(value: str | int | None) -> Iterator[tuple[KeyPath, str]]:
    if isinstance(value, int) and value < 1:
        yield (), f"must be a positive number of bytes, got {value}"
    elif isinstance(value, str) and not SIZE_PATTERN.match(value):
        yield (), f"must be a size such as 500MB or 5GB, got {value!r}"


@dataclass
class RenameConfig(Node):
    """``re.sub(pattern, replace, name)`` on every parameter, tied alias and buffer name."""

    pattern: str = field(metadata={"check": _regex})  # required: no default, unlike checked()
    replace: str


@dataclass
class ResetConfig(Node):
    """``reset_optimizer`` in full: which parameters, and whether their step restarts at 0 too."""

    params: list[str] = checked(_patterns)
    step: str = checked(_one_of(("zero", "keep")), default="zero")


@dataclass
class TransformConfig(Node):
    """One list item of ``transforms:``; exactly one of its keys is given."""

    rename: RenameConfig | None = None
    drop: list[str] | None = checked(_patterns, default=None)
    reset_optimizer: list[str] | ResetConfig | None = checked(_patterns, default=None)

    def kinds(self) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name) is not None]

    def cross_issues(self) -> Iterator[Issue]:
        kinds = self.kinds()
        if not kinds:
            yield Issue((), "must hold one of rename, drop, reset_optimizer")
        elif len(kinds) > 1:
            yield Issue((), f"holds {' and '.join(kinds)}; give each transform its own list item (they run in order)")

    def to_step(self) -> Step:
        if self.rename is not None:
            return Rename(self.rename.pattern, self.rename.replace)
        if self.drop is not None:
            return Drop(tuple(self.drop))
        if isinstance(self.reset_optimizer, ResetConfig):
            return ResetOptimizer(tuple(self.reset_optimizer.params), keep_step=self.reset_optimizer.step == "keep")
        return ResetOptimizer(tuple(self.reset_optimizer or ()))


@dataclass
class TpRuleConfig(Node):
    """How parameters matching ``pattern`` (re.match on the source's names) lie across TP ranks."""

    pattern: str = checked(_regex)
    kind: str = checked(_one_of(("split", "replicated", "average")), default="split")
    dim: int = 0  # the dim a split cuts
    parts: list[int] | None = None  # fused sub-parameters along dim (gate/up, q/k/v), each cut on its own
    vocab: int | None = None  # real vocabulary rows on dim 0; the rest of the TP shards is padding

    def cross_issues(self) -> Iterator[Issue]:
        if self.kind != "split" and (self.parts is not None or self.vocab is not None or self.dim):
            yield Issue((), f"dim, parts and vocab describe a split; a {self.kind} parameter takes none")
        if isinstance(self.parts, list) and any(not isinstance(p, int) or p < 1 for p in self.parts):
            yield Issue(("parts",), f"must list positive sizes, got {self.parts}")
        if self.vocab is not None and self.dim != 0:
            yield Issue(("vocab",), "vocabulary rows are on dim 0")

    def to_rule(self) -> Any:
        from ucp.model.tp import TpRule

        return TpRule(self.kind, dim=self.dim, parts=tuple(self.parts or ()), vocab=self.vocab)


@dataclass
class TensorParallelConfig(Node):
    """Rules for tensor-parallel layouts, where the checkpoint carries none (or to override its own)."""

    rules: list[TpRuleConfig] = field(default_factory=list)

    def pairs(self) -> list[tuple[str, Any]]:
        return [(r.pattern, r.to_rule()) for r in self.rules]


@dataclass
class PipelineConfig(Node):
    """The new run's layer partition, for a PipelineEngine checkpoint: stage ``s`` holds layers
    ``parts[s] .. parts[s+1]-1`` (``PipelineModule.parts``), or ``partition: uniform | parameters`` cuts
    ``layers`` layers on ``stages`` stages as that ``partition_method`` will; ``tied`` the layers using
    each TiedLayerSpec key. None of it is in a checkpoint, so it is given (``ucp restore --pp-parts 0,3,6
    --pp-tied embed=0,5``, or ``--pp-partition parameters --pp-layers 6``)."""

    parts: list[int] | None = None
    partition: str | None = checked(lambda v: _one_of(METHODS)(v) if v is not None else (), default=None)
    stages: int | None = checked(lambda v: _positive(v) if v is not None else (), default=None)
    layers: int | None = checked(lambda v: _positive(v) if v is not None else (), default=None)
    tied: dict[str, list[int]] = field(default_factory=dict)

    def cross_issues(self) -> Iterator[Issue]:
        if (self.parts is None) == (self.partition is None):
            yield Issue(
                ("parts",),
                "give the layer partition (parts: [0, 3, 6]) or a partition method (partition: uniform or "
                "parameters, with stages and layers): one of them",
            )
            return
        if self.partition is not None:
            for key in ("stages", "layers"):
                if getattr(self, key) is None:
                    yield Issue((key,), f"partition: {self.partition} needs {key} (the new run's {key})")
            return
        try:
            self.layout(None)
        except ConfigError as err:
            yield Issue(("tied",) if "tied module" in str(err) else ("parts",), str(err))

    @property
    def pp(self) -> int:
        return len(self.parts) - 1 if self.parts is not None else int(self.stages or 0)

    def describe(self) -> str:
        how = f"parts {self.parts}" if self.parts is not None else f"{self.partition} partition of {self.layers} layers"
        return f"{how}, tied {self.tied}"

    def layout(self, facts: Facts | None) -> PipelineLayout:
        """The partition; a method's needs the source's ``facts`` (``parameters`` weighs layers by them)."""
        tied = {key: tuple(layers) for key, layers in self.tied.items()}
        if self.parts is not None:
            return PipelineLayout(tuple(self.parts), tied)
        if facts is None or self.partition is None or self.stages is None or self.layers is None:
            raise ValueError("a partition method's layout needs the source's facts, stages and layers")
        return PipelineLayout.by_method(self.partition, self.stages, self.layers, tied, facts)


#: the target formats a migration names (``format:``); the others follow from the source (a Trainer folder) or
#: from ``pipeline``
TARGET_FORMATS = FORMAT_NAMES


def _option_check(o: Option) -> Check:
    """How a migration checks a declared option's value (its kind, as the command line reads it)."""
    if o.kind == "positive":
        return lambda v: _positive(v) if v is not None else ()
    if o.kind == "choice":
        return _one_of(o.choices)
    if o.kind == "step":
        return _step_value
    if o.kind == "tag":
        return _tag
    return lambda v: ()


def _option(yaml_key: str) -> Any:
    """A TargetConfig field for the option declared under ``yaml_key`` (ucp.model.option_table): its check and
    its "not given" default."""
    o = next(o for o in OPTIONS if o.yaml == yaml_key)
    return checked(_option_check(o), default=o.unset)


@dataclass
class TargetConfig(Node):
    """What the new run loads: a native DeepSpeed checkpoint (``engine.load_checkpoint``), or with
    ``format: dcp`` a torch.distributed.checkpoint folder for FSDP2, which reshards on load (no dp). Every key but
    ``output``, ``format`` and ``pipeline`` is a restore option declared in ucp.model.option_table, which also says
    the formats that take it."""

    output: Path
    format: str = checked(_one_of(TARGET_FORMATS), default="deepspeed")
    dp: int | None = _option("dp")  # deepspeed: required
    layout: str | None = _option("layout")  # dcp: get_state_dict's (None: torch), or torchtitan's
    stage: int | None = _option("stage")  # None: the source's, 1 for a pipeline (a Hugging Face folder: its own)
    optimizer: str | None = _option("optimizer")  # None: the source's (dcp: its torch optimizer, AdamW for Adam's)
    dtype: str | None = _option("dtype")  # None: the source's
    step: str | int = _option("step")
    tag: str | None = _option("tag")  # None: global_step<N>
    sub_group_size: int | None = _option("sub_group_size")
    tp: int = _option("tp")  # tensor-parallel degree of the new run
    offload: bool | None = _option("offload")  # the new run offloads its optimizer (None: as the source did)
    round_robin_gradients: bool | None = _option("round_robin_gradients")  # ZeRO-1/2 round-robin order
    zenflow: bool | None = _option("zenflow")  # the new run uses ZenFlow: its ZeRO-3 matrices transposed
    backend: str | None = _option("backend")  # a Trainer / Accelerate folder: deepspeed, fsdp-sharded or fsdp-full
    model_config: str | None = _option("model_config")  # megatron from a Llama run: its Hugging Face config.json
    pad_vocab: int = _option("pad_vocab")  # megatron from a Llama run: the vocabulary padded to a multiple of it
    pipeline: PipelineConfig | None = None  # a PipelineEngine checkpoint (ZeRO-1) for this partition

    def cross_issues(self) -> Iterator[Issue]:
        if self.format == "dcp" and self.optimizer is not None and self.optimizer not in DCP_OPTIMIZER_NAMES:
            yield Issue(
                ("optimizer",), f"a dcp output is read by a torch optimizer: one of {', '.join(DCP_OPTIMIZER_NAMES)}"
            )
        if self.format == "deepspeed" and self.optimizer == "torch-adamw" and self.backend in (None, "deepspeed"):
            yield Issue(
                ("optimizer",),
                "torch-adamw names a dcp output's optimizer; a native checkpoint takes torch-adam (AdamW is "
                "torch-adam with decoupled weight decay, kept from the source)",
            )
        for o in not_taken(self.format, self.values()):
            assert o.yaml is not None  # only keys of the YAML are in values()
            if self.format == "deepspeed" and o.targets & FOLDERS:
                continue  # a folder's option: the run refuses it unless the source is a Trainer or Accelerate folder
            if o.targets == {"dcp"}:
                yield Issue((o.yaml,), "describes a dcp output; set format: dcp or remove it")
            else:
                yield Issue(
                    (o.yaml,),
                    f"does not apply to format {self.format}: the folder holds fp32 masters and each parameter's own "
                    "step, and DCP reshards on load at any world size; remove it",
                )
        if self.format == "dcp" and self.pipeline is not None:
            yield Issue(("pipeline",), "does not apply to format dcp: a DCP folder has no pipeline stages; remove it")
        if self.format == "deepspeed":
            if self.pipeline is not None:
                yield from self._pipeline_issues()
            if self.dp is None:
                yield Issue(("dp",), "is required: the data-parallel size of the new run (or set format: dcp)")

    def values(self) -> dict[str, Any]:
        """Every declared option the YAML gave, by its option name (``layout`` is ``dcp_layout``)."""
        return {o.name: getattr(self, o.yaml) for o in OPTIONS if o.yaml is not None}

    def _pipeline_issues(self) -> Iterator[Issue]:
        """What ``ucp restore --pp`` refuses too, before anything is written: PipelineEngine runs ZeRO-0/1.
        (``tp`` is checked against the source's rules as for every native target.)"""
        if self.stage not in (None, 1):
            yield Issue(("stage",), f"a pipeline target is ZeRO-1 (PipelineEngine refuses ZeRO-2/3), got {self.stage}")

    def option_fields(self) -> dict[str, Any]:
        """The RestoreOptions fields as given (None: not given)."""
        return {name: getattr(self, name) for name in RestoreOptions.field_names()}

    def options(self, source_stage: int) -> RestoreOptions:
        """The same choices as the CLI's and the API's: one RestoreOptions, planned once. Unless told, the stage is
        the source's (``source_stage``), or ZeRO-1 for a pipeline target (PipelineEngine runs ZeRO-1, as ucp restore
        --pp)."""
        default = 1 if self.pipeline is not None else source_stage
        return RestoreOptions(**{**self.option_fields(), "stage": default if self.stage is None else self.stage})


@dataclass
class ExportConfig(Node):
    """Consolidated weights for inference or Hugging Face (``ucp.targets.export``)."""

    path: Path
    format: str = checked(_one_of(EXPORT_FORMATS), default="safetensors")
    dtype: str | None = checked(_one_of(DTYPES), default=None)  # None: the model's
    max_shard_size: str | int | None = checked(_size, default=None)  # None: the exporter's default


@dataclass
class MigrationConfig(Node):
    """A whole migration: what to read, how to change it, and what to write."""

    source: Path
    tag: str | None = checked(_tag, default=None)
    universal: Path | None = None
    transforms: list[TransformConfig] = field(default_factory=list)
    tensor_parallel: TensorParallelConfig | None = None
    target: TargetConfig | None = None
    exports: list[ExportConfig] = field(default_factory=list)
    origin: Origin = field(default_factory=Origin, repr=False, compare=False, metadata={"yaml": False})

    def cross_issues(self) -> Iterator[Issue]:
        if self.universal is None and self.target is None and not self.exports:
            yield Issue((), "nothing to write: give universal, target or exports")

    def outputs(self) -> list[tuple[KeyPath, Path]]:
        """Every path the migration writes, with its key path (the well-formed ones, if some are not)."""
        out: list[tuple[KeyPath, Any]] = [(("universal",), self.universal)]
        if isinstance(self.target, TargetConfig):
            out.append((("target", "output"), self.target.output))
        if isinstance(self.exports, list):
            out += [(("exports", i, "path"), e.path) for i, e in enumerate(self.exports) if isinstance(e, ExportConfig)]
        return [(at, path) for at, path in out if isinstance(path, Path)]
