"""Every optimizer flavour ucp knows, by name (:data:`FLAVOURS`; the table in :mod:`ucp.model.flavours`' docstring
says what each keeps where)."""

from __future__ import annotations

import logging
from typing import Any

from ucp.model.optimizer_flavour import ADAM_KEYS, Flavour

__all__ = ["FLAVOURS"]

logger = logging.getLogger(__name__)


def _torch(name: str, cls: str, keys: set[str], more: str = "", **kw: Any) -> Flavour:
    """A torch.optim optimizer beyond Adam: a float32 step tensor per parameter, its own family."""
    what = f"torch.optim.{cls}: float32 step {more}".rstrip()
    return Flavour(
        name,
        True,
        False,
        True,
        what,
        name.removeprefix("torch-"),
        live=(f"torch.optim:{cls}",),
        keys=frozenset(keys),
        **kw,
    )


def _schedule_free(name: str, cls: str, keys: set[str]) -> Flavour:
    """A schedule-free optimizer (facebookresearch/schedule_free): its step ``k`` and weight sums live in the
    group; per parameter ``z``, which a fresh optimizer starts at the weights (so a reset is no zeroing)."""
    what = f"schedulefree.{cls}: int step k, weight_sum and lr_max in the group; z per parameter"
    return Flavour(
        name,
        False,
        True,
        False,
        what,
        name,
        live=(f"schedulefree:{cls}",),
        keys=frozenset(keys),
        step_key="k",
        zero_reset=False,
    )


FLAVOURS: dict[str, Flavour] = {
    f.name: f
    for f in (
        Flavour("torch-adam", True, False, True, "torch.optim.Adam / AdamW: per-parameter float32 step tensor"),
        Flavour(
            "ds-fused-adam",
            True,
            True,
            False,
            "DeepSpeed FusedAdam: per-parameter int step; group['step'] is a stale copy left at 0",
        ),
        Flavour("ds-cpu-adam", True, False, False, "DeepSpeedCPUAdam: per-parameter int step"),
        Flavour("apex-fused-adam", False, True, False, "Apex FusedAdam: one int step per param group"),
        Flavour(
            "torch-sgd",
            False,
            False,
            False,
            "torch.optim.SGD: no step",
            "sgd",
            live=("torch.optim:SGD",),
            keys=frozenset({"momentum_buffer"}),
        ),
        _torch("torch-rmsprop", "RMSprop", {"square_avg", "momentum_buffer", "grad_avg"}),
        _torch(
            "torch-nadam",
            "NAdam",
            {"exp_avg", "exp_avg_sq"},
            "and a 0-dim mu_product per parameter",
            scalars={"mu_product": 1.0},
        ),
        _torch("torch-radam", "RAdam", {"exp_avg", "exp_avg_sq"}),
        _torch("torch-adamax", "Adamax", {"exp_avg", "exp_inf"}),
        _torch("torch-adagrad", "Adagrad", {"sum"}),
        _torch("torch-adadelta", "Adadelta", {"square_avg", "acc_delta"}),
        _torch("torch-rprop", "Rprop", {"prev", "step_size"}),
        # eta and mu follow from the step and the group's settings alone, so every tensor of a group agrees
        _torch("torch-asgd", "ASGD", {"ax"}, "and 0-dim eta and mu per parameter", scalars={"eta": "lr", "mu": 1.0}),
        _torch(
            "torch-adafactor",
            "Adafactor",
            {"variance", "row_var", "col_var"},
            "(its variance is factored on the matrices it sees whole)",
            factored=True,
        ),
        Flavour(
            "hf-adafactor",
            True,
            False,
            False,
            "transformers' Adafactor (Trainer's optim='adafactor'): int step; RMS recomputed at every step",
            "hf-adafactor",
            live=("transformers.optimization:Adafactor",),
            keys=frozenset({"exp_avg", "exp_avg_sq", "exp_avg_sq_row", "exp_avg_sq_col"}),
            derived=("RMS",),
            factored=True,
        ),
        _schedule_free("sf-adamw", "AdamWScheduleFree", {"z", "exp_avg_sq"}),
        _schedule_free("sf-radam", "RAdamScheduleFree", {"z", "exp_avg_sq"}),
        _schedule_free("sf-sgd", "SGDScheduleFree", {"z"}),
        Flavour(
            "ds-cpu-adagrad",
            True,
            False,
            False,
            "DeepSpeedCPUAdagrad: int step; exp_avg_sq is its running sum of squared gradients",
            "ds-adagrad",
            live=("deepspeed.ops.adagrad:DeepSpeedCPUAdagrad",),
            keys=frozenset({"exp_avg_sq"}),
        ),
        Flavour(
            "ds-lion",
            True,
            False,
            False,
            "DeepSpeed FusedLion / DeepSpeedCPULion: int step",
            "lion",
            live=("deepspeed.ops.lion:FusedLion", "deepspeed.ops.lion:DeepSpeedCPULion"),
            # ZeRO-3's offload path (0.19.8) gives it an exp_avg_sq as well, which Lion never reads
            keys=frozenset({"exp_avg", "exp_avg_sq"}),
        ),
        Flavour(
            "ds-muon",
            True,
            True,
            False,
            "DeepSpeed MuonWithAuxAdam: momentum_buffer on Muon groups (no step); FusedAdam moments, int step "
            "per parameter and a stale group copy on the others",
            "muon",
            live=("deepspeed.runtime.zero.muon.muon_optimizer:MuonWithAuxAdam",),
            keys=ADAM_KEYS | {"momentum_buffer"},
        ),
        Flavour(
            "ds-muon-torch-adam",
            True,
            False,
            True,
            "DeepSpeed MuonWithAuxAdam with torch_adam: Muon groups as ds-muon; torch AdamW's float step tensors",
            "muon",
            keys=ADAM_KEYS | {"momentum_buffer"},
        ),
    )
}
