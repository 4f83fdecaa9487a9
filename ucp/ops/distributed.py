"""Work across machines: ``torchrun --nnodes ... -m ucp {to-universal,restore,reshard} SRC OUT --distributed``.

Every rank opens the source (tiny: only the pickled metadata is read; tensors stay on disk behind
mmap), takes its share of the parameters, and reads only the byte ranges those need. Rank 0 owns
the output: it stages OUT, tells every rank where, gathers their manifest entries and commits. The
result is the same, file for file, as a one-process run. OUT's parent must be a filesystem all
ranks see. A native write (restore, reshard) splits the rank files the same way
(``ucp.targets.native.Share``): each process writes its files and checks the source files of its
share of the parameters; rank 0 writes ``latest`` and publishes.

Call order: plan (pure, :func:`assign`) -> rank 0 checks OUT (ucp.io.guard) and stages it -> all
write -> gather -> rank 0 finishes. Each step ends with every rank learning whether any rank failed
or was stopped (:func:`_together`), so one rank's failure, signal or death stops them all and
rank 0 removes the staging folder: OUT appears whole on every rank or not at all.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from array import array
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from ucp.deepspeed.layout import LATEST
from ucp.errors import UcpError, WriteError
from ucp.io.guard import OutputPolicy, fault_message, guarded_output, universal_bytes, weight_bytes
from ucp.io.pool import default_workers
from ucp.model.options import RestoreOptions
from ucp.model.records import Facts, ParamMeta, Reader
from ucp.sources import open_reader
from ucp.targets.native import NativePlan, Share, plan_native, write_files
from ucp.universal.param_table import ParamTable
from ucp.universal.writer import finish_universal, write_params

__all__ = ["assign", "to_universal_distributed", "write_native_distributed"]

logger = logging.getLogger(__name__)
_T = TypeVar("_T")


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
    policy: OutputPolicy | None = None,
) -> dict[str, Any] | None:
    """Convert with every torch.distributed rank taking a share; rank 0 returns the manifest.

    ``policy`` (the CLI's flags; else ``overwrite`` alone) is applied on rank 0 by ucp.io.guard
    before it stages OUT. Any rank's failure or signal stops every rank: all raise, rank 0 removes
    the staging folder, and no OUT appears.
    """
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
            policy=policy or OutputPolicy(overwrite=overwrite),
        )
    finally:
        if started:
            dist.destroy_process_group()


def _collective(call: Callable[[], Any]) -> Any:
    """A collective call; a peer that died (gloo sees its connection close) becomes one line."""
    try:
        return call()
    except RuntimeError as err:
        # gloo's text: "[.../pair.cc:553] Connection closed by peer [addr]:port. This is typically ..."
        first = re.sub(r"^\[[^\]]*\]\s*", "", (str(err).strip().splitlines() or [""])[0]).split(". ")[0]
        first = first[:160] or type(err).__name__
        raise UcpError(
            f"lost contact with another rank, which failed or was stopped ({first}); OUT was not written"
        ) from None


def _together(dist: Any, out: Path, step: Callable[[], _T]) -> _T:
    """This rank's part of one step; then every rank learns whether any failed, and all leave together.

    A rank that failed raises its own exception (a signal keeps its exit code, a bug its traceback);
    the others raise one UcpError naming the first rank that failed, with that rank's exit code.
    """
    result: Any = None
    own: BaseException | None = None
    report: tuple[str, int] | None = None
    try:
        result = step()
    except KeyboardInterrupt as err:  # SIGTERM, SIGHUP, Ctrl-C: ucp.errors.Stopped
        own, report = err, (f"stopped by {getattr(err, 'name', 'Ctrl-C')}", getattr(err, "exit_code", 130))
    except UcpError as err:
        own, report = err, (str(err), err.exit_code)
    except Exception as err:
        fault = fault_message(err, {out: 0})
        own = WriteError(fault) if fault is not None else err
        report = (fault or f"failed with {type(err).__name__}: {err}", getattr(own, "exit_code", 1))
    reports: list[tuple[str, int] | None] = [None] * dist.get_world_size()
    _collective(lambda: dist.all_gather_object(reports, report))
    failed = [(rank, r) for rank, r in enumerate(reports) if r is not None]
    if not failed:
        return result
    if own is not None:
        raise own
    rank, (message, code) = failed[0]
    error = UcpError(message if message.startswith("rank ") else f"rank {rank}: {message}")
    error.exit_code = code
    raise error


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
    policy: OutputPolicy,
) -> dict[str, Any] | None:
    reader: Reader | None = None
    try:
        reader = _together(dist, out, lambda: open_reader(src, tag=tag, optimizer=optimizer))
        metas = reader.facts.params
        shares = assign(metas, world)
        mine = [metas[i] for i in shares[rank]]
        with contextlib.ExitStack() as stack:

            def stage() -> str | None:
                """Rank 0 alone checks OUT (ucp.io.guard) and stages it; the others learn the outcome."""
                if rank != 0 or reader is None:
                    return None
                size = universal_bytes(reader.facts)
                root = stack.enter_context(guarded_output(out, reader.inputs, policy, size=size))
                (root / "zero").mkdir()
                return str(root)

            box: list[Any] = [_together(dist, out, stage)]
            _collective(lambda: dist.broadcast_object_list(box, src=0))
            root = Path(box[0])
            entries = _together(dist, out, lambda: write_params(reader, root, mine, workers))
            gathered: list[ParamTable | None] = [None] * world if rank == 0 else []
            _collective(lambda: dist.gather_object(entries, gathered if rank == 0 else None, dst=0))

            def finish() -> dict[str, Any] | None:
                if rank != 0 or reader is None:
                    return None
                owner = array("I", bytes(4 * len(metas)))  # the rank that wrote each parameter
                for r, share in enumerate(shares):
                    for i in share:
                        owner[i] = r
                ordered = ParamTable()  # every rank's entries, in the model's order
                for i, meta in enumerate(metas):
                    table = gathered[owner[i]]
                    assert table is not None  # gather_object filled every rank's
                    ordered.add_entry(table.entry(table.index[meta.name]))
                ordered.finish()
                return finish_universal(root, reader.facts, ordered, reader.extras(), reader.buffers())

            return _together(dist, out, finish)  # rank 0 publishes OUT on leaving the stack
    finally:
        if reader is not None:
            reader.close()


def write_native_distributed(
    src: str | os.PathLike,
    out: str | os.PathLike,
    options: RestoreOptions | Callable[[Facts], RestoreOptions],
    *,
    tag: str | None = None,
    workers: int | None = None,
    policy: OutputPolicy | None = None,
    fsync: bool = False,
) -> NativePlan | None:
    """A native checkpoint (``ucp restore`` / ``ucp reshard``) with every torch.distributed rank
    writing its share of the rank files; rank 0 returns the plan, the others None. ``options`` may
    depend on the source (a function of its facts: reshard keeps its ZeRO stage). Failure and
    signals behave as in :func:`to_universal_distributed`: OUT appears whole or not at all."""
    dist, rank, world, started = _init()
    try:
        return _run_native(
            dist,
            rank,
            world,
            Path(src),
            Path(out),
            options,
            tag=tag,
            workers=workers or default_workers(),
            policy=policy or OutputPolicy(),
            fsync=fsync,
        )
    finally:
        if started:
            dist.destroy_process_group()


def _run_native(
    dist: Any,
    rank: int,
    world: int,
    src: Path,
    out: Path,
    options: RestoreOptions | Callable[[Facts], RestoreOptions],
    *,
    tag: str | None,
    workers: int,
    policy: OutputPolicy,
    fsync: bool,
) -> NativePlan | None:
    reader: Reader | None = None
    try:
        reader = _together(dist, out, lambda: open_reader(src, tag=tag))
        facts = reader.facts
        chosen = options(facts) if callable(options) else options
        plan = _together(dist, out, lambda: plan_native(facts, chosen))
        checked = frozenset(facts.params[i].name for i in assign(facts.params, world)[rank])
        share = Share(rank, world, checked)
        with contextlib.ExitStack() as stack:

            def stage() -> str | None:
                """Rank 0 alone checks OUT and stages it; the others learn the outcome."""
                if rank != 0:
                    return None
                size = weight_bytes(facts, plan.dtype)
                root = stack.enter_context(guarded_output(out, reader.inputs, policy, size=size, durable=fsync))
                (root / plan.tag).mkdir()
                return str(root)

            box: list[Any] = [_together(dist, out, stage)]
            _collective(lambda: dist.broadcast_object_list(box, src=0))
            root = Path(box[0])
            _together(dist, out, lambda: write_files(reader, plan, root / plan.tag, workers, share))

            def finish() -> None:
                if rank == 0:
                    (root / LATEST).write_text(plan.tag)

            _together(dist, out, finish)  # rank 0 publishes OUT on leaving the stack
            return plan if rank == 0 else None
    finally:
        if reader is not None:
            reader.close()
