"""Real legacy-MoE DeepSpeed runs (ucp.harness.moe), built once and cached like the other fixtures."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from tests.support.fixtures import build_once, cache_root, spec_key
from ucp.harness.moe import MoeSpec, run_moe

__all__ = ["BuiltMoe", "build_moe", "run_moe_from", "merged_records"]

_VERSION = "1"  # bump when the MoE harness model or data change


@dataclass(frozen=True)
class BuiltMoe:
    """A MoE checkpoint DeepSpeed wrote, and what every rank's live engine held when it wrote it."""

    path: Path  # the folder holding `latest`
    spec: MoeSpec

    @property
    def record(self) -> dict[str, Any]:
        return merged_records(self.spec)

    @property
    def tag_dir(self) -> Path:
        return self.path / (self.path / "latest").read_text().strip()


def merged_records(spec: MoeSpec) -> dict[str, Any]:
    """Every rank's record as one model: each parameter (dense, or an expert under its global name) with its
    state; the copies several ranks hold must be the same bytes."""
    out: dict[str, Any] = {"params": {}, "state": {}, "module": {}, "steps": set()}
    records = [torch.load(spec.rank_record(r), weights_only=True) for r in range(spec.world)]
    for rec in records:
        for name, value in rec["params"].items():
            if name in out["params"]:
                assert torch.equal(out["params"][name], value), name
                continue
            out["params"][name] = value
            out["module"][name] = rec["module"][name]
            for key, per_param in rec["state"].items():
                out["state"].setdefault(key, {})[name] = per_param[name]
        out["steps"] |= set(rec["state_steps"])
    head = records[0]
    out.update(
        losses=head["losses"],
        counters=head["counters"],
        lr_scheduler=head["lr_scheduler"],
        group_hparams=head["group_hparams"],
        group_params=[rec["group_params"] for rec in records],
    )
    return out


def build_moe(**fields: Any) -> BuiltMoe:
    """Train and save a MoE checkpoint with MoeSpec(**fields), or return the cached one."""
    spec = MoeSpec(**fields)
    folder = cache_root() / f"moe-w{spec.world}-ep{spec.ep}-z{spec.stage}-{spec.dtype}-{spec_key(_VERSION, spec)}"
    spec = replace(
        spec, save_dir=str(folder / "ckpt"), save_tag=f"global_step{spec.steps}", record=str(folder / "record.pt")
    )
    build_once(folder, lambda: run_moe(spec, log_dir=folder / "logs"))
    return BuiltMoe(folder / "ckpt", spec)


def run_moe_from(base: BuiltMoe, *, name: str, work: Path, steps: int = 3, **overrides: Any) -> dict[str, Any]:
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
    run_moe(spec, log_dir=work / f"{name}-logs")
    return merged_records(spec)
