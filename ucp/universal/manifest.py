"""ucp.json as dataclasses: the manifest of a universal directory (docs/format.md is its spec).

It is written last, to a temporary name, then renamed: its presence means the directory is whole.
Per parameter it records the folder, shape, dtype, group, step and every file with its size and
crc32; the optimizer's state keys are the files' names, so a new optimizer needs no new field.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from ucp.errors import CorruptFileError, InputError
from ucp.model.hyper import Hyper
from ucp.model.records import Facts, GroupMeta, ParamMeta, SourceInfo
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
    "facts_from_manifest",
]

FORMAT = "ucp-universal"
FORMAT_VERSION = 1
MANIFEST = "ucp.json"
STATE_FILE = "state.pt"
FP32_FILE = "fp32.pt"
STEP_FILE = "step.pt"
SUFFIX = ".pt"
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


def manifest_json(facts: Facts, params: list[ParamEntry], files: dict[str, FileEntry]) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created_by": f"ucp {VERSION}",
        "checksum": "crc32",
        "source": asdict(facts.info),
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
    }


def facts_from_manifest(raw: Mapping[str, Any]) -> tuple[Facts, list[ParamEntry], dict[str, FileEntry]]:
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
