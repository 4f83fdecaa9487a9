"""Trainer and Accelerate folders of FSDP runs: read by ucp, written by ucp for another number of processes or the
other backend, resumed by stock Trainer / Accelerate with no manual step, compared with the framework's own resume.

The runs are real (tests/support/fsdp_worker.py): FSDP1 and FSDP2 on gloo CPU ranks, fp32, Trainer's AdamW with its
decay and no-decay groups, saved at 2 processes (checkpoint-4). The DeepSpeed runs they cross with are fp32 too, so
that the losses after the load compare within fp32's summation order.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

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
    tree_digest,
)
from tests.support.hf_worker import HfSpec  # noqa: E402
from ucp.cli import main  # noqa: E402
from ucp.errors import UcpError  # noqa: E402
from ucp.sources import open_reader  # noqa: E402
from ucp.targets.hf import write_hf  # noqa: E402
from ucp.targets.hf_fsdp import write_fsdp_folder  # noqa: E402

#: fp32 at another world size (or through another backend) sums in another order; measured differences are ~5e-7
_FP32_LOSS_TOL = 1e-5
_TRAINER = "tests.support.hf_worker"

#: the source runs: (cache name, spec's extra, worker, folder below out/)
_SOURCES: dict[str, tuple[dict[str, Any], str]] = {
    "trainer-fsdp2-sharded": (fsdp_extra(2), _TRAINER),
    "trainer-fsdp1-sharded": (fsdp_extra(1), _TRAINER),
    "trainer-fsdp2-full": (fsdp_extra(2, "FULL_STATE_DICT"), _TRAINER),
    "trainer-fsdp1-full": (fsdp_extra(1, "FULL_STATE_DICT"), _TRAINER),
    "accel-fsdp2-sharded": (fsdp_extra(2), ACCELERATE_WORKER),
}


def _folder(run: HfRun, worker: str) -> Path:
    return run.out / ("state" if worker == ACCELERATE_WORKER else f"checkpoint-{SAVED_AT}")


def _source(name: str) -> tuple[HfRun, Path, dict[str, Any], str]:
    extra, worker = _SOURCES[name]
    saved = cached_run(f"{name}-save", HfSpec(world=2, extra=extra), module=worker)
    return saved, _folder(saved, worker), extra, worker


def _native(name: str, folder: Path, extra: dict[str, Any], worker: str) -> HfRun:
    """The framework's own resume of the source at 2 processes (FSDP1 with the optimizer-load fix: the stock load
    drops the optimizer state, see tests/test_fsdp_harness.py)."""
    fixed = {"fsdp": {**extra["fsdp"], "fsdp1_optim_fix": True}} if "fsdp" in extra else extra
    spec = HfSpec(world=2, resume=str(folder), extra=fixed)
    return cached_run(f"{name}-native", spec, module=worker)


def _resume(folder: Path, world: int, work: Path, extra: dict[str, Any], worker: str, stage: int = 3) -> HfRun:
    micro, accum = BATCH[world]
    spec = HfSpec(world=world, stage=stage, per_device=micro, accum=accum, resume=str(folder), extra=extra)
    return run_hf(replace(spec, out=str(work / "out"), record=str(work / "record")), module=worker)


def _check_resumed(run: HfRun, native: HfRun, world: int) -> None:
    """Right after the load, the state the framework loaded from the source itself, bit for bit; then the same
    losses for the remaining steps."""
    loaded, ref = run.loaded(), native.loaded()
    assert loaded["global_step"] == ref["global_step"] == SAVED_AT
    assert set(loaded["steps"]) == {float(SAVED_AT)}
    assert loaded["weight_decay"] == ref["weight_decay"] == [0.0, 0.1]
    assert_state_equal(loaded["state"], ref["state"])
    final, want = run.final(), native.final()
    assert final["global_step"] == want["global_step"] == 7
    for step in range(SAVED_AT + 1, 8):
        assert abs(final["losses"][step] - want["losses"][step]) < _FP32_LOSS_TOL, f"step {step} at {world}"


# -- reading --------------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", list(_SOURCES))
def test_fsdp_folder_reads_what_the_run_held(name: str) -> None:
    """Every weight and moment as the live run held it when it saved, the step, the groups, the scheduler."""
    saved, folder, _, worker = _source(name)
    at_save = saved.saved(SAVED_AT)
    before = tree_digest(folder)
    with open_reader(folder) as reader:
        facts = reader.facts
        assert reader.format == ("hf-accelerate-fsdp" if worker == ACCELERATE_WORKER else "hf-trainer-fsdp")
        assert facts.folder is not None and facts.folder.backend == ("fsdp-full" if "full" in name else "fsdp-sharded")
        assert facts.info.global_steps == SAVED_AT and facts.info.dp_world_size == 2
        assert facts.flavour == "torch-adam" and facts.adam_w_mode is True
        assert sorted(g.hyper.weight_decay for g in facts.groups) == at_save["weight_decay"]
        assert {g.step for g in facts.groups} == {SAVED_AT}
        got = {}
        for name_, _ in at_save["state"].items():
            state = reader.read(name_)
            got[name_] = {"fp32": state.fp32, **state.optim}
        assert_state_equal(got, at_save["state"])
        scheduler = reader.extras()["lr_scheduler"]
        assert scheduler["last_epoch"] == SAVED_AT
    assert tree_digest(folder) == before, "ucp changed its input"


# -- FSDP to FSDP at another process count --------------------------------------------------------------------------
_FSDP_CASES = [
    ("trainer-fsdp2-sharded", None, 1),
    ("trainer-fsdp2-sharded", None, 3),
    ("trainer-fsdp2-full", None, 3),
    ("trainer-fsdp2-sharded", "fsdp-full", 3),
    ("trainer-fsdp1-sharded", None, 3),
    ("trainer-fsdp1-full", None, 1),
    ("accel-fsdp2-sharded", None, 1),
    ("accel-fsdp2-sharded", None, 3),
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "backend", "world"), _FSDP_CASES)
def test_fsdp_folder_resumes_at_new_process_count(name: str, backend: str | None, world: int, tmp_path: Path) -> None:
    saved, folder, extra, worker = _source(name)
    native = _native(name, folder, extra, worker)
    new = tmp_path / folder.name
    result = write_fsdp_folder(folder, new, dp=world, backend=backend)
    assert result.backend == (backend or folder_backend_of(name))
    rng = "random_states" if worker == ACCELERATE_WORKER else "rng_state"
    names = [f"{rng}_{r}.{'pkl' if worker == ACCELERATE_WORKER else 'pth'}" for r in range(world)]
    if world == 1 and worker != ACCELERATE_WORKER:
        names = ["rng_state.pth"]
    assert sorted(new_ for _, new_ in result.rng) == sorted(names)
    wanted = extra
    if backend == "fsdp-full":
        wanted = {"fsdp": {**extra["fsdp"], "state_dict_type": "FULL_STATE_DICT"}}
    if extra["fsdp"]["version"] == 1:  # the stock FSDP1 SHARDED load drops any folder's optimizer state
        wanted = {"fsdp": {**wanted["fsdp"], "fsdp1_optim_fix": True}}
    run = _resume(new, world, tmp_path / "run", wanted, worker)
    _check_resumed(run, native, world)


def folder_backend_of(name: str) -> str:
    return "fsdp-full" if "full" in name else "fsdp-sharded"


# -- across the backends ----------------------------------------------------------------------------------------------
_DS_FP32 = {"fp32": True}


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 3])
def test_deepspeed_trainer_folder_to_fsdp_and_resume(world: int, tmp_path: Path) -> None:
    """A Trainer DeepSpeed (ZeRO-2, fp32) folder written as an FSDP2 one: FSDP2 Trainer loads what DeepSpeed itself
    loaded from the source, and trains on as DeepSpeed's own resume does."""
    saved = cached_run("trainer-z2-fp32-save", HfSpec(world=2, stage=2, extra=_DS_FP32))
    ckpt = saved.out / f"checkpoint-{SAVED_AT}"
    native = cached_run("trainer-z2-fp32-native", HfSpec(world=2, stage=2, extra=_DS_FP32, resume=str(ckpt)))
    new = tmp_path / ckpt.name
    code = main(["restore", str(ckpt), str(new), "--dp", str(world), "--backend", "fsdp-sharded", "--json", "-q"])
    assert code == 0
    assert (new / "pytorch_model_fsdp_0" / ".metadata").is_file() and not (new / "latest").exists()
    assert (new / "scheduler.pt").is_file() and (new / "trainer_state.json").is_file()
    run = _resume(new, world, tmp_path / "run", fsdp_extra(2), _TRAINER)
    _check_resumed(run, native, world)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 3])
def test_fsdp_trainer_folder_to_deepspeed_and_resume(world: int, tmp_path: Path) -> None:
    """A Trainer FSDP2 folder written as a DeepSpeed ZeRO-3 one: DeepSpeed Trainer (fp32) loads what FSDP itself
    loaded from the source, and trains on as FSDP's own resume does."""
    name = "trainer-fsdp2-sharded"
    saved, folder, extra, worker = _source(name)
    native = _native(name, folder, extra, worker)
    new = tmp_path / folder.name
    result = write_hf(folder, new, dp=world, sub_group_size=200)  # the new run's zero_optimization.sub_group_size
    assert result.plan.stage == 3 and result.plan.tag == f"global_step{SAVED_AT}"
    assert (new / "latest").read_text().strip() == f"global_step{SAVED_AT}"
    assert not (new / "pytorch_model_fsdp_0").exists()
    run = _resume(new, world, tmp_path / "run", _DS_FP32, _TRAINER, stage=3)
    _check_resumed(run, native, world)


# -- the command line -----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_restore_keeps_the_folder_backend_and_refuses_deepspeed_options(tmp_path: Path, capsys: Any) -> None:
    _, folder, _, _ = _source("trainer-fsdp2-sharded")
    out = tmp_path / "out"
    assert main(["restore", str(folder), str(out), "--dp", "3", "--json", "-q"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["format"] == "trainer" and report["backend"] == "fsdp-sharded" and report["processes"] == 3
    assert (out / "optimizer_0" / ".metadata").is_file()
    assert main(["restore", str(folder), str(tmp_path / "o2"), "--dp", "3", "--stage", "2"]) != 0
    err = capsys.readouterr().err
    assert "--stage describes a DeepSpeed output" in err and "--backend deepspeed" in err
    assert not (tmp_path / "o2").exists()
    with pytest.raises(UcpError, match="name the FSDP backend"):
        write_fsdp_folder(_ds_folder(), tmp_path / "o3", dp=2)


def _ds_folder() -> Path:
    saved = cached_run("trainer-z2-fp32-save", HfSpec(world=2, stage=2, extra=_DS_FP32))
    return saved.out / f"checkpoint-{SAVED_AT}"


@pytest.mark.slow
def test_written_fsdp_folder_reads_back_equal(tmp_path: Path) -> None:
    """SHARDED and FULL outputs hold the source's state exactly (ucp diff), and inspect names the backend."""
    _, folder, _, _ = _source("trainer-fsdp2-sharded")
    for backend in ("fsdp-sharded", "fsdp-full"):
        out = tmp_path / backend
        write_fsdp_folder(folder, out, dp=3, backend=backend)
        assert main(["diff", str(folder), str(out), "-q"]) == 0
        with open_reader(out) as reader:
            assert reader.facts.folder is not None and reader.facts.folder.backend == backend
            assert reader.facts.info.dp_world_size == 3
            assert ".ucp-output" not in reader.facts.folder.files
    with open_reader(tmp_path / "fsdp-sharded") as reader:
        assert torch.equal(reader.read("lm_head.weight").fp32, _read(folder, "lm_head.weight"))


def _read(folder: Path, name: str) -> torch.Tensor:
    with open_reader(folder) as reader:
        return reader.read(name).fp32


@pytest.mark.slow
def test_migrate_plans_and_writes_an_fsdp_folder(tmp_path: Path, capsys: Any) -> None:
    """A migration's target is the FSDP run's folder too: the dry run says so and refuses DeepSpeed-only keys before
    anything is written; the run writes what ucp restore writes."""
    _, folder, _, _ = _source("trainer-fsdp1-sharded")
    config = tmp_path / "m.yaml"
    out = tmp_path / "out"
    config.write_text(f"source: {folder}\ntarget:\n  output: {out}\n  dp: 3\n  backend: fsdp-full\n  stage: 2\n")
    assert main(["migrate", str(config)]) != 0
    assert "target.stage: describes a DeepSpeed output" in capsys.readouterr().err and not out.exists()
    config.write_text(f"source: {folder}\ntarget:\n  output: {out}\n  dp: 3\n  backend: fsdp-full\n")
    assert main(["migrate", str(config), "--dry-run"]) == 0
    assert "a whole trainer folder of an FSDP run (FULL_STATE_DICT) for 3 processes" in capsys.readouterr().out
    assert main(["migrate", str(config)]) == 0 and (out / "optimizer.bin").is_file()
    assert main(["diff", str(folder), str(out), "-q"]) == 0


@pytest.mark.parametrize(
    ("entries", "needle"),
    [
        (["pytorch_model_fsdp_0/.metadata"], "no optimizer state (optimizer_0)"),
        (["pytorch_model_fsdp.bin"], "no optimizer state (optimizer.bin)"),
        (["pytorch_model_fsdp_0/.metadata", "optimizer_0/.metadata", "optimizer_1/.metadata"], "several FSDP models"),
    ],
)
def test_fsdp_folders_ucp_cannot_move_are_refused_in_one_line(entries: list[str], needle: str, tmp_path: Path) -> None:
    folder = tmp_path / "checkpoint-4"
    for entry in ["trainer_state.json", *entries]:
        (folder / entry).parent.mkdir(parents=True, exist_ok=True)
        (folder / entry).write_text("{}")
    with pytest.raises(UcpError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        open_reader(folder)
