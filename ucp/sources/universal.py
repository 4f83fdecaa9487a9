"""The ucp universal directory as a source format (its reader lives in ``ucp.universal``)."""

from __future__ import annotations

from pathlib import Path

from ucp.model.records import Reader
from ucp.sources.format import How, Probe, SourceFormat
from ucp.universal.reader import is_universal, open_universal

__all__ = ["FORMAT"]


def _folder(probe: Probe) -> Path | None:
    """PATH itself, or the ds_to_universal folder it means, when that holds ucp's manifest."""
    if is_universal(probe.path):
        return probe.path
    found = probe.ds_universal
    return found if found is not None and is_universal(found) else None


def _open(probe: Probe, how: How) -> Reader:
    folder = _folder(probe)
    assert folder is not None  # claimed
    return open_universal(folder, verify=how.verify)


FORMAT = SourceFormat(
    name="universal",
    label="ucp universal directory",
    docs="format.md#4-the-ucp-universal-directory-format_version-1",
    claims=lambda probe: _folder(probe) is not None,
    open=_open,
    refines=("ds-universal",),
)
