"""``ucp migrate CONFIG.yaml``: one YAML file -> a checked plan -> the calls that read, transform, restore, export.

Call order: :func:`load_config` parses the YAML into a :class:`MigrationConfig` (unknown keys,
types and values: every problem at once, each with its key path and line);
:func:`plan_migration` opens the source's facts and checks what only the checkpoint can tell
(renames that collide, drops that empty the model, a ZeRO-3 layout that cannot hold a reset, outputs
that exist) and returns a :class:`MigrationPlan` without writing anything; :meth:`MigrationPlan.describe`
is the ``--dry-run`` output and :func:`execute` does the work: source -> transforms -> universal
(if asked) -> native target (if asked) -> exports. :func:`run_migration` is all of it, for the CLI.

Relative paths in a config file resolve against the folder that holds the file.
"""

from __future__ import annotations

import difflib
import inspect
import logging
import os
import re
import types
import typing
from collections.abc import Callable, Iterable, Iterator
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Union

import yaml

from ucp.errors import ConfigError, OutputExistsError, StepConflictError, UcpError
from ucp.model import flavours
from ucp.model.options import RestoreOptions
from ucp.model.records import DTYPES, Facts, Reader
from ucp.transforms import Drop, Rename, ResetOptimizer, Step, TransformedReader, TransformPlan, plan_transforms

__all__ = [
    "MigrationConfig",
    "TransformConfig",
    "RenameConfig",
    "ResetConfig",
    "TargetConfig",
    "ExportConfig",
    "TensorParallelConfig",
    "TpRuleConfig",
    "Issue",
    "MigrationConfigError",
    "MigrationPlan",
    "load_config",
    "parse_config",
    "plan_migration",
    "execute",
    "run_migration",
]

logger = logging.getLogger(__name__)

KeyPath = tuple[str | int, ...]
EXPORT_FORMATS = ("safetensors", "torch")
_EXPORT_SUFFIXES = {"safetensors": (".safetensors",), "torch": (".bin", ".pt", ".pth")}  # else OUT is a folder
_SIZE = re.compile(r"^\s*(\d+(\.\d*)?|\.\d+)\s*([kmgt]i?b|b)?\s*$", re.IGNORECASE)


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
class _Origin:
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


def _error(issues: list[Issue], origin: _Origin, exists: list[Issue]) -> UcpError:
    """One error listing every problem, sorted by line; outputs in the way alone read as OutputExistsError."""
    lines = [origin.where(i) for i in sorted(issues + exists, key=lambda i: i.line or origin.line_of(i.path))]
    if not issues:
        return OutputExistsError(lines[0] if len(lines) == 1 else "\n  ".join(["outputs already exist:", *lines]))
    return MigrationConfigError(lines)


def _raise(issues: list[Issue], origin: _Origin, *, exists: Iterable[Issue] = ()) -> None:
    exists = list(exists)
    if issues or exists:
        raise _error(issues, origin, exists)


# -- field checks: each returns (sub-path, message) pairs -------------------------------------
Check = Callable[[Any], Iterable[tuple[KeyPath, str]]]


def _checked(check: Check, **kwargs: Any) -> Any:
    return field(metadata={"check": check}, **kwargs)


def _positive(value: int) -> Iterator[tuple[KeyPath, str]]:
    if value < 1:
        yield (), f"must be a positive integer, got {value}"


def _one_of(choices: Iterable[Any]) -> Check:
    choices = tuple(choices)

    def check(value: Any) -> Iterator[tuple[KeyPath, str]]:
        if value is not None and value not in choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            yield (), f"must be one of {', '.join(map(str, choices))}, got {value!r}{hint}"

    return check


def _regex(value: str) -> Iterator[tuple[KeyPath, str]]:
    try:
        re.compile(value)
    except re.error as err:
        yield (), f"{value!r} is not a valid regular expression: {err}"


def _patterns(value: Any) -> Iterator[tuple[KeyPath, str]]:
    if not isinstance(value, list):
        return  # None, or a mapping form that checks its own
    if not value:
        yield (), "must list at least one regular expression"
    for j, pattern in enumerate(value):
        for _, message in _regex(pattern):
            yield (j,), message


def _step_value(value: str | int) -> Iterator[tuple[KeyPath, str]]:
    if isinstance(value, str) and value not in ("keep", "reset"):
        yield (), f"must be keep, reset or a non-negative integer, got {value!r}"
    elif isinstance(value, int) and value < 0:
        yield (), f"must be keep, reset or a non-negative integer, got {value}"


def _tag(value: str | None) -> Iterator[tuple[KeyPath, str]]:
    if value is not None and (not value or "/" in value or value in (".", "..")):
        yield (), f"{value!r} is not a folder name"


def _size(value: str | int | None) -> Iterator[tuple[KeyPath, str]]:
    if isinstance(value, int) and value < 1:
        yield (), f"must be a positive number of bytes, got {value}"
    elif isinstance(value, str) and not _SIZE.match(value):
        yield (), f"must be a size such as 500MB or 5GB, got {value!r}"


# -- the config tree --------------------------------------------------------------------------
class _Node:
    """A config dataclass that checks itself: field types from the annotations, values from each
    field's ``check``, and whatever ties fields together from :meth:`cross_issues`."""

    def issues(self) -> list[Issue]:
        return list(_node_issues(self, ()))

    def cross_issues(self) -> Iterator[Issue]:
        return iter(())


@dataclass
class RenameConfig(_Node):
    """``re.sub(pattern, replace, name)`` on every parameter, tied alias and buffer name."""

    pattern: str = _checked(_regex)
    replace: str


@dataclass
class ResetConfig(_Node):
    """``reset_optimizer`` in full: which parameters, and whether their step restarts at 0 too."""

    params: list[str] = _checked(_patterns)
    step: str = _checked(_one_of(("zero", "keep")), default="zero")


@dataclass
class TransformConfig(_Node):
    """One list item of ``transforms:``; exactly one of its keys is given."""

    rename: RenameConfig | None = None
    drop: list[str] | None = _checked(_patterns, default=None)
    reset_optimizer: list[str] | ResetConfig | None = _checked(_patterns, default=None)

    def kinds(self) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name) is not None]

    def cross_issues(self) -> Iterator[Issue]:
        kinds = self.kinds()
        if not kinds:
            yield Issue((), "must hold one of rename, drop, reset_optimizer")
        elif len(kinds) > 1:
            yield Issue((), f"holds {' and '.join(kinds)}; give each transform its own list item (they run in order)")

    def to_step(self) -> Step:
        if self.rename is not None:
            return Rename(self.rename.pattern, self.rename.replace)
        if self.drop is not None:
            return Drop(tuple(self.drop))
        if isinstance(self.reset_optimizer, ResetConfig):
            return ResetOptimizer(tuple(self.reset_optimizer.params), keep_step=self.reset_optimizer.step == "keep")
        return ResetOptimizer(tuple(self.reset_optimizer or ()))


@dataclass
class TpRuleConfig(_Node):
    """How parameters matching ``pattern`` (re.match on the source's names) lie across TP ranks."""

    pattern: str = _checked(_regex)
    kind: str = _checked(_one_of(("split", "replicated", "average")), default="split")
    dim: int = 0  # the dim a split cuts
    parts: list[int] | None = None  # fused sub-parameters along dim (gate/up, q/k/v), each cut on its own
    vocab: int | None = None  # real vocabulary rows on dim 0; the rest of the TP shards is padding

    def cross_issues(self) -> Iterator[Issue]:
        if self.kind != "split" and (self.parts is not None or self.vocab is not None or self.dim):
            yield Issue((), f"dim, parts and vocab describe a split; a {self.kind} parameter takes none")
        if isinstance(self.parts, list) and any(not isinstance(p, int) or p < 1 for p in self.parts):
            yield Issue(("parts",), f"must list positive sizes, got {self.parts}")
        if self.vocab is not None and self.dim != 0:
            yield Issue(("vocab",), "vocabulary rows are on dim 0")

    def to_rule(self) -> Any:
        from ucp.model.tp import TpRule

        return TpRule(self.kind, dim=self.dim, parts=tuple(self.parts or ()), vocab=self.vocab)


@dataclass
class TensorParallelConfig(_Node):
    """Rules for tensor-parallel layouts, where the checkpoint carries none (or to override its own)."""

    rules: list[TpRuleConfig] = field(default_factory=list)

    def pairs(self) -> list[tuple[str, Any]]:
        return [(r.pattern, r.to_rule()) for r in self.rules]


@dataclass
class TargetConfig(_Node):
    """The native DeepSpeed checkpoint the new run loads with a plain ``engine.load_checkpoint``."""

    output: Path
    dp: int = _checked(_positive)
    stage: int = _checked(_one_of((1, 2, 3)), default=3)
    optimizer: str | None = _checked(_one_of(flavours.FLAVOURS), default=None)  # None: the source's
    dtype: str | None = _checked(_one_of(DTYPES), default=None)  # None: the source's
    step: str | int = _checked(_step_value, default="keep")
    tag: str | None = _checked(_tag, default=None)  # None: global_step<N>
    sub_group_size: int | None = _checked(lambda v: _positive(v) if v is not None else (), default=None)
    tp: int = _checked(_positive, default=1)  # tensor-parallel degree of the new run

    def options(self) -> RestoreOptions:
        """The same choices as the CLI's and the API's: one RestoreOptions, planned once."""
        return RestoreOptions(**{name: getattr(self, name) for name in RestoreOptions.field_names()})


@dataclass
class ExportConfig(_Node):
    """Consolidated weights for inference or Hugging Face (``ucp.targets.export``)."""

    path: Path
    format: str = _checked(_one_of(EXPORT_FORMATS), default="safetensors")
    dtype: str | None = _checked(_one_of(DTYPES), default=None)  # None: the model's
    max_shard_size: str | int | None = _checked(_size, default=None)  # None: the exporter's default


@dataclass
class MigrationConfig(_Node):
    """A whole migration: what to read, how to change it, and what to write."""

    source: Path
    tag: str | None = _checked(_tag, default=None)
    universal: Path | None = None
    transforms: list[TransformConfig] = field(default_factory=list)
    tensor_parallel: TensorParallelConfig | None = None
    target: TargetConfig | None = None
    exports: list[ExportConfig] = field(default_factory=list)
    origin: _Origin = field(default_factory=_Origin, repr=False, compare=False, metadata={"yaml": False})

    def cross_issues(self) -> Iterator[Issue]:
        if self.universal is None and self.target is None and not self.exports:
            yield Issue((), "nothing to write: give universal, target or exports")

    def outputs(self) -> list[tuple[KeyPath, Path]]:
        """Every path the migration writes, with its key path (the well-formed ones, if some are not)."""
        out: list[tuple[KeyPath, Any]] = [(("universal",), self.universal)]
        if isinstance(self.target, TargetConfig):
            out.append((("target", "output"), self.target.output))
        if isinstance(self.exports, list):
            out += [(("exports", i, "path"), e.path) for i, e in enumerate(self.exports) if isinstance(e, ExportConfig)]
        return [(at, path) for at, path in out if isinstance(path, Path)]


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
        elif is_dataclass(option):
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
        elif option is str:
            names.append("a string")
        elif option is Path:
            names.append("a path (a non-empty string)")
        elif typing.get_origin(option) is list:
            (item,) = typing.get_args(option)
            names.append("a list of strings" if item is str else "a list")
        elif is_dataclass(option):
            keys = [f.name for f in fields(option) if f.metadata.get("yaml", True)]
            names.append(f"a mapping with keys {', '.join(keys)}")
    return " or ".join(names)


def _describe(value: Any) -> str:
    kind = {dict: "a mapping", list: "a list", bool: "a boolean", float: "a number", type(None): "nothing"}.get(
        type(value), type(value).__name__
    )
    return f"{value!r} ({kind})" if not isinstance(value, (dict, list)) else kind


def _node_issues(node: Any, at: KeyPath) -> Iterator[Issue]:
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
            yield Issue(at + (f.name,), f"must be {_type_name(hints[f.name])}, got {_describe(value)}")
            continue
        check = f.metadata.get("check")
        if check is not None:
            for sub, message in check(value):
                clean = False
                yield Issue(at + (f.name,) + sub, message)
        if isinstance(value, _Node):
            yield from _node_issues(value, at + (f.name,))
        elif isinstance(value, list):
            item_type = _list_item(hints[f.name])
            for i, item in enumerate(value):
                if isinstance(item, _Node):
                    yield from _node_issues(item, at + (f.name, i))
                elif is_dataclass(item_type):
                    yield Issue(at + (f.name, i), f"must be {_type_name(item_type)}, got {_describe(item)}")
    if clean:
        for issue in node.cross_issues():
            yield Issue(at + issue.path, issue.message)


def _list_item(hint: Any) -> Any:
    for option in _args(hint):
        if typing.get_origin(option) is list:
            return typing.get_args(option)[0]
    return None


def _build(cls: type, raw: Any, at: KeyPath, base: Path, issues: list[Issue]) -> Any:
    """YAML data -> an instance of ``cls``. Unknown and missing keys are issues here; values of the
    wrong type are kept as they are, for :meth:`_Node.issues` to report with everything else."""
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
        if is_dataclass(option) and isinstance(raw, dict):
            return _build(option, raw, at, base, issues)
        if option is Path and isinstance(raw, str) and raw:
            return Path(os.path.normpath(base / os.path.expanduser(raw)))
        if typing.get_origin(option) is list and isinstance(raw, list):
            (item,) = typing.get_args(option)
            if is_dataclass(item):
                return [
                    _build(item, v, at + (i,), base, issues) if isinstance(v, dict) else v for i, v in enumerate(raw)
                ]
    return raw


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


def _parse(raw: Any, base: Path, origin: _Origin) -> tuple[MigrationConfig, list[Issue]]:
    if not isinstance(raw, dict):
        what = "empty" if raw is None else f"{_describe(raw)}, not a mapping"
        raise MigrationConfigError([f"{origin.file or 'config'}: the config is {what}; it needs at least source:"])
    issues: list[Issue] = []
    config = _build(MigrationConfig, raw, (), base.absolute(), issues)
    config.origin = origin
    return config, issues + config.issues()


def parse_config(
    raw: Any, *, base: str | os.PathLike = ".", file: str | None = None, lines: dict[KeyPath, int] | None = None
) -> MigrationConfig:
    """A config from already-parsed data (a dict); raises :class:`MigrationConfigError` listing every problem."""
    config, issues = _parse(raw, Path(base), _Origin(file, dict(lines or {})))
    _raise(issues, config.origin)
    return config


def _read(path: Path) -> tuple[MigrationConfig, list[Issue]]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read: {err}") from None
    data, lines, duplicates = _yaml_lines(text, str(path))
    config, issues = _parse(data, path.parent, _Origin(str(path), lines))
    return config, duplicates + issues


def load_config(path: str | os.PathLike) -> MigrationConfig:
    """Read a migration YAML; relative paths in it resolve against its folder."""
    config, issues = _read(Path(path))
    _raise(issues, config.origin)
    return config


# -- planning ---------------------------------------------------------------------------------
@dataclass
class MigrationPlan:
    """Every decision of a migration, as data, with the source open for :func:`execute`."""

    config: MigrationConfig
    reader: Reader
    transforms: TransformPlan
    native: Any | None  # ucp.targets.native.NativePlan
    warnings: list[str] = field(default_factory=list)

    @property
    def facts(self) -> Facts:
        return self.transforms.facts

    def close(self) -> None:
        self.reader.close()

    def describe(self, *, dry_run: bool = True) -> str:
        return _describe_plan(self, dry_run)


def _transform_path(config: MigrationConfig, index: int, where: tuple[str | int, ...]) -> KeyPath:
    step = config.transforms[index]
    if isinstance(step.reset_optimizer, ResetConfig) and where:
        where = ("params",) + tuple(where)  # the mapping form keeps its patterns under params
    return ("transforms", index, step.kinds()[0]) + tuple(where)


def plan_migration(config: MigrationConfig, *, overwrite: bool = False) -> MigrationPlan:
    """Open the source and check everything only the checkpoint can tell; write nothing.

    Raises :class:`MigrationConfigError` listing every problem (or :class:`OutputExistsError`
    when existing outputs are the only problem). The returned plan holds the source open:
    pass it to :func:`execute`, or close it.
    """
    return _plan(config, overwrite, [])


def _plan(config: MigrationConfig, overwrite: bool, known: list[Issue]) -> MigrationPlan:
    """plan_migration, also reporting ``known`` (the config's own problems) with whatever the
    checkpoint shows about the parts of the config that are sound."""
    origin = config.origin
    broken = {i.path[0] if i.path else "" for i in known}
    issues, exists = _output_issues(config, overwrite=overwrite)
    issues = known + issues
    reader = None if broken & {"source", "tag"} else _open_source(config, issues)
    if reader is None:
        raise _error(issues, origin, exists)
    try:
        warnings: list[Issue] = []
        if config.tag is not None and reader.facts.info.format == "universal":
            warnings.append(Issue(("tag",), "is ignored: the source is a universal directory"))
        steps = [] if "transforms" in broken else [t.to_step() for t in config.transforms]
        tplan = plan_transforms(reader.facts, steps)
        issues += [Issue(_transform_path(config, p.step, p.where), p.message) for p in tplan.problems]
        warnings += [Issue(_transform_path(config, i, where), message) for i, where, message in tplan.warnings]
        if tplan.removed_groups:
            kept = len(tplan.facts.groups)
            warnings.append(
                Issue(
                    ("transforms",),
                    f"param group(s) {tplan.removed_groups} lose every parameter and "
                    f"are removed; the new optimizer must have {kept} param group(s)",
                )
            )
        native = None
        if isinstance(config.target, TargetConfig) and not broken & {"target", "transforms"} and not tplan.problems:
            native = _plan_target(config, config.target, reader, tplan, issues)
        if config.exports and not broken & {"exports", "transforms"} and not tplan.problems:
            _check_exports(config, reader, tplan, issues)
        _raise(issues, origin, exists=exists)
    except BaseException:
        reader.close()
        raise
    return MigrationPlan(config, reader, tplan, native, [origin.where(w) for w in warnings])


def _check_exports(config: MigrationConfig, reader: Reader, tplan: TransformPlan, issues: list[Issue]) -> None:
    """What the exporter would refuse half-way: a missing exporter, a file name that does not fit
    the format, a single file that the model would need shards for."""
    try:
        from ucp.targets.export import export, parse_size, plan_shards
    except ImportError:
        issues.append(
            Issue(
                ("exports",), "this ucp has no exporter (ucp.targets.export is missing); remove exports or update ucp"
            )
        )
        return
    facts = tplan.facts
    held = reader.buffers() if facts.buffer_names else {}
    buffers = {new: held[old] for new, old in tplan.buffer_origin.items() if old in held}
    for i, item in enumerate(config.exports):
        suffix = item.path.suffix
        file_suffixes = _EXPORT_SUFFIXES[item.format]
        if suffix and suffix in {s for f in _EXPORT_SUFFIXES.values() for s in f} - set(file_suffixes):
            issues.append(
                Issue(
                    ("exports", i, "path"),
                    f"{item.path.name} does not fit format {item.format}; name "
                    f"the file *{file_suffixes[0]} or give a folder",
                )
            )
            continue
        if suffix not in file_suffixes:
            continue  # a folder: the exporter shards as needed
        sizes = []
        for meta in facts.params:
            dtype = DTYPES.get(item.dtype or meta.dtype)
            if dtype is None:
                break  # a dtype the exporter refuses with its own message
            sizes.append((meta.name, meta.numel * dtype.itemsize))
        for name, tensor in buffers.items():
            size = DTYPES[item.dtype].itemsize if item.dtype and tensor.is_floating_point() else tensor.element_size()
            sizes.append((name, tensor.numel() * size))
        limit = item.max_shard_size
        if limit is None:
            limit = inspect.signature(export).parameters["max_shard_size"].default
        shards = len(plan_shards(sizes, parse_size(limit)))
        if shards > 1:
            issues.append(
                Issue(
                    ("exports", i, "path"),
                    f"the model needs {shards} shards of at most {limit}, which "
                    "one file cannot hold; give a folder or raise max_shard_size",
                )
            )


def _open_source(config: MigrationConfig, issues: list[Issue]) -> Reader | None:
    from ucp.sources import open_reader

    rules = config.tensor_parallel.pairs() if isinstance(config.tensor_parallel, TensorParallelConfig) else []
    try:
        reader = open_reader(config.source, tag=config.tag, tp_rules=rules)
        if rules:
            from ucp.sources.tensor_parallel import with_tp_rules

            return with_tp_rules(reader, rules)
        return reader
    except UcpError as err:
        at = ("tag",) if config.tag is not None and f"tag {config.tag!r}" in str(err) else ("source",)
        issues.append(Issue(at, f"cannot be read: {err}"))
    return None


def _output_issues(config: MigrationConfig, *, overwrite: bool) -> tuple[list[Issue], list[Issue]]:
    """(outputs that clash with each other or the source, outputs that exist and would need --overwrite)."""
    clashes: list[Issue] = []
    exists: list[Issue] = []
    seen: dict[Path, KeyPath] = {}
    source = config.source.resolve() if isinstance(config.source, Path) else None
    for at, path in config.outputs():
        where = path.resolve()
        if where in seen:
            clashes.append(Issue(at, f"{path} is also {show_path(seen[where])}; every output needs its own path"))
            continue
        seen[where] = at
        if source is not None and (where == source or source in where.parents or where in source.parents):
            clashes.append(Issue(at, f"{path} overlaps the source {config.source}; write somewhere else"))
        elif path.exists() and not overwrite:
            exists.append(Issue(at, f"{path} already exists; pass --overwrite to replace it"))
    return clashes, exists


def _plan_target(
    config: MigrationConfig, target: TargetConfig, reader: Reader, tplan: TransformPlan, issues: list[Issue]
) -> Any:
    from ucp.targets.native import plan_native

    facts = tplan.facts
    start = len(issues)
    if target.optimizer is None and facts.flavour is None:
        issues.append(
            Issue(
                ("target", "optimizer"),
                "is required: the source's optimizer cannot be told from its "
                f"files; name it ({', '.join(flavours.FLAVOURS)})",
            )
        )
    if not any(g.params for g in facts.groups):
        issues.append(
            Issue(
                ("target",),
                "the transforms leave no trained parameter; a native checkpoint needs at least one param group",
            )
        )
    if len(issues) > start:
        return None
    step: str | int = target.step
    try:
        plan = plan_native(facts, target.options())
    except ConfigError as err:
        issues.append(Issue(("target",), str(err)))
        return None
    if target.tp > 1:
        from ucp.targets.tensor_parallel import rank_layouts

        try:
            rank_layouts(TransformedReader(reader, tplan), target.tp, 0)
        except UcpError as err:
            issues.append(Issue(("target", "tp"), str(err)))
            return None
    if step == "keep":
        issues += _step_conflicts(config, reader, tplan, plan)
    return plan


def _param_steps(reader: Reader, tplan: TransformPlan) -> dict[str, int]:
    """The step each trained (renamed) parameter will carry: 0 when reset, else the source's
    (a native writer reads "never stepped" as 0 too)."""
    per_param = reader.param_steps()
    source = reader.facts
    group_step = {g.index: g.step for g in source.groups}
    steps: dict[str, int] = {}
    for meta in tplan.facts.params:
        if meta.frozen:
            continue
        old = tplan.origin[meta.name]
        if meta.name in tplan.restarted:
            steps[meta.name] = 0
        elif old in per_param:
            steps[meta.name] = int(per_param[old] or 0)
        else:
            group = source.param(old).group
            steps[meta.name] = int(group_step.get(group) or 0) if group is not None else 0
    return steps


def _step_conflicts(config: MigrationConfig, reader: Reader, tplan: TransformPlan, plan: Any) -> list[Issue]:
    """DeepSpeed keeps one step per flat partition (ZeRO-3: per sub-group; ZeRO-1/2: per param
    group). Parameters that would share one but carry different steps cannot be written as asked."""
    steps = _param_steps(reader, tplan)
    units: dict[int, list[str]] = {}
    for g, names in enumerate(plan.group_names):
        for i, name in enumerate(names):
            unit = plan.layout.slots[g][i].sub_group if plan.layout is not None else g
            units.setdefault(unit, []).append(name)
    what = "ZeRO-3 sub-group" if plan.layout is not None else "param group"
    by_step: dict[int, list[str]] = {}  # reset step index -> parameters that conflict
    shared: dict[int, set[str]] = {}
    plain: list[str] = []
    for unit, names in units.items():
        seen = {steps.get(n) for n in names}
        if len(seen) <= 1:
            continue
        resets = [n for n in names if n in tplan.restarted]
        if not resets:
            plain.append(f"{what} {unit}: " + ", ".join(f"{n} (step {steps.get(n)})" for n in names))
            continue
        for name in resets:
            index = tplan.reset_params[name]
            by_step.setdefault(index, []).append(name)
            shared.setdefault(index, set()).update(
                f"{n} (step {steps.get(n)})" for n in names if n not in tplan.restarted
            )
    issues = []
    keep = max((s for n, s in steps.items() if n not in tplan.restarted), default=0)
    layout = f"dp={plan.dp}, sub_group_size={plan.sub_group_size}" if plan.layout is not None else f"ZeRO-{plan.stage}"
    for index, names in sorted(by_step.items()):
        others = sorted(shared[index])
        more = f" and {len(others) - 4} more" if len(others) > 4 else ""
        issues.append(
            Issue(
                _transform_path(config, index, ()),
                f"resets {', '.join(names)} to step 0, but in the target ({layout}) they share a {what} with "
                f"{', '.join(others[:4])}{more}, and DeepSpeed keeps one step per {what}. Write the reset as "
                "{params: [...], step: keep} or set target.step: "
                f"{keep} to zero only their moments and keep the step (a warm start: Adam's bias correction is then "
                "already ~1), or set target.step: reset to restart every parameter at step 0",
            )
        )
    if plain:
        issues.append(
            Issue(
                ("target", "step"),
                "parameters that share a flat partition have different steps in "
                "the source (" + "; ".join(plain) + "); set target.step to an "
                "integer or reset",
            )
        )
    return issues


# -- describing -------------------------------------------------------------------------------
def _counts(facts: Facts) -> str:
    trained = sum(1 for p in facts.params if not p.frozen)
    frozen = len(facts.params) - trained
    return (
        f"{len(facts.params)} parameters ({trained} trained, {frozen} frozen) in {len(facts.groups)} param "
        f"group(s), {len(facts.tied)} tied alias(es), {len(facts.buffer_names)} buffer(s)"
    )


def _describe_plan(plan: MigrationPlan, dry_run: bool) -> str:
    config = plan.config
    source = plan.reader.facts
    info = source.info
    head = f"migration plan for {config.origin.file or 'config'}"
    out = [head + (" (dry run: nothing is written)" if dry_run else "")]
    kind = {
        "universal": "universal directory",
        "ds-universal": f"DeepSpeed ds_to_universal folder (from ZeRO-{info.zero_stage})",
    }.get(info.format, f"DeepSpeed ZeRO-{info.zero_stage} checkpoint")
    out.append(
        f"read       {config.source}: {kind}, tag {info.tag}, dp={info.dp_world_size}, {info.dtype}, "
        f"{source.flavour or 'unknown optimizer'}, optimizer step {source.step}"
    )
    out.append(f"           {_counts(source)}")
    tplan = plan.transforms
    for index, step in enumerate(config.transforms):
        kind_name = step.kinds()[0]
        if step.rename is not None:
            out.append(f"transform  [{index}] rename {step.rename.pattern!r} -> {step.rename.replace!r}")
            out += [f"             {old} -> {new}" for i, old, new in tplan.renames if i == index]
        else:
            value = getattr(step, kind_name)
            if isinstance(value, ResetConfig):
                value = f"{value.params} (step: {value.step})"
            out.append(f"transform  [{index}] {kind_name} {value}")
        out += [f"             drop {name} ({what}; {why})" for i, name, what, why in tplan.drops if i == index]
        out += [
            f"             reset {name}: moments zeroed, step {'0' if restart else 'kept'}"
            for i, name, restart in tplan.resets
            if i == index
        ]
    if config.transforms:
        out.append(f"           result: {_counts(tplan.facts)}")
    if config.universal is not None:
        out.append(f"write      {config.universal}: universal directory")
    native = plan.native
    if native is not None and config.target is not None:
        layout = ""
        if native.layout is not None:
            layout = f", sub_group_size {native.sub_group_size} -> {len(native.layout.sub_group_numel)} sub-group(s)"
        step = config.target.step
        step_text = {"keep": "kept", "reset": "reset to 0 (moments zeroed)"}.get(str(step), f"set to {step}")
        tp = f" tp={native.tp}" if native.tp > 1 else ""
        out.append(
            f"write      {config.target.output}: native ZeRO-{native.stage} checkpoint for dp={native.dp}{tp}, "
            f"{native.flavour.name}, {native.dtype}, tag {native.tag}, step {step_text}{layout}"
        )
        out += [f"             note: {note}" for note in native.notes]
    for export in config.exports:
        src = (
            "the universal directory"
            if config.universal is not None
            else ("the transformed source" if tplan.changes_anything else "the source")
        )
        size = f", shards of at most {export.max_shard_size}" if export.max_shard_size is not None else ""
        out.append(f"export     {export.path}: {export.format}, {export.dtype or 'model dtype'}{size}, from {src}")
    if dry_run:  # a real run logs them instead
        out += [f"warning    {w}" for w in plan.warnings]
    return "\n".join(out)


# -- running ----------------------------------------------------------------------------------
def execute(plan: MigrationPlan, *, overwrite: bool = False, workers: int | None = None) -> list[str]:
    """Do what the plan says, in order; returns one line per output written. Closes the plan's source."""
    from ucp.universal.reader import open_universal
    from ucp.universal.writer import write_universal

    config = plan.config
    tplan = plan.transforms
    reader: Reader = TransformedReader(plan.reader, tplan) if tplan.changes_anything else plan.reader
    done: list[str] = []
    downstream: Reader = reader
    try:
        if config.universal is not None:
            manifest = write_universal(reader, config.universal, overwrite=overwrite, workers=workers)
            done.append(f"wrote {len(manifest['params'])} parameters to universal directory {config.universal}")
            downstream = open_universal(config.universal)  # the target reads what was written, checksums checked
        if config.target is not None:
            done.append(_write_target(plan, downstream, overwrite=overwrite, workers=workers))
        if config.exports:
            done += _exports(plan, reader, overwrite=overwrite, workers=workers)
    finally:
        if downstream is not reader:
            downstream.close()
        plan.close()
    return done


def _write_target(plan: MigrationPlan, reader: Reader, *, overwrite: bool, workers: int | None) -> str:
    from ucp.targets.native import write_plan

    target = plan.config.target
    if target is None or plan.native is None:
        raise ValueError("the plan has no target")
    try:
        native = write_plan(reader, plan.native, target.output, overwrite=overwrite, workers=workers)
    except StepConflictError as err:
        # plan_migration checks this up front; a source whose own steps disagree still lands here
        origin = plan.config.origin
        raise MigrationConfigError(
            [origin.where(Issue(("target", "step"), f"{err}; set target.step to an integer or reset"))]
        ) from None
    tp = f" tp={native.tp}" if native.tp > 1 else ""
    return (
        f"wrote a native ZeRO-{native.stage} checkpoint for dp={native.dp}{tp} ({native.flavour.name}, "
        f"{native.dtype}) to {target.output}/{native.tag}"
    )


def _exports(plan: MigrationPlan, reader: Reader, *, overwrite: bool, workers: int | None) -> list[str]:
    from ucp.targets.export import export

    config = plan.config
    # from the universal directory when one was written (what a later export would read), else
    # straight from the (transformed) source
    src: Path | Reader = config.universal if config.universal is not None else reader
    done = []
    for item in config.exports:
        kwargs: dict[str, Any] = {
            "format": item.format,
            "dtype": item.dtype,
            "overwrite": overwrite,
            "workers": workers,
        }
        if item.max_shard_size is not None:
            kwargs["max_shard_size"] = item.max_shard_size
        written = export(src, item.path, **kwargs)
        done.append(f"exported {item.format} ({len(written)} file(s)) to {item.path}")
    return done


def run_migration(config_path: str | os.PathLike, *, dry_run: bool = False, overwrite: bool = False) -> str:
    """Load, check and plan a migration; then either describe it (``dry_run``) or run it. Returns the text to show.

    Every problem is reported at once: the config's own, and what the source shows about the
    parts of the config that are sound (a rename that collides, a drop that empties the model).
    Each output appears whole or not at all; should a late step fail, the earlier outputs stay
    (complete) and a re-run needs ``overwrite``.
    """
    config, issues = _read(Path(config_path))
    plan = _plan(config, overwrite, issues)
    if dry_run:
        try:
            return plan.describe(dry_run=True)
        finally:
            plan.close()
    for warning in plan.warnings:
        logger.warning("%s", warning)
    text = plan.describe(dry_run=False)
    done = execute(plan, overwrite=overwrite)
    return "\n".join([text, *done])
