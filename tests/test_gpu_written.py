"""Checkpoints a GPU wrote, read and resumed on a CPU machine: DP > 1 where a single GPU runs DP = 1 only.

The checkpoints are real: ``gpu/run.sh`` on an NVIDIA H200 (torch 2.11.0+cu130, DeepSpeed 0.19.8, Apex from its
main branch) wrote every CUDA cell of tests/test_device_flavours.py and tests/test_cuda_modes.py with its live
record and run spec; tests/data/gpu-written.tgz keeps them (``UCP_GPU_CHECKPOINTS`` points at a newer unpacked
set). On the CPU:

- to-universal bit for bit against the GPU engine's record, fp16 and bf16, every flavour (Apex FusedAdam's group
  step, DeepSpeed FusedAdam's CUDA build, torch AdamW ``fused`` and ``capturable``);
- restored at DP 2 into torch AdamW and DeepSpeed FusedAdam (its CPU build) on CPU ranks, the engine holds every
  master and moment bit for bit, with the step where each reads it (Apex and capturable AdamW need CUDA: their
  state moves to a CPU optimizer);
- the bf16 runs of optimizers a CPU has resume at DP 2 and follow DeepSpeed's native DP 1 resume of the same
  files within bf16's rounding (a batch split in two rounds its activations differently: measured up to 6e-4 in
  the loss over three steps across the cells; the same restore with its moments reset moves it by 2.7e-2).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import ucp
from tests.support.checks import assert_adam_universal_matches_record
from tests.support.fixtures import Built, resume
from tests.support.gpu_written import gpu_written_root, written
from ucp.harness import LoadSpec


def _written() -> list[Built]:
    root = gpu_written_root()
    return [written(folder) for folder in sorted(root.iterdir()) if (folder / "spec.json").exists()]


WRITTEN = [pytest.param(b, id=b.path.parent.name) for b in _written()]
#: restored into CPU torch AdamW at DP 2: every flavour at ZeRO-1 bf16, ZeRO-3 fp16 and without ZeRO
RESTORED = [p for p in WRITTEN if p.id.startswith(("cuda-z1-bf16-", "cuda-z3-fp16-", "cuda-z0-bf16-"))]
RESUMABLE = [
    p
    for p in WRITTEN
    if p.id in ("cuda-z2-bf16-torch-adamw-fused", "cuda-z2-bf16-ds-fused-adam", "cuda-z3-bf16-ds-fused-adam")
]
#: bf16 across a batch split: the loss of each step after the first (measured 6e-4 at most here)
_BF16_LOSS_TOL = 2e-3


@pytest.mark.slow
@pytest.mark.parametrize("built", WRITTEN)
def test_a_gpu_written_checkpoint_reads_bit_exact_on_cpu(built, tmp_path):
    ucp.to_universal(built.path, tmp_path / "u")
    assert_adam_universal_matches_record(tmp_path / "u", built.record, built_steps=1 if built.spec.stage == 0 else 0)


def _on_cpu(built: Built, **changes) -> Built:
    return Built(built.path, built.record_path, replace(built.spec, device="cpu", **changes))


@pytest.mark.slow
@pytest.mark.parametrize("built", RESTORED)
@pytest.mark.parametrize(
    ("flavour", "reader"), [("torch-adam", "torch-adamw-fused"), ("ds-fused-adam", "ds-fused-adam")]
)
def test_a_gpu_written_checkpoint_restores_bit_exact_into_cpu_ranks_at_dp_2(built, flavour, reader, tmp_path):
    out = tmp_path / "n"
    ucp.write_native(built.path, out, dp=2, stage=built.spec.stage, optimizer=flavour)
    on_cpu = _on_cpu(built, optimizer=reader)
    after = resume(on_cpu, LoadSpec(str(out)), dp=2, steps=0, name="loaded", work=tmp_path)
    record = built.record
    counters = record["counters"]
    applied = counters["global_steps"] - counters["skipped_steps"] + (1 if built.spec.stage == 0 else 0)
    for key in ("params", "exp_avg", "exp_avg_sq"):
        for name, value in record[key].items():
            assert torch.equal(after[key][name], value), (key, name)
    assert set(after["state_steps"]) == {float(applied)}
    if built.spec.dtype == "fp16" and built.spec.stage:  # the loss scale the run came down to travels too
        assert after["loss_scaler"]["cur_scale"] == record["loss_scaler"]["cur_scale"]


@pytest.mark.slow
@pytest.mark.parametrize("built", RESUMABLE)
def test_a_gpu_written_checkpoint_resumes_on_cpu_at_a_new_dp(built, tmp_path):
    on_cpu = _on_cpu(built)
    out = tmp_path / "n"
    flavour = "torch-adam" if built.spec.optimizer.startswith("torch") else built.spec.optimizer
    ucp.write_native(built.path, out, dp=2, stage=built.spec.stage, optimizer=flavour)
    reference = resume(on_cpu, LoadSpec(str(built.path)), name="native", work=tmp_path)
    ours = resume(on_cpu, LoadSpec(str(out)), dp=2, name="ucp", work=tmp_path)
    assert abs(ours["losses"][0] - reference["losses"][0]) <= 1e-5, (reference["losses"], ours["losses"])
    for a, b in zip(reference["losses"], ours["losses"], strict=True):
        assert abs(a - b) <= _BF16_LOSS_TOL, (reference["losses"], ours["losses"])
    assert ours["counters"] == reference["counters"] and ours["lrs"] == reference["lrs"]
    assert set(ours["state_steps"]) == set(reference["state_steps"])
