"""A migration's native target (``target.format`` native, the default): planned here, so that what only the
checkpoint can tell (an optimizer its files do not name, a pipeline or MoE layout the writer would refuse,
parameters sharing one step that should differ) is refused before anything is written; written by
``ucp.targets.native``."""

from __future__ import annotations

import logging
from typing import Any

from ucp.errors import ConfigError, UcpError
from ucp.migrate.issues import Issue, KeyPath
from ucp.migrate.schema import MigrationConfig, PipelineConfig, ResetConfig, TargetConfig
from ucp.model import flavours
from ucp.model.options import zero_label
from ucp.model.records import Facts, Reader
from ucp.transforms import TransformedReader, TransformPlan

__all__ = ["param_steps", "plan_native_target", "transform_path"]

logger = logging.getLogger(__name__)


def transform_path(config: MigrationConfig, index: int, where: tuple[str | int, ...]) -> KeyPath:
    """The config path of transform ``index``'s key ``where``, as an issue names it."""
    step = config.transforms[index]
    if isinstance(step.reset_optimizer, ResetConfig) and where:
        where = ("params",) + tuple(where)  # the mapping form keeps its patterns under params
    return ("transforms", index, step.kinds()[0]) + tuple(where)


def plan_native_target(
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


def param_steps(reader: Reader, tplan: TransformPlan) -> dict[str, int]:
    """The step each trained (renamed) parameter will carry: 0 when reset, else the source's (a native writer
    reads "never stepped" as 0 too)."""
    steps = TransformedReader(reader, tplan).param_steps() if tplan.changes_anything else reader.param_steps()
    return {meta.name: int(steps.get(meta.name) or 0) for meta in tplan.facts.params if not meta.frozen}


def _step_conflicts(config: MigrationConfig, reader: Reader, tplan: TransformPlan, plan: Any) -> list[Issue]:
    """DeepSpeed keeps one step per flat partition (ZeRO-3: per sub-group; ZeRO-1/2: per param
    group). Parameters that would share one but carry different steps cannot be written as asked."""
    steps = param_steps(reader, tplan)
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
                transform_path(config, index, ()),
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
