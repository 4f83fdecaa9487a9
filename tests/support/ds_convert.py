"""DeepSpeed's own converter, run as its users run it, for comparisons with ucp."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

__all__ = ["ds_to_universal"]


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
