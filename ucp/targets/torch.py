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
from ucp.model.records import Reader
from ucp.sources import opened
from ucp.targets.engine.common import as_live_names, check_buffers
from ucp.targets.engine.named import stage_named

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

    Everything is checked and read before anything changes (names, shapes, dtypes, param groups, the optimizer's
    family, buffers, the scheduler's state): a failure is a UcpError naming what differs, and leaves the model,
    the optimizer and the scheduler as they were.

    Example::

        model = build_model(); opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ucp.restore_torch(model, opt, "universal/")
    """
    with opened(universal_dir) as source:
        reader = as_live_names(source, model)  # across torch.compile's wrapper
        staged = stage_named(dict(model.named_parameters()), optimizer, reader, flavour=flavour, strict=strict)
        buffers = reader.buffers()
        live_buffers = dict(model.named_buffers())
        check_buffers({n: tuple(b.shape) for n, b in live_buffers.items()}, reader, buffers, strict=False)
        extras = reader.extras()
        if scheduler is not None and extras.get("lr_scheduler") is not None:
            _load_scheduler(scheduler, extras["lr_scheduler"])  # first: the one step that may still refuse
        staged.apply()
        with torch.no_grad():
            for name, buf in live_buffers.items():
                if name in buffers:
                    buf.copy_(buffers[name].to(buf.dtype))
        return dict(extras.get("client_state") or {})


def _load_scheduler(scheduler: Any, state: Any) -> None:
    """The scheduler's state, or one line (and the scheduler as it was) when it does not take it."""
    before = scheduler.state_dict()
    try:
        scheduler.load_state_dict(state)
    except Exception as err:
        scheduler.load_state_dict(before)
        raise InputError(
            f"the checkpoint's lr scheduler state does not load into {type(scheduler).__name__} ({err}); "
            "nothing was restored"
        ) from None
