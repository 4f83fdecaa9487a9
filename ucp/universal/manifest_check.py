"""Checking a manifest read back: ucp.json is untrusted input, so every field a reader relies on is checked for type,
range and consistency before anything is built from it: the top-level fields (:func:`check_header`), each parameter's
entry as it is read (:func:`check_param`), then the parameters against the groups and ties (:func:`check_members`)."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import fields
from typing import Any

from ucp.errors import CorruptFileError
from ucp.model.records import SourceInfo
from ucp.universal.file_names import FP32_FILE, MANIFEST, SOURCE_LAYOUTS, STATE_FILE, SUFFIX, folder_for, state_file

__all__ = ["MAX_DIMS", "MAX_NUMEL", "MAX_NAME", "check_header", "check_param", "check_members", "given_twice"]

logger = logging.getLogger(__name__)

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


def check_param(i: int, p: Any) -> None:
    """Entry ``i`` of ``params``: every field of its type and range, its files named and sized."""
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


def check_header(raw: Any) -> None:
    """Every top-level field but the parameters' entries (each checked by :func:`check_param` as it is read), of the
    right type and range: the source, the optimizer, the shared files. Raises CorruptFileError."""
    _need(isinstance(raw, dict), "the manifest", raw, "an object")
    _check_kinds(raw)
    _check_source(raw["source"])
    _check_optimizer(raw.get("optimizer", {}))
    for name, entry in raw.get("files", {}).items():
        _check_file("files", name, entry)
    _need(STATE_FILE in raw.get("files", {}), "files", sorted(raw.get("files", {})), f"a list holding {STATE_FILE}")


def given_twice(what: str) -> CorruptFileError:
    """The error for a parameter name (``what="names"``) or folder (``"folders"``) that ``params`` gives twice."""
    return _bad(
        "params", f"({what} given twice)", "a list of distinct names" if what == "names" else "one folder per parameter"
    )


#: a parameter's (frozen, group) by name, None for a name the manifest does not list
Member = Callable[[str], "tuple[bool, int | None] | None"]


def check_members(raw: Mapping[str, Any], names: Iterable[str], member: Member) -> None:
    """The parameters against the rest, once all are read (``names``, and ``member(name)``): groups whose members
    are exactly the trained parameters that name them, ties to existing parameters. Raises CorruptFileError."""
    members = _check_groups(raw["param_groups"], member)
    for name in names:
        frozen, group = member(name) or (True, None)
        _need(frozen or name in members, f"params ({name!r}).group", group, "a group that lists it")
    for alias, owner in raw.get("tied", {}).items():
        _need(
            isinstance(owner, str) and member(owner) is not None and member(alias) is None,
            f"tied[{alias!r}]",
            owner,
            "a parameter",
        )


def _check_kinds(raw: dict[str, Any]) -> None:
    """The top-level fields are of their kinds: objects, lists, lists of strings."""
    for key, kind in (("source", dict), ("params", list), ("param_groups", list)):
        _need(isinstance(raw.get(key), kind), key, raw.get(key), f"a {'list' if kind is list else 'object'}")
    for key, kind in (("optimizer", dict), ("tied", dict), ("files", dict), ("tensor_parallel", dict)) + tuple(
        (layout, dict) for layout in SOURCE_LAYOUTS
    ):
        _need(isinstance(raw.get(key, {}), kind), key, raw.get(key), "an object")
    for key in ("buffers", "warnings"):
        value = raw.get(key, [])
        _need(isinstance(value, list) and all(isinstance(v, str) for v in value), key, value, "a list of strings")


def _check_source(source: dict[str, Any]) -> None:
    """The source's facts: known fields only, each of its type."""
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


def _check_optimizer(opt: dict[str, Any]) -> None:
    """The optimizer's flavour, AdamW mode and step, each of its type or null."""
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


def _check_groups(groups: list[Any], member: Member) -> dict[str, int]:
    """Each param group: a distinct index, hyperparameters, a step, and members that are trained parameters
    naming it and no other group; returns each member's group."""
    members: dict[str, int] = {}
    indexes: set[int] = set()
    for i, g in enumerate(groups):
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
            p = member(name)
            _need(
                p is not None and not p[0] and p[1] == g["index"],
                f"{where}.params",
                name,
                f"a trained parameter whose group is {g['index']}",
            )
            _need(name not in members, f"{where}.params", name, "a parameter no other group lists")
            members[name] = g["index"]
    return members
