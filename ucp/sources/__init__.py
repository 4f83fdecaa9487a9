"""Sources: read a checkpoint into :class:`ucp.records.Reader` form.

``open_reader`` decides what PATH is (a universal directory, DeepSpeed's own ``ds_to_universal``
output, or a DeepSpeed checkpoint of some ZeRO stage) and returns the matching reader; nothing
downstream branches on the stage.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from ucp.errors import InputError
from ucp.records import Reader
from ucp.sources.files import find_checkpoint

if TYPE_CHECKING:
    from ucp.tp import TpRule

__all__ = ["open_reader", "is_universal"]


def is_universal(path: str | Path) -> bool:
    return (Path(path) / "ucp.json").is_file()


def open_reader(path: str | Path, *, tag: str | None = None, optimizer: str | None = None,
                verify: bool = True, tp_rules: Sequence[tuple[str, "TpRule"]] = ()) -> Reader:
    """A reader for a universal directory, a ds_to_universal folder (or the folder holding its
    ``latest_universal``) or a DeepSpeed ZeRO checkpoint (folder or tag folder).

    A folder holding both ``latest`` and ``latest_universal`` is read as the native checkpoint;
    name the universal folder with ``tag`` to read that one instead. A checkpoint saved with
    tensor parallelism (several ``mp_rank_XX``) is read as full parameters, merged by the rules in
    its ``universal_checkpoint_info``; ``tp_rules`` (regex, rule) pairs add to or override them.
    """
    path = Path(path)
    if is_universal(path):
        from ucp.universal import open_universal

        return open_universal(path, verify=verify)
    from ucp.sources.dsuniversal import find_ds_universal

    found = find_ds_universal(path, tag)
    if found is not None:
        if is_universal(found):
            from ucp.universal import open_universal

            return open_universal(found, verify=verify)
        from ucp.sources.dsuniversal import DsUniversalSource

        return DsUniversalSource(found, optimizer=optimizer)
    files = find_checkpoint(path, tag)
    if files.mp > 1:
        from ucp.sources.tensor_parallel import TensorParallelSource

        return TensorParallelSource(files, optimizer=optimizer, rules=tp_rules)
    if files.stage3:
        from ucp.sources.zero3 import Zero3Source

        return Zero3Source(files, optimizer=optimizer)
    try:
        from ucp.sources.zero12 import Zero12Source
    except ImportError:
        raise InputError(f"{files.tag_dir} is a ZeRO-1/2 checkpoint; this ucp reads ZeRO-3 only") from None
    return Zero12Source(files, optimizer=optimizer)
