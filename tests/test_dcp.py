"""DeepSpeed ZeRO-3 -> DCP -> real FSDP2, and FSDP2 -> DCP -> universal -> real DeepSpeed ZeRO-3.

Every checkpoint here is written by a real run (DeepSpeed or FSDP2 ``fully_shard`` on gloo ranks);
runs that only depend on the fixtures are cached on disk like them, runs that load ucp's output
run once per session.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest
import torch

import ucp
from tests.support.checks import assert_same_training, assert_state_equals_record
from tests.support.fixtures import Built, cache_root
from ucp.cli import main as cli
from ucp.errors import InputError, UcpError
from ucp.harness import LoadSpec, RunSpec, run_ranks
from ucp.harness.fsdp import loaded_record_path, run_fsdp
from ucp.sources import open_reader
from ucp.sources.dcp import DcpSource, read_metadata
from ucp.targets.dcp import write_dcp

#: the FSDP2 run that starts the reverse trip: the model, groups and data of z3-fp32-dp3-adamw at 2 ranks
_VERSION = 2  # bump when the FSDP2 harness changes what it computes
FSDP_SOURCE = RunSpec(dp=2, stage=3, dtype="fp32", optimizer="torch-adamw", param_groups=3)


def _cached(name: str, spec: RunSpec, run: Callable[[RunSpec], None]) -> Path:
    """Run ``spec`` once (its record and save folder under the fixture cache) and return its folder."""
    raw = json.dumps(
        {"v": _VERSION, "name": name, **asdict(replace(spec, record=None, save_dir=None, port=0))}, sort_keys=True
    )
    folder = cache_root() / f"dcp-{name}-{hashlib.sha1(raw.encode()).hexdigest()[:12]}"
    if not (folder / "DONE").exists():
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        run(replace(spec, record=str(folder / "record.pt"), save_dir=str(folder / "dcp") if spec.save_dir else None))
        (folder / "DONE").write_text("ok")
    return folder


def _record(path: Path | str) -> dict[str, Any]:
    return torch.load(path, weights_only=True)


def _ds_run(spec: RunSpec, log_dir: Path) -> None:
    run_ranks(spec, log_dir=log_dir)


@pytest.fixture(scope="session")
def z3_fp32(source: Callable[[str], Built]) -> Built:
    return source("z3-fp32-dp3-adamw")


@pytest.fixture(scope="session")
def native_3_more(z3_fp32: Built) -> dict[str, Any]:
    """DeepSpeed's own resume of z3-fp32-dp3-adamw at DP=3, 3 more steps (cached)."""
    spec = replace(z3_fp32.spec, steps=3, first_step=z3_fp32.spec.steps, load=LoadSpec(str(z3_fp32.path)))
    folder = _cached("native", spec, lambda s: _ds_run(s, Path(s.record).parent / "logs"))
    return _record(folder / "record.pt")


@pytest.fixture(scope="session")
def dcp_of(universals: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """dcp_of(name) -> the DCP folder ``ucp restore --format dcp`` writes for source(name)."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = tmp_path_factory.mktemp(f"dcp-{name}") / "dcp"
            assert cli(["restore", str(universals(name)), str(made[name]), "--format", "dcp"]) == 0
        return made[name]

    return get


@pytest.fixture(scope="session")
def fsdp_resume(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Built, Path, int], tuple[dict, dict]]:
    """fsdp_resume(base, dcp, world) -> (state right after the load, state after 3 more steps)."""
    work = tmp_path_factory.mktemp("fsdp")
    done: dict[tuple[str, int], tuple[dict, dict]] = {}

    def get(base: Built, folder: Path, world: int) -> tuple[dict, dict]:
        if (str(folder), world) not in done:
            record = work / f"{folder.parent.name}-w{world}.pt"
            load = LoadSpec(str(folder), kind="dcp")
            spec = replace(base.spec, dp=world, steps=3, first_step=base.spec.steps, load=load, record=str(record))
            run_fsdp(replace(spec, save_dir=None, port=0), log_dir=work / f"{record.stem}-logs")
            done[(str(folder), world)] = (_record(loaded_record_path(str(record))), _record(record))
        return done[(str(folder), world)]

    return get


@pytest.fixture(scope="session")
def fsdp_source() -> Path:
    """An FSDP2 run at 2 ranks, 3 steps from scratch, saved with plain dcp.save (cached)."""
    return _cached("fsdp-source", replace(FSDP_SOURCE, save_dir="yes"), run_fsdp)


@pytest.fixture(scope="session")
def fsdp_own_resume(fsdp_source: Path) -> dict[str, Any]:
    """FSDP2's own resume of ``fsdp_source`` at 2 ranks, 3 more steps (cached)."""
    spec = replace(FSDP_SOURCE, steps=3, first_step=3, load=LoadSpec(str(fsdp_source / "dcp"), kind="dcp"))
    return _record(_cached("fsdp-resume", spec, run_fsdp) / "record.pt")


# -- DeepSpeed -> DCP -> FSDP2 -------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 3])
def test_fsdp2_resumes_a_zero3_run_from_dcp_like_deepspeed_itself(z3_fp32, dcp_of, fsdp_resume, native_3_more, world):
    loaded, after = fsdp_resume(z3_fp32, dcp_of("z3-fp32-dp3-adamw"), world)
    assert_state_equals_record(loaded, z3_fp32.record, steps=3)  # bit for bit, buffers and counters too
    assert [g["lr"] for g in loaded["group_hparams"]] == [g["lr"] for g in z3_fp32.record["group_hparams"]]
    assert len({json.dumps(g, sort_keys=True, default=str) for g in loaded["group_hparams"]}) == 3
    assert loaded["lr_scheduler"]["last_epoch"] == z3_fp32.record["lr_scheduler"]["last_epoch"]
    assert_same_training(native_3_more, after, atol=1e-5)
    assert set(after["state_steps"]) == {6.0}


def test_bf16_zero3_state_loads_into_fsdp2_bit_exact(source, dcp_of, fsdp_resume):
    base = source("z3-bf16-dp2-adamw")
    loaded, after = fsdp_resume(base, dcp_of("z3-bf16-dp2-adamw"), 2)
    assert_state_equals_record(loaded, base.record, steps=3, buffers=False)  # fp32 masters, moments, bf16 weights
    for name, value in base.record["buffers"].items():  # FSDP2 keeps buffers in fp32: the bf16 values, widened
        assert torch.equal(loaded["buffers"][name], value.float()), name
    assert all(abs(loss) < 10 for loss in after["losses"]) and set(after["state_steps"]) == {6.0}


def test_dcp_output_holds_exactly_the_keys_an_fsdp2_save_holds(dcp_of, fsdp_source):
    ours = read_metadata(dcp_of("z3-fp32-dp3-adamw")).state_dict_metadata
    theirs = read_metadata(fsdp_source / "dcp").state_dict_metadata
    assert set(ours) - {"ucp"} == set(theirs)
    for key, meta in theirs.items():
        assert type(ours[key]) is type(meta), key
        if hasattr(meta, "size"):
            assert (ours[key].size, ours[key].properties.dtype) == (meta.size, meta.properties.dtype), key


# -- FSDP2 -> DCP -> universal -> DeepSpeed ------------------------------------------------------
def test_dcp_source_reads_what_the_fsdp2_run_held(fsdp_source):
    record = _record(fsdp_source / "record.pt")
    with DcpSource(fsdp_source / "dcp") as reader:
        facts = reader.facts
        assert facts.tied == record["tied"] == {"head.weight": "embed.weight"}
        assert facts.buffer_names == ["calls"] and facts.flavour == "torch-adam" and facts.adam_w_mode is True
        assert sorted(p.name for p in facts.params if p.frozen) == ["proj.bias", "proj.weight"]
        assert [g.hyper.lr for g in facts.groups] == record["lrs"] and facts.info.global_steps == 3
        for name, value in record["params"].items():
            state = reader.read(name)
            assert torch.equal(state.fp32, value) and state.step == 3, name
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(state.optim[key], record[key][name]), (name, key)
        assert torch.equal(reader.buffers()["calls"], record["buffers"]["calls"])
        assert reader.extras()["lr_scheduler"] == record["lr_scheduler"]


def test_fsdp2_run_moves_to_deepspeed_zero3_at_dp3(fsdp_source, fsdp_own_resume, tmp_path):
    u, native = tmp_path / "u", tmp_path / "ds"
    assert cli(["to-universal", str(fsdp_source / "dcp"), str(u)]) == 0
    assert cli(["restore", str(u), str(native), "--dp", "3"]) == 0
    spec = replace(FSDP_SOURCE, dp=3, steps=3, first_step=3, load=LoadSpec(str(native)), record=str(tmp_path / "r.pt"))
    run_ranks(spec, log_dir=tmp_path / "logs")
    assert_same_training(fsdp_own_resume, _record(spec.record), atol=1e-5)


# -- round trip and inspection, no run -----------------------------------------------------------
def test_dcp_written_by_ucp_reads_back_bit_exact(universals, dcp_of):
    with open_reader(universals("z3-bf16-dp2-adamw")) as u, open_reader(dcp_of("z3-bf16-dp2-adamw")) as d:
        assert [(p.name, p.shape, p.group, p.frozen, p.dtype) for p in d.facts.params] == [
            (p.name, p.shape, p.group, p.frozen, p.dtype) for p in u.facts.params
        ]
        assert d.facts.tied == u.facts.tied and d.facts.buffer_names == u.facts.buffer_names
        for meta in u.facts.params:
            a, b = u.read(meta.name), d.read(meta.name)
            assert torch.equal(a.fp32, b.fp32) and a.step == b.step and a.optim.keys() == b.optim.keys()
            assert all(torch.equal(a.optim[k], b.optim[k]) for k in a.optim), meta.name
        assert all(torch.equal(v, d.buffers()[k]) for k, v in u.buffers().items())
        assert d.extras()["lr_scheduler"] == u.extras()["lr_scheduler"]
        assert (d.facts.info.global_steps, d.facts.info.global_samples) == (
            u.facts.info.global_steps,
            u.facts.info.global_samples,
        )


def test_inspect_recognises_a_dcp_folder(dcp_of, capsys):
    assert cli(["inspect", str(dcp_of("z3-fp32-dp3-adamw")), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["format"] == "dcp" and report["optimizer"] == "torch-adam" and report["step"] == 3


# -- bad input: one line, non-zero exit, nothing written ----------------------------------------
def _fails(argv: list[str], out: Path, capsys: pytest.CaptureFixture[str], words: str) -> None:
    assert cli(argv) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err
    assert not out.exists() and not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.ucp-")]


def _copy(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / "in"))


def test_missing_shard_file_is_one_line(fsdp_source, tmp_path, capsys):
    broken = _copy(fsdp_source / "dcp", tmp_path)
    (broken / "__1_0.distcp").unlink()
    _fails(["to-universal", str(broken), str(tmp_path / "u")], tmp_path / "u", capsys, "__1_0.distcp is missing")


def test_truncated_shard_file_is_one_line(fsdp_source, tmp_path, capsys):
    broken = _copy(fsdp_source / "dcp", tmp_path)
    shard = broken / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])
    _fails(["restore", str(broken), str(tmp_path / "o"), "--format", "dcp"], tmp_path / "o", capsys, "truncated")


def test_metadata_that_is_not_dcps_is_refused_unexecuted(fsdp_source, tmp_path, capsys):
    broken = _copy(fsdp_source / "dcp", tmp_path)
    marker = tmp_path / "pwned"
    (broken / ".metadata").write_bytes(pickle.dumps(_Evil(str(marker))))
    _fails(["to-universal", str(broken), str(tmp_path / "u")], tmp_path / "u", capsys, "not a torch.distributed")
    assert not marker.exists()
    (broken / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": {}}))
    with pytest.raises(UcpError, match="not a torch.distributed.checkpoint metadata"):
        DcpSource(broken)


class _Evil:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.path}",))


def test_optimizer_state_for_names_the_model_lacks_is_refused(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp

    state = {
        "model": {"a.weight": torch.ones(3)},
        "optim": {
            "state": {"b.weight": {"step": torch.tensor(1.0), "exp_avg": torch.ones(3), "exp_avg_sq": torch.ones(3)}},
            "param_groups": [
                {"lr": 0.1, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.0, "params": ["b.weight"]}
            ],
        },
    }
    dcp.save(state, checkpoint_id=tmp_path / "bad", no_dist=True)
    _fails(["to-universal", str(tmp_path / "bad"), str(tmp_path / "u")], tmp_path / "u", capsys, "'b.weight'")
    with pytest.raises(InputError, match="does not hold"):
        DcpSource(tmp_path / "bad")


def test_restore_dcp_refuses_another_optimizer_family(universals, tmp_path, capsys):
    out = tmp_path / "o"
    argv = ["restore", str(universals("z3-fp32-dp3-adamw")), str(out), "--format", "dcp", "--optimizer", "torch-sgd"]
    _fails(argv, out, capsys, "adam family")


def test_write_dcp_keeps_an_existing_output_whole(universals, dcp_of, tmp_path):
    out = Path(shutil.copytree(dcp_of("z3-fp32-dp3-adamw"), tmp_path / "o"))
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(UcpError, match="already exists"):
        write_dcp(universals("z3-fp32-dp3-adamw"), out)
    assert sorted(p.name for p in out.iterdir()) == before
    assert ucp.write_dcp(universals("z3-fp32-dp3-adamw"), out, overwrite=True).flavour == "torch-adamw"
