"""ucp.json as dataclasses: the manifest of a universal directory (docs/format.md is its spec).

It is written last, to a temporary name, then renamed: its presence means the directory is whole.
Per parameter it records the folder, shape, dtype, group, step and every file with its size and
crc32; the optimizer's state keys are the files' names, so a new optimizer needs no new field.

A manifest read back is untrusted input: ``ucp.universal.param_table`` checks the type and range of
every field it uses (``ucp.universal.manifest_check``) before anything is built from it, so a hand-made
``ucp.json`` ends in one CorruptFileError, never in a TypeError deep inside a target.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

from ucp.model.records import Facts, ParamMeta, Reader, SourceInfo
from ucp.model.version import VERSION
from ucp.universal.file_names import (
    FORMAT,
    FORMAT_VERSION,
    FP32_FILE,
    MANIFEST,
    SOURCE_LAYOUTS,
    STATE_FILE,
    STEP_FILE,
    SUFFIX,
    folder_for,
    state_file,
)
from ucp.universal.manifest_check import MAX_DIMS, MAX_NAME, MAX_NUMEL

__all__ = [
    "write_manifest",
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "STATE_FILE",
    "FP32_FILE",
    "STEP_FILE",
    "FileEntry",
    "ParamEntry",
    "folder_for",
    "state_file",
    "manifest_json",
    "SOURCE_LAYOUTS",
    "source_layouts",
    "SUFFIX",
    "MAX_DIMS",
    "MAX_NUMEL",
    "MAX_NAME",
]


@dataclass(slots=True)
class FileEntry:
    bytes: int
    crc32: str


@dataclass(slots=True)
class ParamEntry:
    name: str
    folder: str
    shape: list[int]
    dtype: str
    group: int | None
    frozen: bool
    step: int | None
    files: dict[str, FileEntry] = field(default_factory=dict)
    #: the keys whose files hold a 0-dim scalar of the optimizer (NAdam's mu_product), not a tensor
    scalars: list[str] = field(default_factory=list)

    def meta(self) -> ParamMeta:
        return ParamMeta(self.name, tuple(self.shape), self.dtype, self.group, self.frozen)

    @property
    def state_keys(self) -> tuple[str, ...]:
        """The optimizer's per-parameter tensors, as their files name them (``exp_avg.pt`` -> ``exp_avg``)."""
        skip = {FP32_FILE, STEP_FILE} | {state_file(k) for k in self.scalars}
        return tuple(f[: -len(SUFFIX)] for f in self.files if f not in skip)

    def to_json(self) -> dict[str, Any]:
        """The entry as ucp.json holds it; ``scalars`` only where there are some (Adam's entries stay as they were).
        Spelled out, not ``asdict``: that recursion cost 11 s of a 10^5-parameter manifest."""
        out: dict[str, Any] = {
            "name": self.name,
            "folder": self.folder,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "group": self.group,
            "frozen": self.frozen,
            "step": self.step,
            "files": {key: {"bytes": f.bytes, "crc32": f.crc32} for key, f in self.files.items()},
        }
        if self.scalars:
            out["scalars"] = list(self.scalars)
        return out


def source_layouts(reader: Reader) -> dict[str, Any]:
    """The source's pipeline stages, MoE or AutoEP layers (its facts' layout), as ucp.json keeps them."""
    layout = reader.facts.layout
    return layout.to_json() if layout is not None else {}


def write_manifest(out: TextIO, header: Mapping[str, Any], params: Iterable[ParamEntry]) -> None:
    """Write ucp.json to ``out``: one top-level field of ``header`` per line, the ``params`` field from ``params``,
    one entry per line, encoded one at a time (a 10^5-parameter manifest is never whole in memory, as dicts or as
    text). Each line comes from json's C encoder; an indented dump goes through its pure-Python one (11 s for 10^5
    parameters)."""
    out.write("{\n")
    first = True
    for key, value in header.items():
        out.write("" if first else ",\n")
        first = False
        out.write(f" {json.dumps(key)}: ")
        if key != "params":
            out.write(json.dumps(value))
            continue
        any_entry = False
        for entry in params:
            out.write(",\n  " if any_entry else "[\n  ")
            out.write(json.dumps(entry.to_json()))
            any_entry = True
        out.write("\n ]" if any_entry else "[]")
    out.write("\n}\n")


def manifest_json(
    facts: Facts,
    params: list[ParamEntry],
    files: dict[str, FileEntry],
    layouts: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """ucp.json's content; ``layouts`` are :func:`source_layouts`."""
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created_by": f"ucp {VERSION}",
        "checksum": "crc32",
        "source": _source_json(facts.info),
        "optimizer": {"flavour": facts.flavour, "adam_w_mode": facts.adam_w_mode, "step": facts.step},
        "warnings": list(facts.warnings),
        "param_groups": [
            {"index": g.index, "hyperparameters": g.hyper.to_json(), "raw": g.raw, "step": g.step, "params": g.params}
            for g in facts.groups
        ],
        "params": [p.to_json() for p in params],
        "tied": dict(facts.tied),
        "buffers": list(facts.buffer_names),
        "files": {name: asdict(entry) for name, entry in files.items()},
        **(
            {"tensor_parallel": {"source_degree": facts.info.mp_world_size, "rules": dict(facts.tp_rules)}}
            if facts.tp_rules
            else {}
        ),
        **{key: value for key, value in (layouts or {}).items() if key in SOURCE_LAYOUTS and value},
    }


def _source_json(info: SourceInfo) -> dict[str, Any]:
    """The source's facts; ``replicas`` only where a run had them (MiCS), so that every other directory reads
    as ucp wrote it before the field existed."""
    out = asdict(info)
    if out.get("replicas") == 1:
        del out["replicas"]
    return out
