"""``ucp diff`` on real DeepSpeed checkpoints: equal across formats and DP sizes, and every kind of difference
named (a parameter's reset moments, steps, group settings, names on one side only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ucp
from ucp.cli import main as cli
from ucp.ops.diff import diff


@pytest.fixture(scope="module")
def restored(z3_bf16_dp2, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoint written anew at DP=3 (straight from the DeepSpeed files)."""
    out = tmp_path_factory.mktemp("diff") / "dp3"
    ucp.write_native(z3_bf16_dp2.path, out, dp=3)
    return out


@pytest.mark.slow
def test_a_checkpoint_equals_its_universal_directory_and_its_restore_at_another_dp(
    z3_bf16_dp2, universals, restored, capsys
):
    assert cli(["diff", str(z3_bf16_dp2.path), str(universals("z3-bf16-dp2-adamw"))]) == 0
    assert capsys.readouterr().out.strip().endswith("bit for bit")
    assert cli(["diff", str(universals("z3-bf16-dp2-adamw")), str(restored), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["equal"] and report["params_compared"] == len(z3_bf16_dp2.record["module"])


@pytest.fixture(scope="module")
def norm_reset(z3_bf16_dp2, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoint's universal directory with norm.weight's moments reset by a migration."""
    work = tmp_path_factory.mktemp("reset")
    config = work / "reset.yaml"
    config.write_text(
        f"source: {z3_bf16_dp2.path}\nuniversal: {work / 'u'}\n"
        "transforms:\n  - reset_optimizer:\n      params: ['^norm[.]weight$']\n      step: keep\n"
    )
    assert cli(["--quiet", "migrate", str(config)]) == 0
    return work / "u"


@pytest.mark.slow
def test_one_parameter_reset_by_a_migration_is_the_only_difference(z3_bf16_dp2, norm_reset, capsys):
    report = diff(z3_bf16_dp2.path, norm_reset)
    assert not report.equal
    assert [p.name for p in report.differing] == ["norm.weight"]
    changed = {t.key for t in report.differing[0].tensors if not t.within(0.0)}
    assert changed == {"exp_avg", "exp_avg_sq"}, report.differing[0]
    assert cli(["diff", str(z3_bf16_dp2.path), str(norm_reset)]) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("norm.weight: exp_avg max abs") and "differ" in out.splitlines()[-1]


@pytest.mark.slow
def test_steps_settings_and_names_that_differ_are_each_named(z3_bf16_dp2, z3_fp32_dp3, source, tmp_path):
    stepped = tmp_path / "step7"
    ucp.write_native(z3_bf16_dp2.path, stepped, dp=2, step=7)
    report = diff(z3_bf16_dp2.path, stepped)
    assert {p.steps for p in report.differing} == {(3, 7)}  # every trained parameter, no frozen one
    assert {p.name for p in report.differing} == set(z3_bf16_dp2.record["params"])

    other = diff(z3_bf16_dp2.path, z3_fp32_dp3.path, atol=1e9)  # another run of the model, another schedule
    assert not other.equal and not other.differing
    assert any("lr" in line for line in other.groups) and any("weight_decay" in line for line in other.groups)

    glu = diff(z3_bf16_dp2.path, source("tp2-z1-bf16-dp2-glu").path)  # another model, saved with TP=2
    assert "blocks.0.0.weight" in glu.only_a and "blocks.0.up.weight" in glu.only_b, (glu.only_a, glu.only_b)
    assert glu.counters["global_samples"] == (36, 72)  # engine counters too


@pytest.mark.slow
def test_bad_input_is_one_line_with_exit_2(z3_bf16_dp2, tmp_path, capsys):
    assert cli(["diff", str(z3_bf16_dp2.path), str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ucp: error:") and len(err.splitlines()) == 1


# -- --plot -----------------------------------------------------------------------------------
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_plot_draws_every_parameter_and_json_still_parses(z3_bf16_dp2, norm_reset, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    chart = tmp_path / "charts" / "diff.png"  # its folder is made
    assert cli(["diff", str(z3_bf16_dp2.path), str(norm_reset), "--plot", str(chart), "--json"]) == 1
    out = capsys.readouterr().out
    report = json.loads(out)  # stdout holds the JSON object and nothing else
    assert report["plot"] == str(chart) and [p["name"] for p in report["differing"]] == ["norm.weight"]
    assert chart.read_bytes()[:8] == PNG_MAGIC
    height, width, _ = imread(chart).shape
    assert width >= 800 and height >= 600
    assert sorted(p.name for p in chart.parent.iterdir()) == ["diff.png"]  # nothing staged left beside it

    assert cli(["diff", str(z3_bf16_dp2.path), str(norm_reset), "--plot", str(chart)]) == 2  # never over a file
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    pdf = tmp_path / "diff.pdf"
    assert cli(["--quiet", "diff", str(z3_bf16_dp2.path), str(norm_reset), "--plot", str(pdf)]) == 1
    assert pdf.read_bytes()[:5] == b"%PDF-"


@pytest.mark.parametrize(
    "name, message",
    [
        ("diff.txt", "--plot {out}: the chart is written as .png, .svg, .pdf; name a file ending in one"),
        ("A/diff.png", "overlaps the A"),
    ],
)
@pytest.mark.slow
def test_plot_refuses_a_file_it_cannot_write_before_reading_anything(z3_bf16_dp2, tmp_path, capsys, name, message):
    a = tmp_path / "A"
    a.mkdir()
    out = tmp_path / name
    assert cli(["diff", str(a), str(z3_bf16_dp2.path), "--plot", str(out)]) == 2  # A is no checkpoint: not read
    err = capsys.readouterr().err.strip()
    assert message.format(out=out) in err and len(err.splitlines()) == 1, err
    assert not out.exists()


def test_plot_without_matplotlib_is_one_line_and_exit_2_before_any_work(tmp_path):
    wrapper = tmp_path / "no_matplotlib.py"  # as if matplotlib were not installed: its import fails
    wrapper.write_text("import sys\nsys.modules['matplotlib'] = None\nfrom ucp.cli import main\nsys.exit(main())\n")
    chart = tmp_path / "diff.png"
    missing = str(tmp_path / "missing")  # the checkpoints are never opened: the check comes first
    done = subprocess.run(
        [sys.executable, str(wrapper), "diff", missing, missing, "--plot", str(chart)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr.strip() == (
        "ucp: error: --plot needs matplotlib: pip install matplotlib (or pip install 'ucp-checkpoint[plot]')"
    ), done.stderr
    assert not chart.exists()


def test_states_are_compared_a_chunk_at_a_time_with_the_whole_tensors_figures(tmp_path, monkeypatch) -> None:
    """diff folds each state's figures over bounded chunks of its pieces (a 4 GB state is never whole in memory):
    max abs, max rel and a NaN in another place come out as the one-chunk comparison gives them, wherever in
    which chunk they lie, and from file spans and tensor slices alike."""
    from ucp.model.pieces import PathSpan, Pieces, file_stamp
    from ucp.ops import diff as diff_mod

    a = torch.randn(3, 1001, generator=torch.Generator().manual_seed(0))
    b = a.clone()
    b.view(-1)[1500] += 0.25  # the largest absolute difference, in the second chunk
    b.view(-1)[2999] = a.view(-1)[2999] * 1.5  # another relative difference, in the last chunk
    b.view(-1)[10] = float("nan")  # a NaN only B has, in the first chunk
    path = tmp_path / "a.bin"
    path.write_bytes(b"pad" + a.numpy().tobytes())
    spans = Pieces((PathSpan(str(path), 3, 4 * a.numel(), file_stamp(path.stat())),), tuple(a.shape), torch.float32)
    halves = Pieces((b.reshape(-1)[:1700].clone(), b.reshape(-1)[1700:].clone()), tuple(b.shape), torch.float32)
    whole = diff_mod._tensor_diff("exp_avg", Pieces.of(a), Pieces.of(b))  # one chunk: the whole tensors
    monkeypatch.setattr(diff_mod, "_CHUNK", 1000)
    chunked = diff_mod._tensor_diff("exp_avg", spans, halves)
    assert chunked == whole and whole.nan_mismatch
    keep = ~torch.isnan(b.view(-1))  # the figures, by hand: over the elements both sides hold numbers
    x, y = a.view(-1)[keep].double(), b.view(-1)[keep].double()
    assert whole.max_abs == pytest.approx(float((x - y).abs().max()), rel=1e-6)
    assert whole.max_rel == pytest.approx(float(((x - y).abs() / torch.maximum(x.abs(), y.abs())).max()), rel=1e-6)
    assert whole.max_rel == pytest.approx(1 / 3, rel=1e-5)  # b = 1.5 a at flat 2999, in the last chunk
    same = diff_mod._tensor_diff("fp32", spans, Pieces.of(a.clone()))
    assert same == diff_mod.TensorDiff("fp32", 0.0, 0.0, False)


@pytest.mark.slow
def test_diff_never_reads_a_parameter_whole(z3_bf16_dp2, universals, norm_reset, monkeypatch) -> None:
    """Both sides of a real checkpoint are compared from their pieces: whole reads are banned (but for the frozen
    parameters, which a ZeRO-3 source keeps in bf16 and hands out cast) and the verdicts (equal to its universal
    directory; only norm.weight's reset moments differ) stand."""
    import threading

    from ucp.model.pieces import Pieces
    from ucp.sources.zero3 import Zero3Source
    from ucp.universal.reader import UniversalReader

    frozen, join, gather = threading.local(), Pieces.join, Zero3Source._frozen_tensor
    joined: list[int] = []

    def banned(*args, **kwargs):
        raise AssertionError("a whole read during diff")

    def frozen_gather(self, name):
        frozen.on = True
        try:
            return gather(self, name)
        finally:
            frozen.on = False

    def frozen_join(self, dtype=None):
        assert getattr(frozen, "on", False), "a whole read during diff"
        joined.append(self.numel)
        return join(self, dtype)

    monkeypatch.setattr(Zero3Source, "read", banned)
    monkeypatch.setattr(UniversalReader, "read", banned)
    monkeypatch.setattr(Zero3Source, "_frozen_tensor", frozen_gather)
    monkeypatch.setattr(Pieces, "join", frozen_join)
    assert diff(z3_bf16_dp2.path, universals("z3-bf16-dp2-adamw")).equal
    report = diff(z3_bf16_dp2.path, norm_reset)
    assert [p.name for p in report.differing] == ["norm.weight"]
    assert {t.key for t in report.differing[0].tensors if not t.within(0.0)} == {"exp_avg", "exp_avg_sq"}
    assert joined, "the checkpoint has frozen parameters: the ban above was exercised"
