"""Sources: read a checkpoint into :class:`~ucp.model.records.Reader` form.

``open_reader`` decides what PATH is (a universal directory, DeepSpeed's own ``ds_to_universal``
output, or a DeepSpeed checkpoint of some ZeRO stage) and returns the matching reader; nothing
downstream branches on the stage.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ucp.deepspeed.layout import find_checkpoint
from ucp.errors import InputError
from ucp.io.timing import phase
from ucp.model.records import Reader
from ucp.universal.reader import is_universal, open_universal

if TYPE_CHECKING:
    from ucp.model.tp import TpRule

__all__ = ["open_reader", "opened", "is_universal"]


def open_reader(
    path: str | os.PathLike[str],
    *,
    tag: str | None = None,
    optimizer: str | None = None,
    verify: bool = True,
    tp_rules: Sequence[tuple[str, TpRule]] = (),
    frozen: Sequence[str] = (),
) -> Reader:
    """A reader for a universal directory, a torch.distributed.checkpoint folder (``.metadata``), a
    ds_to_universal folder (or the folder holding its ``latest_universal``) or a DeepSpeed checkpoint,
    ZeRO or stage 0 (folder or tag folder).

    A folder holding both ``latest`` and ``latest_universal`` is read as the native checkpoint;
    name the universal folder with ``tag`` to read that one instead. A checkpoint saved with
    tensor parallelism (several ``mp_rank_XX``) is read as full parameters, merged by the rules in
    its ``universal_checkpoint_info``; ``tp_rules`` (regex, rule) pairs add to or override them. A
    pipeline-parallel one (``layer_XX-model_states.pt`` files) is read as the whole model, and so is a
    legacy mixture-of-experts one (``layer_L_expert_E_*`` files) or an AutoEP one (``ds_autoep_layers``),
    every expert under its global index. A checkpoint saved without ZeRO (stage 0: one model-states file
    holding the optimizer's own state) is read as its parameters; ``frozen`` names its frozen parameters
    where the optimizer's shapes cannot tell them from trained ones (and a DCP folder's, as ``--frozen``).
    The reader records ``path`` as its input (:attr:`Reader.inputs`), which no output may overlap.
    """
    path = Path(path)
    with phase(f"read {path}'s metadata"):
        reader = _open(path, tag=tag, optimizer=optimizer, verify=verify, tp_rules=tp_rules, frozen=frozen)
    reader.inputs = (path,)
    return _zenflow_view(reader)


def _zenflow_view(reader: Reader) -> Reader:
    """A ZenFlow ZeRO-3 save's matrices, back in the model's shape; any other reader as it is."""
    from ucp.model.zenflow import ZENFLOW_Z3_NOTE, ZenflowTransposed, transposes_matrices
    from ucp.sources.zero3 import Zero3Source

    if isinstance(reader, Zero3Source) and transposes_matrices(reader.facts.info.ds_config, 3):
        return ZenflowTransposed(reader, note=ZENFLOW_Z3_NOTE, owns=True)
    return reader


def _open(
    path: Path,
    *,
    tag: str | None,
    optimizer: str | None,
    verify: bool,
    tp_rules: Sequence[tuple[str, TpRule]],
    frozen: Sequence[str],
) -> Reader:
    """:func:`open_reader`'s choice of source."""
    if is_universal(path):
        return open_universal(path, verify=verify)
    from ucp.sources.dcp import DcpSource, is_dcp

    if is_dcp(path):
        if (path / "latest").is_file() or (path / "latest_universal").is_file():
            raise InputError(
                f"{path} holds both a torch.distributed.checkpoint (.metadata) and a DeepSpeed checkpoint (latest): "
                "name the DeepSpeed tag folder, or move one of them to a folder of its own"
            )
        return DcpSource(path, optimizer=optimizer, names={"frozen": list(frozen)} if frozen else None)
    from ucp.deepspeed.layout import find_ds_universal

    found = find_ds_universal(path, tag)
    if found is not None:
        if is_universal(found):
            return open_universal(found, verify=verify)
        from ucp.sources.ds_universal import DsUniversalSource

        return DsUniversalSource(found, optimizer=optimizer)
    files = find_checkpoint(path, tag)
    if files.stage0:
        from ucp.sources.zero0 import Zero0Source

        if files.mp > 1:
            from ucp.sources.tensor_parallel import TensorParallelSource

            return TensorParallelSource(
                files,
                rules=tp_rules,
                rank_reader=lambda mp_rank: Zero0Source(files, optimizer=optimizer, frozen=frozen, mp_rank=mp_rank),
            )
        return Zero0Source(files, optimizer=optimizer, frozen=frozen)
    if frozen:
        raise InputError(
            f"frozen parameters are named only for a DCP folder or a stage-0 checkpoint; {path} is a ZeRO "
            "checkpoint, which lists its own"
        )
    if files.layers:
        from ucp.sources.pipeline import PipelineSource

        return PipelineSource(files, optimizer=optimizer, rules=tp_rules)
    if files.experts or files.stage3:
        from ucp.sources.autoep import AutoEpSource, is_autoep

        if is_autoep(files):  # AutoEP at ZeRO-3 writes no expert files, hence the stage3 test
            return AutoEpSource(files, optimizer=optimizer)
    if files.experts:
        from ucp.sources.moe import MoeSource

        return MoeSource(files, optimizer=optimizer)
    if files.mp > 1:
        from ucp.sources.tensor_parallel import TensorParallelSource

        return TensorParallelSource(files, optimizer=optimizer, rules=tp_rules)
    if files.stage3:
        from ucp.sources.zero3 import Zero3Source

        return Zero3Source(files, optimizer=optimizer)
    from ucp.sources.zero12 import Zero12Source

    return Zero12Source(files, optimizer=optimizer)


@contextmanager
def opened(source: str | os.PathLike[str] | Reader, **how: Any) -> Iterator[Reader]:
    """The reader for ``source``: opened (``open_reader(source, **how)``) and closed after, when it is a path;
    an open reader is lent as it is and left open, since its caller owns it."""
    if not isinstance(source, (str, os.PathLike)):
        yield source
        return
    reader = open_reader(source, **how)
    try:
        yield reader
    finally:
        reader.close()
