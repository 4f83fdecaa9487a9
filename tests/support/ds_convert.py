"""DeepSpeed's own converter, run as its users run it, for comparisons with ucp."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from ucp.model.records import Reader

__all__ = ["ds_to_universal", "assert_trained_params_match"]


def ds_to_universal(tag_dir: Path, out: Path) -> subprocess.CompletedProcess:
    """``python -m deepspeed.checkpoint.ds_to_universal`` on one tag folder (DeepSpeed 0.19.8), with
    ``--inject_missing_state``: ZeRO-1/2 conversion asserts a universal_checkpoint_info that engines outside
    Megatron-DeepSpeed never save. Returns the finished process; the caller checks its outcome."""
    argv = ["--input_folder", str(tag_dir), "--output_folder", str(out), "--inject_missing_state"]
    argv += ["--num_extract_workers", "1", "--num_merge_workers", "1"]
    return subprocess.run(
        [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", *argv],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
        timeout=600,
    )


def assert_trained_params_match(out: Path, reader: Reader) -> None:
    """DeepSpeed's universal folder ``out`` holds exactly the reader's trained parameters, each one's fp32
    and optimizer state bit for bit (its files are DeepSpeed's own output, pickled with its own classes)."""
    zero = out / "zero"
    trained = [p.name for p in reader.facts.params if not p.frozen]
    assert sorted(p.name for p in zero.iterdir() if p.is_dir()) == sorted(trained)
    for name in trained:
        state = reader.read(name)
        for key, value in {"fp32": state.fp32, **state.optim}.items():
            theirs = torch.load(zero / name / f"{key}.pt", weights_only=False)
            assert torch.equal(theirs["param"] if isinstance(theirs, dict) else theirs, value), (name, key)
