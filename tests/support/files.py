"""Re-saving a (deliberately broken) torch file in place, through ucp's own writer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ucp.io.torchzip import write_torch_file

__all__ = ["resave"]


def resave(obj: Any, path: str | Path) -> None:
    """Replace ``path`` with ``obj`` written as ucp writes torch files (DeepSpeed stand-ins under their names)."""
    path = Path(path)
    path.unlink(missing_ok=True)
    write_torch_file(obj, path)
