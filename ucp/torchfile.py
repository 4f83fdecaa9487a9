"""Reading and writing torch checkpoint files safely, without importing DeepSpeed.

Reading: every file is unpickled by torch's weights_only unpickler; the few DeepSpeed classes that
appear in ZeRO checkpoints map to inert stand-ins defined here, and any other global is refused
with one line naming it. Tensors of a zip-format file are views on a private read-only mmap, so
opening a shard costs no copy and :meth:`TorchFile.release` hands pages back once a parameter is
done (memory stays bounded by what is being assembled, not by the checkpoint).

Writing: :func:`save` pickles the stand-ins under DeepSpeed's own class names, so a native
checkpoint written here loads into stock DeepSpeed exactly like one DeepSpeed wrote.
"""

from __future__ import annotations

import io
import logging
import mmap
import os
import pickle
import re
import struct
import threading
import zipfile
from pathlib import Path
from typing import Any

import torch

from ucp.errors import CorruptFileError, UnsafeFileError

__all__ = [
    "DSObject",
    "DSEnum",
    "LossScaler",
    "DynamicLossScaler",
    "ZeroStageEnum",
    "FragmentAddress",
    "Namespace",
    "TorchFile",
    "load",
    "save",
]

logger = logging.getLogger(__name__)


class DSEnum(int):
    """An int standing in for a DeepSpeed enum member; pickles back as ``<ds_name>(value)``."""

    ds_name = ""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({int(self)})"


class ZeroStageEnum(DSEnum):
    ds_name = "deepspeed.runtime.zero.config.ZeroStageEnum"


class DSObject:
    """A plain attribute bag standing in for a DeepSpeed object; pickles back under ``ds_name``."""

    ds_name = ""

    def __init__(self, **state: Any) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__})"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.__dict__ == other.__dict__


class LossScaler(DSObject):
    ds_name = "deepspeed.runtime.fp16.loss_scaler.LossScaler"


class DynamicLossScaler(DSObject):
    ds_name = "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"


class FragmentAddress(DSObject):
    ds_name = "deepspeed.utils.tensor_fragment.fragment_address"


class Namespace(DSObject):
    """Megatron-DeepSpeed stores its argparse namespace in model states."""

    ds_name = "argparse.Namespace"


_STANDINS: tuple[type, ...] = (ZeroStageEnum, LossScaler, DynamicLossScaler, FragmentAddress, Namespace)
_SAFE_GLOBALS = [(cls, cls.ds_name) for cls in _STANDINS]
# torch keeps its allow-list in one process-wide set; the lock keeps our additions scoped to our loads.
_ALLOW_LOCK = threading.Lock()
_UNSUPPORTED = re.compile(r"(?:Unsupported global: GLOBAL|unrecognized function|Unsupported class)\s+([\w.<>]+)")


def _refusal(err: Exception, path: Path) -> Exception:
    text = str(err)
    match = _UNSUPPORTED.search(text)
    if match:
        return UnsafeFileError(
            f"{path.name} refers to {match.group(1)}, which is not on ucp's allow-list; refusing to load it"
        )
    first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
    return CorruptFileError(f"{path} could not be unpickled: {first}")


def load(path: str | os.PathLike) -> Any:
    """Load a whole (small) torch file into memory, weights_only, with the DeepSpeed stand-ins."""
    with TorchFile(path) as tf:
        return _detach(tf.obj)


def _detach(obj: Any) -> Any:
    """Copy tensors out of a TorchFile's mmap so they outlive it."""
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
    return obj


class TorchFile:
    """A torch checkpoint opened read-only, its tensors zero-copy views on a private mmap.

    Call order: open (unpickles the small object tree), use ``obj``, call :meth:`release` on big
    tensors once their bytes have been consumed, then :meth:`close` (or use ``with``). Legacy
    (non-zip) files are loaded eagerly instead.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._mm: mmap.mmap | None = None
        self._base = 0
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            raise CorruptFileError(f"{self.path} does not exist") from None
        if size == 0:
            raise CorruptFileError(f"{self.path} is empty")
        if not zipfile.is_zipfile(self.path):
            self.obj = self._load_legacy()
            return
        with open(self.path, "rb") as handle:
            self._mm = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
        self._storage = torch.frombuffer(self._mm, dtype=torch.uint8).untyped_storage()
        self._base = self._storage.data_ptr()
        try:
            records, pickle_name = self._index(size)
            self.obj = self._unpickle(records, pickle_name)
        except (UnsafeFileError, CorruptFileError):
            self.close()
            raise

    def _load_legacy(self) -> Any:
        try:
            with _ALLOW_LOCK, torch.serialization.safe_globals(_SAFE_GLOBALS):
                return torch.load(self.path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            raise _refusal(err, self.path) from None
        except Exception as err:  # torch raises many types for a broken file
            raise CorruptFileError(f"{self.path} is not a readable torch file ({type(err).__name__})") from None

    def _index(self, size: int) -> tuple[dict[str, tuple[int, int]], str]:
        """Map each zip member to (data offset, length); members are stored uncompressed by torch."""
        try:
            with zipfile.ZipFile(self.path) as zf:
                infos = zf.infolist()
        except (zipfile.BadZipFile, OSError) as err:
            raise CorruptFileError(f"{self.path} is truncated or corrupt: {err}") from None
        records: dict[str, tuple[int, int]] = {}
        pickle_name = ""
        for info in infos:
            if info.compress_type != zipfile.ZIP_STORED:
                raise CorruptFileError(f"{self.path}: member {info.filename} is compressed; not a torch.save file")
            head = info.header_offset
            if head + 30 > size or self._mm[head : head + 4] != b"PK\x03\x04":
                raise CorruptFileError(f"{self.path} is truncated or corrupt: bad local header for {info.filename}")
            name_len, extra_len = struct.unpack("<HH", self._mm[head + 26 : head + 30])
            start = head + 30 + name_len + extra_len
            if start + info.file_size > size:
                raise CorruptFileError(f"{self.path} is truncated: {info.filename} runs past the end of the file")
            records[info.filename] = (start, info.file_size)
            if info.filename.endswith("/data.pkl") and info.filename.count("/") == 1:
                pickle_name = info.filename
        if not pickle_name:
            raise CorruptFileError(f"{self.path} has no data.pkl; not a torch.save file")
        prefix = pickle_name[: -len("data.pkl")]
        order = records.get(prefix + "byteorder")
        if order is not None and bytes(self._mm[order[0] : order[0] + order[1]]) != b"little":
            raise CorruptFileError(f"{self.path} was written big-endian; ucp reads little-endian files only")
        return records, pickle_name

    def _unpickle(self, records: dict[str, tuple[int, int]], pickle_name: str) -> Any:
        from torch import _weights_only_unpickler

        prefix = pickle_name[: -len("data.pkl")]
        start, length = records[pickle_name]
        storages: dict[str, torch.storage.TypedStorage] = {}

        def persistent_load(saved_id: tuple) -> torch.storage.TypedStorage:
            if not isinstance(saved_id, tuple) or len(saved_id) != 5 or saved_id[0] != "storage":
                raise CorruptFileError(f"{self.path}: unexpected persistent id {saved_id!r:.80}")
            _, storage_type, key, _location, numel = saved_id
            dtype = getattr(storage_type, "dtype", torch.uint8)
            if key in storages:
                return storages[key]
            record = records.get(f"{prefix}data/{key}")
            if record is None:
                raise CorruptFileError(f"{self.path}: storage {key} is missing from the archive")
            nbytes = int(numel) * torch.empty((), dtype=dtype).element_size()
            if nbytes > record[1]:
                raise CorruptFileError(f"{self.path}: storage {key} holds {record[1]} bytes, needs {nbytes}")
            # slicing an UntypedStorage shares its memory (torch's own mmap loader does the same)
            raw = self._storage[record[0] : record[0] + nbytes] if nbytes else torch.UntypedStorage(0)
            typed = torch.storage.TypedStorage(wrap_storage=raw, dtype=dtype, _internal=True)
            storages[key] = typed
            return typed

        unpickler = _weights_only_unpickler.Unpickler(io.BytesIO(self._mm[start : start + length]), encoding="utf-8")
        unpickler.persistent_load = persistent_load
        try:
            with _ALLOW_LOCK, torch.serialization.safe_globals(_SAFE_GLOBALS):
                return unpickler.load()
        except (UnsafeFileError, CorruptFileError):
            raise
        except pickle.UnpicklingError as err:
            raise _refusal(err, self.path) from None
        except Exception as err:  # a hostile or damaged pickle can fail in many ways
            raise CorruptFileError(f"{self.path} could not be unpickled: {type(err).__name__}: {err}"[:300]) from None

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

    def close(self) -> None:
        self.obj = None
        self._storage = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # tensors still reference the mapping; it goes when they do
                pass
            self._mm = None

    def __enter__(self) -> "TorchFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _GlobalRef:
    """A dotted name pickled as a GLOBAL opcode, so no module needs importing to write it."""

    def __init__(self, dotted: str) -> None:
        self.module, _, self.name = dotted.rpartition(".")


class _Pickler(pickle._Pickler):  # type: ignore[misc,name-defined]
    """The pure-Python pickler, taught to write the stand-ins under DeepSpeed's names."""

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:  # noqa: D401
        if isinstance(obj, _GlobalRef):
            self.write(pickle.GLOBAL + obj.module.encode() + b"\n" + obj.name.encode() + b"\n")
        elif isinstance(obj, DSEnum):
            self.save(_GlobalRef(obj.ds_name))
            self.save((int(obj),))
            self.write(pickle.REDUCE)
        elif isinstance(obj, DSObject):
            self.save(_GlobalRef(obj.ds_name))
            self.save(())
            self.write(pickle.NEWOBJ)
            self.save(dict(obj.__dict__))
            self.write(pickle.BUILD)
        else:
            super().save(obj, save_persistent_id)


class _PickleModule:
    """What torch.save needs of a pickle module."""

    Pickler = _Pickler
    Unpickler = pickle.Unpickler
    __name__ = "ucp.torchfile"


def save(obj: Any, path: str | os.PathLike) -> None:
    """torch.save ``obj`` to ``path``, writing stand-ins as the DeepSpeed classes they stand for."""
    torch.save(obj, path, pickle_module=_PickleModule)  # type: ignore[arg-type]
