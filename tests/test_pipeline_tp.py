"""Pipeline x tensor x data parallelism (3D): a real PipelineEngine run at PP=2 x TP=2 x DP=2 (ZeRO-1, fp32,
8 gloo ranks; Megatron-style blocks, ``ucp.harness.pipeline``) merged into whole parameters bit for bit
against every rank's live engine, written back at the same layout with DeepSpeed's own tensors, and at
other PP x TP x DP layouts that PipelineEngine (or, at PP=1, an ordinary engine) resumes.

Like Megatron-DeepSpeed, the run saves a ``universal_checkpoint_info`` saying which parameters are
replicated and which are cut along dim 1; ucp merges each stage's TP ranks by it, as for any TP checkpoint.
Resumes on a PipelineEngine are compared with DeepSpeed's native resume of the 3D checkpoint (both run
their first step on the tied embedding as initialised, see tests/test_pipeline.py); the PP=1 resume on an
ordinary engine with the uninterrupted run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import ucp
from tests.support.digest import tree
from tests.support.ds_convert import assert_trained_params_match, ds_to_universal
from tests.support.pipeline_runs import (
    BuiltPipe,
    build_pipe,
    merged_record,
    run_pipe,
    run_through,
    tp_merged,
    tp_records,
    universal_of,
)
from ucp.cli import main as cli
from ucp.harness import LoadSpec
from ucp.io.torchfile import load
from ucp.ops.inspect import format_report, inspect_path
from ucp.sources import open_reader
from ucp.targets.pipeline import PipelineLayout, write_pipeline

pytestmark = pytest.mark.slow

#: the fixture model's partition at PP=2 and at PP=1, and its tied embedding's layers
LAYOUT = PipelineLayout(parts=(0, 3, 6), tied={"embed": (0, 5)})
ONE_STAGE = PipelineLayout(parts=(0, 6), tied={"embed": (0, 5)})
SPLIT = {"1.fc1.weight": 0, "1.fc1.bias": 0, "1.fc2.weight": 1, "3.fc2.weight": 1}


@pytest.fixture(scope="module")
def pipe() -> BuiltPipe:
    return build_pipe(pp=2, tp=2, dp=2, stage=1, dtype="fp32")


@pytest.fixture(scope="module")
def universal(pipe: BuiltPipe, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return universal_of(pipe, tmp_path_factory)


def whole(records: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """A 3D run's records (per stage, per TP rank) as one model's, with the run's losses."""
    return {**merged_record([tp_merged(stage) for stage in records]), "losses": records[0][0]["losses"]}


@pytest.fixture(scope="module")
def live(pipe: BuiltPipe) -> dict[str, Any]:
    return whole(tp_records(pipe.spec))


@pytest.fixture(scope="module")
def native(pipe: BuiltPipe, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """DeepSpeed's own resume of the fixture at PP=2 x TP=2 x DP=2."""
    work = tmp_path_factory.mktemp("native3d")
    return whole(run_pipe(pipe, name="native", work=work, load=LoadSpec(str(pipe.path)), per_tp=True))


def assert_resumed_alike(ours: dict[str, Any], ref: dict[str, Any], atol: float) -> None:
    for a, b in zip(ref["losses"], ours["losses"], strict=True):
        assert abs(a - b) <= atol, (ref["losses"], ours["losses"])
    assert ours["steps"] == ref["steps"] and set(ours["params"]) == set(ref["params"])
    for name, value in ref["params"].items():
        assert torch.allclose(ours["params"][name], value, rtol=0, atol=atol), name
        for key, per_param in ref["state"].items():
            assert torch.allclose(ours["state"][key][name], per_param[name], rtol=0, atol=atol), (name, key)
    for name in ref["frozen"]:
        assert torch.equal(ours["module"][name], ref["module"][name]), name
    assert all(torch.equal(ours["buffers"][k], v) for k, v in ref["buffers"].items())


def test_the_fixture_is_cut_megatron_style(pipe):
    """Each TP rank holds its own rows of fc1 and columns of fc2 (so a merge that swapped or dropped
    shards would show), and the same copy of everything else."""
    (s0t0, s0t1), _ = tp_records(pipe.spec)
    assert s0t0["params"]["1.fc1.weight"].shape == (12, 10) and s0t1["params"]["1.fc1.weight"].shape == (11, 10)
    assert s0t0["params"]["1.fc2.weight"].shape == (10, 12)
    assert not torch.equal(s0t0["params"]["1.fc1.weight"][:11], s0t1["params"]["1.fc1.weight"])
    assert torch.equal(s0t0["params"]["tied_modules.embed.weight"], s0t1["params"]["tied_modules.embed.weight"])


def test_to_universal_is_bit_exact_against_every_ranks_live_engine(pipe, universal, live):
    assert live["steps"] == {float(pipe.spec.steps)}
    for path in (pipe.path, universal):
        with open_reader(path) as reader:
            facts = reader.facts
            assert {p.name for p in facts.params if not p.frozen} == set(live["params"])
            assert sorted(p.name for p in facts.params if p.frozen) == sorted(set(live["frozen"]))
            for meta in facts.params:
                state = reader.read(meta.name)
                if meta.frozen:
                    assert torch.equal(state.fp32, live["module"][meta.name].float()), meta.name
                    continue
                assert torch.equal(state.fp32, live["params"][meta.name]), meta.name
                assert sorted(state.optim) == ["exp_avg", "exp_avg_sq"], meta.name
                for key, value in state.optim.items():
                    assert torch.equal(value, live["state"][key][meta.name]), (meta.name, key)
                assert state.step == pipe.spec.steps, meta.name
            assert all(torch.equal(v, live["buffers"][k]) for k, v in reader.buffers().items())
            for name, dim in SPLIT.items():
                assert facts.tp_rules[name] == {"kind": "split", "dim": dim}, name
            assert facts.tp_rules["tied_modules.embed.weight"] == {"kind": "replicated"}


def test_inspect_shows_the_stages_and_tp(pipe):
    report = inspect_path(pipe.path)
    assert "pipeline: 2 stages x tp=2 x dp=2" in format_report(report)
    pipeline = report["pipeline"]
    assert (pipeline["pp"], pipeline["tp"]) == (2, 2)
    assert [s["model_file"] for s in pipeline["stages"]] == ["mp_rank_00_model_states.pt", "mp_rank_02_model_states.pt"]
    assert [s["optim_files"] for s in pipeline["stages"]] == [4, 4]


def _tensors(obj: Any, path: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in a nested structure, by its path."""
    if torch.is_tensor(obj):
        return {path: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    return {k: v for key, value in items for k, v in _tensors(value, f"{path}/{key}").items()}


def test_the_same_layout_holds_deepspeeds_own_tensors(pipe, universal, tmp_path):
    """Written back at PP=2 x TP=2 x DP=2, every optim and layer file holds the tensors DeepSpeed saved,
    dtype and bits (ucp also writes the empty layer files of the forward_fn tied layers, which
    PipelineEngine loads as empty)."""
    write_pipeline(universal, tmp_path / "same", LAYOUT, dp=2, stage=1, tp=2)
    ours = tmp_path / "same" / pipe.tag_dir.name
    theirs = sorted(p.name for p in pipe.tag_dir.iterdir())
    assert set(theirs) <= {p.name for p in ours.iterdir()}
    for name in theirs:
        a, b = load(pipe.tag_dir / name), load(ours / name)
        if "optim" in name:
            a, b = a["optimizer_state_dict"], b["optimizer_state_dict"]
            a = {k: a[k] for k in ("single_partition_of_fp32_groups", "base_optimizer_state")}
        elif not name.startswith("layer"):
            assert (b["param_shapes"], b["buffer_names"]) == (a["param_shapes"], a["buffer_names"]), name
            assert b["checkpoint_parallel_dimensions"] == {"pp_degree": 2, "tp_degree": 2}
            assert b["mp_world_size"] == a["mp_world_size"] == 4
            continue
        mine = _tensors(b)
        for key, value in _tensors(a).items():
            assert value.dtype == mine[key].dtype and torch.equal(value, mine[key]), (name, key)


def test_restore_at_pp2_tp1_dp2_resumes_like_deepspeeds_native_resume(pipe, universal, native, tmp_path):
    write_pipeline(universal, tmp_path / "p", LAYOUT, dp=2, stage=1)
    assert not list((tmp_path / "p").rglob("*-model_0*"))  # no TP axis, no -model_YY
    resumed = run_pipe(pipe, name="pp2tp1", work=tmp_path, load=LoadSpec(str(tmp_path / "p")), tp=1, per_tp=True)
    assert_resumed_alike(whole(resumed), native, atol=1e-5)


def test_restore_at_pp1_tp2_dp2_resumes_like_deepspeeds_native_resume(pipe, universal, native, tmp_path):
    """On the command line; the same bytes as the Python call."""
    argv = ["-q", "restore", str(universal), str(tmp_path / "p"), "--pp", "1", "--tp", "2", "--dp", "2"]
    assert cli([*argv, "--pp-parts", "0,6", "--pp-tied", "embed=0,5"]) == 0
    write_pipeline(universal, tmp_path / "api", ONE_STAGE, dp=2, stage=1, tp=2)
    assert tree(tmp_path / "p") == tree(tmp_path / "api")
    resumed = run_pipe(pipe, name="pp1tp2", work=tmp_path, load=LoadSpec(str(tmp_path / "p")), pp=1, per_tp=True)
    assert_resumed_alike(whole(resumed), native, atol=1e-5)


@pytest.fixture(scope="module")
def through(pipe: BuiltPipe, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The fixture's run continued without a save and load, its losses those of the 3 steps after the save."""
    ran = whole(run_through(pipe, per_tp=True))
    return {**ran, "losses": ran["losses"][pipe.spec.steps :]}


def test_a_live_3d_pipeline_engine_restores_and_trains_like_the_uninterrupted_run(pipe, universal, through, tmp_path):
    """``ucp.restore(engine, U)`` on each rank of a PipelineEngine at PP=2 x TP=2 x DP=1: each rank takes its
    stage's parameters cut for its TP rank; put together they are U's state bit for bit, and 3 steps on
    (no stale tied weight: the restore refreshes the model weights) stay within 1e-5 of the uninterrupted run."""
    load = LoadSpec(str(universal), kind="ucp")
    loaded = whole(run_pipe(pipe, name="live0", work=tmp_path, load=load, dp=1, steps=0, per_tp=True))
    with open_reader(universal) as reader:
        for meta in reader.facts.params:
            state = reader.read(meta.name)
            if meta.frozen:
                assert torch.equal(loaded["module"][meta.name], state.fp32), meta.name
                continue
            assert torch.equal(loaded["params"][meta.name], state.fp32), meta.name
            assert torch.equal(loaded["module"][meta.name], state.fp32), meta.name
            for key, value in state.optim.items():
                assert torch.equal(loaded["state"][key][meta.name], value), (meta.name, key)
        assert all(torch.equal(loaded["buffers"][k], v) for k, v in reader.buffers().items())
    trained = whole(run_pipe(pipe, name="live3", work=tmp_path, load=load, dp=1, per_tp=True))
    assert_resumed_alike(trained, through, atol=1e-5)


def test_restore_at_pp1_dp3_on_an_ordinary_engine_resumes_like_the_uninterrupted_run(
    pipe, universal, through, tmp_path
):
    ucp.write_native(universal, tmp_path / "n", dp=3, stage=1)
    plain = run_pipe(
        pipe, name="plain", work=tmp_path, load=LoadSpec(str(tmp_path / "n")), pp=1, tp=1, dp=3, plain=True
    )
    ours = {**merged_record(plain), "losses": plain[0]["losses"]}
    assert_resumed_alike(ours, through, atol=1e-5)


def test_deepspeeds_ds_to_universal_on_the_3d_run(pipe, universal, tmp_path):
    """DeepSpeed 0.19.8's converter reads this run (it carries universal_checkpoint_info): every trained
    parameter's fp32 and moments equal ucp's, but no layer files, so the frozen projection and the buffer
    are not carried (docs/format.md section 8). When this fails, DeepSpeed changed: update the docs."""
    done = ds_to_universal(pipe.tag_dir, tmp_path / "dsu")
    assert done.returncode == 0, done.stderr[-2000:]
    with open_reader(universal) as ours:
        assert_trained_params_match(tmp_path / "dsu", ours)
