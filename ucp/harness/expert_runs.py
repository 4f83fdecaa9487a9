"""What the two expert-parallel harnesses (legacy MoE, AutoEP) share: the DeepSpeed config of a run on
``world`` ranks, the load-train-save flow of a rank, the record's closing fields and the launch."""

from __future__ import annotations

import os
from typing import Any, Protocol

import torch

from ucp.harness.launch import free_port, launch
from ucp.harness.model import spec_batch
from ucp.harness.spec import LoadSpec, ModelSpec
from ucp.harness.worker import train_step

__all__ = ["ExpertSpec", "base_config", "drive", "record_tail", "run_expert_spec"]


class ExpertSpec(Protocol):
    """The fields MoeSpec and AutoEpSpec share."""

    world: int
    stage: int
    dtype: str
    model: ModelSpec
    global_batch: int
    seq: int
    data_seed: int
    steps: int
    first_step: int
    load: LoadSpec | None
    save_dir: str | None
    save_tag: str | None
    port: int

    def to_json(self) -> str: ...


def base_config(spec: ExpertSpec) -> dict[str, Any]:
    """The DeepSpeed config of a run on ``spec.world`` ranks, one micro-batch per step."""
    config: dict[str, Any] = {
        "train_batch_size": spec.global_batch,
        "train_micro_batch_size_per_gpu": spec.global_batch // spec.world,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": spec.stage},
        "bf16": {"enabled": spec.dtype == "bf16"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    if spec.load is not None and spec.load.kind == "ds-universal":
        config["checkpoint"] = {"load_universal": True}
    return config


def drive(engine: Any, spec: ExpertSpec) -> list[float]:
    """Load ``spec.load`` (DeepSpeed's own loader), train ``spec.steps`` steps from batch ``spec.first_step``,
    save to ``spec.save_dir``; the losses, averaged over the ranks."""
    if spec.load is not None:
        path, _ = engine.load_checkpoint(spec.load.path, tag=spec.load.tag)
        if path is None:
            raise SystemExit(f"DeepSpeed loaded nothing from {spec.load.path}")
    rank = torch.distributed.get_rank()
    losses = []
    for step in range(spec.first_step, spec.first_step + spec.steps):
        tokens = spec_batch(spec, step, rank=rank, dp=spec.world)
        losses.append(train_step(engine, tokens))
    if spec.save_dir:
        engine.save_checkpoint(spec.save_dir, tag=spec.save_tag)
    return losses


def record_tail(engine: Any, base: Any) -> dict[str, Any]:
    """The record's fields beyond the parameters: group settings, steps, counters, the scheduler."""
    return {
        "group_hparams": [{k: v for k, v in g.items() if k != "params"} for g in base.param_groups],
        "state_steps": [
            float(s["step"]) if torch.is_tensor(s.get("step")) else s.get("step") for s in base.state.values()
        ],
        "counters": {"global_steps": engine.global_steps, "global_samples": engine.global_samples},
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
    }


def run_expert_spec(
    spec: ExpertSpec, module: str, *, timeout: float = 900.0, log_dir: str | os.PathLike | None = None
) -> None:
    """Run ``spec`` on ``spec.world`` local processes of ``module`` and wait for all of them."""
    if not spec.port:
        spec.port = free_port()
    launch(spec.world, spec.to_json(), port=spec.port, module=module, timeout=timeout, log_dir=log_dir)
