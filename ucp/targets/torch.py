"""Universal -> a plain PyTorch model and optimizer (no DeepSpeed at all).

Weights come from the fp32 masters (cast to each parameter's dtype), moments and steps go into
``optimizer.state[param]`` where the optimizer's flavour reads them, and each param group takes the
hyperparameters of the checkpoint group that holds its members.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from ucp.errors import InputError
from ucp.model import flavours
from ucp.model.detect import detect_live
from ucp.model.records import Reader
from ucp.sources import opened
from ucp.targets.engine import match_groups

__all__ = ["restore_torch"]

logger = logging.getLogger(__name__)


def restore_torch(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    universal_dir: str | os.PathLike | Reader,
    *,
    flavour: str | None = None,
    scheduler: Any = None,
    strict: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint into a plain torch model and optimizer (no DeepSpeed needed).

    Args:
        model: the model; its parameter names must be the checkpoint's (``strict``) or a superset/subset.
        optimizer: the new run's optimizer, or None for weights only. Its param groups take the
            checkpoint's hyperparameters (lr, betas, eps, weight decay: the checkpoint's lr replaces
            the one the optimizer was built with, and a log line says so); its own switches
            (foreach, fused, capturable) stay.
        universal_dir: any checkpoint ucp reads (universal directory, DeepSpeed ZeRO, DCP), or a reader.
        flavour: the optimizer flavour, when it cannot be told from the optimizer object.
        scheduler: an lr scheduler to load the checkpoint's scheduler state into.
        strict: the parameter names must match exactly.

    Returns:
        The client state DeepSpeed saved with the checkpoint.

    Example::

        model = build_model(); opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ucp.restore_torch(model, opt, "universal/")
    """
    with opened(universal_dir) as reader:
        facts = reader.facts
        params = dict(model.named_parameters())  # tied aliases collapse to their owner
        expected = {m.name for m in facts.params}
        if strict and set(params) != expected:
            extra, lost = sorted(set(params) - expected), sorted(expected - set(params))
            raise InputError(
                f"parameters differ: model has {extra[:3]} not in the checkpoint, checkpoint has "
                f"{lost[:3]} not in the model; pass strict=False to restore the common ones"
            )
        names_of = {id(p): n for n, p in params.items()}
        live_members = [
            [names_of[id(p)] for p in g["params"] if id(p) in names_of]
            for g in (optimizer.param_groups if optimizer else [])
        ]
        matched = match_groups(reader, live_members, strict=strict) if optimizer else []
        kind = flavours.get(flavour) if flavour else detect_live(optimizer) if optimizer else None
        for name, param in params.items():
            if name not in expected:
                continue
            state = reader.read(name, moments=optimizer is not None)
            with torch.no_grad():
                param.copy_(state.fp32.to(param.dtype))
            if optimizer is not None and kind is not None and state.optim and param.requires_grad:
                index = facts.param(name).group
                new = kind.make_state(
                    {k: v.to(param.device) for k, v in state.optim.items()},
                    int(state.step or 0),
                    state.scalars,
                    with_step=index is None or kind.group_has_step(facts.groups[index].raw),
                )
                if torch.is_tensor(new.get("step")) and _on_device(optimizer, param):
                    new["step"] = new["step"].to(param.device)
                optimizer.state[param] = new
        for g, group in enumerate(optimizer.param_groups if optimizer else []):
            source = matched[g]
            if source is None or kind is None:
                continue
            meta = facts.groups[source]
            if group.get("lr") != meta.hyper.lr:
                logger.info("param group %d: lr %s from the checkpoint replaces %s", g, meta.hyper.lr, group.get("lr"))
            group.update(
                {
                    k: v
                    for k, v in kind.update_group(group, meta.hyper, int(meta.step or 0), meta.raw).items()
                    if k != "params"
                }
            )
        buffers = reader.buffers()
        for name, buf in model.named_buffers():
            if name in buffers:
                buf.copy_(buffers[name].to(buf.dtype))
        extras = reader.extras()
        if scheduler is not None and extras.get("lr_scheduler") is not None:
            scheduler.load_state_dict(extras["lr_scheduler"])
        return dict(extras.get("client_state") or {})


def _on_device(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> bool:
    """torch Adam keeps the step on the parameter's device when capturable or fused."""
    for group in optimizer.param_groups:
        if any(p is param for p in group["params"]):
            return bool(group.get("capturable") or group.get("fused"))
    return False
