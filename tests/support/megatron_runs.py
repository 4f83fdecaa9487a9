"""Real Megatron-Core runs (megatron-core 0.16.1, ``torch_dist`` + DistributedOptimizer) for the tests: launched
on local gloo ranks by tests/support/megatron_worker.py, saves cached on disk.

A save run is keyed by its spec (like :mod:`tests.support.fixtures`), so it is built once; a resume is run
fresh (:func:`resume_at`), since what it tests may be the folder ucp just wrote. The standard save runs train
``TOTAL`` steps and save after ``SAVED_AT``: one run gives the checkpoint and the uninterrupted continuation a
resume must reproduce (``final()["losses"]`` at steps ``SAVED_AT`` .. ``TOTAL - 1``). For example::

    run = cached_run("tp1dp2-fr", save_spec(1, 1, 2, "fully_reshardable"))
    run.out, run.iteration_dir(), run.saved()   # the Megatron-LM folder, its iter_0000003, the live state then
    back = resume_at(folder, 2, 1, 1, work=tmp_path, name="tp2")  # Megatron resumes ``folder`` at TP 2, 3 steps
    back.loaded()["state"], back.final()["losses"]
    forward_backward(tokens, labels, work=tmp_path, resume=str(folder))["loss"]  # one batch's loss (and grads)

Records name parameters as Megatron's modules do, with global layer numbers, in the checkpoint's TP-invariant
layout; :func:`checkpoint_key` gives a name's key and layer index on disk.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from tests.support.fixtures import build_once, cache_root, refuse_in_fast_tier
from tests.support.megatron_worker import SHARDINGS, MegatronSpec
from ucp.harness.launch import free_port, launch

__all__ = [
    "LOSS_TOL",
    "SAVED_AT",
    "SHARDINGS",
    "TOTAL",
    "MegatronRun",
    "MegatronSpec",
    "cached_run",
    "checkpoint_key",
    "read_common",
    "forward_backward",
    "resume_at",
    "run_megatron",
    "save_spec",
]

_VERSION = "1"  # bump when the worker's model, data or records change
#: a loss at another layout sums in another order: at most 4.8e-7 apart here (losses near 4.8), most bit-equal
LOSS_TOL = 1e-5
#: the iteration the standard save runs checkpoint at, and how many steps they train in all
SAVED_AT = 3
TOTAL = 6
_ROOT = Path(__file__).resolve().parents[2]
_WORKER = "tests.support.megatron_worker"

#: module parameter name (layer part) -> the checkpoint key's suffix: the local spec's layer norms are saved
#: under Transformer Engine's names (``sharded_state_dict_keys_map``)
_KEY_RENAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def checkpoint_key(name: str) -> tuple[str, int | None]:
    """A record's parameter name -> (its tensor key in the torch_dist checkpoint, its index on the stacked layer
    axis, or None): ``decoder.layers.1.input_layernorm.weight`` -> (``decoder.layers.self_attention.linear_qkv
    .layer_norm_weight``, 1). Optimizer keys add a prefix (``optimizer.state.exp_avg.`` for fully_reshardable)."""
    parts = name.split(".")
    if parts[:2] != ["decoder", "layers"]:
        return name, None
    rest = ".".join(parts[3:])
    return f"decoder.layers.{_KEY_RENAMES.get(rest, rest)}", int(parts[2])


_READ_COMMON = """
import enum, sys, torch
import megatron.core  # registers Megatron's safe globals, as Megatron's own load relies on

def plain(value):
    if isinstance(value, (list, tuple)):
        return type(value)(plain(v) for v in value)
    return str(value) if isinstance(value, enum.Enum) else value

common = torch.load(sys.argv[1], map_location="cpu", weights_only=True)
common["args"] = {k: plain(v) for k, v in vars(common["args"]).items()}
torch.save(common, sys.argv[2])
"""


def read_common(folder: str | os.PathLike) -> dict[str, Any]:
    """An iteration folder's ``common.pt`` loaded the way Megatron loads it (``weights_only=True`` with
    megatron.core's safe globals), with ``args`` as a dict and enums (``attention_backend``) as their str.
    It runs in a child process: importing megatron.core registers its safe globals (argparse.Namespace, numpy
    arrays, ...) for every later ``torch.load`` of the process, which a test process must not inherit."""
    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp) / "common.pt"
        subprocess.run(
            [sys.executable, "-W", "ignore", "-c", _READ_COMMON, str(Path(folder) / "common.pt"), str(plain)],
            check=True,
            capture_output=True,
        )
        return torch.load(plain, weights_only=True)


class MegatronRun:
    """A finished run: its checkpoint folder and records (each loaded with ``weights_only=True``)."""

    def __init__(self, spec: MegatronSpec, wall: float = 0.0) -> None:
        self.spec = spec
        self.out = Path(spec.out) if spec.out else None
        self.record = Path(spec.record)
        self.wall = wall  # seconds the launch took (a cached run's: when it was built)

    def _load(self, name: str) -> dict[str, Any]:
        return torch.load(self.record / name, weights_only=True)

    def saved(self, iteration: int = SAVED_AT) -> dict[str, Any]:
        """The live state right after the save at ``iteration`` (``state``, ``steps``, ``layer``, ``group``,
        ``param_groups``, ``scheduler``, ``losses`` so far)."""
        return self._load(f"saved_{iteration}.pt")

    def loaded(self) -> dict[str, Any]:
        """The live state right after the resume's load, with ``iteration``, ``rng_loaded``, ``sharding``,
        ``checkpoint_layout``, ``consumed_train_samples``."""
        return self._load("loaded.pt")

    def final(self) -> dict[str, Any]:
        """``losses`` and ``grad_norms`` ({step index: value}), ``iteration``, and the final state."""
        return self._load("final.pt")

    def probe(self) -> dict[str, Any]:
        """``loss`` (and at DP 1 ``grads``) of the probe batch, with the state it ran on."""
        return self._load("probe.pt")

    def latest(self) -> int:
        """The iteration ``latest_checkpointed_iteration.txt`` names."""
        assert self.out is not None
        return int((self.out / "latest_checkpointed_iteration.txt").read_text().strip())

    def iteration_dir(self, iteration: int | None = None) -> Path:
        assert self.out is not None
        return self.out / f"iter_{self.latest() if iteration is None else iteration:07d}"


def run_megatron(spec: MegatronSpec, *, timeout: float = 600.0) -> MegatronRun:
    """Run ``spec`` on ``spec.world`` local gloo ranks; raise RankFailure with the failing rank's log."""
    import time

    spec = replace(spec, port=spec.port or free_port())
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")]))}
    start = time.monotonic()
    launch(
        spec.world,
        spec.to_json(),
        port=spec.port,
        module=_WORKER,
        timeout=timeout,
        log_dir=Path(spec.record) / "logs",
        env=env,
        cwd=_ROOT,
    )
    return MegatronRun(spec, time.monotonic() - start)


def cached_run(name: str, spec: MegatronSpec) -> MegatronRun:
    """``spec`` run once into the fixture cache (its ``out``/``record`` are set here)."""
    raw = replace(spec, out="", record="", port=0).to_json()
    key = hashlib.sha1(f"{_VERSION}{raw}".encode()).hexdigest()[:16]
    folder = cache_root() / f"megatron-{name}-{key}"
    spec = replace(spec, out=str(folder / "out"), record=str(folder / "record"))
    done = build_once(folder, lambda: f"{run_megatron(spec).wall:.1f}")  # the build's seconds
    return MegatronRun(spec, float(done) if done.replace(".", "", 1).isdigit() else 0.0)


def save_spec(tp: int, pp: int, dp: int, sharding: str, **fields: Any) -> MegatronSpec:
    """The standard save run at (tp, pp, dp): ``TOTAL`` steps, a checkpoint after ``SAVED_AT``."""
    return MegatronSpec(tp=tp, pp=pp, dp=dp, sharding=sharding, steps=TOTAL, save_at=[SAVED_AT], **fields)


def resume_at(
    folder: str | os.PathLike, tp: int, pp: int, dp: int, *, work: Path, name: str, steps: int = 3, **fields: Any
) -> MegatronRun:
    """Megatron's own resume of the checkpoint ``folder`` (holding ``latest_checkpointed_iteration.txt``) at
    (tp, pp, dp), then ``steps`` steps; never cached. The model's sizes come from the checkpoint's args;
    ``fields`` (``odd``, ``global_batch``, ``bucket_size``, ``guard``, ``load_fixes``, ``out``...) must match
    the saver's where they are not in the checkpoint (its data: ``seed``, ``global_batch``)."""
    refuse_in_fast_tier(Path(folder))
    spec = MegatronSpec(tp=tp, pp=pp, dp=dp, resume=str(folder), steps=steps, record=str(work / name), **fields)
    return run_megatron(spec)


def forward_backward(
    tokens: torch.Tensor, labels: torch.Tensor, *, work: Path, name: str = "probe", **fields: Any
) -> dict[str, Any]:
    """Megatron's loss of one batch (``tokens`` and ``labels``, [rows, seq] each, labels already the next
    tokens), with one backward: the probe record (``loss``; at DP 1 ``grads`` by Megatron name; the ``state``
    it ran on). ``fields`` say which model: ``resume`` (a checkpoint folder), ``weights`` (a torch file of full
    tensors by Megatron name), or neither (the fresh init of ``seed``); and the layout (``tp``, ``pp``, ``dp``,
    default 1). ``rows`` must divide by ``dp``; each DP rank runs its rows as one micro-batch."""
    refuse_in_fast_tier(work / name)
    (work / name).mkdir(parents=True, exist_ok=True)
    batch = work / name / "batch.pt"
    torch.save({"tokens": tokens, "labels": labels}, batch)
    layout = {"tp": 1, "pp": 1, "dp": 1} | {k: fields.pop(k) for k in ("tp", "pp", "dp") if k in fields}
    spec = MegatronSpec(**layout, steps=0, probe=str(batch), record=str(work / name), **fields)
    return run_megatron(spec).probe()
