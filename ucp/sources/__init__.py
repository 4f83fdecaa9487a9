"""Sources: read a checkpoint into :class:`ucp.records.Reader` form.

``open_reader`` decides what PATH is (a universal directory, or a DeepSpeed checkpoint of some ZeRO
stage) and returns the matching reader; nothing downstream branches on the stage.
"""

from __future__ import annotations

from pathlib import Path

from ucp.errors import InputError
from ucp.records import Reader
from ucp.sources.files import find_checkpoint

__all__ = ["open_reader", "is_universal"]


def is_universal(path: str | Path) -> bool:
    return (Path(path) / "ucp.json").is_file()


def open_reader(path: str | Path, *, tag: str | None = None, optimizer: str | None = None,
                verify: bool = True) -> Reader:
    """A reader for a universal directory or a DeepSpeed ZeRO checkpoint (folder or tag folder)."""
    path = Path(path)
    if is_universal(path):
        from ucp.universal import open_universal

        return open_universal(path, verify=verify)
    files = find_checkpoint(path, tag)
    if files.mp > 1:
        raise InputError(f"{files.tag_dir} has {files.mp} model-parallel ranks; convert one with --mp-rank "
                         "(tensor-parallel merging is not supported yet)")
    if files.stage3:
        from ucp.sources.zero3 import Zero3Source

        return Zero3Source(files, optimizer=optimizer)
    try:
        from ucp.sources.zero12 import Zero12Source
    except ImportError:
        raise InputError(f"{files.tag_dir} is a ZeRO-1/2 checkpoint; this ucp reads ZeRO-3 only") from None
    return Zero12Source(files, optimizer=optimizer)
