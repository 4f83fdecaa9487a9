"""The per-parameter entries of a manifest read back, kept in columns: a few machine words per parameter and per file.

A reader of a 10^5-parameter MoE holds its manifest for the whole restore. As parsed JSON, or as one
:class:`~ucp.universal.manifest.ParamEntry` per parameter with a dict of :class:`~ucp.universal.manifest.FileEntry`,
that was about 2 KB a parameter (200 MB); here a parameter is its name (the folder is the same string when they
agree, as they do for every safe name), its shape tuple (shared with the facts' ``ParamMeta``), and integers in
arrays: its group, step, frozen flag, and per file its size and crc32. The sets of file keys and of state keys are
shared by every parameter that has the same ones. Each entry is checked as it is added (``check_param``), so nothing
is built from a field that was not checked.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterator, Mapping
from typing import Any

from ucp.errors import CorruptFileError
from ucp.model.hyper import Hyper
from ucp.model.layouts import SourceLayout
from ucp.model.records import Facts, GroupMeta, ParamMeta, SourceInfo
from ucp.universal.file_names import FP32_FILE, MANIFEST, SOURCE_LAYOUTS, STEP_FILE, SUFFIX, state_file
from ucp.universal.manifest import FileEntry, ParamEntry
from ucp.universal.manifest_check import check_header, check_members, check_param, given_twice

__all__ = ["ParamTable", "facts_from_manifest"]

_NONE = -1  # a group or step of null


class ParamTable:
    """The manifest's ``params`` entries, added one at a time as they are parsed (:meth:`add`), in columns."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.index: dict[str, int] = {}
        self._folders: list[str] = []
        self._shapes: list[tuple[int, ...]] = []
        self._dtypes: list[str] = []
        self._groups = array("q")
        self._steps = array("q")
        self._frozen = bytearray()
        self._file_keys: list[tuple[str, ...]] = []  # per parameter, one shared tuple per distinct set of files
        self._first = array("q", [0])  # per parameter: where its files start in the two columns below, then the end
        self._bytes = array("q")
        self._crcs = array("I")
        self._scalars: dict[int, tuple[str, ...]] = {}  # the few parameters with 0-dim optimizer scalars
        self._shared: dict[Any, Any] = {}  # shared tuples: file keys, state keys
        self._folder_set: set[str] | None = set()  # while adding: every folder, to refuse one given twice

    def __len__(self) -> int:
        return len(self.names)

    def add(self, i: int, p: Any) -> None:
        """Entry ``i`` of the manifest's ``params``: checked, then kept."""
        check_param(i, p)
        name = p["name"]
        files = p["files"]
        self._keep(
            name,
            p["folder"],
            tuple(p["shape"]),
            p["dtype"],
            _NONE if p["group"] is None else _word(p["group"], name, "group"),
            _NONE if p["step"] is None else _word(p["step"], name, "step"),
            bool(p["frozen"]),
            tuple(files),
            [(_word(claim["bytes"], name, "a file's bytes"), int(claim["crc32"], 16)) for claim in files.values()],
            tuple(p.get("scalars") or ()),
        )

    def add_entry(self, entry: ParamEntry) -> None:
        """An entry a writer just made (its files written and checksummed), kept as :meth:`add` keeps a parsed one:
        a writer of 10^5 parameters holds this table, not 10^5 entries."""
        self._keep(
            entry.name,
            entry.folder,
            tuple(entry.shape),
            entry.dtype,
            _NONE if entry.group is None else entry.group,
            _NONE if entry.step is None else entry.step,
            entry.frozen,
            tuple(entry.files),
            [(claim.bytes, int(claim.crc32, 16)) for claim in entry.files.values()],
            tuple(entry.scalars),
        )

    def _keep(
        self,
        name: str,
        folder: str,
        shape: tuple[int, ...],
        dtype: str,
        group: int,
        step: int,
        frozen: bool,
        file_keys: tuple[str, ...],
        claims: list[tuple[int, int]],
        scalars: tuple[str, ...],
    ) -> None:
        if name in self.index:
            raise given_twice("names")
        folder = name if folder == name else folder
        if self._folder_set is None or folder in self._folder_set:
            raise given_twice("folders")
        self._folder_set.add(folder)
        self.index[name] = len(self.names)
        self.names.append(name)
        self._folders.append(folder)
        self._shapes.append(shape)
        self._dtypes.append(sys.intern(dtype))
        self._groups.append(group)
        self._steps.append(step)
        self._frozen.append(1 if frozen else 0)
        self._file_keys.append(self._share(file_keys))
        for size, crc in claims:
            self._bytes.append(size)
            self._crcs.append(crc)
        self._first.append(len(self._bytes))
        if scalars:
            self._scalars[len(self.names) - 1] = self._share(scalars)

    def entries(self) -> Iterator[ParamEntry]:
        """Every entry, in order, each built when reached."""
        return (self.entry(i) for i in range(len(self.names)))

    def finish(self) -> None:
        """All entries are in: the folder set used to refuse duplicates goes."""
        self._folder_set = None

    def _share(self, value: tuple[str, ...]) -> tuple[str, ...]:
        return self._shared.setdefault(value, value)

    def member(self, name: str) -> tuple[bool, int | None] | None:
        """(frozen, group) of a parameter, None for a name not listed."""
        i = self.index.get(name)
        return None if i is None else (bool(self._frozen[i]), self.group(i))

    def folder(self, i: int) -> str:
        return self._folders[i]

    def shape(self, i: int) -> tuple[int, ...]:
        return self._shapes[i]

    def group(self, i: int) -> int | None:
        g = self._groups[i]
        return None if g == _NONE else g

    def step(self, i: int) -> int | None:
        step = self._steps[i]
        return None if step == _NONE else step

    def frozen(self, i: int) -> bool:
        return bool(self._frozen[i])

    def files(self, i: int) -> tuple[str, ...]:
        """The parameter's file names (``fp32.pt``, ``exp_avg.pt``, ``step.pt``...)."""
        return self._file_keys[i]

    def scalars(self, i: int) -> tuple[str, ...]:
        """The keys whose files hold a 0-dim optimizer scalar."""
        return self._scalars.get(i, ())

    def claim(self, i: int, key: str) -> FileEntry | None:
        """What the manifest says of file ``key`` of parameter ``i``: its size and crc32 (None: not listed)."""
        keys = self._file_keys[i]
        if key not in keys:
            return None
        at = self._first[i] + keys.index(key)
        return FileEntry(self._bytes[at], f"{self._crcs[at]:08x}")

    def claims(self, i: int) -> Iterator[tuple[str, FileEntry]]:
        for key in self._file_keys[i]:
            claim = self.claim(i, key)
            assert claim is not None
            yield key, claim

    def state_keys(self, i: int) -> tuple[str, ...]:
        """The optimizer's per-parameter tensors, as their files name them (``exp_avg.pt`` -> ``exp_avg``)."""
        files, scalars = self._file_keys[i], self._scalars.get(i, ())
        known = self._shared.get((files, scalars))
        if known is None:
            skip = {FP32_FILE, STEP_FILE} | {state_file(k) for k in scalars}
            known = self._shared[files, scalars] = tuple(f[: -len(SUFFIX)] for f in files if f not in skip)
        return known

    def meta(self, i: int) -> ParamMeta:
        return ParamMeta(self.names[i], self._shapes[i], self._dtypes[i], self.group(i), self.frozen(i))

    def entry(self, i: int) -> ParamEntry:
        """Parameter ``i``'s entry as ucp.json holds it (built when asked: the table keeps none)."""
        return ParamEntry(
            name=self.names[i],
            folder=self._folders[i],
            shape=list(self._shapes[i]),
            dtype=self._dtypes[i],
            group=self.group(i),
            frozen=self.frozen(i),
            step=self.step(i),
            files=dict(self.claims(i)),
            scalars=list(self.scalars(i)),
        )


def _word(value: int, name: str, what: str) -> int:
    """A whole number the table keeps in a 64-bit column (checked whole already; a larger one is damage)."""
    if value >= 1 << 63:
        raise CorruptFileError(f"{MANIFEST} is malformed: {name!r} has {what} {value}, past any real checkpoint")
    return value


def facts_from_manifest(header: Mapping[str, Any], table: ParamTable) -> tuple[Facts, dict[str, FileEntry]]:
    """The facts and shared files of a manifest whose entries are in ``table``, the rest of its fields checked first
    (``check_header``, then ``check_members`` against the table)."""
    check_header(header)
    table.finish()
    check_members(header, table.names, table.member)
    try:
        info = SourceInfo(**header["source"])
        groups = [
            GroupMeta(
                index=g["index"],
                hyper=Hyper.from_json(g["hyperparameters"]),
                raw=dict(g.get("raw", {})),
                # the table's own strings: the group's list parsed its own copies
                params=[table.names[table.index[n]] for n in g["params"]],
                step=g.get("step"),
                state_keys=_union(table.state_keys(table.index[n]) for n in g["params"]),
            )
            for g in header["param_groups"]
        ]
        opt = header.get("optimizer", {})
        facts = Facts(
            info=info,
            flavour=opt.get("flavour"),
            adam_w_mode=opt.get("adam_w_mode"),
            step=opt.get("step"),
            groups=groups,
            params=[table.meta(i) for i in range(len(table))],
            tied=dict(header.get("tied", {})),
            buffer_names=list(header.get("buffers", [])),
            warnings=list(header.get("warnings", [])),
            tp_rules={k: dict(v) for k, v in (header.get("tensor_parallel") or {}).get("rules", {}).items()},
            layout=_layout(header),
        )
        files = {k: FileEntry(**v) for k, v in header.get("files", {}).items()}
    except (KeyError, TypeError, ValueError) as err:
        raise CorruptFileError(f"{MANIFEST} is malformed: {type(err).__name__}: {err}") from None
    return facts, files


def _layout(raw: Mapping[str, Any]) -> SourceLayout | None:
    """The layout a manifest records (one of :data:`SOURCE_LAYOUTS`), as the facts carry it."""
    found = [SourceLayout(kind, raw[kind]) for kind in SOURCE_LAYOUTS if raw.get(kind)]
    return found[0] if found else None


def _union(key_lists: Iterator[tuple[str, ...]] | Any) -> tuple[str, ...]:
    """Keys in first-seen order: a group's members may carry the same keys or (reset) none."""
    out: dict[str, None] = {}
    for keys in key_lists:
        out.update(dict.fromkeys(keys))
    return tuple(out)
