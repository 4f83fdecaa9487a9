"""A live engine without ZeRO (stage 0, DeepSpeed's default): every rank holds the whole model and optimizer.

fp32: the optimizer is the client's own, over the module's parameters. bf16 without ZeRO: DeepSpeed 0.19.8
wraps it in FP16_UnfusedOptimizer, which steps fp32 copies (``fp32_groups``, in step with the module's
``fp16_groups``): the masters and optimizer state go to the copies and the module takes them cast, as its
own ``load_state_dict`` leaves them. fp16 without ZeRO keeps a loss scale in the wrapper's own fields, which
ucp does not set yet: refused in one line.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ucp.errors import InputError
from ucp.model.records import ParamState, Reader
from ucp.targets.engine.common import check_names
from ucp.targets.engine.named import load_named

__all__ = ["restore_zero0"]

#: the wrappers DeepSpeed puts around the client optimizer without ZeRO, whose fp32 copies ucp fills
_FP32_COPIES = ("FP16_UnfusedOptimizer",)


def restore_zero0(
    engine: Any,
    reader: Reader,
    *,
    optimizer: str | None,
    load_optimizer_states: bool,
    strict: bool,
    step_of: Callable[[ParamState], int] | None = None,
) -> None:
    """Load ``reader``'s weights (and optimizer state) into a live stage-0 engine on this rank."""
    check_names(engine, reader, strict=strict)
    opt = engine.optimizer
    module: dict[str, torch.Tensor] = dict(engine.module.named_parameters())
    wrapper = type(opt).__name__
    if wrapper in _FP32_COPIES:
        if getattr(opt, "low_precision_dtype", torch.bfloat16) != torch.bfloat16:
            raise InputError(
                "fp16 without ZeRO keeps its loss scale in FP16_UnfusedOptimizer's own fields, which ucp does not "
                "restore: use ZeRO-1/2/3 (zero_optimization.stage) or bf16"
            )
        copies: dict[int, torch.Tensor] = {
            id(lp): hp
            for lp_group, hp_group in zip(opt.fp16_groups, opt.fp32_groups)
            for lp, hp in zip(lp_group, hp_group)
        }
        named = {name: copies.get(id(param), param) for name, param in module.items()}
        inner = opt.optimizer
    elif isinstance(opt, torch.optim.Optimizer):
        named, inner = module, opt
    else:
        raise InputError(
            f"{wrapper} is not an optimizer ucp restores without ZeRO (the client's torch optimizer, or "
            "FP16_UnfusedOptimizer for bf16)"
        )
    load_named(
        named, inner if load_optimizer_states else None, reader, flavour=optimizer, strict=strict, step_of=step_of
    )
    with torch.no_grad():
        for name, param in module.items():
            if named[name] is not param:  # the module's bf16 weight from its restored fp32 copy
                param.copy_(named[name].to(param.dtype))
