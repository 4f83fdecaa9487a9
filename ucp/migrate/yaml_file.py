"""Reading the YAML file: the parsed tree, the line of every key (for messages), and the config built from it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from ucp.errors import ConfigError
from ucp.migrate.checking import build_node, describe_value
from ucp.migrate.issues import Issue, KeyPath, MigrationConfigError, Origin, raise_issues
from ucp.migrate.schema import MigrationConfig


# -- YAML -------------------------------------------------------------------------------------
def _yaml_lines(text: str, file: str) -> tuple[Any, dict[KeyPath, int], list[Issue]]:
    """Parse with yaml.safe_load, and map every key path to its 1-based line with a node walk."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{file}:{mark.line + 1}" if mark is not None else file
        problem = getattr(err, "problem", None) or str(err)
        raise MigrationConfigError([f"{where}: not valid YAML: {problem}"]) from None
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
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read: {err}") from None
    data, lines, duplicates = _yaml_lines(text, str(path))
    config, issues = _parse(data, path.parent, Origin(str(path), lines))
    return config, duplicates + issues


def load_config(path: str | os.PathLike) -> MigrationConfig:
    """Read a migration YAML; relative paths in it resolve against its folder."""
    config, issues = read_config(Path(path))
    raise_issues(issues, config.origin)
    return config
