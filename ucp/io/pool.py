"""A small ordered thread pool: parameters are read and written in parallel, memory stays bounded.

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

__all__ = ["default_workers", "parallel_map", "state_bytes"]


def default_workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def state_bytes(facts: Facts, *, moments: bool = True) -> Callable[[ParamMeta | str], int]:
    """Bytes a parameter's fp32 master and (with ``moments``) each state tensor of its group take:
    the ``weight`` of :func:`parallel_map` for work that moves whole parameter states."""
    keys = {g.index: len(g.state_keys) for g in facts.groups} if moments else {}
    sizes = {p.name: 4 * p.numel * (1 + (0 if p.group is None else keys.get(p.group, 0))) for p in facts.params}
    return lambda item: sizes[item if isinstance(item, str) else item.name]


def parallel_map(
    fn: Callable[[Any], Any],
    items: Iterable[Any],
    workers: int,
    *,
    desc: str = "",
    total: int | None = None,
    weight: Callable[[Any], int] | None = None,
    progress: bool | None = None,
) -> Generator[Any, None, None]:
    """Map in a thread pool, in order, keeping at most ``2 x workers`` items in flight (bounded memory).

    Args:
        weight: bytes per item; the bar then counts bytes (rate and ETA in B/s) instead of items.
        total: the bar's total, in items or (with ``weight``) bytes; default: all of ``items``.
        progress: None shows the bar when stderr is a terminal and ucp is not ``--quiet``; True or
            False forces it on or off.
    """
    items = list(items)
    sizes = [weight(item) for item in items] if weight is not None else [1] * len(items)
    bar = _progress(sum(sizes) if total is None else total, desc, weight is not None, progress)
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
