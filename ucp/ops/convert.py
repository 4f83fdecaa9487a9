"""to-universal: wire a source reader to the universal writer. No stage branches here."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

from ucp.io.guard import OutputPolicy
from ucp.io.pool import default_workers, parallel_map, state_bytes
from ucp.model.records import ParamState
from ucp.sources import open_reader
from ucp.universal.writer import write_universal

__all__ = ["to_universal", "load_optimizer_moments", "iter_optimizer_moments"]

logger = logging.getLogger(__name__)


def to_universal(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    tag: str | None = None,
    optimizer: str | None = None,
    workers: int | None = None,
    overwrite: bool | OutputPolicy = False,
    fsync: bool = False,
) -> dict[str, Any]:
    """Convert a checkpoint (DeepSpeed folder with ``latest`` or a tag folder, or any other source ucp reads) into
    ``out``.

    Returns the manifest written to ``out/ucp.json``. ``optimizer`` names the flavour outright when
    detection cannot tell (e.g. a checkpoint saved before the first step). ``fsync`` flushes the
    output to disk before it is published (survives power loss, not just a killed process). OUT never is, lies
    inside or holds ``src``; ``overwrite`` replaces an earlier output of ucp only (``ucp.io.guard``).
    """
    reader = open_reader(src, tag=tag, optimizer=optimizer)
    try:
        manifest = write_universal(reader, out, overwrite=overwrite, workers=workers, fsync=fsync)
    finally:
        reader.close()
    logger.debug("wrote %d parameters to %s", len(manifest["params"]), out)
    return manifest


def iter_optimizer_moments(
    src: str | os.PathLike, *, tag: str | None = None, optimizer: str | None = None, workers: int | None = None
) -> Iterator[tuple[str, ParamState]]:
    """Stream (name, state) for every parameter straight from the shards, one at a time."""
    reader = open_reader(src, tag=tag, optimizer=optimizer)
    try:
        metas = reader.facts.params
        states = parallel_map(
            lambda m: reader.read(m.name),
            metas,
            workers or default_workers(),
            desc="read",
            weight=state_bytes(reader.facts),
        )
        for meta, state in zip(metas, states):
            yield meta.name, state
    finally:
        reader.close()


def load_optimizer_moments(
    src: str | os.PathLike, *, tag: str | None = None, optimizer: str | None = None
) -> dict[str, dict[str, Any]]:
    """Per parameter name: ``fp32``, every optimizer state tensor by its key (``exp_avg``, ``exp_avg_sq``
    for Adam; full, unpadded, real shape) and ``step``.

    The API asked for in DeepSpeed #7961. Frozen parameters have only ``fp32``. For models too
    large to hold at once, use :func:`iter_optimizer_moments`.
    """
    out: dict[str, dict[str, Any]] = {}
    for name, state in iter_optimizer_moments(src, tag=tag, optimizer=optimizer):
        entry: dict[str, Any] = {"fp32": state.fp32}
        if state.optim:
            entry.update(state.optim)
            entry["step"] = state.step
        out[name] = entry
    return out
