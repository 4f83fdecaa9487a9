"""DeepSpeed ZeRO-3 -> DCP -> real FSDP2, and FSDP2 -> DCP -> universal -> real DeepSpeed ZeRO-3.

Every checkpoint here is written by a real run (DeepSpeed or FSDP2 ``fully_shard`` on gloo ranks);
runs that only depend on the fixtures are cached on disk like them, runs that load ucp's output
run once per session.
"""

from __future__ import annotations

import hashlib
import importlib.util
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
from tests.support.checks import assert_every_state_equals_record, assert_same_training, assert_state_equals_record
from tests.support.fixtures import Built, cache_root, refuse_in_fast_tier
from ucp.cli import main as cli
from ucp.errors import InputError, UcpError
from ucp.frameworks.dcp import read_metadata
from ucp.harness import LoadSpec, RunSpec, run_ranks
from ucp.harness.fsdp import loaded_record_path, run_fsdp
from ucp.sources import open_reader
from ucp.sources.dcp import DcpSource
from ucp.targets.dcp import write_dcp

#: the FSDP2 run that starts the reverse trip: the model, groups and data of z3-fp32-dp3-adamw at 2 ranks
_VERSION = 3  # bump when the FSDP2 harness changes what it computes or records
FSDP_SOURCE = RunSpec(dp=2, stage=3, dtype="fp32", optimizer="torch-adamw", param_groups=3)


def _cached(name: str, spec: RunSpec, run: Callable[[RunSpec], None]) -> Path:
    """Run ``spec`` once (its record and save folder under the fixture cache) and return its folder."""
    raw = json.dumps(
        {"v": _VERSION, "name": name, **asdict(replace(spec, record=None, save_dir=None, port=0))}, sort_keys=True
    )
    folder = cache_root() / f"dcp-{name}-{hashlib.sha1(raw.encode()).hexdigest()[:12]}"
    refuse_in_fast_tier(folder)
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
@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3])
def test_fsdp2_resumes_a_zero3_run_from_dcp_like_deepspeed_itself(z3_fp32, dcp_of, fsdp_resume, native_3_more, world):
    loaded, after = fsdp_resume(z3_fp32, dcp_of("z3-fp32-dp3-adamw"), world)
    assert_state_equals_record(loaded, z3_fp32.record, steps=3)  # bit for bit, buffers and counters too
    assert [g["lr"] for g in loaded["group_hparams"]] == [g["lr"] for g in z3_fp32.record["group_hparams"]]
    assert len({json.dumps(g, sort_keys=True, default=str) for g in loaded["group_hparams"]}) == 3
    assert loaded["lr_scheduler"]["last_epoch"] == z3_fp32.record["lr_scheduler"]["last_epoch"]
    assert_same_training(native_3_more, after, atol=1e-5)
    assert set(after["state_steps"]) == {6.0}


@pytest.mark.slow
def test_bf16_zero3_state_loads_into_fsdp2_bit_exact_and_trains_on_within_bf16_noise(
    source, dcp_of, fsdp_resume, native_resume
):
    """Bit for bit at the load. After it the two runs follow different bf16 recipes: DeepSpeed casts the
    whole module (buffers too) to bf16 and all-reduces bf16 gradients; FSDP2's MixedPrecisionPolicy
    casts only parameters, keeps buffers fp32 and reduces in fp32. Measured here (torch 2.13, DeepSpeed
    0.19.8): the first loss, from identical weights, differs by 3.1e-3 (recipe alone); losses by at
    most 6.2e-3, fp32 masters 5.4e-4, exp_avg 4.1e-4, exp_avg_sq 6.4e-5 after 3 steps. Tolerances are
    ~3-4x those; a wrong step (bias correction) or lost moments moves parameters by ~lr = 8e-3-1.5e-2."""
    base = source("z3-bf16-dp2-adamw")
    loaded, after = fsdp_resume(base, dcp_of("z3-bf16-dp2-adamw"), 2)
    assert_state_equals_record(loaded, base.record, steps=3, buffers=False)  # fp32 masters, moments, bf16 weights
    for name, value in base.record["buffers"].items():  # FSDP2 keeps buffers in fp32: the bf16 values, widened
        assert torch.equal(loaded["buffers"][name], value.float()), name
    native = native_resume(base)
    assert all(abs(a - b) <= 1e-2 for a, b in zip(after["losses"], native["losses"], strict=True)), (
        after["losses"],
        native["losses"],
    )
    for key, atol in (("params", 2e-3), ("exp_avg", 2e-3), ("exp_avg_sq", 3e-4)):
        for name, value in native[key].items():
            assert torch.allclose(after[key][name], value, rtol=0, atol=atol), (key, name)
    assert set(after["state_steps"]) == {6.0} and after["lrs"] == native["lrs"]


@pytest.mark.slow
def test_dcp_output_holds_exactly_the_keys_an_fsdp2_save_holds(dcp_of, fsdp_source):
    ours = read_metadata(dcp_of("z3-fp32-dp3-adamw")).state_dict_metadata
    theirs = read_metadata(fsdp_source / "dcp").state_dict_metadata
    assert set(ours) - {"ucp"} == set(theirs)
    for key, meta in theirs.items():
        assert type(ours[key]) is type(meta), key
        if hasattr(meta, "size"):
            assert (ours[key].size, ours[key].properties.dtype) == (meta.size, meta.properties.dtype), key


# -- FSDP2 -> DCP -> universal -> DeepSpeed ------------------------------------------------------
@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("stage", [3, 2])
def test_fsdp2_run_moves_to_deepspeed_zero_at_dp3(fsdp_source, fsdp_own_resume, stage, tmp_path, capsys):
    """At ZeRO-3 (a DCP source's default) and ZeRO-2, whose load asserts a ds_version the source cannot name and
    takes the gradient clipping from the files."""
    u, native = tmp_path / "u", tmp_path / "ds"
    assert cli(["to-universal", str(fsdp_source / "dcp"), str(u)]) == 0
    assert cli(["restore", str(u), str(native), "--dp", "3", "--stage", str(stage)]) == 0
    assert ("records no gradient clipping" in capsys.readouterr().err) == (stage == 2)
    load = LoadSpec(str(native))
    spec = replace(FSDP_SOURCE, dp=3, stage=stage, steps=3, first_step=3, load=load, record=str(tmp_path / "r.pt"))
    run_ranks(spec, log_dir=tmp_path / "logs")
    assert_same_training(fsdp_own_resume, _record(spec.record), atol=1e-5)


# -- round trip and inspection, no run -----------------------------------------------------------
@pytest.mark.slow
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


@pytest.mark.slow
def test_inspect_recognises_a_dcp_folder(dcp_of, capsys):
    assert cli(["inspect", str(dcp_of("z3-fp32-dp3-adamw")), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["format"] == "dcp" and report["optimizer"] == "torch-adam" and report["step"] == 3


@pytest.fixture(scope="session")
def dcp_folders(fsdp_source: Path, dcp_of: Callable[[str], Path]) -> dict[str, Path]:
    """A DCP folder an FSDP2 run saved, and one ucp wrote."""
    return {"fsdp2": fsdp_source / "dcp", "ucp": dcp_of("z3-fp32-dp3-adamw")}


@pytest.mark.slow
@pytest.mark.parametrize("which", ["fsdp2", "ucp"])
def test_verify_and_export_work_on_a_dcp_folder(which, dcp_folders, universals, tmp_path, capsys):
    from safetensors.torch import load_file

    folder, u = dcp_folders[which], tmp_path / "u"
    assert cli(["to-universal", str(folder), str(u)]) == 0
    assert capsys.readouterr().out.startswith("wrote 13 parameters")
    assert cli(["verify", str(folder), str(u)]) == 0
    assert capsys.readouterr().out.startswith("OK: 13 parameters")
    other = universals("z3-fp32-dp3-adamw") if which == "fsdp2" else u.parent / "other"
    if which == "ucp":  # the same model from another run: verify must tell them apart
        assert cli(["to-universal", str(dcp_folders["fsdp2"]), str(other)]) == 0
    assert cli(["verify", str(folder), str(other)]) == 1
    assert cli(["export", str(folder), str(tmp_path / "w.safetensors")]) == 0
    weights = load_file(tmp_path / "w.safetensors")
    with DcpSource(folder) as reader:
        assert set(weights) == {p.name for p in reader.facts.params} | {"calls"}  # the tied head stored once
        for meta in reader.facts.params:
            assert torch.equal(weights[meta.name], reader.read(meta.name, moments=False).fp32), meta.name
        assert torch.equal(weights["calls"], reader.buffers()["calls"])


@pytest.mark.slow
@pytest.mark.parametrize("which", ["fsdp2", "ucp"])
def test_inspect_describes_a_dcp_folder_in_text_and_json(which, dcp_folders, capsys):
    folder = dcp_folders[which]
    assert cli(["inspect", str(folder)]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"{folder}: dcp checkpoint") and "optimizer torch-adam (adam_w_mode=True), step 3" in text
    assert "tied: head.weight -> embed.weight" in text and "buffers: calls" in text
    assert "torch.distributed.checkpoint, saved at" in text and "DeepSpeed" not in text and "ZeRO" not in text
    assert cli(["inspect", str(folder), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["format"], report["num_params"], report["num_frozen"], report["global_steps"]) == ("dcp", 13, 2, 3)
    assert [
        len(g["params"]) if isinstance(g.get("params"), list) else g.get("num_params") for g in report["param_groups"]
    ]


# -- one rank: frozen parameters and buffers look alike -----------------------------------------
@pytest.fixture(scope="session")
def fsdp_one_rank() -> Path:
    """An FSDP2 run on one rank, 3 steps, saved with plain dcp.save (cached): nothing is sharded."""
    return _cached("fsdp-one-rank", replace(FSDP_SOURCE, dp=1, save_dir="yes"), run_fsdp)


@pytest.mark.slow
def test_one_rank_fsdp2_save_keeps_the_frozen_parameters_the_user_names(fsdp_one_rank, tmp_path, capsys):
    folder, record = fsdp_one_rank / "dcp", _record(fsdp_one_rank / "record.pt")
    with DcpSource(folder) as guessed:  # unnamed, they are read as buffers, with a warning: never dropped
        assert sorted(guessed.facts.buffer_names) == ["calls", "proj.bias", "proj.weight"]
        assert any("--frozen" in w for w in guessed.facts.warnings)
    u = tmp_path / "u"
    assert cli(["to-universal", str(folder), str(u), "--frozen", "proj.weight", "proj.bias"]) == 0
    with open_reader(u) as reader:
        facts = reader.facts
        assert sorted(p.name for p in facts.params if p.frozen) == ["proj.bias", "proj.weight"]
        assert facts.buffer_names == ["calls"] and facts.tied == {"head.weight": "embed.weight"}
        entries = {p.name for p in facts.params} | set(facts.tied) | set(facts.buffer_names)
        assert entries == set(record["names"]) | {"calls"}  # every model entry reached the output
        for name in ("proj.weight", "proj.bias"):
            assert torch.equal(reader.read(name).fp32, record["module"][name]), name
        for name, value in record["params"].items():
            state = reader.read(name)
            assert torch.equal(state.fp32, value) and torch.equal(state.optim["exp_avg"], record["exp_avg"][name])
    capsys.readouterr()
    for bad, words in ((["embed.weight"], "are trained"), (["nope"], "does not hold")):
        _fails(["to-universal", str(folder), str(tmp_path / "v"), "--frozen", *bad], tmp_path / "v", capsys, words)


# -- bad input: one line, non-zero exit, nothing written ----------------------------------------
def _fails(argv: list[str], out: Path, capsys: pytest.CaptureFixture[str], words: str) -> None:
    assert cli(argv) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err
    assert not out.exists() and not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.ucp-")]


def _copy(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / "in"))


@pytest.mark.slow
def test_missing_shard_file_is_one_line(fsdp_source, tmp_path, capsys):
    broken = _copy(fsdp_source / "dcp", tmp_path)
    (broken / "__1_0.distcp").unlink()
    _fails(["to-universal", str(broken), str(tmp_path / "u")], tmp_path / "u", capsys, "__1_0.distcp is missing")


@pytest.mark.slow
def test_truncated_shard_file_is_one_line(fsdp_source, tmp_path, capsys):
    broken = _copy(fsdp_source / "dcp", tmp_path)
    shard = broken / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])
    _fails(["restore", str(broken), str(tmp_path / "o"), "--format", "dcp"], tmp_path / "o", capsys, "truncated")


@pytest.mark.slow
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


def test_a_group_whose_members_keep_different_state_keys_is_refused(tmp_path, capsys):
    """Never one member's keys for the whole group: the other member's moments would be lost."""
    import torch.distributed.checkpoint as dcp

    adam = {"step": torch.tensor(1.0), "exp_avg": torch.ones(3), "exp_avg_sq": torch.ones(3)}
    state = {
        "model": {"a.weight": torch.ones(3), "b.weight": torch.ones(3)},
        "optim": {
            "state": {"a.weight": {"step": torch.tensor(1.0)}, "b.weight": adam},
            "param_groups": [
                {"lr": 0.1, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.0, "params": ["a.weight", "b.weight"]}
            ],
        },
    }
    dcp.save(state, checkpoint_id=tmp_path / "bad", no_dist=True)
    _fails(["to-universal", str(tmp_path / "bad"), str(tmp_path / "u")], tmp_path / "u", capsys, "b.weight keeps")


@pytest.mark.slow
def test_restore_dcp_refuses_another_optimizer_family(universals, tmp_path, capsys):
    out = tmp_path / "o"
    argv = ["restore", str(universals("z3-fp32-dp3-adamw")), str(out), "--format", "dcp", "--optimizer", "torch-sgd"]
    _fails(argv, out, capsys, "adam family")


@pytest.mark.slow
def test_write_dcp_keeps_an_existing_output_whole(universals, dcp_of, tmp_path):
    out = Path(shutil.copytree(dcp_of("z3-fp32-dp3-adamw"), tmp_path / "o"))
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(UcpError, match="already exists"):
        write_dcp(universals("z3-fp32-dp3-adamw"), out)
    assert sorted(p.name for p in out.iterdir()) == before
    assert ucp.write_dcp(universals("z3-fp32-dp3-adamw"), out, overwrite=True).flavour == "torch-adamw"


# -- torchtitan's CheckpointManager ---------------------------------------------------------------
class _TrainState:
    """torchtitan's Trainer is its own ``train_state`` Stateful (0.3: step and ntokens_seen)."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, -1

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = state["step"], state["ntokens_seen"]


def _torchtitan_run(base: Built, universal: Path, folder: Path) -> tuple[Any, Any, Any, _TrainState]:
    """The harness model under torchtitan's own OptimizersContainer, LRSchedulersContainer and
    CheckpointManager (one process, CPU), loaded from ``folder`` as torchtitan's initial_load_path."""
    import re

    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    from ucp.harness.model import TinyLM
    from ucp.harness.worker import lr_decay

    torch.manual_seed(0)  # not the run's seed: every value must come from the checkpoint
    model = TinyLM(base.spec.model)
    # one torchtitan group per ucp group, by exact names; lr is the config's base lr (torchtitan's
    # schedule starts from it, as in a real run), the rest deliberately wrong: the load must set it
    base_lrs = [g["initial_lr"] for g in base.record["group_hparams"]]
    with open_reader(universal) as reader:
        groups = [
            ParamGroupConfig(
                pattern="^(" + "|".join(map(re.escape, g.params)) + ")$",
                optimizer_name="AdamW",
                optimizer_kwargs={"lr": lr, "betas": (0.5, 0.5), "eps": 1.0, "weight_decay": 0.0},
            )
            for g, lr in zip(reader.facts.groups, base_lrs, strict=True)
        ]
    optimizers = OptimizersContainer(
        OptimizersContainer.Config(param_groups=groups, implementation="for-loop"), model_parts=[model]
    )
    schedulers = LRSchedulersContainer(optimizers, lr_decay)
    train = _TrainState()
    config = CheckpointManager.Config(
        enable=True,
        folder=str(folder.parent / "empty"),
        initial_load_path=str(folder),
        initial_load_model_only=False,
        exclude_from_loading=["dataloader"],
        keep_latest_k=0,
        load_only=True,
    )
    manager = CheckpointManager(
        config, dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
        states={"train_state": train}, sd_adapter=None,
    )  # fmt: skip
    assert manager.load()
    manager.close()
    return model, optimizers, schedulers, train


def _train_on(base: Built, model: Any, optimizers: Any, schedulers: Any) -> dict[str, Any]:
    """3 more steps with torchtitan's containers: the harness's batches, clipping and schedule, one process."""
    from ucp.harness.model import spec_batch

    spec, losses = base.spec, []
    for step in range(spec.steps, spec.steps + 3):
        tokens = spec_batch(spec, step, rank=0, dp=1)
        loss = model(tokens)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        optimizers.step()
        optimizers.zero_grad()
        schedulers.step()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach() for n, p in model.named_parameters()}}


@pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None,
    reason="torchtitan is not installed (pip install --no-deps torchtitan==0.3.0 tyro docstring_parser spmd_types==0.2.3)",
)
@pytest.mark.slow
def test_torchtitan_checkpoint_manager_resumes_the_torchtitan_layout(z3_fp32, universals, native_3_more, tmp_path):
    universal = universals("z3-fp32-dp3-adamw")
    out = tmp_path / "tt"
    assert cli(["restore", str(universal), str(out), "--format", "dcp", "--dcp-layout", "torchtitan"]) == 0
    model, optimizers, schedulers, train = _torchtitan_run(z3_fp32, universal, out)
    record = z3_fp32.record
    params = dict(model.named_parameters())
    for name, value in record["params"].items():
        assert torch.equal(params[name].detach(), value), name
        state = optimizers.optimizers[0].state[params[name]]
        assert float(state["step"]) == 3.0, name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key], record[key][name]), (name, key)
    for name, value in record["module"].items():
        assert torch.equal(params[name].detach(), value.float()), name  # frozen ones too
    assert model.head.weight is model.embed.weight and torch.equal(model.calls, record["buffers"]["calls"])
    live = [
        {k: v for k, v in g.items() if k in ("lr", "betas", "eps", "weight_decay")}
        for g in optimizers.optimizers[0].param_groups
    ]
    assert live == [{k: g[k] for k in ("lr", "betas", "eps", "weight_decay")} for g in record["group_hparams"]]
    assert schedulers.schedulers[0].last_epoch == record["lr_scheduler"]["last_epoch"]
    assert train.state_dict() == {"step": 3, "ntokens_seen": 0}
    after = _train_on(z3_fp32, model, optimizers, schedulers)  # and it trains on like DeepSpeed's own resume
    assert all(abs(a - b) <= 1e-4 for a, b in zip(after["losses"], native_3_more["losses"], strict=True)), (
        after["losses"],
        native_3_more["losses"],
    )
    for name, value in native_3_more["params"].items():
        assert torch.allclose(after["params"][name], value, rtol=0, atol=1e-5), name


@pytest.mark.slow
def test_write_dcp_reads_each_parameter_once(universals, tmp_path, monkeypatch):
    """The model entry and the optimizer state of a parameter are written together: its pieces found once, and
    every tensor streamed from them into the .distcp file (none read whole: torch's own writer would keep a whole
    file's tensors in memory); torch's own reader loads each one bit for bit."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from ucp.model.pieces import Pieces
    from ucp.universal import open_universal

    def whole(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("read whole")

    with open_universal(universals("z3-fp32-dp3-adamw")) as reader:
        reads: list[str] = []
        read_pieces = reader.read_pieces

        def counted(name: str, **kwargs: Any) -> Any:
            reads.append(name)
            return read_pieces(name, **kwargs)

        reader.read_pieces = counted  # type: ignore[method-assign]
        with monkeypatch.context() as banned:
            banned.setattr(reader, "read", whole)
            banned.setattr(Pieces, "join", whole)
            ucp.write_dcp(reader, tmp_path / "d")
        assert sorted(reads) == sorted(m.name for m in reader.facts.params)
        dcp_to_torch_save(tmp_path / "d", tmp_path / "whole.pt")
        saved = torch.load(tmp_path / "whole.pt", weights_only=True)
        trained = [m for m in reader.facts.params if not m.frozen]
        assert trained
        for meta in trained:
            state = reader.read(meta.name)
            assert torch.equal(saved["model"][meta.name], state.fp32), meta.name
            for key, tensor in state.optim.items():
                assert torch.equal(saved["optim"]["state"][meta.name][key], tensor), (meta.name, key)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["torch-nadam", "torch-sgd", "torch-asgd"])
def test_an_fsdp2_run_beyond_adam_moves_to_deepspeed_with_its_state(optimizer, tmp_path):
    """The way back beyond Adam: an FSDP2 run of NAdam (0-dim mu_product), SGD (no step) or ASGD (0-dim eta and
    mu) saved with dcp.save becomes a ZeRO-3 checkpoint at DP 3; DeepSpeed loads every tensor bit for bit and
    steps within 1e-5 of FSDP2's own resume."""
    spec = replace(FSDP_SOURCE, optimizer=optimizer, param_groups=2)
    saved = _cached(f"fsdp-{optimizer}", replace(spec, save_dir="yes"), run_fsdp)
    own = _record(
        _cached(
            f"fsdp-{optimizer}-resume",
            replace(spec, steps=3, first_step=3, load=LoadSpec(str(saved / "dcp"), kind="dcp")),
            run_fsdp,
        )
        / "record.pt"
    )
    out = tmp_path / "ds"
    assert cli(["restore", str(saved / "dcp"), str(out), "--dp", "3"]) == 0
    record = tmp_path / "r.pt"
    ds = replace(spec, dp=3, steps=0, first_step=3, load=LoadSpec(str(out)), record=str(record))
    run_ranks(ds, log_dir=tmp_path / "logs")
    assert_every_state_equals_record(_record(record), _record(saved / "record.pt"))
    run_ranks(replace(ds, steps=3, record=str(tmp_path / "r3.pt")), log_dir=tmp_path / "logs3")
    assert_same_training(own, _record(tmp_path / "r3.pt"), atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "named"),
    [(["--dtype", "bf16"], "--dtype describes"), (["--stage", "2", "--tp", "2"], "--stage, --tp describe")],
)
def test_flags_of_a_deepspeed_output_are_refused_for_a_dcp_folder(universals, tmp_path, capsys, flags, named):
    """They were ignored: --dtype bf16 wrote fp32 masters without a word."""
    out = tmp_path / "d"
    assert cli(["restore", str(universals("z3-fp32-dp3-adamw")), str(out), "--format", "dcp", *flags]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err, err
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("step", ["reset", "7"])
def test_a_dcp_folder_takes_the_step_policy_and_fsdp2_loads_it(z3_fp32, universals, step, tmp_path, capsys):
    """--step was ignored for a DCP output; now reset zeroes the state (step 0) and an integer sets every step,
    and a real FSDP2 run loads either with the standard lines."""
    out = tmp_path / "d"
    assert cli(["restore", str(universals("z3-fp32-dp3-adamw")), str(out), "--format", "dcp", "--step", step]) == 0
    assert ("optimizer state is reset" in capsys.readouterr().err) == (step == "reset")
    record = tmp_path / "r.pt"
    load = LoadSpec(str(out), kind="dcp")
    spec = replace(z3_fp32.spec, dp=2, steps=0, load=load, record=str(record), save_dir=None, port=0)
    run_fsdp(spec, log_dir=tmp_path / "logs")
    loaded = _record(loaded_record_path(str(record)))
    assert all(torch.equal(loaded["params"][n], v) for n, v in z3_fp32.record["params"].items())
    assert set(loaded["state_steps"]) == {0.0 if step == "reset" else 7.0}
    for key in ("exp_avg", "exp_avg_sq"):
        for name, value in z3_fp32.record[key].items():
            want = torch.zeros_like(value) if step == "reset" else value
            assert torch.equal(loaded[key][name], want), (key, name)


@pytest.mark.slow
def test_a_folder_holding_both_a_deepspeed_and_a_dcp_checkpoint_is_refused(z3_fp32, dcp_of, tmp_path, capsys):
    """A DCP save into a DeepSpeed checkpoint's folder (an FSDP2 run pointed at it) was read as the DCP folder."""
    both = tmp_path / "both"
    shutil.copytree(z3_fp32.path, both)
    for item in dcp_of("z3-fp32-dp3-adamw").iterdir():
        shutil.copy(item, both / item.name)
    assert cli(["inspect", str(both)]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "both a torch.distributed.checkpoint" in err, err
    assert cli(["inspect", str(both / "global_step3")]) == 0
