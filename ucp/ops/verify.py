"""``ucp verify``: prove a universal directory equals its source, or that a model fits a checkpoint.

:func:`verify_universal` reads both sides parameter by parameter (memory stays near a few
parameters) and compares bits, not values, so ``-0.0`` vs ``0.0`` or two different NaNs count as
differences. Checksums are checked on the way: a damaged file is a failed verification naming the
file, never a crash. :func:`verify_model` checks the names, shapes, frozen flags, ties and the
per-group order of a model's parameters against the checkpoint's flat layout, which is what a
restore into that model relies on.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ucp.errors import ChecksumError, CorruptFileError, InputError, UcpError
from ucp.io import torchfile
from ucp.io.atomic import checksum
from ucp.io.memory import give_back_freed
from ucp.io.pool import default_workers, parallel_map, state_bytes
from ucp.io.span_copy import read_witnessed
from ucp.model.pieces import Pieces
from ucp.model.records import Facts, ParamMeta, PieceState, Reader
from ucp.sources import is_universal, open_reader
from ucp.universal.manifest import MANIFEST, ParamEntry
from ucp.universal.reader import UniversalReader, open_universal

__all__ = ["VerifyResult", "verify_universal", "verify_model", "first_difference", "first_difference_pieces"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class VerifyResult:
    """The outcome: ``ok`` decides the exit code, ``message`` is the one line a person reads."""

    ok: bool
    message: str
    #: what was compared, when it all held (parameters, elements, buffers, groups, tied)
    compared: dict[str, int] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return self.ok

    def to_json(self) -> dict[str, Any]:
        """What ``ucp verify --json`` prints (with the verb and the source)."""
        return {"ok": self.ok, "message": self.message, "compared": dict(self.compared)}


# -- tensors ----------------------------------------------------------------------------------
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(_BITS[flat.element_size()]) if flat.is_floating_point() else flat


def _unravel(index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for dim in reversed(shape):
        out.append(index % dim if dim else 0)
        index = index // dim if dim else 0
    return tuple(reversed(out))


def _show(t: torch.Tensor, i: int) -> str:
    """A value and, for floats, its bit pattern (two NaNs or +-0 print alike but differ)."""
    value = t.reshape(-1)[i : i + 1]
    if not t.is_floating_point():
        return repr(value.item())
    width = t.element_size()
    bits = int(_bits(value)[0].item()) & ((1 << 8 * width) - 1)
    return f"{value.item()!r} (0x{bits:0{2 * width}x})"


def first_difference(a: torch.Tensor, b: torch.Tensor, labels: tuple[str, str] = ("source", "universal")) -> str | None:
    """None when ``a`` and ``b`` agree in dtype, shape and every bit; else what differs first."""
    x, y = labels
    if a.dtype != b.dtype:
        return f"dtype differs: {x} {a.dtype}, {y} {b.dtype}"
    if tuple(a.shape) != tuple(b.shape):
        return f"shape differs: {x} {list(a.shape)}, {y} {list(b.shape)}"
    diff = (_bits(a) != _bits(b)).nonzero()
    if diff.numel() == 0:
        return None
    i = int(diff[0, 0])
    where = _unravel(i, tuple(a.shape))
    return (
        f"first of {diff.shape[0]} differing elements at index {list(where)} (flat {i}): "
        f"{x} {_show(a, i)}, {y} {_show(b, i)}"
    )


#: elements of a tensor compared at once by :func:`first_difference_pieces` (16 MiB of fp32 per side)
_COMPARE_CHUNK = 4 << 20


def first_difference_pieces(a: Pieces, b: Pieces, labels: tuple[str, str] = ("source", "universal")) -> str | None:
    """:func:`first_difference` over pieces of files, a bounded chunk of both at a time: a 4 GB state is never
    whole in memory; the message is the one the whole tensors give."""
    x, y = labels
    if a.dtype != b.dtype:
        return f"dtype differs: {x} {a.dtype}, {y} {b.dtype}"
    if tuple(a.shape) != tuple(b.shape):
        return f"shape differs: {x} {list(a.shape)}, {y} {list(b.shape)}"
    first: tuple[int, str, str] | None = None
    count = 0
    size = min(_COMPARE_CHUNK, a.numel)
    buf_a, buf_b = torch.empty(size, dtype=a.dtype), torch.empty(size, dtype=b.dtype)  # reused chunk after chunk
    for start in range(0, a.numel, _COMPARE_CHUNK):
        end = min(start + _COMPARE_CHUNK, a.numel)
        ca, cb = buf_a[: end - start], buf_b[: end - start]
        for pieces, chunk in ((a, ca), (b, cb)):  # each span's witness told the crc32 of what it read
            view = memoryview(chunk.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]
            read_witnessed(pieces.slice(start, end).parts, view)
        bits_a, bits_b = _bits(ca), _bits(cb)
        if torch.equal(bits_a, bits_b):  # the usual case, without a mask and an index per chunk
            continue
        diff = (bits_a != bits_b).nonzero()
        if diff.numel() and first is None:
            i = int(diff[0, 0])
            first = (start + i, _show(ca, i), _show(cb, i))
        count += diff.shape[0]
    if first is None:
        return None
    i, shown_a, shown_b = first
    where = _unravel(i, tuple(a.shape))
    return f"first of {count} differing elements at index {list(where)} (flat {i}): {x} {shown_a}, {y} {shown_b}"


# -- universal vs source ----------------------------------------------------------------------
def _facts_difference(src: Facts, uni: Facts) -> str | None:
    src_names = [p.name for p in src.params]
    uni_names = [p.name for p in uni.params]
    if src_names != uni_names:
        theirs, ours = set(uni_names), set(src_names)  # once: a set per name was quadratic at 10^5 parameters
        missing = [n for n in src_names if n not in theirs]
        extra = [n for n in uni_names if n not in ours]
        if missing:
            return f"parameter {missing[0]!r} is in the source but not in the universal directory"
        if extra:
            return f"parameter {extra[0]!r} is in the universal directory but not in the source"
        i = next(i for i, (a, b) in enumerate(zip(src_names, uni_names)) if a != b)
        return f"parameter order differs at position {i}: source {src_names[i]!r}, universal {uni_names[i]!r}"
    for p, q in zip(src.params, uni.params):
        if p != q:
            return f"{p.name}: source says {_meta_text(p)}, universal says {_meta_text(q)}"
    if len(src.groups) != len(uni.groups):
        return f"source has {len(src.groups)} param groups, universal {len(uni.groups)}"
    for a, b in zip(src.groups, uni.groups):
        if a.params != b.params:
            return f"param group {a.index}: members differ"
        if a.hyper.to_json() != b.hyper.to_json():
            return f"param group {a.index}: hyperparameters differ: {a.hyper.to_json()} != {b.hyper.to_json()}"
    if src.tied != uni.tied:
        return f"tied parameters differ: source {src.tied}, universal {uni.tied}"
    if src.buffer_names != uni.buffer_names:
        return f"buffer names differ: source {src.buffer_names}, universal {uni.buffer_names}"
    if src.step != uni.step:
        return f"optimizer step differs: source {src.step}, universal {uni.step}"
    return None


def _meta_text(meta: ParamMeta) -> str:
    return f"shape {list(meta.shape)} {meta.dtype} group {meta.group} frozen={meta.frozen}"


def _step_file_difference(uni: UniversalReader, entry: ParamEntry, want: int | None) -> str | None:
    """step.pt is not read by UniversalReader.read (the manifest has the step); check it here."""
    name = entry.name
    file = entry.files.get("step.pt")
    if file is None:
        return None if want is None else f"{name}: step.pt is missing from {MANIFEST} (source step {want})"
    path = uni.file_path(name, "step.pt")
    if not path.is_file():
        raise CorruptFileError(f"{path} is missing from the universal directory")
    if path.stat().st_size != file.bytes or checksum(path) != file.crc32:
        raise ChecksumError(f"{path} does not match its checksum in {MANIFEST}: the file changed or is corrupt")
    value = torchfile.load(path)
    value = float(value.item()) if torch.is_tensor(value) else value
    if want is None or value != float(want):
        return f"{name} step: step.pt holds {value!r}, source step is {want!r}"
    return None


def _compare_param(src: Reader, uni: UniversalReader, entry: ParamEntry, meta: ParamMeta) -> str | None:
    """The first way the parameter's state in the universal directory differs from the source's; both read as
    pieces and compared a chunk at a time."""
    with contextlib.ExitStack() as stack:
        a = stack.enter_context(src.read_pieces(meta.name))
        try:
            b = stack.enter_context(uni.read_pieces(meta.name))
            step_diff = _step_file_difference(uni, entry, a.step)
        except (ChecksumError, CorruptFileError) as err:
            return f"{meta.name}: {err}"
        found = _state_difference(meta.name, a, b) or step_diff
    give_back_freed()  # the chunks' buffers, freed in this worker thread's heap
    return found


def _state_difference(name: str, a: PieceState, b: PieceState) -> str | None:
    if list(a.optim) != list(b.optim):
        return f"{name}: the source keeps optimizer state {list(a.optim)}, the universal directory {list(b.optim)}"
    for key, x, y in [("fp32", a.fp32, b.fp32)] + [(k, a.optim[k], b.optim[k]) for k in a.optim]:
        diff = first_difference_pieces(x, y)
        if diff:
            return f"{name} {key}: {diff}"
    if a.step != b.step:
        return f"{name} step: source {a.step!r} != universal {b.step!r}"
    if a.scalars.keys() != b.scalars.keys():
        return f"{name}: the source keeps scalars {sorted(a.scalars)}, the universal directory {sorted(b.scalars)}"
    for key, scalar in a.scalars.items():
        if scalar.dtype != b.scalars[key].dtype or not torch.equal(scalar, b.scalars[key]):
            return f"{name} {key}: source {scalar.item()!r} != universal {b.scalars[key].item()!r}"
    return None


def verify_universal(
    source: str | os.PathLike, universal: str | os.PathLike, *, tag: str | None = None, workers: int | None = None
) -> VerifyResult:
    """Compare every tensor of ``universal`` with ``source`` bit for bit, checksums included."""
    if not is_universal(universal):
        raise InputError(f"{universal} is not a universal directory: {MANIFEST} is missing")
    try:
        uni = open_universal(universal, verify=True)
    except CorruptFileError as err:  # a damaged manifest is what verify exists to report
        return VerifyResult(False, f"MISMATCH: {err}")
    src = open_reader(source, tag=tag)
    try:
        diff = _facts_difference(src.facts, uni.facts)
        if diff:
            return VerifyResult(False, f"MISMATCH: {diff}")
        metas = src.facts.params
        try:
            # the universal files found without parsing them, each checked from the bytes the comparison reads
            with uni.deferred_checks():
                results = parallel_map(
                    lambda m: _compare_param(src, uni, uni.entry(m.name), m),  # one entry at a time: 10^5 for a MoE
                    metas,
                    workers or default_workers(),
                    desc="verify",
                    weight=state_bytes(src.facts),
                )
                for diff in results:
                    if diff:
                        results.close()  # stop reading; in-flight parameters finish and are dropped
                        return VerifyResult(False, f"MISMATCH: {diff}")
        except (ChecksumError, CorruptFileError) as err:
            return VerifyResult(False, f"MISMATCH: {err}")
        try:
            theirs = uni.buffers()
        except (ChecksumError, CorruptFileError) as err:
            return VerifyResult(False, f"MISMATCH: buffers: {err}")
        ours = src.buffers()
        for name in sorted(set(ours) | set(theirs)):
            if name not in theirs or name not in ours:
                side = "universal directory" if name not in theirs else "source"
                return VerifyResult(False, f"MISMATCH: buffer {name!r} is missing from the {side}")
            diff = first_difference(ours[name], theirs[name])
            if diff:
                return VerifyResult(False, f"MISMATCH: buffer {name}: {diff}")
        numel = sum(m.numel for m in metas)
        return VerifyResult(
            True,
            f"OK: {len(metas)} parameters ({numel:,} elements), their optimizer moments and "
            f"steps, and {len(ours)} buffer(s) match the source bit for bit; checksums hold",
            {"parameters": len(metas), "elements": numel, "buffers": len(ours)},
        )
    finally:
        src.close()
        uni.close()


# -- model vs checkpoint ----------------------------------------------------------------------
@contextlib.contextmanager
def _cwd_on_path() -> Iterator[None]:
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added:
            with contextlib.suppress(ValueError):
                sys.path.remove(cwd)


def load_callable(spec: str) -> Callable[[], Any]:
    """``package.module:function`` or ``path/to/file.py:function`` -> the callable (cwd importable)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise InputError(f"--model {spec!r} must look like MODULE:CALLABLE, e.g. mypkg.model:build")
    with _cwd_on_path():
        try:
            if module_name.endswith(".py"):
                path = Path(module_name)
                if not path.is_file():
                    raise InputError(f"--model: {path} does not exist")
                loader_spec = importlib.util.spec_from_file_location(path.stem, path)
                module = importlib.util.module_from_spec(loader_spec)  # type: ignore[arg-type]
                loader_spec.loader.exec_module(module)  # type: ignore[union-attr]
            else:
                module = importlib.import_module(module_name)
        except UcpError:
            raise
        except ImportError as err:
            raise InputError(f"--model: cannot import {module_name!r}: {err}") from err
        except Exception as err:  # the user's module failed while importing
            raise InputError(f"--model: importing {module_name!r} raised {type(err).__name__}: {err}") from err
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise InputError(f"--model: {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise InputError(f"--model: {spec} is not callable")
    return target


def _build_model(spec: str) -> torch.nn.Module:
    """Build on the meta device first (no memory for weights); fall back to a real build."""
    factory = load_callable(spec)
    try:
        with torch.device("meta"):
            model = factory()
    except Exception as err:  # noqa: BLE001 - some builders need real tensors; try again for real
        logger.debug("building %s on the meta device failed (%s); building it for real", spec, err)
        try:
            model = factory()
        except Exception as err2:
            raise InputError(f"--model: {spec}() raised {type(err2).__name__}: {err2}") from err2
    if not isinstance(model, torch.nn.Module):
        raise InputError(f"--model: {spec}() returned {type(model).__name__}, not a torch.nn.Module")
    return model


def _model_difference(facts: Facts, model: torch.nn.Module) -> str | None:
    owners: dict[int, str] = {}
    order: list[str] = []
    aliases: dict[str, str] = {}
    params: dict[str, torch.nn.Parameter] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in owners:
            aliases[name] = owners[id(param)]
            continue
        owners[id(param)] = name
        order.append(name)
        params[name] = param
    ckpt = {p.name: p for p in facts.params}
    for meta in facts.params:
        if meta.name not in params:
            if meta.name in aliases:
                return (
                    f"checkpoint parameter {meta.name!r} is a tied alias of {aliases[meta.name]!r} in the model, "
                    "but holds its own data in the checkpoint"
                )
            return f"checkpoint parameter {meta.name!r} is not in the model"
    for name in order:
        if name not in ckpt:
            if name in facts.tied:
                return (
                    f"model parameter {name!r} holds its own data, but the checkpoint ties it to {facts.tied[name]!r}"
                )
            return f"model parameter {name!r} is not in the checkpoint"
    for alias, owner in facts.tied.items():
        if alias not in aliases:
            return f"the checkpoint ties {alias!r} to {owner!r}, but the model has no such alias"
        if aliases[alias] != owner:
            return f"the checkpoint ties {alias!r} to {owner!r}, the model ties it to {aliases[alias]!r}"
    for alias, owner in aliases.items():
        if alias not in facts.tied:
            return f"the model ties {alias!r} to {owner!r}, but the checkpoint does not"
    for meta in facts.params:
        shape = tuple(params[meta.name].shape)
        if shape != meta.shape:
            return f"{meta.name}: model shape {list(shape)}, checkpoint shape {list(meta.shape)}"
        frozen = not params[meta.name].requires_grad
        if frozen != meta.frozen:
            state = "frozen (requires_grad=False)" if frozen else "trainable"
            return f"{meta.name}: {state} in the model, {'frozen' if meta.frozen else 'trainable'} in the checkpoint"
    position = {name: i for i, name in enumerate(order)}
    members = [(f"param group {g.index}", list(g.params)) for g in facts.groups]
    members.append(("frozen parameters", [p.name for p in facts.params if p.frozen]))
    for label, names in members:
        in_model = sorted(names, key=position.__getitem__)
        if in_model != names:
            i = next(i for i, (a, b) in enumerate(zip(names, in_model)) if a != b)
            return (
                f"{label}: order differs at position {i}: the checkpoint stores {names[i]!r}, the model has "
                f"{in_model[i]!r} there (within a group the model's order must match the flat order)"
            )
    return None


def verify_model(ckpt: str | os.PathLike, model: str, *, tag: str | None = None) -> VerifyResult:
    """Check that ``model`` (MODULE:CALLABLE) has the checkpoint's parameters, shapes, ties and order."""
    reader = open_reader(ckpt, tag=tag, verify=False)
    try:
        facts = reader.facts
    finally:
        reader.close()
    built = _build_model(model)
    diff = _model_difference(facts, built)
    if diff:
        return VerifyResult(False, f"MISMATCH: {diff}")
    frozen = sum(p.frozen for p in facts.params)
    return VerifyResult(
        True,
        f"OK: {model} matches the checkpoint: {len(facts.params)} parameters "
        f"({frozen} frozen) in {len(facts.groups)} groups, {len(facts.tied)} tied; names, "
        "shapes, ties and per-group order agree",
        {"parameters": len(facts.params), "frozen": frozen, "groups": len(facts.groups), "tied": len(facts.tied)},
    )
