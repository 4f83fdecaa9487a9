"""The records that flow from a source through the universal format to a target.

A :class:`Reader` is anything that can answer "what is in this checkpoint" (:class:`Facts`) and
"give me one parameter's state" (:meth:`Reader.read`): a DeepSpeed ZeRO checkpoint and a universal
directory are both readers, so every target accepts either.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ucp.flavors import Hyper

if TYPE_CHECKING:
    from ucp.tensorfile import Pieces

__all__ = ["DTYPES", "dtype_name", "torch_dtype", "ParamMeta", "ParamState", "PieceState", "GroupMeta", "SourceInfo", "Facts",
           "Reader"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    return _NAMES.get(dtype, str(dtype).replace("torch.", ""))


def torch_dtype(name: str) -> torch.dtype:
    return DTYPES[name]


@dataclass(frozen=True)
class ParamMeta:
    """One distinct parameter tensor. Tied aliases are not parameters; Facts.tied maps them."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # dtype of the model (low-precision) weight: fp32 | bf16 | fp16
    group: int | None  # param group index; None when frozen
    frozen: bool

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class ParamState:
    """One parameter's full, unpadded state in its real shape; moments are None when frozen."""

    fp32: torch.Tensor
    exp_avg: torch.Tensor | None = None
    exp_avg_sq: torch.Tensor | None = None
    step: int | None = None


@dataclass
class PieceState:
    """A :class:`ParamState` whose tensors are :class:`ucp.tensorfile.Pieces`: the copy-free fast path
    from a source's mmapped shards into the universal writer (valid only while the source says so)."""

    fp32: Pieces
    exp_avg: Pieces | None = None
    exp_avg_sq: Pieces | None = None
    step: int | None = None

    def joined(self) -> ParamState:
        """The same state as whole fp32 tensors (what :meth:`Reader.read` returns)."""
        def join(pieces: "Pieces | None") -> torch.Tensor | None:
            return None if pieces is None else pieces.join(torch.float32)

        return ParamState(fp32=join(self.fp32), exp_avg=join(self.exp_avg), exp_avg_sq=join(self.exp_avg_sq),
                          step=self.step)


@dataclass
class GroupMeta:
    """A param group: neutral hyperparameters, the source's own keys, and its members in order."""

    index: int
    hyper: Hyper
    raw: dict[str, Any]
    params: list[str]
    step: int | None = None


@dataclass
class SourceInfo:
    """Facts about where a checkpoint came from, kept in ucp.json for every later stage."""

    format: str  # deepspeed | universal
    zero_stage: int
    dp_world_size: int
    mp_world_size: int = 1
    dtype: str = "fp32"
    ds_version: str | None = None
    tag: str | None = None
    sub_group_size: int | None = None
    global_steps: int = 0
    skipped_steps: int = 0
    global_samples: int | None = None
    iteration: int | None = None
    ds_config: dict[str, Any] = field(default_factory=dict)


@dataclass
class Facts:
    """Everything about a checkpoint except the tensors themselves."""

    info: SourceInfo
    flavour: str | None  # None: unknown (the optimizer never stepped, or no known layout)
    adam_w_mode: bool | None
    step: int | None
    groups: list[GroupMeta]
    params: list[ParamMeta]  # flat order: optimized params group by group, then frozen ones
    tied: dict[str, str] = field(default_factory=dict)  # alias -> parameter that holds the data
    buffer_names: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    #: per parameter, how tensor parallelism lays it out (ucp.tp.TpRule as JSON); empty when the
    #: source had no tensor parallelism and no rules were given
    tp_rules: dict[str, dict[str, Any]] = field(default_factory=dict)

    def param(self, name: str) -> ParamMeta:
        for meta in self.params:
            if meta.name == name:
                return meta
        raise KeyError(name)


class Reader(Protocol):
    """What every source offers. Call order: ``facts`` any time, ``read`` per parameter (any
    order, from several threads), ``buffers``/``extras`` once, then ``close``."""

    facts: Facts

    def read(self, name: str, *, moments: bool = True) -> ParamState: ...

    def buffers(self) -> dict[str, torch.Tensor]: ...

    def extras(self) -> dict[str, Any]: ...

    def close(self) -> None: ...
