"""Real Hugging Face Trainer runs for tests/test_hf.py: launched on local gloo ranks, saves cached on disk.
DeepSpeed runs by default, FSDP1/FSDP2 ones with ``extra=fsdp_extra(...)`` (tests/support/fsdp_worker.py).

A save run is keyed by its spec (like :mod:`tests.support.fixtures`), so it is built once; a run
that resumes from a folder ucp wrote is never cached, since it tests ucp's current code.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from tests.support.fixtures import build_once, cache_root
from tests.support.hf_worker import HfSpec
from ucp.harness.launch import free_port, launch

__all__ = [
    "HfRun",
    "run_hf",
    "cached_run",
    "ACCELERATE_WORKER",
    "LOSS_TOL",
    "SAVED_AT",
    "BATCH",
    "tree_digest",
    "assert_state_equal",
    "fsdp_extra",
]

_VERSION = "1"
#: bf16 sums run in another order at another world size; measured at most 9e-5 here (losses near 4.12)
LOSS_TOL = 5e-4
#: the optimizer step the save runs checkpoint at
SAVED_AT = 4
#: per world size, the per-device batch and accumulation that keep the global batch (2 x 3 x 2 = 12)
BATCH = {1: (2, 6), 2: (2, 3), 3: (2, 2)}


def tree_digest(root: Path) -> dict[str, str]:
    """sha256 of every file below ``root``: a folder ucp only reads must come out the same."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


def assert_state_equal(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Two records' per-parameter tensors (fp32 and moments) bit for bit."""
    assert got.keys() == want.keys() and want
    for name, tensors in want.items():
        for key, value in tensors.items():
            assert torch.equal(got[name][key], value), f"{name} {key} differs"


_ROOT = Path(__file__).resolve().parents[2]


class HfRun:
    """A finished run: its output folder and records."""

    def __init__(self, spec: HfSpec) -> None:
        self.spec = spec
        self.out = Path(spec.out)
        self.record = Path(spec.record)

    def loaded(self) -> dict[str, Any]:
        return torch.load(self.record / "loaded.pt", weights_only=True)

    def final(self) -> dict[str, Any]:
        return torch.load(self.record / "final.pt", weights_only=True)

    def rng_loaded(self, rank: int) -> torch.Tensor:
        return torch.load(self.record / f"rng_loaded_{rank}.pt", weights_only=True)["cpu"]

    def saved(self, step: int) -> dict[str, Any]:
        """An FSDP run's live state right after it saved at ``step`` (the fields of :meth:`loaded`)."""
        return torch.load(self.record / f"saved_{step}.pt", weights_only=True)


def fsdp_extra(version: int, state_dict_type: str = "SHARDED_STATE_DICT", **options: Any) -> dict[str, Any]:
    """``HfSpec.extra`` of an FSDP run (see tests/support/fsdp_worker.py for ``options``:
    ``use_orig_params``, ``fsdp1_optim_fix``)."""
    return {"fsdp": {"version": version, "state_dict_type": state_dict_type, **options}}


_TRAINER_WORKER = "tests.support.hf_worker"
#: the worker of an Accelerate run (a Trainer run's is the default)
ACCELERATE_WORKER = "tests.support.accel_worker"


def run_hf(spec: HfSpec, *, timeout: float = 600.0, module: str = _TRAINER_WORKER) -> HfRun:
    """Run ``spec`` on ``spec.world`` local processes with ``module`` (a Trainer run unless told);
    raise RankFailure with the failing rank's log."""
    spec = replace(spec, port=spec.port or free_port())
    env = {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")])),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    launch(
        spec.world,
        spec.to_json(),
        port=spec.port,
        module=module,
        timeout=timeout,
        log_dir=Path(spec.record) / "logs",
        env=env,
        cwd=_ROOT,
    )
    return HfRun(spec)


def cached_run(name: str, spec: HfSpec, *, module: str = _TRAINER_WORKER) -> HfRun:
    """``spec`` run once by ``module`` into the fixture cache (its ``out``/``record`` are set here)."""
    raw = replace(spec, out="", record="", port=0).to_json()
    worker = "" if module == _TRAINER_WORKER else module  # Trainer runs keep their keys
    key = hashlib.sha1(f"{_VERSION}{raw}{worker}".encode()).hexdigest()[:16]
    folder = cache_root() / f"hf-{name}-{key}"
    spec = replace(spec, out=str(folder / "out"), record=str(folder / "record"))
    build_once(folder, lambda: run_hf(spec, module=module))
    return HfRun(spec)
