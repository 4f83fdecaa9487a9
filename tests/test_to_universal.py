"""to-universal on real DeepSpeed ZeRO-3 checkpoints: every tensor equals the live engine's."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import SOURCES

import ucp
from tests.support.checks import assert_reader_matches_record
from tests.support.fixtures import resume
from ucp.harness import LoadSpec
from ucp.sources import open_reader


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SOURCES))
def test_to_universal_equals_live_engine_bit_for_bit(source, name, tmp_path):
    built = source(name)
    record = built.record
    out = tmp_path / "universal"
    manifest = ucp.to_universal(built.path, out)
    assert (out / "ucp.json").is_file() and json.loads((out / "ucp.json").read_text()) == manifest
    reader = ucp.open_universal(out)
    assert_reader_matches_record(reader, record)
    # the same facts straight from the shards, without the universal directory
    assert_reader_matches_record(open_reader(built.path), record)


@pytest.mark.parametrize(
    "name, flavour",
    [
        ("z3-bf16-dp2-adamw", "torch-adam"),
        ("z3-bf16-dp4-fused", "ds-fused-adam"),
        ("z3-bf16-dp2-cpuadam", "ds-cpu-adam"),
    ],
)
@pytest.mark.slow
def test_manifest_records_source_facts_and_flavour(source, name, flavour, tmp_path):
    built = source(name)
    manifest = ucp.to_universal(built.path, tmp_path / "u")
    spec = built.spec
    assert manifest["format_version"] == 1
    src = manifest["source"]
    assert (src["zero_stage"], src["dp_world_size"], src["dtype"]) == (3, spec.dp, spec.dtype)
    assert src["global_steps"] == spec.steps and src["ds_version"]
    assert manifest["optimizer"]["flavour"] == flavour and manifest["optimizer"]["step"] == spec.steps
    groups = manifest["param_groups"]
    assert len(groups) == spec.param_groups
    names = [p["name"] for p in manifest["params"]]
    assert sorted(n for g in groups for n in g["params"]) == sorted(
        p["name"] for p in manifest["params"] if not p["frozen"]
    )
    frozen = [p for p in manifest["params"] if p["frozen"]]
    assert [p["name"] for p in frozen] == ["proj.weight", "proj.bias"] and all(p["group"] is None for p in frozen)
    assert "head.weight" not in names and manifest["tied"] == {"head.weight": "embed.weight"}
    for p in manifest["params"]:
        expected = {"fp32.pt"} if p["frozen"] else {"fp32.pt", "exp_avg.pt", "exp_avg_sq.pt", "step.pt"}
        assert set(p["files"]) == expected and all(len(f["crc32"]) == 8 for f in p["files"].values())
    if flavour == "ds-fused-adam":
        assert any("stale" in w for w in manifest["warnings"]), manifest["warnings"]


@pytest.mark.slow
def test_per_parameter_files_follow_deepspeeds_universal_layout(z3_bf16_dp2, tmp_path):
    out = tmp_path / "u"
    ucp.to_universal(z3_bf16_dp2.path, out)
    record = z3_bf16_dp2.record
    fp32 = torch.load(out / "zero" / "embed.weight" / "fp32.pt", weights_only=True)
    assert set(fp32) == {"param"} and torch.equal(fp32["param"], record["params"]["embed.weight"])
    step = torch.load(out / "zero" / "embed.weight" / "step.pt", weights_only=True)
    assert float(step) == z3_bf16_dp2.spec.steps
    assert not (out / "zero" / "head.weight").exists()


@pytest.mark.slow
def test_tag_folder_and_explicit_tag_read_the_same_checkpoint(z3_bf16_dp2, tmp_path):
    a = ucp.to_universal(z3_bf16_dp2.tag_dir, tmp_path / "a")
    b = ucp.to_universal(z3_bf16_dp2.path, tmp_path / "b", tag=z3_bf16_dp2.tag_dir.name)
    assert [p["files"] for p in a["params"]] == [p["files"] for p in b["params"]]


@pytest.mark.slow
def test_load_optimizer_moments_returns_full_states_straight_from_shards(z3_fp32_dp3):
    moments = ucp.load_optimizer_moments(z3_fp32_dp3.path)
    record = z3_fp32_dp3.record
    for name, value in record["params"].items():
        assert torch.equal(moments[name]["fp32"], value)
        assert torch.equal(moments[name]["exp_avg"], record["exp_avg"][name])
        assert torch.equal(moments[name]["exp_avg_sq"], record["exp_avg_sq"][name])
        assert moments[name]["step"] == z3_fp32_dp3.spec.steps
    assert set(moments["proj.weight"]) == {"fp32"}


@pytest.mark.slow
def test_deepspeeds_own_load_universal_loads_the_output(z3_bf16_dp2, tmp_path):
    out = tmp_path / "u"
    ucp.to_universal(z3_bf16_dp2.path, out)
    # DeepSpeed 0.19.8's ZeRO-3 universal loader: engine.load_checkpoint(OUT) with load_universal=True
    after = resume(z3_bf16_dp2, LoadSpec(str(out), kind="ds-universal"), steps=0, name="ds_uc", work=tmp_path)
    record = z3_bf16_dp2.record
    for name, value in record["params"].items():
        assert torch.equal(after["params"][name], value), name
        assert torch.equal(after["exp_avg"][name], record["exp_avg"][name]), name


@pytest.mark.slow
def test_reading_does_not_import_deepspeed(z3_bf16_dp2, tmp_path):
    import subprocess
    import sys

    code = (
        "import sys, ucp; ucp.to_universal(sys.argv[1], sys.argv[2]); "
        "assert 'deepspeed' not in sys.modules, 'deepspeed was imported'"
    )
    subprocess.run([sys.executable, "-c", code, str(z3_bf16_dp2.path), str(tmp_path / "u")], check=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["z3-bf16-dp2-adamw", "z3-fp32-dp3-adamw", "z3-bf16-dp4-fused"])
def test_zero3_slices_are_offsets_into_each_ranks_buffer_span(source, name):
    """A ZeRO-3 reader finds where each rank's flat buffer lies in its file once and hands out every member's
    slice as an offset into it: the spans are those the tensor views give, byte for byte, on real saves at DP 2,
    3 (uneven splits) and 4."""
    from ucp.model.pieces import FileSpan

    with open_reader(source(name).path) as reader:
        trained = [m for m in reader.facts.params if not m.frozen]
        assert trained
        for meta in trained:
            where = reader._where[meta.name]
            for key in (None, *reader._keys[where.sub_group]):
                fast, views = reader._pieces(where, key), reader._tensor_pieces(where, key)
                assert all(isinstance(p, FileSpan) for p in fast.parts), (meta.name, key)
                assert [(p.file, p.offset, p.nbytes) for p in fast.parts] == [
                    (p.file, p.offset, p.nbytes) for p in views.parts
                ], (meta.name, key)
                assert torch.equal(fast.join(), views.join())


def test_a_zero3_source_keeps_no_placeholder_per_parameter_after_reading_its_facts(z3_bf16_dp2) -> None:
    """Rank 0's model-states tree is read whole for the facts (its module holds a placeholder per parameter and
    param_shapes a shape per parameter: 10^5 each for a MoE); after that the source keeps only what buffers() and
    extras() read, and they still give what the file holds."""
    from ucp.io import torchfile

    model_file = sorted(z3_bf16_dp2.path.glob("*/zero_pp_rank_0_mp_rank_00_model_states.pt"))[0]
    whole = torchfile.load(model_file)
    reader = open_reader(z3_bf16_dp2.path)
    try:
        head = reader._model[0].obj
        assert "param_shapes" not in head and set(head["module"]) == set(whole["buffer_names"])
        assert whole["buffer_names"] and len(whole["module"]) > len(whole["buffer_names"])
        buffers = reader.buffers()
        assert set(buffers) == set(whole["buffer_names"])
        assert all(torch.equal(buffers[n], whole["module"][n]) for n in buffers)
        assert reader.extras()["lr_scheduler"] == whole.get("lr_scheduler")
    finally:
        reader.close()


@pytest.mark.slow
def test_threads_write_the_universal_files_of_one_thread(z3_bf16_dp2, tmp_path, monkeypatch) -> None:
    """The fixture's parameters are smaller than ``ucp.io.pool.FILE_GRAIN``, so to-universal writes them in the
    calling thread; with threads forced, parameters written at once must give the same files."""
    import threading

    from ucp.universal import writer

    seen: dict[str, set[int]] = {"one": set(), "threads": set()}
    run = ["one"]
    write_param = writer._write_param

    def spied(*args, **kwargs):  # which threads wrote parameters (the writing itself is the real one)
        seen[run[0]].add(threading.get_ident())
        return write_param(*args, **kwargs)

    monkeypatch.setattr(writer, "_write_param", spied)
    ucp.to_universal(z3_bf16_dp2.path, tmp_path / "one", workers=2)
    run[0] = "threads"
    monkeypatch.setattr(writer, "FILE_GRAIN", 0)
    ucp.to_universal(z3_bf16_dp2.path, tmp_path / "threads", workers=2)
    assert seen["one"] == {threading.get_ident()}, seen
    assert seen["threads"] and threading.get_ident() not in seen["threads"], seen
    files = {}
    for run_name in ("one", "threads"):
        root = tmp_path / run_name
        files[run_name] = {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
    assert files["one"].keys() == files["threads"].keys() and len(files["one"]) > 20
    assert [name for name in files["one"] if files["one"][name] != files["threads"][name]] == []
