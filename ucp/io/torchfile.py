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

import io
import logging
import mmap
import os
import pickle
import stat
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ucp.errors import CorruptFileError, UnsafeFileError
from ucp.io import descriptors
from ucp.io.allow_list import (
    ALLOW_LOCK,
    SAFE_GLOBALS,
    allowed_globals,
    check_globals,
    check_tensors,
    one_line,
    only_globals,
    refusal,
)
from ucp.io.memory import give_back_freed
from ucp.io.plain_pickle import NotPlain, load_plain, rebind
from ucp.io.standins import DSObject
from ucp.io.zip_records import ZIP_MAGIC, Handed, Records, storage_loader, zip_records
from ucp.model.pieces import FileSpan

__all__ = ["TorchFile", "allowed_globals", "load", "pickle_mentions"]

logger = logging.getLogger(__name__)


_LEGACY_PICKLES = 5  # magic number, protocol, sys info, the object, storage keys (torch's _legacy_load)


def load(
    path: str | os.PathLike,
    *,
    check: Callable[[mmap.mmap], None] | None = None,
    allow: Sequence[tuple[Any, str]] = (),
) -> Any:
    """Load a whole (small) torch file into memory, weights_only, with the DeepSpeed stand-ins (and ``allow``'s,
    see :class:`TorchFile`)."""
    with TorchFile(path, check=check, allow=allow) as tf:
        try:
            return _detach(tf.obj)
        except RecursionError:
            raise CorruptFileError(f"{tf.path} nests its objects too deeply to be a checkpoint") from None


def pickle_mentions(path: str | os.PathLike, text: str) -> bool:
    """Whether the pickle of torch file ``path`` holds ``text`` (ASCII) among its bytes: a certain "no" for a dict
    key before a full read (a pickled str's ASCII text is in the bytes as it is), at the cost of the zip directory.
    A ZeRO-3 model-states file of 10^5 placeholders takes seconds and 200 MB to unpickle, not to search. True
    where it cannot tell (a legacy file, a damaged one): the full read then decides, and words any error."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO in its place must not block the probe
    except OSError:
        return True
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size < len(ZIP_MAGIC):
            return True
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mm:
            if mm[: len(ZIP_MAGIC)] != ZIP_MAGIC:
                return True
            records, pickle_name = zip_records(Path(path), mm, info.st_size)
            start, length = records[pickle_name]
            return mm.find(text.encode("ascii"), start, start + length) >= 0
    except (OSError, ValueError, CorruptFileError):
        return True
    finally:
        os.close(fd)


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


def _keys(handed: list[Handed]) -> dict[int, str]:
    """Which key each handed-out storage came from, by the storage's ``_cdata`` (what its tensors share)."""
    return {raw._cdata: key for key, raw, _, _ in handed}


class TorchFile:
    """A torch checkpoint opened read-only, its tensors zero-copy views on a private mmap.

    Call order: open (unpickles the small object tree), use ``obj``, call :meth:`release` on big
    tensors once their bytes have been consumed, then :meth:`close` (or use ``with``). Legacy
    (non-zip) files are loaded eagerly instead. :meth:`open_all` opens the rank files of one save.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        check: Callable[[mmap.mmap], None] | None = None,
        allow: Sequence[tuple[Any, str]] = (),
    ) -> None:
        """``check(mapping)`` sees the file's bytes before anything is parsed (a checksum over the
        same pages that then back the tensors: one pass over the file). ``allow``: more (stand-in, dotted name)
        pairs this file may name beyond the allow-list (a verl checkpoint's DTensors:
        :data:`ucp.io.dist_standins.DIST_GLOBALS`)."""
        self._allow = tuple(allow)
        self._keep: tuple[str, ...] | None = None
        self._open(path, check=check, like=None, remember=False)

    @classmethod
    def open_all(
        cls,
        paths: Iterable[str | os.PathLike],
        each: Callable[[list[TorchFile], TorchFile], None] | None = None,
        keep: tuple[str, ...] | None = None,
    ) -> list[TorchFile]:
        """Open the rank files of one save in order; a file whose pickle repeats the one before it byte for
        byte (a ZeRO-3 model-states file repeats the module dict on every rank) is not unpickled again:
        the tree read before, untouched yet, is copied onto this file's storages. ``each(opened, file)``
        sees every file as it is opened (``opened``: those before it), to check it and trim its ``obj`` to
        what is kept, so that memory holds one whole tree, not one per rank. If one fails, those already
        open are closed. ``keep``: of a file that repeats the one before (``repeats``), re-bind only these top-level
        keys of its dict, and load only the storages they reach: the rest is the file before's, byte for byte
        (a ZeRO-3 rank's module of 10^5 placeholder tensors, never read again)."""
        paths = list(paths)
        if paths:
            descriptors.reserve(len(paths), f"the save in {Path(paths[0]).parent}")
        files: list[TorchFile] = []
        try:
            for path in paths:
                tf = cls.__new__(cls)
                tf._allow = ()
                tf._keep = keep
                tf._open(path, check=None, like=files[-1]._template if files else None, remember=True)
                if files:
                    files[-1]._template = None  # only the last file read is copied from
                files.append(tf)
                if each is not None:
                    each(files[:-1], tf)
        except BaseException:
            for tf in files:
                tf.close()
            raise
        if files:
            files[-1]._template = None  # the trees are the caller's from here: none may be copied from
        give_back_freed()  # the trees trimmed by ``each`` leave freed pages behind
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
        #: the pickle repeats the file's before it byte for byte (open_all): only its tensors can differ
        self.repeats = False
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
            raise CorruptFileError(f"{self.path} cannot be read: {one_line(err)}") from None
        try:
            if check is not None:
                check(self._mm)
            if self._mm[:4] != ZIP_MAGIC:
                self.obj = self._load_legacy()
                self._close_mapping()
                return
            self._storage = torch.frombuffer(self._mm, dtype=torch.uint8).untyped_storage()
            self._base = self._storage.data_ptr()
            records, pickle_name = self._index(size)
            self.obj = self._unpickle(records, pickle_name, like, remember)
            self._drop_pages()
        except BaseException:
            self.close()
            raise

    def _load_legacy(self) -> Any:
        """Files written with _use_new_zipfile_serialization=False: torch's own (eager) reader."""
        if self._mm is None or self._mm[:1] != pickle.PROTO:
            raise CorruptFileError(f"{self.path} is not a torch checkpoint (neither a zip archive nor a pickle)")
        check_globals(io.BytesIO(self._mm[:]), self.path, pickles=_LEGACY_PICKLES, extra=self._extra_names())
        try:
            with ALLOW_LOCK, self._globals():
                obj = torch.load(self.path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            raise refusal(err, self.path) from None
        except Exception as err:  # torch raises many types for a broken file
            raise CorruptFileError(
                f"{self.path} is not a readable torch file ({type(err).__name__}: {one_line(err, 120)})"
            ) from None
        check_tensors(obj, self.path)
        return obj

    def _index(self, size: int) -> tuple[Records, str]:
        """Map each zip member to (data offset, length); members are stored uncompressed by torch."""
        assert self._mm is not None
        return zip_records(self.path, self._mm, size)

    def _unpickle(self, records: Records, pickle_name: str, like: _Template | None, remember: bool) -> Any:
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
        self.repeats = obj is not None
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
                if remember:  # the optim files of a save name DeepSpeed's classes and repeat each other too
                    self._template = _Template(data, tuple(s[3] for s in sizes), _keys(sizes), obj)
        for key, raw, nbytes, _ in sizes:
            if raw.nbytes() != nbytes:  # the empty storages are one (storage_loader): which key grew it is unknown
                which = f"storage {key} ({nbytes} bytes)" if nbytes else "an empty storage"
                raise CorruptFileError(f"{self.path}: a tensor reaches past the end of {which}; the file is corrupt")
        if not self.repeats:
            # a re-bound tree has the checked tree's every tensor (shape, stride, offset) over storages of the sizes
            # the same pickle declares, just checked above: the same check would give the same answer (it was a
            # third of opening a DP 4096 save)
            check_tensors(obj, self.path)
        return obj

    def _rebound(self, like: _Template, data: bytes, records: Records, prefix: str) -> tuple[Any, list[Handed]]:
        """The tree of a pickle identical to ``like``'s, re-bound onto this file's storages; (None, [])
        when that fails in any way, so that unpickling it reports the failure in its own words."""
        load_storage, sizes = self._storage_loader(records, prefix)
        try:
            if self._keep is not None and isinstance(like.obj, dict):
                # only the kept keys, and only the storages they reach (load_storage checks each as it comes)
                ids = {saved_id[2]: saved_id for saved_id in like.saved_ids}
                kept = type(like.obj)((key, like.obj[key]) for key in self._keep if key in like.obj)
                obj = rebind(kept, lambda cdata: load_storage(ids[like.keys[cdata]]))
            else:
                # every storage the unpickler would ask for, in its order: the same checks, the same first error
                by_key = {saved_id[2]: load_storage(saved_id) for saved_id in like.saved_ids}
                obj = rebind(like.obj, lambda cdata: by_key[like.keys[cdata]])
        except Exception as why:  # noqa: BLE001 - any failure: read this file the ordinary way
            logger.debug("%s: not re-bound from the rank before (%s)", self.path, one_line(why, 120))
            return None, []
        self._template = _Template(data, like.saved_ids, _keys(sizes), obj)  # only open_all passes a like
        return obj, sizes

    def _storage_loader(
        self, records: Records, prefix: str
    ) -> tuple[Callable[[Any], torch.storage.TypedStorage], list[Handed]]:
        """The unpickler's ``persistent_load`` over this file's mapping, and the storages it hands out
        (:func:`~ucp.io.zip_records.storage_loader`)."""
        assert self._mm is not None
        return storage_loader(self.path, self._mm, records, prefix)

    def _unpickle_full(self, data: bytes, persistent_load: Callable[[Any], Any]) -> Any:
        """The allow-list scan, then torch's weights_only unpickler with the stand-ins allowed."""
        from torch import _weights_only_unpickler

        stream = io.BytesIO(data)
        check_globals(stream, self.path, extra=self._extra_names())
        stream.seek(0)
        unpickler = _weights_only_unpickler.Unpickler(stream, encoding="utf-8")
        unpickler.persistent_load = persistent_load  # type: ignore[method-assign]  # pickle's documented hook
        try:
            with ALLOW_LOCK, self._globals():
                return unpickler.load()
        except (UnsafeFileError, CorruptFileError):
            raise
        except pickle.UnpicklingError as err:
            raise refusal(err, self.path) from None
        except Exception as err:  # a hostile or damaged pickle can fail in many ways
            raise CorruptFileError(
                f"{self.path} could not be unpickled: {type(err).__name__}: {one_line(err, 160)}"
            ) from None

    def _extra_names(self) -> frozenset[str]:
        return frozenset(name for _, name in self._allow)

    def _globals(self) -> AbstractContextManager[Any]:
        """torch's weights_only unpickler sees the stand-ins; with ``allow``, those alone: torch keeps one process-wide
        set, and a module imported earlier (``torch.distributed.tensor`` adds the real DTensor classes) would else
        give its own class for a name a stand-in answers (torch 2.13 resolves a clash by set order)."""
        if not self._allow:
            return torch.serialization.safe_globals(SAFE_GLOBALS)
        return only_globals([*SAFE_GLOBALS, *self._allow])

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

    def _drop_pages(self) -> None:
        """Unmap the pages that indexing and unpickling touched (the zip headers, one per tensor, and the pickle):
        with fault-around they are most of a small rank file, and a save of 8192 such files would otherwise keep
        its metadata's every page in this process's RSS. They are read again from the page cache if touched."""
        if self._mm is not None and len(self._mm):
            try:
                self._mm.madvise(mmap.MADV_DONTNEED)
            except (OSError, ValueError):  # advisory only
                pass

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
