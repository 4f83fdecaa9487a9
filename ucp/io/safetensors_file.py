"""Writing a safetensors file tensor by tensor, each streamed in bounded chunks.

The safetensors library's ``save_file`` takes every tensor of a file in memory at once (an export shard: up to its
``--max-shard-size``, 5 GB by default). Here the header is laid out from shapes and dtypes alone, then each tensor's
bytes are copied into place as the caller hands them over, one at a time, from memory, from spans of files or cast
from fp32 pieces chunk by chunk (:mod:`ucp.io.span_copy`): memory holds a copy buffer, not the file.

The format (https://huggingface.co/docs/safetensors): an 8-byte little-endian header length, a JSON header (here
padded with spaces to a multiple of 8, as the library pads it) mapping each name to its ``dtype``, ``shape`` and
``data_offsets`` ``[begin, end)`` in the byte buffer that follows, plus ``__metadata__`` (strings only); the
tensors tile the buffer in header order, row-major, little-endian.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from ucp.io.pool import parallel_map
from ucp.io.span_copy import PARALLEL_MIN, Copied, copy_spans
from ucp.model.pieces import Cast, FileSpan, PathSpan, Pieces, nbytes_of

__all__ = ["SAFETENSORS_DTYPES", "Entry", "Source", "write_safetensors"]

#: torch dtype -> safetensors dtype name
SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}

#: the order the library lays tensors out in (dtypes from widest, then names): every tensor starts aligned to its
#: element size, and a file holds what ``safetensors.torch.save_file`` would write for the same tensors
_LAYOUT = ("I64", "F64", "F32", "I32", "BF16", "F16", "I16", "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL")

#: what one tensor's bytes come from: memory, pieces of files (and memory), or pieces cast as they are copied
Source = torch.Tensor | Pieces | Cast


@dataclass(frozen=True)
class Entry:
    """One tensor of the file, known before its bytes are: its name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.shape, self.dtype)


E = TypeVar("E", bound=Entry)


def layout(entries: Sequence[E]) -> list[E]:
    """The entries in the order their bytes follow each other in the file."""
    for entry in entries:
        if entry.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{entry.name}: safetensors has no dtype for {entry.dtype}")
    return sorted(entries, key=lambda e: (_LAYOUT.index(SAFETENSORS_DTYPES[e.dtype]), e.name))


def header_bytes(entries: Sequence[Entry], metadata: Mapping[str, str]) -> bytes:
    """The length prefix and JSON header for ``entries`` laid end to end in this order."""
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for entry in entries:
        header[entry.name] = {
            "dtype": SAFETENSORS_DTYPES[entry.dtype],
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + entry.nbytes],
        }
        offset += entry.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _parts(source: Source) -> list[Copied]:
    """The bytes of one tensor as the copier takes them."""
    if isinstance(source, Cast):
        return [source] if source.nbytes else []
    if isinstance(source, Pieces):
        return [p if isinstance(p, (FileSpan, PathSpan)) else _memory(p) for p in source.parts if _size(p)]
    return [_memory(source)] if source.numel() else []


def _size(part: torch.Tensor | FileSpan | PathSpan) -> int:
    return part.nbytes if isinstance(part, (FileSpan, PathSpan)) else part.numel() * part.element_size()


def _memory(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]  # ndarray is a buffer


def write_safetensors(
    path: str | os.PathLike,
    entries: Sequence[E],
    fetch: Callable[[E], AbstractContextManager[Source]],
    metadata: Mapping[str, str] | None = None,
    *,
    workers: int = 1,
    desc: str = "",
) -> int:
    """Write ``entries`` to a new file at ``path``; ``fetch(entry)`` is a context manager yielding the entry's
    bytes (valid inside it), entered once per tensor, ``workers`` tensors at a time, each copied to its own
    offset. Returns the file's size."""
    entries = layout(entries)
    head = header_bytes(entries, metadata or {})
    starts, at = [], len(head)
    for entry in entries:
        starts.append(at)
        at += entry.nbytes
    fd = os.open(Path(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)

    def one(index: int) -> None:
        entry = entries[index]
        with fetch(entry) as source:
            if tuple(source.shape) != tuple(entry.shape) or source.dtype != entry.dtype:
                raise ValueError(
                    f"{entry.name}: handed {source.dtype} {tuple(source.shape)} for {entry.dtype} {entry.shape}"
                )
            copy_spans(fd, _parts(source), starts[index], 0, parallel=entry.nbytes >= PARALLEL_MIN)

    try:
        _write_at(fd, head, 0)
        for _ in parallel_map(one, range(len(entries)), workers, desc=desc, weight=lambda i: entries[i].nbytes):
            pass
        os.ftruncate(fd, at)  # a last empty tensor writes nothing
    finally:
        os.close(fd)
    return at


def _write_at(fd: int, data: bytes, at: int) -> int:
    view = memoryview(data)
    while len(view):
        done = os.pwrite(fd, view, at)
        if done <= 0:
            raise OSError("pwrite wrote nothing")
        view, at = view[done:], at + done
    return at
