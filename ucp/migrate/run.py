"""Running a plan: source -> transforms -> universal (if asked) -> native or DCP target (if asked) -> exports."""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from ucp.errors import StepConflictError
from ucp.io.guard import OutputPolicy, check_output, universal_bytes, weight_bytes, writing
from ucp.migrate.issues import Issue, KeyPath, MigrationConfigError
from ucp.migrate.plan import MigrationPlan, plan_with
from ucp.migrate.schema import TargetConfig
from ucp.migrate.yaml_file import read_config
from ucp.model.records import Reader, ReaderView
from ucp.targets.format import Request
from ucp.transforms import TransformedReader

logger = logging.getLogger(__name__)


# -- running ----------------------------------------------------------------------------------
def execute(plan: MigrationPlan, *, overwrite: bool | OutputPolicy = False, workers: int | None = None) -> list[str]:
    """Do what the plan says, in order; returns one line per output written. Closes the plan's source."""
    from ucp.universal.reader import open_universal
    from ucp.universal.writer import write_universal

    config = plan.config
    tplan = plan.transforms
    reader: Reader = TransformedReader(plan.reader, tplan) if tplan.changes_anything else plan.reader
    done: list[str] = []
    downstream: Reader = reader
    try:
        if config.universal is not None:
            manifest = write_universal(reader, config.universal, overwrite=overwrite, workers=workers)
            done.append(f"wrote {len(manifest['params'])} parameters to universal directory {config.universal}")
            downstream = open_universal(config.universal)  # the target reads what was written, checksums checked
        if config.target is not None:
            done.append(_write_target(plan, downstream, overwrite=overwrite, workers=workers))
        if config.exports:
            done += _exports(plan, reader, overwrite=overwrite, workers=workers)
    finally:
        if downstream is not reader:
            downstream.close()
        plan.close()
    return done


def target_request(target: TargetConfig, *, overwrite: bool | OutputPolicy, workers: int | None) -> Request:
    """The target as the registry's request: its options by name, ``pipeline`` as ``ucp restore --pp`` spells it."""
    values = target.values()
    pipe = target.pipeline
    if pipe is not None:
        values.update(
            pp=pipe.pp,
            pp_parts=",".join(map(str, pipe.parts)) if pipe.parts is not None else None,
            pp_partition=pipe.partition,
            pp_layers=pipe.layers,
            pp_tied=[f"{key}={','.join(map(str, layers))}" for key, layers in pipe.tied.items()],
        )
    return Request(values, overwrite=overwrite, workers=workers)


def _write_target(plan: MigrationPlan, reader: Reader, *, overwrite: bool | OutputPolicy, workers: int | None) -> str:
    """The target the registry chooses for the source and the config (the one the plan described), written."""
    from ucp.targets.registry import write

    target = plan.config.target
    if target is None:
        raise ValueError("the plan has no target")
    if plan.hf is not None and reader.facts.folder is None:  # read back from the universal directory written first
        reader = ReaderView(reader, replace(reader.facts, folder=plan.hf))
    try:
        written = write(
            reader, target.output, target_request(target, overwrite=overwrite, workers=workers), target.format
        )
    except StepConflictError as err:
        # plan_migration checks this up front; a source whose own steps disagree still lands here
        origin = plan.config.origin
        raise MigrationConfigError(
            [origin.where(Issue(("target", "step"), f"{err}; set target.step to an integer or reset"))]
        ) from None
    for note in written.notes:
        logger.warning("%s", note)
    return written.summary


def _exports(plan: MigrationPlan, reader: Reader, *, overwrite: bool | OutputPolicy, workers: int | None) -> list[str]:
    from ucp.targets.export import export

    config = plan.config
    # from the universal directory when one was written (what a later export would read), else
    # straight from the (transformed) source
    src: Path | Reader = config.universal if config.universal is not None else reader
    done = []
    for item in config.exports:
        kwargs: dict[str, Any] = {
            "format": item.format,
            "dtype": item.dtype,
            "overwrite": overwrite,
            "workers": workers,
            "folder": config.source,  # a Trainer folder's config and tokenizer files go with the weights
        }
        if item.max_shard_size is not None:
            kwargs["max_shard_size"] = item.max_shard_size
        written = export(src, item.path, **kwargs)
        done.append(f"exported {item.format} ({len(written)} file(s)) to {item.path}")
    return done


def _guarded_outputs(plan: MigrationPlan, config_path: Path, policy: OutputPolicy) -> dict[Path, int]:
    """Every output through ucp.io.guard.check_output (never over the source or this config file,
    never over a folder ucp did not write); returns each one's estimated size for the space check."""
    config = plan.config
    inputs: dict[str, Path] = {"source": config.source, "config file": config_path}

    def size(at: KeyPath) -> int:
        if at == ("universal",):
            return universal_bytes(plan.facts)
        dtype = config.target.dtype if at[0] == "target" and config.target is not None else None
        if at[0] == "exports" and isinstance(at[1], int):
            dtype = config.exports[at[1]].dtype
        return weight_bytes(plan.facts, dtype)

    sizes = {}
    for at, path in config.outputs():
        check_output(path, inputs, policy)
        sizes[path] = size(at)
    return sizes


def run_migration(
    config_path: str | os.PathLike,
    *,
    dry_run: bool = False,
    overwrite: bool = False,
    policy: OutputPolicy | None = None,
) -> str:
    """Load, check and plan a migration; then either describe it (``dry_run``) or run it. Returns the text to show.

    Every problem is reported at once: the config's own, and what the source shows about the
    parts of the config that are sound (a rename that collides, a drop that empties the model).
    Each output appears whole or not at all; should a late step fail, the earlier outputs stay
    (complete) and a re-run needs ``overwrite``. ``policy`` (the CLI's flags) replaces ``overwrite``.
    """
    policy = policy or OutputPolicy(overwrite=overwrite)
    config, issues = read_config(Path(config_path))
    plan = plan_with(config, policy.overwrite, issues)
    if dry_run:
        try:
            return plan.describe(dry_run=True)
        finally:
            plan.close()
    try:
        sizes = _guarded_outputs(plan, Path(config_path), policy)
        for warning in plan.warnings:
            logger.warning("%s", warning)
        text = plan.describe(dry_run=False)
        with writing(sizes, policy):
            done = execute(plan, overwrite=policy)
    finally:
        plan.close()  # execute closes it too; closing a reader twice is a no-op
    return "\n".join([text, *done])
