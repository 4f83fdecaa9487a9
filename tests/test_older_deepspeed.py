"""Checkpoints written by older DeepSpeed releases, moved into the current one at another DP size.

``tests/data/older`` holds real ZeRO-1/2/3 checkpoints of the harness's model written by DeepSpeed 0.14.5, 0.16.9
and 0.17.6 on CPU ranks, each with the record of what its live engine held (rebuilt by
``python -m tests.support.older_deepspeed --write``). Each is read bit-exact; written for DP 3 and loaded by
DeepSpeed 0.19.8, every state bit-exact after the load; and at the same DP, resumed by 0.19.8 bit-identically to
0.19.8's own load of the old files.
"""

from __future__ import annotations

import pytest

import ucp
from tests.support.checks import assert_every_state_equals_record, assert_reader_holds_every_state, assert_same_training
from tests.support.fixtures import Built, resume
from tests.support.older_deepspeed import CASES, DATA, VERSIONS
from ucp.harness import LoadSpec, RunSpec
from ucp.sources import open_reader

PAIRS = [(version, case) for version in VERSIONS for case in CASES]
IDS = [f"ds{version}-{case}" for version, case in PAIRS]


def _built(version: str, case: str) -> Built:
    folder = DATA / f"ds-{version}" / case
    return Built(folder / "ckpt", folder / "record.pt", RunSpec(**CASES[case]))


@pytest.mark.parametrize("version, case", PAIRS, ids=IDS)
def test_an_older_release_is_read_bit_exact(version: str, case: str) -> None:
    built = _built(version, case)
    record = built.record
    with open_reader(built.path) as reader:
        assert reader.facts.info.ds_version == version
        assert_reader_holds_every_state(reader, record)


@pytest.mark.parametrize("version, case", PAIRS, ids=IDS)
def test_written_for_dp3_the_current_release_loads_every_state_bit_exact(version: str, case: str, tmp_path) -> None:
    built = _built(version, case)
    ucp.reshard(built.path, tmp_path / "n", dp=3)
    after = resume(built, LoadSpec(str(tmp_path / "n")), dp=3, steps=0, name="after", work=tmp_path)
    assert_every_state_equals_record(after, built.record)


@pytest.mark.parametrize("version, case", PAIRS, ids=IDS)
def test_at_the_same_dp_it_resumes_as_the_current_releases_own_load(version: str, case: str, tmp_path) -> None:
    built = _built(version, case)
    ucp.reshard(built.path, tmp_path / "n", dp=2)
    reference = resume(built, LoadSpec(str(built.path)), name="native", work=tmp_path)
    assert_same_training(reference, resume(built, LoadSpec(str(tmp_path / "n")), name="ucp", work=tmp_path))
