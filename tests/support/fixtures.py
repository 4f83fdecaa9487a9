"""Real DeepSpeed checkpoints for the tests, built once and cached on disk.

Every fixture is a real run of the harness (gloo ranks on CPU). The cache key is the run's full
spec, so changing a spec rebuilds only that fixture. ``UCP_TEST_CACHE`` moves the cache.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from ucp.harness import LoadSpec, RunSpec, run_ranks
from ucp.harness.launch import NO_RANKS

__all__ = ["Built", "build", "cache_root", "refuse_in_fast_tier", "resume"]

_VERSION = "1"  # bump when the harness model or data change


def cache_root() -> Path:
    root = os.environ.get("UCP_TEST_CACHE")
    return Path(root) if root else Path(__file__).resolve().parents[2] / ".ucp-cache" / "fixtures"


@dataclass(frozen=True)
class Built:
    """A checkpoint DeepSpeed wrote, and what the live engine held when it wrote it."""

    path: Path  # the folder holding `latest`
    record_path: Path
    spec: RunSpec

    @property
    def record(self) -> dict[str, Any]:
        return torch.load(self.record_path, map_location="cpu", weights_only=True)  # a GPU run's too

    @property
    def tag_dir(self) -> Path:
        return self.path / (self.path / "latest").read_text().strip()


def spec_key(version: str, spec: Any) -> str:
    """A fixture's cache key: its spec (paths and port left out) and the version of its harness."""
    raw = json.dumps({"v": version, **asdict(replace(spec, save_dir=None, record=None, port=0))}, sort_keys=True)
    return hashlib.sha1(raw.encode()).hexdigest()[:16]


def refuse_in_fast_tier(what: Path | str) -> None:
    """The fast tier (``-m "not slow"``) uses only checkpoints kept in tests/data: a test that needs a real run, even
    one cached from an earlier session, belongs to the real-run tier (a fresh clone would train it)."""
    if os.environ.get(NO_RANKS):
        pytest.fail(f"a test of the fast tier needs the real run {Path(what).name}: mark it slow", pytrace=False)


def build_once(folder: Path, make: Callable[[], object]) -> str:
    """Fill ``folder`` with ``make()`` unless an earlier build finished it (its ``DONE`` mark, holding the text
    ``make`` returned, or "ok"): one builder per fixture, even across test processes; a half-built folder is started
    again. Returns the mark's text."""
    refuse_in_fast_tier(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "DONE").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            made = make()
            (folder / "DONE").write_text(made if isinstance(made, str) else "ok")
    return (folder / "DONE").read_text()


def _key(spec: RunSpec) -> str:
    fields = asdict(replace(spec, save_dir=None, record=None, port=0))
    # fields added later: runs that leave them at their defaults keep their cached keys
    later = (
        ("grad_accum_dtype", None),
        ("tp", 1),
        ("exclude_frozen", False),
        ("loss_scale_power", 16),
        ("device", "cpu"),
        ("master", "fp32"),
        ("hpz", 0),
        ("sp", 1),
        ("round_robin", False),
        ("persistence_threshold", 0),
        ("mics", 0),
        ("offload_param", False),
        ("zenflow", 0),
        ("nvme", False),
        ("ds_config", None),
        ("compiled", False),
        ("zero_init", False),
    )
    for key, default in later:
        if fields.get(key) == default:
            del fields[key]
    if not fields["model"].get("glu"):
        del fields["model"]["glu"]
    raw = json.dumps({"v": _VERSION, **fields}, sort_keys=True)
    return hashlib.sha1(raw.encode()).hexdigest()[:16]


def build(**fields: Any) -> Built:
    """Train and save a checkpoint with RunSpec(**fields), or return the cached one."""
    spec = RunSpec(**fields)
    tp = f"-tp{spec.tp}" if spec.tp > 1 else ""
    device = "" if spec.device == "cpu" else f"{spec.device}-"
    folder = cache_root() / f"{device}{spec.stage}-{spec.dtype}-dp{spec.dp}{tp}-{spec.optimizer}-{_key(spec)}"
    spec = replace(spec, save_dir=str(folder / "ckpt"), record=str(folder / "record.pt"))
    build_once(folder, lambda: run_ranks(spec, log_dir=folder / "logs"))
    return Built(folder / "ckpt", folder / "record.pt", spec)


def resume(
    base: Built, load: LoadSpec, *, dp: int | None = None, steps: int = 3, name: str, work: Path, **overrides: Any
) -> dict[str, Any]:
    """Continue ``base``'s run from ``load`` for ``steps`` more steps; return the live record."""
    spec = replace(
        base.spec,
        dp=dp or base.spec.dp,
        steps=steps,
        first_step=base.spec.steps,
        load=load,
        save_dir=None,
        record=str(work / f"{name}.pt"),
        port=0,
        **overrides,
    )
    run_ranks(spec, log_dir=work / f"{name}-logs")
    return torch.load(spec.record, weights_only=True)


def universals_of(sources: dict[str, dict[str, Any]], root: Path) -> Callable[[str], Path]:
    """universal(name) -> a universal directory converted once (under ``root``) from build(**sources[name])."""
    import ucp

    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = root / name / "u"
            ucp.to_universal(build(**sources[name]).path, made[name])
        return made[name]

    return get
