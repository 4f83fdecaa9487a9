"""Inert stand-ins for the few DeepSpeed (and argparse) classes that ZeRO checkpoints pickle, and the Megatron-Core
enums and plain records that Megatron-LM's args in ``common.pt`` hold (megatron.core.safe_globals' list).

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
    "DSStrEnum",
    "STANDINS",
]


class DSEnum(int):
    """An int standing in for a DeepSpeed enum member; pickles back as ``<ds_name>(value)``."""

    ds_name = ""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({int(self)})"


class DSStrEnum(str):
    """A str standing in for an enum member whose value is a string; pickles back as ``<ds_name>(value)``."""

    ds_name = ""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r})"


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


def _enum(name: str, base: type[DSEnum] | type[DSStrEnum] = DSEnum) -> Any:
    """A stand-in class for the enum ``name`` (a dotted path)."""
    return type(name.rpartition(".")[2], (base,), {"ds_name": name, "__module__": __name__})


#: Megatron-LM's args (``common.pt``) and what megatron-core lets torch.load take (megatron/core/safe_globals.py)
MEGATRON_STANDINS: tuple[Any, ...] = (
    _enum("megatron.core.transformer.enums.AttnBackend"),
    _enum("megatron.core.transformer.enums.CudaGraphScope"),
    _enum("megatron.core.enums.ModelType"),
    _enum("megatron.core.rerun_state_machine.RerunState"),
    _enum("megatron.core.rerun_state_machine.RerunMode", DSStrEnum),
    _enum("megatron.core.rerun_state_machine.RerunDiagnostic", DSStrEnum),
    _enum("signal.Signals"),
    type("SimpleNamespace", (DSObject,), {"ds_name": "types.SimpleNamespace", "__module__": __name__}),
    type(
        "OptimizerConfig", (DSObject,), {"ds_name": "megatron.core.optimizer.OptimizerConfig", "__module__": __name__}
    ),
)
for _cls in MEGATRON_STANDINS:
    globals()[_cls.__name__] = _cls  # importable by the name the pickler writes before renaming

STANDINS: tuple[Any, ...] = (
    ZeroStageEnum,
    LossScaler,
    DynamicLossScaler,
    FragmentAddress,
    Namespace,
    *MEGATRON_STANDINS,
)
