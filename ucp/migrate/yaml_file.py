"""Reading the YAML file: the parsed tree, the line of every key (for messages), and the config built from it.

The file is untrusted input: it is read up to :data:`MAX_BYTES`, composed by a loader that refuses
nesting deeper than :data:`MAX_DEPTH` and more than :data:`MAX_ALIASES` aliases, and refused when its
aliases would expand it beyond :data:`MAX_NODES` nodes (an alias bomb) or loop back on themselves;
each refusal is one line, within a second.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from ucp.errors import ConfigError
from ucp.migrate.checking import build_node, describe_value
from ucp.migrate.issues import Issue, KeyPath, MigrationConfigError, Origin, raise_issues
from ucp.migrate.schema import MigrationConfig

_T = TypeVar("_T")

#: a migration config is a page of text; these bounds are far above any real one
MAX_BYTES = 1 << 20
MAX_DEPTH = 32
MAX_ALIASES = 64
MAX_NODES = 20_000


class _Refused(yaml.YAMLError):
    """The document breaks one of the bounds above."""

    def __init__(self, problem: str, mark: Any) -> None:
        super().__init__(problem)
        self.problem, self.problem_mark = problem, mark


class _BoundedLoader(yaml.SafeLoader):
    """yaml.SafeLoader that stops composing at :data:`MAX_DEPTH` levels or :data:`MAX_ALIASES` aliases
    (PyYAML's composer recurses once per level: a deep document would otherwise end in RecursionError)."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self._depth = 0
        self._aliases = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                raise _Refused(
                    f"more than {MAX_ALIASES} aliases (*name); write the values out", self.peek_event().start_mark
                )
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _Refused(f"nested more than {MAX_DEPTH} levels deep", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _check_expansion(root: yaml.Node) -> None:
    """Refuse aliases that expand the document past MAX_NODES nodes or MAX_DEPTH levels, or that
    contain themselves: counted on the node graph (each node once), without expanding anything."""
    sizes: dict[int, int] = {}
    depths: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            on_path.discard(key)
            kids = _children(node)
            sizes[key] = 1 + sum(sizes[id(kid)] for kid in kids)
            depths[key] = 1 + max((depths[id(kid)] for kid in kids), default=0)
            if sizes[key] > MAX_NODES:
                raise _Refused(
                    f"its aliases expand it to more than {MAX_NODES:,} values (an alias bomb?)", node.start_mark
                )
            if depths[key] > MAX_DEPTH:
                raise _Refused(f"its aliases nest it more than {MAX_DEPTH} levels deep", node.start_mark)
            continue
        if key in sizes:
            continue
        if key in on_path:
            raise _Refused("an alias refers to a value that contains it", node.start_mark)
        on_path.add(key)
        stack.append((node, True))
        stack.extend((kid, False) for kid in _children(node) if id(kid) not in sizes)


def _guarded(file: str, step: Callable[[], _T]) -> _T:
    """One step of reading the YAML; what goes wrong becomes one line naming the file and line."""
    try:
        return step()
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{file}:{mark.line + 1}" if mark is not None else file
        problem = getattr(err, "problem", None) or str(err)
        verdict = "refused" if isinstance(err, _Refused) else "not valid YAML"
        raise MigrationConfigError([f"{where}: {verdict}: {problem}"]) from None
    except (ValueError, OverflowError, RecursionError) as err:  # e.g. an integer of more digits than Python converts
        raise MigrationConfigError([f"{file}: refused: a value cannot be read: {str(err)[:200]}"]) from None


def _key_lines(root: yaml.Node | None) -> tuple[dict[KeyPath, int], list[Issue]]:
    """The 1-based line of every key path, and the keys given twice, from a walk of the node graph."""
    lines: dict[KeyPath, int] = {}
    duplicates: list[Issue] = []

    def walk(node: yaml.Node, at: KeyPath) -> None:
        if isinstance(node, yaml.MappingNode):
            seen: set[str] = set()
            for key_node, value_node in node.value:
                key = key_node.value
                path = at + (key,)
                if key in seen:
                    duplicates.append(
                        Issue(
                            path,
                            f"is given twice (first on line {lines[path]}); keep one",
                            line=key_node.start_mark.line + 1,
                        )
                    )
                    continue
                seen.add(key)
                lines[path] = key_node.start_mark.line + 1
                walk(value_node, path)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                lines[at + (i,)] = item.start_mark.line + 1
                walk(item, at + (i,))

    if root is not None:
        walk(root, ())
    return lines, duplicates


# -- YAML -------------------------------------------------------------------------------------
def _yaml_lines(text: str, file: str) -> tuple[Any, dict[KeyPath, int], list[Issue]]:
    """Compose within the bounds above, map every key path to its line (before the constructor
    flattens merge keys into the graph), then build the data."""
    loader = _BoundedLoader(text)
    try:
        root = _guarded(file, loader.get_single_node)
        if root is None:
            return None, {}, []
        _guarded(file, lambda: _check_expansion(root))
        lines, duplicates = _key_lines(root)
        data = _guarded(file, lambda: loader.construct_document(root))
    finally:
        loader.dispose()
    return data, lines, duplicates


def _parse(raw: Any, base: Path, origin: Origin) -> tuple[MigrationConfig, list[Issue]]:
    if not isinstance(raw, dict):
        what = "empty" if raw is None else f"{describe_value(raw)}, not a mapping"
        raise MigrationConfigError([f"{origin.file or 'config'}: the config is {what}; it needs at least source:"])
    issues: list[Issue] = []
    config = build_node(MigrationConfig, raw, (), base.absolute(), issues)
    config.origin = origin
    return config, issues + config.issues()


def parse_config(
    raw: Any, *, base: str | os.PathLike = ".", file: str | None = None, lines: dict[KeyPath, int] | None = None
) -> MigrationConfig:
    """A config from already-parsed data (a dict); raises :class:`MigrationConfigError` listing every problem."""
    config, issues = _parse(raw, Path(base), Origin(file, dict(lines or {})))
    raise_issues(issues, config.origin)
    return config


def read_config(path: Path) -> tuple[MigrationConfig, list[Issue]]:
    """The config in ``path`` and every problem found in it (not raised: planning adds its own)."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_BYTES + 1)
        text = raw.decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read: {err}") from None
    if len(raw) > MAX_BYTES:
        raise ConfigError(f"{path}: refused: longer than {MAX_BYTES:,} bytes; a migration config is a page of text")
    data, lines, duplicates = _yaml_lines(text, str(path))
    config, issues = _parse(data, path.parent, Origin(str(path), lines))
    return config, duplicates + issues


def load_config(path: str | os.PathLike) -> MigrationConfig:
    """Read a migration YAML; relative paths in it resolve against its folder."""
    config, issues = read_config(Path(path))
    raise_issues(issues, config.origin)
    return config
