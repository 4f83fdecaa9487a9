"""ucp: universal checkpoints for DeepSpeed ZeRO (installed as the distribution ``ucp-checkpoint``).

Read ZeRO shards into a per-parameter universal directory, and restore it at any DP size, ZeRO
stage and optimizer flavour: into a live engine, a plain torch model, or a native checkpoint that
stock DeepSpeed loads. Importing ucp never imports deepspeed.
"""

from __future__ import annotations

import sys

try:
    import importlib
    from typing import TYPE_CHECKING, Any

    from ucp.errors import UcpError
except KeyboardInterrupt:
    # `python -m ucp` imports this package before ucp/__main__ can take Ctrl-C: the CLI's one line here too
    if getattr(sys, "argv", [])[:1] == ["-m"]:
        __import__("os").write(2, b"ucp: interrupted by SIGINT while starting; nothing was written\n")
        __import__("os")._exit(130)
    raise

__version__ = "0.1.0"
#: the name pip knows ucp by (``ucp`` on the package index is another, older project)
DISTRIBUTION = "ucp-checkpoint"
#: files RAPIDS' UCX-Py (also imported as ``ucp``) installs into its ``ucp`` folder, and ucp-checkpoint never has
_UCX_PY_FILES = ("_libs", "core.py", "continuous_ucx_progress.py")


def shared_folder() -> str | None:
    """One line when another package installed into this package's folder (UCX-Py's ``ucp``, in one environment
    with ucp-checkpoint: both are imported as ``ucp``, so pip puts their files in one folder and neither works
    whole), else None. Two stat calls: the CLI asks at every start."""
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    found = [name for name in _UCX_PY_FILES if os.path.exists(os.path.join(here, name))]
    if not found:
        return None
    return (
        f"{here} also holds {', '.join(found)} of RAPIDS' UCX-Py, which is imported as `ucp` too: the two packages "
        f"cannot share one environment; install {DISTRIBUTION} in a virtual environment of its own"
    )


if TYPE_CHECKING:
    from ucp.ops.convert import iter_optimizer_moments, load_optimizer_moments, to_universal
    from ucp.ops.diff import diff
    from ucp.sources import open_reader
    from ucp.universal.reader import open_universal

#: the API's readers and converters, imported on first use: ``import ucp`` (and the CLI's start) stays free of torch
_LAZY = {
    "to_universal": "ucp.ops.convert",
    "load_optimizer_moments": "ucp.ops.convert",
    "iter_optimizer_moments": "ucp.ops.convert",
    "diff": "ucp.ops.diff",
    "open_reader": "ucp.sources",
    "open_universal": "ucp.universal.reader",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ucp' has no attribute {name!r}")


def restore(engine, universal_dir, **kwargs):  # type: ignore[no-untyped-def]
    """Restore a universal directory into a live DeepSpeed engine (see ucp.targets.engine.restore)."""
    from ucp.targets.engine import restore as _restore

    return _restore(engine, universal_dir, **kwargs)


def restore_torch(model, optimizer, universal_dir, **kwargs):  # type: ignore[no-untyped-def]
    """Restore into a plain torch model and optimizer (see ucp.targets.torch.restore_torch)."""
    from ucp.targets.torch import restore_torch as _restore_torch

    return _restore_torch(model, optimizer, universal_dir, **kwargs)


def write_native(source, out, **kwargs):  # type: ignore[no-untyped-def]
    """Write a native ZeRO checkpoint for a new DP size (see ucp.targets.native.write_native)."""
    from ucp.targets.native import write_native as _write_native

    return _write_native(source, out, **kwargs)


def reshard(source, out, **kwargs):  # type: ignore[no-untyped-def]
    """A DeepSpeed checkpoint straight to another DP size, keeping its stage (see ucp.targets.native.reshard)."""
    from ucp.targets.native import reshard as _reshard

    return _reshard(source, out, **kwargs)


def write_dcp(source, out, **kwargs):  # type: ignore[no-untyped-def]
    """Write a torch.distributed.checkpoint folder for FSDP2 / plain torch (see ucp.targets.dcp.write_dcp)."""
    from ucp.targets.dcp import write_dcp as _write_dcp

    return _write_dcp(source, out, **kwargs)


__all__ = [
    "__version__",
    "DISTRIBUTION",
    "shared_folder",
    "UcpError",
    "to_universal",
    "open_universal",
    "open_reader",
    "load_optimizer_moments",
    "iter_optimizer_moments",
    "diff",
    "restore",
    "restore_torch",
    "write_native",
    "reshard",
    "write_dcp",
]
