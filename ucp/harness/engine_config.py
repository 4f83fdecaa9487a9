"""The DeepSpeed config a harness rank starts its engine with (``ucp.harness.worker``)."""

from __future__ import annotations

import logging

from ucp.harness.model import tp_layer_specs
from ucp.harness.spec import RunSpec

__all__ = ["ds_config"]

logger = logging.getLogger(__name__)


def ds_config(spec: RunSpec) -> dict:
    """The DeepSpeed config of a harness run: its stage, dtype, offload and ZeRO features as ``spec`` names them."""
    zero: dict = {"stage": spec.stage}
    if spec.stage == 3:
        zero["stage3_param_persistence_threshold"] = spec.persistence_threshold
    if spec.sub_group_size:
        zero["sub_group_size"] = spec.sub_group_size
    if spec.hpz:
        zero["zero_hpz_partition_size"] = spec.hpz
    if spec.mics:
        zero["mics_shard_size"] = spec.mics
    if spec.round_robin:
        zero["round_robin_gradients"] = True
    if spec.offload:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": _swap_folder()} if spec.nvme else {"device": "cpu"}
    if spec.offload_param:
        zero["offload_param"] = {"device": "nvme", "nvme_path": _swap_folder()} if spec.nvme else {"device": "cpu"}
    if spec.zenflow:
        # the top quarter of each matrix's columns updated every step, the rest every `zenflow` steps;
        # overlap_step's optimizer process cannot start on CPU/gloo ranks (its second rendezvous fails)
        zero["zenflow"] = {
            "topk_ratio": 0.25,
            "select_strategy": "step",
            "select_interval": spec.zenflow,
            "update_interval": spec.zenflow,
            "full_warm_up_rounds": 0,
            "overlap_step": False,
        }
    force = spec.offload and spec.optimizer != "ds-cpu-adam"  # DeepSpeed's other CPU optimizers are client ones
    config: dict = {
        "train_micro_batch_size_per_gpu": spec.global_batch // spec.dp,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "bf16": {"enabled": spec.dtype == "bf16"},
        **({"fp16": _fp16_config(spec)} if spec.dtype == "fp16" else {}),
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        **({"zero_force_ds_cpu_optimizer": False} if force else {}),
    }
    if spec.optimizer == "ds-muon":
        # MuonWithAuxAdam: Muon on the matrices, Adam (DeepSpeed's FusedAdam) on the rest
        params = {"lr": spec.lr, "momentum": 0.95, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}
        config["optimizer"] = {"type": "Muon", "params": params}
        zero["reduce_scatter"] = False  # DeepSpeed 0.19.8 refuses Muon with reduce scatter
    if spec.zenflow:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": spec.lr, "betas": [0.9, 0.95], "weight_decay": 0.1}}
    if spec.master == "fp16":
        config["fp16"]["fp16_master_weights_and_grads"] = True
    elif spec.master != "fp32":
        config["bf16"]["bf16_master_weights_and_grads"] = True
        config["bf16"]["bf16_optimizer_states"] = spec.master == "bf16-states"
    if spec.grad_accum_dtype:
        config["data_types"] = {"grad_accum_dtype": spec.grad_accum_dtype}
    if spec.tp > 1:
        config["tensor_parallel"] = {
            "autotp_size": spec.tp,
            "partition_config": {"use_default_specs": False, "layer_specs": tp_layer_specs(spec.model)},
        }
    config.update(spec.ds_config or {})
    if spec.load is not None and spec.load.kind == "ds-universal":
        config["checkpoint"] = {"load_universal": True}
    return config


def _swap_folder() -> str:
    """A folder of this rank for ZeRO-Infinity's NVMe swap files, removed when the rank exits."""
    import atexit
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="ucp-nvme-")
    atexit.register(shutil.rmtree, folder, True)
    return folder


def _fp16_config(spec: RunSpec) -> dict:
    """Dynamic loss scaling that halves the scale on every overflow (hysteresis 1), from 2**loss_scale_power:
    a high power makes the first steps overflow and be skipped, as a real fp16 run's first steps do."""
    return {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": spec.loss_scale_power,
        "loss_scale_window": 1000,
        "hysteresis": 1,
        "min_loss_scale": 1,
    }
