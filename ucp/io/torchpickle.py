"""Pickling objects the way torch.save does, for ucp's one torch-zip writer (:mod:`ucp.io.torchzip`).

A tensor pickles as torch.save pickles it: a ``_rebuild_tensor_v2`` call over a persistent storage
id, the storage's bytes kept aside as a record (from the tensor's memory, from :class:`Pieces` of
files, converted chunk by chunk from them by a :class:`Cast`, or made late by a :class:`LazyTensor`) for the zip
writer to stream, or left for a caller to fill (:class:`Reserved`). DeepSpeed stand-ins
(:mod:`ucp.io.standins`) pickle under DeepSpeed's own class names, so a file loads into stock
DeepSpeed exactly like one DeepSpeed wrote. The C pickler does the work (a model-states file is
thousands of small objects); the pure-Python one, which writes DeepSpeed's names directly, takes
over when the C pickler's renaming cannot be trusted.
"""

from __future__ import annotations

import copyreg
import io
import pickle
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ucp.io.standins import DSEnum, DSObject, DSStrEnum
from ucp.model.pieces import Cast, FileSpan, LazyTensor, PathSpan, Pieces, Placeholder, Reserved, part_numel

__all__ = [
    "Chunk",
    "Pickled",
    "STREAMED",
    "Stored",
    "StorageRef",
    "UnsharedDict",
    "WrapperTensor",
    "data_pickle",
    "pickle_object",
    "tensor_bytes",
]


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A tensor's bytes as written: row-major, contiguous, on the CPU (a view when it already is)."""
    flat = tensor.detach()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]  # ndarray is a buffer


#: one piece of a record's bytes: in memory, spans of files, or a tensor made when the writer reaches it
Chunk = memoryview | bytes | FileSpan | PathSpan | LazyTensor | Cast
#: what a storage record holds: its chunks, or one :class:`Reserved` for its writer's caller to fill
Stored = Chunk | Reserved
#: the chunks the zip writer streams (their CRC known only once written)
STREAMED = (FileSpan, PathSpan, LazyTensor, Cast)
#: an object as :func:`pickle_object` returns it: its data.pkl and each storage's record
Pickled = tuple[bytes, list[tuple[str, Sequence[Stored]]]]


class _Tensors:
    """What both picklers share: tensors pickled the way torch.save does, a rebuild call over a
    persistent storage id, with each storage's bytes (in pieces) kept as a record to write."""

    records: list[tuple[str, Sequence[Stored]]]

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, StorageRef):
            key = str(len(self.records))
            self.records.append((key, obj.data))
            return ("storage", obj.storage_type, key, "cpu", obj.numel)
        return None

    fast: bool  # both picklers': no memo while set

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, UnsharedDict):
            return OrderedDict, (), None, None, self._unmemoized(iter(obj.items()))
        if isinstance(obj, WrapperTensor):
            return obj.reduce()
        if isinstance(obj, Placeholder):
            # no bytes, and a shape tuple of its own, as a tensor's (a shared one would pickle as a memo reference)
            return _rebuild(StorageRef(_storage_type(obj.dtype), (), 0), tuple([0]))
        if isinstance(obj, (LazyTensor, Cast, Reserved)):
            numel = obj.nbytes // obj.dtype.itemsize
            return _rebuild(StorageRef(_storage_type(obj.dtype), [obj] if numel else [], numel), obj.shape)
        if isinstance(obj, torch.Tensor):  # written from its own memory; no Pieces to build and check
            return _rebuild(StorageRef(_storage_type(obj.dtype), _chunks(obj), obj.numel()), tuple(obj.shape))
        if isinstance(obj, Pieces):
            return _rebuild(StorageRef(_storage_type(obj.dtype), _chunks(obj), obj.numel), obj.shape)
        return NotImplemented

    def _unmemoized(self, items: Iterator[tuple[Any, Any]]) -> Iterator[tuple[Any, Any]]:
        """An :class:`UnsharedDict`'s entries for the C pickler, its memo off for all but the first two and back on
        once the entries run out. The C pickler fetches one entry ahead: it saves the first two before it asks for
        the third, so the globals and strings every entry repeats are memoized once and referred to after, and it
        saves all but perhaps the last before the entries run out. Only the file's size depends on that order:
        an entry saved with the memo on or off loads the same."""
        before = self.fast
        try:
            for i, item in enumerate(items):
                if i == 2:
                    self.fast = True
                yield item
        finally:
            self.fast = before


_NEWOBJ = copyreg.__newobj__  # type: ignore[attr-defined]  # protocol 2 NEWOBJ; the stubs leave it out


class _FastPickler(_Tensors, pickle.Pickler):
    """The C pickler. A DeepSpeed stand-in pickles under its own importable name in
    ``ucp.io.standins``; :func:`_pickle` then renames those globals to DeepSpeed's. Protocol 2 has
    no frames or offsets, so renaming a GLOBAL opcode's text is safe once each is known to occur
    exactly where the pickler put it."""

    def __init__(self, buffer: io.BytesIO) -> None:
        super().__init__(buffer, protocol=2)
        self.records = []
        self.used: set[type] = set()

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (DSEnum, DSStrEnum)):
            self.used.add(type(obj))
            return (type(obj), (int(obj) if isinstance(obj, DSEnum) else str(obj),))
        if isinstance(obj, DSObject):
            self.used.add(type(obj))
            return (_NEWOBJ, (type(obj),), dict(obj.__dict__))
        return super().reducer_override(obj)


# The pure-Python pickler: its save() is a hook for writing DeepSpeed's globals directly (the C one has
# none); the stubs leave it out, hence getattr. Used when the C pickler's renaming cannot be trusted.
_PyPickler: Any = pickle._Pickler


class _Pickler(_Tensors, _PyPickler):
    """The pure-Python pickler, DeepSpeed's globals written as GLOBAL opcodes of their own names."""

    def __init__(self, buffer: io.BytesIO) -> None:
        super().__init__(buffer, protocol=2)
        self.records = []

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        if isinstance(obj, UnsharedDict):  # this pickler fetches entries a batch ahead: the memo off around them all
            before, self.fast = self.fast, True
            try:
                self.save_reduce(OrderedDict, (), None, None, iter(obj.items()), obj=obj)
            finally:
                self.fast = before
        elif isinstance(obj, _GlobalRef):
            self.write(pickle.GLOBAL + obj.module.encode() + b"\n" + obj.name.encode() + b"\n")
        elif isinstance(obj, (DSEnum, DSStrEnum)):
            self.save(_GlobalRef(obj.ds_name))
            self.save((int(obj) if isinstance(obj, DSEnum) else str(obj),))
            self.write(pickle.REDUCE)
        elif isinstance(obj, DSObject):
            self.save(_GlobalRef(obj.ds_name))
            self.save(())
            self.write(pickle.NEWOBJ)
            self.save(dict(obj.__dict__))
            self.write(pickle.BUILD)
        else:
            super().save(obj, save_persistent_id)


_STANDIN_MODULE = DSObject.__module__.encode()


#: data.pkl of ``{key: one tensor}`` (or of a bare tensor: key None) by (key, shape, dtype): it holds no values,
#: and a universal directory writes one such file per parameter and state key, and a step.pt per parameter
#: (5 x 10^5 of them for a MoE)
_SINGLE: dict[tuple[str | None, tuple[int, ...], torch.dtype], bytes] = {}
_SINGLE_MAX = 4096


def pickle_object(obj: Any) -> tuple[bytes, list[tuple[str, Sequence[Stored]]]]:
    """``obj``'s data.pkl and its storage records: the C pickler (tens of times faster on a
    model-states file's thousands of small objects), or the pure-Python one when a stand-in's
    name also turns up somewhere a GLOBAL opcode did not put it. A dict of one tensor (or
    :class:`Pieces`) under a string key, or a bare tensor, reuses the pickle of an earlier one of its shape."""
    single = _single_tensor(obj)
    if single is None:
        return _pickle_any(obj)
    known = _SINGLE.get(single)
    if known is not None:
        value = obj if single[0] is None else next(iter(obj.values()))
        return known, [("0", _chunks(value))]
    data, records = _pickle_any(obj)
    if len(_SINGLE) >= _SINGLE_MAX:
        _SINGLE.clear()
    _SINGLE[single] = data
    return data, records


def _single_tensor(obj: Any) -> tuple[str | None, tuple[int, ...], torch.dtype] | None:
    """(key, shape, dtype) of ``{key: tensor or Pieces}``, or (None, shape, dtype) of a plain tensor, whose data.pkl
    depends on nothing else; else None."""
    if type(obj) is torch.Tensor:
        return None, tuple(obj.shape), obj.dtype
    if type(obj) is not dict or len(obj) != 1:
        return None
    key, value = next(iter(obj.items()))
    if type(key) is not str or type(value) not in (torch.Tensor, Pieces):
        return None
    return key, tuple(value.shape), value.dtype


def _chunks(value: torch.Tensor | Pieces) -> list[Chunk]:
    """The record's bytes of a tensor or :class:`Pieces`, as the reducer hands them to the writer."""
    if isinstance(value, Pieces):
        item = value.dtype.itemsize
        return [
            p if isinstance(p, (FileSpan, PathSpan)) else tensor_bytes(p) for p in value.parts if part_numel(p, item)
        ]
    return [tensor_bytes(value.detach())] if value.numel() else []


def _pickle_any(obj: Any) -> tuple[bytes, list[tuple[str, Sequence[Stored]]]]:
    buffer = io.BytesIO()
    fast = _FastPickler(buffer)
    fast.dump(obj)
    data = buffer.getvalue()
    trusted = True
    for cls in fast.used:
        ours = pickle.GLOBAL + f"{cls.__module__}\n{cls.__qualname__}\n".encode()
        module, _, name = cls.ds_name.rpartition(".")  # type: ignore[attr-defined]  # every stand-in has one
        trusted = trusted and data.count(ours) == 1
        data = data.replace(ours, pickle.GLOBAL + f"{module}\n{name}\n".encode())
    if trusted and _STANDIN_MODULE not in data:
        return data, fast.records
    buffer = io.BytesIO()
    slow = _Pickler(buffer)
    slow.dump(obj)
    return buffer.getvalue(), slow.records


class _GlobalRef:
    """A dotted name pickled as a GLOBAL opcode, so no module needs importing to write it."""

    def __init__(self, dotted: str) -> None:
        self.module, _, self.name = dotted.rpartition(".")


def _rebuild(ref: StorageRef, shape: tuple[int, ...]) -> tuple[Any, tuple]:
    """What torch.save pickles for a contiguous tensor over a whole storage."""
    return (torch._utils._rebuild_tensor_v2, (ref, 0, shape, _contiguous_strides(shape), False, _ordered_dict()))


def _storage_type(dtype: torch.dtype) -> Any:
    return getattr(torch, _storage_type_name(dtype))


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """What ``torch.empty(shape).stride()`` gives (a size-0 dim counts as 1, as in c10)."""
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


class _NoHooks:
    """The empty ``OrderedDict`` of backward hooks torch.save pickles with every tensor, pickled exactly as one but
    smaller: the pickler's memo keeps each alive until the whole object is pickled (10^5 for a MoE's model-states
    file; an OrderedDict is 128 bytes)."""

    __slots__ = ()

    def __reduce__(self) -> tuple[Any, tuple]:
        return OrderedDict, ()


def _ordered_dict() -> Any:
    return _NoHooks()


_STORAGE_TYPES = {
    torch.float32: "FloatStorage",
    torch.bfloat16: "BFloat16Storage",
    torch.float16: "HalfStorage",
    torch.float64: "DoubleStorage",
    torch.int64: "LongStorage",
    torch.int32: "IntStorage",
    torch.int16: "ShortStorage",
    torch.int8: "CharStorage",
    torch.uint8: "ByteStorage",
    torch.bool: "BoolStorage",
}


def _storage_type_name(dtype: torch.dtype) -> str:
    try:
        return _STORAGE_TYPES[dtype]
    except KeyError:
        raise TypeError(f"cannot write tensors of dtype {dtype}") from None


@dataclass(frozen=True)
class WrapperTensor:
    """A tensor subclass pickled as ``torch.save`` pickles a storage-less wrapper (a ``DTensor``): a call of
    ``_rebuild_from_type_v2(_rebuild_wrapper_subclass, cls, (cls, dtype, shape, stride, 0, strided, cpu, False),
    state)``, ``state`` its fields (a ``DTensor``'s ``_local_tensor``, which may be a :class:`LazyTensor`, and
    ``_spec``). Only the written file holds the object: no instance of ``cls`` is made here."""

    cls: type
    shape: tuple[int, ...]
    dtype: torch.dtype
    state: dict[str, Any]

    def reduce(self) -> tuple[Any, tuple[Any, ...]]:
        stride = _contiguous_strides(self.shape)
        args = (self.cls, self.dtype, self.shape, stride, 0, torch.strided, torch.device("cpu"), False)
        return torch._tensor._rebuild_from_type_v2, (torch._utils._rebuild_wrapper_subclass, self.cls, args, self.state)


class UnsharedDict(OrderedDict):
    """An OrderedDict pickled as one, but without the pickler's memo: nothing in it is shared with, or refers
    to, anything else of the object. A pickler's memo keeps every object it wrote alive until the whole
    object is written, about 700 bytes for each empty tensor of a ZeRO-3 model-states file (70 MB for a MoE of
    10^5 parameters); here each entry is dropped once written. An object met twice inside it may be written
    twice, and then loads as two."""


@dataclass(slots=True)
class StorageRef:
    storage_type: Any
    data: Sequence[Stored]  # the record's bytes, in pieces
    numel: int


def data_pickle(obj: Any) -> bytes:
    """The ``data.pkl`` record :func:`write_torch_file` writes for ``obj``: it depends on the tensors'
    shapes and dtypes, never their values, so a reader can recognise a file of a known layout by it."""
    return pickle_object(obj)[0]
