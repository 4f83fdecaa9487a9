"""Reading torch checkpoint files safely, without importing DeepSpeed.

Reading: a pickle of plain metadata is read in one pass by :mod:`ucp.io.plain_pickle` (a strict
subset of torch's weights_only unpickler); any other is unpickled by torch's weights_only unpickler
after an allow-list scan: the few DeepSpeed classes that appear in ZeRO checkpoints map to inert
stand-ins defined here, and any other global is refused with one line naming it. Tensors of a
zip-format file are views on a private read-only mmap, so opening a shard costs no copy and :meth:`TorchFile.release` hands pages back once a parameter is
done (memory stays bounded by what is being assembled, not by the checkpoint).

Writing is :mod:`ucp.io.torchzip`'s alone.
"""

from __future__ import annotations

import _compat_pickle
import io
import logging
import mmap
import os
import pickle
import pickletools
import re
import struct
import threading
import zipfile
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ucp.errors import CorruptFileError, UnsafeFileError
from ucp.io.plain_pickle import NotPlain, load_plain, rebind
from ucp.io.standins import STANDINS, DSObject
from ucp.model.pieces import FileSpan

__all__ = ["TorchFile", "allowed_globals", "load"]

logger = logging.getLogger(__name__)


_SAFE_GLOBALS: list[Any] = [(cls, cls.ds_name) for cls in STANDINS]
# torch keeps its allow-list in one process-wide set; the lock keeps our additions scoped to our loads.
_ALLOW_LOCK = threading.Lock()
_UNSUPPORTED = re.compile(
    r"(?:Unsupported global: GLOBAL|unsupported GLOBAL|unrecognized function|Unsupported class)"
    r"\s+([\w.<>]+)"
)
_ZIP_MAGIC = b"PK\x03\x04"
_LEGACY_PICKLES = 5  # magic number, protocol, sys info, the object, storage keys (torch's _legacy_load)
# A tensor may address more bytes than its storage holds only by overlapping itself (stride 0,
# expand()); a damaged file can use that to ask for terabytes. Small expanded tensors stay legal.
_MAX_OVERLAP_BYTES = 1 << 20
#: What a storage loader hands out, per storage: (key, storage, bytes the record must hold, persistent id).
_Handed = tuple[str, torch.UntypedStorage, int, Any]


def _one_line(text: object, limit: int = 300) -> str:
    """The first line of ``str(text)`` (a message or an exception), cut to ``limit`` characters: error messages stay one line."""
    lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
    first = lines[0] if lines else ""
    return first if len(first) <= limit else first[: limit - 3] + "..."


def allowed_globals() -> frozenset[str]:
    """Every dotted name a checkpoint pickle may refer to: torch's weights_only set plus the stand-ins.

    This is the whole allow-list: names added to torch's process-wide set by other code
    (``torch.serialization.add_safe_globals``) are not on it.
    """
    from torch import _weights_only_unpickler

    return frozenset(_weights_only_unpickler._get_allowed_globals()) | {cls.ds_name for cls in STANDINS}


def _global_name(arg: str) -> str:
    module, _, name = arg.partition(" ")
    # mirror torch's _read_global_instruction: protocol-2 pickles may carry Python 2 names
    if (module, name) in _compat_pickle.NAME_MAPPING:
        module, name = _compat_pickle.NAME_MAPPING[(module, name)]
    elif module in _compat_pickle.IMPORT_MAPPING:
        module = _compat_pickle.IMPORT_MAPPING[module]
    return f"{module}.{name}"


def _check_globals(stream: io.BytesIO, path: Path, pickles: int = 1) -> None:
    """Refuse a pickle naming any global off the allow-list, before a single opcode runs.

    ``pickletools.genops`` only parses; nothing is imported or called. The weights_only unpickler
    checks again as it loads; this pass makes the allow-list ours alone and the refusal name the global.
    """
    allowed = allowed_globals()
    try:
        for _ in range(pickles):
            for opcode, arg, _pos in pickletools.genops(stream):
                if opcode.name == "GLOBAL":
                    name = _global_name(str(arg))
                    if name not in allowed:
                        raise UnsafeFileError(
                            f"{path} refers to {_one_line(name, 120)}, which is not on ucp's allow-list of checkpoint "
                            "types; refused without running it (if you trust the file, re-save it without that object)"
                        )
                elif opcode.name in ("STACK_GLOBAL", "INST", "OBJ"):
                    raise UnsafeFileError(
                        f"{path} builds objects with the {opcode.name} opcode, which ucp does not "
                        "allow; refused without running it"
                    )
    except UnsafeFileError:
        raise
    except Exception as err:  # genops raises ValueError and friends on a damaged pickle
        raise CorruptFileError(
            f"{path} holds a damaged pickle ({_one_line(err, 120) or type(err).__name__}); "
            "the file is truncated or corrupt"
        ) from None


def _refusal(err: Exception, path: Path) -> Exception:
    text = str(err)
    match = _UNSUPPORTED.search(text)
    if match:
        return UnsafeFileError(
            f"{path} refers to {match.group(1)}, which is not on ucp's allow-list of checkpoint types; refused "
            "without running it"
        )
    return CorruptFileError(f"{path} could not be unpickled: {_one_line(text) or type(err).__name__}")


def _extent(tensor: torch.Tensor) -> int:
    """The bytes of its storage a strided tensor reaches, from the storage's start."""
    if tensor.numel() == 0:
        return 0
    last = tensor.storage_offset() + sum((n - 1) * st for n, st in zip(tensor.shape, tensor.stride(), strict=True))
    return int(last + 1) * tensor.element_size()


def _check_tensors(obj: Any, path: Path) -> None:
    """Refuse tensors that claim far more bytes than their storage holds (see _MAX_OVERLAP_BYTES)."""
    stack = [obj]
    seen: set[int] = set()
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if torch.is_tensor(item):
            if item.layout != torch.strided:
                continue
            claimed = item.numel() * item.element_size()
            held = item.untyped_storage().nbytes()
            if _extent(item) > held:
                raise CorruptFileError(
                    f"{path} holds a tensor of shape {tuple(item.shape)} that reaches past the end of its "
                    f"storage of {held} bytes; the file is corrupt"
                )
            if claimed > held and claimed > _MAX_OVERLAP_BYTES:
                raise CorruptFileError(
                    f"{path} holds a tensor of shape {tuple(item.shape)} that claims {claimed} "
                    f"bytes over a storage of {held}; the file is corrupt"
                )
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)
        elif isinstance(item, DSObject):
            stack.extend(item.__dict__.values())


def load(path: str | os.PathLike, *, check: Callable[[mmap.mmap], None] | None = None) -> Any:
    """Load a whole (small) torch file into memory, weights_only, with the DeepSpeed stand-ins."""
    with TorchFile(path, check=check) as tf:
        try:
            return _detach(tf.obj)
        except RecursionError:
            raise CorruptFileError(f"{tf.path} nests its objects too deeply to be a checkpoint") from None


def _detach(obj: Any) -> Any:
    """Copy tensors out of a TorchFile's mmap so that what load() returns does not pin the mapping."""
    if torch.is_tensor(obj):
        return obj.clone()
    if isinstance(obj, dict):
        out = type(obj)() if type(obj) is not dict else {}
        for key, value in obj.items():
            out[key] = _detach(value)
        return out
    if isinstance(obj, list):
        return [_detach(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_detach(v) for v in obj)
    if isinstance(obj, (set, frozenset)):
        return type(obj)(_detach(v) for v in obj)
    if isinstance(obj, DSObject):
        copy = type(obj).__new__(type(obj))
        copy.__dict__.update({k: _detach(v) for k, v in obj.__dict__.items()})
        return copy
    return obj


@dataclass(frozen=True)
class _Template:
    """How a plain pickle was read: its bytes, the storages it asked for (in order), which storage (by
    ``_cdata``) came from which key, and the tree it gave; a byte-identical pickle is re-bound from it."""

    data: bytes
    saved_ids: tuple[Any, ...]
    keys: dict[int, str]
    obj: Any


def _keys(handed: list[_Handed]) -> dict[int, str]:
    """Which key each handed-out storage came from, by the storage's ``_cdata`` (what its tensors share)."""
    return {raw._cdata: key for key, raw, _, _ in handed}


class TorchFile:
    """A torch checkpoint opened read-only, its tensors zero-copy views on a private mmap.

    Call order: open (unpickles the small object tree), use ``obj``, call :meth:`release` on big
    tensors once their bytes have been consumed, then :meth:`close` (or use ``with``). Legacy
    (non-zip) files are loaded eagerly instead. :meth:`open_all` opens the rank files of one save.
    """

    def __init__(self, path: str | os.PathLike, *, check: Callable[[mmap.mmap], None] | None = None) -> None:
        """``check(mapping)`` sees the file's bytes before anything is parsed (a checksum over the
        same pages that then back the tensors: one pass over the file)."""
        self._open(path, check=check, like=None, remember=False)

    @classmethod
    def open_all(cls, paths: Iterable[str | os.PathLike]) -> list[TorchFile]:
        """Open the rank files of one save in order; a file whose pickle repeats the one before it byte for
        byte (a ZeRO-3 model-states file repeats the module dict on every rank) is not unpickled again:
        the tree read before, untouched yet, is copied onto this file's storages. If one fails, those
        already open are closed."""
        files: list[TorchFile] = []
        try:
            for path in paths:
                tf = cls.__new__(cls)
                tf._open(path, check=None, like=files[-1]._template if files else None, remember=True)
                if files:
                    files[-1]._template = None  # only the last file read is copied from
                files.append(tf)
        except BaseException:
            for tf in files:
                tf.close()
            raise
        if files:
            files[-1]._template = None  # the trees are the caller's from here: none may be copied from
        return files

    def _open(
        self,
        path: str | os.PathLike,
        *,
        check: Callable[[mmap.mmap], None] | None,
        like: _Template | None,
        remember: bool,
    ) -> None:
        """What ``__init__`` does; ``like``: how the file before was read (to re-bind a repeat of its
        pickle); ``remember``: keep how this one was read, for the file after it."""
        self.path = Path(path)
        self._template: _Template | None = None
        self._mm: mmap.mmap | None = None
        self._file: io.RawIOBase | None = None
        self._storage: torch.UntypedStorage | None = None
        self._base = 0
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            raise CorruptFileError(f"{self.path} does not exist") from None
        except OSError as err:
            raise CorruptFileError(f"{self.path} cannot be read: {err.strerror}") from None
        if not self.path.is_file():
            raise CorruptFileError(f"{self.path} is not a regular file")
        if size == 0:
            raise CorruptFileError(f"{self.path} is empty")
        try:
            # read-only descriptor, kept for span(); ACCESS_COPY keeps any write to the mapping private
            self._file = open(self.path, "rb", buffering=0)
            self._mm = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError) as err:
            self._close_file()
            raise CorruptFileError(f"{self.path} cannot be read: {_one_line(err)}") from None
        try:
            if check is not None:
                check(self._mm)
            if self._mm[:4] != _ZIP_MAGIC:
                self.obj = self._load_legacy()
                self._close_mapping()
                return
            self._storage = torch.frombuffer(self._mm, dtype=torch.uint8).untyped_storage()
            self._base = self._storage.data_ptr()
            records, pickle_name = self._index(size)
            self.obj = self._unpickle(records, pickle_name, like, remember)
        except BaseException:
            self.close()
            raise

    def _load_legacy(self) -> Any:
        """Files written with _use_new_zipfile_serialization=False: torch's own (eager) reader."""
        if self._mm is None or self._mm[:1] != pickle.PROTO:
            raise CorruptFileError(f"{self.path} is not a torch checkpoint (neither a zip archive nor a pickle)")
        _check_globals(io.BytesIO(self._mm[:]), self.path, pickles=_LEGACY_PICKLES)
        try:
            with _ALLOW_LOCK, torch.serialization.safe_globals(_SAFE_GLOBALS):
                obj = torch.load(self.path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            raise _refusal(err, self.path) from None
        except Exception as err:  # torch raises many types for a broken file
            raise CorruptFileError(
                f"{self.path} is not a readable torch file ({type(err).__name__}: {_one_line(err, 120)})"
            ) from None
        _check_tensors(obj, self.path)
        return obj

    def _index(self, size: int) -> tuple[dict[str, tuple[int, int]], str]:
        """Map each zip member to (data offset, length); members are stored uncompressed by torch."""
        if not zipfile.is_zipfile(self.path):
            raise CorruptFileError(f"{self.path} is truncated or corrupt: its zip directory is missing or damaged")
        try:
            with zipfile.ZipFile(self.path) as zf:
                infos = zf.infolist()
        except Exception as err:  # zipfile raises BadZipFile, ValueError, struct.error, UnicodeDecodeError...
            raise CorruptFileError(f"{self.path} is truncated or corrupt: {_one_line(err, 120)}") from None
        records: dict[str, tuple[int, int]] = {}
        pickle_name = ""
        pickle_crc = 0
        assert self._mm is not None
        for info in infos:
            if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
                raise CorruptFileError(
                    f"{self.path}: member {info.filename!r} is compressed or damaged; not a torch.save file"
                )
            head = info.header_offset
            if head < 0 or head + 30 > size or self._mm[head : head + 4] != _ZIP_MAGIC:
                raise CorruptFileError(f"{self.path} is truncated or corrupt: bad local header for {info.filename!r}")
            name_len, extra_len = struct.unpack("<HH", self._mm[head + 26 : head + 30])
            start = head + 30 + name_len + extra_len
            if info.file_size < 0 or start + info.file_size > size:
                raise CorruptFileError(f"{self.path} is truncated: {info.filename!r} runs past the end of the file")
            records[info.filename] = (start, info.file_size)
            if info.filename.endswith("/data.pkl") and info.filename.count("/") == 1:
                pickle_name = info.filename
                pickle_crc = info.CRC
        if not pickle_name:
            raise CorruptFileError(f"{self.path} has no data.pkl; not a torch.save file")
        start, length = records[pickle_name]
        # torch writes CRC 0 when crc32 is switched off (torch.serialization.set_crc32_options)
        if pickle_crc and zlib.crc32(self._mm[start : start + length]) != pickle_crc:
            raise CorruptFileError(f"{self.path} is corrupt: the checksum of {pickle_name} does not match")
        prefix = pickle_name[: -len("data.pkl")]
        order = records.get(prefix + "byteorder")
        if order is not None and bytes(self._mm[order[0] : order[0] + order[1]]) != b"little":
            raise CorruptFileError(f"{self.path} was written big-endian; ucp reads little-endian files only")
        return records, pickle_name

    def _unpickle(
        self, records: dict[str, tuple[int, int]], pickle_name: str, like: _Template | None, remember: bool
    ) -> Any:
        """The pickle's object: re-bound from ``like`` when the bytes repeat, else by the one-pass plain
        reader when it can (most metadata pickles), else the full way (allow-list scan, then torch's
        weights_only unpickler), which also words every refusal. ``remember``: keep a plain read's
        :class:`_Template` for the next file."""
        assert self._mm is not None
        start, length = records[pickle_name]
        data = self._mm[start : start + length]
        prefix = pickle_name[: -len("data.pkl")]
        obj, sizes = (
            self._rebound(like, data, records, prefix) if like is not None and like.data == data else (None, [])
        )
        if obj is None:
            load_storage, sizes = self._storage_loader(records, prefix)
            try:
                obj = load_plain(data, load_storage)
                if remember:
                    self._template = _Template(data, tuple(s[3] for s in sizes), _keys(sizes), obj)
            except NotPlain as why:
                logger.debug("%s: read by the full unpickler (%s)", self.path, why)
                load_storage, sizes = self._storage_loader(records, prefix)  # fresh: nothing of the attempt is kept
                obj = self._unpickle_full(data, load_storage)
        for key, raw, nbytes, _ in sizes:
            if raw.nbytes() != nbytes:
                raise CorruptFileError(
                    f"{self.path}: a tensor reaches past the end of storage {key} ({nbytes} bytes); the file is corrupt"
                )
        _check_tensors(obj, self.path)
        return obj

    def _rebound(
        self, like: _Template, data: bytes, records: dict[str, tuple[int, int]], prefix: str
    ) -> tuple[Any, list[_Handed]]:
        """The tree of a pickle identical to ``like``'s, re-bound onto this file's storages; (None, [])
        when that fails in any way, so that unpickling it reports the failure in its own words."""
        load_storage, sizes = self._storage_loader(records, prefix)
        try:
            # every storage the unpickler would ask for, in its order: the same checks, the same first error
            by_key = {saved_id[2]: load_storage(saved_id) for saved_id in like.saved_ids}
            obj = rebind(like.obj, lambda cdata: by_key[like.keys[cdata]])
        except Exception as why:  # noqa: BLE001 - any failure: read this file the ordinary way
            logger.debug("%s: not re-bound from the rank before (%s)", self.path, _one_line(why, 120))
            return None, []
        self._template = _Template(data, like.saved_ids, _keys(sizes), obj)  # only open_all passes a like
        return obj, sizes

    def _storage_loader(
        self, records: dict[str, tuple[int, int]], prefix: str
    ) -> tuple[Callable[[Any], torch.storage.TypedStorage], list[_Handed]]:
        """The unpickler's ``persistent_load``: each storage a zero-copy view of its record, checked
        against the record's length; and the list of (key, storage, bytes, persistent id) it hands out,
        because torch grows an empty storage that a tensor overruns (checked once the pickle is read)."""
        assert self._mm is not None
        storages: dict[str, torch.storage.TypedStorage] = {}
        sizes: list[_Handed] = []

        def persistent_load(saved_id: Any) -> torch.storage.TypedStorage:
            if not isinstance(saved_id, tuple) or len(saved_id) != 5 or saved_id[0] != "storage":
                raise CorruptFileError(f"{self.path}: unexpected persistent id {saved_id!r:.80}")
            _, storage_type, key, _location, numel = saved_id
            dtype = getattr(storage_type, "dtype", None)
            if not isinstance(dtype, torch.dtype) or not isinstance(key, str) or not isinstance(numel, int):
                raise CorruptFileError(f"{self.path}: malformed storage reference {saved_id!r:.80}")
            if key in storages:
                return storages[key]
            record = records.get(f"{prefix}data/{key}")
            if record is None:
                raise CorruptFileError(f"{self.path}: storage {key} is missing from the archive")
            nbytes = numel * dtype.itemsize
            if numel < 0 or nbytes > record[1]:
                raise CorruptFileError(f"{self.path}: storage {key} holds {record[1]} bytes, needs {nbytes}")
            # A frombuffer view per record: zero-copy like a slice of the whole mapping, but copying from
            # a slice of one big UntypedStorage was measured 10-30x slower (torch 2.13, CPU).
            raw = (
                torch.frombuffer(self._mm, dtype=torch.uint8, count=nbytes, offset=record[0]).untyped_storage()
                if nbytes
                else torch.UntypedStorage(0)
            )
            typed = torch.storage.TypedStorage(wrap_storage=raw, dtype=dtype, _internal=True)
            storages[key] = typed
            sizes.append((key, raw, nbytes, saved_id))
            return typed

        return persistent_load, sizes

    def _unpickle_full(self, data: bytes, persistent_load: Callable[[Any], Any]) -> Any:
        """The allow-list scan, then torch's weights_only unpickler with the stand-ins allowed."""
        from torch import _weights_only_unpickler

        stream = io.BytesIO(data)
        _check_globals(stream, self.path)
        stream.seek(0)
        unpickler = _weights_only_unpickler.Unpickler(stream, encoding="utf-8")
        unpickler.persistent_load = persistent_load  # type: ignore[method-assign]  # pickle's documented hook
        try:
            with _ALLOW_LOCK, torch.serialization.safe_globals(_SAFE_GLOBALS):
                return unpickler.load()
        except (UnsafeFileError, CorruptFileError):
            raise
        except pickle.UnpicklingError as err:
            raise _refusal(err, self.path) from None
        except Exception as err:  # a hostile or damaged pickle can fail in many ways
            raise CorruptFileError(
                f"{self.path} could not be unpickled: {type(err).__name__}: {_one_line(err, 160)}"
            ) from None

    def span(self, tensor: torch.Tensor) -> FileSpan | None:
        """Where a contiguous tensor of this file lies on disk, for a pread instead of touching its
        mapping; None when the tensor is not a view on this file (legacy files, copies)."""
        if self._mm is None or self._file is None or not tensor.is_contiguous():
            return None
        start = tensor.data_ptr() - self._base
        nbytes = tensor.numel() * tensor.element_size()
        if start < 0 or start + nbytes > len(self._mm):
            return None
        return FileSpan(self._file, start, nbytes)

    def release(self, tensor: torch.Tensor) -> None:
        """Hand the pages under ``tensor`` back to the kernel; they are re-read from disk if touched."""
        if self._mm is None or tensor.numel() == 0:
            return
        start = tensor.data_ptr() - self._base
        end = start + tensor.numel() * tensor.element_size()
        page = mmap.PAGESIZE
        lo = start - start % page
        if lo < 0 or end > len(self._mm):
            return
        try:
            self._mm.madvise(mmap.MADV_DONTNEED, lo, end - lo)
        except (OSError, ValueError):  # advisory only
            pass

    def _close_mapping(self) -> None:
        """Drop the mmap (legacy files are loaded eagerly, so no tensor views it)."""
        self._storage = None
        if self._mm is not None:
            self._mm.close()
            self._mm = None
        self._close_file()

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.close()  # a FileSpan used after this raises ValueError: never reads a reused descriptor
            self._file = None

    def close(self) -> None:
        """Drop this file's hold on the mapping; it is unmapped once no tensor from it is left.

        Never ``mmap.close()`` here: torch.frombuffer keeps a reference to the mmap object, not a
        buffer export, so close() would succeed and leave every surviving tensor pointing at
        unmapped memory (a segfault on the next read; seen with torch 2.13).
        """
        self.obj = None
        self._template = None
        self._storage = None
        self._mm = None
        self._close_file()

    def __enter__(self) -> TorchFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
