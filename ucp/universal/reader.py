"""Reading a universal directory: lazily, one parameter at a time, every file checked against ucp.json.

The directory is untrusted input. ``ucp.json`` is read up to :data:`MAX_MANIFEST_BYTES` and
:data:`MAX_MANIFEST_DEPTH` levels, every field is checked (``manifest_check``, as each entry is parsed), and a
reader that verifies (restore, export, verify) checks the manifest's claims against the files
when it opens: every file present as a plain file of the size the manifest gives, large enough
for the shape it claims. So a lying manifest is refused before any output is staged, and no
target sizes a buffer from a shape the files do not back.
"""

from __future__ import annotations

import math
import mmap
import os
import zlib
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ucp.errors import ChecksumError, CorruptFileError, InputError
from ucp.io import torchfile
from ucp.io.crc import crc32_mapped
from ucp.io.tensor_record import SpanChecks, find_tensor_record
from ucp.model.pieces import PathSpan, Pieces, file_stamp
from ucp.model.records import ParamState, PieceState, Reader
from ucp.universal.file_checks import FP32_BYTES, check_file, param_pickle, small_step
from ucp.universal.file_memo import FileMemo
from ucp.universal.manifest import (
    FORMAT,
    FORMAT_VERSION,
    FP32_FILE,
    MANIFEST,
    STATE_FILE,
    STEP_FILE,
    FileEntry,
    ParamEntry,
    state_file,
)
from ucp.universal.manifest_file import MAX_MANIFEST_BYTES, MAX_MANIFEST_DEPTH, read_manifest
from ucp.universal.param_table import ParamTable, facts_from_manifest

__all__ = ["UniversalReader", "open_universal", "is_universal", "MAX_MANIFEST_BYTES", "MAX_MANIFEST_DEPTH"]


def is_universal(path: str | os.PathLike) -> bool:
    """A folder holding ucp.json."""
    return (Path(path) / MANIFEST).is_file()


class UniversalReader(Reader):
    """A universal directory as a :class:`~ucp.model.records.Reader`, loading one parameter at a time."""

    streams = True

    def __init__(self, path: Path, *, verify: bool = True) -> None:
        self.path = path
        self.inputs = (path,)
        self.verify = verify
        manifest_path = path / MANIFEST
        table = self._table = ParamTable()
        raw = read_manifest(manifest_path, table.add)
        if raw.get("format") != FORMAT:
            raise InputError(f"{manifest_path} is not a ucp manifest")
        version = raw.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise InputError(f"{manifest_path} has format_version {version!r}; this ucp reads up to {FORMAT_VERSION}")
        # its top-level fields (format, created_by, ...); the per-parameter entries live on in the table
        self.manifest = {k: v for k, v in raw.items() if k != "params"}
        self._zero = path / "zero"
        self._zero_str = str(self._zero)
        # a file outside zero/ -> its _stamp when its checksum matched (the parameters' files: in the FileMemo)
        self._verified: dict[Path, tuple[int, ...]] = {}
        # inside deferred_checks: the checks of files handed out unchecked (by FileMemo slot), and those that failed
        self._pending: SpanChecks | None = None
        self._failed: list[str] = []
        self._elsewhere: Callable[[str], bool] | None = None  # inside deferred_checks: names another process checks
        self.facts, self._files = facts_from_manifest(raw, table)
        del raw
        # what parsing each file told (a tensor's place, a step): 4 x 10^5 files for a MoE
        keys = sorted({key for i in range(len(table)) for key in table.files(i)})
        self._memo = FileMemo(table.names, keys, index=table.index)
        root = (path / "zero").resolve()
        for i, name in enumerate(table.names):
            folder = table.folder(i)
            if "\x00" in folder or "/" in folder or folder in ("", ".", ".."):
                raise CorruptFileError(f"{MANIFEST} maps {name!r} to folder {folder!r}, outside zero/")
            if (root / folder).resolve().parent != root:  # a folder that links out of zero/
                raise CorruptFileError(f"{MANIFEST} maps {name!r} to folder {folder!r}, outside zero/")
        if verify:
            self._check_claims()

    def _check_claims(self) -> None:
        """What the manifest says about each file, against the file: there, plain, the size given,
        and (for a tensor) at least as many bytes as its claimed shape needs. One stat per file."""
        table = self._table
        for i, name in enumerate(table.names):
            tensors = {FP32_FILE} | {state_file(k) for k in self._keys(i, True)}
            numel = math.prod(table.shape(i))
            for key, claim in table.claims(i):
                file = self.file_path(name, key)
                check_file(file, claim)
                if key in tensors and claim.bytes < numel * FP32_BYTES:
                    raise CorruptFileError(
                        f"{file} has {claim.bytes:,} bytes; {MANIFEST} says it holds {name}'s "
                        f"{numel:,} float32 values (shape {table.shape(i)}): the manifest lies or the file is cut"
                    )
        for key, claim in self._files.items():
            check_file(self.path / key, claim)

    def file_path(self, name: str, key: str) -> Path:
        return self._zero.joinpath(self._table.folder(self._index(name)), key)  # one join: per file, per rank

    def _stamp_now(self, name: str, key: str) -> tuple[int, ...] | None:
        """The file's stamp now (None: not there), by its string path."""
        try:
            return file_stamp(os.stat(self._file(name, key)))
        except OSError:
            return None

    def _file(self, name: str, key: str) -> str:
        """:meth:`file_path` as a string, without pathlib (read per file and per task of ranks: 10^6 times at 10^5
        parameters, where pathlib cost a tenth of a restore's CPU)."""
        return f"{self._zero_str}/{self._table.folder(self._index(name))}/{key}"

    def _check(
        self, path: Path, entry: FileEntry | None, slot: tuple[str, str] | None = None
    ) -> Callable[[mmap.mmap], None] | None:
        """What a file must match before it is parsed: its size now, its crc32 over the very pages that
        then back its tensors (one pass over the file); None when not verifying, or when this reader
        already verified the file and its size, mtime, ctime and inode are unchanged since. ``slot``:
        the (parameter, file) a file of zero/ is, whose verification the FileMemo keeps."""
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
        if self._memo.verified(*slot, stamp) if slot is not None else self._verified.get(path) == stamp:
            return None

        def check(data: mmap.mmap) -> None:
            if len(data) != entry.bytes or f"{crc32_mapped(data) & 0xFFFFFFFF:08x}" != entry.crc32:
                raise mismatch()
            if slot is not None:
                self._memo.verify(*slot, stamp)
            else:
                self._verified[path] = stamp

        return check

    def _load(self, path: Path, entry: FileEntry | None, slot: tuple[str, str] | None = None) -> Any:
        return torchfile.load(path, check=self._check(path, entry, slot))

    def _open_tensor(self, name: str, key: str) -> tuple[torchfile.TorchFile, torch.Tensor]:
        """A parameter file, checked, and its tensor (a view on the file's private mapping)."""
        i = self._index(name)
        shape = self._table.shape(i)
        path = self.file_path(name, key)
        tf = torchfile.TorchFile(path, check=self._check(path, self._table.claim(i, key), (name, key)))
        obj = tf.obj
        tensor = obj.get("param") if isinstance(obj, Mapping) else obj
        if not torch.is_tensor(tensor):
            tf.close()
            raise CorruptFileError(f"{path} holds no tensor under 'param'")
        if tuple(tensor.shape) != shape or tensor.dtype != torch.float32:
            tf.close()
            raise CorruptFileError(
                f"{path} holds a {str(tensor.dtype).replace('torch.', '')} "
                f"tensor of shape {tuple(tensor.shape)}; {MANIFEST} says float32 "
                f"{shape}"
            )
        return tf, tensor

    def _tensor(self, name: str, key: str) -> torch.Tensor:
        """A parameter file's tensor with no copy: writes to it stay private, and the mapping lives
        as long as the tensor does."""
        tf, tensor = self._open_tensor(name, key)
        tf.close()
        return tensor

    def _step(self, name: str) -> int | None:
        """The step from step.pt (what DeepSpeed's loader reads), checked against the manifest."""
        i = self._index(name)
        claim, step = self._table.claim(i, STEP_FILE), self._table.step(i)
        if claim is None:
            return step
        known = self._memo.known(name, STEP_FILE)
        if known is not None:  # the value checked against the manifest; the file is not read again
            return known[0]
        path = self.file_path(name, STEP_FILE)
        small = small_step(path, claim, verify=self.verify)
        stamp: tuple[int, ...] | None
        if small is not None:
            value, stamp = small
        else:
            stamp = self._stamp_now(name, STEP_FILE)  # taken before reading: a change while reading shows up next time
            raw = self._load(path, claim, (name, STEP_FILE))
            value = raw.item() if torch.is_tensor(raw) and raw.numel() == 1 else raw
        if not isinstance(value, (int, float)) or value != step:
            raise CorruptFileError(f"{path} holds {value!r}; {MANIFEST} says {step}")
        self._memo.put(name, STEP_FILE, stamp, int(value), 0)
        return int(value)

    def _keys(self, i: int, moments: bool) -> tuple[str, ...]:
        return () if self._table.frozen(i) or not moments else self._table.state_keys(i)

    def read(self, name: str, *, moments: bool = True) -> ParamState:
        i = self._entry(name)
        fp32 = self._tensor(name, FP32_FILE)
        keys = self._keys(i, moments)
        if not keys:
            return ParamState(fp32=fp32, step=self._table.step(i))
        optim = {k: self._tensor(name, state_file(k)) for k in keys}
        return ParamState(fp32=fp32, optim=optim, step=self._step(name), scalars=self._scalars(name))

    @contextmanager
    def read_pieces(self, name: str, *, moments: bool = True) -> Iterator[PieceState]:
        """:meth:`read` as spans of the parameter's files (each checked first), valid until the
        reader closes: a target reads just the slices it needs (a rank's share) straight into place
        or streams them into its own files, and a file read again is not checksummed again."""
        i = self._entry(name)
        keys = self._keys(i, moments)
        fp32 = self._file_pieces(name, FP32_FILE)
        optim = {k: self._file_pieces(name, state_file(k)) for k in keys}
        if not keys:
            yield PieceState(fp32=fp32, step=self._table.step(i))
            return
        yield PieceState(fp32=fp32, optim=optim, step=self._step(name), scalars=self._scalars(name))

    def _scalars(self, name: str) -> dict[str, torch.Tensor]:
        """The optimizer's 0-dim scalars of a parameter, exact as the source kept them."""
        i = self._index(name)
        out = {}
        for key in self._table.scalars(i):
            path = self.file_path(name, state_file(key))
            obj = self._load(path, self._table.claim(i, state_file(key)), (name, state_file(key)))
            value = obj.get("param") if isinstance(obj, Mapping) else obj
            if not torch.is_tensor(value) or value.dim() != 0 or not value.is_floating_point():
                raise CorruptFileError(f"{path} holds no 0-dim floating tensor under 'param'; {MANIFEST} says a scalar")
            out[key] = value
        return out

    def _entry(self, name: str) -> int:
        """The parameter's row in the table; one line for a name the directory does not hold."""
        i = self._table.index.get(name)
        if i is None:
            raise InputError(f"parameter {name!r} is not in {self.path}")
        return i

    def _index(self, name: str) -> int:
        return self._table.index[name]

    def _file_pieces(self, name: str, key: str) -> Pieces:
        """One file's tensor as a :class:`PathSpan`, checked once: the span outlives any open file (a
        restore holds every parameter's spans while it writes rank after rank), and handing it out
        again costs nothing: the span carries the stamp the file was checked under (size, mtime,
        ctime, inode), and a file that changed since is refused when the span is read.
        Inside :meth:`deferred_checks` a file in ucp's own layout is found without parsing it and
        checked from the spans copied out of it."""
        i = self._index(name)
        shape = self._table.shape(i)
        memo = self._memo.known(name, key)
        if memo is not None:  # no stat: the span is refused when read if the file is no longer the one checked
            offset, nbytes, checked = memo
            return self._span(self._file(name, key), offset, nbytes, checked, shape, self._witness(name, key))
        path = self.file_path(name, key)
        claim = self._table.claim(i, key)
        if (self._pending is not None or not self.verify) and claim is not None:
            record = find_tensor_record(path, param_pickle(shape), math.prod(shape) * FP32_BYTES)
            if record is not None and record.size == claim.bytes:
                elsewhere = self._elsewhere is not None and self._elsewhere(name)
                if self.verify and record.data is not None:  # read whole already: checked now, nothing kept
                    if f"{record.file_crc(zlib.crc32(record.data)) & 0xFFFFFFFF:08x}" != claim.crc32:
                        raise ChecksumError(
                            f"{path} does not match its checksum in {MANIFEST}: the file changed or is corrupt"
                        )
                self._memo.put(name, key, record.stamp, record.offset, record.nbytes)
                slot = self._memo.slot(name, key)
                witness = None
                if self.verify and record.data is None and self._pending is not None and not elsewhere:
                    if slot is None:
                        raise InputError(f"{path} is not a file of {MANIFEST}")  # entries and memo are built alike
                    witness = self._pending.add(slot, record, claim.crc32)
                return self._span(path, record.offset, record.nbytes, record.stamp, shape, witness)
        stamp = self._stamp_now(name, key)  # taken before reading: a change while reading shows up next time
        tf, tensor = self._open_tensor(name, key)
        try:
            span = tf.span(tensor)
        finally:
            tf.close()
        if span is None or stamp is None:
            return Pieces.of(tensor)
        self._memo.put(name, key, stamp, span.offset, span.nbytes)
        return self._span(path, span.offset, span.nbytes, stamp, shape, self._witness(name, key))

    def _witness(self, name: str, key: str) -> Callable[[int, int, int], None] | None:
        """The witness of a file handed out again while its check is open (None: none open)."""
        slot = self._memo.slot(name, key)
        if self._pending is None or slot is None or not self._pending.is_open(slot):
            return None
        return partial(self._pending.witness, slot)

    @staticmethod
    def _span(
        path: Path | str,
        offset: int,
        nbytes: int,
        stamp: tuple[int, ...],
        shape: tuple[int, ...],
        witness: Callable[[int, int, int], None] | None,
    ) -> Pieces:
        return Pieces._trusted((PathSpan(str(path), offset, nbytes, stamp, witness),), shape, torch.float32)

    @contextmanager
    def deferred_checks(self, elsewhere: Callable[[str], bool] | None = None) -> Iterator[None]:
        """Inside the block, parameter files of ucp's own layout are handed out as spans before
        their checksums are checked; a writer's copies report what they read, and on leaving the
        block every such file is checked (what nobody copied is read then). A mismatch raises
        :class:`ChecksumError` there, before the caller publishes anything it wrote. The files
        of parameters ``elsewhere(name)`` are not checked here: another process of a distributed
        write checks them, and its failure fails every process before anything is published."""
        if self._pending is not None:  # nested: the outer block checks
            yield
            return
        pending = self._pending = SpanChecks(self._memo.slots, self._settled)
        self._failed = []
        self._elsewhere = elsewhere
        try:
            yield
            left = [(slot, self._memo.file_of(slot)) for slot in pending.open_slots()]
            bad = [*self._failed, *(self._file(*at) for slot, at in left if not pending.confirm(slot, self._file(*at)))]
            if bad:
                more = f" (and {len(bad) - 1} more files)" if len(bad) > 1 else ""
                raise ChecksumError(
                    f"{bad[0]} does not match its checksum in {MANIFEST}{more}: the file changed or is corrupt"
                )
            for slot, at in left:
                self._memo.verify(*at, pending.stamp(slot))
        except BaseException:
            for slot in pending.open_slots():
                self._memo.forget(*self._memo.file_of(slot))
            raise
        finally:
            self._pending = None
            self._failed = []
            self._elsewhere = None

    def _settled(self, slot: int, ok: bool) -> None:
        """A check the copies covered: the file counts as verified, or is named when the block ends (and, read
        again, is parsed and checked again)."""
        pending = self._pending
        if pending is None:
            return
        name, key = self._memo.file_of(slot)
        if ok:
            self._memo.verify(name, key, pending.stamp(slot))
        else:
            self._failed.append(self._file(name, key))
            self._memo.forget(name, key)

    def _state(self) -> Mapping[str, Any]:
        if not hasattr(self, "_state_cache"):
            self._state_cache = self._load(self.path / STATE_FILE, self._files.get(STATE_FILE))
        return self._state_cache

    def buffers(self) -> dict[str, torch.Tensor]:
        return dict(self._state().get("buffers") or {})

    def extras(self) -> dict[str, Any]:
        return {k: v for k, v in self._state().items() if k != "buffers"}

    def entry(self, name: str) -> ParamEntry:
        """One parameter's record in the manifest (built when asked: the reader keeps its entries in columns)."""
        return self._table.entry(self._entry(name))

    def entries(self) -> list[ParamEntry]:
        """The manifest's record of every parameter (folder, files, checksums, step)."""
        return [self._table.entry(i) for i in range(len(self._table))]

    def param_steps(self) -> dict[str, int | None]:
        return {name: self._table.step(i) for i, name in enumerate(self._table.names)}


_stamp = file_stamp


def open_universal(path: str | os.PathLike, *, verify: bool = True) -> UniversalReader:
    """Open a universal directory for lazy, per-parameter access (checksums checked on each read)."""
    return UniversalReader(Path(path), verify=verify)
