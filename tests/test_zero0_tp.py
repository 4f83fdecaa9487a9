"""DeepSpeed AutoTP without ZeRO (stage 0, one of the stages AutoTP trains with): every TP rank saves its own
``mp_rank_MM_model_states.pt`` holding its shards of the module and its optimizer's state over them.

Read: each rank's file as a stage-0 checkpoint of its shards, merged by the ``universal_checkpoint_info`` rules,
bit for bit against every rank's live engine. Written: one such file per TP rank; a stage-0 TP source written back
is DeepSpeed's own files tensor for tensor and resumes bit-identically; a ZeRO-2 TP source written at stage 0 trains
as DeepSpeed's native ZeRO-2 TP resume does (within 1e-5).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import ucp
from tests.support.checks import assert_same_tree
from tests.support.fixtures import Built, build, resume
from tests.support.tp_records import assert_training_close, expected_full, full_record, records
from ucp.harness import LoadSpec
from ucp.io.torchfile import load
from ucp.sources import open_reader
from ucp.universal.writer import write_universal

#: replicated under TP, the frozen projection's bias [10] is shaped like the trained LayerNorm vectors
FROZEN = ["proj.weight", "proj.bias"]


def _run(dtype: str) -> Built:
    return build(dp=1, tp=2, stage=0, dtype=dtype, optimizer="torch-adamw")


def _files(root: Path) -> list[dict[str, Any]]:
    tag = (root / "latest").read_text().strip()
    return [load(root / tag / f"mp_rank_{r:02d}_model_states.pt") for r in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_tp_stage0_checkpoint_merges_bit_exact_into_full_parameters(dtype):
    built = _run(dtype)
    recs = records(Path(built.record_path), 2)
    with open_reader(built.path, frozen=FROZEN) as reader:
        facts = reader.facts
        assert (facts.info.zero_stage, facts.info.mp_world_size) == (0, 2)
        assert [p.name for p in facts.params if p.frozen] == FROZEN
        for meta in facts.params:
            state = reader.read(meta.name)
            if meta.frozen:
                assert torch.equal(state.fp32, expected_full(meta.name, [r["module"][meta.name] for r in recs]).float())
                continue
            for key in ("params", "exp_avg", "exp_avg_sq"):
                want = expected_full(meta.name, [r[key][meta.name] for r in recs])
                got = state.fp32 if key == "params" else state.optim[key]
                assert torch.equal(got, want), (meta.name, key)
            assert state.step == int(recs[0]["state_steps"][0])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_tp_stage0_source_written_back_is_deepspeeds_own_files_and_resumes_bit_identically(dtype, tmp_path):
    built = _run(dtype)
    with open_reader(built.path, frozen=FROZEN) as reader:
        ucp.write_native(reader, tmp_path / "n", dp=1, stage=0, tp=2)
    for ours, theirs in zip(_files(tmp_path / "n"), _files(built.path)):
        assert ours.pop("sparse_tensor_module_names") == set()
        assert set(ours) == set(theirs)
        for key in ("module", "optimizer", "checkpoint_parallel_dimensions", "dp_world_size", "mp_world_size"):
            assert_same_tree(ours[key], theirs[key], key)
    # ucp writes universal_checkpoint_info as its own rules spell it (patterns in another order, and the shard
    # widths): read back, the same rules
    with open_reader(tmp_path / "n", frozen=FROZEN) as ours, open_reader(built.path, frozen=FROZEN) as theirs:
        assert ours.facts.tp_rules == theirs.facts.tp_rules
    native = records(_resumed(built, built.path, tmp_path, "native"), 2)
    again = records(_resumed(built, tmp_path / "n", tmp_path, "ucp"), 2)
    for ref, got in zip(native, again):
        assert ref["losses"] == got["losses"]
        for key in ("params", "exp_avg", "exp_avg_sq"):
            assert all(torch.equal(v, got[key][n]) for n, v in ref[key].items()), key


@pytest.mark.slow
def test_zero2_tp_source_written_without_zero_trains_like_its_native_resume(source, universals, tmp_path):
    name = "tp2-z2-fp32-dp1"
    built = source(name)
    ucp.write_native(universals(name), tmp_path / "n", dp=1, stage=0, tp=2)
    ours = full_record(records(_resumed(built, tmp_path / "n", tmp_path, "ucp", stage=0), 2))
    native = full_record(records(_resumed(built, built.path, tmp_path, "native"), 2))
    assert_training_close(native, ours, atol=1e-5)


def _resumed(built: Built, path: Path, work: Path, name: str, load_kind: str = "native", **overrides: Any) -> Path:
    resume(built, LoadSpec(str(path), kind=load_kind), name=name, work=work, **overrides)
    return work / f"{name}.pt"


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_live_restore_into_a_tp_stage0_engine_is_bit_identical_to_native_resume(dtype, tmp_path):
    built = _run(dtype)
    with open_reader(built.path, frozen=FROZEN) as reader:
        write_universal(reader, tmp_path / "u")
    native = records(_resumed(built, built.path, tmp_path, "native"), 2)
    live = records(_resumed(built, tmp_path / "u", tmp_path, "live", load_kind="ucp"), 2)
    for ref, got in zip(native, live):
        assert ref["losses"] == got["losses"]
        for key in ("params", "exp_avg", "exp_avg_sq"):
            assert all(torch.equal(v, got[key][n]) for n, v in ref[key].items()), key
