"""Config dataclasses that check themselves: field types from the annotations, values from each field's
``check``; and the builder that turns parsed YAML into them, collecting every problem instead of stopping."""

from __future__ import annotations

import difflib
import os
import types
import typing
from collections.abc import Callable, Iterable, Iterator
from dataclasses import MISSING, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Union

from ucp.migrate.issues import Issue, KeyPath, show_path

Check = Callable[[Any], Iterable[tuple[KeyPath, str]]]


def checked(check: Check, **kwargs: Any) -> Any:
    return field(metadata={"check": check}, **kwargs)


class Node:
    """A config dataclass that checks itself: field types from the annotations, values from each
    field's ``check``, and whatever ties fields together from :meth:`cross_issues`."""

    def issues(self) -> list[Issue]:
        return list(node_issues(self, ()))

    def cross_issues(self) -> Iterator[Issue]:
        return iter(())


class _Absent:
    """A required key the YAML did not give (already reported)."""

    def __repr__(self) -> str:
        return "<absent>"


_ABSENT = _Absent()


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _args(hint: Any) -> tuple[Any, ...]:
    """The options of a union hint (``int | None`` -> ``(int, NoneType)``), else the hint itself."""
    return typing.get_args(hint) if typing.get_origin(hint) in (Union, types.UnionType) else (hint,)


def _type_ok(hint: Any, value: Any) -> bool:
    for option in _args(hint):
        if option is type(None):
            if value is None:
                return True
        elif option is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return True
        elif option is bool:
            if isinstance(value, bool):
                return True
        elif option is str:
            if isinstance(value, str):
                return True
        elif option is Path:
            if isinstance(value, Path):
                return True
        elif typing.get_origin(option) is list:
            (item,) = typing.get_args(option)
            # items that are config nodes are checked one by one, each at its own path
            if isinstance(value, list) and (is_dataclass(item) or all(_type_ok(item, v) for v in value)):
                return True
        elif typing.get_origin(option) is dict:
            key, item = typing.get_args(option)
            if isinstance(value, dict) and all(_type_ok(key, k) and _type_ok(item, v) for k, v in value.items()):
                return True
        elif isinstance(option, type) and is_dataclass(option):
            if isinstance(value, option):
                return True
    return False


def _type_name(hint: Any) -> str:
    names = []
    for option in _args(hint):
        if option is type(None):
            continue
        if option is int:
            names.append("an integer")
        elif option is bool:
            names.append("true or false")
        elif option is str:
            names.append("a string")
        elif option is Path:
            names.append("a path (a non-empty string)")
        elif typing.get_origin(option) is list:
            (item,) = typing.get_args(option)
            names.append({str: "a list of strings", int: "a list of integers"}.get(item, "a list"))
        elif typing.get_origin(option) is dict:
            key, item = typing.get_args(option)
            names.append(f"a mapping of {_type_name(key).removeprefix('a ')}s to {_type_name(item)}")
        elif is_dataclass(option):
            keys = [f.name for f in fields(option) if f.metadata.get("yaml", True)]
            names.append(f"a mapping with keys {', '.join(keys)}")
    return " or ".join(names)


def describe_value(value: Any) -> str:
    kind = {dict: "a mapping", list: "a list", bool: "a boolean", float: "a number", type(None): "nothing"}.get(
        type(value), type(value).__name__
    )
    return f"{value!r} ({kind})" if not isinstance(value, (dict, list)) else kind


def node_issues(node: Any, at: KeyPath) -> Iterator[Issue]:
    hints = _hints(type(node))
    clean = True
    for f in fields(node):
        if not f.metadata.get("yaml", True):
            continue
        value = getattr(node, f.name)
        if value is _ABSENT:
            clean = False
            continue
        if not _type_ok(hints[f.name], value):
            clean = False
            yield Issue(at + (f.name,), f"must be {_type_name(hints[f.name])}, got {describe_value(value)}")
            continue
        check = f.metadata.get("check")
        if check is not None:
            for sub, message in check(value):
                clean = False
                yield Issue(at + (f.name,) + sub, message)
        if isinstance(value, Node):
            yield from node_issues(value, at + (f.name,))
        elif isinstance(value, list):
            item_type = _list_item(hints[f.name])
            for i, item in enumerate(value):
                if isinstance(item, Node):
                    yield from node_issues(item, at + (f.name, i))
                elif is_dataclass(item_type):
                    yield Issue(at + (f.name, i), f"must be {_type_name(item_type)}, got {describe_value(item)}")
    if clean:
        for issue in node.cross_issues():
            yield Issue(at + issue.path, issue.message)


def _list_item(hint: Any) -> Any:
    for option in _args(hint):
        if typing.get_origin(option) is list:
            return typing.get_args(option)[0]
    return None


def build_node(cls: type, raw: Any, at: KeyPath, base: Path, issues: list[Issue]) -> Any:
    """YAML data -> an instance of ``cls``. Unknown and missing keys are issues here; values of the
    wrong type are kept as they are, for :meth:`Node.issues` to report with everything else."""
    if not isinstance(raw, dict):
        return raw
    hints = _hints(cls)
    known = {f.name: f for f in fields(cls) if f.metadata.get("yaml", True)}
    for key in raw:
        if key not in known:
            close = difflib.get_close_matches(str(key), list(known), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            issues.append(
                Issue(
                    at + (str(key),),
                    f"unknown key; {hint}{show_path(at) if at else 'the config'} takes {', '.join(known)}",
                )
            )
    values: dict[str, Any] = {}
    for name, f in known.items():
        required = f.default is MISSING and f.default_factory is MISSING
        if name not in raw or (raw[name] is None and not required):
            if required:
                issues.append(Issue(at + (name,), "is required"))
                values[name] = _ABSENT
            continue
        values[name] = _convert(hints[name], raw[name], at + (name,), base, issues)
    return cls(**values)


def _convert(hint: Any, raw: Any, at: KeyPath, base: Path, issues: list[Issue]) -> Any:
    options = [o for o in _args(hint) if o is not type(None)]
    for option in options:
        if isinstance(option, type) and is_dataclass(option) and isinstance(raw, dict):
            return build_node(option, raw, at, base, issues)
        if option is Path and isinstance(raw, str) and raw:
            return Path(os.path.normpath(base / os.path.expanduser(raw)))
        if typing.get_origin(option) is list and isinstance(raw, list):
            (item,) = typing.get_args(option)
            if isinstance(item, type) and is_dataclass(item):
                return [
                    build_node(item, v, at + (i,), base, issues) if isinstance(v, dict) else v
                    for i, v in enumerate(raw)
                ]
    return raw
