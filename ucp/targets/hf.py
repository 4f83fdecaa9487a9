"""A Hugging Face run folder for a new world size: the same kind of folder, ready to resume from.

Call order: :func:`write_hf` finds the source's layout (:func:`ucp.frameworks.hf.find_hf_folder`),
plans the native write for the new size (:func:`ucp.targets.native.plan_native`), and inside one
staged output writes the DeepSpeed tag under the name the framework loads plus ``latest``, copies
every other file of the source unchanged (as bytes: nothing is unpickled), and gives each new
process an RNG file (new process r takes old process r mod W_old). The source is only read.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ucp.deepspeed.layout import LATEST
from ucp.errors import InputError
from ucp.frameworks.hf import ACCELERATE, ACCELERATE_TAG, HfFolder, batch_advice, rng_plan
from ucp.io.guard import OutputPolicy, guarded_output, weight_bytes
from ucp.model.layouts import DEEPSPEED
from ucp.model.options import RestoreOptions, zero_label
from ucp.model.records import Facts, Reader
from ucp.sources import opened
from ucp.targets.format import Request, TargetFormat, Written
from ucp.targets.native import NativePlan, mark_reset, plan_native, write_plan
from ucp.targets.run_folder import folder_backend, folder_batch_note, folder_notes, place_files

__all__ = ["FORMAT", "hf_options", "write_hf_plan", "HfResult", "write_hf"]

logger = logging.getLogger(__name__)


@dataclass
class HfResult:
    """What was written, and what the user should know before resuming."""

    folder: HfFolder
    plan: NativePlan
    out: Path
    world: int
    rng: list[tuple[str, str]]
    notes: list[str] = field(default_factory=list)


def hf_options(
    facts: Facts, folder: HfFolder, options: RestoreOptions | None, fields: dict[str, Any]
) -> RestoreOptions:
    """The new run keeps the source's stage and tag name unless told otherwise; from an FSDP run's folder, the tag is
    the one the framework's DeepSpeed save names (Trainer: ``global_step<N>``, Accelerate: ``pytorch_model``) and
    the stage 3 (FSDP's full sharding)."""
    fields = {k: v for k, v in fields.items() if v is not None}
    fields.setdefault("stage", facts.info.zero_stage)
    if folder.tag:
        fields.setdefault("tag", folder.tag)
    elif folder.kind == ACCELERATE:
        fields.setdefault("tag", ACCELERATE_TAG)
    if options is None:
        return RestoreOptions(**fields)
    return replace(options, **{k: v for k, v in fields.items() if k not in ("stage", "tag")})


def _batch_note(facts: Facts, new_dp: int) -> str | None:
    """Trainer and Accelerate fill DeepSpeed's config with the real batch settings; read them there (an FSDP run's
    folder has no DeepSpeed config: :func:`ucp.targets.run_folder.folder_batch_note` reads its trainer state)."""
    if facts.folder is not None and facts.folder.fsdp:
        return folder_batch_note(facts.folder, new_dp)
    cfg = facts.info.ds_config or {}
    micro, accum = cfg.get("train_micro_batch_size_per_gpu"), cfg.get("gradient_accumulation_steps")
    if not isinstance(micro, int) or not isinstance(accum, int):
        return None
    return batch_advice(micro, accum, facts.info.batch_ranks, new_dp)


def _fill(
    root: Path, folder: HfFolder, reader: Any, plan: NativePlan, rng: list[tuple[str, str]], workers: Any
) -> None:
    """The DeepSpeed tag and ``latest`` (built in a sub-folder, then moved up), the copies, the RNG files."""
    native = root / ".ucp-native"
    write_plan(reader, plan, native, workers=workers, fsync=False)
    os.rename(native / plan.tag, root / plan.tag)
    os.rename(native / LATEST, root / LATEST)
    native.rmdir()
    place_files(root, folder, rng)


def write_hf(
    src: str | os.PathLike[str] | Reader,
    out: str | os.PathLike[str],
    options: RestoreOptions | None = None,
    *,
    overwrite: bool | OutputPolicy = False,
    workers: int | None = None,
    fsync: bool = False,
    **fields: Any,
) -> HfResult:
    """Write OUT: the Trainer or Accelerate folder ``src`` (a path, or a reader of one) for ``dp`` x ``tp``
    processes, whole or not at all.

    ``options`` or its fields as keywords (``dp=3``, ``stage``, ``optimizer``, ...); stage and tag
    default to the source's, so the framework finds the tag it looks for.
    """
    with opened(src) as reader:
        folder = reader.facts.folder
        if folder is None:
            raise InputError(
                f"{src} is a {reader.format or 'checkpoint'}, not a Hugging Face Trainer or Accelerate folder"
            )
        opts = hf_options(reader.facts, folder, options, fields)
        return write_hf_plan(
            folder,
            reader,
            plan_native(reader.facts, opts, batch_note=False),
            out,
            overwrite=overwrite,
            workers=workers,
            fsync=fsync,
        )


def write_hf_plan(
    folder: HfFolder,
    reader: Reader,
    plan: NativePlan,
    out: str | os.PathLike[str],
    *,
    overwrite: bool | OutputPolicy = False,
    workers: int | None = None,
    fsync: bool = False,
) -> HfResult:
    """:func:`write_hf` for a planned write from any reader of the folder's checkpoint (``ucp migrate``
    hands its transformed source here): the DeepSpeed files by ``plan``, every other file of ``folder``."""
    out = Path(out)
    world = plan.dp * plan.tp
    rng = rng_plan(folder, world)
    inputs = [folder.path, *reader.inputs]
    size = weight_bytes(reader.facts, plan.dtype)
    with guarded_output(out, inputs, overwrite, size=size, durable=fsync) as root:
        _fill(root, folder, reader, plan, rng, workers)
        mark_reset(root, plan)
    result = HfResult(folder, plan, out, world, rng, list(plan.notes))
    result.notes += folder_notes(folder, world, rng)
    batch = _batch_note(reader.facts, plan.dp)
    if batch:
        result.notes.append(batch)
    for note in result.notes:
        logger.debug("%s", note)
    return result


def _write(reader: Reader, out: Path, request: Request) -> Written:
    """The whole folder for the new process count: stage and tag as the source's unless asked."""
    fields = {name: request.get(name) for name in RestoreOptions.field_names()}
    result = write_hf(reader, out, overwrite=request.overwrite, workers=request.workers, fsync=request.fsync, **fields)
    world, plan = result.world, result.plan
    summary = (
        f"wrote {'a Trainer' if result.folder.kind == 'trainer' else 'an Accelerate'} folder for {world} "
        f"process{'es' if world > 1 else ''} ({zero_label(plan.stage)}, tag {plan.tag}, {len(result.folder.files)} "
        f"files copied, {len(result.rng)} RNG files) to {out}"
    )
    return Written(
        summary,
        list(result.notes),
        {
            "format": result.folder.kind,
            "processes": world,
            "stage": plan.stage,
            "tag": plan.tag,
            "files_copied": list(result.folder.files),
            "rng_files": [new for _, new in result.rng],
        },
    )


FORMAT = TargetFormat(
    name="hf-folder",
    label="a Hugging Face Trainer or Accelerate folder",
    docs="format.md#7-hugging-face-trainer-and-accelerate-folders",
    write=_write,
    serves=lambda reader, request: folder_backend(reader, request.get("backend")) == DEEPSPEED,
)
