"""``ucp.restore`` into a live PipelineEngine: each rank restores its stage from the universal directory of
the PP=2 x DP=2 fixture (tests/test_pipeline.py), at PP=2 x DP=1 and PP=2 x DP=2.

What each stage's engine holds right after the restore (a run of 0 steps) is compared bit for bit with
the universal directory; 3 trained steps are compared with the same PipelineEngine loading ucp's native
pipeline output, and with the fixture's run uninterrupted. DeepSpeed runs here besides the two fixtures
(fp32, bf16): three 0-step restores, two 3-step restores, one native load, the uninterrupted run, one
refused restore (each a few seconds to a minute on 2 CPU cores).
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.pipeline_runs import BuiltPipe, build_pipe, run_pipe, run_through, universal_of
from ucp.harness import LoadSpec
from ucp.harness.launch import RankFailure
from ucp.harness.pipeline import run_pipeline
from ucp.sources import open_reader
from ucp.targets.pipeline import PipelineLayout, StageView, write_pipeline
from ucp.universal.writer import write_universal

pytestmark = pytest.mark.slow

TIED = "tied_modules.embed.weight"
#: the fixture model's partition at PP=2 (uniform over 6 layers) and its tied embedding's layers
LAYOUT = PipelineLayout(parts=(0, 3, 6), tied={"embed": (0, 5)})


@pytest.fixture(scope="module")
def pipe() -> BuiltPipe:
    return build_pipe(pp=2, dp=2, stage=1, dtype="fp32")


@pytest.fixture(scope="module")
def universal(pipe: BuiltPipe, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return universal_of(pipe, tmp_path_factory)


def _live(pipe: BuiltPipe, universal: Path, work: Path, *, dp: int, steps: int) -> list[dict[str, Any]]:
    """Each stage's record of a PipelineEngine at PP=2 x ``dp`` that ``ucp.restore``d ``universal``."""
    load = LoadSpec(str(universal), kind="ucp")
    return run_pipe(pipe, name=f"live-dp{dp}-s{steps}", work=work, load=load, dp=dp, steps=steps)


@pytest.fixture(scope="module")
def bf16_universal(tmp_path_factory: pytest.TempPathFactory) -> tuple[BuiltPipe, Path]:
    built = build_pipe(pp=2, dp=2, stage=1, dtype="bf16")
    return built, universal_of(built, tmp_path_factory)


@pytest.mark.parametrize("dtype, dp", [("fp32", 1), ("fp32", 2), ("bf16", 1)])
def test_each_stage_holds_the_universal_state_bit_for_bit_after_restore(
    pipe, universal, bf16_universal, tmp_path, dtype, dp
):
    """Every stage's fp32 masters, moments and steps are the universal directory's (ZeRO-1, or BF16_Optimizer
    for bf16), a tied module on both stages, the model weights refreshed from the masters; frozen weights and
    the buffer are the layer files' (through the universal directory)."""
    if dtype == "bf16":
        pipe, universal = bf16_universal
    records = _live(pipe, universal, tmp_path, dp=dp, steps=0)
    with open_reader(universal) as reader:
        facts = reader.facts
        layers = [set(range(LAYOUT.parts[s], LAYOUT.parts[s + 1])) for s in range(LAYOUT.pp)]
        for stage, rec in enumerate(records):
            expected = {p.name for p in facts.params if stage in LAYOUT.stages_of(p.name)}
            assert set(rec["module"]) == expected, stage
            assert TIED in rec["params"], stage
            assert rec["state_steps"] and set(rec["state_steps"]) == {float(facts.step)}, stage
            assert rec["counters"]["global_steps"] == facts.info.global_steps
            for name in expected:
                state = reader.read(name)
                if name in rec["frozen"]:
                    assert torch.equal(rec["module"][name].float(), state.fp32), name
                    continue
                assert torch.equal(rec["params"][name], state.fp32), name
                assert torch.equal(rec["module"][name], state.fp32.to(rec["module"][name].dtype)), name  # the weight
                assert sorted(rec["state"]) == sorted(state.optim), name
                for key, value in state.optim.items():
                    assert torch.equal(rec["state"][key][name], value), (name, key)
            buffers = {n: v for n, v in reader.buffers().items() if int(n.split(".")[0]) in layers[stage]}
            assert rec["buffers"].keys() == buffers.keys()
            assert all(torch.equal(rec["buffers"][n], v) for n, v in buffers.items())
    assert sum(len(rec["frozen"]) for rec in records) == sum(p.frozen for p in facts.params) > 0


@pytest.fixture(scope="module")
def through(pipe: BuiltPipe, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_through(pipe)


@pytest.fixture(scope="module")
def native_pp2dp1(pipe: BuiltPipe, universal: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The same PipelineEngine (PP=2 x DP=1) loading ucp's native pipeline output with load_checkpoint."""
    work = tmp_path_factory.mktemp("native")
    write_pipeline(universal, work / "p", LAYOUT, dp=1, stage=1)
    return run_pipe(pipe, name="native", work=work, load=LoadSpec(str(work / "p")), dp=1)


def _max_diff(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> float:
    """The largest difference of any fp32 master or moment between two runs' stages."""
    worst = 0.0
    for ra, rb in zip(a, b, strict=True):
        assert ra["params"].keys() == rb["params"].keys()
        for name, value in ra["params"].items():
            worst = max(worst, (value - rb["params"][name]).abs().max().item())
            for key in ra["state"]:
                worst = max(worst, (ra["state"][key][name] - rb["state"][key][name]).abs().max().item())
    return worst


def test_live_restore_trains_on_like_the_uninterrupted_run_not_like_deepspeeds_loader(
    pipe, universal, through, native_pp2dp1, tmp_path
):
    """DeepSpeed 0.19.8's loader restores a forward_fn tied module's fp32 master but leaves its model weight
    as initialised, so the first step after ``load_checkpoint`` runs on a stale embedding (docs/format.md
    section 8). ``ucp.restore`` hands the fp32 partitions to the same ``load_state_dict`` and then refreshes
    every model weight from them (``update_lp_params``), so the first step runs on the trained weight and the
    3 resumed steps follow the uninterrupted PP=2 x DP=2 run (to float rounding: DP=1 sums gradients in
    another order), not the native load."""
    live = _live(pipe, universal, tmp_path, dp=1, steps=3)
    steps = pipe.spec.steps
    ours, native, whole = live[0]["losses"], native_pp2dp1[0]["losses"], through[0]["losses"][steps:]
    assert all(rec["losses"] == ours for rec in live)
    assert max(abs(a - b) for a, b in zip(ours, whole, strict=True)) <= 2e-6, (ours, whole)  # measured 4.8e-7
    assert abs(ours[0] - native[0]) > 1e-3, (ours, native)  # DeepSpeed's stale tied weight: measured 0.163
    assert _max_diff(live, through) <= 1e-6  # measured 1.2e-7
    assert _max_diff(live, native_pp2dp1) > 1e-4  # measured 4.9e-3
    for rec, ref in zip(live, through, strict=True):
        assert set(rec["state_steps"]) == set(ref["state_steps"]) == {float(2 * steps)}
        assert all(torch.equal(rec["buffers"][k], v) for k, v in ref["buffers"].items())
        assert all(torch.equal(rec["module"][n], ref["module"][n]) for n in rec["frozen"])
        assert rec["counters"] == ref["counters"]
        assert rec["lr_scheduler"]["last_epoch"] == ref["lr_scheduler"]["last_epoch"]


def test_live_restore_at_the_saved_size_trains_on_bit_for_bit_like_the_uninterrupted_run(
    pipe, universal, through, tmp_path
):
    """At the fixture's own PP=2 x DP=2 nothing is summed in another order: the 3 resumed steps are the
    uninterrupted run's, losses, fp32 masters, moments, steps and buffers equal."""
    live = _live(pipe, universal, tmp_path, dp=2, steps=3)
    assert all(rec["losses"] == through[0]["losses"][pipe.spec.steps :] for rec in live)
    assert _max_diff(live, through) == 0.0
    for rec, ref in zip(live, through, strict=True):
        assert rec["state_steps"] == ref["state_steps"]
        assert all(torch.equal(rec["module"][n], v) for n, v in ref["module"].items())
        assert all(torch.equal(rec["buffers"][k], v) for k, v in ref["buffers"].items())


def test_a_checkpoint_missing_a_stage_parameter_is_refused_in_one_line(pipe, universal, tmp_path):
    """A universal directory without the last stage's LayerNorm weight: that stage's rank refuses it with
    one line naming the stage and the parameter (strict), before anything is loaded."""
    with open_reader(universal) as reader:
        write_universal(StageView(reader, lambda name: name != "4.weight"), tmp_path / "cut")
    spec = replace(
        pipe.spec,
        dp=1,
        steps=0,
        save_dir=None,
        record=None,
        port=0,
        load=LoadSpec(str(tmp_path / "cut"), kind="ucp"),
    )
    with pytest.raises(RankFailure):
        run_pipeline(spec, log_dir=tmp_path / "logs", timeout=300)
    log = (tmp_path / "logs" / "rank1.log").read_text()
    errors = [line for line in log.splitlines() if "ucp.errors.InputError:" in line]
    assert len(errors) == 1, log[-3000:]
    assert re.fullmatch(
        r"(\[rank1\]: )?ucp\.errors\.InputError: pipeline stage 1 holds '4\.weight', which the checkpoint lacks \(1 of the "
        r"stage's 7 parameters missing\): the checkpoint is of another model; pass strict=False .*",
        errors[0],
    ), errors[0]
