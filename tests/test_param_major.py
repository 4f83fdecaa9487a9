"""ZeRO-3 rank files written parameter by parameter (``ucp.targets.native.zero3``), on a real DeepSpeed save.

A streaming ZeRO-3 restore lays out the optim-states files of a task of ranks first, then reads each parameter's
range for those ranks once and writes every rank's slice of it into its file through gathering buffers. The bytes
must not depend on how the ranks are cut into tasks, how big the buffers are, or whether a range is gathered in
memory or copied slice by slice from its files; each universal file must be read once per task, not once per rank
(at 10^5 parameters and DP 8, 3 x 10^5 reads instead of 2.4 M). The restored bytes themselves are pinned by
tests/test_golden.py and loaded into DeepSpeed by tests/test_restore_native.py.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

import ucp
from ucp.io import pool
from ucp.model import pieces
from ucp.model.pieces import PathSpan, open_checked
from ucp.targets.native import zero3
from ucp.universal.reader import open_universal

pytestmark = pytest.mark.slow

#: three param groups in several sub-groups, frozen and tied parameters, three ranks' partitions in every file
SOURCE = "z3-fp32-dp3-adamw"


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_small_tasks_buffers_and_copies_write_the_bytes_of_the_default(
    universals: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uni = universals(SOURCE)
    ucp.write_native(uni, tmp_path / "default", dp=7, stage=3, workers=2)
    monkeypatch.setattr(zero3, "RANKS_PER_TASK", 2)  # 4 tasks of 1-2 ranks
    monkeypatch.setattr(zero3, "GATHER_MAX", 64)  # most ranges copied slice by slice from the files
    monkeypatch.setattr(zero3, "FILL_BUDGET", 4096)
    monkeypatch.setattr(zero3, "_FILL_MIN", 256)  # buffers smaller than most slices: written past the buffer
    ucp.write_native(uni, tmp_path / "small", dp=7, stage=3, workers=2)
    default, small = _files(tmp_path / "default"), _files(tmp_path / "small")
    assert default.keys() == small.keys() and len(default) == 2 * 7 + 2  # and latest, .ucp-output
    assert [name for name in default if default[name] != small[name]] == []


def test_tasks_in_threads_write_the_bytes_of_one_thread(
    universals: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fixture's parameters are small, so by default its tasks run in one thread (``ucp.io.pool``); with threads
    forced, tasks of ranks run at once and must write the same bytes."""
    uni = universals(SOURCE)
    threads: dict[str, set[int]] = {"one": set(), "threads": set()}
    write = zero3._RankTask.write
    run = ["one"]

    def seen(task: zero3._RankTask) -> None:  # which threads wrote tasks (the writing itself is the real one)
        threads[run[0]].add(threading.get_ident())
        write(task)

    monkeypatch.setattr(zero3._RankTask, "write", seen)
    ucp.write_native(uni, tmp_path / "one", dp=7, stage=3, workers=2)
    run[0] = "threads"
    monkeypatch.setattr(pool, "THREAD_GRAIN", 0)
    ucp.write_native(uni, tmp_path / "threads", dp=7, stage=3, workers=2)
    assert threads["one"] == {threading.get_ident()}, threads
    assert threads["threads"] and threading.get_ident() not in threads["threads"], threads
    one, many = _files(tmp_path / "one"), _files(tmp_path / "threads")
    assert one.keys() == many.keys() and [name for name in one if one[name] != many[name]] == []


@pytest.mark.parametrize("workers", [1, 2])
def test_each_universal_file_is_read_once_per_task(
    universals: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    uni = universals(SOURCE)
    reads: Counter[str] = Counter()
    opened = PathSpan.opened

    def counted_check(path: str, stamp: tuple[int, ...]) -> int:  # every read of a span by path opens it so
        reads[path] += 1
        return open_checked(path, stamp)

    def counted_open(span: PathSpan):  # type: ignore[no-untyped-def]
        reads[span.path] += 1
        return opened(span)

    monkeypatch.setattr(pieces, "open_checked", counted_check)  # PathSpan.read_into
    monkeypatch.setattr(PathSpan, "opened", counted_open)
    ucp.write_native(uni, tmp_path / "out", dp=8, stage=3, workers=workers)
    frozen = {e.folder for e in open_universal(uni).entries() if e.frozen}  # read per rank for its fragments
    trainable = [path for path in reads if Path(path).parent.name not in frozen]
    assert len(trainable) >= 20  # every trainable parameter's fp32, exp_avg and exp_avg_sq
    tasks = workers  # DP 8 in at most as many tasks as workers (one here: the parameters are small, ucp.io.pool)
    assert max(reads[path] for path in trainable) <= tasks, reads.most_common(3)
