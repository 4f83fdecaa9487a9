"""DeepSpeed ZenFlow (``zero_optimization.zenflow``, the optimizer offloaded to CPU): whose copy of a weight is
the newest (ZeRO-1/2), and the transposed matrices of its ZeRO-3 runs.

ZenFlow updates the top-k columns of each matrix (and the whole of each vector) every step with a selective
Adam on the bf16/fp16 weights, and the rest every ``update_interval`` steps with CPU Adam on the fp32 masters,
whose values it then copies onto the weights outside those columns; at each new selection it copies the weights
back onto the masters. So between selections the masters of the selected values are stale: the model the run
computes with is in the module's weights, and a master restored as it was saved sends the run back (measured in
DeepSpeed 0.19.8, ZeRO-2, bf16: the first loss after a restore from the masters 8.006 against 7.834 resumed from
the weights). Where a weight is not its master's rounding, the weight is the newer value.

At ZeRO-3 ZenFlow transposes every matrix of the module in place before partitioning it
(``_initialize_zenflow_stage3_prologue`` in DeepSpeed 0.19.8; frozen ones too), so its masters, moments,
``param_shapes`` and frozen fragments are the transposes of the model's: seen in a real save on an H200, where
the 37x10 embedding is saved as 10x37. A square matrix keeps its shape, so nothing but the config tells.
:class:`ZenflowTransposed` turns one layout into the other, both ways.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch

from ucp.model.pieces import Pieces
from ucp.model.records import ParamState, Reader, ReaderView

__all__ = [
    "zenflow_config",
    "newest_master",
    "transposes_matrices",
    "ZenflowTransposed",
    "ZENFLOW_NOTE",
    "ZENFLOW_OVERLAP_NOTE",
    "ZENFLOW_Z3_NOTE",
]

ZENFLOW_NOTE = (
    "a ZenFlow run: its selective optimizer updates the weights between syncs with the fp32 masters, so where "
    "a weight is not its master's rounding ucp takes the weight as the master (every target starts from the "
    "model the run had); the selective optimizer's moments are not in DeepSpeed's checkpoint"
)
ZENFLOW_OVERLAP_NOTE = (
    "saved with zenflow.overlap_step: DeepSpeed saves while its optimizer process may still be applying a CPU "
    "update to the masters, which then reaches neither the weights nor ucp's output"
)

ZENFLOW_Z3_NOTE = (
    "a ZenFlow run at ZeRO-3: DeepSpeed keeps every matrix transposed (masters, moments, param_shapes and frozen "
    "weights), and ucp reads each in the model's shape"
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


def transposes_matrices(ds_config: Mapping[str, Any] | None, stage: int) -> bool:
    """A run with this config keeps its matrices transposed: ZenFlow at ZeRO-3."""
    return stage == 3 and zenflow_config(ds_config) is not None


class ZenflowTransposed(ReaderView):
    """``inner`` with every 2-D parameter transposed: a ZenFlow ZeRO-3 save in the model's shapes, or a model's
    state in the layout a ZenFlow ZeRO-3 run keeps (the same operation). Reads hold one parameter whole at a
    time; ``owns``: closing the view closes ``inner`` (a source that hands out the view)."""

    def __init__(self, inner: Reader, *, note: str | None = None, owns: bool = False) -> None:
        facts = inner.facts
        self._names = frozenset(p.name for p in facts.params if len(p.shape) == 2)
        params = [replace(p, shape=p.shape[::-1]) if p.name in self._names else p for p in facts.params]
        warnings = facts.warnings + ([note] if note else [])
        super().__init__(inner, replace(facts, params=params, warnings=warnings), owns=owns)
        self.streams = False

    def read(self, name: str, *, moments: bool = True) -> ParamState:
        state = self.inner.read(name, moments=moments)
        if name not in self._names:
            return state
        optim = {k: _transposed(v) for k, v in state.optim.items()}
        return replace(state, fp32=_transposed(state.fp32), optim=optim)

    def reads_whole(self, name: str) -> bool:
        return name in self._names


def _transposed(tensor: torch.Tensor | Pieces) -> torch.Tensor:
    """A matrix's transpose in new row-major memory; elementwise state (moments) is a matrix of the same shape."""
    whole = tensor.join() if isinstance(tensor, Pieces) else tensor
    if whole.dim() != 2:
        raise ValueError(f"a ZenFlow ZeRO-3 matrix has 2 dimensions, not {whole.dim()}")
    return whole.t().contiguous()
