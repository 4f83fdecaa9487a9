"""The optimizer a harness run names (``RunSpec.optimizer``), built over the run's param groups."""

from __future__ import annotations

import logging

import torch

from ucp.harness.spec import RunSpec

__all__ = ["make_optimizer"]

logger = logging.getLogger(__name__)


def make_optimizer(spec: RunSpec, groups: list[dict]):
    """The optimizer ``spec`` names, over ``groups`` (None where DeepSpeed builds it from its config)."""
    betas = (0.9, 0.95)
    if spec.optimizer == "torch-adamw":
        return torch.optim.AdamW(groups, lr=spec.lr, betas=betas)
    if spec.optimizer == "torch-adam":
        return torch.optim.Adam(groups, lr=spec.lr, betas=betas, weight_decay=0.0)
    if spec.optimizer in ("torch-adamw-fused", "torch-adamw-capturable"):
        switch = spec.optimizer.removeprefix("torch-adamw-")
        return torch.optim.AdamW(groups, lr=spec.lr, betas=betas, **{switch: True})
    if spec.optimizer == "apex-fused-adam":
        from apex.optimizers import FusedAdam as ApexFusedAdam

        return ApexFusedAdam(groups, lr=spec.lr, betas=betas, adam_w_mode=True)
    if spec.optimizer == "ds-fused-adam":
        from deepspeed.ops.adam import FusedAdam

        return FusedAdam(groups, lr=spec.lr, betas=betas, adam_w_mode=True)
    if spec.optimizer == "ds-cpu-adam" and spec.zenflow:
        return None  # ZenFlow takes its CPU Adam from the config only
    if spec.optimizer == "ds-cpu-adam":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=spec.lr, betas=betas, adamw_mode=True)
    if spec.optimizer == "ds-muon":
        return None  # DeepSpeed builds it from the config (it must tag each parameter use_muon)
    return _other_optimizer(spec, groups, betas)


def _other_optimizer(spec: RunSpec, groups: list[dict], betas: tuple[float, float]):
    """The optimizers beyond Adam, each with the options that give it the most state to carry."""
    lr = spec.lr
    if spec.optimizer == "torch-adamw-amsgrad":
        return torch.optim.AdamW(groups, lr=lr, betas=betas, amsgrad=True)
    if spec.optimizer == "torch-sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=0.9, nesterov=True)
    if spec.optimizer == "torch-rmsprop":
        return torch.optim.RMSprop(groups, lr=lr * 0.1, momentum=0.5, centered=True)
    if spec.optimizer == "torch-nadam":
        return torch.optim.NAdam(groups, lr=lr, betas=betas)
    if spec.optimizer == "torch-radam":
        return torch.optim.RAdam(groups, lr=lr, betas=betas)
    if spec.optimizer == "torch-adamax":
        return torch.optim.Adamax(groups, lr=lr, betas=betas)
    if spec.optimizer == "torch-adagrad":
        return torch.optim.Adagrad(groups, lr=lr)
    if spec.optimizer == "ds-cpu-adagrad":
        from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad

        return DeepSpeedCPUAdagrad(groups, lr=lr)
    if spec.optimizer == "ds-cpu-lion":
        from deepspeed.ops.lion import DeepSpeedCPULion

        return DeepSpeedCPULion(groups, lr=lr * 0.1, betas=betas)
    if spec.optimizer == "torch-adadelta":
        return torch.optim.Adadelta(groups, lr=lr * 100)
    if spec.optimizer == "torch-rprop":
        return torch.optim.Rprop(groups, lr=lr)
    if spec.optimizer == "torch-asgd":
        return torch.optim.ASGD(groups, lr=lr, t0=1)  # mu leaves 1 after the first step
    if spec.optimizer == "torch-adafactor":
        return torch.optim.Adafactor(groups, lr=lr)
    if spec.optimizer in ("sf-adamw", "sf-sgd"):
        import schedulefree

        if spec.optimizer == "sf-sgd":
            return schedulefree.SGDScheduleFree(groups, lr=lr, momentum=0.9, warmup_steps=2)
        return schedulefree.AdamWScheduleFree(groups, lr=lr, betas=betas, warmup_steps=2)
    if spec.optimizer == "hf-adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(groups, lr=lr, beta1=0.9, relative_step=False, scale_parameter=False)
    raise SystemExit(f"unknown optimizer {spec.optimizer}")
