"""Checked reading of one checkpoint field: an int, a dict, a list, a tensor, a name, a shape.

:mod:`ucp.deepspeed.model_states` and :mod:`ucp.deepspeed.optim_states` read DeepSpeed's files
with these; a damaged or hand-made file gets an :class:`~ucp.errors.InputError` naming the file
and the field, one line per problem.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ucp.errors import InputError
from ucp.model.records import Facts

__all__ = [
    "check_one_version",
    "MALFORMED",
    "as_int",
    "need_mapping",
    "need_list",
    "need_tensor",
    "tensor_shape",
    "check_name",
    "first_line",
    "sub_group_size",
    "jsonable",
    "build_facts",
]


def as_int(value: Any, what: str) -> int:
    """An int field of a checkpoint (a Python int, an int-valued tensor or float, a DeepSpeed enum)."""
    if isinstance(value, bool):
        raise InputError(f"{what} is {value!r}, not an integer")
    if torch.is_tensor(value) and value.numel() == 1:
        value = value.item()
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int):
        raise InputError(f"{what} is {value!r:.60}, not an integer")
    return int(value)


def need_mapping(value: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise InputError(
            f"{what} is a {type(value).__name__}, expected a dict: the file is damaged or not from DeepSpeed"
        )
    return value


def need_list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, (list, tuple)):
        raise InputError(
            f"{what} is a {type(value).__name__}, expected a list: the file is damaged or not from DeepSpeed"
        )
    return list(value)


def need_tensor(value: Any, what: str, *, floating: bool = True) -> torch.Tensor:
    if not torch.is_tensor(value) or value.layout != torch.strided or (floating and not value.is_floating_point()):
        kind = f"a {value.dtype} tensor" if torch.is_tensor(value) else f"a {type(value).__name__}"
        raise InputError(
            f"{what} is {kind}, expected a {'floating-point ' if floating else ''}tensor: the file is "
            "damaged or not from DeepSpeed"
        )
    return value


def tensor_shape(shape: Any) -> tuple[int, ...]:
    if torch.is_tensor(shape) or isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise InputError(f"parameter shape {shape!r:.60} is not a sequence of ints")
    dims = tuple(shape)
    if len(dims) > 64 or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
        raise InputError(f"parameter shape {shape!r:.60} is not a sequence of non-negative ints")
    return tuple(int(d) for d in dims)


#: What a damaged or hand-made file can raise while its structure is walked; readers turn these
#: into one-line InputErrors and keep the cause for --debug.
MALFORMED = (KeyError, TypeError, ValueError, AttributeError, IndexError, RecursionError, RuntimeError)


def check_name(name: Any, where: str) -> None:
    """Parameter names become folder names later (ucp.universal.folder_for): text only, no NUL."""
    if not isinstance(name, str):
        raise InputError(f"{where} holds a parameter name {name!r:.60} that is not a string")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise InputError(f"{where} holds a parameter name {name!r:.60} that is not valid text") from None
    if not name or "\x00" in name:
        raise InputError(f"{where} holds a parameter name {name!r:.60} that is empty or holds a NUL byte")


def first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0][:160] if lines else ""


def sub_group_size(ds_config: Mapping[str, Any]) -> int | None:
    zero = ds_config.get("zero_optimization") if isinstance(ds_config, Mapping) else None
    if isinstance(zero, Mapping) and zero.get("sub_group_size") is not None:
        return as_int(zero["sub_group_size"], "zero_optimization.sub_group_size")
    return None


def jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)


def build_facts(build: Callable[[], Facts], *, close: Callable[[], None], where: str) -> Facts:
    """Run a reader's fact-building; on any failure close its files first.

    The explicit checks inside ``build`` cover what DeepSpeed writes; the rest of what a damaged or
    hand-made file can hold (MALFORMED) becomes one line naming ``where``, the cause kept for --debug.
    """
    try:
        return build()
    except InputError:
        close()
        raise
    except MALFORMED as err:
        close()
        raise InputError(f"{where} ({type(err).__name__}: {first_line(err)}); rerun with --debug for details") from err
    except BaseException:
        close()
        raise


def check_one_version(stamped: Iterable[Mapping[str, Any]]) -> None:
    """Files of one save carry one ``ds_version``; two mean rank files of different runs are mixed."""
    versions = {str(m["ds_version"]) for m in stamped if m.get("ds_version") is not None}
    if len(versions) > 1:
        raise InputError(
            f"rank files were written by different DeepSpeed versions: {sorted(versions)}; they come "
            "from different runs, so use one tag folder as DeepSpeed saved it"
        )
