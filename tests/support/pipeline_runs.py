"""Real pipeline-parallel DeepSpeed runs (ucp.harness.pipeline), built once and cached like the other fixtures."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from tests.support.fixtures import build_once, cache_root, spec_key
from ucp.harness.pipeline import PipeSpec, run_pipeline

__all__ = ["BuiltPipe", "build_pipe", "run_pipe", "run_through", "stage_records"]

_VERSION = "1"  # bump when the pipeline harness model or data change


@dataclass(frozen=True)
class BuiltPipe:
    """A pipeline checkpoint DeepSpeed wrote, and each stage's live state when it wrote it."""

    path: Path  # the folder holding `latest`
    spec: PipeSpec

    @property
    def records(self) -> list[dict[str, Any]]:
        return stage_records(self.spec)

    @property
    def tag_dir(self) -> Path:
        return self.path / (self.path / "latest").read_text().strip()


def stage_records(spec: PipeSpec) -> list[dict[str, Any]]:
    """Each stage's record of a finished run (one for a plain run)."""
    stages = 1 if spec.plain else spec.pp
    return [torch.load(spec.record_path(s), weights_only=True) for s in range(stages)]


def build_pipe(**fields: Any) -> BuiltPipe:
    """Train and save a pipeline checkpoint with PipeSpec(**fields), or return the cached one."""
    spec = PipeSpec(**fields)
    folder = cache_root() / f"pipe-pp{spec.pp}-dp{spec.dp}-z{spec.stage}-{spec.dtype}-{spec_key(_VERSION, spec)}"
    spec = replace(spec, save_dir=str(folder / "ckpt"), record=str(folder / "record.pt"))
    build_once(folder, lambda: run_pipeline(spec, log_dir=folder / "logs"))
    return BuiltPipe(folder / "ckpt", spec)


def run_pipe(base: BuiltPipe, *, name: str, work: Path, steps: int = 3, **overrides: Any) -> list[dict[str, Any]]:
    """Continue ``base``'s run for ``steps`` more steps as ``overrides`` say (a load, another PP or DP
    size, a plain engine); return each stage's live record."""
    spec = replace(
        base.spec,
        steps=steps,
        first_step=base.spec.steps,
        save_dir=None,
        record=str(work / f"{name}.pt"),
        port=0,
        **overrides,
    )
    run_pipeline(spec, log_dir=work / f"{name}-logs")
    return stage_records(spec)


def run_through(base: BuiltPipe, *, name: str, work: Path, steps: int = 3) -> list[dict[str, Any]]:
    """``base``'s run without the interruption: its steps and ``steps`` more in one go, nothing loaded."""
    spec = replace(base.spec, steps=base.spec.steps + steps, save_dir=None, record=str(work / f"{name}.pt"), port=0)
    run_pipeline(spec, log_dir=work / f"{name}-logs")
    return stage_records(spec)
