"""Reading ucp.json from disk as untrusted input: within :data:`MAX_MANIFEST_BYTES` and
:data:`MAX_MANIFEST_DEPTH` levels, each failure one line (``ucp.universal.reader`` checks its fields next)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from ucp.errors import CorruptFileError, InputError
from ucp.universal.file_names import MANIFEST

__all__ = ["MAX_MANIFEST_BYTES", "MAX_MANIFEST_DEPTH", "read_manifest"]

logger = logging.getLogger(__name__)

#: about half a million parameters' entries; a bigger ucp.json is damage, not a model
MAX_MANIFEST_BYTES = 256 << 20
#: ucp writes about 6 levels (the DeepSpeed config inside ``source`` is the deepest part)
MAX_MANIFEST_DEPTH = 32


def read_manifest(file: Path) -> Any:
    """ucp.json parsed, within MAX_MANIFEST_BYTES and MAX_MANIFEST_DEPTH."""
    try:
        with open(file, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size > MAX_MANIFEST_BYTES:
                raise CorruptFileError(
                    f"{file} has {size:,} bytes; ucp reads manifests up to {MAX_MANIFEST_BYTES:,} bytes"
                )
            text = handle.read(size + 1)  # not the limit: a read of n bytes allocates n first
    except FileNotFoundError:
        raise InputError(f"{file.parent} is not a universal directory: {MANIFEST} is missing") from None
    except IsADirectoryError:
        raise CorruptFileError(f"{file} is a folder, not a manifest") from None
    except OSError as err:
        raise InputError(f"cannot read {file}: {err.strerror}") from None
    try:
        raw = json.loads(text)
    except RecursionError:  # json's C scanner recurses once per level
        raise CorruptFileError(f"{file} is nested more than {MAX_MANIFEST_DEPTH} levels deep") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CorruptFileError(f"{file} is not valid JSON: {err}") from None
    if _depth(raw) > MAX_MANIFEST_DEPTH:
        raise CorruptFileError(f"{file} is nested more than {MAX_MANIFEST_DEPTH} levels deep")
    return raw


def _depth(value: Any) -> int:
    """How deep a parsed JSON value nests (iteratively: the value may be as deep as json allowed)."""
    deepest = 0
    todo = [(value, 1)]
    while todo:
        item, level = todo.pop()
        deepest = max(deepest, level)
        if level > MAX_MANIFEST_DEPTH:
            break
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        todo.extend((child, level + 1) for child in children)
    return deepest
