"""Writing a universal directory: one folder per parameter, a manifest, atomic commit, checksums.

Layout (docs/format.md has the full spec)::

    OUT/ucp.json                              manifest, written last: its presence means OUT is whole
    OUT/zero/<folder>/fp32.pt                 {"param": fp32 tensor in the parameter's real shape}
    OUT/zero/<folder>/<key>.pt                one per optimizer state key (exp_avg.pt, exp_avg_sq.pt, ...)
    OUT/zero/<folder>/step.pt                 0-dim float32 tensor: updates applied to this parameter
    OUT/state.pt                              buffers, lr scheduler, client state, loss scaler
    OUT/zero/optimizer_state.pt, OUT/*model_states.pt, OUT/latest_universal
                                              what DeepSpeed's own ``load_universal`` reads

``<folder>`` is the parameter name when that is a safe folder name (so DeepSpeed's loader finds
it), else a reversible percent-encoding; ucp.json maps names to folders either way.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ucp.deepspeed import states as ds_states
from ucp.deepspeed.layout import LATEST_UNIVERSAL, UNIVERSAL_MODEL_FILES, UNIVERSAL_OPTIM
from ucp.errors import InputError
from ucp.io.guard import OutputPolicy, guarded_output, universal_bytes
from ucp.io.pool import default_workers, parallel_map, state_bytes
from ucp.io.span_read import read_many
from ucp.io.timing import phase
from ucp.io.torchpickle import pickle_bytes
from ucp.io.torchzip import write_pickled, write_torch_file
from ucp.model.pieces import Pieces
from ucp.model.records import Facts, ParamMeta, ParamState, PieceState, Reader
from ucp.universal.manifest import (
    FP32_FILE,
    MANIFEST,
    STATE_FILE,
    STEP_FILE,
    FileEntry,
    ParamEntry,
    folder_for,
    manifest_json,
    source_layouts,
    state_file,
    write_manifest,
)
from ucp.universal.param_table import ParamTable

__all__ = ["write_universal", "write_params", "finish_universal"]

logger = logging.getLogger(__name__)


def _save(obj: Any, path: Path) -> FileEntry:
    """Every file of the directory: one pass over the bytes, deterministic output, checksum for free."""
    written = write_torch_file(obj, path)
    return FileEntry(bytes=written.bytes, crc32=written.crc32)


def _save_state(value: torch.Tensor | Pieces | Raw, path: Path) -> FileEntry:
    """A state tensor's file: ``{"param": tensor}``."""
    if isinstance(value, Raw):
        written = write_pickled(pickle_bytes("param", value.shape, value.dtype, value.data), path)
        return FileEntry(bytes=written.bytes, crc32=written.crc32)
    return _save({"param": value}, path)


def _save_step(step: int, path: Path) -> FileEntry:
    """``step.pt``: a 0-dim float32 tensor (its pickle made from its four bytes, not a tensor)."""
    written = write_pickled(pickle_bytes(None, (), torch.float32, struct.pack("<f", float(step))), path)
    return FileEntry(bytes=written.bytes, crc32=written.crc32)


@dataclass(frozen=True, slots=True)
class Raw:
    """A tensor as its shape, dtype and bytes in memory (a slice of a batch's buffer)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    data: memoryview


@dataclass(slots=True)
class RawState:
    """A :class:`ParamState` whose tensors are :class:`Raw`."""

    fp32: Raw
    optim: dict[str, Raw]
    step: int | None
    scalars: dict[str, torch.Tensor]


def _write_param(root: Path, meta: ParamMeta, state: ParamState | PieceState | RawState) -> ParamEntry:
    if tuple(state.fp32.shape) != meta.shape:
        raise InputError(f"{meta.name}: source gave shape {tuple(state.fp32.shape)}, expected {meta.shape}")
    folder = folder_for(meta.name)
    target = root / "zero" / folder
    try:
        target.mkdir(parents=True, exist_ok=False)
    except FileExistsError:  # two names that one case-insensitive file system cannot tell apart
        raise InputError(
            f"parameter {meta.name!r} needs folder {folder!r}, which another parameter's folder already "
            "takes on this file system (names differing only in case?); convert onto a "
            "case-sensitive file system"
        ) from None
    entry = ParamEntry(meta.name, folder, list(meta.shape), meta.dtype, meta.group, meta.frozen, state.step)
    entry.files[FP32_FILE] = _save_state(state.fp32, target / FP32_FILE)
    if not meta.frozen:
        for key, tensor in state.optim.items():
            if state_file(key) in (FP32_FILE, STEP_FILE) or not folder_for(key) == key:
                raise InputError(
                    f"{meta.name}: the optimizer keeps state under {key!r}, which cannot be a file name "
                    "of a universal directory"
                )
            entry.files[state_file(key)] = _save_state(tensor, target / state_file(key))
    if not meta.frozen:
        for key, value in state.scalars.items():
            if state_file(key) in entry.files or state_file(key) == STEP_FILE or not folder_for(key) == key:
                raise InputError(f"{meta.name}: the optimizer keeps scalar {key!r}, which cannot be a file name here")
            entry.files[state_file(key)] = _save({"param": value}, target / state_file(key))
            entry.scalars.append(key)
    if not meta.frozen and state.step is not None:
        entry.files[STEP_FILE] = _save_step(state.step, target / STEP_FILE)
    return entry


def _ds_compat_files(root: Path, facts: Facts, extras: Mapping[str, Any], buffers: Mapping[str, torch.Tensor]) -> None:
    """What DeepSpeed's ``load_universal`` reads besides the per-parameter folders."""
    write_torch_file(ds_states.universal_optimizer_state(facts, extras), root / UNIVERSAL_OPTIM)
    model_states = ds_states.universal_model_states(facts, extras, buffers)
    for name in UNIVERSAL_MODEL_FILES:
        write_torch_file(model_states, root / name)
    # engine.load_checkpoint(OUT) with load_universal reads the tag from this file; "." is OUT itself
    (root / LATEST_UNIVERSAL).write_text(".")


#: a parameter whose states take at most this many bytes is read together with its neighbours (:func:`_write_batch`)
SMALL_PARAM = 1 << 20
#: the bytes, and the parameters, one batch of small parameters holds at most (a reader may hold a file open for each)
BATCH_BYTES = 8 << 20
BATCH_PARAMS = 64


def write_params(
    reader: Reader,
    root: Path,
    metas: list[ParamMeta],
    workers: int,
) -> ParamTable:
    """Write the per-parameter folders of ``metas`` under ``root/zero``; returns their manifest entries, in a
    :class:`ParamTable` (a few words a parameter: a list of 10^5 entries held 170 MB until the manifest was written).

    Each state comes from :meth:`Reader.read_pieces`: a large parameter's slices go from the source's files straight
    into the output records, never held whole in memory; small ones are read in batches (:func:`_write_batch`).
    """
    size = state_bytes(reader.facts)

    def one(batch: list[ParamMeta]) -> list[ParamEntry]:
        if len(batch) == 1 and size(batch[0]) > SMALL_PARAM:
            with reader.read_pieces(batch[0].name) as pieces:
                return [_write_param(root, batch[0], pieces)]
        return _write_batch(reader, root, batch)

    table = ParamTable()
    batches = _batches(metas, size)
    weight = lambda batch: sum(map(size, batch))  # noqa: E731
    for entries in parallel_map(one, batches, workers, desc="to-universal", weight=weight):
        for entry in entries:
            table.add_entry(entry)
    table.finish()
    return table


def _batches(metas: list[ParamMeta], size: Callable[[ParamMeta], int]) -> list[list[ParamMeta]]:
    """Runs of neighbouring small parameters (at most :data:`BATCH_BYTES` and :data:`BATCH_PARAMS` each), and each
    large one alone, in order."""
    batches: list[list[ParamMeta]] = []
    run: list[ParamMeta] = []
    held = 0
    for meta in metas:
        nbytes = size(meta)
        if nbytes > SMALL_PARAM:
            if run:
                batches.append(run)
            batches.append([meta])
            run, held = [], 0
            continue
        if run and (held + nbytes > BATCH_BYTES or len(run) >= BATCH_PARAMS):
            batches.append(run)
            run, held = [], 0
        run.append(meta)
        held += nbytes
    if run:
        batches.append(run)
    return batches


def _write_batch(reader: Reader, root: Path, batch: list[ParamMeta]) -> list[ParamEntry]:
    """Small parameters: every state of the batch read into one buffer at once (:func:`ucp.io.span_read.read_many`:
    at 10^5 parameters a ``preadv`` per run of neighbours in a source file instead of a ``pread`` per rank slice), then
    each file written from memory in one ``writev``, its checksum known before its header goes out."""
    with ExitStack() as stack:
        states = [stack.enter_context(reader.read_pieces(meta.name)) for meta in batch]
        wholes = [[state.fp32, *state.optim.values()] for state in states]
        buffer = torch.empty(sum(p.numel * p.dtype.itemsize for ps in wholes for p in ps), dtype=torch.uint8)
        view = memoryview(buffer.numpy()).cast("B")  # type: ignore[arg-type]
        jobs, raws, at = [], [], 0
        for pieces in wholes:
            made = []
            for p in pieces:
                nbytes = p.numel * p.dtype.itemsize
                jobs.append((p.parts, view[at : at + nbytes]))
                made.append(Raw(p.shape, p.dtype, view[at : at + nbytes]))
                at += nbytes
            raws.append(made)
        read_many(jobs)
        return [
            _write_param(
                root,
                meta,
                RawState(fp32=made[0], optim=dict(zip(state.optim, made[1:])), step=state.step, scalars=state.scalars),
            )
            for meta, state, made in zip(batch, states, raws)
        ]


def write_universal(
    reader: Reader,
    out: str | os.PathLike,
    *,
    overwrite: bool | OutputPolicy = False,
    workers: int | None = None,
    fsync: bool = False,
    listed: bool = True,
) -> dict[str, Any]:
    """Stream every parameter of ``reader`` into a universal directory at ``out``; returns the manifest (without
    ``listed``, without its ``params``: a caller that wants only the rest saves a dict per parameter, 1.5 KB each).

    Memory stays near ``2 x workers`` parameters.
    OUT appears whole or not at all; ``fsync`` also makes it survive a power loss. OUT never overlaps the reader's
    inputs; ``overwrite`` replaces an earlier output of ucp (``ucp.io.guard``).
    """
    size = universal_bytes(reader.facts)
    with guarded_output(out, reader.inputs, overwrite, size=size, durable=fsync) as root:
        (root / "zero").mkdir()
        with phase("write every parameter's files"):
            entries = write_params(reader, root, reader.facts.params, workers or default_workers())
        layouts = source_layouts(reader)
        with phase("write the shared state and ucp.json"):
            manifest = finish_universal(
                root, reader.facts, entries, reader.extras(), reader.buffers(), layouts=layouts, listed=listed
            )
    return manifest


def finish_universal(
    root: Path,
    facts: Facts,
    entries: ParamTable,
    extras: Mapping[str, Any],
    buffers: Mapping[str, torch.Tensor],
    *,
    layouts: Mapping[str, Any] | None = None,
    listed: bool = True,
) -> dict[str, Any]:
    """Write the shared state and, last, the manifest of a universal directory being built at root;
    ``layouts`` (:func:`~ucp.universal.manifest.source_layouts`) record the source's stages and experts."""
    files = {STATE_FILE: _save({"buffers": dict(buffers), **dict(extras)}, root / STATE_FILE)}
    _ds_compat_files(root, facts, extras, buffers)
    manifest = manifest_json(facts, [], files, layouts)
    tmp = root / (MANIFEST + ".tmp")
    with open(tmp, "w", encoding="utf-8") as out:
        write_manifest(out, manifest, entries.entries())  # entry by entry: never the whole text or every dict at once
    os.replace(tmp, root / MANIFEST)
    if listed:  # what callers get back, as ucp.json holds it
        manifest["params"] = [entry.to_json() for entry in entries.entries()]
    return manifest
