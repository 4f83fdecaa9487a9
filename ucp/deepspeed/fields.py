"""DeepSpeed's checkpoint fields: reading them checked, one line per problem.

Every source reads the same model-states and optim-states fields (stage, partition count, shapes,
counters, buffers, scheduler, loss scaler); each check lives here once. A damaged or hand-made
file gets an :class:`~ucp.errors.InputError` naming the file and the field.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ucp.errors import InputError
from ucp.io.torchfile import TorchFile
from ucp.model.records import Facts, dtype_name

__all__ = [
    "SUPPORTED_STAGES",
    "DS_MODEL_KEYS",
    "MALFORMED",
    "as_int",
    "need_mapping",
    "need_list",
    "need_tensor",
    "optimizer_block",
    "check_rank_count",
    "flat_state_scalars",
    "same_scalars",
    "show_scalars",
    "stage_of",
    "partition_count",
    "tensor_shape",
    "model_dtype",
    "engine_counters",
    "client_state",
    "check_name",
    "first_line",
    "sub_group_size",
    "jsonable",
    "build_facts",
    "module_buffers",
    "model_extras",
    "missing_ranks",
    "zero12_frozen_names",
    "zero12_frozen_values",
    "module_ties",
    "STEP_KEY",
    "flat_state_keys",
]

#: Where torch optimizers (and DeepSpeed's) keep a per-tensor step; every other key is state.
STEP_KEY = "step"


#: ZeRO stages whose checkpoints ucp reads.
SUPPORTED_STAGES = (1, 2, 3)

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


def as_int(value: Any, what: str) -> int:
    """An int field of a checkpoint (a Python int, an int-valued tensor or float, a DeepSpeed enum)."""
    if isinstance(value, bool):
        raise InputError(f"{what} is {value!r}, not an integer")
    if torch.is_tensor(value) and value.numel() == 1:
        value = value.item()
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int):
        raise InputError(f"{what} is {value!r:.60}, not an integer")
    return int(value)


def need_mapping(value: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise InputError(
            f"{what} is a {type(value).__name__}, expected a dict: the file is damaged or not from DeepSpeed"
        )
    return value


def need_list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, (list, tuple)):
        raise InputError(
            f"{what} is a {type(value).__name__}, expected a list: the file is damaged or not from DeepSpeed"
        )
    return list(value)


def need_tensor(value: Any, what: str, *, floating: bool = True) -> torch.Tensor:
    if not torch.is_tensor(value) or value.layout != torch.strided or (floating and not value.is_floating_point()):
        kind = f"a {value.dtype} tensor" if torch.is_tensor(value) else f"a {type(value).__name__}"
        raise InputError(
            f"{what} is {kind}, expected a {'floating-point ' if floating else ''}tensor: the file is "
            "damaged or not from DeepSpeed"
        )
    return value


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
    stage = as_int(stage, "zero_stage")
    if stage not in SUPPORTED_STAGES:
        raise InputError(f"zero_stage={stage} is not supported: ucp reads ZeRO stage 1, 2 and 3 checkpoints")
    return stage


def partition_count(block: Mapping[str, Any]) -> int:
    """DeepSpeed writes an int (ZeRO-3) or one count per param group (ZeRO-1/2)."""
    count = block.get("partition_count")
    if isinstance(count, (list, tuple)):
        counts = [as_int(c, "partition_count") for c in count]
        if len(set(counts)) != 1:
            raise InputError(f"param groups were partitioned differently: partition_count={counts}")
        count = counts[0]
    if count is None:
        raise InputError("optim-states file does not say its partition_count")
    count = as_int(count, "partition_count")
    if count < 1:
        raise InputError(f"partition_count={count} is not a positive number of ranks")
    return count


def tensor_shape(shape: Any) -> tuple[int, ...]:
    if torch.is_tensor(shape) or isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise InputError(f"parameter shape {shape!r:.60} is not a sequence of ints")
    dims = tuple(shape)
    if len(dims) > 64 or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
        raise InputError(f"parameter shape {shape!r:.60} is not a sequence of non-negative ints")
    return tuple(int(d) for d in dims)


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


#: What a damaged or hand-made file can raise while its structure is walked; readers turn these
#: into one-line InputErrors and keep the cause for --debug.
MALFORMED = (KeyError, TypeError, ValueError, AttributeError, IndexError, RecursionError, RuntimeError)


def check_name(name: Any, where: str) -> None:
    """Parameter names become folder names later (ucp.universal.folder_for): text only, no NUL."""
    if not isinstance(name, str):
        raise InputError(f"{where} holds a parameter name {name!r:.60} that is not a string")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise InputError(f"{where} holds a parameter name {name!r:.60} that is not valid text") from None
    if not name or "\x00" in name:
        raise InputError(f"{where} holds a parameter name {name!r:.60} that is empty or holds a NUL byte")


def first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0][:160] if lines else ""


def sub_group_size(ds_config: Mapping[str, Any]) -> int | None:
    zero = ds_config.get("zero_optimization") if isinstance(ds_config, Mapping) else None
    if isinstance(zero, Mapping) and zero.get("sub_group_size") is not None:
        return as_int(zero["sub_group_size"], "zero_optimization.sub_group_size")
    return None


def jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)


def build_facts(build: Callable[[], Facts], *, close: Callable[[], None], where: str) -> Facts:
    """Run a reader's fact-building; on any failure close its files first.

    The explicit checks inside ``build`` cover what DeepSpeed writes; the rest of what a damaged or
    hand-made file can hold (MALFORMED) becomes one line naming ``where``, the cause kept for --debug.
    """
    try:
        return build()
    except InputError:
        close()
        raise
    except MALFORMED as err:
        close()
        raise InputError(f"{where} ({type(err).__name__}: {first_line(err)}); rerun with --debug for details") from err
    except BaseException:
        close()
        raise


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


def check_rank_count(
    block: Mapping[str, Any], file: str, found: list[str], rank_file: Callable[[int], str], where: object
) -> None:
    """A rank file's partition_count must match the rank files found in ``where``: missing ones are
    named (a bounded list), extra ones too."""
    try:
        count = partition_count(block)
    except InputError as err:
        raise InputError(f"{file}: {err}") from None
    dp = len(found)
    have = f"{dp} rank file{'s were' if dp > 1 else ' was'} found"
    if count > dp:
        raise InputError(
            f"{missing_ranks(rank_file, dp, count)} missing from {where}: {file} says partition_count={count}, but {have}"
        )
    if count < dp:
        extra = found[count:]
        what = f"{', '.join(extra)} are extra rank files" if len(extra) > 1 else f"{extra[0]} is an extra rank file"
        raise InputError(
            f"{what} in {where}: {file} says partition_count={count}, but {have}; remove the extra files or check "
            "they belong to this run"
        )


def missing_ranks(rank_file: Callable[[int], str], found: int, count: int) -> str:
    """'rank file X is' / 'rank files X, Y, Z and N more are': a bounded list, whatever count claims."""
    names = [rank_file(r) for r in range(found, min(count, found + 3))]
    if count - found > len(names):
        names.append(f"and {count - found - len(names)} more")
    return f"rank files {', '.join(names)} are" if len(names) > 1 else f"rank file {names[0]} is"


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


def _is_scalar(value: Any) -> bool:
    return torch.is_tensor(value) and value.dim() == 0 and value.is_floating_point()


def flat_state_scalars(entry: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The 0-dim floating entries of a flat tensor's optimizer state besides the step (NAdam's
    ``mu_product``): one value for every parameter the flat tensor holds."""
    return {k: v for k, v in entry.items() if k != STEP_KEY and _is_scalar(v)}


def same_scalars(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    """Bit-equal scalars (NaN-safe): what ranks stepped together must hold."""
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def show_scalars(scalars: Mapping[str, torch.Tensor]) -> str:
    return "{" + ", ".join(f"{k}: {v.item()!r}" for k, v in scalars.items()) + "}"


def flat_state_keys(
    entry: Mapping[str, Any], size: int, where: str, expected: tuple[str, ...] | None = None
) -> tuple[str, ...]:
    """The state keys of one flat tensor's optimizer entry, in its order: every key but the step and
    the 0-dim scalars (:func:`flat_state_scalars`) must be a flat floating tensor of the partition's
    ``size`` (elementwise state, which ucp can cut anew), or the checkpoint is refused; nothing is
    ever dropped. ``expected``: what rank 0 holds."""
    keys = tuple(k for k in entry if k != STEP_KEY and not _is_scalar(entry[k]))
    for key in keys:
        value = entry[key]
        if not torch.is_tensor(value) or not value.is_floating_point() or value.dim() != 1 or value.numel() != size:
            kind = (
                f"a {str(value.dtype).replace('torch.', '')} tensor of shape {tuple(value.shape)}"
                if torch.is_tensor(value)
                else f"a {type(value).__name__}"
            )
            raise InputError(
                f"{where}: optimizer state {key!r} is {kind}, not a flat tensor of the partition's "
                f"{size} elements: ucp cannot reshard it elementwise, so it refuses the checkpoint "
                "rather than drop it"
            )
    if expected is not None and keys != expected:
        raise InputError(
            f"{where} holds optimizer state {list(keys)}, rank 0 holds {list(expected)}: ranks from "
            "different runs are mixed"
        )
    return keys
