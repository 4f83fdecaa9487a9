"""ucp inspect: what a real checkpoint holds, read from metadata alone, for DeepSpeed and universal input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.support.files import resave
from ucp.cli import main
from ucp.errors import CorruptFileError
from ucp.io import torchfile
from ucp.ops.convert import to_universal
from ucp.ops.inspect import format_report, inspect_path
from ucp.sources.zero3 import Zero3Source
from ucp.universal.reader import UniversalReader


@pytest.fixture(scope="module")
def bf16_universal(z3_bf16_dp2, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("inspect") / "universal"
    to_universal(z3_bf16_dp2.path, out)
    return out


def _distinct(record: dict) -> list[str]:
    return [n for n in record["names"] if n not in record["tied"]]


@pytest.mark.slow
def test_inspect_reports_what_the_live_engine_held(z3_bf16_dp2):
    record = z3_bf16_dp2.record
    report = inspect_path(z3_bf16_dp2.path)
    assert report["format"] == "deepspeed"
    assert (report["zero_stage"], report["dp_world_size"], report["mp_world_size"]) == (3, 2, 1)
    assert report["dtype"] == "bf16"
    assert report["optimizer"] == "torch-adam" and report["adam_w_mode"] is True
    assert report["step"] == 3 and report["global_steps"] == record["counters"]["global_steps"]
    assert report["skipped_steps"] == record["counters"]["skipped_steps"]
    assert report["tag"] == "global_step3" and report["ds_version"]
    distinct = _distinct(record)
    assert report["num_params"] == len(distinct) == len(record["module"])
    assert report["numel"] == sum(t.numel() for t in record["module"].values())
    shapes = {p["name"]: tuple(p["shape"]) for p in report["params"]}
    assert shapes == {n: tuple(t.shape) for n, t in record["module"].items()}
    frozen = {p["name"] for p in report["params"] if p["frozen"]}
    assert frozen == set(distinct) - set(record["params"]) == {"proj.weight", "proj.bias"}
    assert all(p["group"] is None and p["step"] is None for p in report["params"] if p["frozen"])
    assert all(p["step"] == 3 for p in report["params"] if not p["frozen"])
    assert report["tied"] == record["tied"]
    assert report["buffers"] == ["calls"]  # the persistent one; "scratch" is not saved
    members = [n for g in report["param_groups"] for n in g["params"]]
    assert sorted(members) == sorted(record["params"])
    assert [g["hyperparameters"]["lr"] for g in report["param_groups"]] == record["lrs"]
    assert [g["hyperparameters"]["weight_decay"] for g in report["param_groups"]] == [
        h["weight_decay"] for h in record["group_hparams"]
    ]
    assert report["warnings"] == []


@pytest.mark.slow
def test_inspect_counts_three_groups_of_an_fp32_dp3_run(z3_fp32_dp3):
    record = z3_fp32_dp3.record
    report = inspect_path(z3_fp32_dp3.path)
    assert (report["dtype"], report["dp_world_size"], len(report["param_groups"])) == ("fp32", 3, 3)
    assert [g["hyperparameters"]["lr"] for g in report["param_groups"]] == record["lrs"]
    assert report["num_params"] == len(record["module"])
    assert sum(g["numel"] for g in report["param_groups"]) == sum(t.numel() for t in record["params"].values())


@pytest.mark.slow
def test_inspect_of_universal_dir_reports_the_same_facts_as_its_source(z3_bf16_dp2, bf16_universal):
    ours = inspect_path(z3_bf16_dp2.path)
    theirs = inspect_path(bf16_universal)
    assert theirs["format"] == "universal" and theirs["source_format"] == "deepspeed"
    assert theirs["format_version"] == 1
    skip = {"path", "format", "format_version", "created_by"}
    assert {k: v for k, v in theirs.items() if k not in skip} == {k: v for k, v in ours.items() if k not in skip}


@pytest.mark.slow
def test_inspect_loads_no_tensor(z3_bf16_dp2, bf16_universal, monkeypatch):
    def refuse(*_args, **_kwargs):
        raise AssertionError("inspect loaded tensors")

    for cls in (Zero3Source, UniversalReader):
        monkeypatch.setattr(cls, "read", refuse)
        monkeypatch.setattr(cls, "buffers", refuse)
    monkeypatch.setattr(torchfile, "load", refuse)  # a universal dir's files stay unread too
    assert inspect_path(z3_bf16_dp2.path)["num_params"] == 13
    assert inspect_path(bf16_universal)["num_params"] == 13


@pytest.mark.slow
def test_inspect_surfaces_fused_adam_stale_group_step(z3_bf16_dp2, tmp_path):
    """The same real checkpoint with its optimizer state laid out as DeepSpeed FusedAdam writes it."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(z3_bf16_dp2.path, ckpt)
    for path in (ckpt / "global_step3").glob("*optim_states.pt"):
        obj = torchfile.load(path)
        base = obj["optimizer_state_dict"]["optimizer_state_dict"]
        for entry in base["state"].values():
            entry["step"] = int(entry["step"].item())
        for group in base["param_groups"]:
            for key in (
                "amsgrad",
                "maximize",
                "foreach",
                "capturable",
                "differentiable",
                "fused",
                "decoupled_weight_decay",
            ):
                group.pop(key)
            group.update(bias_correction=True, step=0)
        resave(obj, path)
    report = inspect_path(ckpt)
    assert report["optimizer"] == "ds-fused-adam" and report["step"] == 3
    assert len(report["warnings"]) == 1 and "stale" in report["warnings"][0]
    assert "warning: group['step'] reads [0]" in format_report(report)


@pytest.mark.slow
def test_inspect_uses_the_optimizer_named_by_the_user(z3_bf16_dp2):
    assert inspect_path(z3_bf16_dp2.path, optimizer="ds-cpu-adam")["optimizer"] == "ds-cpu-adam"


@pytest.mark.slow
def test_inspect_cli_prints_a_table_and_json(z3_bf16_dp2, capsys):
    assert main(["inspect", str(z3_bf16_dp2.path)]) == 0
    text = capsys.readouterr().out
    assert "ZeRO stage 3, dp=2" in text and "tied: head.weight -> embed.weight" in text
    header = next(line for line in text.splitlines() if line.startswith("name"))
    assert header.split() == ["name", "shape", "numel", "dtype", "group", "frozen", "step"]
    row = next(line for line in text.splitlines() if line.startswith("blocks.0.0.weight"))
    assert row.split() == ["blocks.0.0.weight", "23x10", "230", "bf16", "0", "no", "3"]
    assert main(["inspect", "--json", "--tag", "global_step3", str(z3_bf16_dp2.path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["num_params"] == 13 and report["tag"] == "global_step3"


def test_inspect_cli_bad_path_is_one_line_exit_2(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ucp: error:") and "does not exist" in err and len(err.splitlines()) == 1
    assert main(["inspect", str(tmp_path)]) == 2
    assert "holds no DeepSpeed checkpoint" in capsys.readouterr().err


@pytest.mark.slow
def test_inspect_report_is_plain_json(z3_fp32_dp3):
    report = inspect_path(z3_fp32_dp3.path)
    assert json.loads(json.dumps(report)) == report


@pytest.fixture(scope="module")
def layered_sources() -> dict[str, Path]:
    """A real PP=2 x DP=2 PipelineModule run and a real MoE run (W=4, ep_size 2), cached like every fixture."""
    from tests.support.moe_runs import build_moe
    from tests.support.pipeline_runs import build_pipe

    return {
        "pipeline": build_pipe(pp=2, dp=2, stage=1, dtype="fp32").path,
        "moe": build_moe(world=4, ep=2, experts=4, stage=2, dtype="fp32").path,
    }


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["pipeline", "moe"])
def test_inspect_of_a_universal_dir_shows_its_sources_stages_and_experts(layered_sources, layout, tmp_path, capsys):
    """ucp.json keeps the source's pipeline stages (files, layers, parameters, tied modules) or MoE layers,
    so inspecting the universal directory shows what inspecting the source showed."""
    source = layered_sources[layout]
    to_universal(source, tmp_path / "u")
    direct = inspect_path(source)
    assert json.loads((tmp_path / "u" / "ucp.json").read_text())[layout] == direct[layout]
    assert main(["inspect", "--json", str(tmp_path / "u")]) == 0
    assert json.loads(capsys.readouterr().out)[layout] == direct[layout]
    other = {"pipeline": "moe", "moe": "pipeline"}[layout]
    assert other not in direct and other not in inspect_path(tmp_path / "u")
    assert main(["inspect", str(tmp_path / "u")]) == 0
    text = capsys.readouterr().out.splitlines()
    head = {"pipeline": "  pipeline: 2 stages x dp=2", "moe": "  mixture of experts: 1 MoE layers on 4 ranks"}[layout]
    start = next(i for i, line in enumerate(text) if line.startswith(head))
    shown = text[start : next(i for i, line in enumerate(text) if line.startswith("  optimizer"))]
    assert shown == format_report(direct).splitlines()[2 : 2 + len(shown)]
    assert len(shown) > 1  # a line per stage or MoE layer


@pytest.mark.slow
def test_a_universal_dir_without_the_source_layout_still_reads_and_a_bad_one_is_refused(layered_sources, tmp_path):
    """Directories written before ucp.json kept the pipeline have no such key: they read as before; a key of
    the wrong type is damage, refused in one line."""
    to_universal(layered_sources["pipeline"], tmp_path / "u")
    manifest = json.loads((tmp_path / "u" / "ucp.json").read_text())
    del manifest["pipeline"]
    (tmp_path / "u" / "ucp.json").write_text(json.dumps(manifest))
    report = inspect_path(tmp_path / "u")
    assert "pipeline" not in report and report["num_params"] == 17
    manifest["pipeline"] = [0, 3, 6]
    (tmp_path / "u" / "ucp.json").write_text(json.dumps(manifest))
    with pytest.raises(CorruptFileError, match=r"pipeline") as caught:
        inspect_path(tmp_path / "u")
    assert len(str(caught.value).splitlines()) == 1
