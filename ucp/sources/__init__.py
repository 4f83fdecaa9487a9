"""Sources: read a checkpoint into :class:`~ucp.model.records.Reader` form.

Each format ucp reads is declared by its module (a :class:`~ucp.sources.format.SourceFormat`) and listed once
in :mod:`ucp.sources.registry`, whose ``open_reader`` finds the one that claims a path; nothing downstream branches
on the format.
"""

from __future__ import annotations

from ucp.sources.registry import SOURCE_FORMATS, open_reader, opened, source_format
from ucp.universal.reader import is_universal

__all__ = ["SOURCE_FORMATS", "open_reader", "opened", "source_format", "is_universal"]
