"""Planning a migration: open the source, check what only the checkpoint can tell, decide; write nothing."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ucp.errors import ConfigError, UcpError
from ucp.migrate.dcp_target import describe_dcp, plan_dcp_target
from ucp.migrate.issues import Issue, KeyPath, config_error, raise_issues, show_path
from ucp.migrate.schema import (
    EXPORT_SUFFIXES,
    MigrationConfig,
    PipelineConfig,
    ResetConfig,
    TargetConfig,
    TensorParallelConfig,
)
from ucp.model import flavours
from ucp.model.layouts import RunFolder
from ucp.model.options import zero_label
from ucp.model.records import DTYPES, Facts, Reader
from ucp.sources import source_format
from ucp.transforms import TransformedReader, TransformPlan, plan_transforms


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

    @property
    def facts(self) -> Facts:
        return self.transforms.facts

    def close(self) -> None:
        self.reader.close()

    def describe(self, *, dry_run: bool = True) -> str:
        return _describe_plan(self, dry_run)


def _transform_path(config: MigrationConfig, index: int, where: tuple[str | int, ...]) -> KeyPath:
    step = config.transforms[index]
    if isinstance(step.reset_optimizer, ResetConfig) and where:
        where = ("params",) + tuple(where)  # the mapping form keeps its patterns under params
    return ("transforms", index, step.kinds()[0]) + tuple(where)


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
        issues += [Issue(_transform_path(config, p.step, p.where), p.message) for p in tplan.problems]
        warnings += [Issue(_transform_path(config, i, where), message) for i, where, message in tplan.warnings]
        if tplan.removed_groups:
            kept = len(tplan.facts.groups)
            warnings.append(
                Issue(
                    ("transforms",),
                    f"param group(s) {tplan.removed_groups} lose every parameter and "
                    f"are removed; the new optimizer must have {kept} param group(s)",
                )
            )
        native = dcp = hf = None
        if isinstance(config.target, TargetConfig) and not broken & {"target", "transforms"} and not tplan.problems:
            if config.target.format == "dcp":
                dcp = plan_dcp_target(config.target, reader, tplan, _param_steps(reader, tplan), issues)
            else:
                hf = reader.facts.folder
                native = _plan_target(config, config.target, reader, tplan, issues, hf)
        if config.exports and not broken & {"exports", "transforms"} and not tplan.problems:
            _check_exports(config, reader, tplan, issues)
        raise_issues(issues, origin, exists=exists)
    except BaseException:
        reader.close()
        raise
    dcp_steps = _param_steps(reader, tplan) if dcp is not None else {}
    return MigrationPlan(config, reader, tplan, native, [origin.where(w) for w in warnings], dcp, dcp_steps, hf)


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


def _plan_target(
    config: MigrationConfig,
    target: TargetConfig,
    reader: Reader,
    tplan: TransformPlan,
    issues: list[Issue],
    hf: Any | None = None,
) -> Any:
    """The native target's plan; for a Hugging Face folder ``hf`` its stage and tag default to the folder's."""
    from ucp.targets.hf import hf_options
    from ucp.targets.native import plan_native

    facts = tplan.facts
    start = len(issues)
    if target.optimizer is None and facts.flavour is None:
        issues.append(
            Issue(
                ("target", "optimizer"),
                "is required: the source's optimizer cannot be told from its "
                f"files; name it ({', '.join(flavours.FLAVOURS)})",
            )
        )
    if not any(g.params for g in facts.groups):
        issues.append(
            Issue(
                ("target",),
                "the transforms leave no trained parameter; a native checkpoint needs at least one param group",
            )
        )
    if target.pipeline is not None:
        _check_pipeline(target.pipeline, facts, hf, issues)
    elif hf is None:
        _check_experts(facts, issues)
    if len(issues) > start:
        return None
    step: str | int = target.step
    try:
        options = (
            target.options(facts.info.zero_stage) if hf is None else hf_options(facts, hf, None, target.option_fields())
        )
        plan = plan_native(facts, options, batch_note=hf is None)
    except ConfigError as err:
        issues.append(Issue(("target",), str(err)))
        return None
    if target.tp > 1:
        from ucp.targets.tensor_parallel import rank_layouts

        try:
            rank_layouts(TransformedReader(reader, tplan), target.tp, 0)
        except UcpError as err:
            issues.append(Issue(("target", "tp"), str(err)))
            return None
    if step == "keep":
        issues += _step_conflicts(config, reader, tplan, plan)
    return plan


def _check_pipeline(pipeline: PipelineConfig, facts: Facts, hf: Any | None, issues: list[Issue]) -> None:
    """What a pipeline target would refuse half-way: a source that is no single pipeline-able model, a name
    that the partition places on no stage."""
    from ucp.targets.experts import has_experts

    at: KeyPath = ("target", "pipeline")
    if hf is not None or has_experts(facts):
        what = "a Hugging Face folder" if hf is not None else "a mixture-of-experts run"
        issues.append(Issue(at, f"the source is {what}, which a pipeline target cannot write; remove pipeline"))
        return
    if facts.tied:
        issues.append(Issue(at, "a pipeline target cannot carry tied aliases; tie layers with TiedLayerSpec"))
        return
    try:
        layout = pipeline.layout(facts)
        for name in [p.name for p in facts.params] + list(facts.buffer_names):
            layout.stages_of(name)
    except ConfigError as err:
        issues.append(Issue(at, str(err)))


def _check_experts(facts: Facts, issues: list[Issue]) -> None:
    """A legacy MoE or AutoEP source written by the native target would put every expert on every rank under
    names its run lacks; ``ucp restore --ep`` writes it."""
    from ucp.targets.experts import has_experts

    if has_experts(facts):
        issues.append(
            Issue(
                ("target",),
                "the source is a mixture-of-experts run (legacy MoE or AutoEP), which a migration's native target "
                "cannot write yet: keep the universal directory and run `ucp restore UNIVERSAL OUT --dp N --ep E`",
            )
        )


def _param_steps(reader: Reader, tplan: TransformPlan) -> dict[str, int]:
    """The step each trained (renamed) parameter will carry: 0 when reset, else the source's (a native writer
    reads "never stepped" as 0 too)."""
    steps = TransformedReader(reader, tplan).param_steps() if tplan.changes_anything else reader.param_steps()
    return {meta.name: int(steps.get(meta.name) or 0) for meta in tplan.facts.params if not meta.frozen}


def _step_conflicts(config: MigrationConfig, reader: Reader, tplan: TransformPlan, plan: Any) -> list[Issue]:
    """DeepSpeed keeps one step per flat partition (ZeRO-3: per sub-group; ZeRO-1/2: per param
    group). Parameters that would share one but carry different steps cannot be written as asked."""
    steps = _param_steps(reader, tplan)
    units: dict[int, list[str]] = {}
    for g, names in enumerate(plan.group_names):
        for i, name in enumerate(names):
            unit = plan.layout.slots[g][i].sub_group if plan.layout is not None else g
            units.setdefault(unit, []).append(name)
    what = "ZeRO-3 sub-group" if plan.layout is not None else "param group"
    by_step: dict[int, list[str]] = {}  # reset step index -> parameters that conflict
    shared: dict[int, set[str]] = {}
    plain: list[str] = []
    for unit, names in units.items():
        seen = {steps.get(n) for n in names}
        if len(seen) <= 1:
            continue
        resets = [n for n in names if n in tplan.restarted]
        if not resets:
            plain.append(f"{what} {unit}: " + ", ".join(f"{n} (step {steps.get(n)})" for n in names))
            continue
        for name in resets:
            index = tplan.reset_params[name]
            by_step.setdefault(index, []).append(name)
            shared.setdefault(index, set()).update(
                f"{n} (step {steps.get(n)})" for n in names if n not in tplan.restarted
            )
    issues = []
    keep = max((s for n, s in steps.items() if n not in tplan.restarted), default=0)
    layout = (
        f"dp={plan.dp}, sub_group_size={plan.sub_group_size}" if plan.layout is not None else zero_label(plan.stage)
    )
    for index, names in sorted(by_step.items()):
        others = sorted(shared[index])
        more = f" and {len(others) - 4} more" if len(others) > 4 else ""
        issues.append(
            Issue(
                _transform_path(config, index, ()),
                f"resets {', '.join(names)} to step 0, but in the target ({layout}) they share a {what} with "
                f"{', '.join(others[:4])}{more}, and DeepSpeed keeps one step per {what}. Write the reset as "
                "{params: [...], step: keep} or set target.step: "
                f"{keep} to zero only their moments and keep the step (a warm start: Adam's bias correction is then "
                "already ~1), or set target.step: reset to restart every parameter at step 0",
            )
        )
    if plain:
        issues.append(
            Issue(
                ("target", "step"),
                "parameters that share a flat partition have different steps in "
                "the source (" + "; ".join(plain) + "); set target.step to an "
                "integer or reset",
            )
        )
    return issues


# -- describing -------------------------------------------------------------------------------
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
        f"read       {config.source}: {kind}, tag {info.tag}, dp={info.dp_world_size}, {info.dtype}, "
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
    if plan.dcp is not None and config.target is not None:
        out += describe_dcp(plan.dcp, config.target, _counts(plan.facts), plan.dcp_steps)
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
