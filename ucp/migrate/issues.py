"""Problems in a migration config: each with its key path, shown with its YAML line, all reported at once."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ucp.errors import ConfigError, OutputExistsError, UcpError

KeyPath = tuple[str | int, ...]


# -- problems ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Issue:
    """One problem (or warning) in a config, at a key path such as ``("target", "dp")``."""

    path: KeyPath
    message: str
    line: int | None = None  # where the path alone does not tell (a key given twice)


def show_path(path: KeyPath) -> str:
    """``("transforms", 0, "rename", "pattern")`` -> ``transforms[0].rename.pattern``."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else part)
    return text or "(config)"


@dataclass
class Origin:
    """Where a config came from: the file name to show and the line of every key path in it."""

    file: str | None = None
    lines: dict[KeyPath, int] = field(default_factory=dict)

    def where(self, issue: Issue) -> str:
        """``FILE:LINE: key.path: message`` (the line of the nearest key the file has)."""
        line = issue.line or self.line_of(issue.path)
        prefix = f"{self.file}:{line}: " if self.file and line else f"{self.file}: " if self.file else ""
        return f"{prefix}{show_path(issue.path) + ': ' if issue.path else ''}{issue.message}"

    def line_of(self, path: KeyPath) -> int:
        """The line of ``path``, else of its nearest ancestor in the file; 0 when none is."""
        while path:
            if path in self.lines:
                return self.lines[path]
            path = path[:-1]
        return 0


class MigrationConfigError(ConfigError):
    """Every problem found in a migration config, one per line, each with its key path and line."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        head = problems[0] if len(problems) == 1 else f"{len(problems)} problems in the migration config:"
        super().__init__(head if len(problems) == 1 else "\n  ".join([head, *problems]))


def config_error(issues: list[Issue], origin: Origin, exists: list[Issue]) -> UcpError:
    """One error listing every problem, sorted by line; outputs in the way alone read as OutputExistsError."""
    lines = [origin.where(i) for i in sorted(issues + exists, key=lambda i: i.line or origin.line_of(i.path))]
    if not issues:
        return OutputExistsError(lines[0] if len(lines) == 1 else "\n  ".join(["outputs already exist:", *lines]))
    return MigrationConfigError(lines)


def raise_issues(issues: list[Issue], origin: Origin, *, exists: Iterable[Issue] = ()) -> None:
    exists = list(exists)
    if issues or exists:
        raise config_error(issues, origin, exists)
