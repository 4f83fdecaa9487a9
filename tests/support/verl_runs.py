"""Real verl runs for tests/test_verl.py: launched on local gloo ranks (tests/support/verl_worker.py), saves cached.

A save run is keyed by its spec and built once into the fixture cache (like :mod:`tests.support.hf_runs`); a run that
loads a folder ucp wrote is never cached, since it tests ucp's current code. The fast tier refuses both.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from tests.support.fixtures import build_once, cache_root
from tests.support.verl_worker import VerlSpec
from ucp.harness.launch import free_port, launch

__all__ = ["VerlRun", "run_verl", "cached_verl", "actor_of"]

_VERSION = "1"
_WORKER = "tests.support.verl_worker"
_ROOT = Path(__file__).resolve().parents[2]


class VerlRun:
    """A finished run: its spec, output and records."""

    def __init__(self, spec: VerlSpec) -> None:
        self.spec = spec
        self.out = Path(spec.out)
        self.record = Path(spec.record)

    def _load(self, name: str) -> dict[str, Any]:
        return torch.load(self.record / name, weights_only=True)

    def saved(self) -> dict[str, Any]:
        return self._load("saved.pt")

    def loaded(self) -> dict[str, Any]:
        return self._load("loaded.pt")

    def losses(self) -> dict[int, float]:
        return self._load("final.pt")["losses"]

    @property
    def actor(self) -> Path:
        return actor_of(self)


def actor_of(run: VerlRun) -> Path:
    return run.out / f"global_step_{run.spec.save_at}" / "actor"


def run_verl(spec: VerlSpec, *, timeout: float = 600.0) -> VerlRun:
    """Run ``spec`` on ``spec.world`` local processes; RankFailure carries the failing rank's log."""
    spec = replace(spec, port=spec.port or free_port())
    Path(spec.record).mkdir(parents=True, exist_ok=True)
    env = {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")])),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    launch(
        spec.world, spec.to_json(), port=spec.port, module=_WORKER, timeout=timeout,
        log_dir=Path(spec.record) / "logs", env=env, cwd=_ROOT,
    )  # fmt: skip
    return VerlRun(spec)


def cached_verl(name: str, spec: VerlSpec) -> VerlRun:
    """``spec`` run once into the fixture cache (its ``out``/``record`` set here)."""
    raw = replace(spec, out="", record="", port=0).to_json()
    key = hashlib.sha1(f"{_VERSION}{raw}".encode()).hexdigest()[:16]
    folder = cache_root() / f"verl-{name}-{key}"
    spec = replace(spec, out=str(folder / "out"), record=str(folder / "record"))
    build_once(folder, lambda: run_verl(spec))
    return VerlRun(spec)
