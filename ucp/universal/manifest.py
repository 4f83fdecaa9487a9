"""ucp.json as dataclasses: the manifest of a universal directory (docs/format.md is its spec).

It is written last, to a temporary name, then renamed: its presence means the directory is whole.
Per parameter it records the folder, shape, dtype, group, step and every file with its size and
crc32; the optimizer's state keys are the files' names, so a new optimizer needs no new field.

A manifest read back is untrusted input: :func:`facts_from_manifest` checks the type and range of
every field it uses (:func:`check_manifest`) before anything is built from it, so a hand-made
``ucp.json`` ends in one CorruptFileError, never in a TypeError deep inside a target.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

from ucp.errors import CorruptFileError
from ucp.model.hyper import Hyper
from ucp.model.layouts import SourceLayout
from ucp.model.records import Facts, GroupMeta, ParamMeta, Reader, SourceInfo
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
from ucp.universal.manifest_check import MAX_DIMS, MAX_NAME, MAX_NUMEL, check_manifest

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
    "facts_from_manifest",
    "check_manifest",
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


def _layout(raw: Mapping[str, Any]) -> SourceLayout | None:
    """The layout a manifest records (one of :data:`SOURCE_LAYOUTS`), as the facts carry it."""
    found = [SourceLayout(kind, raw[kind]) for kind in SOURCE_LAYOUTS if raw.get(kind)]
    return found[0] if found else None


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


def facts_from_manifest(raw: Mapping[str, Any]) -> tuple[Facts, list[ParamEntry], dict[str, FileEntry]]:
    """The facts, entries and shared files of a manifest, each field checked first (check_manifest)."""
    check_manifest(raw)
    try:
        info = SourceInfo(**raw["source"])
        params = [
            ParamEntry(**{**p, "files": {k: FileEntry(**v) for k, v in p.get("files", {}).items()}})
            for p in raw["params"]
        ]
        keys = {p.name: p.state_keys for p in params}
        groups = [
            GroupMeta(
                index=g["index"],
                hyper=Hyper.from_json(g["hyperparameters"]),
                raw=dict(g.get("raw", {})),
                params=list(g["params"]),
                step=g.get("step"),
                state_keys=_union(keys.get(n, ()) for n in g["params"]),
            )
            for g in raw["param_groups"]
        ]
        opt = raw.get("optimizer", {})
        facts = Facts(
            info=info,
            flavour=opt.get("flavour"),
            adam_w_mode=opt.get("adam_w_mode"),
            step=opt.get("step"),
            groups=groups,
            params=[p.meta() for p in params],
            tied=dict(raw.get("tied", {})),
            buffer_names=list(raw.get("buffers", [])),
            warnings=list(raw.get("warnings", [])),
            tp_rules={k: dict(v) for k, v in (raw.get("tensor_parallel") or {}).get("rules", {}).items()},
            layout=_layout(raw),
        )
        files = {k: FileEntry(**v) for k, v in raw.get("files", {}).items()}
    except (KeyError, TypeError, ValueError) as err:
        raise CorruptFileError(f"{MANIFEST} is malformed: {type(err).__name__}: {err}") from None
    return facts, params, files


def _union(key_lists: Iterable[tuple[str, ...]]) -> tuple[str, ...]:
    """Keys in first-seen order: a group's members may carry the same keys or (reset) none."""
    out: dict[str, None] = {}
    for keys in key_lists:
        out.update(dict.fromkeys(keys))
    return tuple(out)
