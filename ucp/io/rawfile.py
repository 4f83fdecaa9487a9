"""A file that is one flat tensor's raw bytes, nothing else: DeepSpeed's NVMe swap files.

ZeRO-Infinity writes each swapped optimizer tensor as its elements in native byte order, padded up to its
I/O alignment, with no header; a save copies those files beside the optim files. Opened read-only on a
private mmap, like :class:`ucp.io.torchfile.TorchFile`, with the same ``span`` so that a writer streams
its slices from disk.
"""

from __future__ import annotations

import logging
import mmap
import os
from pathlib import Path

import torch

from ucp.errors import CorruptFileError, InputError
from ucp.model.pieces import FileSpan

__all__ = ["RawTensorFile"]

logger = logging.getLogger(__name__)


class RawTensorFile:
    """The first ``numel`` elements of ``dtype`` in the file at ``path`` (the rest is alignment padding), as
    ``tensor``: a read-only view on the file's mapping. Call :meth:`close` when done (or use ``with``)."""

    def __init__(self, path: str | os.PathLike, dtype: torch.dtype, numel: int, *, what: str) -> None:
        self.path = Path(path)
        nbytes = numel * dtype.itemsize
        try:
            self._file = open(self.path, "rb", buffering=0)  # noqa: SIM115  # closed by close()
        except FileNotFoundError:
            raise InputError(f"{self.path} is missing: {what}") from None
        except OSError as err:
            raise InputError(f"cannot read {self.path}: {err.strerror}") from None
        try:
            size = os.fstat(self._file.fileno()).st_size
            if size < nbytes:
                raise CorruptFileError(
                    f"{self.path} has {size:,} bytes, but {what} needs {nbytes:,} ({numel:,} {dtype} values): "
                    "it is truncated or belongs to another save"
                )
            self._mm = mmap.mmap(self._file.fileno(), size, access=mmap.ACCESS_COPY) if size else None
        except BaseException:
            self._file.close()
            raise
        self.tensor = (
            torch.frombuffer(self._mm, dtype=dtype, count=numel)
            if self._mm is not None and numel
            else torch.empty(0, dtype=dtype)
        )

    def span(self, tensor: torch.Tensor) -> FileSpan | None:
        """Where a contiguous view of :attr:`tensor` lies in the file; None for any other tensor."""
        if self._mm is None or not tensor.is_contiguous() or tensor.numel() == 0:
            return None
        start = tensor.data_ptr() - self.tensor.data_ptr()
        nbytes = tensor.numel() * tensor.element_size()
        if start < 0 or start + nbytes > self.tensor.numel() * self.tensor.element_size():
            return None
        return FileSpan(self._file, start, nbytes)

    def close(self) -> None:
        self.tensor = torch.empty(0, dtype=self.tensor.dtype)
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a view still exported: the mapping goes with its last user
                logger.debug("%s: mapping still in use at close", self.path)
        self._file.close()

    def __enter__(self) -> RawTensorFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
