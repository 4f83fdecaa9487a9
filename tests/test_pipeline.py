"""Pipeline parallelism: DeepSpeed PipelineEngine checkpoints (PP=2 x DP=2, ZeRO-1, fp32) merged into whole
parameters, bit for bit against each stage's live engine (bf16 too), and resumed at PP=1 x DP=3 and
PP=2 x DP=1.

The fixture is a real PipelineModule run on 4 gloo ranks: a tied embedding (``TiedLayerSpec`` on the first
stage as the embedding and on the last as the LM head), residual MLP blocks (the first with a frozen
projection and a persistent buffer) and a LayerNorm; each stage's DP rank 0 records what its engine holds.

Resumed training is compared with the same run uninterrupted (6 steps in one go), not with DeepSpeed's
native resume: DeepSpeed 0.19.8 resumes this model from a stale tied weight (see the last test).
DeepSpeed runs here besides the fixture: the uninterrupted run, two resumes from ucp (PP=1 x DP=3 on a plain
engine, PP=2 x DP=1 on a PipelineEngine), one native resume.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import ucp
from tests.support.digest import tree
from tests.support.ds_convert import assert_trained_params_match, ds_to_universal
from tests.support.files import resave
from tests.support.pipeline_runs import (
    BuiltPipe,
    assert_reader_matches_stages,
    build_pipe,
    merged_record,
    run_pipe,
    run_through,
    universal_of,
)
from ucp.cli import main as cli
from ucp.errors import ConfigError, InputError
from ucp.harness import LoadSpec
from ucp.io.torchfile import load
from ucp.ops.inspect import format_report, inspect_path
from ucp.sources import open_reader
from ucp.targets.pipeline import PipelineLayout, write_pipeline

pytestmark = pytest.mark.slow

TIED = "tied_modules.embed.weight"


@pytest.fixture(scope="module")
def pipe() -> BuiltPipe:
    return build_pipe(pp=2, dp=2, stage=1, dtype="fp32")


@pytest.fixture(scope="module")
def universal(pipe: BuiltPipe, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return universal_of(pipe, tmp_path_factory)


def test_stages_hold_the_tied_embedding_and_their_own_layers(pipe):
    stage0, stage1 = pipe.records
    assert TIED in stage0["params"] and TIED in stage1["params"]
    assert not (set(stage0["params"]) & set(stage1["params"])) - {TIED}
    assert stage0["losses"] == stage1["losses"]  # every stage reports the pipeline's loss


def test_to_universal_is_bit_exact_against_every_stages_live_engine(pipe, universal):
    for path in (pipe.path, universal):
        with open_reader(path) as reader:
            assert_reader_matches_stages(reader, pipe)


def test_a_bf16_pipeline_checkpoint_merges_bit_exact_too():
    bf16 = build_pipe(pp=2, dp=2, stage=1, dtype="bf16")
    with open_reader(bf16.path) as reader:
        assert_reader_matches_stages(reader, bf16)


def test_merged_groups_follow_the_stages_flat_order(pipe):
    live = [rec["group_params"] for rec in pipe.records]
    with open_reader(pipe.path) as reader:
        for g, group in enumerate(reader.facts.groups):
            order = [n for stage in live for n in stage[g]]
            assert group.params == list(dict.fromkeys(order)), g


def test_inspect_shows_the_pipeline_stages(pipe):
    report = inspect_path(pipe.path)
    pipeline = report["pipeline"]
    assert pipeline["pp"] == 2
    assert [s["model_file"] for s in pipeline["stages"]] == ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]
    assert [s["layers"] for s in pipeline["stages"]] == [[1, 2], [3, 4]]
    assert pipeline["tied_across_stages"] == {TIED: [0, 1]}
    assert all(set(rec["params"]) == set(s["params"]) for rec, s in zip(pipe.records, pipeline["stages"]))
    text = format_report(report)
    assert "pipeline: 2 stages x dp=2" in text
    assert f"tied across stages 0, 1: {TIED}" in text


@pytest.fixture(scope="module")
def through(pipe: BuiltPipe, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The fixture's run continued without a save and load: the reference for every resume."""
    return run_through(pipe)


def test_restore_at_pp1_dp3_resumes_like_the_uninterrupted_pipeline_run(pipe, universal, through, tmp_path):
    """A PP=2 x DP=2 checkpoint, restored as a plain ZeRO-1 checkpoint for 3 ranks, loads into a
    non-pipeline DeepSpeed engine over the same layers (same names) and trains on as the pipeline would."""
    ucp.write_native(universal, tmp_path / "n", dp=3, stage=1)
    plain = run_pipe(pipe, name="plain", work=tmp_path, load=LoadSpec(str(tmp_path / "n")), pp=1, dp=3, plain=True)[0]
    expected = merged_record(through)
    ours = merged_record([plain])
    steps = pipe.spec.steps
    assert ours["steps"] == expected["steps"] == {float(2 * steps)}
    for a, b in zip(through[0]["losses"][steps:], plain["losses"], strict=True):
        assert abs(a - b) <= 1e-5, (through[0]["losses"], plain["losses"])
    assert set(ours["params"]) == set(expected["params"])
    for name, value in expected["params"].items():
        assert torch.allclose(ours["params"][name], value, rtol=0, atol=1e-5), name
        for key, per_param in expected["state"].items():
            assert torch.allclose(ours["state"][key][name], per_param[name], rtol=0, atol=1e-5), (name, key)
    for name in expected["frozen"]:
        assert torch.equal(ours["module"][name], expected["module"][name]), name
    assert all(torch.equal(ours["buffers"][k], v) for k, v in expected["buffers"].items())
    assert plain["counters"] == through[0]["counters"]
    assert plain["lr_scheduler"]["last_epoch"] == through[0]["lr_scheduler"]["last_epoch"]


#: the fixture model's partition at PP=2 (uniform over 6 layers) and its tied embedding's layers
LAYOUT = PipelineLayout(parts=(0, 3, 6), tied={"embed": (0, 5)})


@pytest.fixture(scope="module")
def native(pipe: BuiltPipe, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """DeepSpeed's own resume of the fixture at PP=2 x DP=2."""
    return run_pipe(pipe, name="native", work=tmp_path_factory.mktemp("native"), load=LoadSpec(str(pipe.path)))


def test_deepspeed_native_resume_runs_its_first_step_on_the_initial_tied_weight(pipe, through, native):
    """DeepSpeed 0.19.8: a TiedLayerSpec with a forward_fn is a partial in forward_funcs, so it gets no layer
    file; ZeRO-1's load restores the fp32 master but not the model weight, so the first step after a
    native resume runs (and takes its gradient) with the tied weight as initialised. ucp's restore
    writes the weight into the module (checked above). When this fails, DeepSpeed fixed it: compare
    resumes with the native one again."""
    steps = pipe.spec.steps
    assert abs(native[0]["losses"][0] - through[0]["losses"][steps]) > 1e-3
    drift = max((v - native[0]["params"][n]).abs().max().item() for n, v in through[0]["params"].items())
    assert drift > 1e-4


def test_restore_at_pp2_dp1_resumes_like_deepspeeds_native_resume(pipe, universal, native, tmp_path):
    """Per-stage ZeRO-1 files and layer files for PP=2 x DP=1, loaded by a PipelineEngine; read back by
    ucp they hold the universal state bit for bit."""
    write_pipeline(universal, tmp_path / "p", LAYOUT, dp=1, stage=1)
    with open_reader(tmp_path / "p") as ours, open_reader(universal) as theirs:
        assert [p.name for p in ours.facts.params] == [p.name for p in theirs.facts.params]
        for meta in theirs.facts.params:
            a, b = ours.read(meta.name), theirs.read(meta.name)
            assert torch.equal(a.fp32, b.fp32) and a.step == b.step, meta.name
            assert a.optim.keys() == b.optim.keys() and all(torch.equal(a.optim[k], b.optim[k]) for k in a.optim)
        assert all(torch.equal(v, theirs.buffers()[k]) for k, v in ours.buffers().items())
    resumed = run_pipe(pipe, name="pp2dp1", work=tmp_path, load=LoadSpec(str(tmp_path / "p")), dp=1)
    for a, b in zip(native[0]["losses"], resumed[0]["losses"], strict=True):
        assert abs(a - b) <= 1e-5, (native[0]["losses"], resumed[0]["losses"])
    for ref, other in zip(native, resumed, strict=True):
        for name, value in ref["params"].items():
            assert torch.allclose(other["params"][name], value, rtol=0, atol=1e-5), name
            for key, per_param in ref["state"].items():
                assert torch.allclose(other["state"][key][name], per_param[name], rtol=0, atol=1e-5), (name, key)
        assert all(torch.equal(other["buffers"][k], v) for k, v in ref["buffers"].items())


def _copy(pipe: BuiltPipe, tmp_path: Path) -> Path:
    copy = tmp_path / "ckpt"
    shutil.copytree(pipe.path, copy)
    return copy / pipe.tag_dir.name


def test_layer_files_of_another_tp_degree_are_refused_in_one_line(pipe, tmp_path):
    tag = _copy(pipe, tmp_path)
    (tag / "layer_01-model_states.pt").rename(tag / "layer_01-model_01-model_states.pt")
    with pytest.raises(InputError, match=r"layer files are for tensor-parallel ranks \[1\].*tp_degree=1"):
        open_reader(tag.parent)


def test_degrees_that_do_not_match_the_files_are_refused_in_one_line(pipe, tmp_path):
    tag = _copy(pipe, tmp_path)
    head = load(tag / "mp_rank_00_model_states.pt")
    head["checkpoint_parallel_dimensions"] = {"pp_degree": 4, "tp_degree": 1}
    resave(head, tag / "mp_rank_00_model_states.pt")
    with pytest.raises(InputError, match=r"pp_degree=4 x tp_degree=1, but the folder holds 2 mp ranks"):
        open_reader(tag.parent)


def test_a_missing_stage_optim_file_is_refused_in_one_line(pipe, tmp_path):
    tag = _copy(pipe, tmp_path)
    (tag / "zero_pp_rank_1_mp_rank_01_optim_states.pt").unlink()
    with pytest.raises(InputError):
        open_reader(tag.parent)


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_cli_restore_pp_writes_what_write_pipeline_writes_at_zero1_by_default(universal, tmp_path, capsys):
    """``ucp restore U OUT --pp 2 --dp 1 --pp-parts 0,3,6 --pp-tied embed=0,5``: the same files, byte for byte,
    as the Python call the resume test above loads into a PipelineEngine; the stage defaults to 1."""
    argv = ["restore", str(universal), str(tmp_path / "cli"), "--pp", "2", "--dp", "1", "--pp-parts", "0,3,6"]
    assert cli([*argv, "--pp-tied", "embed=0,5", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["format"] == "deepspeed-pipeline" and result["stage"] == 1
    assert (result["pp"], result["parts"], result["dp"]) == (2, [0, 3, 6], 1)
    write_pipeline(universal, tmp_path / "api", LAYOUT, dp=1, stage=1)
    assert _tree(tmp_path / "cli") == _tree(tmp_path / "api")


def test_cli_reshard_pp_reads_a_pipeline_checkpoint_straight(pipe, universal, tmp_path):
    assert cli(["-q", "reshard", str(pipe.path), str(tmp_path / "r"), "--pp", "2", "--dp", "1", "--pp-parts", "0,3,6",
                "--pp-tied", "embed=0,5"]) == 0  # fmt: skip
    write_pipeline(universal, tmp_path / "api", LAYOUT, dp=1, stage=1)
    direct, two = tree(tmp_path / "r"), tree(tmp_path / "api")  # object for object, as tests/test_reshard.py
    assert sorted(direct) == sorted(two)
    for name, entry in two.items():
        assert direct[name].get("content", direct[name]["sha256"]) == entry.get("content", entry["sha256"]), name


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--pp", "2"], "--pp needs the new run's layer partition: --pp-parts 0,3,6"),
        (["--pp", "3", "--pp-parts", "0,3,6"], "--pp-parts 0,3,6 cuts 2 stages, but --pp is 3"),
        (["--pp", "2", "--pp-parts", "0,3,3"], r"layer partition \[0, 3, 3\] is not one"),
        (["--pp", "2", "--pp-parts", "0,x,6"], "--pp-parts: give comma-separated layer indices"),
        (["--pp", "2", "--pp-parts", "0,3,6"], "tied module 'embed'; give the layers using it .*--pp-tied embed=0,5"),
        (["--pp", "2", "--pp-parts", "0,3,6", "--pp-tied", "embed=0,5", "--stage", "2"], "PipelineEngine refuses"),
        (["--pp", "2", "--pp-partition", "uniform"], "--pp-partition needs --pp-layers"),
        (["--pp", "2", "--pp-parts", "0,3,6", "--pp-partition", "uniform"], "--pp-parts 0,3,6 .* or --pp-partition"),
        (["--pp", "7", "--pp-partition", "uniform", "--pp-layers", "6"], "6 layers cannot fill 7 pipeline stages"),
    ],
    ids=[
        "no-parts",
        "parts-vs-pp",
        "not-rising",
        "not-numbers",
        "tied-missing",
        "stage-2",
        "method-no-layers",
        "parts-and-method",
        "method-too-few-layers",
    ],  # fmt: skip
)
def test_cli_pipeline_restore_problems_are_one_line(universal, tmp_path, capsys, flags, message):
    assert cli(["restore", str(universal), str(tmp_path / "x"), "--dp", "1", *flags]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(message, err), err
    assert not (tmp_path / "x").exists()


def test_deepspeeds_ds_to_universal_converts_the_trained_weights_but_drops_the_layer_files(pipe, universal, tmp_path):
    """DeepSpeed 0.19.8's own converter on the same run: every trained parameter's fp32 and moments bit-exact
    and the tied embedding once, but no layer files, so the frozen projection and the buffer are not carried
    (docs/format.md section 8). When this fails, DeepSpeed changed: update the comparison there."""
    done = ds_to_universal(pipe.tag_dir, tmp_path / "dsu")
    assert done.returncode == 0, done.stderr[-2000:]
    with open_reader(universal) as ours:
        assert_trained_params_match(tmp_path / "dsu", ours)
    assert not list((tmp_path / "dsu").glob("layer_*"))


def test_a_partition_method_gives_deepspeeds_own_partition_and_the_run_resumes(pipe, universal, native, tmp_path):
    """``PipelineLayout.by_method("parameters", ...)`` cuts the 6 layers for 3 stages as a PipelineModule with
    ``partition_method="parameters"`` does ([0, 2, 3, 6], where "uniform" gives [0, 2, 4, 6]); that engine
    loads ucp's output and trains on like DeepSpeed's native resume of the PP=2 run."""
    with open_reader(universal) as reader:
        layout = PipelineLayout.by_method("parameters", 3, 6, {"embed": (0, 5)}, reader.facts)
        assert PipelineLayout.by_method("uniform", 3, 6, {"embed": (0, 5)}, reader.facts).parts == (0, 2, 4, 6)
    assert layout.parts == (0, 2, 3, 6)
    write_pipeline(universal, tmp_path / "p", layout, dp=1, stage=1)
    resumed = run_pipe(
        pipe, name="pp3", work=tmp_path, load=LoadSpec(str(tmp_path / "p")), pp=3, dp=1, partition_method="parameters"
    )
    assert all(rec["parts"] == [0, 2, 3, 6] for rec in resumed)
    for a, b in zip(native[0]["losses"], resumed[0]["losses"], strict=True):
        assert abs(a - b) <= 1e-5, (native[0]["losses"], resumed[0]["losses"])
    ours, theirs = merged_record(resumed), merged_record(native)
    for name, value in theirs["params"].items():
        assert torch.allclose(ours["params"][name], value, rtol=0, atol=1e-5), name


def test_partition_methods_ucp_cannot_reproduce_are_refused_in_one_line(universal):
    with open_reader(universal) as reader:
        with pytest.raises(ConfigError, match=r"partition method 'type:PipeBlock'.*uniform and parameters"):
            PipelineLayout.by_method("type:PipeBlock", 2, 6, {"embed": (0, 5)}, reader.facts)
        with pytest.raises(ConfigError, match=r"5 layers cannot fill 6 pipeline stages"):
            PipelineLayout.by_method("uniform", 6, 5, {"embed": (0, 5)}, reader.facts)
        with pytest.raises(ConfigError, match=r"tied_modules.embed.weight is in layer 5, but the model has 5 layers"):
            PipelineLayout.by_method("parameters", 2, 5, {"embed": (0, 5)}, reader.facts)
