#!/usr/bin/env python
"""Write a ZeRO-1, 2 or 3 Adam checkpoint in DeepSpeed 0.19.8's exact on-disk layout without training: a
benchmark input.

The benchmark needs checkpoints far larger, wider (DP 4096) and more numerous in tensors than this machine can
train. This writes the rank files DeepSpeed's ``save_checkpoint`` writes for a model described by
``bench.shapes.SynthSpec`` (param groups of named shapes, ZeRO stage, DP size, bf16 or fp32), then ``latest``:

- ZeRO-3, per rank: ``zero_pp_rank_R_mp_rank_00_model_states.pt`` (empty placeholders, ``param_shapes``, counters,
  config) and ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`` (each param group's flat fp32 partition, torch
  AdamW's ``exp_avg`` / ``exp_avg_sq`` partitions and step, the param groups);
- ZeRO-1/2: one ``mp_rank_00_model_states.pt`` (the whole module in the model dtype, ``param_shapes``, counters)
  and per rank ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`` (DeepSpeedZeroOptimizer's block: the rank's
  partition of each group's flat buffer, its padding, the Adam state and the parameters' slice mappings).

Each value is a function of (parameter, state key, element) (:class:`Values`), so a test can hold real DeepSpeed's
loaded engine to it (tests/test_bench_synth.py) and a benchmark can check any output against it.

Only DeepSpeed's pickled classes (``ZeroStageEnum``, ``LossScaler``, ``fragment_address``) are imported from
DeepSpeed; nothing runs it. Benchmarks only: correctness tests use checkpoints real DeepSpeed wrote.

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
from bench.shapes import ADAM_KEYS, SynthSpec, check_spec  # noqa: E402

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
        "zero_optimization": {"stage": spec.stage},
        "bf16": {"enabled": spec.dtype == "bf16"},
        "zero_allow_untested_optimizer": True,
    }


def model_states(spec: SynthSpec, values: Values, version: str) -> dict[str, Any]:
    """The model-states file: ZeRO-3's (the same on every rank for a model without frozen or shared parameters)
    holds empty placeholders; ZeRO-1/2's one file holds the whole module, the masters rounded to the model dtype."""
    dtype = torch.bfloat16 if spec.dtype == "bf16" else torch.float32
    if spec.stage == 3:
        module = OrderedDict((p.name, torch.empty(0, dtype=dtype)) for p in spec.params)
    else:
        module = OrderedDict(
            (p.name, values.full("fp32", i, p.numel).to(dtype).view(p.shape)) for i, p in enumerate(spec.params)
        )
    frozen = OrderedDict() if spec.stage == 3 else None
    return {
        "module": module,
        "buffer_names": [],
        "optimizer": None,
        "param_shapes": [OrderedDict((p.name, torch.Size(p.shape)) for p in group) for group in spec.groups],
        "frozen_param_shapes": frozen,
        "shared_params": {},
        "frozen_param_fragments": frozen,
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
    """Per param group, this rank's flat partition of each key, zero-padded: at ZeRO-3 every parameter's own
    slice in turn; at ZeRO-1/2 the rank's window of the group's parameters laid end to end."""
    flats, index = [], 0
    for g, group in enumerate(spec.groups):
        size = spec.group_partition(g)
        flat = {key: torch.zeros(size) for key in KEYS}
        offset = 0  # ZeRO-3: where the parameter's slice sits in the partition; ZeRO-1/2: where it sits in the group
        for param in group:
            if spec.stage == 3:
                share = spec.partition(param)
                start = min(rank * share, param.numel)
                end, at = min(start + share, param.numel), offset
                offset += share
            else:
                left = rank * size
                start = min(max(left - offset, 0), param.numel)
                end, at = min(max(left + size - offset, 0), param.numel), offset + start - left
                offset += param.numel
            if end > start:
                for key in KEYS:
                    values.fill(key, index, start, flat[key][at : at + end - start])
            index += 1
        flats.append(flat)
    return flats


def slice_mappings(spec: SynthSpec, rank: int) -> list[OrderedDict[str, Any]]:
    """ZeRO-1/2 ``param_slice_mappings``: per group, each parameter that reaches ``rank``'s partition, with the
    elements it has there and where they start in the partition."""
    from deepspeed.utils.tensor_fragment import fragment_address

    out = []
    for g, group in enumerate(spec.groups):
        size, offset, mapping = spec.group_partition(g), 0, OrderedDict()
        left = rank * size
        for param in group:
            lo, hi = max(offset, left), min(offset + param.numel, left + size)
            if lo < hi:
                mapping[param.name] = fragment_address(numel=hi - lo, start=lo - left)
            offset += param.numel
        out.append(mapping)
    return out


def optim_states(spec: SynthSpec, flats: list[dict[str, torch.Tensor]], version: str, rank: int) -> dict[str, Any]:
    """One rank's optim-states file: ZeRO-3's or DeepSpeedZeroOptimizer's (ZeRO-1/2) optimizer block."""
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
    if spec.stage == 3:
        block = {
            "zero_stage": ZeroStageEnum.weights,
            "loss_scaler": LossScaler(1.0),
            "dynamic_loss_scale": False,
            "overflow": False,
            "partition_count": spec.dp,
            "optimizer_state_dict": {"state": state, "param_groups": groups},
            "fp32_flat_groups": [flat["fp32"] for flat in flats],
        }
    else:
        paddings = [spec.group_padding(g, rank) for g in range(len(spec.groups))]
        block = {
            "loss_scaler": LossScaler(1.0),
            "dynamic_loss_scale": False,
            "overflow": False,
            "clip_grad": 0.0,
            "base_optimizer_state": {"state": state, "param_groups": groups},
            # DeepSpeed saves the masters without the end padding (a view of the padded partition), the moments with
            "single_partition_of_fp32_groups": [
                flat["fp32"][: flat["fp32"].numel() - pad] for flat, pad in zip(flats, paddings)
            ],
            "zero_stage": ZeroStageEnum.gradients if spec.stage == 2 else ZeroStageEnum.optimizer_states,
            "group_paddings": paddings,
            "param_alignment_paddings": [[0] * len(group) for group in spec.groups],
            "partition_count": [spec.dp] * len(spec.groups),
            "ds_version": version,
            "param_slice_mappings": slice_mappings(spec, rank),
        }
    return {"optimizer_state_dict": block, "ds_config": ds_config(spec), "ds_version": version}


def _write_ranks(args: tuple[dict[str, Any], str, list[int]]) -> None:
    data, tag_dir, ranks = args
    spec = SynthSpec.from_json(data)
    values = Values(spec.seed)
    prefix = "bf16_" if spec.dtype == "bf16" else ""
    version = "0.19.8"
    for rank in ranks:
        if spec.stage == 3:
            name = f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
            torch.save(model_states(spec, values, version), os.path.join(tag_dir, name))
        elif rank == 0:
            torch.save(model_states(spec, values, version), os.path.join(tag_dir, "mp_rank_00_model_states.pt"))
        flats = rank_flats(spec, values, rank)
        name = f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        torch.save(optim_states(spec, flats, version, rank), os.path.join(tag_dir, name))


def write_checkpoint(spec: SynthSpec, out: Path, jobs: int = 1) -> Path:
    """Write ``spec`` under ``out`` (``out/global_stepN/`` plus ``out/latest``); the tag folder."""
    check_spec(spec)
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
