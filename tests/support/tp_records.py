"""Records of the harness's TP=2 runs (one per TP rank) as full tensors, spelled out from the harness model's AutoTP
layout by hand, independently of ucp.tp; and the comparison of two runs' training."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from ucp.harness.worker import record_path

__all__ = ["records", "expected_full", "full_record", "assert_training_close"]


def records(path: Path, tp: int) -> list[dict[str, Any]]:
    return [torch.load(record_path(str(path), r), weights_only=True) for r in range(tp)]


def expected_full(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full tensor from TP=2 shards, written out from the harness model's AutoTP layout."""
    r0, r1 = shards
    if re.search(r"\.up\.(weight|bias)$", name):  # [gate; up], each 23 rows split 12 / 11
        return torch.cat([r0[:12], r1[:11], r0[12:], r1[11:]])
    if re.search(r"^blocks\.\d+\.0\.(weight|bias)$", name):  # column parallel
        return torch.cat([r0, r1])
    if re.search(r"(\.down|\.2)\.weight$", name):  # row parallel
        return torch.cat([r0, r1], dim=1)
    assert torch.equal(r0, r1), f"{name} should be replicated"
    return r0


def full_record(recs: list[dict[str, Any]]) -> dict[str, Any]:
    out = dict(recs[0])
    for key in ("params", "exp_avg", "exp_avg_sq", "module"):
        out[key] = {n: expected_full(n, [r[key][n] for r in recs]) for n in recs[0][key]}
    return out


def assert_training_close(reference: dict[str, Any], other: dict[str, Any], *, atol: float) -> None:
    for a, b in zip(reference["losses"], other["losses"], strict=True):
        assert abs(a - b) <= atol * 10, (reference["losses"], other["losses"])
    for key in ("params", "exp_avg", "exp_avg_sq"):
        for name, value in reference[key].items():
            diff = (value - other[key][name]).abs().max().item()
            assert diff <= atol, (key, name, diff)
    assert set(other["state_steps"]) == set(reference["state_steps"])
    assert other["lrs"] == reference["lrs"]
    # global_samples grows by DeepSpeed's train batch size, which under AutoTP 0.19.8 counts the TP
    # ranks as if they were data parallel: runs at other TP degrees add different amounts per step
    for key in ("global_steps", "skipped_steps"):
        assert other["counters"][key] == reference["counters"][key]
