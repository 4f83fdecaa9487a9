"""The test launcher (ucp.harness.launch): a failed rank ends the run at once, naming that rank."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ucp.harness.launch import RankFailure, free_port, launch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_failed_rank_stops_the_others_instead_of_leaving_them_waiting(tmp_path):
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 0 exited with 3"):
        launch(3, "fail0", port=free_port(), module="tests.support.rank_probe", log_dir=tmp_path, cwd=ROOT)
    assert time.monotonic() - start < 60  # the others sleep 300 s; without the stop, the test hangs


@pytest.mark.slow
def test_every_rank_succeeding_returns_the_log_folder(tmp_path):
    logs = launch(2, "ok", port=free_port(), module="tests.support.rank_probe", log_dir=tmp_path, cwd=ROOT)
    assert sorted(p.name for p in logs.iterdir()) == ["rank0.log", "rank1.log"]


@pytest.mark.slow
@pytest.mark.parametrize("fork", ["1", "0"])
def test_a_rank_forked_from_the_warm_parent_gets_what_a_fresh_one_gets(tmp_path, monkeypatch, fork):
    monkeypatch.setenv("UCP_HARNESS_FORK", fork)
    logs = launch(
        2, "show", port=free_port(), module="tests.support.rank_probe", log_dir=tmp_path, cwd=ROOT, env={"PROBE": "x"}
    )
    for rank in (0, 1):
        assert (logs / f"rank{rank}.log").read_text().split() == [str(rank), "2", str(ROOT), "x", "1"]


@pytest.mark.slow
@pytest.mark.parametrize("fork", ["1", "0"])
def test_a_rank_that_dies_of_a_signal_is_a_failure(tmp_path, monkeypatch, fork):
    monkeypatch.setenv("UCP_HARNESS_FORK", fork)
    with pytest.raises(RankFailure, match=r"rank 0 exited with -"):
        launch(1, "abort", port=free_port(), module="tests.support.rank_probe", log_dir=tmp_path, cwd=ROOT)
