"""Checkpoints a GPU wrote, read and resumed on a CPU machine: DP > 1 where a single GPU runs DP = 1 only.

``gpu/run.sh`` leaves gpu-checkpoints.tgz: every CUDA cell of tests/test_device_flavours.py with its live
record and run spec. Unpack it and point ``UCP_GPU_CHECKPOINTS`` at the folder; without it these tests skip.
On the CPU: to-universal bit for bit against the GPU engine's record (fp16 and bf16, every flavour); the bf16
runs of optimizers the CPU has (torch AdamW fused, DeepSpeed FusedAdam's CPU build) restored at DP 2 and
resumed within 1e-5 of DeepSpeed's native DP 1 resume of the GPU-written files on the same CPU. fp16 does not
train on most CPUs (DeepSpeed refuses it), Apex and capturable AdamW need CUDA: those are read, not resumed.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

import ucp
from tests.support.checks import assert_adam_universal_matches_record, assert_same_training
from tests.support.fixtures import Built, resume
from ucp.harness import LoadSpec, RunSpec

_ROOT = os.environ.get("UCP_GPU_CHECKPOINTS")
pytestmark = pytest.mark.skipif(not _ROOT, reason="UCP_GPU_CHECKPOINTS unset (the unpacked output of gpu/run.sh)")


def _written() -> list[Built]:
    if not _ROOT:
        return []
    runs = []
    for folder in sorted(Path(_ROOT).iterdir()):
        if (folder / "spec.json").exists():
            spec = RunSpec.from_json((folder / "spec.json").read_text())
            runs.append(Built(folder / "ckpt", folder / "record.pt", spec))
    return runs


WRITTEN = [pytest.param(b, id=b.path.parent.name) for b in _written()]
RESUMABLE = [
    pytest.param(b, id=b.path.parent.name)
    for b in _written()
    if b.spec.dtype == "bf16" and b.spec.optimizer in ("torch-adamw-fused", "ds-fused-adam")
]


@pytest.mark.slow
@pytest.mark.parametrize("built", WRITTEN)
def test_a_gpu_written_checkpoint_reads_bit_exact_on_cpu(built, tmp_path):
    ucp.to_universal(built.path, tmp_path / "u")
    assert_adam_universal_matches_record(tmp_path / "u", built.record, built_steps=1 if built.spec.stage == 0 else 0)


@pytest.mark.slow
@pytest.mark.parametrize("built", RESUMABLE)
def test_a_gpu_written_checkpoint_resumes_on_cpu_at_a_new_dp(built, tmp_path):
    on_cpu = Built(built.path, built.record_path, replace(built.spec, device="cpu"))
    out = tmp_path / "n"
    flavour = "torch-adam" if built.spec.optimizer.startswith("torch") else built.spec.optimizer
    ucp.write_native(built.path, out, dp=2, stage=built.spec.stage, optimizer=flavour)
    reference = resume(on_cpu, LoadSpec(str(built.path)), name="native", work=tmp_path)
    ours = resume(on_cpu, LoadSpec(str(out)), dp=2, name="ucp", work=tmp_path)
    assert_same_training(reference, ours, atol=1e-5)
