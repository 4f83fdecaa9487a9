"""The universal format: a per-parameter directory any DP size, stage or optimizer can be restored from.

:mod:`~ucp.universal.manifest` is ucp.json as dataclasses, :mod:`~ucp.universal.writer` builds a
directory from any reader, :mod:`~ucp.universal.reader` reads one back as a reader.
"""

from ucp.universal.manifest import FORMAT, FORMAT_VERSION, MANIFEST, ParamEntry, folder_for
from ucp.universal.reader import UniversalReader, is_universal, open_universal
from ucp.universal.writer import finish_universal, write_params, write_universal

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "ParamEntry",
    "folder_for",
    "UniversalReader",
    "is_universal",
    "open_universal",
    "finish_universal",
    "write_params",
    "write_universal",
]
