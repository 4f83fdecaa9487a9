"""DeepSpeed's CUDA-only ZeRO modes, saved for real on a GPU: what ucp reads from each, and what it refuses.

Marked ``gpu`` (gpu/run.sh runs them; they skip without CUDA). One rank on the one GPU, bf16, a model of two
param groups; every checkpoint is kept for the CPU tests when $UCP_GPU_KEEP is set (under ``modes/``;
tests/test_cuda_modes_written.py reads the set an H200 wrote, with what it showed). The modes (docs/gpu.md):

- SuperOffload (``offload_optimizer.super_offload``, ZeRO-3) and ZenFlow's ``overlap_step`` (ZeRO-2): their CPU
  Adam steps in a process of its own, and the save holds no optimizer state: ucp says so, a restore asks for
  ``--step reset``, and one resumes as DeepSpeed's own resume does (from moments at zero).
- ZeRO-Offload++ (``offload_optimizer.ratio`` 0.5, ZeRO-3): the first sub-groups are stepped on the GPU by a
  second torch AdamW that the save leaves out; ucp refuses in one line, before writing anything.
- ZenFlow at ZeRO-3: every matrix saved transposed; ucp reads the model's shapes and writes ZenFlow's back.
- FastPersist (``checkpoint.writer`` type ``fast``): its ZeRO-1/2 files are named ``NAME-0.1``, which
  DeepSpeed's load does not look for, and DeepSpeed 0.19.8's fast engine loads with torch's ``weights_only``
  default, which refuses its own files under torch 2.6 and later: both resumes run without the writer.

For the modes ucp reads: to-universal against the live engine, and a same-size restore through ucp resumes as
DeepSpeed's native resume does.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

import ucp
from tests.support.checks import assert_adam_universal_matches_record, assert_same_training
from tests.support.fixtures import Built, build, resume
from ucp.errors import InputError
from ucp.harness import LoadSpec
from ucp.sources import open_reader


def _zero3(**offload: Any) -> dict:
    return {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "offload_optimizer": {"device": "cpu", **offload},
    }


_ZENFLOW = {
    "topk_ratio": 0.25,
    "select_strategy": "step",
    "select_interval": 2,
    "update_interval": 2,
    "full_warm_up_rounds": 0,
}
_RUN = dict(device="cuda", dp=1, dtype="bf16", steps=4)
_CPU_ADAM = dict(optimizer="ds-cpu-adam", offload=True)
CELLS: dict[str, dict[str, Any]] = {
    "superoffload": dict(_RUN, stage=3, **_CPU_ADAM, ds_config={"zero_optimization": _zero3(super_offload=True)}),
    "offload-pp": dict(_RUN, stage=3, **_CPU_ADAM, ds_config={"zero_optimization": _zero3(ratio=0.5)}),
    "zenflow-z3": dict(
        _RUN,
        stage=3,
        **_CPU_ADAM,
        zenflow=2,
        ds_config={"zero_optimization": {**_zero3(), "zenflow": {**_ZENFLOW, "overlap_step": False}}},
    ),
    "zenflow-overlap-z2": dict(
        _RUN,
        stage=2,
        **_CPU_ADAM,
        zenflow=2,
        ds_config={
            "zero_optimization": {
                "stage": 2,
                "offload_optimizer": {"device": "cpu"},
                "zenflow": {**_ZENFLOW, "overlap_step": True},
            }
        },
    ),
}
for _stage in (2, 3):
    CELLS[f"fastpersist-z{_stage}"] = dict(
        _RUN,
        stage=_stage,
        optimizer="torch-adamw-fused",
        ds_config={"checkpoint": {"writer": {"type": "fast", "data_parallel": "replica"}}},
    )
#: ZenFlow's masters lag the weights (ucp.model.zenflow), and its ZeRO-3 records hold matrices transposed
_ZENFLOW_CELLS = {"zenflow-z3", "zenflow-overlap-z2"}
#: saves that hold no optimizer state (its optimizer ran in a process of its own)
_UNSAVED = {"superoffload", "zenflow-overlap-z2"}
_REFUSED = {"offload-pp": "ZeRO-Offload++"}


def _param(name: str) -> Any:
    marks = [
        pytest.mark.gpu,
        pytest.mark.xdist_group(f"mode-{name}"),
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    ]
    return pytest.param(name, id=name, marks=marks)


READ = [_param(n) for n in CELLS if n not in _REFUSED]


@pytest.fixture(scope="module")
def cell():
    made: dict[str, Built] = {}

    def get(name: str) -> Built:
        if name not in made:
            # FastPersist's writer asks the launcher's machine counts (DeepSpeed's runner sets them)
            os.environ.setdefault("CROSS_SIZE", "1")
            os.environ.setdefault("CROSS_RANK", "0")
            made[name] = build(**CELLS[name])
            _keep(name, made[name])
        return made[name]

    return get


def _keep(name: str, built: Built) -> None:
    keep = os.environ.get("UCP_GPU_KEEP")
    if keep:
        import shutil

        folder = Path(keep) / "modes" / name
        shutil.copytree(built.path.parent, folder, dirs_exist_ok=True)
        (folder / "spec.json").write_text(built.spec.to_json())


@pytest.mark.slow
@pytest.mark.parametrize("name", [_param(n) for n in _REFUSED])
def test_a_mode_whose_save_leaves_state_out_is_refused_in_one_line(cell, name, tmp_path):
    built = cell(name)
    with pytest.raises(InputError) as refused:
        ucp.to_universal(built.path, tmp_path / "u")
    message = str(refused.value)
    assert _REFUSED[name] in message and "\n" not in message, message
    assert not (tmp_path / "u").exists()


@pytest.mark.slow
@pytest.mark.parametrize("name", READ)
def test_a_mode_reads_as_the_live_engine_holds_it(cell, name, tmp_path):
    built = cell(name)
    ucp.to_universal(built.path, tmp_path / "u")
    if name in _UNSAVED:
        with open_reader(tmp_path / "u") as reader:
            assert any("holds no optimizer state" in w for w in reader.facts.warnings)
    elif name not in _ZENFLOW_CELLS:  # ZenFlow's: checked by the resume below and on a CPU
        assert_adam_universal_matches_record(tmp_path / "u", built.record)


@pytest.mark.slow
@pytest.mark.parametrize("name", READ)
def test_a_mode_restored_through_ucp_resumes_as_deepspeed_does(cell, name, tmp_path):
    built = cell(name)
    out = tmp_path / "n"
    step = "reset" if name in _UNSAVED else "keep"
    ucp.write_native(built.path, out, dp=1, stage=built.spec.stage, optimizer=_flavour(built), step=step)
    if name.startswith("fastpersist"):  # resumed without the fast writer (see above); ZeRO-3's files as saved
        built = Built(built.path, built.record_path, replace(built.spec, ds_config=None))
    ours = resume(built, LoadSpec(str(out)), name="ucp", work=tmp_path)
    if name == "fastpersist-z2":  # DeepSpeed cannot load its own NAME-0.1 files: the state right after loading
        loaded = resume(built, LoadSpec(str(out)), steps=0, name="loaded", work=tmp_path)
        for key in ("params", "exp_avg", "exp_avg_sq"):
            for param, value in built.record[key].items():
                assert torch.equal(loaded[key][param], value), (key, param)
        return
    reference = resume(built, LoadSpec(str(built.path)), name="native", work=tmp_path)
    assert_same_training(reference, ours, atol=1e-6 if name in _ZENFLOW_CELLS else 0.0)


def _flavour(built: Built) -> str:
    return "torch-adam" if built.spec.optimizer.startswith("torch") else built.spec.optimizer
