"""fp32 to the dtype a run or an export keeps, refusing what fp16 cannot hold.

A value of magnitude 65520 or more becomes inf in fp16. A weight cast so would make every forward of an fp16
run overflow (each step skipped, the loss scale sinking to its minimum) and an fp16 export unusable, with
nothing said. Infinities and NaNs the source already held are its own state and pass through.
"""

from __future__ import annotations

import torch

from ucp.errors import ConfigError

__all__ = ["FP16_MAX", "check_fits", "narrowed"]

FP16_MAX = float(torch.finfo(torch.float16).max)
#: the smallest magnitude fp16 rounds to inf (half an fp16 step above its largest value)
_FP16_INF = 65520.0


def check_fits(name: str, values: torch.Tensor, dtype: torch.dtype) -> None:
    """Refuse, in one line, ``values`` that ``dtype`` (fp16) would turn from finite numbers into inf."""
    if dtype != torch.float16 or values.numel() == 0 or values.dtype == torch.float16:
        return
    low, high = torch.aminmax(values)
    if -_FP16_INF < low.item() and high.item() < _FP16_INF:  # false for a NaN too: then every value is looked at
        return
    flat = values.reshape(-1)
    grown = torch.isfinite(flat) & (flat.abs() >= _FP16_INF)
    if grown.any():
        biggest = flat[grown].abs().max().item()
        raise ConfigError(
            f"{name} holds {biggest:.6g}, beyond fp16's largest value ({FP16_MAX:g}): in fp16 it would be inf "
            f"({int(grown.sum())} of its values); keep it in bf16 or fp32 (--dtype)"
        )


def narrowed(name: str, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values`` in ``dtype``, refused (:func:`check_fits`) when fp16 would make a finite value inf."""
    check_fits(name, values, dtype)
    return values.to(dtype)
