"""The worker pool's progress bar counts bytes when told what each item weighs, and shows nothing unless asked
(stderr not a terminal, or ucp --quiet); a map of small items runs in the calling thread, since two threads of
Python-bound work took longer than one (``ucp.io.pool``)."""

from __future__ import annotations

import logging
import threading

import pytest

from ucp.io.pool import FILE_GRAIN, THREAD_GRAIN, parallel_map, state_bytes, threads_for, typical_state_bytes


@pytest.mark.parametrize("workers", [1, 3])
def test_a_weighted_bar_counts_bytes_with_rate_and_keeps_order(workers, capsys):
    sizes = {"a": 1024, "b": 2048, "c": 0, "d": 1024 * 1024}
    out = list(parallel_map(str.upper, sizes, workers, desc="copy", weight=sizes.__getitem__, progress=True))
    assert out == ["A", "B", "C", "D"]
    bar = capsys.readouterr().err
    assert "/1.00M" in bar and "B/s" in bar, bar  # total 1 MiB + 3 KiB in binary units, a rate in bytes


def test_an_unweighted_bar_counts_items(capsys):
    assert list(parallel_map(abs, [-1, -2], 1, desc="read", progress=True)) == [1, 2]
    bar = capsys.readouterr().err
    assert "/2 " in bar and "param" in bar and "B/s" not in bar, bar


def test_no_bar_when_stderr_is_not_a_terminal_or_ucp_is_quiet(capsys, monkeypatch):
    assert list(parallel_map(abs, [-1], 2, weight=lambda _: 4)) == [1]  # capsys' stderr is no terminal
    monkeypatch.setattr(logging.getLogger("ucp"), "level", logging.ERROR)  # what ucp --quiet sets
    assert list(parallel_map(abs, [-1], 1, weight=lambda _: 4)) == [1]
    assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_a_parameter_weighs_its_fp32_master_and_each_state_tensor(z3_bf16_dp2):
    import ucp

    with ucp.open_reader(z3_bf16_dp2.path) as reader:
        facts = reader.facts
    weigh = state_bytes(facts)
    trained = next(p for p in facts.params if not p.frozen)
    frozen = next(p for p in facts.params if p.frozen)
    assert weigh(trained) == weigh(trained.name) == trained.numel * 4 * 3  # fp32, exp_avg, exp_avg_sq
    assert weigh(frozen) == frozen.numel * 4
    assert state_bytes(facts, moments=False)(trained) == trained.numel * 4
    sizes = sorted(weigh(p) for p in facts.params)
    assert typical_state_bytes(facts) == sizes[len(sizes) // 2] < THREAD_GRAIN  # the fixture's parameters are small


def _thread(_: object) -> int:
    return threading.get_ident()


def test_small_items_run_in_the_calling_thread_and_large_ones_in_threads():
    here = threading.get_ident()
    assert set(parallel_map(_thread, range(8), 4, weight=lambda _: 64 << 10)) == {here}
    assert here not in set(parallel_map(_thread, range(8), 4, weight=lambda _: THREAD_GRAIN))
    # the median item decides: one embedding beside many small experts is still a map of small items
    sizes = [1 << 32] + [64 << 10] * 9
    assert set(parallel_map(_thread, range(10), 4, weight=sizes.__getitem__)) == {here}
    # a grain the caller knows (a task of ranks walks every parameter) decides over the items' weights
    assert set(parallel_map(_thread, range(8), 4, weight=lambda _: 1 << 32, grain=1024)) == {here}
    assert here not in set(parallel_map(_thread, range(8), 4, grain=THREAD_GRAIN))
    assert set(parallel_map(_thread, range(8), 4)) != {here}  # no weight, no grain: threads as asked
    assert (threads_for(4, THREAD_GRAIN - 1), threads_for(4, THREAD_GRAIN), threads_for(4, None)) == (1, 4, 4)
    assert threads_for(0, None) == 1
    # a map whose items create files needs less: their system calls leave the interpreter lock
    assert here not in set(parallel_map(_thread, range(8), 4, weight=lambda _: FILE_GRAIN, least=FILE_GRAIN))
    assert set(parallel_map(_thread, range(8), 4, weight=lambda _: FILE_GRAIN - 1, least=FILE_GRAIN)) == {here}
