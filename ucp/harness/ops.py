"""The C++ op DeepSpeed builds for CPU ranks, checked before any rank starts.

DeepSpeed's CPU accelerator JIT-builds its shared-memory collective op (``deepspeed_shm_comm``) the first time a
process group starts (a minute or two, once per machine), through torch's cpp_extension: that needs a C++
compiler, and it holds a ``lock`` file in the op's build folder while it builds. A build that was killed leaves the
lock behind, and every later build waits on it forever without a word. :func:`check_op_build` turns both into one
line before the ranks start.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from ucp.errors import UcpError

__all__ = ["OP_NAME", "check_op_build", "extensions_root", "stale_locks"]

#: the op every DeepSpeed CPU rank builds on its first start (deepspeed.comm.torch.build_shm_op)
OP_NAME = "deepspeed_shm_comm"
#: how long a lock no process holds is watched before it is called stale (a build may be just starting)
_SETTLE_SECONDS = 3.0


def extensions_root() -> Path:
    """Where torch's cpp_extension builds ops: ``TORCH_EXTENSIONS_DIR``, else its default root."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def _held_files() -> set[str]:
    """Every file some process of this machine holds open (Linux ``/proc``; empty elsewhere)."""
    held: set[str] = set()
    proc = Path("/proc")
    if not proc.is_dir():
        return held
    for pid in os.listdir(proc):
        if not pid.isdigit():
            continue
        try:
            fds = os.listdir(proc / pid / "fd")
        except OSError:  # another user's process, or one that ended
            continue
        for fd in fds:
            try:
                held.add(os.readlink(proc / pid / "fd" / fd))
            except OSError:
                continue
    return held


def stale_locks(root: Path, *, settle: float = _SETTLE_SECONDS) -> list[Path]:
    """Build locks under ``root`` that no process holds (torch's FileBaton keeps its lock open while it builds),
    seen twice ``settle`` seconds apart."""
    locks = [p for p in (*root.glob("*/lock"), *root.glob("*/*/lock")) if p.is_file()]
    if not locks or not Path("/proc").is_dir():
        return []
    orphans = [p for p in locks if str(p.resolve()) not in _held_files()]
    if orphans and settle > 0:
        time.sleep(settle)
        held = _held_files()
        orphans = [p for p in orphans if p.is_file() and str(p.resolve()) not in held]
    return orphans


def _compiler() -> str | None:
    """The C++ compiler torch's cpp_extension will call (``CXX``, else ``c++``), if it is there."""
    return shutil.which(os.environ.get("CXX") or "c++")


def _built(root: Path) -> bool:
    return any(root.glob(f"*/{OP_NAME}/{OP_NAME}*.so")) or any(root.glob(f"{OP_NAME}/{OP_NAME}*.so"))


def check_op_build() -> None:
    """Refuse, in one line, a start that would hang on a stale build lock or die building without a compiler."""
    root = extensions_root()
    for lock in stale_locks(root):
        raise UcpError(
            f"{lock} is the lock of a DeepSpeed op build that was killed (no process holds it); the next build "
            f"would wait on it forever: remove it (rm {lock}) and run again"
        )
    if not _built(root) and _compiler() is None:
        cxx = os.environ.get("CXX") or "c++"
        raise UcpError(
            f"DeepSpeed builds its C++ op {OP_NAME} on the first CPU run, and there is no C++ compiler ({cxx} is not "
            "on PATH): install one (Debian/Ubuntu: apt-get install g++; Fedora: dnf install gcc-c++; macOS: "
            "xcode-select --install) and run again"
        )
