"""A small ordered thread pool: parameters are read and written in parallel, memory stays bounded."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Generator, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

__all__ = ["default_workers", "parallel_map"]


def default_workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def parallel_map(
    fn: Callable[[Any], Any], items: Iterable[Any], workers: int, *, desc: str = "", total: int | None = None
) -> Generator[Any, None, None]:
    """Map in a thread pool, in order, keeping at most ``2 x workers`` items in flight (bounded memory)."""
    items = list(items)
    bar = _progress(total if total is not None else len(items), desc)
    try:
        if workers <= 1:
            for item in items:
                yield fn(item)
                bar.update(1)
            return
        with ThreadPoolExecutor(workers) as pool:
            pending = []
            for item in items:
                pending.append(pool.submit(fn, item))
                if len(pending) >= 2 * workers:
                    yield pending.pop(0).result()
                    bar.update(1)
            for future in pending:
                yield future.result()
                bar.update(1)
    finally:
        bar.close()


def _progress(total: int, desc: str) -> Any:
    try:
        from tqdm import tqdm

        quiet = logging.getLogger("ucp").getEffectiveLevel() > logging.WARNING  # ucp --quiet
        return tqdm(total=total, desc=desc, unit="param", disable=True if quiet else None, leave=False)
    except ImportError:  # tqdm is optional

        class _Null:
            def update(self, n: int) -> None: ...
            def close(self) -> None: ...

        return _Null()
