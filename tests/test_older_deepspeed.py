"""Checkpoints written by older DeepSpeed releases, moved into the current one at another DP size.

``tests/data/older`` holds real ZeRO-1/2/3 checkpoints of the harness's model written by DeepSpeed 0.14.5, 0.16.9
and 0.17.6 on CPU ranks, each with the record of what its live engine held (rebuilt by
``python -m tests.support.older_deepspeed --write``). Each is read bit-exact; written for DP 3 and loaded by
DeepSpeed 0.19.8, every state bit-exact after the load; and at the same DP, resumed by 0.19.8 bit-identically to
0.19.8's own load of the old files.

A MiCS checkpoint (``mics_shard_size``, gone from 0.19.8; 0.14 to 0.17 cannot resume one either) is written as
plain ZeRO-3 that 0.19.8 loads at any DP size.
"""

from __future__ import annotations

import json
import shutil

import pytest

import ucp
from tests.support.checks import assert_every_state_equals_record, assert_reader_holds_every_state, assert_same_training
from tests.support.files import resave
from tests.support.fixtures import Built, resume
from tests.support.older_deepspeed import CASES, DATA, VERSIONS
from ucp.cli import main as cli
from ucp.harness import LoadSpec, RunSpec
from ucp.harness.launch import RankFailure
from ucp.io.torchfile import load as load_torch_file
from ucp.sources import open_reader

PAIRS = [(version, case) for version in VERSIONS for case in CASES]
IDS = [f"ds{version}-{case}" for version, case in PAIRS]
MICS = "z3-mics2-bf16-w4"
#: the cases 0.19.8 loads itself (MiCS it cannot)
NATIVE = [(version, case) for version, case in PAIRS if case != MICS]


def _built(version: str, case: str) -> Built:
    """The old run; its spec as the current release runs it (MiCS gone: plain ZeRO-3 on as many ranks)."""
    folder = DATA / f"ds-{version}" / case
    return Built(folder / "ckpt", folder / "record.pt", RunSpec(**{**CASES[case], "mics": 0}))


@pytest.mark.parametrize("version, case", PAIRS, ids=IDS)
def test_an_older_release_is_read_bit_exact(version: str, case: str) -> None:
    built = _built(version, case)
    record = built.record
    with open_reader(built.path) as reader:
        assert reader.facts.info.ds_version == version
        assert_reader_holds_every_state(reader, record)


@pytest.mark.slow
@pytest.mark.parametrize("version, case", PAIRS, ids=IDS)
def test_written_for_dp3_the_current_release_loads_every_state_bit_exact(version: str, case: str, tmp_path) -> None:
    built = _built(version, case)
    ucp.reshard(built.path, tmp_path / "n", dp=3)
    after = resume(built, LoadSpec(str(tmp_path / "n")), dp=3, steps=0, name="after", work=tmp_path)
    assert_every_state_equals_record(after, built.record)


@pytest.mark.slow
@pytest.mark.parametrize("version, case", NATIVE, ids=[f"ds{v}-{c}" for v, c in NATIVE])
def test_at_the_same_dp_it_resumes_as_the_current_releases_own_load(version: str, case: str, tmp_path) -> None:
    built = _built(version, case)
    ucp.reshard(built.path, tmp_path / "n", dp=2)
    reference = resume(built, LoadSpec(str(built.path)), name="native", work=tmp_path)
    assert_same_training(reference, resume(built, LoadSpec(str(tmp_path / "n")), name="ucp", work=tmp_path))


def test_mics_is_read_from_its_first_shard_group_and_its_ranks_counted(tmp_path, capsys) -> None:
    ucp.to_universal(_built("0.17.6", MICS).path, tmp_path / "u")
    for source in (_built("0.17.6", MICS).path, tmp_path / "u"):  # the universal directory keeps it
        with open_reader(source) as reader:
            info = reader.facts.info
            assert (info.dp_world_size, info.replicas, info.batch_ranks) == (2, 2, 4)
            assert any("MiCS (mics_shard_size=2)" in w for w in reader.facts.warnings)
        assert cli(["inspect", str(source)]) == 0
        assert "dp=2 (MiCS: 4 ranks)" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("dp", [2, 4])
def test_mics_written_as_plain_zero3_loads_bit_exact_where_the_current_release_cannot_load_it(dp, tmp_path) -> None:
    built = _built("0.17.6", MICS)
    if dp == 4:  # the same ranks: 0.19.8 itself fails on the MiCS files (rank files it expects are missing)
        with pytest.raises(RankFailure):
            resume(built, LoadSpec(str(built.path)), steps=0, name="native", work=tmp_path)
    ucp.reshard(built.path, tmp_path / "n", dp=dp)
    written = load_torch_file(next((tmp_path / "n").glob("*/zero_pp_rank_0_mp_rank_00_model_states.pt")))
    assert written["ds_config"]["zero_optimization"] == {"stage": 3, "stage3_param_persistence_threshold": 0}
    after = resume(built, LoadSpec(str(tmp_path / "n")), dp=dp, steps=0, name="after", work=tmp_path)
    assert_every_state_equals_record(after, built.record)


@pytest.mark.slow
def test_mics_restored_live_trains_as_the_written_files(tmp_path) -> None:
    built = _built("0.17.6", MICS)
    ucp.reshard(built.path, tmp_path / "n", dp=3)
    native = resume(built, LoadSpec(str(tmp_path / "n")), dp=3, name="native", work=tmp_path)
    live = resume(built, LoadSpec(str(built.path), kind="ucp"), dp=3, name="live", work=tmp_path)
    assert_same_training(native, live)


@pytest.mark.parametrize(
    ("dp", "advice"), [(4, None), (2, "the global batch was 12 (3 per device x 1 accumulation x 4 processes)")]
)
def test_mics_batch_advice_counts_every_rank_of_the_run(dp, advice, tmp_path, capsys) -> None:
    """The run's 4 ranks each took a micro-batch of 3, though it saved 2 rank files."""
    out = tmp_path / "n"
    assert cli(["restore", str(_built("0.17.6", MICS).path), str(out), "--dp", str(dp), "--json"]) == 0
    notes = [n for n in json.loads(capsys.readouterr().out)["notes"] if "global batch" in n]
    assert notes == [] if advice is None else len(notes) == 1 and advice in notes[0], notes


@pytest.mark.parametrize("shard", [1, 4])
def test_a_mics_shard_size_its_files_contradict_is_refused_in_one_line(shard, tmp_path, capsys) -> None:
    folder = tmp_path / "ckpt"
    shutil.copytree(_built("0.17.6", MICS).path, folder)
    for path in folder.glob("*/zero_pp_rank_*_model_states.pt"):
        states = load_torch_file(path)
        states["ds_config"]["zero_optimization"]["mics_shard_size"] = shard
        resave(states, path)
    assert cli(["to-universal", str(folder), str(tmp_path / "u")]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"mics_shard_size={shard}" in err, err
    assert not (tmp_path / "u").exists()
