"""Reading ucp.json from disk as untrusted input: within :data:`MAX_MANIFEST_BYTES` and
:data:`MAX_MANIFEST_DEPTH` levels, each failure one line, the per-parameter entries handed out one at a time
(``ucp.universal.param_table`` checks and keeps each, ``ucp.universal.reader`` the rest)."""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
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


def read_manifest(file: Path, on_param: Callable[[int, Any], None]) -> dict[str, Any]:
    """ucp.json parsed, within MAX_MANIFEST_BYTES and MAX_MANIFEST_DEPTH: its top-level fields but ``params``, whose
    entries go one by one to ``on_param(index, entry)`` as they are parsed. A 10^5-parameter manifest is then never
    whole in memory as Python objects (about 2 KB an entry), only as its text (about 400 bytes an entry)."""
    try:
        with open(file, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size > MAX_MANIFEST_BYTES:
                raise CorruptFileError(
                    f"{file} has {size:,} bytes; ucp reads manifests up to {MAX_MANIFEST_BYTES:,} bytes"
                )
            data = handle.read(size + 1)  # not the limit: a read of n bytes allocates n first
    except FileNotFoundError:
        raise InputError(f"{file.parent} is not a universal directory: {MANIFEST} is missing") from None
    except IsADirectoryError:
        raise CorruptFileError(f"{file} is a folder, not a manifest") from None
    except OSError as err:
        raise InputError(f"cannot read {file}: {err.strerror}") from None
    try:
        text = data.decode("utf-8")
        del data
        return _Parse(text, file, on_param).top()
    except RecursionError:  # json's C scanner recurses once per level
        raise CorruptFileError(f"{file} is nested more than {MAX_MANIFEST_DEPTH} levels deep") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CorruptFileError(f"{file} is not valid JSON: {err}") from None


_SPACE = re.compile(r"[ \t\n\r]*")


class _Parse:
    """A JSON object read field by field with json's own scanner, its ``params`` list element by element."""

    def __init__(self, text: str, file: Path, on_param: Callable[[int, Any], None]) -> None:
        self.text, self.file, self.on_param = text, file, on_param
        self.decoder = json.JSONDecoder()

    def _skip(self, at: int) -> int:
        match = _SPACE.match(self.text, at)
        return match.end() if match is not None else at

    def _expect(self, at: int, chars: str) -> str:
        if at >= len(self.text) or self.text[at] not in chars:
            found = repr(self.text[at]) if at < len(self.text) else "the end"
            raise json.JSONDecodeError(f"expected one of {chars!r}, found {found}", self.text, at)
        return self.text[at]

    def _value(self, at: int, level: int) -> tuple[Any, int]:
        """One JSON value at ``at``, nested at ``level`` (the top-level object is level 1)."""
        value, end = self.decoder.raw_decode(self.text, at)
        if level - 1 + _depth(value) > MAX_MANIFEST_DEPTH:
            raise CorruptFileError(f"{self.file} is nested more than {MAX_MANIFEST_DEPTH} levels deep")
        return value, end

    def top(self) -> dict[str, Any]:
        at = self._skip(0)
        if not self.text.startswith("{", at):
            self._end(self.decoder.raw_decode(self.text, at)[1], {})  # valid JSON, but not an object
            raise InputError(f"{self.file} is not a ucp manifest")
        out: dict[str, Any] = {}
        at = self._skip(at + 1)
        if self.text.startswith("}", at):
            return self._end(at + 1, out)
        while True:
            self._expect(at, '"')
            key, at = self.decoder.raw_decode(self.text, at)  # a JSON string: the field's name
            at = self._skip(at)
            self._expect(at, ":")
            at = self._skip(at + 1)
            if key in out:
                raise CorruptFileError(f"{self.file} gives the field {key!r} twice")
            if key == "params" and self.text.startswith("[", at):
                out[key] = []  # its entries went to on_param
                at = self._params(at)
            else:
                out[key], at = self._value(at, 2)
            at = self._skip(at)
            if self._expect(at, ",}") == "}":
                return self._end(at + 1, out)
            at = self._skip(at + 1)

    def _params(self, at: int) -> int:
        """The ``params`` list from its ``[``, each element handed on as it is parsed; returns the end."""
        at = self._skip(at + 1)
        if self.text.startswith("]", at):
            return at + 1
        index = 0
        while True:
            value, at = self._value(at, 3)
            self.on_param(index, value)
            index += 1
            at = self._skip(at)
            if self._expect(at, ",]") == "]":
                return at + 1
            at = self._skip(at + 1)

    def _end(self, at: int, out: dict[str, Any]) -> dict[str, Any]:
        if self._skip(at) != len(self.text):
            raise json.JSONDecodeError("Extra data", self.text, self._skip(at))
        return out


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
