"""The FSDP test runs themselves (tests/support/fsdp_worker.py): real Trainer / Accelerate FSDP1 and FSDP2
folders saved at 2 processes and resumed by stock Trainer / Accelerate at 1, 2 and 3.

FSDP2 SHARDED loads the saved live state bit for bit at every world size; FSDP1 SHARDED's stock load
leaves the optimizer empty (accelerate's "Bug 1") unless the run opts in to ``fsdp1_optim_fix``.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tests.support.hf_runs import (  # noqa: E402
    ACCELERATE_WORKER,
    BATCH,
    SAVED_AT,
    HfRun,
    assert_state_equal,
    cached_run,
    fsdp_extra,
    run_hf,
)
from tests.support.hf_worker import HfSpec  # noqa: E402

#: fp32 at another world size sums in another order; measured differences are ~5e-7 (losses near 4.12)
_FP32_LOSS_TOL = 1e-5


def _saved(name: str, version: int, module: str | None = None) -> HfRun:
    spec = HfSpec(world=2, extra=fsdp_extra(version))
    return cached_run(name, spec) if module is None else cached_run(name, spec, module=module)


def _resume(folder: Path, world: int, work: Path, extra: dict[str, Any], module: str | None = None) -> HfRun:
    micro, accum = BATCH[world]
    spec = HfSpec(world=world, per_device=micro, accum=accum, resume=str(folder), extra=extra)
    spec = replace(spec, out=str(work / "out"), record=str(work / "record"))
    return run_hf(spec) if module is None else run_hf(spec, module=module)


def _check_save(saved: HfRun, backend: str, folder: Path) -> dict[str, Any]:
    """The save run's own records: a real FSDP run that saved a DCP folder at step 4 with full state."""
    assert (folder / "pytorch_model_fsdp_0" / ".metadata").is_file()
    assert (folder / "optimizer_0" / ".metadata").is_file()
    at_save = saved.saved(SAVED_AT)
    assert at_save["backend"] == backend and at_save["global_step"] == SAVED_AT
    assert set(at_save["steps"]) == {float(SAVED_AT)}
    assert at_save["weight_decay"] == [0.0, 0.1]
    assert len(at_save["state"]) == 21  # the tiny Llama's parameters, by clean name
    assert all("_fsdp_wrapped_module" not in name for name in at_save["state"])
    assert all(set(entry) == {"fp32", "exp_avg", "exp_avg_sq"} for entry in at_save["state"].values())
    return at_save


def _check_continued(run: HfRun, saved: HfRun) -> None:
    """Trained on to step 7 with the saved run's losses (only fp32 summation order differs)."""
    final, ref = run.final(), saved.final()
    assert final["global_step"] == ref["global_step"] == 7
    assert set(final["steps"]) == {7.0}
    for step in range(SAVED_AT + 1, 8):
        assert abs(final["losses"][step] - ref["losses"][step]) < _FP32_LOSS_TOL, f"step {step}"


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3])
def test_trainer_fsdp2_sharded_resume_is_bit_exact(world: int, tmp_path: Path) -> None:
    saved = _saved("trainer-fsdp2-sharded-save", 2)
    ckpt = saved.out / f"checkpoint-{SAVED_AT}"
    at_save = _check_save(saved, "fsdp2", ckpt)
    run = _resume(ckpt, world, tmp_path, fsdp_extra(2))
    loaded = run.loaded()
    assert loaded["backend"] == "fsdp2" and loaded["global_step"] == SAVED_AT
    assert set(loaded["steps"]) == {float(SAVED_AT)}
    assert loaded["weight_decay"] == [0.0, 0.1]
    assert_state_equal(loaded["state"], at_save["state"])
    _check_continued(run, saved)
    for rank in range(world):
        assert (run.record / f"rng_loaded_{rank}.pt").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("fix", [False, True], ids=["stock", "optim-fix"])
def test_trainer_fsdp1_sharded_resume_drops_optimizer_unless_fixed(world: int, fix: bool, tmp_path: Path) -> None:
    saved = _saved("trainer-fsdp1-sharded-save", 1)
    ckpt = saved.out / f"checkpoint-{SAVED_AT}"
    at_save = _check_save(saved, "fsdp1", ckpt)
    extra = fsdp_extra(1, fsdp1_optim_fix=True) if fix else fsdp_extra(1)
    run = _resume(ckpt, world, tmp_path, extra)
    loaded = run.loaded()
    assert loaded["backend"] == "fsdp1" and loaded["global_step"] == SAVED_AT
    assert loaded["weight_decay"] == [0.0, 0.1]
    if fix:
        assert set(loaded["steps"]) == {float(SAVED_AT)}
        assert_state_equal(loaded["state"], at_save["state"])
        _check_continued(run, saved)
    else:  # Bug 1: the parameters come back, the Adam moments and steps do not
        assert loaded["steps"] == []
        params = {name: {"fp32": entry["fp32"]} for name, entry in at_save["state"].items()}
        assert_state_equal(loaded["state"], params)
        assert all(set(entry) == {"fp32"} for entry in loaded["state"].values())


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_accelerate_fsdp2_sharded_load_is_bit_exact(world: int, tmp_path: Path) -> None:
    saved = _saved("accel-fsdp2-sharded-save", 2, module=ACCELERATE_WORKER)
    state = saved.out / "state"
    at_save = _check_save(saved, "fsdp2", state)
    run = _resume(state, world, tmp_path, fsdp_extra(2), module=ACCELERATE_WORKER)
    loaded = run.loaded()
    assert loaded["backend"] == "fsdp2" and loaded["global_step"] == SAVED_AT
    assert set(loaded["steps"]) == {float(SAVED_AT)}
    assert_state_equal(loaded["state"], at_save["state"])
    _check_continued(run, saved)


@pytest.mark.slow
@pytest.mark.parametrize("version", [1, 2], ids=["fsdp1", "fsdp2"])
def test_trainer_full_state_dict_resume_is_bit_exact(version: int, tmp_path: Path) -> None:
    extra = fsdp_extra(version, "FULL_STATE_DICT")
    saved = cached_run(f"trainer-fsdp{version}-full-save", HfSpec(world=2, extra=extra))
    ckpt = saved.out / f"checkpoint-{SAVED_AT}"
    assert (ckpt / "pytorch_model_fsdp.bin").is_file() and (ckpt / "optimizer.bin").is_file()
    at_save = saved.saved(SAVED_AT)
    run = _resume(ckpt, 3, tmp_path, extra)
    loaded = run.loaded()
    assert loaded["backend"] == f"fsdp{version}" and loaded["global_step"] == SAVED_AT
    assert set(loaded["steps"]) == {float(SAVED_AT)}
    assert_state_equal(loaded["state"], at_save["state"])
    _check_continued(run, saved)
