"""A save from many ranks: real DeepSpeed ZeRO-3 bf16 at DP 64 (128 rank files, every parameter cut across all
of them, most ranks holding padding only of the small ones). ucp converts it bit-exact under a soft descriptor
limit far below what its open files need (it raises its own soft limit, as far as the hard one allows, or refuses
in one line naming the count), and a DP 4 engine loads the reshard holding the DP 64 engine's state bit for bit."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.checks import assert_adam_universal_matches_record, assert_state_equals_record
from tests.support.fixtures import Built, build, resume
from ucp.harness.spec import LoadSpec, ModelSpec

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dp64() -> Built:
    model = ModelSpec(vocab=37, hidden=10, ffn=23, layers=2)
    return build(dp=64, stage=3, dtype="bf16", steps=1, global_batch=64, model=model)


def _ucp(*args: object, soft: int, hard: int | None = None) -> subprocess.CompletedProcess:
    """``python -m ucp ARGS`` under a descriptor limit (soft, and hard when given)."""

    def limit() -> None:
        current_hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, current_hard if hard is None else hard))

    return subprocess.run(
        [sys.executable, "-m", "ucp", *map(str, args)], capture_output=True, text=True, preexec_fn=limit, timeout=600
    )


def test_a_dp64_save_converts_bit_exact_under_a_low_soft_descriptor_limit(dp64: Built, tmp_path: Path) -> None:
    done = _ucp("to-universal", dp64.path, tmp_path / "u", soft=64)
    assert done.returncode == 0, done.stderr
    assert_adam_universal_matches_record(tmp_path / "u", dp64.record)


def test_a_hard_limit_too_low_is_one_line_before_anything_is_written(dp64: Built, tmp_path: Path) -> None:
    done = _ucp("to-universal", dp64.path, tmp_path / "u", soft=100, hard=100)
    assert done.returncode != 0 and not (tmp_path / "u").exists()
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "64 files to hold open" in lines[0] and "ulimit -Hn" in lines[0], done.stderr


def test_a_dp64_save_resharded_for_dp4_loads_into_deepspeed_bit_exact(dp64: Built, tmp_path: Path) -> None:
    done = _ucp("reshard", dp64.path, tmp_path / "dp4", "--dp", 4, soft=64)
    assert done.returncode == 0, done.stderr
    after = resume(dp64, LoadSpec(str(tmp_path / "dp4"), kind="native"), dp=4, steps=0, name="dp4", work=tmp_path)
    assert_state_equals_record(after, dp64.record, steps=1)
