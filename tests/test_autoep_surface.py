"""AutoEP's user surface: ``ucp restore``/``reshard --ep`` route an AutoEP source to ``write_autoep`` (byte for byte
the Python call), sizes DeepSpeed refuses and targets that would write it dense-shaped are refused in one line,
``ucp inspect`` and ucp.json show the AutoEP layers, and DeepSpeed's own ``ds_to_universal`` output of an AutoEP
checkpoint reads exactly as the checkpoint itself.

The fixtures are the real AutoEP runs of tests/test_autoep.py (a tiny HF Mixtral, 2 layers x 4 experts, ep 2).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import ucp
from tests.support.autoep_runs import BuiltAutoEp, build_autoep
from tests.support.ds_convert import ds_to_universal
from tests.test_reliability import assert_one_line_error, run_cli
from ucp.cli import main
from ucp.ops.inspect import format_report, inspect_path
from ucp.sources import open_reader
from ucp.sources.autoep import AutoEpSource
from ucp.sources.ds_universal import DsUniversalSource
from ucp.targets.autoep import write_autoep

pytestmark = pytest.mark.slow

RUNS = {"zero1-w2": dict(world=2, ep=2, stage=1), "zero2-w4": dict(world=4, ep=2, stage=2, global_batch=8)}
MODULES = [f"lm.model.layers.{i}.mlp" for i in range(2)]


@pytest.fixture(scope="module")
def wide() -> BuiltAutoEp:
    return build_autoep(**RUNS["zero2-w4"])


@pytest.fixture(scope="module")
def universal(wide: BuiltAutoEp, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("autoep-surface") / "u"
    ucp.to_universal(wide.path, out)
    return out


@pytest.fixture(scope="module", params=sorted(RUNS))
def converted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[BuiltAutoEp, Path]:
    """A run and DeepSpeed's own ds_to_universal output of it."""
    run = build_autoep(**RUNS[request.param])
    out = tmp_path_factory.mktemp("ds-universal") / "ds"
    done = ds_to_universal(run.tag_dir, out)
    assert done.returncode == 0, done.stderr[-2000:]
    return run, out


def _files(root: Path) -> dict[str, bytes]:
    return {str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*")) if f.is_file()}


# -- restore and reshard ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "flags,world,ep,stage",
    [((), 4, 2, 2), (("--ep", "1"), 2, 1, 2), (("--ep", "4", "--stage", "1"), 4, 4, 1)],
    ids=["default-ep", "ep1-dp2", "ep4-zero1"],
)
def test_cli_restore_of_an_autoep_universal_writes_what_write_autoep_writes(
    universal, tmp_path, capsys, flags, world, ep, stage
):
    """Without --ep the source's autoep_size (2) and stage (2) are kept; the files are byte for byte the Python
    API's, whose resumes tests/test_autoep.py measures."""
    code = main(["restore", str(universal), str(tmp_path / "cli"), "--dp", str(world), *flags])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert f"wrote an AutoEP checkpoint for dp={world} at autoep_size={ep} (ZeRO-{stage}," in out.out
    write_autoep(universal, tmp_path / "api", dp=world, ep=ep, stage=stage)
    assert _files(tmp_path / "cli") == _files(tmp_path / "api")
    with open_reader(tmp_path / "cli") as back:
        assert (
            isinstance(back, AutoEpSource)
            and back.facts.layout.record["ep_size"] == ep
            and back.facts.layout.record["world"] == world
        )


def test_cli_reshard_of_deepspeeds_autoep_checkpoint_writes_what_write_autoep_writes(wide, tmp_path, capsys):
    code = main(["reshard", str(wide.path), str(tmp_path / "r"), "--dp", "4", "--ep", "4", "--json"])
    assert code == 0, capsys.readouterr().err
    result = json.loads(capsys.readouterr().out)
    assert (result["format"], result["dp"], result["ep"], result["stage"]) == ("deepspeed-autoep", 4, 4, 2)
    write_autoep(wide.path, tmp_path / "api", dp=4, ep=4, stage=2)
    assert _files(tmp_path / "r") == _files(tmp_path / "api")


@pytest.mark.parametrize(
    "verb,flags,needle",
    [
        ("restore", ("--dp", "3"), "the source's autoep_size=2 does not divide --dp 3: give the new run's --ep"),
        ("restore", ("--dp", "4", "--ep", "3"), "autoep_size=3 must divide the number of ranks (4)"),
        ("restore", ("--dp", "8", "--ep", "8"), "lm.model.layers.0.mlp has 4 experts, which autoep_size=8 does not"),
        ("reshard", ("--dp", "4", "--ep", "3"), "autoep_size=3 must divide the number of ranks (4)"),
        ("restore", ("--dp", "4", "--pp", "2", "--pp-parts", "0,2,4"), "mixture-of-experts run, which --pp cannot"),
        ("restore", ("--dp", "4", "--ep", "2", "--distributed"), "--ep writes a legacy MoE checkpoint at PP=1"),
    ],
    ids=[
        "ep-does-not-divide-dp",
        "ep-does-not-divide-world",
        "ep-does-not-divide-experts",
        "reshard",
        "pp",
        "distributed",
    ],  # fmt: skip
)
def test_cli_refuses_an_autoep_restore_it_cannot_write_in_one_line(
    wide, universal, tmp_path, capsys, verb, flags, needle
):
    source = wide.path if verb == "reshard" else universal
    code, err = run_cli(capsys, verb, str(source), str(tmp_path / "x"), *flags)
    assert_one_line_error(code, err, needle)
    assert code == 2 and not (tmp_path / "x").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no partial output beside OUT either


def test_a_migration_native_target_refuses_an_autoep_source_in_one_line(universal, tmp_path, capsys):
    """The native writer would put every expert on every rank under per-expert names the AutoEP run lacks."""
    config = tmp_path / "m.yaml"
    config.write_text(f"source: {json.dumps(str(universal))}\ntarget:\n  dp: 2\n  output: out\n")
    code, err = run_cli(capsys, "migrate", str(config))
    line = assert_one_line_error(code, err, "the source is a mixture-of-experts run (legacy MoE or AutoEP)")
    assert "ucp restore UNIVERSAL OUT --dp N --ep E" in line
    assert not (tmp_path / "out").exists()


# -- inspect and ucp.json ---------------------------------------------------------------------
def test_inspect_shows_the_autoep_layers_of_the_checkpoint_and_of_its_universal_directory(wide, universal, capsys):
    manifest = json.loads((universal / "ucp.json").read_text())
    with open_reader(wide.path) as reader:
        record = reader.facts.layout.record
    assert manifest["autoep"] == record  # ucp.json keeps what the source's reader records
    assert "moe" not in manifest
    for path in (wide.path, universal):
        report = inspect_path(path)
        assert report["autoep"] == record and "moe" not in report
        text = format_report(report)
        assert "  AutoEP: 2 layers on 4 ranks at autoep_size=2, experts by global index" in text
        for i, module in enumerate(MODULES):
            assert f"    layer {i}: {module}, 4 experts at ep_size=2" in text
        assert main(["inspect", str(path), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["autoep"]["layers"][1]["module"] == MODULES[1]


# -- DeepSpeed's ds_to_universal output -------------------------------------------------------
def test_deepspeeds_ds_to_universal_output_reads_exactly_as_the_autoep_checkpoint(converted):
    """Every parameter (each expert cut from DeepSpeed's whole fused tensor), group, state key and step, and
    the AutoEP record, as AutoEpSource reads the original checkpoint."""
    run, ds = converted
    with open_reader(run.path) as ours, open_reader(ds) as theirs:
        assert isinstance(ours, AutoEpSource) and isinstance(theirs, DsUniversalSource)
        a, b = ours.facts, theirs.facts
        assert [(p.name, p.shape, p.dtype, p.group, p.frozen) for p in a.params] == [
            (p.name, p.shape, p.dtype, p.group, p.frozen) for p in b.params
        ]
        assert [(g.params, g.step, g.raw, g.hyper) for g in a.groups] == [
            (g.params, g.step, g.raw, g.hyper) for g in b.groups
        ]
        assert (a.step, a.flavour, a.adam_w_mode) == (b.step, b.flavour, b.adam_w_mode) == (3, "torch-adam", True)
        assert theirs.facts.layout.record == ours.facts.layout.record
        experts = 0
        for meta in a.params:
            x, y = ours.read(meta.name), theirs.read(meta.name)
            assert torch.equal(x.fp32, y.fp32), meta.name
            assert sorted(x.optim) == sorted(y.optim) == ["exp_avg", "exp_avg_sq"], meta.name
            for key in x.optim:
                assert torch.equal(x.optim[key], y.optim[key]), (meta.name, key)
            assert x.step == y.step == 3, meta.name
            experts += ".experts.w" in meta.name
        assert experts == 2 * 3 * 4


def test_ucp_converts_deepspeeds_autoep_output_and_restores_it_as_from_the_checkpoint(converted, tmp_path, capsys):
    """ucp to-universal DSU U, then ucp restore U --ep: the same files as from ucp's own conversion."""
    run, ds = converted
    assert main(["to-universal", str(ds), str(tmp_path / "u-ds")]) == 0
    assert main(["to-universal", str(run.path), str(tmp_path / "u")]) == 0
    manifest = json.loads((tmp_path / "u-ds" / "ucp.json").read_text())
    assert manifest["autoep"]["ep_size"] == 2 and len(manifest["autoep"]["layers"]) == 2
    for name, source in (("from-ds", "u-ds"), ("from-ckpt", "u")):
        code = main(["restore", str(tmp_path / source), str(tmp_path / name), "--dp", "4", "--ep", "4"])
        assert code == 0, capsys.readouterr().err
    assert _files(tmp_path / "from-ds") == _files(tmp_path / "from-ckpt")


def test_a_fused_expert_file_of_another_shape_is_refused_in_one_line(converted, tmp_path, capsys):
    """A fused tensor that is not the whole [experts, ...] one (here rank 0's local part) is a real mix-up."""
    run, ds = converted
    broken = tmp_path / "ds"
    shutil.copytree(ds, broken)
    folder = broken / "zero" / f"{MODULES[0]}.experts.w1"
    whole = torch.load(folder / "fp32.pt", weights_only=True)
    torch.save({**whole, "param": whole["param"][:2].clone()}, folder / "fp32.pt")
    code, err = run_cli(capsys, "to-universal", str(broken), str(tmp_path / "u"))
    assert_one_line_error(code, err, "zero/lm.model.layers.0.mlp.experts.w1/fp32.pt holds a float32 tensor of 736")
    assert not (tmp_path / "u").exists()


def test_deepspeeds_output_of_a_zero3_autoep_checkpoint_is_refused_in_one_line_naming_what_to_do(tmp_path, capsys):
    z3 = build_autoep(world=2, ep=2, stage=3)
    done = ds_to_universal(z3.tag_dir, tmp_path / "ds")
    assert done.returncode == 0, done.stderr[-2000:]  # DeepSpeed 0.19.8 converts it
    for verb in ("to-universal", "restore"):
        code, err = run_cli(
            capsys, verb, str(tmp_path / "ds"), str(tmp_path / "out"), *(["--dp", "2"] * (verb == "restore"))
        )
        assert_one_line_error(code, err, "output of a ZeRO-3 AutoEP checkpoint", "convert the original checkpoint with")
        assert not (tmp_path / "out").exists()
