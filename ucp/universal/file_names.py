"""The names in a universal directory (docs/format.md): the format's and its manifest's, each parameter's folder
(the name itself, or percent-encoded) and the files in it."""

from __future__ import annotations

import hashlib
import logging
import re

from ucp.errors import InputError
from ucp.model.layouts import LAYOUT_KINDS

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "STATE_FILE",
    "FP32_FILE",
    "STEP_FILE",
    "SUFFIX",
    "SOURCE_LAYOUTS",
    "folder_for",
    "state_file",
]

logger = logging.getLogger(__name__)

FORMAT = "ucp-universal"
FORMAT_VERSION = 1
MANIFEST = "ucp.json"
STATE_FILE = "state.pt"
FP32_FILE = "fp32.pt"
STEP_FILE = "step.pt"
SUFFIX = ".pt"
#: how the source was laid out (its facts' :class:`~ucp.model.layouts.SourceLayout`), kept in ucp.json under its
#: kind for the targets and ``ucp inspect``; optional keys, absent from directories of other sources and older ucp
SOURCE_LAYOUTS = LAYOUT_KINDS
_SAFE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
_MAX_FOLDER = 200


def folder_for(name: str) -> str:
    """A folder name for a parameter: the name itself when safe, else percent-encoded (reversible)."""
    if not name or "\x00" in name:
        raise InputError(f"parameter name {name!r} is empty or holds a NUL byte")
    if _SAFE.match(name) and len(name) <= _MAX_FOLDER and name not in (".", ".."):
        return name
    encoded = "".join(
        c if (c.isascii() and (c.isalnum() or c in "_.-")) else "".join(f"%{b:02X}" for b in c.encode()) for c in name
    )
    if encoded.startswith("."):
        encoded = "%2E" + encoded[1:]
    if len(encoded) > _MAX_FOLDER:
        encoded = encoded[:150] + "%~" + hashlib.sha1(name.encode()).hexdigest()
    return encoded


def state_file(key: str) -> str:
    """The file of one optimizer state key in a parameter's folder."""
    return key + SUFFIX
