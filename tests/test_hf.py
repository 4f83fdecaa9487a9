"""Hugging Face Trainer folders: restored by ucp for a new number of processes, resumed by Trainer itself
with no manual step, compared with the run's own native resume.

The runs are real: transformers Trainer with DeepSpeed ZeRO-2/3 bf16 on gloo CPU ranks,
torch AdamW with weight decay (two param groups). Save runs and the native resumes are cached on disk
(tests/support/hf_runs.py); every resume from a folder ucp wrote runs anew.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # Trainer runs on it

from tests.support.hf_runs import (  # noqa: E402
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
from ucp.errors import InputError, UcpError  # noqa: E402
from ucp.frameworks.hf import batch_advice, find_hf_folder, rng_plan  # noqa: E402
from ucp.targets.hf import write_hf  # noqa: E402


@pytest.fixture(scope="module", params=[3, 2], ids=["zero3", "zero2"])
def hf_source(request: pytest.FixtureRequest) -> dict[str, Any]:
    """A Trainer run saved at 2 processes (checkpoint-4), and DeepSpeed's own resume of it at 2."""
    stage = request.param
    saved = cached_run(f"trainer-z{stage}-save", HfSpec(world=2, stage=stage))
    ckpt = saved.out / f"checkpoint-{SAVED_AT}"
    native = cached_run(f"trainer-z{stage}-native", HfSpec(world=2, stage=stage, resume=str(ckpt)))
    return {"stage": stage, "saved": saved, "ckpt": ckpt, "native": native}


def _resume(src: dict[str, Any], folder: Path, world: int, work: Path, **extra: Any) -> HfRun:
    micro, accum = BATCH[world]
    spec = HfSpec(world=world, stage=src["stage"], per_device=micro, accum=accum, resume=str(folder))
    return run_hf(replace(spec, out=str(work / "out"), record=str(work / "record"), **extra))


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 3])
def test_trainer_resumes_from_ucp_folder_at_new_world_size(
    hf_source: dict[str, Any], world: int, tmp_path: Path
) -> None:
    ckpt: Path = hf_source["ckpt"]
    before = tree_digest(ckpt)
    new = tmp_path / f"checkpoint-{SAVED_AT}"
    result = write_hf(ckpt, new, dp=world)
    assert tree_digest(ckpt) == before, "the source folder changed"
    run = _resume(hf_source, new, world, tmp_path / "run")
    native: HfRun = hf_source["native"]

    # right after the load: what DeepSpeed itself loaded from the source at 2 processes, bit for bit
    loaded, ref = run.loaded(), native.loaded()
    assert loaded["global_step"] == ref["global_step"] == SAVED_AT
    assert set(loaded["steps"]) == {float(SAVED_AT)}
    assert_state_equal(loaded["state"], ref["state"])

    # every new process found an RNG file: it loaded old process r mod 2's state
    for rank in range(world):
        assert torch.equal(run.rng_loaded(rank), native.rng_loaded(rank % 2)), f"rank {rank} RNG state"
    assert len(result.rng) == world

    # 3 more steps: global_step and every optimizer step, losses within bf16 noise of the native resume
    final, ref_final = run.final(), native.final()
    assert final["global_step"] == final["engine_global_steps"] == SAVED_AT + 3
    assert set(final["steps"]) == {float(SAVED_AT + 3)}
    for step in range(SAVED_AT + 1, SAVED_AT + 4):
        assert abs(final["losses"][step] - ref_final["losses"][step]) <= LOSS_TOL, (step, final["losses"])


@pytest.mark.slow
def test_restored_folder_copies_every_source_file_unchanged(hf_source: dict[str, Any], tmp_path: Path) -> None:
    ckpt: Path = hf_source["ckpt"]
    new = tmp_path / "new"
    result = write_hf(ckpt, new, dp=3)
    for name in result.folder.files:
        assert (new / name).read_bytes() == (ckpt / name).read_bytes(), name
    assert (new / "latest").read_text() == f"global_step{SAVED_AT}"
    assert sorted(p.name for p in new.glob("rng_state*")) == ["rng_state_0.pth", "rng_state_1.pth", "rng_state_2.pth"]
    assert (new / "rng_state_2.pth").read_bytes() == (ckpt / "rng_state_0.pth").read_bytes()
    assert any("--gradient_accumulation_steps 2" in n for n in result.notes), result.notes
    assert any("not reproduced exactly" in n for n in result.notes), result.notes


@pytest.mark.slow
def test_restore_refuses_an_output_overlapping_the_source(hf_source: dict[str, Any], tmp_path: Path) -> None:
    ckpt: Path = hf_source["ckpt"]
    before = tree_digest(ckpt)
    for out in (ckpt, ckpt / "inner", ckpt.parent):
        with pytest.raises(UcpError, match="overlaps the source"):
            write_hf(ckpt, out, dp=3, overwrite=True)
    proc = subprocess.run(
        [sys.executable, "-m", "ucp", "restore", str(ckpt), str(ckpt), "--dp", "3", "--overwrite"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "overlaps the source" in proc.stderr
    assert tree_digest(ckpt) == before


@pytest.mark.slow
def test_folder_missing_an_rng_file_is_refused(hf_source: dict[str, Any], tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(hf_source["ckpt"], broken)
    for name in ("rng_state_0.pth", "rng_state_1.pth"):
        (broken / name).rename(broken / name.replace("_0", "_5").replace("_1", "_7"))
    with pytest.raises(InputError, match="RNG files for processes"):
        find_hf_folder(broken)


@pytest.mark.slow
def test_a_trainer_folder_without_deepspeed_state_is_named_so(hf_source: dict[str, Any], tmp_path: Path) -> None:
    """What Trainer saves with save_only_model=True, or without DeepSpeed: one line that says so, nothing written."""
    bare = tmp_path / "bare"
    shutil.copytree(hf_source["ckpt"], bare, ignore=shutil.ignore_patterns("global_step*", "latest"))
    with pytest.raises(InputError, match="is a Trainer folder without DeepSpeed state"):
        write_hf(bare, tmp_path / "out", dp=3)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_inspect_says_what_a_trainer_folder_holds(hf_source: dict[str, Any]) -> None:
    from ucp.ops.inspect import format_report, inspect_path

    report = inspect_path(hf_source["ckpt"])
    assert report["format"] == "hf-trainer"
    assert report["hf"]["processes"] == 2 and report["hf"]["global_step"] == SAVED_AT
    assert "trainer_state.json" in report["hf"]["files"]
    assert report["zero_stage"] == hf_source["stage"] and report["dp_world_size"] == 2
    assert "Hugging Face Trainer folder, global_step 4" in format_report(report)


@pytest.mark.parametrize(
    ("micro", "accum", "old", "new", "expect"),
    [
        (2, 3, 2, 2, None),
        (2, 3, 2, 3, "--per_device_train_batch_size 2 --gradient_accumulation_steps 2"),
        (2, 3, 2, 1, "--per_device_train_batch_size 2 --gradient_accumulation_steps 6"),
        (4, 1, 2, 4, "--per_device_train_batch_size 2 --gradient_accumulation_steps 1"),
        (2, 3, 2, 5, "no setting keeps 12 at 5 processes"),
    ],
)
def test_batch_advice_names_the_settings_that_keep_the_global_batch(
    micro: int, accum: int, old: int, new: int, expect: str | None
) -> None:
    advice = batch_advice(micro, accum, old, new)
    if expect is None:
        assert advice is None
    else:
        assert advice is not None and expect in advice


def test_rng_files_map_new_rank_to_old_rank_mod_old_world(tmp_path: Path) -> None:
    from ucp.frameworks.hf import HfFolder

    two = HfFolder(tmp_path, "trainer", "global_step4", ("rng_state_0.pth", "rng_state_1.pth"), (), (), None)
    assert rng_plan(two, 1) == [("rng_state_0.pth", "rng_state.pth")]
    assert [old for old, _ in rng_plan(two, 5)] == ["rng_state_0.pth", "rng_state_1.pth"] * 2 + ["rng_state_0.pth"]
    one = HfFolder(tmp_path, "trainer", "global_step4", ("rng_state.pth",), (), (), None)
    assert rng_plan(one, 2) == [("rng_state.pth", "rng_state_0.pth"), ("rng_state.pth", "rng_state_1.pth")]
    acc = HfFolder(tmp_path, "accelerate", "pytorch_model", ("random_states_0.pkl",), (), (), None)
    assert rng_plan(acc, 2)[1] == ("random_states_0.pkl", "random_states_1.pkl")


@pytest.mark.slow
def test_live_helper_resumes_any_world_size_and_its_save_resumes_natively(
    hf_source: dict[str, Any], tmp_path: Path
) -> None:
    if hf_source["stage"] != 3:
        pytest.skip("one live run (ZeRO-3) keeps the suite short; ZeRO-2 goes through the same engine restore")
    native: HfRun = hf_source["native"]
    live = _resume(hf_source, hf_source["ckpt"], 3, tmp_path / "live", resume=None, live_from=str(hf_source["ckpt"]))
    assert_state_equal(live.loaded()["state"], native.loaded()["state"])
    final = live.final()
    assert final["global_step"] == SAVED_AT + 3 and set(final["steps"]) == {float(SAVED_AT + 3)}
    for step in range(SAVED_AT + 1, SAVED_AT + 4):
        assert abs(final["losses"][step] - native.final()["losses"][step]) <= LOSS_TOL, (step, final["losses"])

    # the live run saved an ordinary checkpoint at 3 processes; a plain resume of it loads it as saved
    again = live.out / f"checkpoint-{SAVED_AT + 3}"
    assert find_hf_folder(again) is not None and find_hf_folder(again).old_world == 3
    more = _resume(hf_source, again, 3, tmp_path / "again", max_steps=SAVED_AT + 4)
    assert_state_equal(more.loaded()["state"], final["state"])
    assert more.final()["global_step"] == SAVED_AT + 4 and set(more.final()["steps"]) == {float(SAVED_AT + 4)}


@pytest.mark.slow
def test_migration_yaml_writes_the_same_whole_folder_as_restore(hf_source: dict[str, Any], tmp_path: Path) -> None:
    """`ucp migrate` with a Trainer folder as its source: the folder ucp restore writes (proved by the resumes
    above), its stage kept though the YAML names none; the DeepSpeed state read back equal."""
    from ucp.migrate import run_migration
    from ucp.sources import open_reader

    ckpt: Path = hf_source["ckpt"]
    config = tmp_path / "m.yaml"
    config.write_text(f"source: {ckpt}\ntarget:\n  dp: 3\n  output: {tmp_path / 'migrated'}\n")
    print(run_migration(config))
    restored = write_hf(ckpt, tmp_path / "restored", dp=3).out
    migrated = tmp_path / "migrated"
    names = sorted(str(p.relative_to(restored)) for p in restored.rglob("*") if p.is_file())
    assert names == sorted(str(p.relative_to(migrated)) for p in migrated.rglob("*") if p.is_file())
    for name in names:
        if not name.startswith(f"global_step{SAVED_AT}/") and name != ".ucp-output":
            assert (migrated / name).read_bytes() == (restored / name).read_bytes(), name
    with open_reader(restored) as want, open_reader(migrated) as got:
        assert got.facts.info.zero_stage == want.facts.info.zero_stage == hf_source["stage"]
        assert got.facts.info.dp_world_size == 3
        for meta in want.facts.params:
            a, b = want.read(meta.name), got.read(meta.name)
            assert torch.equal(a.fp32, b.fp32) and a.optim.keys() == b.optim.keys(), meta.name
            assert all(torch.equal(a.optim[k], b.optim[k]) for k in a.optim), meta.name


@pytest.mark.slow
def test_a_trainer_run_without_zero_resumes_from_ucps_folder_at_3_processes(tmp_path: Path) -> None:
    """Trainer with DeepSpeed at stage 0 (bf16: FP16_UnfusedOptimizer around Trainer's AdamW): ucp's folder for 3
    processes loads the state DeepSpeed's own resume at 2 loads, bit for bit (one file serves every size; the
    wrapper's build-time step makes every step one more), and trains within bf16 noise of it."""
    saved = cached_run("trainer-z0-save", HfSpec(world=2, stage=0))
    ckpt = saved.out / f"checkpoint-{SAVED_AT}"
    native = cached_run("trainer-z0-native", HfSpec(world=2, stage=0, resume=str(ckpt)))
    new = tmp_path / f"checkpoint-{SAVED_AT}"
    result = write_hf(ckpt, new, dp=3)
    assert result.plan.stage == 0 and (new / f"global_step{SAVED_AT}" / "mp_rank_00_model_states.pt").exists()
    run = _resume({"stage": 0}, new, 3, tmp_path / "run")
    loaded, ref = run.loaded(), native.loaded()
    assert_state_equal(loaded["state"], ref["state"])
    assert set(loaded["steps"]) == set(ref["steps"]) == {float(SAVED_AT + 1)}
    final, ref_final = run.final(), native.final()
    assert final["global_step"] == SAVED_AT + 3
    for step in range(SAVED_AT + 1, SAVED_AT + 4):
        assert abs(final["losses"][step] - ref_final["losses"][step]) <= LOSS_TOL, (step, final["losses"])


#: ZeRO-Offload as the Hugging Face DeepSpeed docs set it up: the optimizer in the DeepSpeed config ("auto"
#: values filled by Trainer), offloaded to CPU, where DeepSpeed runs its CPU Adam
_OFFLOAD = {
    "ds_config": {
        "optimizer": {"type": "AdamW", "params": dict.fromkeys(("lr", "betas", "eps", "weight_decay"), "auto")}
    },
    "zero": {"offload_optimizer": {"device": "cpu"}},
}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [3, 2])
def test_a_zero_offload_run_resumes_at_3_processes(stage: int, tmp_path: Path) -> None:
    saved = cached_run(f"trainer-offload-z{stage}-save", HfSpec(world=2, stage=stage, extra=_OFFLOAD))
    ckpt = saved.out / f"checkpoint-{SAVED_AT}"
    native = cached_run(
        f"trainer-offload-z{stage}-native", HfSpec(world=2, stage=stage, resume=str(ckpt), extra=_OFFLOAD)
    )
    new = tmp_path / f"checkpoint-{SAVED_AT}"
    assert write_hf(ckpt, new, dp=3).plan.flavour.name == "ds-cpu-adam"
    run = _resume({"stage": stage}, new, 3, tmp_path / "run", extra=_OFFLOAD)
    assert run.loaded()["global_step"] == SAVED_AT and set(run.loaded()["steps"]) == {float(SAVED_AT)}
    assert_state_equal(run.loaded()["state"], native.loaded()["state"])
    final = run.final()
    assert final["global_step"] == SAVED_AT + 3 and set(final["steps"]) == {float(SAVED_AT + 3)}
    for step in range(SAVED_AT + 1, SAVED_AT + 4):
        assert abs(final["losses"][step] - native.final()["losses"][step]) <= LOSS_TOL, (step, final["losses"])


@pytest.mark.slow
def test_export_of_a_trainer_folder_loads_with_from_pretrained(hf_source: dict[str, Any], tmp_path: Path) -> None:
    """What zero_to_fp32.py plus copying the config does, in one command: the folder loads as the model, every
    weight the fp32 master DeepSpeed itself loads from the folder, in the run's dtype (bf16)."""
    from transformers import AutoModelForCausalLM

    from ucp.cli import main as cli

    ckpt: Path = hf_source["ckpt"]
    before = tree_digest(ckpt)
    out = tmp_path / "model"
    assert cli(["export", str(ckpt), str(out)]) == 0
    assert tree_digest(ckpt) == before
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    assert (out / "config.json").read_bytes() == (ckpt / "config.json").read_bytes()
    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    want = hf_source["native"].loaded()["state"]
    params = dict(model.named_parameters())
    assert set(params) == set(want)
    for name, param in params.items():
        assert torch.equal(param.detach(), want[name]["fp32"].bfloat16().float()), name
    assert cli(["export", str(ckpt), str(tmp_path / "one.safetensors")]) == 0  # a file OUT: the weights alone
    # --dtype: the weights in fp16, and config.json says so (from_pretrained's dtype="auto" keeps them fp16)
    assert cli(["export", str(ckpt), str(tmp_path / "fp16"), "--dtype", "fp16"]) == 0
    source, written = (json.loads((d / "config.json").read_text()) for d in (ckpt, tmp_path / "fp16"))
    assert source["dtype"] == "bfloat16" and written == {**source, "dtype": "float16"}
    half = AutoModelForCausalLM.from_pretrained(tmp_path / "fp16", dtype="auto")
    for name, param in half.named_parameters():
        assert param.dtype == torch.float16 and torch.equal(param.detach(), want[name]["fp32"].half()), name


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_a_trainer_adafactor_run_resumes_from_ucps_folder(world: int, tmp_path: Path) -> None:
    """Trainer's ``optim="adafactor"`` (transformers' Adafactor, no first moment) under ZeRO-2: DeepSpeed hands it
    flat partitions, so it keeps a per-element second moment and an RMS of each rank's partition (recomputed
    every step, not carried). ucp read it as FusedAdam before and refused it with a wrong reason. At 2 processes the
    resume is bit-identical to DeepSpeed's own; at 3 the loaded state is the same, and the steps follow the new
    partitions (Adafactor clips each update by the RMS of the tensor it steps)."""
    extra = {"optim": "adafactor"}
    saved = cached_run("trainer-adafactor-z2-save", HfSpec(world=2, stage=2, extra=extra))
    ckpt = saved.out / f"checkpoint-{SAVED_AT}"
    native = cached_run("trainer-adafactor-z2-native", HfSpec(world=2, stage=2, resume=str(ckpt), extra=extra))
    new = tmp_path / f"checkpoint-{SAVED_AT}"
    result = write_hf(ckpt, new, dp=world)
    assert result.plan.flavour.name == "hf-adafactor"
    assert any("RMS" in note for note in result.notes) == (world != 2), result.notes
    run = _resume({"stage": 2}, new, world, tmp_path / "run", extra=extra)
    loaded, ref = run.loaded(), native.loaded()
    assert {k for t in ref["state"].values() for k in t} == {"fp32", "exp_avg_sq"}
    assert_state_equal(loaded["state"], ref["state"])
    assert loaded["global_step"] == SAVED_AT and set(loaded["steps"]) == set(ref["steps"]) == {float(SAVED_AT)}
    final, ref_final = run.final(), native.final()
    assert final["global_step"] == SAVED_AT + 3 and set(final["steps"]) == {float(SAVED_AT + 3)}
    if world == 2:
        assert final["losses"] == ref_final["losses"]
        assert_state_equal(final["state"], ref_final["state"])
    for step in range(SAVED_AT + 1, SAVED_AT + 4):  # measured 1.5e-4 at 3 processes
        assert abs(final["losses"][step] - ref_final["losses"][step]) <= LOSS_TOL, (step, final["losses"])


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_a_trainer_schedule_free_run_resumes_from_ucps_folder(world: int, tmp_path: Path) -> None:
    """Trainer's ``optim="schedule_free_adamw"`` under ZeRO-2 (its step k and weight sums in the param groups, z per
    parameter; read as RAdam before): bit-identical to DeepSpeed's own resume at 2 processes, the same loaded
    state at 3 and losses within 2e-5 of the native resume there (measured)."""
    extra = {"optim": "schedule_free_adamw"}
    saved = cached_run("trainer-sf-z2-save", HfSpec(world=2, stage=2, extra=extra))
    ckpt = saved.out / f"checkpoint-{SAVED_AT}"
    native = cached_run("trainer-sf-z2-native", HfSpec(world=2, stage=2, resume=str(ckpt), extra=extra))
    new = tmp_path / f"checkpoint-{SAVED_AT}"
    assert write_hf(ckpt, new, dp=world).plan.flavour.name == "sf-adamw"
    run = _resume({"stage": 2}, new, world, tmp_path / "run", extra=extra)
    loaded, ref = run.loaded(), native.loaded()
    assert {k for t in ref["state"].values() for k in t} == {"fp32", "exp_avg_sq", "z"}
    assert_state_equal(loaded["state"], ref["state"])
    assert set(loaded["steps"]) == set(ref["steps"]) == {float(SAVED_AT)}  # k, in every param group
    final, ref_final = run.final(), native.final()
    assert final["global_step"] == SAVED_AT + 3 and set(final["steps"]) == {float(SAVED_AT + 3)}
    if world == 2:
        assert final["losses"] == ref_final["losses"]
        assert_state_equal(final["state"], ref_final["state"])
    for step in range(SAVED_AT + 1, SAVED_AT + 4):
        assert abs(final["losses"][step] - ref_final["losses"][step]) <= LOSS_TOL, (step, final["losses"])
