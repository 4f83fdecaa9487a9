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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ucp.deepspeed import states as ds_states
from ucp.deepspeed.layout import LATEST_UNIVERSAL, UNIVERSAL_MODEL_FILES, UNIVERSAL_OPTIM
from ucp.errors import InputError
from ucp.io.guard import OutputPolicy, guarded_output, universal_bytes
from ucp.io.pool import FILE_GRAIN, default_workers, parallel_map, state_bytes
from ucp.io.timing import phase
from ucp.io.torchzip import write_torch_file
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


def _write_param(root: Path, meta: ParamMeta, state: ParamState | PieceState) -> ParamEntry:
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
    entry.files[FP32_FILE] = _save({"param": state.fp32}, target / FP32_FILE)
    if not meta.frozen:
        for key, tensor in state.optim.items():
            if state_file(key) in (FP32_FILE, STEP_FILE) or not folder_for(key) == key:
                raise InputError(
                    f"{meta.name}: the optimizer keeps state under {key!r}, which cannot be a file name "
                    "of a universal directory"
                )
            entry.files[state_file(key)] = _save({"param": tensor}, target / state_file(key))
    if not meta.frozen:
        for key, value in state.scalars.items():
            if state_file(key) in entry.files or state_file(key) == STEP_FILE or not folder_for(key) == key:
                raise InputError(f"{meta.name}: the optimizer keeps scalar {key!r}, which cannot be a file name here")
            entry.files[state_file(key)] = _save({"param": value}, target / state_file(key))
            entry.scalars.append(key)
    if not meta.frozen and state.step is not None:
        entry.files[STEP_FILE] = _save(torch.tensor(float(state.step), dtype=torch.float32), target / STEP_FILE)
    return entry


def _ds_compat_files(root: Path, facts: Facts, extras: Mapping[str, Any], buffers: Mapping[str, torch.Tensor]) -> None:
    """What DeepSpeed's ``load_universal`` reads besides the per-parameter folders."""
    write_torch_file(ds_states.universal_optimizer_state(facts, extras), root / UNIVERSAL_OPTIM)
    model_states = ds_states.universal_model_states(facts, extras, buffers)
    for name in UNIVERSAL_MODEL_FILES:
        write_torch_file(model_states, root / name)
    # engine.load_checkpoint(OUT) with load_universal reads the tag from this file; "." is OUT itself
    (root / LATEST_UNIVERSAL).write_text(".")


def write_params(
    reader: Reader,
    root: Path,
    metas: list[ParamMeta],
    workers: int,
) -> ParamTable:
    """Write the per-parameter folders of ``metas`` under ``root/zero``; returns their manifest entries, in a
    :class:`ParamTable` (a few words a parameter: a list of 10^5 entries held 170 MB until the manifest was written).

    Each state comes from :meth:`Reader.read_pieces`: a streaming source's slices go from its files
    into the output records, never held whole in memory.
    """

    def one(meta: ParamMeta) -> ParamEntry:
        with reader.read_pieces(meta.name) as pieces:
            return _write_param(root, meta, pieces)

    table = ParamTable()
    weight = state_bytes(reader.facts)
    for entry in parallel_map(one, metas, workers, desc="to-universal", weight=weight, least=FILE_GRAIN):
        table.add_entry(entry)
    table.finish()
    return table


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
