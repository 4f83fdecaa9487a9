"""Universal (or any reader) -> a native DeepSpeed checkpoint that stock DeepSpeed loads at DP=N.

Call order: :func:`~ucp.targets.native.plan.plan_native` fixes every choice from one
:class:`~ucp.model.options.RestoreOptions` as plain data and checks it; :func:`write_plan` hands
the plan to the stage's writer (:mod:`.zero3`, :mod:`.zero12` once per TP rank, or :mod:`.zero0`
without ZeRO) inside one staged
output folder, then writes ``OUT/latest``. A new engine loads it with ``engine.load_checkpoint(OUT)``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from ucp.deepspeed.layout import LATEST, RESET_MARK
from ucp.io.atomic import mark_owned
from ucp.io.guard import OutputPolicy, guarded_output, weight_bytes
from ucp.io.pool import default_workers
from ucp.io.timing import phase
from ucp.model.options import RestoreOptions, options_with, zero_label
from ucp.model.records import Reader
from ucp.model.zenflow import ZenflowTransposed
from ucp.sources import open_reader, opened
from ucp.targets.format import Request, TargetFormat, Written
from ucp.targets.native.plan import DS_DEFAULT_SUB_GROUP_SIZE, NativePlan, Share, plan_native
from ucp.targets.native.zero0 import write_zero0
from ucp.targets.native.zero3 import write_zero3
from ucp.targets.native.zero12 import write_zero12
from ucp.targets.tensor_parallel import TpShardReader, rank_layouts

__all__ = [
    "FORMAT",
    "native_written",
    "NativePlan",
    "RestoreOptions",
    "Share",
    "plan_native",
    "write_native",
    "write_plan",
    "write_files",
    "reshard",
    "mark_reset",
    "DS_DEFAULT_SUB_GROUP_SIZE",
]

logger = logging.getLogger(__name__)


def write_plan(
    reader: Reader,
    plan: NativePlan,
    out: str | os.PathLike,
    *,
    overwrite: bool | OutputPolicy = False,
    workers: int | None = None,
    fsync: bool = False,
) -> NativePlan:
    """Carry out a plan: ``out/latest`` and ``out/<tag>/``, whole or not at all, never over an input."""
    size = weight_bytes(reader.facts, plan.dtype)
    with guarded_output(out, reader.inputs, overwrite, size=size, durable=fsync) as root:
        (root / plan.tag).mkdir()
        with phase(f"write the rank files of {plan.tag}"):
            write_files(reader, plan, root / plan.tag, workers or default_workers())
        (root / LATEST).write_text(plan.tag)
        mark_reset(root, plan)
    return plan


def mark_reset(root: Path, plan: NativePlan) -> None:
    """A checkpoint written with the optimizer reset holds a fresh optimizer, which no file tells from a save that
    lost its state: ucp's stamp beside ``latest`` says which flavour it was written for (ucp.deepspeed.layout)."""
    if plan.reset_moments:
        mark_owned(root, **{RESET_MARK: plan.flavour.name})


def write_files(reader: Reader, plan: NativePlan, tag_dir: Path, workers: int, share: Share = Share()) -> None:
    """The rank files of a plan into an existing ``tag_dir`` (``latest`` is the caller's); under a
    ``share``, only that process's part of them (``ucp.ops.distributed``)."""
    if plan.stage == 3:
        # a ZenFlow run's ZeRO-3 layout: its matrices transposed (the view reads each whole)
        write_zero3(ZenflowTransposed(reader) if plan.transposed else reader, plan, tag_dir, workers, share)
        return
    write = write_zero0 if plan.stage == 0 else write_zero12
    for mp_rank in range(plan.tp):
        view = (  # at TP=1 the reader itself, so that it streams
            reader
            if plan.tp == 1
            else TpShardReader(reader, rank_layouts(reader, plan.tp, mp_rank), tp=plan.tp, rank=mp_rank)
        )
        write(view, replace(plan, mp_rank=mp_rank), tag_dir, workers, share)


def write_native(
    source: Reader | str | os.PathLike,
    out: str | os.PathLike,
    options: RestoreOptions | None = None,
    *,
    overwrite: bool | OutputPolicy = False,
    workers: int | None = None,
    fsync: bool = False,
    **fields: Any,
) -> NativePlan:
    """Write ``out/latest`` and ``out/<tag>/`` for a DeepSpeed engine of the options' DP size (and TP degree).

    ``options`` or its fields as keywords (``dp=8, stage=3, optimizer=..., dtype=..., tag=...,
    sub_group_size=..., step=..., tp=...``); without either, the stage is the source's. At ``tp`` > 1 each TP rank's files hold its shards, cut
    by the rules the checkpoint records (``ucp.model.tp``); the model-states files carry a
    ``universal_checkpoint_info`` describing them.
    """
    with opened(source) as reader:
        if options is None and "stage" not in fields:  # the source's stage, as ucp restore and reshard keep it
            fields["stage"] = reader.facts.info.zero_stage
        return write_plan(
            reader,
            plan_native(reader.facts, options_with(options, **fields)),
            out,
            overwrite=overwrite,
            workers=workers,
            fsync=fsync,
        )


def reshard(
    source: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dp: int,
    stage: int | None = None,
    overwrite: bool | OutputPolicy = False,
    workers: int | None = None,
    fsync: bool = False,
    **fields: Any,
) -> NativePlan:
    """A DeepSpeed checkpoint straight to another DP size (``ucp reshard``): one pass, no universal
    directory on disk, the source's ZeRO stage unless ``stage`` is given; other ``fields`` as for
    :func:`write_native` (``optimizer``, ``dtype``, ``tag``, ``tp``, ``step``, ...).

    Example::

        ucp.reshard("checkpoints/run", "checkpoints/run-dp32", dp=32)
    """
    with open_reader(source) as reader:
        chosen = RestoreOptions(dp=dp, stage=reader.facts.info.zero_stage if stage is None else stage, **fields)
        return write_plan(
            reader, plan_native(reader.facts, chosen), out, overwrite=overwrite, workers=workers, fsync=fsync
        )


def native_written(
    plan: NativePlan, out: str | os.PathLike, *, noun: str | None = None, layout: str | None = None, **fields: Any
) -> Written:
    """What a native write reports: one summary line, its plan's notes, and the JSON fields (``format``:
    ``deepspeed`` unless ``fields`` say otherwise). ``noun`` names a layout of its own (``a pipeline``, ``a MoE``:
    the ZeRO stage then goes in the parentheses), ``layout`` the new run's sizes (default ``dp=N``, ``tp=T``)."""
    sizes = layout or f"dp={plan.dp}" + (f" tp={plan.tp}" if plan.tp > 1 else "")
    what = [zero_label(plan.stage)] if noun else []
    summary = (
        f"wrote {noun or 'a ' + zero_label(plan.stage)} checkpoint for {sizes} "
        f"({', '.join([*what, plan.flavour.name, plan.dtype])}) to {out}/{plan.tag}"
    )
    body = {"stage": plan.stage, "dp": plan.dp, "tp": plan.tp, "optimizer": plan.flavour.name, "dtype": plan.dtype}
    return Written(summary, list(plan.notes), {"format": "deepspeed", **fields, **body, "tag": plan.tag})


def _write(reader: Reader, out: Path, request: Request) -> Written:
    """A bare DeepSpeed checkpoint, at the source's ZeRO stage unless one is asked for."""
    options = request.restore_options(reader.facts.info.zero_stage)
    plan = write_plan(
        reader, plan_native(reader.facts, options), out, overwrite=request.overwrite, workers=request.workers,
        fsync=request.fsync,
    )  # fmt: skip
    return native_written(plan, out)


FORMAT = TargetFormat(
    name="deepspeed",
    label="a DeepSpeed checkpoint",
    docs="format.md#1-deepspeed-zero-3",
    write=_write,
    serves=lambda reader, request: True,
)
