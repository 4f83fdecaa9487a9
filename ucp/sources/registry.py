"""The one list of formats ucp reads, and the one dispatch from a path to its reader.

Adding a source format is one module that declares a :class:`~ucp.sources.format.SourceFormat` (its ``FORMAT``)
plus one line in :data:`SOURCE_FORMATS`; ``open_reader``, ``ucp inspect``, ``ucp migrate`` and every writer then
take it. docs/design.md lists the steps.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ucp.errors import InputError
from ucp.io.timing import phase
from ucp.model.layouts import RunFolder
from ucp.model.records import Reader
from ucp.sources import (
    autoep,
    dcp,
    ds_universal,
    hf,
    megatron,
    moe,
    pipeline,
    tensor_parallel,
    universal,
    verl,
    zero0,
    zero3,
    zero12,
)
from ucp.sources.format import OPEN_OPTIONS, How, Probe, SourceFormat

if TYPE_CHECKING:
    from ucp.model.tp import TpRule

__all__ = ["SOURCE_FORMATS", "source_format", "claimant", "open_probe", "open_reader", "opened", "run_folder"]

#: every format ucp reads (a DeepSpeed checkpoint's layouts each have one)
SOURCE_FORMATS: tuple[SourceFormat, ...] = (
    universal.FORMAT,
    ds_universal.FORMAT,
    dcp.FORMAT,
    megatron.FORMAT,
    hf.TRAINER_FORMAT,
    hf.ACCELERATE_FORMAT,
    hf.TRAINER_FSDP_FORMAT,
    hf.ACCELERATE_FSDP_FORMAT,
    verl.FORMAT,
    zero3.FORMAT,
    zero12.FORMAT,
    zero0.FORMAT,
    tensor_parallel.FORMAT,
    pipeline.FORMAT,
    moe.FORMAT,
    autoep.FORMAT,
)

_BY_NAME = {f.name: f for f in SOURCE_FORMATS}


def source_format(name: str) -> SourceFormat:
    """The registered format called ``name`` (a reader's :attr:`~ucp.model.records.Reader.format`)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"no source format {name!r}; known: {', '.join(_BY_NAME)}") from None


def claimant(probe: Probe, family: str | None = None) -> SourceFormat:
    """The one format that claims ``probe`` (among ``family``'s, when given): every claimant but those another
    claimant refines must be one; two apart are refused in one line naming both; none: the reason DeepSpeed's
    layout gave (the usual case), or a line naming what ucp reads."""
    formats = [f for f in SOURCE_FORMATS if family is None or f.family == family]
    claims = [f for f in formats if f.claims(probe)]
    winners = [f for f in claims if not any(f.is_refined_by(other) for other in claims)]
    if len(winners) == 1:
        return winners[0]
    if len(winners) > 1:
        a, b = winners[:2]
        raise InputError(
            f"{probe.path} holds both a {a.label} and a {b.label}: move one of them to a folder of its own (or name "
            "a DeepSpeed tag folder itself)"
        )
    for look in ("ds-universal", "deepspeed"):  # a broken ds_to_universal folder first: its line is the sharper
        if look in probe.errors:
            raise probe.errors[look]
    raise InputError(f"{probe.path} is no checkpoint ucp reads ({', '.join(f.label for f in SOURCE_FORMATS)})")


def open_probe(probe: Probe, how: How, family: str | None = None) -> Reader:
    """The reader of the format :func:`claimant` finds; an option that format does not take is refused first."""
    chosen = claimant(probe, family)
    for option in sorted(how.given() - chosen.takes):
        takers = [f.label for f in SOURCE_FORMATS if option in f.takes]
        raise InputError(
            f"{OPEN_OPTIONS[option]} apply to a {' or a '.join(takers)} only; {probe.path} is a {chosen.label}"
        )
    reader = chosen.open(probe, how)
    reader.mark_source(chosen.name, (probe.path,))
    return reader


def open_reader(
    path: str | os.PathLike[str],
    *,
    tag: str | None = None,
    optimizer: str | None = None,
    verify: bool = True,
    tp_rules: Sequence[tuple[str, TpRule]] = (),
    frozen: Sequence[str] = (),
) -> Reader:
    """A reader for whatever checkpoint ``path`` is, in any format of :data:`SOURCE_FORMATS` (a universal
    directory, a DeepSpeed checkpoint of any stage and layout, folder or tag folder, a ds_to_universal folder, a
    torch.distributed.checkpoint folder, a Hugging Face Trainer or Accelerate folder).

    ``tag`` names a DeepSpeed tag folder (a folder holding both ``latest`` and ``latest_universal`` is read as the
    native checkpoint; name the universal folder with ``tag`` to read that one). ``optimizer`` names the flavour
    where detection cannot tell. ``tp_rules`` ((regex, rule) pairs) add to or override the tensor-parallel rules a
    checkpoint records. ``frozen`` names the frozen parameters where the files cannot tell them (a DCP folder's
    one-rank save, a stage-0 checkpoint). The reader records its format (:attr:`Reader.format`) and ``path`` as its
    input (:attr:`Reader.inputs`), which no output may overlap.
    """
    path = Path(path)
    how = How(tag=tag, optimizer=optimizer, verify=verify, tp_rules=tuple(tp_rules), frozen=tuple(frozen))
    with phase(f"read {path}'s metadata"):
        return open_probe(Probe(path, tag), how)


def run_folder(path: str | os.PathLike[str]) -> RunFolder | None:
    """The training framework's run folder at ``path`` (a Trainer or Accelerate folder), without opening its
    checkpoint: where the files that go with the weights (config, tokenizer) are found."""
    return Probe(Path(path)).hf


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
