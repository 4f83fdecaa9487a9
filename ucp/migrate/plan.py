"""Planning a migration: open the source, check what only the checkpoint can tell, decide; write nothing."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ucp.errors import UcpError
from ucp.migrate.dcp_target import describe_dcp, fsdp_backend, plan_dcp_target
from ucp.migrate.issues import Issue, KeyPath, config_error, raise_issues, show_path
from ucp.migrate.native_target import param_steps, plan_native_target, transform_path
from ucp.migrate.schema import (
    EXPORT_SUFFIXES,
    MigrationConfig,
    ResetConfig,
    TargetConfig,
    TensorParallelConfig,
)
from ucp.model.layouts import RunFolder
from ucp.model.options import zero_label
from ucp.model.records import DTYPES, Facts, Reader
from ucp.sources import source_format
from ucp.transforms import TransformPlan, plan_transforms

__all__ = ["MigrationPlan", "plan_migration", "plan_with"]


# -- planning ---------------------------------------------------------------------------------
@dataclass
class MigrationPlan:
    """Every decision of a migration, as data, with the source open for :func:`execute`."""

    config: MigrationConfig
    reader: Reader
    transforms: TransformPlan
    native: Any | None  # ucp.targets.native.NativePlan
    warnings: list[str] = field(default_factory=list)
    dcp: Any | None = None  # ucp.targets.dcp.DcpPlan, for target.format: dcp
    #: each trained parameter's step in a dcp target (torch keeps one per parameter; resets restart some)
    dcp_steps: dict[str, int] = field(default_factory=dict)
    #: the source is a Hugging Face Trainer/Accelerate folder: a native target is written as a whole one
    hf: RunFolder | None = None
    #: the target is such a folder of an FSDP run: its backend (fsdp-sharded, fsdp-full), ``dcp`` its state's plan
    fsdp: str | None = None

    @property
    def facts(self) -> Facts:
        return self.transforms.facts

    def close(self) -> None:
        self.reader.close()

    def describe(self, *, dry_run: bool = True) -> str:
        return _describe_plan(self, dry_run)


def plan_migration(config: MigrationConfig, *, overwrite: bool = False) -> MigrationPlan:
    """Open the source and check everything only the checkpoint can tell; write nothing.

    Raises :class:`MigrationConfigError` listing every problem (or :class:`OutputExistsError`
    when existing outputs are the only problem). The returned plan holds the source open:
    pass it to :func:`execute`, or close it.
    """
    return plan_with(config, overwrite, [])


def plan_with(config: MigrationConfig, overwrite: bool, known: list[Issue]) -> MigrationPlan:
    """plan_migration, also reporting ``known`` (the config's own problems) with whatever the
    checkpoint shows about the parts of the config that are sound."""
    origin = config.origin
    broken = {i.path[0] if i.path else "" for i in known}
    issues, exists = _output_issues(config, overwrite=overwrite)
    issues = known + issues
    reader = None if broken & {"source", "tag"} else _open_source(config, issues)
    if reader is None:
        raise config_error(issues, origin, exists)
    try:
        warnings: list[Issue] = []
        if config.tag is not None and reader.format == "universal":
            warnings.append(Issue(("tag",), "is ignored: the source is a universal directory"))
        steps = [] if "transforms" in broken else [t.to_step() for t in config.transforms]
        tplan = plan_transforms(reader.facts, steps)
        issues += [Issue(transform_path(config, p.step, p.where), p.message) for p in tplan.problems]
        warnings += [Issue(transform_path(config, i, where), message) for i, where, message in tplan.warnings]
        if tplan.removed_groups:
            kept = len(tplan.facts.groups)
            warnings.append(
                Issue(
                    ("transforms",),
                    f"param group(s) {tplan.removed_groups} lose every parameter and "
                    f"are removed; the new optimizer must have {kept} param group(s)",
                )
            )
        native = dcp = hf = fsdp = None
        target = config.target
        if isinstance(target, TargetConfig) and not broken & {"target", "transforms"} and not tplan.problems:
            hf = reader.facts.folder if target.format == "deepspeed" else None
            fsdp = fsdp_backend(target, hf, issues)
            if target.format not in ("deepspeed", "dcp"):
                pass  # a format named outright plans itself when it writes (Megatron, verl): nothing to decide here
            elif target.format == "dcp" or fsdp is not None:
                dcp = plan_dcp_target(target, reader, tplan, param_steps(reader, tplan), issues)
            else:
                native = plan_native_target(config, target, reader, tplan, issues, hf)
        if config.exports and not broken & {"exports", "transforms"} and not tplan.problems:
            _check_exports(config, reader, tplan, issues)
        raise_issues(issues, origin, exists=exists)
    except BaseException:
        reader.close()
        raise
    dcp_steps = param_steps(reader, tplan) if dcp is not None else {}
    notes = [origin.where(w) for w in warnings]
    return MigrationPlan(config, reader, tplan, native, notes, dcp, dcp_steps, hf, fsdp)


def _check_exports(config: MigrationConfig, reader: Reader, tplan: TransformPlan, issues: list[Issue]) -> None:
    """What the exporter would refuse half-way: a missing exporter, a file name that does not fit
    the format, a single file that the model would need shards for."""
    try:
        from ucp.targets.export import export, parse_size, plan_shards
    except ImportError:
        issues.append(
            Issue(
                ("exports",), "this ucp has no exporter (ucp.targets.export is missing); remove exports or update ucp"
            )
        )
        return
    facts = tplan.facts
    held = reader.buffers() if facts.buffer_names else {}
    buffers = {new: held[old] for new, old in tplan.buffer_origin.items() if old in held}
    for i, item in enumerate(config.exports):
        suffix = item.path.suffix
        file_suffixes = EXPORT_SUFFIXES[item.format]
        if suffix and suffix in {s for f in EXPORT_SUFFIXES.values() for s in f} - set(file_suffixes):
            issues.append(
                Issue(
                    ("exports", i, "path"),
                    f"{item.path.name} does not fit format {item.format}; name "
                    f"the file *{file_suffixes[0]} or give a folder",
                )
            )
            continue
        if suffix not in file_suffixes:
            continue  # a folder: the exporter shards as needed
        sizes = []
        for meta in facts.params:
            dtype = DTYPES.get(item.dtype or meta.dtype)
            if dtype is None:
                break  # a dtype the exporter refuses with its own message
            sizes.append((meta.name, meta.numel * dtype.itemsize))
        for name, tensor in buffers.items():
            size = DTYPES[item.dtype].itemsize if item.dtype and tensor.is_floating_point() else tensor.element_size()
            sizes.append((name, tensor.numel() * size))
        limit = item.max_shard_size
        if limit is None:
            limit = inspect.signature(export).parameters["max_shard_size"].default
        shards = len(plan_shards(sizes, parse_size(limit)))
        if shards > 1:
            issues.append(
                Issue(
                    ("exports", i, "path"),
                    f"the model needs {shards} shards of at most {limit}, which "
                    "one file cannot hold; give a folder or raise max_shard_size",
                )
            )


def _open_source(config: MigrationConfig, issues: list[Issue]) -> Reader | None:
    from ucp.sources import open_reader

    rules = config.tensor_parallel.pairs() if isinstance(config.tensor_parallel, TensorParallelConfig) else []
    try:
        reader = open_reader(config.source, tag=config.tag, tp_rules=rules)
        if rules:
            from ucp.sources.tensor_parallel import with_tp_rules

            return with_tp_rules(reader, rules)
        return reader
    except UcpError as err:
        at = ("tag",) if config.tag is not None and f"tag {config.tag!r}" in str(err) else ("source",)
        issues.append(Issue(at, f"cannot be read: {err}"))
    return None


def _output_issues(config: MigrationConfig, *, overwrite: bool) -> tuple[list[Issue], list[Issue]]:
    """(outputs that clash with each other or the source, outputs that exist and would need --overwrite)."""
    clashes: list[Issue] = []
    exists: list[Issue] = []
    seen: dict[Path, KeyPath] = {}
    source = config.source.resolve() if isinstance(config.source, Path) else None
    for at, path in config.outputs():
        where = path.resolve()
        if where in seen:
            clashes.append(Issue(at, f"{path} is also {show_path(seen[where])}; every output needs its own path"))
            continue
        seen[where] = at
        if source is not None and (where == source or source in where.parents or where in source.parents):
            clashes.append(Issue(at, f"{path} overlaps the source {config.source}; write somewhere else"))
        elif path.exists() and not overwrite:
            exists.append(Issue(at, f"{path} already exists; pass --overwrite to replace it"))
    return clashes, exists


# -- describing -------------------------------------------------------------------------------
#: what a migration names by ``target.format`` and plans when it writes (the target's own module decides it all)
_LABELS = {
    "megatron": "a Megatron-Core torch_dist checkpoint, optimizer state fully_reshardable (Megatron-LM resumes it at "
    "any TP, PP and DP)",
    "verl-fsdp": "a verl FSDP actor folder for target.dp processes (verl's FSDPCheckpointManager loads it)",
}


def _counts(facts: Facts) -> str:
    trained = sum(1 for p in facts.params if not p.frozen)
    frozen = len(facts.params) - trained
    return (
        f"{len(facts.params)} parameters ({trained} trained, {frozen} frozen) in {len(facts.groups)} param "
        f"group(s), {len(facts.tied)} tied alias(es), {len(facts.buffer_names)} buffer(s)"
    )


def _describe_plan(plan: MigrationPlan, dry_run: bool) -> str:
    config = plan.config
    source = plan.reader.facts
    info = source.info
    head = f"migration plan for {config.origin.file or 'config'}"
    out = [head + (" (dry run: nothing is written)" if dry_run else "")]
    kind = source_format(plan.reader.format).title(source) if plan.reader.format else "checkpoint"
    out.append(
        f"read       {config.source}: {kind}, {f'tag {info.tag}, ' if info.tag else ''}dp={info.dp_world_size}, "
        f"{info.dtype}, "
        f"{source.flavour or 'unknown optimizer'}, optimizer step {source.step}"
    )
    out.append(f"           {_counts(source)}")
    tplan = plan.transforms
    for index, step in enumerate(config.transforms):
        kind_name = step.kinds()[0]
        if step.rename is not None:
            out.append(f"transform  [{index}] rename {step.rename.pattern!r} -> {step.rename.replace!r}")
            out += [f"             {old} -> {new}" for i, old, new in tplan.renames if i == index]
        else:
            value = getattr(step, kind_name)
            if isinstance(value, ResetConfig):
                value = f"{value.params} (step: {value.step})"
            out.append(f"transform  [{index}] {kind_name} {value}")
        out += [f"             drop {name} ({what}; {why})" for i, name, what, why in tplan.drops if i == index]
        out += [
            f"             reset {name}: moments zeroed, step {'0' if restart else 'kept'}"
            for i, name, restart in tplan.resets
            if i == index
        ]
    if config.transforms:
        out.append(f"           result: {_counts(tplan.facts)}")
    if config.universal is not None:
        out.append(f"write      {config.universal}: universal directory")
    native = plan.native
    if native is not None and config.target is not None:
        layout = ""
        if native.layout is not None:
            layout = f", sub_group_size {native.sub_group_size} -> {len(native.layout.sub_group_numel)} sub-group(s)"
        target_step = config.target.step
        step_text = {"keep": "kept", "reset": "reset to 0 (moments zeroed)"}.get(
            str(target_step), f"set to {target_step}"
        )
        tp = f" tp={native.tp}" if native.tp > 1 else ""
        kind = "native" if plan.hf is None else f"a whole {plan.hf.kind} folder with a"
        pipeline = config.target.pipeline
        if pipeline is not None:
            kind = f"native pipeline ({pipeline.describe()})"
            tp = f" x pp={pipeline.pp}{tp}"
        out.append(
            f"write      {config.target.output}: {kind} {zero_label(native.stage)} checkpoint for dp={native.dp}{tp}, "
            f"{native.flavour.name}, {native.dtype}, tag {native.tag}, step {step_text}{layout}"
        )
        out += [f"             note: {note}" for note in native.notes]
    if config.target is not None and config.target.format not in ("deepspeed", "dcp"):
        out.append(f"write      {config.target.output}: {_LABELS[config.target.format]}")
    if plan.dcp is not None and config.target is not None:
        whole = None if plan.hf is None or plan.fsdp is None else (plan.hf.kind, plan.fsdp)
        out += describe_dcp(plan.dcp, config.target, _counts(plan.facts), plan.dcp_steps, folder=whole)
    for export in config.exports:
        src = (
            "the universal directory"
            if config.universal is not None
            else ("the transformed source" if tplan.changes_anything else "the source")
        )
        size = f", shards of at most {export.max_shard_size}" if export.max_shard_size is not None else ""
        out.append(f"export     {export.path}: {export.format}, {export.dtype or 'model dtype'}{size}, from {src}")
    if dry_run:  # a real run logs them instead
        out += [f"warning    {w}" for w in plan.warnings]
    return "\n".join(out)
