"""A bf16 pipeline run without ZeRO (PipelineEngine at stage 0: DeepSpeed's BF16_Optimizer, the Megatron-DeepSpeed
BLOOM-style setup): read bit for bit against every stage's live engine, and written back for a PipelineEngine that
resumes as DeepSpeed's own resume does.

Such a save writes no ``param_shapes``: the optim files' ``param_slice_mappings`` name each group's members in flat
order and the layer files give their shapes. The fixture's first tied embedding is a plain module (as
Megatron-DeepSpeed's EmbeddingPipe), so it has a layer file; with a forward_fn on both uses (the harness default)
no file holds its shape, and the save is refused in one line.
"""

from __future__ import annotations

from typing import Any

import pytest

import ucp
from tests.support.pipeline_runs import (
    BuiltPipe,
    assert_reader_matches_stages,
    build_pipe,
    merged_record,
    run_pipe,
    run_through,
)
from ucp.cli import main as cli
from ucp.errors import InputError
from ucp.harness import LoadSpec
from ucp.harness.launch import RankFailure
from ucp.sources import open_reader
from ucp.targets.pipeline import PipelineLayout, write_pipeline

pytestmark = pytest.mark.slow

#: the fixture model's partition at PP=2 (uniform over 6 layers) and its tied embedding's layers
LAYOUT = PipelineLayout(parts=(0, 3, 6), tied={"embed": (0, 5)})


@pytest.fixture(scope="module")
def pipe() -> BuiltPipe:
    return build_pipe(pp=2, dp=2, stage=0, dtype="bf16", embed_module=True)


def test_bf16_pipeline_without_zero_is_read_bit_exact_from_its_slice_mappings_and_layer_files(pipe, tmp_path):
    with open_reader(pipe.path) as reader:
        assert_reader_matches_stages(reader, pipe)
        assert any("BF16_Optimizer without ZeRO" in w for w in reader.facts.warnings)
    assert cli(["to-universal", str(pipe.path), str(tmp_path / "u")]) == 0
    with open_reader(tmp_path / "u") as reader:
        assert_reader_matches_stages(reader, pipe)


def test_a_tied_module_no_file_holds_is_refused_in_one_line(tmp_path, capsys):
    partial = build_pipe(pp=2, dp=2, stage=0, dtype="bf16")  # both tied uses are forward_fn partials
    with pytest.raises(InputError, match="no layer file holds 'tied_modules.embed.weight'.*its shape is unknown"):
        open_reader(partial.path)
    assert cli(["to-universal", str(partial.path), str(tmp_path / "u")]) != 0
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert not (tmp_path / "u").exists()


def test_deepspeed_cannot_resume_its_own_bf16_pipeline_save_without_zero(pipe, tmp_path):
    """DeepSpeed 0.19.8 hands the model-states file's ``optimizer`` (DP rank 0's BF16_Optimizer dict) to
    BF16_Optimizer.load_state_dict, which indexes it by DP rank (KeyError 0). When this fails, DeepSpeed fixed
    it: compare the resumes below with its native one too."""
    with pytest.raises(RankFailure, match="KeyError: 0"):
        run_pipe(pipe, name="native", work=tmp_path, load=LoadSpec(str(pipe.path)))


@pytest.fixture(scope="module")
def through(pipe: BuiltPipe) -> list[dict[str, Any]]:
    """The fixture's run continued without a save and load: the reference (DeepSpeed's own resume fails)."""
    return run_through(pipe)


def _assert_trains_like(reference: list[dict[str, Any]], ours: list[dict[str, Any]], steps: int, atol: float) -> None:
    """Losses within ``atol``, fp32 masters within a tenth of it (exact when 0), steps one ahead each."""
    expected, got = merged_record(reference), merged_record(ours)
    for a, b in zip(reference[0]["losses"][steps:], ours[0]["losses"], strict=True):
        assert abs(a - b) <= atol, (reference[0]["losses"], ours[0]["losses"])
    assert set(got["params"]) == set(expected["params"])
    for name, value in expected["params"].items():
        assert (value - got["params"][name]).abs().max().item() <= atol / 10, name
    assert got["steps"] == expected["steps"] == {float(2 * steps)}


@pytest.mark.parametrize("dp", [2, 1])
def test_live_restore_into_the_stage0_bf16_pipeline_engine_trains_as_the_uninterrupted_run(pipe, through, dp, tmp_path):
    """``ucp.restore`` fills BF16_Optimizer's partitions as at ZeRO-1, at the source's DP size (bit-identical) and
    at DP 1 (bf16 gradient reduction over another DP size: losses 1.0e-3, masters 1.9e-4 apart, measured)."""
    ucp.to_universal(pipe.path, tmp_path / "u")
    ours = run_pipe(pipe, name=f"live{dp}", work=tmp_path, load=LoadSpec(str(tmp_path / "u"), kind="ucp"), dp=dp)
    _assert_trains_like(through, ours, pipe.spec.steps, 0.0 if dp == 2 else 1e-2)


def test_written_as_a_zero1_pipeline_it_resumes_close_to_the_uninterrupted_run(pipe, through, tmp_path):
    """Leaving stage 0: per-stage ZeRO-1 files (DeepSpeedZeroOptimizer in bf16) for a PipelineEngine at ZeRO-1,
    which reduces bf16 gradients otherwise than BF16_Optimizer (losses 2.2e-3, masters 1.7e-4 apart, measured)."""
    ucp.to_universal(pipe.path, tmp_path / "u")
    write_pipeline(tmp_path / "u", tmp_path / "p", LAYOUT, dp=2, stage=1)
    ours = run_pipe(pipe, name="z1", work=tmp_path, load=LoadSpec(str(tmp_path / "p")), stage=1)
    _assert_trains_like(through, ours, pipe.spec.steps, 1e-2)


def test_an_fp32_pipeline_save_without_zero_is_refused_in_one_line_naming_what_it_is(tmp_path, capsys):
    """In fp32 each stage's optimizer state_dict sits in its model-states file and nothing names the layers a stage
    holds: not read yet, and said so (it was called 'not a ZeRO checkpoint')."""
    fp32 = build_pipe(pp=2, dp=2, stage=0, dtype="fp32")
    assert not list(fp32.path.glob("*/*optim_states.pt"))
    with pytest.raises(InputError, match="a pipeline save without ZeRO and without optim files.*not read it yet"):
        open_reader(fp32.path)
    assert cli(["to-universal", str(fp32.path), str(tmp_path / "u")]) != 0
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
