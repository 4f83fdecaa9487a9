"""What a target format is: the record each target module declares, what a write is asked (:class:`Request`), and
what it reports (:class:`Written`).

Call order (``ucp.targets.registry``): :func:`~ucp.targets.registry.choose` finds the target for a source and a
request (the format asked for, else the one the source and the options call for), refuses in one line every option
given that the target does not take (``ucp.model.option_table``), then the target's :attr:`TargetFormat.write`
writes OUT through the output guard and returns a :class:`Written`: the one summary line, the notes and the JSON
fields that ``ucp restore`` prints and ``ucp migrate`` reports alike.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ucp.io.guard import OutputPolicy
from ucp.model.option_table import OPTIONS, Option, option
from ucp.model.options import RestoreOptions
from ucp.model.records import Reader

__all__ = ["Request", "TargetFormat", "Written"]


@dataclass(frozen=True)
class Request:
    """What a restore is asked: ``values`` (option name -> value; absent or at its ``unset``: not given), and how
    OUT is written (``overwrite``: True or an OutputPolicy; ``workers``; ``fsync``)."""

    values: Mapping[str, Any] = field(default_factory=dict)
    overwrite: bool | OutputPolicy = False
    workers: int | None = None
    fsync: bool = False

    def get(self, name: str) -> Any:
        """The value of option ``name``, its ``unset`` value when not given."""
        value = self.values.get(name)
        return option(name).unset if value is None else value

    def has(self, name: str) -> bool:
        value = self.values.get(name)
        return value is not None and value != option(name).unset and value != []

    def with_values(self, **changes: Any) -> Request:
        return replace(self, values={**self.values, **changes})

    def restore_options(self, stage: int) -> RestoreOptions:
        """The RestoreOptions of a native write; ``stage`` unless one was given."""
        fields = {name: self.get(name) for name in RestoreOptions.field_names() if name != "stage"}
        chosen = self.get("stage")
        return RestoreOptions(**fields, stage=stage if chosen is None else int(chosen))


@dataclass
class Written:
    """What a write did: one summary line, the notes a user should read, and the JSON fields (``format`` first)."""

    summary: str
    notes: list[str] = field(default_factory=list)
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TargetFormat:
    """One format ucp writes for a new run, declared by its target module and listed once in
    ``ucp.targets.registry``.

    ``write(reader, out, request)``: OUT written, whole or not at all. ``serves(reader, request)``: whether, with no
    format asked for, this target is the one the source and the options call for (asked in registry order).
    ``refusal(options, request)``: the line refusing options it does not take (default: they do not apply to
    ``label``). The options it takes are those whose declaration names it (``ucp.model.option_table``).
    """

    name: str
    label: str
    docs: str
    write: Callable[[Reader, Path, Request], Written]
    serves: Callable[[Reader, Request], bool]
    refusal: Callable[[list[Option], Request], str] | None = None

    @property
    def options(self) -> frozenset[str]:
        return frozenset(o.name for o in OPTIONS if self.name in o.targets)

    def refuse(self, options: list[Option], request: Request) -> str:
        if self.refusal is not None:
            return self.refusal(options, request)
        one = len(options) == 1
        where = ", ".join(sorted({t for o in options for t in o.targets}))
        return (
            f"{', '.join(o.flag for o in options)} {'does' if one else 'do'} not apply to {self.label} (only to "
            f"{where} outputs): drop {'it' if one else 'them'}"
        )
