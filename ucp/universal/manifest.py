"""ucp.json as dataclasses: the manifest of a universal directory (docs/format.md is its spec).

It is written last, to a temporary name, then renamed: its presence means the directory is whole.
Per parameter it records the folder, shape, dtype, group, step and every file with its size and
crc32; the optimizer's state keys are the files' names, so a new optimizer needs no new field.

A manifest read back is untrusted input: :func:`facts_from_manifest` checks the type and range of
every field it uses (:func:`check_manifest`) before anything is built from it, so a hand-made
``ucp.json`` ends in one CorruptFileError, never in a TypeError deep inside a target.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ucp.errors import CorruptFileError, InputError
from ucp.model.hyper import Hyper
from ucp.model.layouts import LAYOUT_KINDS, SourceLayout
from ucp.model.records import Facts, GroupMeta, ParamMeta, Reader, SourceInfo
from ucp.model.version import VERSION

__all__ = [
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
]

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


@dataclass
class FileEntry:
    bytes: int
    crc32: str


@dataclass
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
        """The entry as ucp.json holds it; ``scalars`` only where there are some (Adam's entries stay as they were)."""
        out = asdict(self)
        if not self.scalars:
            del out["scalars"]
        return out


def state_file(key: str) -> str:
    """The file of one optimizer state key in a parameter's folder."""
    return key + SUFFIX


def source_layouts(reader: Reader) -> dict[str, Any]:
    """The source's pipeline stages, MoE or AutoEP layers (its facts' layout), as ucp.json keeps them."""
    layout = reader.facts.layout
    return layout.to_json() if layout is not None else {}


def _layout(raw: Mapping[str, Any]) -> SourceLayout | None:
    """The layout a manifest records (one of :data:`SOURCE_LAYOUTS`), as the facts carry it."""
    found = [SourceLayout(kind, raw[kind]) for kind in SOURCE_LAYOUTS if raw.get(kind)]
    return found[0] if found else None


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


# -- checking a manifest read back ------------------------------------------------------------
#: bounds far above any real model: a claim beyond them is damage or a lie
MAX_DIMS = 16
MAX_NUMEL = 1 << 48
MAX_NAME = 4096
_CRC = re.compile(r"^[0-9a-f]{8}$")
_DTYPE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")


def _bad(where: str, value: Any, wanted: str) -> CorruptFileError:
    shown = repr(value)
    shown = shown[:80] + "..." if len(shown) > 80 else shown
    return CorruptFileError(f"{MANIFEST} is malformed: {where} is {shown}, not {wanted}")


def _source_json(info: SourceInfo) -> dict[str, Any]:
    """The source's facts; ``replicas`` only where a run had them (MiCS), so that every other directory reads
    as ucp wrote it before the field existed."""
    out = asdict(info)
    if out.get("replicas") == 1:
        del out["replicas"]
    return out


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _need(ok: bool, where: str, value: Any, wanted: str) -> None:
    if not ok:
        raise _bad(where, value, wanted)


def _name(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_NAME and "\x00" not in value


def _check_file(where: str, name: Any, entry: Any) -> None:
    """A file of the directory: a plain ``.pt`` name (one path component) with a size and a crc32."""
    _need(
        isinstance(name, str) and name.endswith(SUFFIX) and folder_for(name) == name and name not in (".", ".."),
        f"a file name in {where}",
        name,
        "a plain file name ending in .pt",
    )
    _need(isinstance(entry, dict) and set(entry) == {"bytes", "crc32"}, f"{where}[{name!r}]", entry, "{bytes, crc32}")
    _need(_whole(entry["bytes"]), f"{where}[{name!r}].bytes", entry["bytes"], "a size in bytes")
    _need(
        isinstance(entry["crc32"], str) and bool(_CRC.match(entry["crc32"])),
        f"{where}[{name!r}].crc32",
        entry["crc32"],
        "8 hex digits",
    )


def _check_param(i: int, p: Any) -> None:
    where = f"params[{i}]"
    _need(isinstance(p, dict), where, p, "an object")
    _need(_name(p.get("name")), f"{where}.name", p.get("name"), "a parameter name")
    where = f"params[{i}] ({p['name']!r})"
    _need(isinstance(p.get("folder"), str), f"{where}.folder", p.get("folder"), "a folder name")
    shape = p.get("shape")
    _need(
        isinstance(shape, list) and len(shape) <= MAX_DIMS and all(map(_whole, shape)),
        f"{where}.shape",
        shape,
        "a list of sizes",
    )
    _need(math.prod(shape) <= MAX_NUMEL, f"{where}.shape", shape, f"a shape of at most {MAX_NUMEL:,} elements")
    _need(
        isinstance(p.get("dtype"), str) and bool(_DTYPE.match(p["dtype"])),
        f"{where}.dtype",
        p.get("dtype"),
        "a dtype name",
    )
    _need(isinstance(p.get("frozen"), bool), f"{where}.frozen", p.get("frozen"), "true or false")
    group, step = p.get("group"), p.get("step")
    if p["frozen"]:
        _need(group is None, f"{where}.group", group, "null (the parameter is frozen)")
    else:
        _need(_whole(group), f"{where}.group", group, "a param group index")
    _need(step is None or _whole(step), f"{where}.step", step, "a step count or null")
    files = p.get("files")
    _need(isinstance(files, dict) and FP32_FILE in files, f"{where}.files", files, f"files including {FP32_FILE}")
    for name, entry in files.items():
        _check_file(f"{where}.files", name, entry)
    scalars = p.get("scalars", [])
    _need(
        isinstance(scalars, list) and all(isinstance(k, str) and state_file(k) in files for k in scalars),
        f"{where}.scalars",
        scalars,
        "a list of keys whose files it lists",
    )


def check_manifest(raw: Any) -> None:
    """Every field a reader relies on, of the right type and range, and consistent with the rest:
    unique names, groups whose members are exactly the trained parameters that name them, ties
    to existing parameters, file names that stay inside their folder. Raises CorruptFileError."""
    _need(isinstance(raw, dict), "the manifest", raw, "an object")
    for key, kind in (("source", dict), ("params", list), ("param_groups", list)):
        _need(isinstance(raw.get(key), kind), key, raw.get(key), f"a {'list' if kind is list else 'object'}")
    for key, kind in (("optimizer", dict), ("tied", dict), ("files", dict), ("tensor_parallel", dict)) + tuple(
        (layout, dict) for layout in SOURCE_LAYOUTS
    ):
        _need(isinstance(raw.get(key, {}), kind), key, raw.get(key), "an object")
    for key in ("buffers", "warnings"):
        value = raw.get(key, [])
        _need(isinstance(value, list) and all(isinstance(v, str) for v in value), key, value, "a list of strings")
    source = raw["source"]
    known = {f.name for f in fields(SourceInfo)}
    _need(
        set(source) <= known and {"format", "zero_stage", "dp_world_size"} <= set(source),
        "source",
        sorted(source),
        f"fields of {sorted(known)}",
    )
    for key in ("zero_stage", "dp_world_size", "mp_world_size", "global_steps", "skipped_steps"):
        _need(key not in source or _whole(source[key]), f"source.{key}", source.get(key), "a whole number")
    _need(
        _whole(source.get("replicas", 1)) and source.get("replicas", 1) >= 1,
        "source.replicas",
        source.get("replicas"),
        "a whole number of at least 1",
    )
    for key in ("sub_group_size", "global_samples", "iteration"):
        _need(
            source.get(key) is None or _whole(source[key]), f"source.{key}", source.get(key), "a whole number or null"
        )
    for key in ("format", "dtype", "ds_version", "tag"):
        _need(source.get(key) is None or isinstance(source[key], str), f"source.{key}", source.get(key), "a string")
    _need(isinstance(source.get("ds_config", {}), dict), "source.ds_config", source.get("ds_config"), "an object")
    _need(
        isinstance(source.get("frozen_excluded", False), bool),
        "source.frozen_excluded",
        source.get("frozen_excluded"),
        "true or false",
    )
    opt = raw.get("optimizer", {})
    _need(
        opt.get("flavour") is None or isinstance(opt["flavour"], str), "optimizer.flavour", opt.get("flavour"), "a name"
    )
    _need(
        opt.get("adam_w_mode") is None or isinstance(opt["adam_w_mode"], bool),
        "optimizer.adam_w_mode",
        opt.get("adam_w_mode"),
        "true, false or null",
    )
    _need(opt.get("step") is None or _whole(opt["step"]), "optimizer.step", opt.get("step"), "a step count or null")

    for i, p in enumerate(raw["params"]):
        _check_param(i, p)
    params = {p["name"]: p for p in raw["params"]}
    _need(len(params) == len(raw["params"]), "params", "(names given twice)", "a list of distinct names")
    folders = {p["folder"] for p in raw["params"]}
    _need(len(folders) == len(raw["params"]), "params", "(folders given twice)", "one folder per parameter")
    members: dict[str, int] = {}
    indexes: set[int] = set()
    for i, g in enumerate(raw["param_groups"]):
        where = f"param_groups[{i}]"
        _need(
            isinstance(g, dict) and _whole(g.get("index")) and g["index"] not in indexes,
            f"{where}.index",
            g.get("index") if isinstance(g, dict) else g,
            "a distinct group index",
        )
        indexes.add(g["index"])
        _need(
            isinstance(g.get("hyperparameters"), dict) and isinstance(g.get("raw", {}), dict),
            where,
            "(hyperparameters)",
            "an object with hyperparameters",
        )
        _need(g.get("step") is None or _whole(g["step"]), f"{where}.step", g.get("step"), "a step count or null")
        names = g.get("params")
        _need(
            isinstance(names, list) and all(isinstance(n, str) for n in names),
            f"{where}.params",
            names,
            "a list of names",
        )
        for name in names:
            p = params.get(name)
            _need(
                p is not None and not p["frozen"] and p["group"] == g["index"],
                f"{where}.params",
                name,
                f"a trained parameter whose group is {g['index']}",
            )
            _need(name not in members, f"{where}.params", name, "a parameter no other group lists")
            members[name] = g["index"]
    for name, p in params.items():
        _need(p["frozen"] or name in members, f"params ({name!r}).group", p["group"], "a group that lists it")
    for alias, owner in raw.get("tied", {}).items():
        _need(
            isinstance(owner, str) and owner in params and alias not in params, f"tied[{alias!r}]", owner, "a parameter"
        )
    for name, entry in raw.get("files", {}).items():
        _check_file("files", name, entry)
    _need(STATE_FILE in raw.get("files", {}), "files", sorted(raw.get("files", {})), f"a list holding {STATE_FILE}")


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
