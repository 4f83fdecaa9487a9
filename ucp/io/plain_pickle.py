"""A one-pass reader for the pickles that hold only plain metadata: dicts, lists, numbers, strings, tensors.

Most pickles ucp opens are of this kind (a ZeRO-3 model-states file is ~15k opcodes of module dict,
shapes and counters, repeated on every rank). torch's weights_only unpickler reads them in pure Python
with an if/elif chain per opcode, after ucp's own allow-list scan has walked the same bytes once
already; this reader does both in one pass, about four times faster.

It is a strict subset of torch's weights_only unpickler (torch 2.13, ``torch/_weights_only_unpickler.py``):
the same opcodes with the same meaning and checks, and only these globals: ``collections.OrderedDict``,
``torch.Size``, ``torch._utils._rebuild_tensor_v2`` and the typed storage classes. Whatever it does not
take (another global or opcode, a damaged stream, any error at all) raises :class:`NotPlain`, and the
caller reads the file the full way, which then accepts or refuses it exactly as before. So a pickle
read here yields what the full path would have yielded, and nothing off the allow-list is ever called.
"""

from __future__ import annotations

import _compat_pickle
import functools
import pickle
import struct
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from ucp.io.standins import DSEnum, DSObject, DSStrEnum

__all__ = ["NotPlain", "load_plain", "rebind"]

_UNPACK = struct.unpack_from
# what a plain pickle builds that is immutable and so shared, not copied, by rebind()
_IMMUTABLE = frozenset({str, int, float, bool, type(None), torch.Size})
_BUILDING = object()  # rebind()'s mark for a tuple whose items are being copied
_SPENT = object()  # _run's memo entry for a call's arguments once the call is made (a GET of one: not plain)
_LOOK_BACK = 8  # memo entries searched for a call's spent arguments
# opcodes as ints, the order of the dispatch below (most frequent first in DeepSpeed's files)
(
    _LONG_BINPUT,
    _BININT1,
    _BINGET,
    _BINUNICODE,
    _TUPLE1,
    _REDUCE,
    _MARK,
    _TUPLE,
    _LONG_BINGET,
    _BININT2,
    _EMPTY_TUPLE,
    _EMPTY_DICT,
    _NEWFALSE,
    _BINPERSID,
    _SETITEM,
    _BINPUT,
    _TUPLE2,
    _SETITEMS,
    _GLOBAL,
    _EMPTY_LIST,
    _NONE,
    _APPENDS,
    _BINFLOAT,
    _BININT,
    _NEWTRUE,
    _BUILD,
    _APPEND,
    _TUPLE3,
    _LONG1,
    _SHORT_BINSTRING,
    _EMPTY_SET,
    _PROTO,
    _STOP,
) = (
    op[0]
    for op in (
        pickle.LONG_BINPUT,
        pickle.BININT1,
        pickle.BINGET,
        pickle.BINUNICODE,
        pickle.TUPLE1,
        pickle.REDUCE,
        pickle.MARK,
        pickle.TUPLE,
        pickle.LONG_BINGET,
        pickle.BININT2,
        pickle.EMPTY_TUPLE,
        pickle.EMPTY_DICT,
        pickle.NEWFALSE,
        pickle.BINPERSID,
        pickle.SETITEM,
        pickle.BINPUT,
        pickle.TUPLE2,
        pickle.SETITEMS,
        pickle.GLOBAL,
        pickle.EMPTY_LIST,
        pickle.NONE,
        pickle.APPENDS,
        pickle.BINFLOAT,
        pickle.BININT,
        pickle.NEWTRUE,
        pickle.BUILD,
        pickle.APPEND,
        pickle.TUPLE3,
        pickle.LONG1,
        pickle.SHORT_BINSTRING,
        pickle.EMPTY_SET,
        pickle.PROTO,
        pickle.STOP,
    )
)


class NotPlain(Exception):
    """The pickle needs more than this reader offers (or is damaged); read it the full way."""


@functools.cache
def _plain_globals() -> dict[str, Any]:
    """The globals this reader resolves, each the very object torch's weights_only unpickler would give."""
    from torch import _weights_only_unpickler

    allowed = _weights_only_unpickler._get_allowed_globals()
    names = ["collections.OrderedDict", "torch.Size", "torch._utils._rebuild_tensor_v2"]
    names += [n for n in allowed if n.startswith("torch.") and n.count(".") == 1 and n.endswith("Storage")]
    return {n: allowed[n] for n in names if n in allowed}


#: the empty tensors one load made, by (storage, size, stride, requires_grad): see :func:`_rebuild_tensor_v2`
Empties = dict[tuple[int, Any, Any, bool], torch.Tensor]


def _rebuild_tensor_v2(
    empties: Empties,
    storage: Any,
    offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any,
    hooks: Any,
    metadata: Any = None,
) -> torch.Tensor:
    """torch._utils._rebuild_tensor_v2 for a CPU storage without tensor metadata, minus its per-tensor
    ``detect_fake_mode`` lookup (ucp never loads under a fake mode); anything else is not plain.

    An empty tensor over an empty storage, without hooks, is made once per load and shared by every entry
    alike: a ZeRO-3 model-states file holds one such placeholder per parameter, 10^5 of them (each with its
    own empty storage, which :func:`~ucp.io.zip_records.storage_loader` shares too) for a MoE, about 1.7 KB of
    tensor, storage and hooks each. Nothing can be written into an empty tensor, and ucp never resizes one."""
    if type(storage) is not torch.storage.TypedStorage or metadata:
        raise NotPlain("a tensor with metadata or without a plain storage")
    raw = storage._untyped_storage  # what torch._utils._rebuild_tensor reads (untyped() warns)
    if hooks or offset != 0 or raw.nbytes() != 0 or 0 not in size or type(requires_grad) is not bool:
        return _tensor(raw, storage.dtype, offset, size, stride, requires_grad, hooks)
    key = (raw._cdata, tuple(size), tuple(stride), requires_grad)
    shared = empties.get(key)
    if shared is None:
        shared = empties[key] = _tensor(raw, storage.dtype, 0, size, stride, requires_grad, hooks)
    return shared


def _tensor(
    raw: torch.UntypedStorage, dtype: torch.dtype, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any
) -> torch.Tensor:
    tensor = torch.empty((0,), dtype=dtype, device=raw.device).set_(raw, offset, size, stride)
    tensor.requires_grad = requires_grad
    tensor._backward_hooks = hooks  # as torch does: always an empty OrderedDict in files torch.save wrote
    return tensor


def _global(data: bytes, pos: int) -> tuple[Any, int]:
    """GLOBAL's two newline-ended lines, resolved as torch's ``_read_global_instruction`` names them."""
    mid = data.index(b"\n", pos)
    end = data.index(b"\n", mid + 1)
    module, name = data[pos:mid].decode("utf-8"), data[mid + 1 : end].decode("utf-8")
    if (module, name) in _compat_pickle.NAME_MAPPING:
        module, name = _compat_pickle.NAME_MAPPING[(module, name)]
    elif module in _compat_pickle.IMPORT_MAPPING:
        module = _compat_pickle.IMPORT_MAPPING[module]
    found = _plain_globals().get(f"{module}.{name}")
    if found is None:
        raise NotPlain(f"global {module}.{name}")
    return found, end + 1


def _reduce(func: Any, args: Any, empties: Empties) -> Any:
    """REDUCE for the three callables this reader resolves (storage classes are not called)."""
    if func is OrderedDict or func is torch.Size:
        return func(*args)
    if func is torch._utils._rebuild_tensor_v2:
        return _rebuild_tensor_v2(empties, *args)
    raise NotPlain(f"a call to {type(func).__name__}")


def _build(inst: Any, state: Any, empties: Empties) -> None:
    """BUILD as weights_only does it for the two types a plain pickle can build (not onto a shared empty tensor:
    that would change every entry that shares it)."""
    if type(inst) is torch.Tensor:
        if any(inst is shared for shared in empties.values()):
            raise NotPlain("BUILD of a shared empty tensor")
        inst.set_(*state)
    elif type(inst) is OrderedDict:
        inst.__dict__.update(state)  # a state_dict's _metadata
    else:
        raise NotPlain(f"BUILD of a {type(inst).__name__}")


def _check_set_item_target(target: Any) -> None:
    if type(target) is not dict and type(target) is not OrderedDict:
        raise NotPlain(f"SETITEM on a {type(target).__name__}")


def load_plain(data: bytes, persistent_load: Callable[[Any], Any]) -> Any:
    """The object a protocol-2 pickle of plain metadata holds; :class:`NotPlain` for any other pickle.

    ``persistent_load`` is the same hook the full path hands torch's unpickler. Any failure, a damaged
    stream included, is :class:`NotPlain`: the full path then reports it in its own words.
    """
    try:
        return _run(data, persistent_load)
    except NotPlain:
        raise
    except Exception as err:  # a damaged stream fails here in many ways; the full path names it
        raise NotPlain(f"{type(err).__name__}: {err}") from None


def _run(data: bytes, persistent_load: Callable[[Any], Any]) -> Any:
    """The opcode loop: weights_only's semantics, dispatched by frequency, on ``data`` in place (the less
    frequent half of the opcodes in :func:`_less_frequent`)."""
    if data[:2] != b"\x80\x02":  # torch.save's protocol; weights_only warns about any other
        raise NotPlain("not protocol 2")
    stack: list[Any] = []
    marks: list[list[Any]] = []
    # a pickler numbers its memo 0, 1, 2...: a list, where a dict of 10^6 ints cost 80 MB (a ZeRO-3 model-states
    # file of 10^5 placeholders memoizes every string, tuple and tensor); a number out of that order goes to ``sparse``
    memo: list[Any] = []
    sparse: dict[int, Any] = {}
    empties: Empties = {}
    pos = 2
    while True:
        op = data[pos]
        pos += 1
        if op == _LONG_BINPUT:
            i = _UNPACK("<I", data, pos)[0]
            if i == len(memo):
                memo.append(stack[-1])
            else:
                _put(memo, sparse, i, stack[-1])
            pos += 4
        elif op == _BININT1:
            stack.append(data[pos])
            pos += 1
        elif op == _BINGET:
            i = data[pos]
            found = memo[i] if i < len(memo) else sparse[i]
            if found is _SPENT:
                raise NotPlain("a call's arguments fetched again")
            stack.append(found)
            pos += 1
        elif op == _BINUNICODE:
            n = _UNPACK("<I", data, pos)[0]
            stack.append(str(data[pos + 4 : pos + 4 + n], "utf-8", "surrogatepass"))
            pos += 4 + n
        elif op == _TUPLE1:
            stack[-1] = (stack[-1],)
        elif op == _REDUCE:
            args = stack.pop()
            stack[-1] = _reduce(stack[-1], args, empties)
            _spend(memo, args)
        elif op == _MARK:
            marks.append(stack)
            stack = []
        elif op == _TUPLE:
            items, stack = stack, marks.pop()
            stack.append(tuple(items))
        elif op == _LONG_BINGET:
            i = _UNPACK("<I", data, pos)[0]
            found = memo[i] if i < len(memo) else sparse[i]
            if found is _SPENT:
                raise NotPlain("a call's arguments fetched again")
            stack.append(found)
            pos += 4
        elif op == _BININT2:
            stack.append(_UNPACK("<H", data, pos)[0])
            pos += 2
        elif op == _EMPTY_TUPLE:
            stack.append(())
        elif op == _EMPTY_DICT:
            stack.append({})
        elif op == _NEWFALSE:
            stack.append(False)
        elif op == _BINPERSID:
            pid = stack.pop()
            if type(pid) is not tuple or not pid or pid[0] != "storage":
                raise NotPlain("a persistent id that is not a storage")
            stack.append(persistent_load(pid))
            if memo and memo[-1] is pid:  # made for this one call (a storage met again gets a new tuple)
                memo[-1] = _SPENT
        elif op == _SETITEM:
            value = stack.pop()
            key = stack.pop()
            _check_set_item_target(stack[-1])
            stack[-1][key] = value
        elif op == _BINPUT:
            i = data[pos]
            if i == len(memo):
                memo.append(stack[-1])
            else:
                _put(memo, sparse, i, stack[-1])
            pos += 1
        elif op == _TUPLE2:
            stack[-2:] = [(stack[-2], stack[-1])]
        elif op == _STOP:
            return stack.pop()
        else:
            stack, pos = _less_frequent(op, data, pos, stack, marks, empties)


def _spend(memo: list[Any], args: tuple[Any, ...]) -> None:
    """A call was made: the memo lets go of its argument tuple and the tuples in it (a tensor's size and stride,
    a torch.Size's dims), which a pickler made for that call alone and memoized all the same: about 300 bytes a
    tensor, 30 MB for a ZeRO-3 model-states file of 10^5 placeholders. Only the last few entries are searched;
    a pickle that fetches one again is not plain (the full unpickler reads it)."""
    for j in range(len(memo) - 1, max(len(memo) - _LOOK_BACK, 0) - 1, -1):
        entry = memo[j]
        if entry is args or type(entry) is tuple and any(entry is arg for arg in args):
            memo[j] = _SPENT


def _put(memo: list[Any], sparse: dict[int, Any], i: int, value: Any) -> None:
    """Memo entry ``i`` set out of the pickler's order: over an earlier entry, or past the end (kept aside; an
    entry of the list's own later overrides it, as a dict's later put would)."""
    if i < len(memo):
        memo[i] = value
    else:
        sparse[i] = value


def _less_frequent(
    op: int, data: bytes, pos: int, stack: list[Any], marks: list[list[Any]], empties: Empties
) -> tuple[list[Any], int]:
    """:func:`_run`'s less frequent opcodes (STOP aside), in the same order: the stack after ``op`` (a new one
    where ``op`` closes a MARK) and the position after its argument."""
    if op == _SETITEMS:
        items, stack = stack, marks.pop()
        _check_set_item_target(stack[-1])
        for i in range(0, len(items), 2):
            stack[-1][items[i]] = items[i + 1]
    elif op == _GLOBAL:
        found, pos = _global(data, pos)
        stack.append(found)
    elif op == _EMPTY_LIST:
        stack.append([])
    elif op == _NONE:
        stack.append(None)
    elif op == _APPENDS:
        items, stack = stack, marks.pop()
        if type(stack[-1]) is not list:
            raise NotPlain("APPENDS to a non-list")
        stack[-1].extend(items)
    elif op == _BINFLOAT:
        stack.append(_UNPACK(">d", data, pos)[0])
        pos += 8
    elif op == _BININT:
        stack.append(_UNPACK("<i", data, pos)[0])
        pos += 4
    elif op == _NEWTRUE:
        stack.append(True)
    elif op == _BUILD:
        state = stack.pop()
        _build(stack[-1], state, empties)
    elif op == _APPEND:
        item = stack.pop()
        if type(stack[-1]) is not list:
            raise NotPlain("APPEND to a non-list")
        stack[-1].append(item)
    elif op == _TUPLE3:
        stack[-3:] = [(stack[-3], stack[-2], stack[-1])]
    elif op == _LONG1:
        n = data[pos]
        stack.append(int.from_bytes(data[pos + 1 : pos + 1 + n], "little", signed=True))
        pos += 1 + n
    elif op == _SHORT_BINSTRING:
        n = data[pos]
        stack.append(data[pos + 1 : pos + 1 + n].decode("utf-8", "strict"))
        pos += 1 + n
    elif op == _EMPTY_SET:
        stack.append(set())
    elif op == _PROTO:
        if data[pos] != 2:
            raise NotPlain("a second PROTO opcode")
        pos += 1
    else:
        raise NotPlain(f"opcode {bytes([op])!r}")
    return stack, pos


def rebind(obj: Any, storage_of: Callable[[int], torch.storage.TypedStorage]) -> Any:
    """What :func:`load_plain` gives for the same pickle bytes over another file's storages, without reading
    them again: ``obj`` (a tree load_plain returned, untouched since) copied with each tensor and storage
    moved onto ``storage_of(its storage's _cdata)``, and what it shared still shared. Ranks of one save
    often pickle byte-identical metadata (ZeRO-3 model-states files); this is how the repeats are read.
    DeepSpeed's stand-ins (:mod:`ucp.io.standins`, which the full unpickler builds) are copied too.
    :class:`NotPlain` for anything else load_plain does not build.
    """
    return _Rebinder(storage_of).copy(obj)


class _Rebinder:
    """One :func:`rebind`'s state. A class, not a closure that calls itself: that closure's cycle kept the memo
    (a tensor per placeholder) and ``storage_of`` (the rank before's whole template, its pickle bytes included)
    alive until a full garbage collection, one rank's worth per rank of a ZeRO-3 save."""

    __slots__ = ("memo", "plain_globals", "storage_of")

    def __init__(self, storage_of: Callable[[int], torch.storage.TypedStorage]) -> None:
        self.storage_of = storage_of
        self.plain_globals = tuple(_plain_globals().values())
        self.memo: dict[int, Any] = {}

    def copy(self, item: Any) -> Any:
        """``item``'s copy over the new storages (one object per object met, shared as before)."""
        memo, copy = self.memo, self.copy
        kind = type(item)
        if kind in _IMMUTABLE:
            return item
        if kind is type or callable(item) and not torch.is_tensor(item):
            if any(item is g for g in self.plain_globals):
                return item
            raise NotPlain(f"a {kind.__name__} in the tree")
        if id(item) in memo:
            if memo[id(item)] is _BUILDING:
                raise NotPlain("a tuple that holds itself")
            return memo[id(item)]
        if isinstance(item, (DSEnum, DSStrEnum)):
            return item  # an int or str standing in for a DeepSpeed enum member: immutable
        if isinstance(item, DSObject):  # a DeepSpeed object's stand-in (a loss scaler): its fields copied
            memo[id(item)] = made = object.__new__(kind)
            made.__dict__.update(copy(vars(item)))
            return made
        if kind is torch.Tensor:
            storage = self.storage_of(item.untyped_storage()._cdata)
            raw = storage._untyped_storage
            new = torch.empty((0,), dtype=item.dtype, device=raw.device)
            new.set_(raw, item.storage_offset(), item.size(), item.stride())
            new.requires_grad = item.requires_grad
            memo[id(item)] = new
            new._backward_hooks = copy(item._backward_hooks)
            return new
        if kind is torch.storage.TypedStorage:
            memo[id(item)] = self.storage_of(item._untyped_storage._cdata)
        elif kind is dict or kind is OrderedDict:
            memo[id(item)] = new_map = kind()
            for key, value in item.items():  # immutables inline: most of a metadata tree, a call each otherwise
                new_map[key if type(key) in _IMMUTABLE else copy(key)] = (
                    value if type(value) in _IMMUTABLE else copy(value)
                )
            if kind is OrderedDict:
                new_map.__dict__.update(copy(vars(item)))
        elif kind is list:
            new_list: list[Any] = []
            memo[id(item)] = new_list
            new_list.extend(value if type(value) in _IMMUTABLE else copy(value) for value in item)
        elif kind is tuple or kind is set:
            memo[id(item)] = _BUILDING  # a tuple inside itself (through a list) would come back as a copy
            memo[id(item)] = kind(value if type(value) in _IMMUTABLE else copy(value) for value in item)
        else:
            raise NotPlain(f"a {kind.__name__} in the tree")
        return memo[id(item)]
