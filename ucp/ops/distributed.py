"""to-universal across machines: ``torchrun --nnodes ... -m ucp to-universal SRC OUT --distributed``.

Every rank opens the source (tiny: only the pickled metadata is read; tensors stay on disk behind
mmap), takes its share of the parameters, and reads only the byte ranges those need. Rank 0 owns
the output: it stages OUT, tells every rank where, gathers their manifest entries and commits. The
result is the same, file for file, as a one-process run. OUT's parent must be a filesystem all
ranks see.

Call order: plan (pure, :func:`assign`) -> rank 0 stages -> all write -> gather -> rank 0 finishes.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ucp.errors import UcpError
from ucp.io.atomic import staged_output
from ucp.io.pool import default_workers
from ucp.model.records import ParamMeta
from ucp.sources import open_reader
from ucp.universal.manifest import ParamEntry
from ucp.universal.writer import finish_universal, write_params

__all__ = ["assign", "to_universal_distributed"]

logger = logging.getLogger(__name__)


def assign(metas: Sequence[ParamMeta], world: int) -> list[list[int]]:
    """Split parameters across ranks by size (largest first to the lightest rank); deterministic."""
    loads = [0] * world
    shares: list[list[int]] = [[] for _ in range(world)]
    for index in sorted(range(len(metas)), key=lambda i: (-metas[i].numel, i)):
        rank = min(range(world), key=lambda r: (loads[r], r))
        shares[rank].append(index)
        loads[rank] += max(1, metas[index].numel)
    return [sorted(share) for share in shares]


def _init() -> tuple[Any, int, int, bool]:
    import torch.distributed as dist

    started = False
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            raise UcpError("--distributed needs torchrun (or RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) set")
        dist.init_process_group(backend="gloo")
        started = True
    return dist, dist.get_rank(), dist.get_world_size(), started


def to_universal_distributed(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    tag: str | None = None,
    optimizer: str | None = None,
    workers: int | None = None,
    overwrite: bool = False,
) -> dict[str, Any] | None:
    """Convert with every torch.distributed rank taking a share; rank 0 returns the manifest."""
    dist, rank, world, started = _init()
    try:
        return _run(
            dist,
            rank,
            world,
            Path(src),
            Path(out),
            tag=tag,
            optimizer=optimizer,
            workers=workers or default_workers(),
            overwrite=overwrite,
        )
    finally:
        if started:
            dist.destroy_process_group()


def _agree(dist: Any, error: str | None) -> None:
    """Every rank learns whether any rank failed; all raise the first failure together."""
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    for rank, message in enumerate(errors):
        if message is not None:
            raise UcpError(message if message.startswith("rank ") else f"rank {rank}: {message}")


def _run(
    dist: Any,
    rank: int,
    world: int,
    src: Path,
    out: Path,
    *,
    tag: str | None,
    optimizer: str | None,
    workers: int,
    overwrite: bool,
) -> dict[str, Any] | None:
    reader = None
    try:
        error = None
        try:
            reader = open_reader(src, tag=tag, optimizer=optimizer)
        except UcpError as err:
            error = str(err)
        _agree(dist, error)
        assert reader is not None
        metas = reader.facts.params
        mine = [metas[i] for i in assign(metas, world)[rank]]
        if rank == 0:
            with contextlib.ExitStack() as stack:
                try:
                    root = stack.enter_context(staged_output(out, overwrite=overwrite))
                    (root / "zero").mkdir()
                except BaseException:
                    dist.broadcast_object_list([None], src=0)  # release the other ranks, then fail
                    raise
                box: list[Any] = [str(root)]
                dist.broadcast_object_list(box, src=0)
                entries = _write_share(dist, reader, root, mine, workers)
                gathered: list[list[ParamEntry] | None] = [None] * world
                dist.gather_object(entries, gathered, dst=0)
                by_name = {e.name: e for share in gathered for e in (share or [])}
                ordered = [by_name[m.name] for m in metas]
                manifest = finish_universal(root, reader.facts, ordered, reader.extras(), reader.buffers())
            dist.barrier()
            return manifest
        staged: list[Any] = [None]
        dist.broadcast_object_list(staged, src=0)
        if staged[0] is None:
            raise UcpError("rank 0 could not stage the output")
        entries = _write_share(dist, reader, Path(staged[0]), mine, workers)
        dist.gather_object(entries, None, dst=0)
        dist.barrier()
        return None
    finally:
        if reader is not None:
            reader.close()


def _write_share(dist: Any, reader: Any, root: Path, mine: list[ParamMeta], workers: int) -> list[ParamEntry]:
    error = None
    entries: list[ParamEntry] = []
    try:
        entries = write_params(reader, root, mine, workers)
    except UcpError as err:
        error = str(err)
    _agree(dist, error)
    return entries
