"""What a checkpoint pickle may name, and what unpickling it may give (``ucp.io.torchfile``).

The allow-list is torch's weights_only set plus ucp's DeepSpeed stand-ins; a pickle naming any other global
is refused with one line naming it, before a single opcode runs. What the unpickler gives back is checked
for tensors that claim more bytes than their storage holds.
"""

from __future__ import annotations

import _compat_pickle
import io
import logging
import pickletools
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ucp.errors import CorruptFileError, UnsafeFileError
from ucp.io.dist_standins import WrapperRecord
from ucp.io.standins import STANDINS, DSObject

__all__ = [
    "ALLOW_LOCK",
    "SAFE_GLOBALS",
    "allowed_globals",
    "check_globals",
    "check_tensors",
    "one_line",
    "only_globals",
    "refusal",
]

logger = logging.getLogger(__name__)

#: the stand-ins, as torch's safe_globals takes them
SAFE_GLOBALS: list[Any] = [(cls, cls.ds_name) for cls in STANDINS]
# torch keeps its allow-list in one process-wide set; the lock keeps our additions scoped to our loads.
ALLOW_LOCK = threading.Lock()
_UNSUPPORTED = re.compile(
    r"(?:Unsupported global: GLOBAL|unsupported GLOBAL|unrecognized function|Unsupported class)"
    r"\s+([\w.<>]+)"
)
# A tensor may address more bytes than its storage holds only by overlapping itself (stride 0,
# expand()); a damaged file can use that to ask for terabytes. Small expanded tensors stay legal.
_MAX_OVERLAP_BYTES = 1 << 20


@contextmanager
def only_globals(pairs: list[Any]) -> Iterator[None]:
    """torch's weights_only allow-list set to ``pairs`` alone while it is held (call under :data:`ALLOW_LOCK`); the
    process-wide set comes back after. torch's ``safe_globals`` only adds to that set."""
    from torch import _weights_only_unpickler

    saved = _weights_only_unpickler._marked_safe_globals_set
    _weights_only_unpickler._marked_safe_globals_set = set(pairs)
    try:
        yield
    finally:
        _weights_only_unpickler._marked_safe_globals_set = saved


def one_line(text: object, limit: int = 300) -> str:
    """The first line of ``str(text)`` (a message or an exception), cut to ``limit`` characters: error messages stay one line."""
    lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
    first = lines[0] if lines else ""
    return first if len(first) <= limit else first[: limit - 3] + "..."


def allowed_globals() -> frozenset[str]:
    """Every dotted name a checkpoint pickle may refer to: torch's weights_only set plus the stand-ins.

    This is the whole allow-list: names added to torch's process-wide set by other code
    (``torch.serialization.add_safe_globals``) are not on it.
    """
    from torch import _weights_only_unpickler

    return frozenset(_weights_only_unpickler._get_allowed_globals()) | {cls.ds_name for cls in STANDINS}


def _global_name(arg: str) -> str:
    module, _, name = arg.partition(" ")
    # mirror torch's _read_global_instruction: protocol-2 pickles may carry Python 2 names
    if (module, name) in _compat_pickle.NAME_MAPPING:
        module, name = _compat_pickle.NAME_MAPPING[(module, name)]
    elif module in _compat_pickle.IMPORT_MAPPING:
        module = _compat_pickle.IMPORT_MAPPING[module]
    return f"{module}.{name}"


def check_globals(stream: io.BytesIO, path: Path, pickles: int = 1, extra: frozenset[str] = frozenset()) -> None:
    """Refuse a pickle naming any global off the allow-list (and ``extra``: the names one reader adds), before a
    single opcode runs.

    ``pickletools.genops`` only parses; nothing is imported or called. The weights_only unpickler
    checks again as it loads; this pass makes the allow-list ours alone and the refusal name the global.
    """
    allowed = allowed_globals() | extra
    try:
        for _ in range(pickles):
            for opcode, arg, _pos in pickletools.genops(stream):
                if opcode.name == "GLOBAL":
                    name = _global_name(str(arg))
                    if name not in allowed:
                        raise UnsafeFileError(
                            f"{path} refers to {one_line(name, 120)}, which is not on ucp's allow-list of checkpoint "
                            "types; refused without running it (if you trust the file, re-save it without that object)"
                        )
                elif opcode.name in ("STACK_GLOBAL", "INST", "OBJ"):
                    raise UnsafeFileError(
                        f"{path} builds objects with the {opcode.name} opcode, which ucp does not "
                        "allow; refused without running it"
                    )
    except UnsafeFileError:
        raise
    except Exception as err:  # genops raises ValueError and friends on a damaged pickle
        raise CorruptFileError(
            f"{path} holds a damaged pickle ({one_line(err, 120) or type(err).__name__}); "
            "the file is truncated or corrupt"
        ) from None


def refusal(err: Exception, path: Path) -> Exception:
    text = str(err)
    match = _UNSUPPORTED.search(text)
    if match:
        return UnsafeFileError(
            f"{path} refers to {match.group(1)}, which is not on ucp's allow-list of checkpoint types; refused "
            "without running it"
        )
    return CorruptFileError(f"{path} could not be unpickled: {one_line(text) or type(err).__name__}")


def _extent(tensor: torch.Tensor) -> int:
    """The bytes of its storage a strided tensor reaches, from the storage's start."""
    if tensor.numel() == 0:
        return 0
    last = tensor.storage_offset() + sum((n - 1) * st for n, st in zip(tensor.shape, tensor.stride(), strict=True))
    return int(last + 1) * tensor.element_size()


def check_tensors(obj: Any, path: Path) -> None:
    """Refuse tensors that claim far more bytes than their storage holds (see _MAX_OVERLAP_BYTES)."""
    stack = [obj]
    seen: set[int] = set()
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, WrapperRecord):  # a record of a DTensor / ShardedTensor: its fields hold the tensors
            stack.extend(vars(item).values())
        elif torch.is_tensor(item):
            if item.layout != torch.strided:
                continue
            claimed = item.numel() * item.element_size()
            held = item.untyped_storage().nbytes()
            if _extent(item) > held:
                raise CorruptFileError(
                    f"{path} holds a tensor of shape {tuple(item.shape)} that reaches past the end of its "
                    f"storage of {held} bytes; the file is corrupt"
                )
            if claimed > held and claimed > _MAX_OVERLAP_BYTES:
                raise CorruptFileError(
                    f"{path} holds a tensor of shape {tuple(item.shape)} that claims {claimed} "
                    f"bytes over a storage of {held}; the file is corrupt"
                )
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)
        elif isinstance(item, DSObject):
            stack.extend(item.__dict__.values())
