"""What a source format is: the record each source module declares, and the probe every format's claim reads.

Call order (``ucp.sources.registry.open_reader``): one :class:`Probe` of PATH is built; every registered
:class:`SourceFormat` is asked :attr:`SourceFormat.claims` on it (each look at the disk is made once, by the probe);
exactly one format must claim it, or one that :attr:`~SourceFormat.refines` every other claimant (a Trainer folder
wraps a DeepSpeed checkpoint; a universal directory carries DeepSpeed's ds_to_universal files too); then that
format's :attr:`~SourceFormat.open` builds the :class:`~ucp.model.records.Reader` from the probe and the caller's
:class:`How`. A claim only looks (file names, small files); whatever is wrong inside is the opener's to say.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from ucp.deepspeed.layout import CheckpointFiles, find_checkpoint, find_ds_universal
from ucp.errors import InputError
from ucp.model.records import Facts, Reader

if TYPE_CHECKING:
    from ucp.frameworks.hf import HfFolder
    from ucp.model.tp import TpRule

__all__ = ["How", "Probe", "SourceFormat", "OPEN_OPTIONS"]

_T = TypeVar("_T")

#: the options of :func:`ucp.sources.open_reader` that only some formats take (the rest every format accepts)
OPEN_OPTIONS = {"frozen": "the frozen parameters' names (--frozen)"}


@dataclass(frozen=True)
class How:
    """How the caller asks a source to be read: the options of :func:`ucp.sources.open_reader`."""

    tag: str | None = None
    optimizer: str | None = None
    verify: bool = True
    tp_rules: Sequence[tuple[str, TpRule]] = ()
    frozen: Sequence[str] = ()

    def given(self) -> set[str]:
        """The format-specific options (:data:`OPEN_OPTIONS`) the caller gave."""
        return {name for name in OPEN_OPTIONS if getattr(self, name)}


class Probe:
    """PATH as the claims see it; each look at the disk is made once and kept (a DeepSpeed folder's rank files,
    a Hugging Face wrapper, a ds_to_universal folder). ``tag`` is the caller's (a DeepSpeed tag folder's name)."""

    def __init__(self, path: Path, tag: str | None = None) -> None:
        self.path = path
        self.tag = tag
        #: why PATH is not what a look expected (a ds_to_universal folder, a DeepSpeed checkpoint), by look: said
        #: when no format claims PATH
        self.errors: dict[str, InputError] = {}

    def _look(self, name: str, look: Callable[[], _T]) -> _T | None:
        """One look at the disk; a refusal it raises is kept (under ``name``) and reads as "not one"."""
        try:
            return look()
        except InputError as err:
            self.errors[name] = err
            return None

    def with_tag(self, tag: str | None) -> Probe:
        """The same path read at another tag (a Trainer folder's own)."""
        return Probe(self.path, tag)

    def has(self, name: str) -> bool:
        """A regular file ``name`` in PATH."""
        return (self.path / name).is_file()

    @cached_property
    def deepspeed(self) -> CheckpointFiles | None:
        """DeepSpeed's rank files of PATH (at the tag), or None (the reason kept in :attr:`errors`)."""
        return self._look("deepspeed", lambda: find_checkpoint(self.path, self.tag))

    @cached_property
    def hf(self) -> HfFolder | None:
        """The Trainer or Accelerate folder PATH is (never when a tag is named: then its DeepSpeed checkpoint is)."""
        from ucp.frameworks.hf import find_hf_folder

        return None if self.tag is not None or not self.path.is_dir() else find_hf_folder(self.path)

    @cached_property
    def ds_universal(self) -> Path | None:
        """The ds_to_universal folder PATH means (itself, its tag, or what ``latest_universal`` names)."""
        return self._look("ds-universal", lambda: find_ds_universal(self.path, self.tag))

    @cached_property
    def autoep(self) -> bool:
        """DeepSpeed files whose model states list AutoEP layers (its ZeRO-3 save writes no expert files)."""
        from ucp.sources.autoep import is_autoep

        files = self.deepspeed
        return files is not None and (bool(files.experts) or files.stage3) and not files.stage0 and is_autoep(files)


@dataclass(frozen=True)
class SourceFormat:
    """One on-disk format ucp reads, declared by its source module and listed once in ``ucp.sources.registry``.

    ``claims(probe)``: whether PATH is one (looks only). ``open(probe, how)``: the reader. ``family``: the formats'
    kin (every DeepSpeed layout is ``deepspeed``). ``refines``: names or families this one is a special case of,
    which it wins over when both claim. ``takes``: the options of :data:`OPEN_OPTIONS` it takes (one given to a
    format that does not take it is refused in one line). ``describe(facts)``: what a report calls an opened one
    (default ``label``). ``docs``: where docs/ specifies it (``file.md#anchor``).
    """

    name: str
    label: str
    docs: str
    claims: Callable[[Probe], bool]
    open: Callable[[Probe, How], Reader]
    family: str = ""
    refines: tuple[str, ...] = ()
    takes: frozenset[str] = field(default_factory=frozenset)
    describe: Callable[[Facts], str] | None = None

    def title(self, facts: Facts) -> str:
        """What ``ucp inspect`` and ``ucp migrate`` call a checkpoint of this format."""
        return self.describe(facts) if self.describe is not None else self.label

    def is_refined_by(self, other: SourceFormat) -> bool:
        """``other`` is a special case of this format (it names this one, or its family, in ``refines``)."""
        return other is not self and bool({self.name, self.family} & set(other.refines))
