"""The universal directory: one folder per parameter, a manifest, atomic commit, checksums.

Layout (docs/format.md has the full spec)::

    OUT/ucp.json                              manifest, written last: its presence means OUT is whole
    OUT/zero/<folder>/fp32.pt                 {"param": fp32 tensor in the parameter's real shape}
    OUT/zero/<folder>/exp_avg.pt, exp_avg_sq.pt   (optimized parameters only)
    OUT/zero/<folder>/step.pt                 0-dim float32 tensor: updates applied to this parameter
    OUT/state.pt                              buffers, lr scheduler, client state, loss scaler
    OUT/zero/optimizer_state.pt, OUT/*model_states.pt, OUT/latest_universal
                                              what DeepSpeed's own ``load_universal`` reads

``<folder>`` is the parameter name when that is a safe folder name (so DeepSpeed's loader finds
it), else a reversible percent-encoding; ucp.json maps names to folders either way.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import re
import zlib
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch

from ucp import __version__, torchfile
from ucp.atomic import checksum, staged_output
from ucp.errors import ChecksumError, CorruptFileError, InputError
from ucp.flavors import Hyper
from ucp.records import Facts, GroupMeta, ParamMeta, ParamState, PieceState, Reader, SourceInfo
from ucp.tensorfile import FileSpan, Pieces, write_torch_file

__all__ = ["FORMAT", "FORMAT_VERSION", "MANIFEST", "folder_for", "write_universal", "write_params",
           "finish_universal", "ParamEntry", "open_universal",
           "UniversalReader", "default_workers", "parallel_map"]

logger = logging.getLogger(__name__)

FORMAT = "ucp-universal"
FORMAT_VERSION = 1
MANIFEST = "ucp.json"
STATE_FILE = "state.pt"
_SAFE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
_MAX_FOLDER = 200


def folder_for(name: str) -> str:
    """A folder name for a parameter: the name itself when safe, else percent-encoded (reversible)."""
    if not name or "\x00" in name:
        raise InputError(f"parameter name {name!r} is empty or holds a NUL byte")
    if _SAFE.match(name) and len(name) <= _MAX_FOLDER and name not in (".", ".."):
        return name
    encoded = "".join(c if (c.isascii() and (c.isalnum() or c in "_.-")) else
                      "".join(f"%{b:02X}" for b in c.encode()) for c in name)
    if encoded.startswith("."):
        encoded = "%2E" + encoded[1:]
    if len(encoded) > _MAX_FOLDER:
        import hashlib

        encoded = encoded[:150] + "%~" + hashlib.sha1(name.encode()).hexdigest()
    return encoded


def default_workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def parallel_map(fn: Callable[[Any], Any], items: Iterable[Any], workers: int, *, desc: str = "",
                 total: int | None = None) -> Iterator[Any]:
    """Map in a thread pool, in order, keeping at most ``2 x workers`` items in flight (bounded memory)."""
    items = list(items)
    bar = _progress(total if total is not None else len(items), desc)
    try:
        if workers <= 1:
            for item in items:
                yield fn(item)
                bar.update(1)
            return
        with ThreadPoolExecutor(workers) as pool:
            pending = []
            for item in items:
                pending.append(pool.submit(fn, item))
                if len(pending) >= 2 * workers:
                    yield pending.pop(0).result()
                    bar.update(1)
            for future in pending:
                yield future.result()
                bar.update(1)
    finally:
        bar.close()


def _progress(total: int, desc: str) -> Any:
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit="param", disable=None, leave=False)
    except ImportError:  # tqdm is optional
        class _Null:
            def update(self, n: int) -> None: ...
            def close(self) -> None: ...
        return _Null()


# -- manifest ---------------------------------------------------------------------------------
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

    def meta(self) -> ParamMeta:
        return ParamMeta(self.name, tuple(self.shape), self.dtype, self.group, self.frozen)


def _manifest_json(facts: Facts, params: list[ParamEntry], files: dict[str, FileEntry]) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created_by": f"ucp {__version__}",
        "checksum": "crc32",
        "source": asdict(facts.info),
        "optimizer": {"flavour": facts.flavour, "adam_w_mode": facts.adam_w_mode, "step": facts.step},
        "warnings": list(facts.warnings),
        "param_groups": [
            {"index": g.index, "hyperparameters": g.hyper.to_json(), "raw": g.raw, "step": g.step, "params": g.params}
            for g in facts.groups
        ],
        "params": [asdict(p) for p in params],
        "tied": dict(facts.tied),
        "buffers": list(facts.buffer_names),
        "files": {name: asdict(entry) for name, entry in files.items()},
        **({"tensor_parallel": {"source_degree": facts.info.mp_world_size, "rules": dict(facts.tp_rules)}}
           if facts.tp_rules else {}),
    }


def _facts_from_manifest(raw: Mapping[str, Any]) -> tuple[Facts, list[ParamEntry], dict[str, FileEntry]]:
    try:
        info = SourceInfo(**raw["source"])
        params = [
            ParamEntry(**{**p, "files": {k: FileEntry(**v) for k, v in p.get("files", {}).items()}})
            for p in raw["params"]
        ]
        groups = [
            GroupMeta(index=g["index"], hyper=Hyper.from_json(g["hyperparameters"]), raw=dict(g.get("raw", {})),
                      params=list(g["params"]), step=g.get("step"))
            for g in raw["param_groups"]
        ]
        opt = raw.get("optimizer", {})
        facts = Facts(
            info=info, flavour=opt.get("flavour"), adam_w_mode=opt.get("adam_w_mode"), step=opt.get("step"),
            groups=groups, params=[p.meta() for p in params], tied=dict(raw.get("tied", {})),
            buffer_names=list(raw.get("buffers", [])), warnings=list(raw.get("warnings", [])),
            tp_rules={k: dict(v) for k, v in (raw.get("tensor_parallel") or {}).get("rules", {}).items()},
        )
        files = {k: FileEntry(**v) for k, v in raw.get("files", {}).items()}
    except (KeyError, TypeError, ValueError) as err:
        raise CorruptFileError(f"{MANIFEST} is malformed: {type(err).__name__}: {err}") from None
    return facts, params, files


# -- writing ----------------------------------------------------------------------------------
def _save(obj: Any, path: Path) -> FileEntry:
    """Objects that may hold DeepSpeed stand-ins (scheduler, loss scaler, client state)."""
    torchfile.save(obj, path)
    return FileEntry(bytes=path.stat().st_size, crc32=checksum(path))


def _save_tensor(obj: Any, path: Path) -> FileEntry:
    """Per-parameter files: one pass over the bytes, deterministic output, checksum for free."""
    written = write_torch_file(obj, path)
    return FileEntry(bytes=written.bytes, crc32=written.crc32)


def _write_param(root: Path, meta: ParamMeta, state: ParamState | PieceState) -> ParamEntry:
    if tuple(state.fp32.shape) != meta.shape:
        raise InputError(f"{meta.name}: source gave shape {tuple(state.fp32.shape)}, expected {meta.shape}")
    folder = folder_for(meta.name)
    target = root / "zero" / folder
    try:
        target.mkdir(parents=True, exist_ok=False)
    except FileExistsError:  # two names that one case-insensitive file system cannot tell apart
        raise InputError(f"parameter {meta.name!r} needs folder {folder!r}, which another parameter's folder already "
                         "takes on this file system (names differing only in case?); convert onto a "
                         "case-sensitive file system") from None
    entry = ParamEntry(meta.name, folder, list(meta.shape), meta.dtype, meta.group, meta.frozen, state.step)
    entry.files["fp32.pt"] = _save_tensor({"param": state.fp32}, target / "fp32.pt")
    if not meta.frozen and state.exp_avg is not None:
        entry.files["exp_avg.pt"] = _save_tensor({"param": state.exp_avg}, target / "exp_avg.pt")
        entry.files["exp_avg_sq.pt"] = _save_tensor({"param": state.exp_avg_sq}, target / "exp_avg_sq.pt")
    if not meta.frozen and state.step is not None:
        entry.files["step.pt"] = _save_tensor(torch.tensor(float(state.step), dtype=torch.float32),
                                              target / "step.pt")
    return entry


def _ds_compat_files(root: Path, facts: Facts, extras: Mapping[str, Any], buffers: Mapping[str, torch.Tensor]) -> None:
    """What DeepSpeed's ``load_universal`` reads besides the per-parameter folders."""
    info = facts.info
    group_dicts = []
    for g in facts.groups:
        raw = {k: (tuple(v) if k == "betas" else v) for k, v in g.raw.items()}
        raw.setdefault("lr", g.hyper.lr)
        raw["params"] = []
        group_dicts.append(raw)
    step = torch.tensor(float(facts.step or 0), dtype=torch.float32)
    inner = {"state": {0: {"step": step}}, "param_groups": group_dicts}
    optim = {
        "zero_stage": torchfile.ZeroStageEnum(info.zero_stage),
        "loss_scaler": (extras["loss_scaler"] if extras.get("loss_scaler") is not None
                        else torchfile.LossScaler(cur_scale=1.0, dynamic=False)),
        "dynamic_loss_scale": extras.get("dynamic_loss_scale") is True,
        "overflow": extras.get("overflow") is True,
        "partition_count": info.dp_world_size,
        "optimizer_state_dict": inner,
        "param_groups": group_dicts,
        "ds_version": info.ds_version,  # DeepSpeed's ZeRO-1/2 universal loader asserts it
    }
    torchfile.save(optim, root / "zero" / "optimizer_state.pt")
    model_states = {
        "module": dict(buffers),
        "buffer_names": list(facts.buffer_names),
        "optimizer": None,
        "param_shapes": None,
        "lr_scheduler": extras.get("lr_scheduler"),
        "data_sampler": extras.get("data_sampler"),
        "random_ltd": extras.get("random_ltd"),
        "global_steps": info.global_steps,
        "global_samples": info.global_samples if info.global_samples is not None else 0,
        "skipped_steps": info.skipped_steps,
        "dp_world_size": info.dp_world_size,
        "mp_world_size": info.mp_world_size,
        "ds_config": info.ds_config,
        "ds_version": info.ds_version,
        **dict(extras.get("client_state") or {}),
    }
    torchfile.save(model_states, root / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    torchfile.save(model_states, root / "mp_rank_00_model_states.pt")
    # engine.load_checkpoint(OUT) with load_universal reads the tag from this file; "." is OUT itself
    (root / "latest_universal").write_text(".")


def write_params(reader: Reader, root: Path, metas: list[ParamMeta], workers: int,
                 transform: Callable[[ParamMeta, ParamState], ParamState] | None = None) -> list[ParamEntry]:
    """Write the per-parameter folders of ``metas`` under ``root/zero``; returns their manifest entries.

    A reader with ``read_pieces`` (a context manager: ``read`` giving :class:`ucp.tensorfile.Pieces`
    instead of tensors) has its slices streamed from its files into the output records, never held
    whole in memory; a ``transform`` needs whole tensors, so it always goes through ``read``.
    """
    read_pieces = getattr(reader, "read_pieces", None) if transform is None else None

    def one(meta: ParamMeta) -> ParamEntry:
        if read_pieces is not None:
            with read_pieces(meta.name) as pieces:
                return _write_param(root, meta, pieces)
        state = reader.read(meta.name)
        if transform is not None:
            state = transform(meta, state)
        return _write_param(root, meta, state)

    return list(parallel_map(one, metas, workers, desc="to-universal"))


def write_universal(reader: Reader, out: str | os.PathLike, *, overwrite: bool = False,
                    workers: int | None = None, fsync: bool = False,
                    transform: Callable[[ParamMeta, ParamState], ParamState] | None = None) -> dict[str, Any]:
    """Stream every parameter of ``reader`` into a universal directory at ``out``; returns the manifest.

    Memory stays near ``2 x workers`` parameters; ``transform`` may edit a state on its way through.
    OUT appears whole or not at all; ``fsync`` also makes it survive a power loss.
    """
    with staged_output(out, overwrite=overwrite, durable=fsync) as root:
        (root / "zero").mkdir()
        entries = write_params(reader, root, reader.facts.params, workers or default_workers(), transform)
        manifest = finish_universal(root, reader.facts, entries, reader.extras(), reader.buffers())
    return manifest


def finish_universal(root: Path, facts: Facts, entries: list[ParamEntry], extras: Mapping[str, Any],
                     buffers: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Write the shared state and, last, the manifest of a universal directory being built at root."""
    files = {STATE_FILE: _save({"buffers": dict(buffers), **dict(extras)}, root / STATE_FILE)}
    _ds_compat_files(root, facts, extras, buffers)
    manifest = _manifest_json(facts, entries, files)
    tmp = root / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, root / MANIFEST)
    return manifest


# -- reading ----------------------------------------------------------------------------------
class UniversalReader:
    """A universal directory as a :class:`ucp.records.Reader`, loading one parameter at a time."""

    def __init__(self, path: Path, *, verify: bool = True) -> None:
        self.path = path
        self.verify = verify
        manifest_path = path / MANIFEST
        try:
            raw = json.loads(manifest_path.read_text())
        except FileNotFoundError:
            raise InputError(f"{path} is not a universal directory: {MANIFEST} is missing") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise CorruptFileError(f"{manifest_path} is not valid JSON: {err}") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise InputError(f"{manifest_path} is not a ucp manifest")
        version = raw.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise InputError(f"{manifest_path} has format_version {version!r}; this ucp reads up to {FORMAT_VERSION}")
        self.manifest = raw
        self._verified: dict[Path, tuple[int, ...]] = {}  # path -> its _stamp when its checksum matched
        self._memo: dict[Path, tuple[tuple[int, ...], Any]] = {}  # path -> (_stamp, what parsing it told)
        self.facts, entries, self._files = _facts_from_manifest(raw)
        self._entries = {e.name: e for e in entries}
        root = (path / "zero").resolve()
        for entry in entries:
            if not isinstance(entry.folder, str) or "\x00" in entry.folder or "/" in entry.folder or \
                    entry.folder in ("", ".", ".."):
                raise CorruptFileError(f"{MANIFEST} maps {entry.name!r} to folder {entry.folder!r}, outside zero/")
            folder = (root / entry.folder).resolve()
            if folder.parent != root:
                raise CorruptFileError(f"{MANIFEST} maps {entry.name!r} to folder {entry.folder!r}, outside zero/")

    def file_path(self, name: str, key: str) -> Path:
        return self.path / "zero" / self._entries[name].folder / key

    def _check(self, path: Path, entry: FileEntry | None) -> Callable[[mmap.mmap], None] | None:
        """What a file must match before it is parsed: its size now, its crc32 over the very pages that
        then back its tensors (one pass over the file); None when not verifying, or when this reader
        already verified the file and its size, mtime, ctime and inode are unchanged since."""
        if entry is None:
            raise CorruptFileError(f"{MANIFEST} lists no checksum for {path}")
        if not path.is_file():
            raise CorruptFileError(f"{path} is missing from the universal directory")
        if not self.verify:
            return None

        def mismatch() -> ChecksumError:
            return ChecksumError(f"{path} does not match its checksum in {MANIFEST}: the file changed or is corrupt")

        stat = path.stat()
        if stat.st_size != entry.bytes:
            raise mismatch()
        stamp = _stamp(stat)
        if self._verified.get(path) == stamp:
            return None

        def check(data: mmap.mmap) -> None:
            if len(data) != entry.bytes or f"{zlib.crc32(data) & 0xFFFFFFFF:08x}" != entry.crc32:
                raise mismatch()
            self._verified[path] = stamp

        return check

    def _load(self, path: Path, entry: FileEntry | None) -> Any:
        return torchfile.load(path, check=self._check(path, entry))

    def _open_tensor(self, name: str, key: str) -> tuple[torchfile.TorchFile, torch.Tensor]:
        """A parameter file, checked, and its tensor (a view on the file's private mapping)."""
        entry = self._entries[name]
        path = self.file_path(name, key)
        tf = torchfile.TorchFile(path, check=self._check(path, entry.files.get(key)))
        obj = tf.obj
        tensor = obj.get("param") if isinstance(obj, Mapping) else obj
        if not torch.is_tensor(tensor):
            tf.close()
            raise CorruptFileError(f"{path} holds no tensor under 'param'")
        if tuple(tensor.shape) != tuple(entry.shape) or tensor.dtype != torch.float32:
            tf.close()
            raise CorruptFileError(f"{path} holds a {str(tensor.dtype).replace('torch.', '')} "
                                   f"tensor of shape {tuple(tensor.shape)}; {MANIFEST} says float32 "
                                   f"{tuple(entry.shape)}")
        return tf, tensor

    def _tensor(self, name: str, key: str) -> torch.Tensor:
        """A parameter file's tensor with no copy: writes to it stay private, and the mapping lives
        as long as the tensor does."""
        tf, tensor = self._open_tensor(name, key)
        tf.close()
        return tensor

    def _step(self, name: str) -> int | None:
        """The step from step.pt (what DeepSpeed's loader reads), checked against the manifest."""
        entry = self._entries[name]
        if "step.pt" not in entry.files:
            return entry.step
        path = self.file_path(name, "step.pt")
        stamp = _stamp_of(path)  # taken before reading: a change while reading shows up next time
        known = self._memo.get(path)
        if known is not None and stamp is not None and known[0] == stamp:
            return known[1]
        raw = self._load(path, entry.files["step.pt"])
        value = raw.item() if torch.is_tensor(raw) and raw.numel() == 1 else raw
        if not isinstance(value, (int, float)) or value != entry.step:
            raise CorruptFileError(f"{path} holds {value!r}; {MANIFEST} says {entry.step}")
        self._memo[path] = (stamp, int(value))
        return int(value)

    def read(self, name: str, *, moments: bool = True) -> ParamState:
        entry = self._entries.get(name)
        if entry is None:
            raise InputError(f"parameter {name!r} is not in {self.path}")
        fp32 = self._tensor(name, "fp32.pt")
        if entry.frozen or not moments or "exp_avg.pt" not in entry.files:
            return ParamState(fp32=fp32, step=entry.step)
        return ParamState(fp32=fp32, exp_avg=self._tensor(name, "exp_avg.pt"),
                          exp_avg_sq=self._tensor(name, "exp_avg_sq.pt"), step=self._step(name))

    @contextmanager
    def read_pieces(self, name: str, *, moments: bool = True) -> Iterator[PieceState]:
        """:meth:`read` as spans of the parameter's files, valid inside the ``with`` block: a target
        reads just the slices it needs (a rank's share) straight into place, and a file read again
        by this reader is not checksummed again."""
        entry = self._entries.get(name)
        if entry is None:
            raise InputError(f"parameter {name!r} is not in {self.path}")
        keys = ["fp32.pt"]
        if not (entry.frozen or not moments or "exp_avg.pt" not in entry.files):
            keys += ["exp_avg.pt", "exp_avg_sq.pt"]
        with ExitStack() as stack:
            pieces = [self._file_pieces(name, key, stack) for key in keys]
            step = self._step(name) if len(keys) > 1 else entry.step
            yield PieceState(*pieces, step=step)  # type: ignore[arg-type]

    def _file_pieces(self, name: str, key: str, stack: ExitStack) -> Pieces:
        """One file's tensor as a span. Where its tensor lies is remembered, so reading the file again
        (a restore reads each file once per target rank) costs an open, not a parse, while it is
        still the file that was checked (same size, mtime, ctime and inode)."""
        shape = tuple(self._entries[name].shape)
        path = self.file_path(name, key)
        known = self._memo.get(path)
        if known is not None:
            with contextlib.suppress(OSError):
                handle = stack.enter_context(open(path, "rb", buffering=0))
                if _stamp(os.fstat(handle.fileno())) == known[0]:
                    return Pieces((FileSpan(handle, *known[1]),), shape, torch.float32)
        stamp = _stamp_of(path)  # taken before reading: a change while reading shows up next time
        tf, tensor = self._open_tensor(name, key)
        stack.callback(tf.close)
        span = tf.span(tensor)
        if span is None:
            return Pieces.of(tensor)
        self._memo[path] = (stamp, (span.offset, span.nbytes))
        return Pieces((span,), shape, torch.float32)

    def _state(self) -> Mapping[str, Any]:
        if not hasattr(self, "_state_cache"):
            self._state_cache = self._load(self.path / STATE_FILE, self._files.get(STATE_FILE))
        return self._state_cache

    def buffers(self) -> dict[str, torch.Tensor]:
        return dict(self._state().get("buffers") or {})

    def extras(self) -> dict[str, Any]:
        return {k: v for k, v in self._state().items() if k != "buffers"}

    def entries(self) -> list[ParamEntry]:
        return list(self._entries.values())

    def close(self) -> None:
        pass


def _stamp(stat: os.stat_result) -> tuple[int, ...]:
    """A file's identity for "is this still the file that was checked": a rewrite changes mtime and
    ctime, a replacement the inode."""
    return (stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino)


def _stamp_of(path: Path) -> tuple[int, ...] | None:
    try:
        return _stamp(path.stat())
    except OSError:
        return None


def open_universal(path: str | os.PathLike, *, verify: bool = True) -> UniversalReader:
    """Open a universal directory for lazy, per-parameter access (checksums checked on each read)."""
    return UniversalReader(Path(path), verify=verify)
