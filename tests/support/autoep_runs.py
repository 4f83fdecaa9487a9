"""Real DeepSpeed AutoEP runs (ucp.harness.autoep), built once and cached like the other fixtures."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tests.support.fixtures import build_once, cache_root, spec_key
from tests.support.moe_runs import merged_records
from ucp.harness.autoep import AutoEpSpec, run_autoep

__all__ = ["BuiltAutoEp", "build_autoep", "run_autoep_from"]

_VERSION = "2"  # bump when the AutoEP harness model or data change


@dataclass(frozen=True)
class BuiltAutoEp:
    """An AutoEP checkpoint DeepSpeed wrote, and what every rank's live engine held when it wrote it."""

    path: Path  # the folder holding `latest`
    spec: AutoEpSpec

    @property
    def record(self) -> dict[str, Any]:
        """Every rank's record as one model, each expert under its global name (see merged_records)."""
        return merged_records(self.spec)  # type: ignore[arg-type]  # the same record shape as a MoE run's

    @property
    def tag_dir(self) -> Path:
        return self.path / (self.path / "latest").read_text().strip()


def build_autoep(**fields: Any) -> BuiltAutoEp:
    """Train and save an AutoEP checkpoint with AutoEpSpec(**fields), or return the cached one."""
    spec = AutoEpSpec(**fields)
    key = spec_key(_VERSION, spec)
    folder = cache_root() / f"autoep-w{spec.world}-ep{spec.ep}-z{spec.stage}-{spec.dtype}-{key}"
    spec = replace(
        spec, save_dir=str(folder / "ckpt"), save_tag=f"global_step{spec.steps}", record=str(folder / "record.pt")
    )
    build_once(folder, lambda: run_autoep(spec, log_dir=folder / "logs"))
    return BuiltAutoEp(folder / "ckpt", spec)


def run_autoep_from(base: BuiltAutoEp, *, name: str, work: Path, steps: int = 3, **overrides: Any) -> dict[str, Any]:
    """Continue ``base``'s run for ``steps`` more steps as ``overrides`` say (a load, another world or ep
    size); return the ranks' merged live record."""
    spec = replace(
        base.spec,
        steps=steps,
        first_step=base.spec.steps,
        save_dir=None,
        save_tag=None,
        record=str(work / f"{name}.pt"),
        port=0,
        **overrides,
    )
    run_autoep(spec, log_dir=work / f"{name}-logs")
    return merged_records(spec)  # type: ignore[arg-type]
