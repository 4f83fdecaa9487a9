"""fp32 to the dtype a run or an export keeps, refusing what fp16 cannot hold.

A value of magnitude 65520 or more becomes inf in fp16. A weight cast so would make every forward of an fp16
run overflow (each step skipped, the loss scale sinking to its minimum) and an fp16 export unusable, with
nothing said. Infinities and NaNs the source already held are its own state and pass through.
"""

from __future__ import annotations

import torch

from ucp.errors import ConfigError
from ucp.model.pieces import Pieces

__all__ = ["FP16_MAX", "check_fits", "check_fits_pieces", "narrowed"]

FP16_MAX = float(torch.finfo(torch.float16).max)
#: the smallest magnitude fp16 rounds to inf (half an fp16 step above its largest value)
_FP16_INF = 65520.0


#: elements of a parameter looked at at once by :func:`check_fits_pieces` (16 MiB of fp32)
_CHUNK = 4 << 20


def check_fits(name: str, values: torch.Tensor, dtype: torch.dtype) -> None:
    """Refuse, in one line, ``values`` that ``dtype`` (fp16) would turn from finite numbers into inf."""
    if dtype != torch.float16 or values.numel() == 0 or values.dtype == torch.float16:
        return
    grown, biggest = _grown(values)
    if grown:
        _refuse(name, grown, biggest)


def check_fits_pieces(name: str, values: Pieces, dtype: torch.dtype) -> None:
    """:func:`check_fits` over pieces of files, a bounded chunk at a time: the weight never whole in memory."""
    if dtype != torch.float16 or values.dtype == torch.float16:
        return
    grown, biggest = 0, 0.0
    for start in range(0, values.numel, _CHUNK):
        more, big = _grown(values.slice(start, min(start + _CHUNK, values.numel)).join())
        grown, biggest = grown + more, max(biggest, big)
    if grown:
        _refuse(name, grown, biggest)


def _grown(values: torch.Tensor) -> tuple[int, float]:
    """How many finite values fp16 would make inf, and the largest magnitude among them."""
    if values.numel() == 0:
        return 0, 0.0
    low, high = torch.aminmax(values)
    if -_FP16_INF < low.item() and high.item() < _FP16_INF:  # false for a NaN too: then every value is looked at
        return 0, 0.0
    flat = values.reshape(-1)
    grown = torch.isfinite(flat) & (flat.abs() >= _FP16_INF)
    count = int(grown.sum())
    return count, (flat[grown].abs().max().item() if count else 0.0)


def _refuse(name: str, grown: int, biggest: float) -> None:
    raise ConfigError(
        f"{name} holds {biggest:.6g}, beyond fp16's largest value ({FP16_MAX:g}): in fp16 it would be inf "
        f"({grown} of its values); keep it in bf16 or fp32 (--dtype)"
    )


def narrowed(name: str, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values`` in ``dtype``, refused (:func:`check_fits`) when fp16 would make a finite value inf."""
    check_fits(name, values, dtype)
    return values.to(dtype)
