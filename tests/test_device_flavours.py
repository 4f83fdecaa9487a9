"""The Adam family trained for real on the device each member needs: its step, moments and loss scale.

Cells are real runs of the harness. The CPU cells (torch AdamW ``fused=True`` at ZeRO-2 and ZeRO-3, and at ZeRO-2 in
fp16 with DeepSpeed's fp16 gate lifted) run everywhere, and so does one without ZeRO (stage 0, bf16:
FP16_UnfusedOptimizer around it). The CUDA cells are
marked ``gpu`` and skip without one: Apex FusedAdam (its step in the param group), DeepSpeed FusedAdam's CUDA build,
torch AdamW ``fused=True`` and ``capturable=True`` (step tensors on the device), each at ZeRO-1/2/3, bf16 and
fp16, and without ZeRO in bf16 (the Apex and DeepSpeed FusedAdam ones inside DeepSpeed's fused FP16_Optimizer). The fp16 runs start their dynamic loss scale at 2**20 so the
first steps overflow and are skipped (DeepSpeed's ``skipped_steps`` and the optimizer's step disagree).
A GPU runs one rank (DP=1, nccl). docs/gpu.md says how to run them.

What each cell checks: to-universal bit for bit against the live engine (every parameter, both moments, the
step where the flavour keeps it); a same-size restore through ucp resumes bit-identically to DeepSpeed's
native resume, the loss scaler's state included; a restore into every other member of the family resumes
within 1e-5 of the native resume (different kernels round differently), with the step where that member reads it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import ucp
from tests.support.checks import assert_adam_universal_matches_record, assert_same_training
from tests.support.fixtures import Built, build, resume
from ucp.harness import LoadSpec
from ucp.ops.inspect import inspect_path

#: the Adam flavours ucp writes (flavour names), and the harness optimizer that reads each
_READERS = {
    "torch-adam": "torch-adamw-fused",
    "ds-fused-adam": "ds-fused-adam",
    "apex-fused-adam": "apex-fused-adam",
}
_CUDA_OPTIMIZERS = ("torch-adamw-fused", "torch-adamw-capturable", "ds-fused-adam", "apex-fused-adam")
#: fp16 cells: the scale starts far above what the gradients fit under (the tied head's gradient is about the
#: scale itself, fp16's largest is 65504: 2**20 .. 2**16 overflow, about five skipped steps), then halves
#: on each overflow; twelve steps leave several applied ones
_FP16_SCALE_POWER = 20
_FP16_STEPS = 12


def _has_cuda() -> bool:
    return torch.cuda.is_available()


def _has_apex() -> bool:
    if not _has_cuda():
        return False
    try:
        import amp_C  # noqa: F401
        import apex.optimizers  # noqa: F401
    except ImportError:
        return False
    return True


def _cells() -> dict[str, dict[str, Any]]:
    cells: dict[str, dict[str, Any]] = {
        f"cpu-z{stage}-bf16-torch-adamw-fused": dict(dp=2, stage=stage, dtype="bf16", optimizer="torch-adamw-fused")
        for stage in (0, 2, 3)
    }
    # fp16 on CPU: DeepSpeed's gate lifted by the harness (ucp.harness.worker._allow_fp16_on_cpu)
    fp16 = dict(steps=_FP16_STEPS, loss_scale_power=_FP16_SCALE_POWER)
    cells["cpu-z2-fp16-torch-adamw-fused"] = dict(dp=2, stage=2, dtype="fp16", optimizer="torch-adamw-fused", **fp16)
    for stage in (0, 1, 2, 3):
        for dtype in ("bf16", "fp16") if stage else ("bf16",):  # fp16 without ZeRO: refused (its loss scale)
            for optimizer in _CUDA_OPTIMIZERS:
                fp16 = dict(steps=_FP16_STEPS, loss_scale_power=_FP16_SCALE_POWER) if dtype == "fp16" else {}
                cells[f"cuda-z{stage}-{dtype}-{optimizer}"] = dict(
                    device="cuda", dp=1, stage=stage, dtype=dtype, optimizer=optimizer, **fp16
                )
    return cells


CELLS = _cells()


def _param(name: str) -> Any:
    """A cell as a pytest param with the marks its device and optimizer need."""
    spec = CELLS[name]
    group = pytest.mark.xdist_group(name)  # a cell's tests share one worker: its build and native resume run once
    if spec.get("device") != "cuda":
        return pytest.param(name, id=name, marks=[group])
    marks = [group, pytest.mark.gpu, pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA GPU")]
    if spec["optimizer"] == "apex-fused-adam":
        marks.append(pytest.mark.skipif(not _has_apex(), reason="needs apex with its amp_C CUDA extension"))
    return pytest.param(name, id=name, marks=marks)


ALL = [_param(name) for name in CELLS]
#: the sources a cross-flavour restore starts from: torch AdamW at ZeRO-2, bf16 and fp16 on each device;
#: without ZeRO, bf16 (the restore into FusedAdam goes through DeepSpeed's fused FP16_Optimizer, on CPU too)
CROSS = [
    _param(n)
    for n in CELLS
    if n.endswith(("-z2-bf16-torch-adamw-fused", "-z0-bf16-torch-adamw-fused", "-z2-fp16-torch-adamw-fused"))
]


@pytest.fixture(scope="module")
def cell(tmp_path_factory: pytest.TempPathFactory):
    """cell(name) -> (Built, universal directory), each made once."""
    made: dict[str, tuple[Built, Path]] = {}

    def get(name: str) -> tuple[Built, Path]:
        if name not in made:
            built = build(**CELLS[name])
            universal = tmp_path_factory.mktemp(name) / "u"
            ucp.to_universal(built.path, universal)
            made[name] = (built, universal)
            _keep(name, built)
        return made[name]

    return get


@pytest.fixture(scope="module")
def native(cell, tmp_path_factory: pytest.TempPathFactory):
    """native(name) -> DeepSpeed's own resume of the cell's checkpoint, 3 more steps, run once."""
    runs: dict[str, dict[str, Any]] = {}

    def get(name: str) -> dict[str, Any]:
        if name not in runs:
            built, _ = cell(name)
            runs[name] = resume(built, LoadSpec(str(built.path)), name="native", work=tmp_path_factory.mktemp(name))
        return runs[name]

    return get


def _keep(name: str, built: Built) -> None:
    """Copy a GPU-written checkpoint, its record and spec to $UCP_GPU_KEEP (when set): tests/test_gpu_written.py
    reads them on a CPU machine."""
    keep = os.environ.get("UCP_GPU_KEEP")
    if keep and CELLS[name].get("device") == "cuda":
        import shutil

        shutil.copytree(built.path.parent, Path(keep) / name, dirs_exist_ok=True)
        (Path(keep) / name / "spec.json").write_text(built.spec.to_json())


@pytest.mark.slow
@pytest.mark.parametrize("name", ALL)
def test_to_universal_is_bit_exact_against_the_live_engine(cell, name):
    built, universal = cell(name)
    record = built.record
    if built.spec.dtype == "fp16":  # the run must have skipped steps, or the loss-scale case proves nothing
        assert 0 < record["counters"]["skipped_steps"] < built.spec.steps, record["counters"]
    assert_adam_universal_matches_record(universal, record, built_steps=1 if built.spec.stage == 0 else 0)
    assert inspect_path(universal)["skipped_steps"] == record["counters"]["skipped_steps"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ALL)
def test_same_size_restore_resumes_bit_identically_to_native_resume(cell, native, name, tmp_path):
    built, universal = cell(name)
    flavour = _flavour_of(built.spec.optimizer)
    out = tmp_path / "n"
    ucp.write_native(universal, out, dp=built.spec.dp, stage=built.spec.stage, optimizer=flavour)
    reference = native(name)
    ours = resume(built, LoadSpec(str(out)), name="ucp", work=tmp_path)
    assert_same_training(reference, ours)  # the loss scaler's state too
    if built.spec.dtype == "fp16":
        assert (
            reference["loss_scaler"]["cur_scale"] < 2.0**_FP16_SCALE_POWER
        )  # the scale the run came down to, not the initial one


@pytest.mark.slow
@pytest.mark.parametrize("name", CROSS)
@pytest.mark.parametrize("target", list(_READERS))
def test_a_restore_into_each_flavour_resumes_with_the_step_where_it_reads_it(cell, native, name, target, tmp_path):
    built, universal = cell(name)
    reader = _READERS[target]
    if built.spec.device == "cpu" and reader == "apex-fused-adam":
        pytest.skip("Apex FusedAdam runs on CUDA only")
    if reader == "apex-fused-adam" and not _has_apex():
        pytest.skip("needs apex with its amp_C CUDA extension")
    out = tmp_path / "n"
    ucp.write_native(universal, out, dp=built.spec.dp, stage=built.spec.stage, optimizer=target)
    reference = native(name)
    ours = resume(built, LoadSpec(str(out)), name="ucp", work=tmp_path, optimizer=reader)
    applied = reference["counters"]["global_steps"] - reference["counters"]["skipped_steps"]
    if built.spec.stage == 0:  # DeepSpeed's FP16 wrappers step once with zero gradients when built: one more
        applied += 1
    if target == "apex-fused-adam":
        assert all(int(g["step"]) == applied for g in ours["group_hparams"])
        assert set(ours["state_steps"]) == {None}
    else:
        assert set(ours["state_steps"]) == {float(applied)}
    assert_same_training(reference, ours, atol=1e-5, steps=False)  # the step is checked above, where each keeps it


def _flavour_of(optimizer: str) -> str:
    """The ucp flavour a harness optimizer writes (the torch AdamW switches are one flavour)."""
    return "torch-adam" if optimizer.startswith("torch-adamw") else optimizer
