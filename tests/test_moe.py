"""Expert parallelism: a legacy DeepSpeed MoE run (4 experts at ep_size 2 on 4 gloo ranks, ZeRO-2, fp32 AdamW
with MoE param groups) merged into whole parameters, every expert under its global index, bit for bit against
every rank's live engine, and resumed at ep_size 2 (bit-identical to DeepSpeed's own resume), 1 and 4.

The fixture is a real run of ucp.harness.moe: an embedding, one ``deepspeed.moe.layer.MoE`` layer (top-1
gate, MLP experts, no dropped tokens), a LayerNorm and a head; each rank records what its engine holds.
DeepSpeed runs here besides the fixture: DeepSpeed's native resume and three resumes from ucp.
"""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import ucp
from tests.support.ds_convert import ds_to_universal
from tests.support.moe_runs import BuiltMoe, build_moe, run_moe_from
from tests.test_reliability import assert_one_line_error, run_cli
from ucp.cli import main
from ucp.deepspeed.moe import expert_order
from ucp.errors import ConfigError, InputError
from ucp.harness import LoadSpec
from ucp.ops.inspect import format_report, inspect_path
from ucp.sources import open_reader
from ucp.targets.moe import write_moe

pytestmark = pytest.mark.slow

EXPERT = "moe.deepspeed_moe.experts.deepspeed_experts.{}.fc1.weight"


@pytest.fixture(scope="module")
def moe() -> BuiltMoe:
    return build_moe(world=4, ep=2, experts=4, stage=2, dtype="fp32")


@pytest.fixture(scope="module")
def universal(moe: BuiltMoe, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("moe") / "u"
    ucp.to_universal(moe.path, out)
    return out


def test_deepspeed_writes_one_file_per_expert_and_rank_zeros_local_shapes(moe):
    names = sorted(p.name for p in moe.tag_dir.iterdir())
    assert [n for n in names if "expert" in n] == [f"layer_0_expert_{e}_mp_rank_00_model_states.pt" for e in range(4)]
    assert [n for n in names if "optim" in n] == [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(4)]
    assert set(moe.record["params"]) >= {EXPERT.format(e) for e in range(4)}


def assert_reader_matches_ranks(reader, moe: BuiltMoe) -> None:
    """Every parameter, state tensor and step the reader gives is what the ranks' engines held."""
    expected = moe.record
    assert expected["steps"] == {float(moe.spec.steps)}
    facts = reader.facts
    assert [p.name for p in facts.params if not p.frozen] == [n for g in facts.groups for n in g.params]
    assert {p.name for p in facts.params} == set(expected["params"])
    assert facts.step == moe.spec.steps and facts.info.dp_world_size == moe.spec.world
    for meta in facts.params:
        state = reader.read(meta.name)
        assert torch.equal(state.fp32, expected["params"][meta.name]), meta.name
        assert list(state.optim) == ["exp_avg", "exp_avg_sq"], meta.name
        for key, value in state.optim.items():
            assert torch.equal(value, expected["state"][key][meta.name]), (meta.name, key)
        assert state.step == moe.spec.steps, meta.name


def test_to_universal_is_bit_exact_against_every_ranks_live_engine(moe, universal):
    for path in (moe.path, universal):
        with open_reader(path) as reader:
            assert_reader_matches_ranks(reader, moe)


def test_expert_groups_list_every_expert_by_global_index_with_their_settings(moe, universal):
    """Groups 2 and 3 are the MoE groups split_params_into_different_moe_groups_for_optimizer made; each rank
    held its own experts there (ranks 0 and 2: experts 0-1, ranks 1 and 3: experts 2-3)."""
    live = moe.record
    with open_reader(universal) as reader:
        groups = reader.facts.groups
        assert [g.raw.get("moe", False) for g in groups] == [False, False, True, True]
        assert [g.raw["name"] for g in groups] == ["decay", "no_decay", "ep_size_2", "ep_size_2"]
        for g in (2, 3):
            by_rank = [rank[g] for rank in live["group_params"]]
            assert by_rank[0] == by_rank[2] and by_rank[1] == by_rank[3]
            assert groups[g].params == expert_order(by_rank[0] + by_rank[1])
        assert [(g.hyper.lr, g.hyper.weight_decay) for g in groups] == [
            (h["lr"], h["weight_decay"]) for h in live["group_hparams"]
        ]
        assert reader.facts.layout.record["layers"] == [{"module": "moe", "layer": 0, "experts": 4, "ep_size": 2}]


@pytest.fixture(scope="module")
def native(moe: BuiltMoe, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """DeepSpeed's own resume of the fixture at 4 ranks, ep_size 2."""
    return run_moe_from(moe, name="native", work=tmp_path_factory.mktemp("native"), load=LoadSpec(str(moe.path)))


def assert_resumed_alike(ours: dict[str, Any], theirs: dict[str, Any], atol: float) -> None:
    for a, b in zip(theirs["losses"], ours["losses"], strict=True):
        assert abs(a - b) <= atol, (theirs["losses"], ours["losses"])
    assert set(ours["params"]) == set(theirs["params"])
    for name, value in theirs["params"].items():
        assert torch.allclose(ours["params"][name], value, rtol=0, atol=atol), name
        for key, per_param in theirs["state"].items():
            assert torch.allclose(ours["state"][key][name], per_param[name], rtol=0, atol=atol), (name, key)
    assert ours["steps"] == theirs["steps"]
    assert ours["counters"] == theirs["counters"]
    assert ours["lr_scheduler"]["last_epoch"] == theirs["lr_scheduler"]["last_epoch"]


def test_restore_at_the_same_sizes_resumes_bit_identically_to_deepspeed(moe, universal, native, tmp_path):
    write_moe(universal, tmp_path / "n", dp=4, ep=2, stage=2)
    ours = run_moe_from(moe, name="same", work=tmp_path, load=LoadSpec(str(tmp_path / "n")))
    assert_resumed_alike(ours, native, atol=0.0)


@pytest.mark.parametrize("world,ep", [(2, 1), (4, 4)], ids=["ep1-dp2", "ep4-dp4"])
def test_restore_at_another_ep_size_resumes_like_deepspeeds_native_resume(moe, universal, native, tmp_path, world, ep):
    """ep_size 1 at 2 ranks (every rank holds all 4 experts, partitioned over 2) and ep_size 4 at 4 ranks
    (one expert per rank, unpartitioned); read back by ucp, the files hold the universal state bit for bit."""
    write_moe(universal, tmp_path / "n", dp=world, ep=ep, stage=2)
    with open_reader(tmp_path / "n") as ours, open_reader(universal) as theirs:
        assert ours.facts.layout.record["layers"] == [{"module": "moe", "layer": 0, "experts": 4, "ep_size": ep}]
        assert [p.name for p in ours.facts.params] == [p.name for p in theirs.facts.params]
        for meta in theirs.facts.params:
            a, b = ours.read(meta.name), theirs.read(meta.name)
            assert torch.equal(a.fp32, b.fp32) and a.step == b.step, meta.name
            assert all(torch.equal(a.optim[k], b.optim[k]) for k in b.optim), meta.name
    resumed = run_moe_from(
        moe, name=f"w{world}ep{ep}", work=tmp_path, load=LoadSpec(str(tmp_path / "n")), world=world, ep=ep
    )
    assert_resumed_alike(resumed, native, atol=1e-5)


def test_sizes_deepspeed_refuses_are_refused_in_one_line(universal, tmp_path):
    with pytest.raises(ConfigError, match=r"ep_size=3 must divide the number of ranks \(4\)"):
        write_moe(universal, tmp_path / "a", dp=4, ep=3, stage=2)
    with pytest.raises(ConfigError, match=r"moe has 4 experts, which ep_size=8 does not divide"):
        write_moe(universal, tmp_path / "b", dp=8, ep=8, stage=2)
    with pytest.raises(ConfigError, match="ZeRO-1 or ZeRO-2"):
        write_moe(universal, tmp_path / "c", dp=4, ep=2, stage=3)
    assert not any(tmp_path.iterdir())


def _copy(moe: BuiltMoe, tmp_path: Path) -> Path:
    copy = tmp_path / "ckpt"
    shutil.copytree(moe.path, copy)
    return copy / moe.tag_dir.name


def test_a_missing_expert_file_is_refused_in_one_line(moe, tmp_path):
    tag = _copy(moe, tmp_path)
    (tag / "layer_0_expert_1_mp_rank_00_model_states.pt").unlink()
    with pytest.raises(InputError, match="the expert files of layer 0 lack expert 1"):
        open_reader(tag.parent)


def test_pre_0_6_expert_files_are_refused_in_one_line(moe, tmp_path):
    tag = _copy(moe, tmp_path)
    (tag / "layer_0_expert_1_mp_rank_00_model_states.pt").rename(tag / "expert_1_mp_rank_00_model_states.pt")
    with pytest.raises(InputError, match="expert files of DeepSpeed before 0.6"):
        open_reader(tag.parent)


def test_a_dense_checkpoint_is_not_a_moe_source(universal, tmp_path):
    from tests.support.pipeline_runs import build_pipe

    with pytest.raises(ConfigError, match="records no MoE layers"):
        write_moe(build_pipe(pp=2, dp=2, stage=1, dtype="fp32").path, tmp_path / "x", dp=2, ep=1, stage=1)


def test_inspect_shows_the_moe_layers(moe):
    report = inspect_path(moe.path)
    assert report["moe"] == {"world": 4, "layers": [{"module": "moe", "layer": 0, "experts": 4, "ep_size": 2}]}
    text = format_report(report)
    assert "mixture of experts: 1 MoE layers on 4 ranks" in text
    assert "layer 0: moe, 4 experts at ep_size=2" in text


def test_deepspeeds_ds_to_universal_cannot_convert_a_legacy_moe_run(moe, tmp_path):
    """DeepSpeed 0.19.8's converter joins every rank's fragments of a local expert name, which are different
    experts' (docs/format.md section 8). When this fails, DeepSpeed changed: update the comparison there."""
    done = ds_to_universal(moe.tag_dir, tmp_path / "dsu")
    assert done.returncode != 0
    found = re.search(r"RuntimeError: shape '\[([\d, ]+)\]' is invalid for input of size (\d+)", done.stderr)
    assert found, done.stderr[-2000:]  # which parameter fails first depends on the merge workers' order
    shape, size = [int(d) for d in found.group(1).split(",")], int(found.group(2))
    assert size == 2 * math.prod(shape)  # two experts' halves joined (ranks r and r+2 hold different experts)


def _files(root: Path) -> dict[str, bytes]:
    return {str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*")) if f.is_file()}


@pytest.mark.parametrize(
    "flags,world,ep",
    [((), 4, 2), (("--ep", "1"), 2, 1), (("--ep", "4", "--stage", "1"), 4, 4)],
    ids=["default-ep", "ep1-dp2", "ep4-zero1"],
)
def test_cli_restore_of_a_moe_source_writes_what_write_moe_writes(universal, tmp_path, capsys, flags, world, ep):
    """Without --ep the source's ep_size (2) and stage (2) are kept; the files are byte for byte the Python
    API's, whose resumes the tests above measure."""
    code = main(["restore", str(universal), str(tmp_path / "cli"), "--dp", str(world), *flags])
    assert code == 0, capsys.readouterr().err
    assert f"wrote a MoE checkpoint for dp={world} at ep_size={ep}" in capsys.readouterr().out
    stage = 1 if "--stage" in flags else 2
    write_moe(universal, tmp_path / "api", dp=world, ep=ep, stage=stage)
    assert _files(tmp_path / "cli") == _files(tmp_path / "api")


def test_cli_reshard_of_deepspeeds_moe_checkpoint_writes_what_write_moe_writes(moe, tmp_path, capsys):
    assert main(["reshard", str(moe.path), str(tmp_path / "r"), "--dp", "4", "--ep", "4"]) == 0
    write_moe(moe.path, tmp_path / "api", dp=4, ep=4, stage=2)
    assert _files(tmp_path / "r") == _files(tmp_path / "api")


@pytest.mark.parametrize(
    "flags,needle",
    [
        (("--dp", "3"), "the source's ep_size=2 does not divide --dp 3: give the new run's --ep"),
        (("--dp", "4", "--ep", "3"), "ep_size=3 must divide the number of ranks (4)"),
        (("--dp", "4", "--stage", "3"), "a MoE target is ZeRO-1 or ZeRO-2"),
        (("--dp", "4", "--pp", "2", "--pp-parts", "0,2,4"), "mixture-of-experts run, which --pp cannot write"),
        (("--dp", "4", "--ep", "2", "--format", "dcp"), "--dp, --ep describe a DeepSpeed output"),
        (("--dp", "4", "--ep", "2", "--distributed"), "--ep writes a legacy MoE checkpoint at PP=1 in one process"),
    ],
    ids=["ep-does-not-divide-dp", "bad-ep", "zero3", "pp", "dcp", "distributed"],
)
def test_cli_refuses_a_moe_restore_it_cannot_write_in_one_line(universal, tmp_path, capsys, flags, needle):
    code, err = run_cli(capsys, "restore", str(universal), str(tmp_path / "x"), *flags)
    assert_one_line_error(code, err, needle)
    assert not (tmp_path / "x").exists()


def test_cli_ep_on_a_dense_checkpoint_is_refused_in_one_line(tmp_path, capsys):
    from tests.support.pipeline_runs import build_pipe

    dense = build_pipe(pp=2, dp=2, stage=1, dtype="fp32").path
    code, err = run_cli(capsys, "restore", str(dense), str(tmp_path / "x"), "--dp", "2", "--ep", "1")
    assert_one_line_error(code, err, "records no MoE layers")


def test_a_moe_save_without_zero_is_refused_in_one_line_naming_what_it_is(tmp_path, capsys):
    """DeepSpeed MoE at stage 0 saves each expert-parallel rank's optimizer state_dict in its own
    expp_rank_*_optim_states.pt: not read yet, and said so (it was called 'not a ZeRO checkpoint')."""
    run = build_moe(world=4, ep=2, stage=0)
    assert sorted(p.name for p in run.path.glob("*/expp_rank_*")) == [
        f"expp_rank_{e}_mp_rank_00_optim_states.pt" for e in range(2)
    ]
    code, err = run_cli(capsys, "to-universal", str(run.path), str(tmp_path / "u"))
    assert_one_line_error(code, err, "mixture-of-experts save without ZeRO", "does not read it yet")
    assert not (tmp_path / "u").exists()
