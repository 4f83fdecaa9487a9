"""DeepSpeed's model-states files: the fields every source reads from them, checked, once.

What a parameter is (optimized, frozen, tied, a buffer), the model dtype, the engine counters and
the client state all come from ``*model_states.pt``; each reading lives here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ucp.deepspeed.fields import as_int, check_name, need_list, need_mapping, need_tensor, tensor_shape
from ucp.errors import InputError
from ucp.io.torchfile import TorchFile
from ucp.model.detect import mics_shard_size
from ucp.model.partition import zero3_rank_span
from ucp.model.records import dtype_name

__all__ = [
    "zero3_frozen_fragment",
    "check_model_states",
    "DS_MODEL_KEYS",
    "client_state",
    "engine_counters",
    "EXCLUDED_FROZEN_NOTE",
    "frozen_excluded",
    "model_dtype",
    "model_extras",
    "module_buffers",
    "module_ties",
    "module_weight",
    "zero12_frozen_names",
    "zero12_frozen_values",
]


#: Keys DeepSpeed itself writes into model-states files; anything else is the user's client state.
DS_MODEL_KEYS = frozenset(
    {
        "module",
        "buffer_names",
        "optimizer",
        "param_shapes",
        "frozen_param_shapes",
        "shared_params",
        "frozen_param_fragments",
        "lr_scheduler",
        "data_sampler",
        "random_ltd",
        "sparse_tensor_module_names",
        "skipped_steps",
        "global_steps",
        "global_samples",
        "dp_world_size",
        "mp_world_size",
        "ds_config",
        "ds_version",
        "checkpoint_parallel_dimensions",
        "universal_checkpoint_info",
        "ds_autoep_layers",
        "num_experts",
    }
)


def model_dtype(model_states: Mapping[str, Any], shapes: Any, *, files_bf16: bool) -> str:
    """The model's weight dtype: read off a parameter placeholder, else from the config."""
    module = model_states.get("module") or {}
    if not isinstance(module, Mapping):
        module = {}
    names = [n for group in (shapes or []) if isinstance(group, Mapping) for n in group]
    for name in names:
        value = module.get(name)
        if torch.is_tensor(value) and value.is_floating_point():
            return dtype_name(value.dtype)
    config = model_states.get("ds_config") or {}
    if not isinstance(config, Mapping):
        config = {}

    def enabled(key: str) -> bool:
        section = config.get(key) or {}
        return isinstance(section, Mapping) and bool(section.get("enabled"))

    if files_bf16 or enabled("bf16"):
        return "bf16"
    if enabled("fp16"):
        return "fp16"
    return "fp32"


def engine_counters(model_states: Mapping[str, Any]) -> dict[str, Any]:
    def count(key: str) -> int | None:
        value = model_states.get(key)
        return None if value is None else as_int(value, key)

    return {
        "global_steps": count("global_steps") or 0,
        "skipped_steps": count("skipped_steps") or 0,
        "global_samples": count("global_samples"),
        "iteration": count("iteration"),
    }


def client_state(model_states: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in model_states.items() if k not in DS_MODEL_KEYS}


def module_weight(
    model_states: Mapping[str, Any], name: str, shape: tuple[int, ...], file_name: str
) -> torch.Tensor | None:
    """An optimized parameter's low-precision weight as the model-states file's ``module`` holds it (ZeRO-1/2
    save whole weights there), checked against its shape; None when the module does not hold it."""
    module = model_states.get("module")
    value = module.get(name) if isinstance(module, Mapping) else None
    if value is None:
        return None
    value = need_tensor(value, f"{file_name}: weight {name!r}")
    if tuple(value.shape) != tuple(shape):
        raise InputError(f"{file_name}: weight {name!r} has shape {tuple(value.shape)}, its master {tuple(shape)}")
    return value


def module_buffers(model_states: Mapping[str, Any], file_name: str) -> dict[str, torch.Tensor]:
    """The persistent buffers DeepSpeed keeps in a model-states file's ``module``."""
    module = model_states.get("module") or {}
    out = {}
    for name in model_states.get("buffer_names") or []:
        if name in module:
            value = need_tensor(module[name], f"{file_name}: buffer {name!r}", floating=False)
            out[name] = value.detach().clone()
    return out


def model_extras(model_states: Mapping[str, Any], zero: Mapping[str, Any] | None) -> dict[str, Any]:
    """Scheduler, sampler, client state and loss-scaler fields, as every reader's ``extras``."""
    out = {
        "lr_scheduler": model_states.get("lr_scheduler"),
        "data_sampler": model_states.get("data_sampler"),
        "random_ltd": model_states.get("random_ltd"),
        "client_state": client_state(model_states),
    }
    for key in ("loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad"):
        if zero is not None and key in zero:
            value = zero.get(key)
            if key in ("dynamic_loss_scale", "overflow") and not isinstance(value, (bool, int, type(None))):
                raise InputError(f"the optimizer state's {key} is a {type(value).__name__}, not a flag: file damaged")
            out[key] = value
    return out


def zero12_frozen_names(
    model_states: Mapping[str, Any], optimized: Iterable[str], tied: Iterable[str], buffer_names: Iterable[str]
) -> list[str]:
    """Parameters outside ZeRO-1/2's flat groups: stage 2 lists them (frozen_param_shapes); stage 1 leaves
    them in ``module`` only, among the optimized weights, the tied aliases and the buffers. A ``module``
    entry that is none of these is a parameter too, even when a list is present: nothing is dropped
    because one field was trimmed."""
    listed = list(model_states.get("frozen_param_shapes") or {})
    skip = set(optimized) | set(tied) | set(buffer_names) | set(listed)
    return listed + [k for k in (model_states.get("module") or {}) if k not in skip]


def _view(tensor: torch.Tensor) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """What makes two saved tensors one tensor: the same first byte, shape and strides."""
    return tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride())


def module_ties(model_states: Mapping[str, Any], optimized: Iterable[str]) -> dict[str, str]:
    """Tied aliases as the file shows them: ``shared_params``, and every other ``module`` entry that is the
    very bytes of an optimized parameter (DeepSpeed 0.19.8 records shared_params on TP rank 0 only)."""
    module = model_states.get("module") or {}
    optimized = set(optimized)
    owners = {_view(v): k for k, v in module.items() if k in optimized and torch.is_tensor(v) and v.numel()}
    found = {
        k: owners[_view(v)]
        for k, v in module.items()
        if k not in optimized and torch.is_tensor(v) and v.numel() and _view(v) in owners
    }
    return {**found, **(model_states.get("shared_params") or {})}


def zero12_frozen_values(
    model_states: Mapping[str, Any],
    optimized: Iterable[str],
    tied: Iterable[str],
    buffer_names: Iterable[str],
    file_name: str,
) -> dict[str, torch.Tensor]:
    """Every frozen parameter of a ZeRO-1/2 checkpoint in its shape and saved dtype: from
    ``frozen_param_fragments`` (stage 2) or ``module`` (stage 1, or a stage-2 entry not listed)."""
    if not isinstance(model_states.get("module"), Mapping):
        raise InputError(f"{file_name} has no module state dict: not a DeepSpeed model-states file")
    if not isinstance(model_states.get("buffer_names"), list):
        raise InputError(f"{file_name} has no buffer_names list: its buffers cannot be told from frozen parameters")
    module = model_states["module"]
    fragments = model_states.get("frozen_param_fragments") or {}
    listed = model_states.get("frozen_param_shapes") or {}
    out: dict[str, torch.Tensor] = {}
    for pname in zero12_frozen_names(model_states, optimized, tied, buffer_names):
        check_name(pname, f"{file_name}: frozen parameters")
        value = fragments.get(pname, module.get(pname))
        if value is None:
            raise InputError(
                f"{file_name} holds no values for frozen parameter {pname!r} (neither in "
                "frozen_param_fragments nor in module)"
            )
        value = need_tensor(value, f"{file_name}: frozen parameter {pname!r}")
        shape = tensor_shape(listed[pname]) if pname in listed else tuple(value.shape)
        if value.numel() != math.prod(shape):
            raise InputError(
                f"{file_name}: frozen parameter {pname!r} holds {value.numel()} elements, its shape "
                f"{shape} needs {math.prod(shape)}"
            )
        out[pname] = value.reshape(shape)
    return out


def check_model_states(obj: Any, file_name: str, what: str, *, shapes: bool = True) -> Mapping[str, Any]:
    """The fields of a model-states file that every source reads, checked for type before use: its
    ``param_shapes`` (``what`` says which file it should be when they are missing; ``shapes=False``: a
    stage-0 file, which has none), the frozen, module, tied and buffer fields and the config."""
    if not isinstance(obj, Mapping) or (shapes and obj.get("param_shapes") is None):
        raise InputError(f"{file_name} has no param_shapes: {what}")
    for group in need_list(obj.get("param_shapes") or [], f"{file_name}: param_shapes"):
        for pname in need_mapping(group, f"{file_name}: a param_shapes entry"):
            check_name(pname, f"{file_name}: param_shapes")
    for key in ("frozen_param_shapes", "frozen_param_fragments", "module", "shared_params"):
        if obj.get(key) is not None:
            need_mapping(obj[key], f"{file_name}: {key}")
    for pname in obj.get("frozen_param_shapes") or {}:
        check_name(pname, f"{file_name}: frozen_param_shapes")
    if obj.get("buffer_names") is not None:
        names = need_list(obj["buffer_names"], f"{file_name}: buffer_names")
        if not all(isinstance(n, str) for n in names):
            raise InputError(f"{file_name}: buffer_names holds a name that is not a string")
    tied = obj.get("shared_params") or {}
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in tied.items()):
        raise InputError(f"{file_name}: shared_params maps names that are not strings")
    if not isinstance(obj.get("ds_config") or {}, Mapping):
        raise InputError(f"{file_name}: ds_config is a {type(obj['ds_config']).__name__}, not a dict")
    return obj


def zero3_frozen_fragment(tf: TorchFile, name: str, numel: int, dp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s part of a frozen ZeRO-3 parameter (its model-states file's
    ``frozen_param_fragments``), checked to hold at least the rank's span of ``numel``."""
    start, end = zero3_rank_span(numel, dp, rank)
    fragment = (tf.obj.get("frozen_param_fragments") or {}).get(name)
    if fragment is None:
        raise InputError(f"{tf.path.name} has no fragment of frozen parameter {name!r}")
    fragment = need_tensor(fragment, f"{tf.path.name}: fragment of frozen parameter {name!r}")
    if fragment.numel() < end - start:
        config = tf.obj.get("ds_config")
        zero = config.get("zero_optimization") if isinstance(config, Mapping) else None
        params = zero.get("offload_param") if isinstance(zero, Mapping) else None
        swapped = isinstance(params, Mapping) and params.get("device") == "nvme"
        why = (
            ": the run swapped its parameters to NVMe (offload_param.device=nvme), and DeepSpeed 0.19.8 saves a "
            "swapped frozen parameter as a placeholder, not its values; save with exclude_frozen_parameters=True "
            "(the restored run keeps its own frozen weights), or with offload_param on cpu"
            if swapped
            else ""
        )
        raise InputError(
            f"{tf.path.name}: fragment of {name!r} holds {fragment.numel()} elements, needs {end - start}{why}"
        )
    return fragment


#: what ``ucp inspect`` says of a checkpoint saved with ``exclude_frozen_parameters``
EXCLUDED_FROZEN_NOTE = (
    "saved with exclude_frozen_parameters: the model's frozen parameters (a PEFT/LoRA base) are not in this "
    "checkpoint; a restored run keeps its own (load with load_module_strict=False, or ucp.restore strict=False)"
)


def frozen_excluded(model_states: Mapping[str, Any], stage: int) -> bool:
    """Whether a ZeRO-2/3 save used ``exclude_frozen_parameters=True`` (PEFT/LoRA runs): DeepSpeed then writes
    ``frozen_param_shapes = None`` (an empty dict when the model has no frozen parameter), and the frozen
    weights are nowhere in the checkpoint. At ZeRO-1 nothing in the files tells."""
    return stage in (2, 3) and "frozen_param_shapes" in model_states and model_states["frozen_param_shapes"] is None


def mics_replicas(model_states: Mapping[str, Any], ds_config: Mapping[str, Any], partitions: int, file: str) -> int:
    """How many copies of its sharded state a ZeRO-3 run kept: 1, or for MiCS (``mics_shard_size`` S) its
    ranks over S. MiCS shards parameters and optimizer state over groups of S ranks and replicates them over
    the rest; only the first group saves, so the folder holds S rank files while ``dp_world_size`` counts
    every rank. Anything else is refused: ZeRO-3 files read as MiCS ones, or the reverse, would be cut wrong."""
    shard = mics_shard_size(ds_config)
    if not shard:
        return 1
    world = as_int(model_states.get("dp_world_size"), f"{file}: dp_world_size")
    if shard != partitions or world < shard or world % shard:
        raise InputError(
            f"{file}: a MiCS checkpoint (mics_shard_size={shard}) of {world} ranks should hold {shard} rank files "
            f"and a multiple of {shard} ranks, it holds {partitions}"
        )
    return world // shard


def mics_note(shard: int, replicas: int) -> str:
    """What ``ucp inspect`` and every output say of a MiCS source."""
    return (
        f"MiCS (mics_shard_size={shard}): the run's {shard * replicas} ranks kept {replicas} copies of state "
        f"sharded over {shard}; read from the first shard group's {shard} files; ucp writes plain ZeRO "
        "(DeepSpeed 0.19.8 has no MiCS and cannot load these files itself)"
    )
