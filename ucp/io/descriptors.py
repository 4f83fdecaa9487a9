"""File descriptors for a save of many rank files: ask for enough before opening them, or refuse in one line.

A rank file opened by :class:`ucp.io.torchfile.TorchFile` holds two descriptors while it is open (the file, for
``pread`` of its spans, and the one its mmap keeps), and a ZeRO-3 save at DP 4096 has 8192 rank files open at
once. The shell's default soft limit (often 1024) would stop that half-way with ``EMFILE``; the hard limit is
usually far higher (524288 under systemd), and raising the soft limit up to it is what a process may do for
itself. So the readers reserve what they need first: the soft limit goes up when it must, and when even the hard
limit is too low the user reads one line naming the count and ``ulimit -n`` before anything is read.
"""

from __future__ import annotations

import os
import resource

from ucp.errors import InputError

__all__ = ["PER_FILE", "reserve"]

PER_FILE = 2  # descriptors an open TorchFile holds: its file and its mapping's duplicate
_SPARE = 64  # for what opens beside them: outputs, a worker pool's pipes, the interpreter's own


def _open_now() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 16


def reserve(files: int, what: str) -> None:
    """Make room to hold ``files`` more files open (``PER_FILE`` descriptors each): raise the soft
    RLIMIT_NOFILE when it is too low, or raise InputError naming ``what`` when the hard limit is too."""
    need = _open_now() + PER_FILE * files + _SPARE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or need <= soft:
        return
    if hard != resource.RLIM_INFINITY and need > hard:
        raise InputError(
            f"{what} has {files:,} files to hold open ({need:,} descriptors), above this process's hard limit "
            f"of {hard:,}: raise it (ulimit -Hn {need}) or ask an administrator to"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
