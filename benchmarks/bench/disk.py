"""The benchmark's footprint on disk: outputs removed between tools, the source pre-read, free space checked.

Kept apart from measure.py so that the rule "a size runs only where its checkpoint and the largest
unit's outputs fit" is stated once, next to the helpers that create and delete those outputs.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from .common import MB

#: Disk a size needs, as a multiple of its checkpoint: the checkpoint itself, plus the largest unit's outputs
#: at once (ds_to_universal's universal folder with its --keep_temp_folder scratch, about 3x, is the largest;
#: ucp's universal copy and restore output together are 2x). An 8 GB checkpoint needs about 40 GB.
NEED_FACTOR = 5.0


def remove(path: Path) -> None:
    """Delete an output and flush dirty pages, outside any timing, so the next tool starts clean."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()
    os.sync()


def fresh_dir(path: Path) -> None:
    """``remove`` then create ``path`` empty."""
    remove(path)
    path.mkdir(parents=True)


def prewarm(path: Path) -> None:
    """Read the source once so that round 1's first tool does not pay the cold-cache read alone."""
    buf = bytearray(1 << 20)  # small and reused: this process's peak RSS is every child's floor
    for file in sorted(path.rglob("*")):
        if file.is_file():
            with open(file, "rb", buffering=0) as fh:
                while fh.readinto(buf):
                    pass


def native_load_target(out: Path) -> tuple[Path, str | None]:
    """Where DeepSpeed should load a native output from: (load_dir, tag), tolerant of the layout."""
    if (out / "latest").is_file():
        return out, None
    if any(out.glob("*model_states.pt")):
        return out.parent, out.name
    tags = [d for d in out.iterdir() if d.is_dir() and any(d.glob("*model_states.pt"))] if out.is_dir() else []
    if len(tags) == 1:
        return out, tags[0].name
    raise FileNotFoundError(f"no `latest` and no single tag folder with *model_states.pt under {out}")


def space_note(out_dir: Path, size_mb: int, cached_bytes: int) -> str | None:
    """Why a size cannot run here (one line), or None when its checkpoint and outputs fit on the disk.

    ``cached_bytes``: what a cached build of that size already holds (it needs no new space).
    """
    probe = out_dir
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    need = NEED_FACTOR * size_mb * MB - cached_bytes
    if need <= free:
        return None
    return (
        f"{size_mb} MB skipped: it needs about {need / 1e9:.0f} GB free on the disk of {out_dir} "
        f"(the checkpoint and the largest tool's outputs, {NEED_FACTOR:.0f}x its size); {free / 1e9:.0f} GB are free"
    )
