#!/usr/bin/env python
"""Write a ZeRO-3 Adam checkpoint in DeepSpeed 0.19.8's exact on-disk layout without training: a benchmark input.

The benchmark needs checkpoints far larger, wider (DP 4096) and more numerous in tensors than this machine can
train. This writes the rank files DeepSpeed's ``save_checkpoint`` writes for a model described by
``bench.shapes.SynthSpec`` (param groups of named shapes, DP size, bf16 or fp32): per rank a
``zero_pp_rank_R_mp_rank_00_model_states.pt`` (empty placeholders, ``param_shapes``, counters, config) and a
``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`` (each param group's flat fp32 partition, torch AdamW's
``exp_avg`` / ``exp_avg_sq`` partitions and step, the param groups), then ``latest``. Each value is a function
of (parameter, state key, element) (:class:`Values`), so a test can hold real DeepSpeed's loaded engine to it
(tests/test_bench_synth.py) and a benchmark can check any output against it.

Only DeepSpeed's two pickled classes (``ZeroStageEnum``, ``LossScaler``) are imported from DeepSpeed; nothing
runs it. Benchmarks only: correctness tests use checkpoints real DeepSpeed wrote.

    python benchmarks/synth_checkpoint.py SPEC.json OUT_DIR [--jobs N]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench.shapes import ADAM_KEYS, SynthSpec, check_sub_groups  # noqa: E402

KEYS = ("fp32", *ADAM_KEYS)
TABLE = (1 << 20) + 7  # values repeat with this period along a parameter; odd, so rows do not line up with it
HPARAMS = {
    "betas": (0.9, 0.95),
    "eps": 1e-8,
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
    "decoupled_weight_decay": True,
}


class Values:
    """Deterministic master / exp_avg / exp_avg_sq values: element ``i`` of parameter ``index`` under ``key`` is
    ``table[key][(i + 7919 * index) % TABLE]``, tables drawn once from ``seed`` (exp_avg_sq non-negative)."""

    def __init__(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        drawn = {
            "fp32": torch.randn(TABLE, generator=gen) * 0.02,
            "exp_avg": torch.randn(TABLE, generator=gen) * 1e-3,
            "exp_avg_sq": torch.rand(TABLE, generator=gen) * 1e-6,
        }
        self.tables = {key: torch.cat([t, t]) for key, t in drawn.items()}  # any window of <= TABLE is one slice

    def fill(self, key: str, index: int, start: int, out: torch.Tensor) -> None:
        """Write elements ``start .. start + len(out)`` of parameter ``index``'s ``key`` into ``out``."""
        table, pos, off = self.tables[key], 0, (start + 7919 * index) % TABLE
        while pos < out.numel():
            take = min(out.numel() - pos, TABLE)
            out[pos : pos + take].copy_(table[off : off + take])
            pos, off = pos + take, (off + take) % TABLE

    def full(self, key: str, index: int, numel: int) -> torch.Tensor:
        out = torch.empty(numel)
        self.fill(key, index, 0, out)
        return out


def ds_config(spec: SynthSpec) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3},
        "bf16": {"enabled": spec.dtype == "bf16"},
        "zero_allow_untested_optimizer": True,
    }


def model_states(spec: SynthSpec, version: str) -> dict[str, Any]:
    """One rank's model-states file (the same on every rank for a model without frozen or shared parameters)."""
    dtype = torch.bfloat16 if spec.dtype == "bf16" else torch.float32
    return {
        "module": OrderedDict((p.name, torch.empty(0, dtype=dtype)) for p in spec.params),
        "buffer_names": [],
        "optimizer": None,
        "param_shapes": [OrderedDict((p.name, torch.Size(p.shape)) for p in group) for group in spec.groups],
        "frozen_param_shapes": OrderedDict(),
        "shared_params": {},
        "frozen_param_fragments": OrderedDict(),
        "lr_scheduler": None,
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": 0,
        "global_steps": spec.step,
        "global_samples": spec.step * spec.dp,
        "dp_world_size": spec.dp,
        "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": ds_config(spec),
        "ds_version": version,
    }


def rank_flats(spec: SynthSpec, values: Values, rank: int) -> list[dict[str, torch.Tensor]]:
    """Per param group, this rank's flat partition of each key: every parameter's slice in turn, zero-padded."""
    flats, index = [], 0
    for g, group in enumerate(spec.groups):
        flat = {key: torch.zeros(spec.group_partition(g)) for key in KEYS}
        offset = 0
        for param in group:
            size = spec.partition(param)
            start = min(rank * size, param.numel)
            end = min(start + size, param.numel)
            for key in KEYS:
                values.fill(key, index, start, flat[key][offset : offset + end - start])
            offset += size
            index += 1
        flats.append(flat)
    return flats


def optim_states(spec: SynthSpec, flats: list[dict[str, torch.Tensor]], version: str) -> dict[str, Any]:
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    state = {
        g: {"step": torch.tensor(float(spec.step)), **{key: flat[key] for key in ADAM_KEYS}}
        for g, flat in enumerate(flats)
    }
    groups = [
        {"weight_decay": 0.1 if g == 0 else 0.0, "lr": 1e-4, **HPARAMS, "initial_lr": 1e-4, "params": [g]}
        for g in range(len(spec.groups))
    ]
    return {
        "optimizer_state_dict": {
            "zero_stage": ZeroStageEnum.weights,
            "loss_scaler": LossScaler(1.0),
            "dynamic_loss_scale": False,
            "overflow": False,
            "partition_count": spec.dp,
            "optimizer_state_dict": {"state": state, "param_groups": groups},
            "fp32_flat_groups": [flat["fp32"] for flat in flats],
        },
        "ds_config": ds_config(spec),
        "ds_version": version,
    }


def _write_ranks(args: tuple[dict[str, Any], str, list[int]]) -> None:
    data, tag_dir, ranks = args
    spec = SynthSpec.from_json(data)
    values = Values(spec.seed)
    prefix = "bf16_" if spec.dtype == "bf16" else ""
    version = "0.19.8"
    for rank in ranks:
        torch.save(
            model_states(spec, version), os.path.join(tag_dir, f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
        )
        flats = rank_flats(spec, values, rank)
        name = f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        torch.save(optim_states(spec, flats, version), os.path.join(tag_dir, name))


def write_checkpoint(spec: SynthSpec, out: Path, jobs: int = 1) -> Path:
    """Write ``spec`` under ``out`` (``out/global_stepN/`` plus ``out/latest``); the tag folder."""
    check_sub_groups(spec)
    tag = f"global_step{spec.step}"
    tag_dir = out / tag
    tag_dir.mkdir(parents=True, exist_ok=True)
    data = spec.to_json()
    shares = [(data, str(tag_dir), list(range(j, spec.dp, jobs))) for j in range(max(1, min(jobs, spec.dp)))]
    if len(shares) == 1:
        _write_ranks(shares[0])
    else:
        with multiprocessing.get_context("fork").Pool(len(shares)) as pool:
            pool.map(_write_ranks, shares)
    (out / "latest").write_text(tag)
    return tag_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec", type=Path, help="a SynthSpec as JSON")
    parser.add_argument("out", type=Path, help="folder to write (global_stepN/ and latest)")
    parser.add_argument("--jobs", type=int, default=1, help="processes writing ranks (default 1)")
    args = parser.parse_args()
    spec = SynthSpec.from_json(json.loads(args.spec.read_text()))
    write_checkpoint(spec, args.out, args.jobs)


if __name__ == "__main__":
    main()
