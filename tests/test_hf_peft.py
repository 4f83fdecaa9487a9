"""Hugging Face Trainer with PEFT LoRA and DeepSpeed: the most common fine-tuning set-up, moved to another
number of processes by ucp and resumed by Trainer itself.

Trainer saves a PEFT model's DeepSpeed checkpoint with ``exclude_frozen_parameters=True`` (only the LoRA weights
and their optimizer state; the frozen base stays with the model) beside ``adapter_model.safetensors``, and
resumes it with ``load_module_strict=False``. Real runs: transformers Trainer, peft LoRA on the tiny Llama's q/v
projections, DeepSpeed ZeRO-2 and ZeRO-3 bf16 on gloo CPU ranks, saved at 2 processes.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from tests.support.hf_runs import BATCH, LOSS_TOL, SAVED_AT, HfRun, assert_state_equal, cached_run, run_hf  # noqa: E402
from tests.support.hf_worker import HfSpec  # noqa: E402
from ucp.sources import open_reader  # noqa: E402
from ucp.targets.hf import write_hf  # noqa: E402

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}


@pytest.fixture(scope="module", params=[3, 2], ids=["zero3", "zero2"])
def lora_source(request: pytest.FixtureRequest) -> dict[str, Any]:
    """A LoRA Trainer run saved at 2 processes (checkpoint-4), and Trainer's own resume of it at 2."""
    stage = request.param
    spec = HfSpec(world=2, stage=stage, extra={"lora": LORA})
    saved = cached_run(f"trainer-lora-z{stage}-save", spec)
    ckpt = saved.out / f"checkpoint-{SAVED_AT}"
    native = cached_run(f"trainer-lora-z{stage}-native", replace(spec, resume=str(ckpt)))
    return {"stage": stage, "ckpt": ckpt, "native": native}


def _run(src: dict[str, Any], world: int, work: Path, **extra: Any) -> HfRun:
    micro, accum = BATCH[world]
    spec = HfSpec(world=world, stage=src["stage"], per_device=micro, accum=accum, extra={"lora": LORA})
    return run_hf(replace(spec, out=str(work / "out"), record=str(work / "record"), **extra))


def _assert_resumed_like_native(run: HfRun, native: HfRun) -> None:
    """Right after the load: what DeepSpeed loaded from the source at 2 processes, bit for bit; then 3 more
    steps: every step counter, and the losses within bf16 noise of the native resume."""
    loaded = run.loaded()
    assert loaded["global_step"] == SAVED_AT and set(loaded["steps"]) == {float(SAVED_AT)}
    assert loaded["state"] and all("lora_" in name for name in loaded["state"]), "not a LoRA run: proves nothing"
    assert_state_equal(loaded["state"], native.loaded()["state"])
    final = run.final()
    assert final["global_step"] == final["engine_global_steps"] == SAVED_AT + 3
    assert set(final["steps"]) == {float(SAVED_AT + 3)}
    for step in range(SAVED_AT + 1, SAVED_AT + 4):
        assert abs(final["losses"][step] - native.final()["losses"][step]) <= LOSS_TOL, (step, final["losses"])


@pytest.mark.slow
def test_a_lora_folder_resumes_at_3_processes(lora_source: dict[str, Any], tmp_path: Path) -> None:
    ckpt: Path = lora_source["ckpt"]
    with open_reader(ckpt) as reader:  # the base weights are not in the checkpoint, and ucp says so
        assert reader.facts.info.frozen_excluded and not any(p.frozen for p in reader.facts.params)
    new = tmp_path / f"checkpoint-{SAVED_AT}"
    result = write_hf(ckpt, new, dp=3)
    assert (new / "adapter_model.safetensors").read_bytes() == (ckpt / "adapter_model.safetensors").read_bytes()
    assert len(result.rng) == 3
    _assert_resumed_like_native(_run(lora_source, 3, tmp_path / "run", resume=str(new)), lora_source["native"])


@pytest.mark.slow
def test_the_live_helper_resumes_a_lora_run_at_1_process(lora_source: dict[str, Any], tmp_path: Path) -> None:
    if lora_source["stage"] != 3:
        pytest.skip("one live run (ZeRO-3) keeps the suite short; ZeRO-2 goes through the same engine restore")
    run = _run(lora_source, 1, tmp_path / "live", live_from=str(lora_source["ckpt"]))
    _assert_resumed_like_native(run, lora_source["native"])
