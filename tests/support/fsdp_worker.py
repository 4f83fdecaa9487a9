"""FSDP (version 1 and 2) for the Hugging Face test runs: real Trainer / Accelerate FSDP on gloo CPU ranks.

A run is an FSDP run when its spec has ``extra["fsdp"]`` (absent: DeepSpeed, as before), for example
``{"version": 2, "state_dict_type": "SHARDED_STATE_DICT"}``. Keys of that dict:

* ``version``: 1 or 2 (default 2);
* ``state_dict_type``: ``"SHARDED_STATE_DICT"`` (DCP folders, the default) or ``"FULL_STATE_DICT"``;
* ``use_orig_params``: FSDP1 only (default True, Trainer's default);
* ``fsdp1_optim_fix``: opt in to the workaround for accelerate's FSDP1 SHARDED optimizer load (see
  :func:`enable_cpu_fsdp`); off by default, since tests compare what stock Trainer/Accelerate do.

:func:`tests.support.hf_worker` (Trainer) and :func:`tests.support.accel_worker` (Accelerate) call
:func:`enable_cpu_fsdp` first, then build their run with :func:`trainer_fsdp_config` or :func:`accelerate_plugin`,
check with :func:`assert_fsdp` that FSDP really wraps the model (a silent DDP run fails), and record the live
state with :func:`fsdp_record`, in the same shape as the DeepSpeed records.
"""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = [
    "accelerate_plugin",
    "assert_fsdp",
    "enable_cpu_fsdp",
    "fsdp_options",
    "fsdp_record",
    "fsdp_state",
    "fsdp_steps",
    "trainer_fsdp_config",
]

#: the decoder layer FSDP wraps as one unit (TRANSFORMER_BASED_WRAP)
_LAYER = "LlamaDecoderLayer"
#: keys of ``extra["fsdp"]`` the harness reads itself; the rest is FSDP configuration
_HARNESS_KEYS = ("fsdp1_optim_fix",)


def fsdp_options(extra: dict[str, Any]) -> dict[str, Any] | None:
    """``extra["fsdp"]`` with its defaults filled in, or None for a DeepSpeed run."""
    options = extra.get("fsdp")
    if options is None:
        return None
    options = {"version": 2, "state_dict_type": "SHARDED_STATE_DICT", **options}
    if options["version"] not in (1, 2):
        raise ValueError(f"fsdp version {options['version']!r}: 1 or 2")
    if options["state_dict_type"] not in ("SHARDED_STATE_DICT", "FULL_STATE_DICT"):
        raise ValueError(f"state_dict_type {options['state_dict_type']!r}: SHARDED_STATE_DICT or FULL_STATE_DICT")
    return options


def enable_cpu_fsdp(options: dict[str, Any]) -> None:
    """Make transformers / accelerate run real FSDP on this gloo CPU rank (call first, before any
    Trainer, TrainingArguments or Accelerator exists).

    The patches only concern *where and how* this process runs FSDP and loads; none of them changes what
    is written to disk: the checkpoint folders (file names, DCP keys and chunks, ``.bin`` contents) are
    those a GPU run of the same configuration writes.

    1. ``ACCELERATE_TORCH_DEVICE=cpu``: accelerate's ``PartialState.set_device`` keeps the CPU.
    2. The gloo process group is initialised here, before accelerate looks for one.
    3. ``PartialState._prepare_backend`` reports a multi-device run (``MULTI_GPU``) on gloo: without CUDA
       accelerate picks ``NO`` (or ``MULTI_CPU`` with ``use_cpu=True``), and only the multi-device branch of
       ``AcceleratorState`` turns an FSDP plugin into ``DistributedType.FSDP``; otherwise the run silently
       becomes DDP. (Callers pass ``use_cpu=False``; FSDP1 also needs ``sync_module_states=False``, which
       the configurations below set, since it would move modules to a GPU.)
    4. FSDP1 + FULL_STATE_DICT only: accelerate forces ``FullStateDictConfig(offload_to_cpu=True,
       rank0_only=True)``, with which FSDP1's state-dict hook segfaults on a CPU-only run (torch
       ``fsdp/_state_dict_utils.py`` ``param_hook``). Both flags read False: every rank gathers the full
       dict, rank 0 still writes the same files.
    5. Only with ``fsdp1_optim_fix``: accelerate's FSDP1 SHARDED optimizer load builds its DCP template from
       the fresh optimizer, whose state is empty, so the Adam moments and steps in the folder are silently
       dropped ("Bug 1"). The fix initialises the optimizer state first (torch DCP's ``_init_optim_state``,
       a zero-lr step) so the template holds every key. Off by default: stock behaviour is what tests see.
    """
    os.environ["ACCELERATE_TORCH_DEVICE"] = "cpu"  # 1
    import torch.distributed as dist

    if not dist.is_initialized():  # 2
        dist.init_process_group("gloo")

    from accelerate.state import PartialState  # 3
    from accelerate.utils import DistributedType

    original = PartialState._prepare_backend

    def _prepare_backend(self: Any, cpu: bool = False, sagemaker_dp: bool = False, backend: str | None = None) -> Any:
        if cpu:
            return original(self, cpu, sagemaker_dp, backend)
        return "gloo", DistributedType.MULTI_GPU

    PartialState._prepare_backend = _prepare_backend

    if options["version"] == 1 and options["state_dict_type"] == "FULL_STATE_DICT":  # 4
        import torch.distributed.fsdp.api as fsdp_api

        # the classes themselves: FSDP checks ``type(config) is FullStateDictConfig``, so no subclass will do
        for cls in (fsdp_api.FullStateDictConfig, fsdp_api.FullOptimStateDictConfig):
            cls.offload_to_cpu = property(lambda self: False, lambda self, value: None)
            cls.rank0_only = property(lambda self: False, lambda self, value: None)

    if options.get("fsdp1_optim_fix"):  # 5
        import accelerate.accelerator
        import accelerate.utils.fsdp_utils
        import transformers.trainer
        from torch.distributed.checkpoint.state_dict import _init_optim_state

        stock = accelerate.utils.fsdp_utils.load_fsdp_optimizer

        def load_fsdp_optimizer(plugin: Any, accelerator: Any, optimizer: Any, *args: Any, **kw: Any) -> Any:
            _init_optim_state(getattr(optimizer, "optimizer", optimizer))
            return stock(plugin, accelerator, optimizer, *args, **kw)

        for module in (accelerate.utils.fsdp_utils, accelerate.accelerator, transformers.trainer):
            module.load_fsdp_optimizer = load_fsdp_optimizer


def trainer_fsdp_config(options: dict[str, Any]) -> dict[str, Any]:
    """TrainingArguments' ``fsdp_config``: wrap each LlamaDecoderLayer, the state dict type asked for."""
    config = {k: v for k, v in options.items() if k not in _HARNESS_KEYS}
    config.update(auto_wrap_policy="TRANSFORMER_BASED_WRAP", transformer_layer_cls_to_wrap=[_LAYER])
    if options["version"] == 1:
        config["sync_module_states"] = "false"
        config["use_orig_params"] = "true" if options.get("use_orig_params", True) else "false"
        config.setdefault("reshard_after_forward", "full_shard")
    return config


def accelerate_plugin(options: dict[str, Any]) -> Any:
    """The FullyShardedDataParallelPlugin of an Accelerate run (the same wrapping as the Trainer runs)."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    kw: dict[str, Any] = dict(
        fsdp_version=options["version"],
        state_dict_type=options["state_dict_type"],
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=[_LAYER],
    )
    if options["version"] == 1:
        kw.update(sync_module_states=False, use_orig_params=bool(options.get("use_orig_params", True)))
    return FullyShardedDataParallelPlugin(**kw)


def assert_fsdp(model: torch.nn.Module, options: dict[str, Any], accelerator: Any) -> None:
    """Fail the rank unless accelerate runs FSDP of the asked version and ``model`` is an FSDP module."""
    from accelerate.utils import DistributedType
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    if accelerator.distributed_type != DistributedType.FSDP:
        raise RuntimeError(f"not an FSDP run: accelerate runs {accelerator.distributed_type}")
    version = options["version"]
    if getattr(accelerator.state.fsdp_plugin, "fsdp_version", 1) != version:
        raise RuntimeError(f"accelerate runs FSDP{accelerator.state.fsdp_plugin.fsdp_version}, the spec asks {version}")
    wanted = FullyShardedDataParallel if version == 1 else FSDPModule
    if not isinstance(model, wanted):
        raise RuntimeError(f"the model is a {type(model).__name__}, not an FSDP{version} module")


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps the torch one


def fsdp_steps(optimizer: Any) -> list[float]:
    """Every step the torch optimizer keeps on this rank (one per parameter, or per flat parameter)."""
    return [float(s["step"]) for s in _inner(optimizer).state.values() if "step" in s]


def _trained_names(model: torch.nn.Module) -> list[str]:
    """Clean Hugging Face names of the trained parameters (no FSDP wrapper prefixes; an FSDP1 flat
    parameter stands for all the parameters it holds)."""
    from torch.distributed.checkpoint.state_dict import _get_fqns

    names: list[str] = []
    for name, param in model.named_parameters():
        if param.requires_grad:
            names.extend(sorted(_get_fqns(model, name)))
    return names


def fsdp_state(model: torch.nn.Module, optimizer: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Full fp32 parameter and optimizer moments of every trained parameter, by its clean name (collective:
    every rank calls). Gathered with torch.distributed.checkpoint.state_dict's full state dicts, without CPU
    offload (FSDP1's offload path segfaults on a CPU-only run). An optimizer without state (before the first
    step, or after accelerate's FSDP1 SHARDED load dropped it) gives the parameters only: asking torch for its
    state dict would first run a zero-lr step to create the state, which would change the run."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    params = get_model_state_dict(model, options=options)
    inner = _inner(optimizer)
    stateful = torch.tensor([1.0 if inner.state else 0.0])
    dist.all_reduce(stateful, op=dist.ReduceOp.MAX)  # every rank takes the same (collective) path
    moments = get_optimizer_state_dict(model, inner, options=options)["state"] if stateful.item() else {}
    state: dict[str, dict[str, torch.Tensor]] = {}
    for name in _trained_names(model):
        entry = {"fp32": params[name]}
        # every elementwise state tensor (AdamW's exp_avg, exp_avg_sq); the 0-d step goes to "steps"
        entry.update({k: v for k, v in moments.get(name, {}).items() if torch.is_tensor(v) and v.dim()})
        state[name] = {k: v.detach().clone().cpu() for k, v in entry.items()}
    return state


def fsdp_record(model: torch.nn.Module, optimizer: Any, options: dict[str, Any]) -> dict[str, Any]:
    """What the DeepSpeed workers record of a live engine, for an FSDP run (collective): ``state``,
    ``steps`` (every optimizer step of this rank), ``weight_decay`` (the groups' values, sorted) and
    ``backend`` ("fsdp1"/"fsdp2")."""
    return {
        "state": fsdp_state(model, optimizer),
        "steps": fsdp_steps(optimizer),
        "weight_decay": sorted({g["weight_decay"] for g in _inner(optimizer).param_groups}),
        "backend": f"fsdp{options['version']}",
    }
