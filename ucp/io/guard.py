"""May this write OUT here? One owner for the rules every function that writes follows.

Every writer of the API (``write_universal``, ``write_native``, ``write_dcp``, ``export``, ``write_hf``, the
pipeline and expert writers; the CLI and ``ucp migrate`` call those) builds its output inside
:func:`guarded_output` (:func:`guarded` for a file OUT), which runs :func:`check_output` against the reader's
:attr:`~ucp.model.records.Reader.inputs` before anything is staged, then the write inside :func:`writing`.
``ucp migrate`` also checks all its outputs up front, before the first one is written.

* OUT never is, lies inside, or holds one of the command's inputs, with or without
  ``--overwrite``: the resolved paths are compared, then the (device, inode) of OUT, the input and
  every folder above them (symlinks followed, bind mounts seen through);
* an existing OUT is replaced only with ``--overwrite``, and only when ucp made it (its
  :data:`~ucp.io.atomic.OWNER_MARK`) or it is an empty folder; any other folder also needs
  ``--overwrite-foreign``. A file at OUT (an export to ``model.safetensors``) is the writer's to
  judge: an export replaces it with ``--overwrite``, a folder output refuses it;
* the file system holding OUT has room for a lower-bound estimate of the output
  (``--no-space-check`` skips this);
* a write that fails for want of space, quota, permission or a working disk becomes one
  :class:`~ucp.errors.WriteError` line; by then ``staged_output`` has removed the staging folder.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from ucp.errors import OutputExistsError, OutputOverlapError, UcpError, WriteError
from ucp.io.atomic import OLD_MARK, OWNER_MARK, PARTIAL_MARK, owner_kind, remove_own_partials, staged_output
from ucp.model.records import Facts

__all__ = [
    "OutputPolicy",
    "as_policy",
    "guarded",
    "guarded_output",
    "check_output",
    "check_space",
    "writing",
    "fault_message",
    "universal_bytes",
    "weight_bytes",
]

logger = logging.getLogger(__name__)

#: errno -> what the one line says; the faults a write can meet that are the machine's, not ucp's
_FAULTS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EIO: "input/output error (a failing disk or network file system?)",
}
#: how Rust's std::io::Error shows an errno (safetensors writes through it): "... (os error 28)"
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")
_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class OutputPolicy:
    """What the user allowed: replacing ucp's own outputs, replacing anything, skipping the space check."""

    overwrite: bool = False
    foreign: bool = False
    space_check: bool = True


def as_policy(overwrite: bool | OutputPolicy) -> OutputPolicy:
    """A writer's ``overwrite`` argument as a policy: ``True`` replaces an earlier output of ucp (never another
    folder, never an input); an :class:`OutputPolicy` says more (foreign folders, the space check)."""
    if isinstance(overwrite, OutputPolicy):
        return overwrite
    return OutputPolicy(overwrite=bool(overwrite))


Inputs = Mapping[str, "str | os.PathLike[str]"] | Iterable["str | os.PathLike[str]"]


def _roles(inputs: Inputs) -> dict[str, str | os.PathLike[str]]:
    """Inputs by role: a mapping as it is, a list of paths as the source's (``source``, ``source 2``, ...)."""
    if isinstance(inputs, Mapping):
        return dict(inputs)
    paths = list(inputs)
    return {("source" if i == 0 else f"source {i + 1}"): p for i, p in enumerate(paths)}


@contextlib.contextmanager
def guarded(
    out: str | os.PathLike[str], inputs: Inputs, overwrite: bool | OutputPolicy = False, *, size: int = 0
) -> Iterator[OutputPolicy]:
    """The guard around a write of OUT: :func:`check_output` against ``inputs``, then the write (the ``with``
    body) inside :func:`writing` with ``size`` (estimated bytes) for the space check. Yields the policy."""
    policy = as_policy(overwrite)
    check_output(out, _roles(inputs), policy)
    with writing({Path(out): size}, policy):
        yield policy


@contextlib.contextmanager
def guarded_output(
    out: str | os.PathLike[str],
    inputs: Inputs,
    overwrite: bool | OutputPolicy = False,
    *,
    size: int = 0,
    durable: bool = False,
    check: Callable[[Path], None] | None = None,
) -> Iterator[Path]:
    """The one door through which a writer makes a folder OUT: :func:`guarded`, then
    :func:`ucp.io.atomic.staged_output` (yields the staging folder; OUT appears whole or not at all)."""
    with guarded(out, inputs, overwrite, size=size) as policy:
        with staged_output(out, overwrite=policy.overwrite, durable=durable, check=check) as root:
            yield root


# -- paths ------------------------------------------------------------------------------------
def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino


def _above(real: Path) -> set[tuple[int, int]]:
    """(device, inode) of every existing folder above ``real`` (itself excluded)."""
    return {ident for ident in map(_identity, real.parents) if ident is not None}


def _overlap(out: Path, src: Path) -> str | None:
    """How OUT meets the input: 'is', 'lies inside' or 'holds'; None when they are apart."""
    out_real, src_real = Path(os.path.realpath(out)), Path(os.path.realpath(src))
    if out_real == src_real:
        return "is"
    if src_real in out_real.parents:
        return "lies inside"
    if out_real in src_real.parents:
        return "holds"
    out_id, src_id = _identity(out_real), _identity(src_real)
    if src_id is not None and out_id == src_id:
        return "is"
    if src_id is not None and src_id in _above(out_real):
        return "lies inside"
    if out_id is not None and out_id in _above(src_real):
        return "holds"
    return None


def _is_empty_folder(path: Path) -> bool:
    try:
        with os.scandir(path) as entries:
            return next(entries, None) is None
    except OSError:
        return False


def check_output(out: str | os.PathLike, inputs: Mapping[str, str | os.PathLike], policy: OutputPolicy) -> None:
    """Refuse OUT when it overlaps an input (``inputs``: role -> path, e.g. ``{"source": SRC}``) or
    when an existing OUT may not be replaced under ``policy``. Changes nothing on disk."""
    out = Path(out)
    for role, path in inputs.items():
        relation = _overlap(out, Path(path))
        if relation is not None:
            detail = "both name the same place" if relation == "is" else f"{out} {relation} it"
            raise OutputOverlapError(
                f"{out} overlaps the {role} {path}: {detail}; ucp never replaces, deletes or writes into an "
                "input, with or without --overwrite: write the output somewhere else"
            )
    if not os.path.lexists(out):
        return
    if not policy.overwrite:
        raise OutputExistsError(f"{out} already exists; pass --overwrite to replace it")
    if not out.is_dir() or policy.foreign or owner_kind(out) is not None or _is_empty_folder(out):
        return
    raise OutputExistsError(
        f"{out} is a folder ucp did not write (it holds no {OWNER_MARK}); --overwrite replaces only ucp's "
        "own outputs: add --overwrite-foreign to replace it anyway, or write elsewhere"
    )


# -- room -------------------------------------------------------------------------------------
def _existing(path: Path) -> Path:
    """``path`` or its nearest existing ancestor: where the output's file system is asked about."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return path


def _free(path: Path) -> int:
    st = os.statvfs(_existing(path))
    return st.f_bavail * st.f_frsize


def _size(n: int) -> str:
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def check_space(sizes: Mapping[Path, int]) -> None:
    """Refuse when a file system clearly lacks room: the outputs on it (OUT -> bytes, lower bounds)
    need more than it has free. The old OUT of an overwrite is no credit: it goes only at the end."""
    per_fs: dict[int, tuple[Path, int, list[str]]] = {}
    for out, need in sizes.items():
        probe = _existing(Path(out).absolute())
        try:
            dev = os.stat(probe).st_dev
        except OSError:
            continue
        where, total, names = per_fs.get(dev, (probe, 0, []))
        per_fs[dev] = (where, total + need, [*names, str(out)])
    for probe, need, names in per_fs.values():
        try:
            free = _free(probe)
        except OSError:
            continue
        if need > free:
            raise WriteError(
                f"not enough space for {' and '.join(names)}: it needs about {_size(need)}, the file system "
                f"holding {probe} has {_size(free)} free; free some space, write elsewhere, or pass --no-space-check"
            )


def universal_bytes(facts: Facts) -> int:
    """A universal directory's size: every fp32 master and every state tensor the optimizer keeps."""
    keys = {g.index: len(g.state_keys) for g in facts.groups}
    tensors = [1 if p.frozen or p.group is None else 1 + keys.get(p.group, 0) for p in facts.params]
    return sum(4 * p.numel * n for p, n in zip(facts.params, tensors))


def weight_bytes(facts: Facts, dtype: str | None = None) -> int:
    """The parameters at ``dtype`` (default: each one's model dtype): the least any restore or export writes."""
    return sum(p.numel * _DTYPE_BYTES.get(dtype or p.dtype, 1) for p in facts.params)


# -- faults while writing ---------------------------------------------------------------------
def _os_error(err: BaseException) -> tuple[int, str | None] | None:
    """The errno (and file) behind ``err``: itself, its causes, a Rust ``(os error N)`` in its text,
    or the per-rank failures of torch.distributed.checkpoint's CheckpointException."""
    todo: list[BaseException] = [err]
    seen: set[int] = set()
    while todo and len(seen) < 64:
        current = todo.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            return current.errno, current.filename if isinstance(current.filename, str) else None
        try:
            text = str(current)
        except Exception:  # an exception whose __str__ fails says nothing more
            text = ""
        match = _RUST_OS_ERROR.search(text)
        if match:
            return int(match.group(1)), None
        todo += [c for c in (current.__cause__, current.__context__) if c is not None]
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            for failure in failures.values():
                failure = failure[0] if isinstance(failure, tuple) and failure else failure
                if isinstance(failure, BaseException):
                    todo.append(failure)
    return None


def _belongs_to(file: str, out: Path) -> bool:
    """Whether ``file`` is OUT, lies in it, or lies in one of its staging folders."""
    path = Path(os.path.abspath(file))
    if path == out or out in path.parents:
        return True
    for parent in (path, *path.parents):
        if parent.parent == out.parent:
            return parent.name.startswith((f".{out.name}{PARTIAL_MARK}", f".{out.name}{OLD_MARK}"))
    return False


def fault_message(err: BaseException, sizes: Mapping[Path, int]) -> str | None:
    """One line for a write that met a fault of the machine (full disk, quota, read-only, permission,
    I/O error) while writing one of ``sizes`` (OUT -> estimated bytes); None for anything else."""
    found = _os_error(err)
    if found is None or found[0] not in _FAULTS:
        return None
    code, file = found
    need = {Path(o).absolute(): n for o, n in sizes.items()}
    owner = next((o for o in need if file and _belongs_to(file, o)), None)
    if owner is None and (file is not None or not need):
        return _FAULTS[code] + (f": {file}" if file else "")
    out = owner or next(iter(need))
    if code in (errno.ENOSPC, errno.EDQUOT):
        parts = [f"needed about {_size(need[out])}"] if need[out] else []
        with contextlib.suppress(OSError):
            parts.append(f"{_size(_free(out.parent))} free")
        detail = ", ".join(parts)
        return f"{_FAULTS[code]} while writing {out}" + (f" ({detail})" if detail else "")
    return f"{_FAULTS[code]} while writing {out}" + (f" ({file})" if file else "")


@contextlib.contextmanager
def writing(sizes: Mapping[Path, int], policy: OutputPolicy) -> Iterator[None]:
    """Check the room for ``sizes`` (OUT -> estimated bytes; unless ``policy`` skips it), then run the
    write. Whatever stops it, no staging folder of this process is left beside an OUT; a machine
    fault becomes one :class:`WriteError` line."""
    outs = {Path(o).absolute(): n for o, n in sizes.items()}
    if policy.space_check:
        check_space(outs)
    try:
        yield
    except BaseException as err:  # BaseException: torch.distributed.checkpoint's CheckpointException is one
        for out in outs:
            remove_own_partials(out)
        if isinstance(err, (UcpError, KeyboardInterrupt, SystemExit, GeneratorExit)):
            raise
        message = fault_message(err, outs)
        if message is None:
            raise
        raise WriteError(message) from err
