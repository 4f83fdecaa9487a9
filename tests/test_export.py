"""ucp export: consolidated weights equal to what the live engine computed with, sharded the HF way."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ucp.cli import main
from ucp.errors import ConfigError, OutputExistsError
from ucp.io.atomic import OWNER_MARK
from ucp.ops.convert import to_universal
from ucp.targets import export as export_mod
from ucp.targets.export import export, parse_size, plan_shards

FROZEN = {"proj.weight", "proj.bias"}


@pytest.fixture(scope="module")
def bf16_universal(z3_bf16_dp2, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export") / "universal"
    to_universal(z3_bf16_dp2.path, out)
    return out


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def _load_folder(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    )
    out: dict[str, torch.Tensor] = {}
    for name in files:
        out.update(load_file(folder / name))
    return out


@pytest.mark.slow
def test_export_safetensors_equals_the_live_engines_bf16_weights(z3_bf16_dp2, tmp_path):
    record = z3_bf16_dp2.record
    written = export(z3_bf16_dp2.path, tmp_path / "out")
    assert written == [tmp_path / "out" / "model.safetensors"]
    weights = load_file(written[0])
    assert set(weights) == set(record["module"]) | {"calls"}  # owner only: head.weight is an alias
    for name, live in record["module"].items():
        assert _bits_equal(weights[name], live), name
    assert _bits_equal(weights["calls"], record["buffers"]["calls"])
    with safe_open(written[0], "pt") as handle:
        metadata = handle.metadata()
    assert metadata["format"] == "pt" and json.loads(metadata["ucp_tied"]) == record["tied"]


@pytest.mark.slow
def test_export_from_universal_equals_export_from_the_checkpoint(z3_bf16_dp2, bf16_universal, tmp_path):
    a = export(z3_bf16_dp2.path, tmp_path / "a.safetensors")
    b = export(bf16_universal, tmp_path / "b.safetensors")
    assert a == [tmp_path / "a.safetensors"]
    ours, theirs = load_file(a[0]), load_file(b[0])  # not the bytes: safetensors orders its metadata freely
    assert set(ours) == set(theirs) and all(_bits_equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.slow
def test_export_casts_fp32_masters_to_the_requested_dtype(z3_bf16_dp2, bf16_universal, tmp_path):
    record = z3_bf16_dp2.record
    fp32 = load_file(export(bf16_universal, tmp_path / "fp32", dtype="fp32")[0])
    fp16 = load_file(export(bf16_universal, tmp_path / "fp16", dtype="fp16")[0])
    for name, master in record["params"].items():  # trainable: the fp32 master itself, or its cast
        assert _bits_equal(fp32[name], master), name
        assert _bits_equal(fp16[name], master.half()), name
    for name in FROZEN:  # frozen: stored in the model dtype, so the bf16 weight widened exactly
        assert _bits_equal(fp32[name], record["module"][name].float()), name
    assert fp32["calls"].dtype == torch.float32 and fp16["calls"].dtype == torch.float16  # floating buffers follow


@pytest.mark.slow
def test_export_fp32_run_keeps_fp32_weights(z3_fp32_dp3, tmp_path):
    record = z3_fp32_dp3.record
    weights = load_file(export(z3_fp32_dp3.path, tmp_path / "out")[0])
    for name, live in record["module"].items():
        assert _bits_equal(weights[name], live), name
    for name, master in record["params"].items():
        assert _bits_equal(weights[name], master), name


@pytest.mark.slow
def test_export_shards_by_max_shard_size_with_an_hf_index(z3_bf16_dp2, bf16_universal, tmp_path):
    record = z3_bf16_dp2.record
    out = tmp_path / "sharded"
    written = export(bf16_universal, out, max_shard_size="1KB")
    shards, index_path = written[:-1], written[-1]
    assert index_path == out / "model.safetensors.index.json" and len(shards) >= 3
    assert sorted(p.name for p in out.iterdir()) == sorted([OWNER_MARK] + [p.name for p in written])
    assert all(
        re.fullmatch(rf"model-{i + 1:05d}-of-{len(shards):05d}\.safetensors", p.name) for i, p in enumerate(shards)
    )
    index = json.loads(index_path.read_text())
    weights = _load_folder(out)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in weights.values())
    assert index["metadata"]["ucp_tied"] == record["tied"]
    assert set(index["weight_map"]) == set(weights) == set(record["module"]) | {"calls"}
    for shard in shards:
        tensors = load_file(shard)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        assert size <= 1000 or len(tensors) == 1  # one tensor above the limit gets a shard of its own
        assert all(index["weight_map"][name] == shard.name for name in tensors)
    for name, live in record["module"].items():
        assert _bits_equal(weights[name], live), name


@pytest.mark.slow
def test_export_torch_format_stores_a_tied_alias_as_the_same_tensor(z3_bf16_dp2, tmp_path):
    record = z3_bf16_dp2.record
    state = torch.load(export(z3_bf16_dp2.path, tmp_path / "model.bin", format="torch")[0], weights_only=True)
    assert state["head.weight"] is state["embed.weight"]
    assert set(state) == set(record["names"]) | {"calls"}
    keys = list(state)
    assert keys[keys.index("embed.weight") + 1] == "head.weight"  # the alias right after its owner
    for name, live in record["module"].items():
        assert _bits_equal(state[name], live), name
    written = export(z3_bf16_dp2.path, tmp_path / "sharded", format="torch", max_shard_size="600B")
    assert written[-1].name == "pytorch_model.bin.index.json" and written[0].name.startswith("pytorch_model-00001-of-")
    index = json.loads(written[-1].read_text())
    assert index["weight_map"]["head.weight"] == index["weight_map"]["embed.weight"]
    shard = torch.load(written[-1].parent / index["weight_map"]["embed.weight"], weights_only=True)
    assert shard["head.weight"] is shard["embed.weight"]


@pytest.mark.slow
def test_export_never_touches_an_existing_output_without_overwrite(z3_bf16_dp2, tmp_path):
    target = tmp_path / "model.safetensors"
    target.write_text("keep me")
    with pytest.raises(OutputExistsError):
        export(z3_bf16_dp2.path, target)
    assert target.read_text() == "keep me"
    export(z3_bf16_dp2.path, target, overwrite=True)
    assert "embed.weight" in load_file(target)
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]  # no staging left behind


@pytest.mark.slow
def test_export_failure_leaves_no_output(z3_bf16_dp2, tmp_path, monkeypatch):
    calls = []

    def fail_second(path, entries, fetch, metadata, **kwargs):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full")
        path.write_bytes(b"x")

    monkeypatch.setattr(export_mod, "write_safetensors", fail_second)
    with pytest.raises(OSError):
        export(z3_bf16_dp2.path, tmp_path / "out", max_shard_size="1KB")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_export_to_one_file_refuses_to_shard(z3_bf16_dp2, tmp_path):
    with pytest.raises(ConfigError, match="give a folder"):
        export(z3_bf16_dp2.path, tmp_path / "model.safetensors", max_shard_size="1KB")
    with pytest.raises(ConfigError, match="does not fit --format torch"):
        export(z3_bf16_dp2.path, tmp_path / "model.safetensors", format="torch")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_export_writes_safetensors_without_the_package(z3_bf16_dp2, tmp_path, monkeypatch):
    """ucp writes the format itself (tensor by tensor, in bounded chunks); the library only reads it back here."""
    with monkeypatch.context() as patched:
        patched.setitem(sys.modules, "safetensors", None)
        patched.setitem(sys.modules, "safetensors.torch", None)
        written = export(z3_bf16_dp2.path, tmp_path / "out")
    assert "embed.weight" in load_file(written[0])


@pytest.mark.parametrize(
    "text, size",
    [
        ("500MB", 500 * 10**6),
        ("5GB", 5 * 10**9),
        ("1.5GiB", 3 * 2**29),
        ("100", 100),
        (" 2 kib ", 2048),
        ("1KB", 1000),
        ("600B", 600),
        (1234, 1234),
    ],
)
def test_parse_size_reads_decimal_and_binary_units(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["5XB", "", "GB", "0", "-1", "1.2.3MB", "0.1B"])
def test_parse_size_refuses_nonsense(text):
    with pytest.raises(ConfigError):
        parse_size(text)


@pytest.mark.parametrize(
    "sizes, limit, shards",
    [
        ([("a", 4), ("b", 4), ("c", 4)], 8, [["a", "b"], ["c"]]),
        ([("a", 10), ("b", 1), ("c", 1)], 8, [["a"], ["b", "c"]]),
        ([("a", 1), ("b", 10), ("c", 1)], 8, [["a"], ["b"], ["c"]]),
        ([("a", 8)], 8, [["a"]]),
        ([], 8, [[]]),
    ],
)
def test_plan_shards_fills_in_order_and_isolates_oversized_tensors(sizes, limit, shards):
    assert plan_shards(sizes, limit) == shards


@pytest.mark.slow
def test_export_cli_exit_codes(z3_bf16_dp2, bf16_universal, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["export", str(bf16_universal), str(out), "--dtype", "fp32", "--max-shard-size", "2KB"]) == 0
    assert "file(s) to" in capsys.readouterr().out  # the result on stdout
    assert (out / "model.safetensors.index.json").is_file()
    assert main(["export", str(bf16_universal), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ucp: error:") and "already exists" in err and len(err.strip().splitlines()) == 1
    assert main(["export", str(bf16_universal), str(out), "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == [OWNER_MARK, "model.safetensors"]
    assert main(["export", str(bf16_universal), str(tmp_path / "x"), "--max-shard-size", "lots"]) == 2
    assert "is not a size" in capsys.readouterr().err


@pytest.mark.slow
def test_export_cli_in_a_subprocess(z3_bf16_dp2, tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "ucp", "export", str(z3_bf16_dp2.path), str(tmp_path / "m.bin"), "--format", "torch"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    assert torch.load(tmp_path / "m.bin", weights_only=True)["head.weight"].dtype == torch.bfloat16
    bad = subprocess.run(
        [sys.executable, "-m", "ucp", "export", str(tmp_path / "nothing"), str(tmp_path / "o")],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_exported_files_follow_the_umask_and_a_foreign_suffix_is_refused(bf16_universal, tmp_path, capsys):
    mask = os.umask(0o022)
    os.umask(mask)
    single = tmp_path / "model.safetensors"
    assert main(["export", str(bf16_universal), str(single)]) == 0
    sharded = export(bf16_universal, tmp_path / "shards", max_shard_size="1KB")
    torch_file = export(bf16_universal, tmp_path / "model.bin", format="torch")
    for path in [single, *sharded, *torch_file]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~mask, path
    capsys.readouterr()
    assert main(["export", str(bf16_universal), str(tmp_path / "weights.txt")]) == 2
    err = capsys.readouterr().err
    assert "ends in .txt" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "weights.txt").exists()


def test_config_dtype_is_rewritten_only_where_it_names_another_dtype_and_hostile_text_is_left_alone():
    from ucp.frameworks.hf import config_in_dtype

    written = config_in_dtype(b'{"dtype": "bfloat16", "text_config": {"torch_dtype": "float32"}, "x": 1}', "fp16")
    assert json.loads(written) == {"dtype": "float16", "text_config": {"torch_dtype": "float16"}, "x": 1}
    assert config_in_dtype(b'{"dtype": "float16"}', "fp16") is None  # already says so: copied byte for byte
    assert config_in_dtype(b"\xff\xfe not json", "fp16") is None
    deep = b'{"a":' * 100_000 + b"1" + b"}" * 100_000
    assert config_in_dtype(deep, "fp16") is None
