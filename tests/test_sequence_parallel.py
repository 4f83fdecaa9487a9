"""Ulysses sequence parallelism (DeepSpeed's ``parallel_state_sp`` groups, as ALST and Accelerate's
``sp_backend="deepspeed"`` hand them to ``deepspeed.initialize``) on real ZeRO-2 and ZeRO-3 runs.

ZeRO then partitions over the sequence-data-parallel group, every rank: a run of 2 data-parallel x 2
sequence-parallel ranks writes 4 rank files, and its model states record no ``dp_world_size`` (None). ucp reads it
as DP 4 and writes for the ZeRO group of the new run (``--dp`` = data-parallel x sequence-parallel ranks).
"""

from __future__ import annotations

import pytest

import ucp
from tests.support.checks import assert_every_state_equals_record, assert_reader_holds_every_state, assert_same_training
from tests.support.fixtures import build, resume, universals_of
from ucp.harness import LoadSpec
from ucp.universal import open_universal

SOURCES = {"z2": dict(dp=4, sp=2, stage=2, dtype="bf16"), "z3": dict(dp=4, sp=2, stage=3, dtype="bf16")}


@pytest.fixture(scope="module")
def universal(tmp_path_factory):
    return universals_of(SOURCES, tmp_path_factory.mktemp("universal"))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SOURCES))
def test_a_sequence_parallel_run_reaches_the_universal_directory_bit_exact(universal, name):
    record = build(**SOURCES[name]).record
    assert record["sequence_parallel"] == 2, "the run is not sequence parallel: the test would prove nothing"
    with open_universal(universal(name)) as reader:
        assert reader.facts.info.dp_world_size == 4
        assert_reader_holds_every_state(reader, record)


@pytest.mark.slow
@pytest.mark.parametrize("dp, sp", [(6, 3), (2, 1)], ids=["dp6-sp3", "dp2-no-sp"])
@pytest.mark.parametrize("kind", ["ucp", "native"])
@pytest.mark.parametrize("name", list(SOURCES))
def test_restore_at_another_sequence_parallel_size_loads_every_state_bit_exact(universal, name, kind, dp, sp, tmp_path):
    built = build(**SOURCES[name])
    path = universal(name)
    if kind == "native":
        path = tmp_path / "n"
        ucp.write_native(universal(name), path, dp=dp, stage=built.spec.stage)
    after = resume(built, LoadSpec(str(path), kind=kind), dp=dp, sp=sp, steps=0, name="after", work=tmp_path)
    assert after["sequence_parallel"] == sp
    assert_every_state_equals_record(after, built.record)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SOURCES))
def test_same_layout_restore_resumes_bit_identically_to_deepspeeds_own_resume(universal, name, tmp_path):
    built = build(**SOURCES[name])
    ucp.write_native(universal(name), tmp_path / "n", dp=4, stage=built.spec.stage)
    reference = resume(built, LoadSpec(str(built.path)), name="native", work=tmp_path)
    assert_same_training(reference, resume(built, LoadSpec(str(tmp_path / "n")), name="ucp", work=tmp_path))
    live = resume(built, LoadSpec(str(universal(name)), kind="ucp"), name="live", work=tmp_path)
    assert_same_training(reference, live)
