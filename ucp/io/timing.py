"""How long each phase of a command took, for ``ucp -v`` (logged at INFO on ``ucp.timing``; silent otherwise)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["phase"]

logger = logging.getLogger("ucp.timing")


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Time the ``with`` block and log ``name: N.NN s`` when it ends (also when it fails, marked so)."""
    start = time.perf_counter()
    failed = True
    try:
        yield
        failed = False
    finally:
        if logger.isEnabledFor(logging.INFO):
            logger.info("%s: %.2f s%s", name, time.perf_counter() - start, " (failed)" if failed else "")
