"""What every Trainer or Accelerate folder a target writes has around its model and optimizer state, whichever backend
holds that state (``ucp.targets.hf``: DeepSpeed's tag; ``ucp.targets.hf_fsdp``: Accelerate's FSDP save): the source
folder's other files copied unchanged (as bytes: nothing is unpickled), an RNG file for each new process (new process r
takes old process r mod W_old), and the notes a user reads before resuming.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ucp.errors import InputError
from ucp.model.layouts import RunFolder
from ucp.model.records import Reader

__all__ = ["folder_backend", "copy_entry", "place_files", "folder_notes", "folder_batch_note", "processes"]


def processes(n: int) -> str:
    return f"{n} process" if n == 1 else f"{n} processes"


def folder_backend(reader: Reader, asked: str | None) -> str | None:
    """The backend the new folder is written for: the one asked, else the source folder's (None: no folder)."""
    folder = reader.facts.folder
    return None if folder is None else asked or folder.backend


def copy_entry(src: Path, dst: Path) -> None:
    """A plain file or folder of the source, copied as bytes (a link or a device is refused in one line)."""
    if src.is_symlink() or not (src.is_file() or src.is_dir()):
        raise InputError(f"{src} is not a plain file or folder; ucp copies only those")
    if src.is_dir():
        shutil.copytree(src, dst, symlinks=False)
    else:
        shutil.copyfile(src, dst)


def place_files(
    root: Path, folder: RunFolder, rng: list[tuple[str, str]], *, skip: frozenset[str] = frozenset()
) -> None:
    """Every other entry of the source folder but ``skip`` (files the target writes itself), and the RNG files."""
    for name in folder.files:
        if name not in skip:
            copy_entry(folder.path / name, root / name)
    for old, new in rng:
        shutil.copyfile(folder.path / old, root / new)


def folder_notes(folder: RunFolder, world: int, rng: list[tuple[str, str]]) -> list[str]:
    """What the new folder cannot carry exactly: the random streams at another process count, other tags."""
    notes = []
    old = len(folder.rng_files)
    if not rng:
        notes.append(f"{folder.path} has no RNG files; the resumed run starts from its own seed")
    elif old != world:
        notes.append(
            f"RNG files: new process r takes old process r mod {old} "
            f"({', '.join(f'{new} <- {src}' for src, new in rng)}); the old random streams are not "
            f"reproduced exactly at {processes(world)} (dropout and sampling draw differently)"
        )
    if folder.skipped:
        notes.append(f"not carried: {', '.join(folder.skipped)} (shards of another tag, for the old size)")
    return notes


def folder_batch_note(folder: RunFolder, new_world: int) -> str | None:
    """What keeps the global batch at ``new_world`` processes, from what an FSDP run's folder records: Trainer's
    ``train_batch_size`` (per device) and the RNG files' count; the gradient accumulation is not recorded there."""
    micro = (folder.trainer_state or {}).get("train_batch_size")
    old = folder.old_world
    if not isinstance(micro, int) or isinstance(micro, bool) or micro < 1 or old is None or old == new_world:
        return None
    total = micro * old
    head = (
        f"the old run took {micro} samples per device at {processes(old)} ({total} per accumulation step, times its "
        "gradient_accumulation_steps, which the folder does not record)"
    )
    if total % new_world:
        return f"{head}; no per-device batch keeps {total} at {processes(new_world)}: change the accumulation instead"
    return (
        f"{head}; to keep the global batch at {processes(new_world)} pass --per_device_train_batch_size "
        f"{total // new_world} with the old --gradient_accumulation_steps"
    )
