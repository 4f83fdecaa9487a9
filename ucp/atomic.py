"""Whole-or-nothing outputs: build beside OUT under a temporary name, check, then rename into place.

A kill at any moment leaves either no OUT (plus a ``.OUT.ucp-partial-*`` folder that the next run
clears) or a whole OUT. An existing OUT is never touched unless ``overwrite`` is given, and then it
is only moved aside after the new one is complete.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import shutil
import zlib
from pathlib import Path
from typing import Iterator

from ucp.errors import OutputExistsError, UcpError

__all__ = ["staged_output", "checksum", "fsync_tree", "PARTIAL_MARK"]

logger = logging.getLogger(__name__)
PARTIAL_MARK = ".ucp-partial-"


def checksum(path: Path) -> str:
    """crc32 of a file's bytes as 8 hex digits (integrity against corruption, not tampering)."""
    size = path.stat().st_size
    if size == 0:
        return "00000000"
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        crc = 0
        step = 1 << 26
        for start in range(0, size, step):
            crc = zlib.crc32(mm[start : start + step], crc)
    return f"{crc & 0xFFFFFFFF:08x}"


def fsync_tree(root: Path) -> None:
    """Flush every file and folder under root, so a rename after it publishes durable data."""
    for folder, _dirs, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _clear_stale(out: Path) -> None:
    for stale in out.parent.glob(f".{out.name}{PARTIAL_MARK}*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and _alive(int(pid)):
            continue
        logger.info("removing %s left by an interrupted run", stale)
        shutil.rmtree(stale, ignore_errors=True)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def staged_output(out: str | os.PathLike, *, overwrite: bool = False, durable: bool = True) -> Iterator[Path]:
    """Yield a fresh staging folder; on clean exit it becomes ``out``, on error it is removed."""
    out = Path(out).absolute()
    if out.exists() and not overwrite:
        raise OutputExistsError(f"{out} already exists; pass --overwrite to replace it")
    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"{out} exists and is not a folder; refusing to replace it")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UcpError(f"cannot create {out.parent}: {err.strerror}") from None
    _clear_stale(out)
    staging = out.parent / f".{out.name}{PARTIAL_MARK}{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
        if durable:
            fsync_tree(staging)
        if out.exists():
            aside = out.parent / f".{out.name}{PARTIAL_MARK}old-{os.getpid()}"
            os.rename(out, aside)
            os.rename(staging, out)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.rename(staging, out)
        _fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
