"""The test launcher (ucp.harness.launch): a failed rank ends the run at once, naming that rank."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ucp.harness.launch import RankFailure, free_port, launch

ROOT = Path(__file__).resolve().parents[1]


def test_a_failed_rank_stops_the_others_instead_of_leaving_them_waiting(tmp_path):
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 0 exited with 3"):
        launch(3, "fail0", port=free_port(), module="tests.support.rank_probe", log_dir=tmp_path, cwd=ROOT)
    assert time.monotonic() - start < 60  # the others sleep 300 s; without the stop, the test hangs


def test_every_rank_succeeding_returns_the_log_folder(tmp_path):
    logs = launch(2, "ok", port=free_port(), module="tests.support.rank_probe", log_dir=tmp_path, cwd=ROOT)
    assert sorted(p.name for p in logs.iterdir()) == ["rank0.log", "rank1.log"]
