"""Inert stand-ins for the few DeepSpeed (and argparse) classes that ZeRO checkpoints pickle.

The safe reader maps these names to the stand-ins instead of importing DeepSpeed; the writer
pickles them back under DeepSpeed's own names, so a file written by ucp loads into stock
DeepSpeed exactly like one DeepSpeed wrote. They live at the I/O layer because they are part of
what the reader will accept from a pickle, not of any one layout.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "DSEnum",
    "DSObject",
    "ZeroStageEnum",
    "LossScaler",
    "DynamicLossScaler",
    "FragmentAddress",
    "Namespace",
    "STANDINS",
]


class DSEnum(int):
    """An int standing in for a DeepSpeed enum member; pickles back as ``<ds_name>(value)``."""

    ds_name = ""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({int(self)})"


class ZeroStageEnum(DSEnum):
    ds_name = "deepspeed.runtime.zero.config.ZeroStageEnum"


class DSObject:
    """A plain attribute bag standing in for a DeepSpeed object; pickles back under ``ds_name``."""

    ds_name = ""

    def __init__(self, **state: Any) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__})"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.__dict__ == other.__dict__


class LossScaler(DSObject):
    ds_name = "deepspeed.runtime.fp16.loss_scaler.LossScaler"


class DynamicLossScaler(DSObject):
    ds_name = "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"


class FragmentAddress(DSObject):
    ds_name = "deepspeed.utils.tensor_fragment.fragment_address"


class Namespace(DSObject):
    """Megatron-DeepSpeed stores its argparse namespace in model states."""

    ds_name = "argparse.Namespace"


STANDINS: tuple[type[DSEnum] | type[DSObject], ...] = (
    ZeroStageEnum,
    LossScaler,
    DynamicLossScaler,
    FragmentAddress,
    Namespace,
)
