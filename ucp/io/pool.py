"""A small ordered thread pool: parameters are read and written in parallel, memory stays bounded.

Threads pay only where each step of an item moves enough bytes to leave the interpreter lock (a large copy, a
CRC, a read or write of megabytes). A checkpoint of many small tensors is converted by Python code that holds the
lock, and two threads of it took longer than one: on 2 cores, a reshard of 10^5 tensors (1 GB, DP 8 -> 4) 46 s
against 26 s, its restore from the universal folder 68 s against 37 s, and a reshard of 10^3 tensors 2.4-3.0 s
against 2.3 s. So a map whose typical item moves less than :data:`THREAD_GRAIN` bytes runs in the calling thread;
a record large enough is still copied by the copy pool's threads (``ucp.io.span_copy``). Creating files is the
exception: each file's system calls leave the lock, and to-universal of 10^3 tensors (four files of about 250 KB
each) took 3.5 s in two threads against 4.4 s in one, so it passes the lower :data:`FILE_GRAIN`.

Its progress bar (tqdm, on stderr) counts bytes when the caller says what each item weighs
(:func:`state_bytes` for a parameter's fp32 master and optimizer state), so the rate and ETA mean
something when parameters range from a bias to an embedding; it is off when stderr is not a
terminal and under ``ucp --quiet``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Generator, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ucp.model.records import Facts, ParamMeta

__all__ = [
    "THREAD_GRAIN",
    "FILE_GRAIN",
    "default_workers",
    "threads_for",
    "parallel_map",
    "state_bytes",
    "typical_state_bytes",
]

#: a map whose typical item (the median) moves fewer bytes than this runs in one thread
THREAD_GRAIN = 4 << 20
#: the same for a map whose items each create files (to-universal: at 10^5 tensors of about 10 KB each, one thread
#: still wins, 79-112 s against 126-139 s)
FILE_GRAIN = 64 << 10


def default_workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def threads_for(workers: int, grain: int | None, least: int | None = None) -> int:
    """The threads a map of ``workers`` at most uses when a typical step of an item moves ``grain`` bytes; ``least``:
    the grain threads need (default :data:`THREAD_GRAIN`)."""
    least = THREAD_GRAIN if least is None else least
    return 1 if grain is not None and grain < least else max(1, workers)


def state_bytes(facts: Facts, *, moments: bool = True) -> Callable[[ParamMeta | str], int]:
    """Bytes a parameter's fp32 master and (with ``moments``) each state tensor of its group take:
    the ``weight`` of :func:`parallel_map` for work that moves whole parameter states."""
    keys = {g.index: len(g.state_keys) for g in facts.groups} if moments else {}
    sizes = {p.name: 4 * p.numel * (1 + (0 if p.group is None else keys.get(p.group, 0))) for p in facts.params}
    return lambda item: sizes[item if isinstance(item, str) else item.name]


def typical_state_bytes(facts: Facts, *, moments: bool = True) -> int:
    """The median of :func:`state_bytes` over the parameters: the ``grain`` of a map whose items each walk every
    parameter (a task of ranks), so that 10^5 small experts beside one embedding still count as small."""
    weigh = state_bytes(facts, moments=moments)
    return _median([weigh(p) for p in facts.params])


def _median(sizes: list[int]) -> int:
    return sorted(sizes)[len(sizes) // 2] if sizes else 0


def parallel_map(
    fn: Callable[[Any], Any],
    items: Iterable[Any],
    workers: int,
    *,
    desc: str = "",
    total: int | None = None,
    weight: Callable[[Any], int] | None = None,
    grain: int | None = None,
    least: int | None = None,
    progress: bool | None = None,
) -> Generator[Any, None, None]:
    """Map in a thread pool, in order, keeping at most ``2 x workers`` items in flight (bounded memory).

    Args:
        weight: bytes per item; the bar then counts bytes (rate and ETA in B/s) instead of items.
        grain: the bytes a typical step of an item moves (default: the median ``weight``; None without one): under
            ``least`` (default :data:`THREAD_GRAIN`) the map runs in the calling thread: ``workers`` is the most it
            may use.
        total: the bar's total, in items or (with ``weight``) bytes; default: all of ``items``.
        progress: None shows the bar when stderr is a terminal and ucp is not ``--quiet``; True or
            False forces it on or off.
    """
    items = list(items)
    sizes = [weight(item) for item in items] if weight is not None else [1] * len(items)
    bar = _progress(sum(sizes) if total is None else total, desc, weight is not None, progress)
    workers = threads_for(workers, _median(sizes) if grain is None and weight is not None else grain, least)
    try:
        if workers <= 1:
            for item, size in zip(items, sizes):
                yield fn(item)
                bar.update(size)
            return
        with ThreadPoolExecutor(workers) as pool:
            pending = []
            done = iter(sizes)
            for item in items:
                pending.append(pool.submit(fn, item))
                if len(pending) >= 2 * workers:
                    yield pending.pop(0).result()
                    bar.update(next(done))
            for future in pending:
                yield future.result()
                bar.update(next(done))
    finally:
        bar.close()


def _progress(total: int, desc: str, in_bytes: bool, progress: bool | None) -> Any:
    """A tqdm bar on stderr (bytes scaled by 1024 when ``in_bytes``), or a stand-in that shows nothing."""
    if progress is None and logging.getLogger("ucp").getEffectiveLevel() > logging.WARNING:  # ucp --quiet
        progress = False
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional
        progress = False
    if progress is False:
        return _NoBar()
    units: dict[str, Any] = {"unit": "B", "unit_scale": True, "unit_divisor": 1024} if in_bytes else {"unit": "param"}
    # disable=None: tqdm shows the bar only when stderr is a terminal
    return tqdm(total=total, desc=desc, disable=None if progress is None else False, leave=False, **units)


class _NoBar:
    """What parallel_map updates when no bar is shown."""

    def update(self, n: int) -> None: ...

    def close(self) -> None: ...
