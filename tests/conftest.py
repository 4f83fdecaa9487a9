"""Shared fixtures: real DeepSpeed checkpoints (cached) and the native-resume references."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from dsfixtures import Built, build  # noqa: E402


@pytest.fixture(scope="session")
def z3_bf16_dp2() -> Built:
    """ZeRO-3, bf16, DP=2, torch AdamW, two param groups, several sub-groups, frozen + tied + buffers."""
    return build(dp=2, stage=3, dtype="bf16", optimizer="torch-adamw", sub_group_size=60)


@pytest.fixture(scope="session")
def z3_fp32_dp3() -> Built:
    """ZeRO-3, fp32, DP=3, torch AdamW, three param groups."""
    return build(dp=3, stage=3, dtype="fp32", optimizer="torch-adamw", param_groups=3, sub_group_size=100)
