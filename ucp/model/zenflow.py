"""DeepSpeed ZenFlow (``zero_optimization.zenflow``, ZeRO-1/2 with the optimizer offloaded to CPU): whose copy
of a weight is the newest.

ZenFlow updates the top-k columns of each matrix (and the whole of each vector) every step with a selective
Adam on the bf16/fp16 weights, and the rest every ``update_interval`` steps with CPU Adam on the fp32 masters,
whose values it then copies onto the weights outside those columns; at each new selection it copies the weights
back onto the masters. So between selections the masters of the selected values are stale: the model the run
computes with is in the module's weights, and a master restored as it was saved sends the run back (measured in
DeepSpeed 0.19.8, ZeRO-2, bf16: the first loss after a restore from the masters 8.006 against 7.834 resumed from
the weights). Where a weight is not its master's rounding, the weight is the newer value.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["zenflow_config", "newest_master", "ZENFLOW_NOTE", "ZENFLOW_OVERLAP_NOTE"]

ZENFLOW_NOTE = (
    "a ZenFlow run: its selective optimizer updates the weights between syncs with the fp32 masters, so where "
    "a weight is not its master's rounding ucp takes the weight as the master (every target starts from the "
    "model the run had); the selective optimizer's moments are not in DeepSpeed's checkpoint"
)
ZENFLOW_OVERLAP_NOTE = (
    "saved with zenflow.overlap_step: DeepSpeed saves while its optimizer process may still be applying a CPU "
    "update to the masters, which then reaches neither the weights nor ucp's output"
)


def zenflow_config(ds_config: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """The ``zero_optimization.zenflow`` block of a DeepSpeed config, or None when the run did not use ZenFlow."""
    zero = ds_config.get("zero_optimization") if isinstance(ds_config, Mapping) else None
    block = zero.get("zenflow") if isinstance(zero, Mapping) else None
    return block if isinstance(block, Mapping) else None


def newest_master(master: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The fp32 master with each value whose low-precision ``weight`` is not the master's rounding replaced by
    that weight (widened): the weight was written after the master there. Casting the result to the weight's
    dtype gives back ``weight`` exactly, and where the two agree the master keeps its fp32 bits."""
    if weight.shape != master.shape:
        raise ValueError(f"weight shape {tuple(weight.shape)} != master shape {tuple(master.shape)}")
    if weight.dtype == master.dtype:
        return weight.to(master.dtype, copy=True)
    agrees = master.to(weight.dtype) == weight
    return torch.where(agrees, master, weight.to(master.dtype))
