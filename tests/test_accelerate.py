"""Accelerate ``save_state`` folders: restored by ucp for a new number of processes and loaded by
``accelerator.load_state`` itself, or loaded live through ucp; compared with the run's own native resume.

The runs are real: accelerate 1.15 with DeepSpeed ZeRO-2/3 bf16 on gloo CPU ranks, torch AdamW in two
param groups (decay, no decay), a LambdaLR schedule (tests/support/accel_worker.py). Saves and the
native resumes at 2 processes are cached on disk; every resume from ucp's output runs anew.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")  # the model is a tiny Llama

from tests.support.hf_runs import (  # noqa: E402
    ACCELERATE_WORKER,
    BATCH,
    LOSS_TOL,
    SAVED_AT,
    HfRun,
    assert_state_equal,
    cached_run,
    run_hf,
    tree_digest,
)
from tests.support.hf_worker import HfSpec  # noqa: E402
from ucp.targets.hf import write_hf  # noqa: E402


@pytest.fixture(scope="module", params=[3, 2], ids=["zero3", "zero2"])
def accel_source(request: pytest.FixtureRequest) -> dict[str, Any]:
    """An Accelerate run saved at 2 processes after 4 optimizer steps, and its native resume at 2."""
    stage = request.param
    saved = cached_run(f"accel-z{stage}-save", HfSpec(world=2, stage=stage), module=ACCELERATE_WORKER)
    state = saved.out / "state"
    native = cached_run(
        f"accel-z{stage}-native", HfSpec(world=2, stage=stage, resume=str(state)), module=ACCELERATE_WORKER
    )
    return {"stage": stage, "state": state, "native": native}


def _run(src: dict[str, Any], world: int, work: Path, **fields: Any) -> HfRun:
    micro, accum = BATCH[world]
    spec = HfSpec(world=world, stage=src["stage"], per_device=micro, accum=accum, out=str(work / "out"))
    return run_hf(replace(spec, record=str(work / "record"), **fields), module=ACCELERATE_WORKER)


def _assert_resumed_like_native(run: HfRun, native: HfRun) -> None:
    loaded, ref = run.loaded(), native.loaded()
    assert loaded["global_step"] == ref["global_step"] == SAVED_AT
    assert set(loaded["steps"]) == {float(SAVED_AT)}
    assert_state_equal(loaded["state"], ref["state"])
    final, ref_final = run.final(), native.final()
    assert final["global_step"] == SAVED_AT + 3 and set(final["steps"]) == {float(SAVED_AT + 3)}
    for step in range(SAVED_AT + 1, SAVED_AT + 4):
        assert abs(final["losses"][step] - ref_final["losses"][step]) <= LOSS_TOL, (step, final["losses"])


@pytest.mark.slow
@pytest.mark.parametrize("world", [3, 1])
def test_accelerate_loads_ucps_folder_at_a_new_world_size(accel_source: dict[str, Any], world: int, tmp_path: Path):
    if world == 1 and accel_source["stage"] == 2:
        pytest.skip("one process is shown at ZeRO-3; ZeRO-2 goes through the same folder writer")
    state: Path = accel_source["state"]
    before = tree_digest(state)
    new = tmp_path / "state"
    result = write_hf(state, new, dp=world)
    assert tree_digest(state) == before, "the source folder changed"
    assert result.folder.kind == "accelerate"
    assert sorted(p.name for p in new.glob("random_states_*.pkl")) == [f"random_states_{r}.pkl" for r in range(world)]
    assert (new / "scheduler.bin").read_bytes() == (state / "scheduler.bin").read_bytes()
    run = _run(accel_source, world, tmp_path / "run", resume=str(new))
    _assert_resumed_like_native(run, accel_source["native"])
    for rank in range(world):  # every new process loaded old process r mod 2's random state
        assert torch.equal(run.rng_loaded(rank), accel_source["native"].rng_loaded(rank % 2)), rank


@pytest.mark.slow
def test_live_accelerate_load_at_a_new_world_size_and_its_save_resumes_natively(
    accel_source: dict[str, Any], tmp_path: Path
):
    if accel_source["stage"] != 3:
        pytest.skip("one live run (ZeRO-3) keeps the suite short; ZeRO-2 goes through the same engine restore")
    live = _run(accel_source, 3, tmp_path / "live", live_from=str(accel_source["state"]))
    _assert_resumed_like_native(live, accel_source["native"])
    # the live run saved an ordinary state at 3 processes, which a plain load_state reads as saved
    again = _run(accel_source, 3, tmp_path / "again", resume=str(live.out / "state-again"), max_steps=SAVED_AT + 3)
    assert_state_equal(again.loaded()["state"], live.final()["state"])


@pytest.mark.slow
def test_inspect_says_what_an_accelerate_folder_holds(accel_source: dict[str, Any]):
    from ucp.ops.inspect import format_report, inspect_path

    report = inspect_path(accel_source["state"])
    assert report["format"] == "hf-accelerate" and report["hf"]["processes"] == 2
    assert report["zero_stage"] == accel_source["stage"] and report["global_steps"] == SAVED_AT
    assert "scheduler.bin" in report["hf"]["files"]
    assert "Accelerate save_state folder: DeepSpeed tag pytorch_model" in format_report(report)
