"""Whole-or-nothing outputs: build beside OUT under a temporary name, check, then rename into place.

A kill at any moment leaves either no OUT or a whole OUT (the old one or the new one), plus at most
a ``.OUT.ucp-partial-*`` folder that the next run for OUT clears. An existing OUT is never touched
unless ``overwrite`` is given, and then it is only replaced once the new one is complete: on Linux
the two folders swap in one ``renameat2(RENAME_EXCHANGE)``; elsewhere the old one is first moved
aside to ``.OUT.ucp-old-*``, which the next run puts back if a kill struck between the two renames.

Folders named ``*.ucp-partial-*`` are always garbage and may be deleted; ``*.ucp-old-*`` folders
are always whole (they are renamed to a partial name before anything deletes them).

Every published OUT carries an :data:`OWNER_MARK` file: how a later ``--overwrite`` knows that the
folder it would replace is a previous output of ucp and not someone else's (``ucp.io.guard``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import logging
import mmap
import os
import re
import secrets
import shutil
import signal
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

from ucp.errors import OutputExistsError, Stopped, UcpError, WriteError
from ucp.io.signals import held_signals, raise_if_stopped, stopped_by
from ucp.io.timing import phase
from ucp.model.version import VERSION

__all__ = [
    "staged_output",
    "checksum",
    "fsync_tree",
    "mark_owned",
    "owner_kind",
    "owner_mark",
    "remove_own_partials",
    "publish_new",
    "remove_tree",
    "PARTIAL_MARK",
    "OLD_MARK",
    "OWNER_MARK",
]

logger = logging.getLogger(__name__)
PARTIAL_MARK = ".ucp-partial-"
OLD_MARK = ".ucp-old-"
#: the file in every folder ucp made: {"created_by": "ucp X", "kind": "output" | "demo"}
OWNER_MARK = ".ucp-output"
_MARK_LIMIT = 4096

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2


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
        _fsync_dir(Path(folder))


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- who made a folder -----------------------------------------------------------------------
def mark_owned(folder: Path, kind: str = "output", **facts: str) -> None:
    """Stamp ``folder`` as ucp's (deterministic bytes: two runs write the same file); ``facts`` say more about what
    ucp wrote there that its files cannot (``optimizer_reset``: the flavour of an optimizer restored reset)."""
    text = json.dumps({"created_by": f"ucp {VERSION}", "kind": kind, **facts}, sort_keys=True) + "\n"
    (folder / OWNER_MARK).write_text(text)


def owner_kind(folder: Path) -> str | None:
    """The kind named by ucp's stamp in ``folder``; None when it has none (or a symlink, or garbage)."""
    data = owner_mark(folder)
    kind = data.get("kind") if data is not None else None
    return kind if isinstance(kind, str) else None


def owner_mark(folder: Path) -> dict[str, object] | None:
    """ucp's stamp in ``folder`` as a dict; None when it has none (or a symlink, or garbage)."""
    mark = folder / OWNER_MARK
    try:
        fd = os.open(mark, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as handle:
            raw = handle.read(_MARK_LIMIT + 1)
        data = json.loads(raw) if len(raw) <= _MARK_LIMIT else None
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not str(data.get("created_by", "")).startswith("ucp "):
        return None
    return data


# -- renames ----------------------------------------------------------------------------------
def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """Linux renameat2; False when this system or filesystem does not offer it (caller falls back)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(src), None, str(dst))


def publish_new(staging: Path, out: Path) -> None:
    """staging (a folder or a file) -> out, failing (never replacing) if out appeared meanwhile."""
    try:
        if _renameat2(staging, out, _RENAME_NOREPLACE):
            return
        if os.path.lexists(out):
            raise FileExistsError(errno.EEXIST, "exists", str(out))
        os.rename(staging, out)  # an empty folder created at out since the check would be replaced
    except OSError as err:
        if err.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise OutputExistsError(
                f"{out} appeared while it was being written; the new output was discarded, "
                "pass --overwrite to replace it"
            ) from None
        raise


def _publish_over(staging: Path, out: Path, token: str) -> None:
    """Replace out with staging; at every instant out is the old whole folder or the new one."""
    if _renameat2(staging, out, _RENAME_EXCHANGE):
        # staging now holds the old folder, under a partial name: garbage from here on
        remove_tree(staging)
        return
    aside = out.parent / f".{out.name}{OLD_MARK}{token}-{os.getpid()}"
    try:
        os.rename(out, aside)
        os.rename(staging, out)
    except BaseException:  # a failure or a signal between the two renames: the old OUT goes back
        if os.path.lexists(aside) and not os.path.lexists(out):
            os.rename(aside, out)
        raise
    doomed = out.parent / f".{out.name}{PARTIAL_MARK}old-{token}-{os.getpid()}"
    os.rename(aside, doomed)
    remove_tree(doomed)


# -- leftovers of interrupted runs ------------------------------------------------------------
def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OverflowError:
        return False
    return True


def _leftovers(out: Path) -> Iterator[tuple[Path, bool, int]]:
    """(path, is an old whole OUT, owner pid) for every leftover of a run that wrote out."""
    pattern = re.compile(rf"\.{re.escape(out.name)}\.ucp-(partial|old)-(?:old-)?(?:[0-9a-f]{{8}}-)?(\d+)")
    try:
        names = sorted(os.listdir(out.parent))
    except OSError:
        return
    for name in names:
        match = pattern.fullmatch(name)
        if match:
            yield out.parent / name, match.group(1) == "old", int(match.group(2))


def remove_own_partials(out: str | os.PathLike) -> None:
    """Remove this process's staging folders for OUT: the last word after a failure or a signal, for a
    writer stopped between creating its staging folder and the code that would have removed it."""
    for path, whole, pid in _leftovers(Path(out).absolute()):
        if not whole and pid == os.getpid():
            remove_tree(path)


def _clear_stale(out: Path) -> None:
    """Remove partial folders of dead runs for out; put back an old OUT a dead run left aside."""
    for path, whole, pid in _leftovers(out):
        if _alive(pid):
            continue
        if whole and not os.path.lexists(out):
            logger.warning("putting back %s, which an interrupted --overwrite run had moved aside to %s", out, path)
            os.rename(path, out)
            continue
        logger.info("removing %s left by an interrupted run", path)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                path.unlink()


@contextlib.contextmanager
def staged_output(
    out: str | os.PathLike,
    *,
    overwrite: bool = False,
    durable: bool = True,
    check: Callable[[Path], None] | None = None,
) -> Iterator[Path]:
    """Yield a fresh staging folder beside ``out``; on clean exit it becomes ``out``, on error it goes.

    Call order: the caller fills the yielded folder (its metadata file last); on leaving the
    ``with`` block the folder gets its :data:`OWNER_MARK` (unless it is built inside another
    staging folder, whose output it is part of), ``check(staging)`` runs if given (raise to refuse
    the result), the tree is fsynced when ``durable``, and only then is it renamed to ``out``. Any
    exception, a signal's included (``ucp.io.signals``), removes the staging folder and any folder
    made to hold OUT.
    """
    out = Path(out).absolute()
    if not out.name or out.name in (".", ".."):
        raise UcpError(f"{out} cannot be an output folder; name a folder to create")
    made = _make_parents(out.parent)
    try:
        yield from _staged(out, overwrite, durable, check)
    except BaseException:
        for folder in made:  # the folders made for OUT go too, if nothing else has moved in
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise


def _make_parents(folder: Path) -> list[Path]:
    """mkdir -p; returns the folders it made, deepest first."""
    missing = [f for f in (folder, *folder.parents) if not f.exists()]
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise WriteError(f"cannot create {folder}: {err.strerror}") from None
    return missing


def _staged(out: Path, overwrite: bool, durable: bool, check: Callable[[Path], None] | None) -> Iterator[Path]:
    """staged_output once OUT's folder exists."""
    _clear_stale(out)
    if os.path.lexists(out):
        if not overwrite:
            raise OutputExistsError(f"{out} already exists; pass --overwrite to replace it")
        if not out.is_dir():
            raise OutputExistsError(f"{out} exists and is not a folder; refusing to replace it")
    token = secrets.token_hex(4)
    staging = out.parent / f".{out.name}{PARTIAL_MARK}{token}-{os.getpid()}"
    try:  # mkdir inside: a signal just after it must not leave the folder behind
        try:
            staging.mkdir()
        except OSError as err:
            raise WriteError(f"cannot create {staging} beside {out}: {err.strerror}") from None
        yield staging
        with phase(f"publish {out}" + (" (fsync)" if durable else "")):
            if PARTIAL_MARK not in out.parent.name and not (staging / OWNER_MARK).exists():
                mark_owned(staging)  # unless the writer stamped it with more
            if check is not None:
                check(staging)
            if durable:
                fsync_tree(staging)
            raise_if_stopped()  # a stop signal whose exception a library swallowed: still never publish
            if os.path.lexists(out) and overwrite:
                _publish_over(staging, out, token)
            else:
                publish_new(staging, out)
            _fsync_dir(out.parent)
    except BaseException:
        remove_tree(staging)
        raise


def remove_tree(folder: Path) -> None:
    """rmtree that a signal cannot cut short: a stop signal while it runs is only noted (an exception
    inside rmtree can leave it closing a descriptor twice, an OSError), then raised once the folder is
    gone, unless the command is already stopping."""
    with held_signals() as got:
        shutil.rmtree(folder, ignore_errors=True)
    if got and stopped_by() is None:
        raise Stopped(got[0], signal.Signals(got[0]).name)
