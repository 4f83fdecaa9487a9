"""Small readers of DeepSpeed checkpoint fields that every ZeRO stage shares."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ucp.errors import InputError
from ucp.records import dtype_name
from ucp.torchfile import TorchFile

__all__ = ["optimizer_block", "stage_of", "partition_count", "tensor_shape", "model_dtype", "engine_counters",
           "client_state", "DS_MODEL_KEYS"]

#: Keys DeepSpeed itself writes into model-states files; anything else is the user's client state.
DS_MODEL_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
    "checkpoint_parallel_dimensions", "universal_checkpoint_info", "ds_autoep_layers", "num_experts",
})


def optimizer_block(tf: TorchFile) -> Mapping[str, Any]:
    """The ZeRO optimizer's dict inside an optim-states file."""
    obj = tf.obj
    block = obj.get("optimizer_state_dict") if isinstance(obj, Mapping) else None
    if not isinstance(block, Mapping):
        raise InputError(f"{tf.path.name} has no optimizer_state_dict: not a ZeRO optim-states file")
    return block


def stage_of(block: Mapping[str, Any]) -> int:
    stage = block.get("zero_stage")
    if stage is None:
        raise InputError("optim-states file does not say its zero_stage")
    return int(stage)


def partition_count(block: Mapping[str, Any]) -> int:
    """DeepSpeed writes an int (ZeRO-3) or one count per param group (ZeRO-1/2)."""
    count = block.get("partition_count")
    if isinstance(count, (list, tuple)):
        if len(set(count)) != 1:
            raise InputError(f"param groups were partitioned differently: partition_count={list(count)}")
        count = count[0]
    if count is None:
        raise InputError("optim-states file does not say its partition_count")
    return int(count)


def tensor_shape(shape: Any) -> tuple[int, ...]:
    try:
        return tuple(int(d) for d in shape)
    except TypeError:
        raise InputError(f"parameter shape {shape!r} is not a sequence of ints") from None


def model_dtype(model_states: Mapping[str, Any], shapes: Any, *, files_bf16: bool) -> str:
    """The model's weight dtype: read off a parameter placeholder, else from the config."""
    module = model_states.get("module") or {}
    names = [n for group in (shapes or []) for n in group]
    for name in names:
        value = module.get(name)
        if torch.is_tensor(value) and value.is_floating_point():
            return dtype_name(value.dtype)
    config = model_states.get("ds_config") or {}
    if files_bf16 or (config.get("bf16") or {}).get("enabled"):
        return "bf16"
    if (config.get("fp16") or {}).get("enabled"):
        return "fp16"
    return "fp32"


def engine_counters(model_states: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "global_steps": int(model_states.get("global_steps") or 0),
        "skipped_steps": int(model_states.get("skipped_steps") or 0),
        "global_samples": None if model_states.get("global_samples") is None else int(model_states["global_samples"]),
        "iteration": None if model_states.get("iteration") is None else int(model_states["iteration"]),
    }


def client_state(model_states: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in model_states.items() if k not in DS_MODEL_KEYS}
