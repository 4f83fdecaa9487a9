"""Optimizer flavours: the one place that knows where each optimizer keeps its step, its scalars and its settings.

=================  ============  ===========================  ==========================================
flavour            family        step lives in                 state besides the step
=================  ============  ===========================  ==========================================
torch-adam         adam          ``state[p]["step"]`` float    exp_avg, exp_avg_sq (+ max_exp_avg_sq)
ds-fused-adam      adam          ``state[p]["step"]`` int      same; ``group["step"]`` is a stale copy
ds-cpu-adam        adam          ``state[p]["step"]`` int      same
apex-fused-adam    adam          ``group["step"]`` int         same
torch-sgd          sgd           none                          momentum_buffer
torch-rmsprop      rmsprop       ``state[p]["step"]`` float    square_avg (+ momentum_buffer, grad_avg)
torch-nadam        nadam         ``state[p]["step"]`` float    mu_product (0-dim), exp_avg, exp_avg_sq
torch-radam        radam         ``state[p]["step"]`` float    exp_avg, exp_avg_sq
torch-adamax       adamax        ``state[p]["step"]`` float    exp_avg, exp_inf
torch-adagrad      adagrad       ``state[p]["step"]`` float    sum
torch-adadelta     adadelta      ``state[p]["step"]`` float    square_avg, acc_delta
torch-rprop        rprop         ``state[p]["step"]`` float    prev, step_size
torch-asgd         asgd          ``state[p]["step"]`` float    eta, mu (0-dim), ax
torch-adafactor    adafactor     ``state[p]["step"]`` float    variance (a flat partition is a vector)
hf-adafactor       hf-adafactor  ``state[p]["step"]`` int      exp_avg_sq (+ exp_avg); RMS is recomputed
sf-adamw           sf-adamw      ``group["k"]`` int            z, exp_avg_sq (weight_sum, lr_max in the group)
sf-radam           sf-radam      ``group["k"]`` int            z, exp_avg_sq
sf-sgd             sf-sgd        ``group["k"]`` int            z
ds-cpu-adagrad     ds-adagrad    ``state[p]["step"]`` int      exp_avg_sq (a running sum of squares)
ds-lion            lion          ``state[p]["step"]`` int      exp_avg
ds-muon            muon          Adam groups' ``state[p]``     momentum_buffer (Muon groups, no step);
                                 int, stale group copy        exp_avg, exp_avg_sq (Adam groups)
=================  ============  ===========================  ==========================================

State means the same thing within a family, so a restore may move between its flavours (a torch
AdamW run resumed under DeepSpeed FusedAdam); across families it is refused (the state would be
read as something it is not), unless the user resets the optimizer.

Call order for a target: ``flavour.make_group(hyper, step)`` for each param group (or
``flavour.update_group(live, hyper, step)`` for a live one), then ``flavour.make_state(tensors,
step)`` for each flat tensor the optimizer owns. Sources call :func:`ucp.model.detect.detect` once on the optimizer's
state dict and then :meth:`Flavour.read_step` per state entry.

Each flavour names the state it may keep (``keys``, ``scalars``): a checkpoint holding anything else is
refused in one line (:func:`check_keys`), so state ucp does not know is never dropped or read as Adam's.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ucp.model.options import Decided

import torch

from ucp.errors import InputError
from ucp.model.hyper import TORCH_KEYS, Hyper, group_value
from ucp.model.pieces import Pieces

__all__ = [
    "muon_layout_note",
    "factored_note",
    "conversion_note",
    "Flavour",
    "FLAVOURS",
    "check_family",
    "check_keys",
    "check_reset",
    "get",
]

logger = logging.getLogger(__name__)


_ADAM_KEYS = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq"})


@dataclass(frozen=True)
class Flavour:
    """Where one optimizer keeps its step and scalars, and which keys its param groups carry."""

    name: str
    step_in_state: bool  # per-parameter step in state[p]["step"]
    step_in_group: bool  # group["step"] is read (apex) or carried stale (ds-fused-adam)
    float_step: bool  # the step is a float32 tensor (torch) rather than an int
    description: str
    family: str = "adam"  # flavours of one family keep state that means the same thing
    #: 0-dim per-tensor state -> its value at reset: a number, or the name of the group setting it starts at
    scalars: Mapping[str, float | str] = field(default_factory=dict)
    live: tuple[str, ...] = ()  # "module:Class" of the live optimizer objects of this flavour
    keys: frozenset[str] = _ADAM_KEYS  # the elementwise state tensors it may keep
    #: 0-dim state the optimizer recomputes before it reads it (HF Adafactor's RMS of the tensor it steps): a
    #: value of one rank's partition, meaningless for another; not carried, and a loaded state without it is whole
    derived: tuple[str, ...] = ()
    #: a matrix's second moment is kept factored (rows, columns) when the optimizer sees it whole: the state
    #: is elementwise only on ZeRO's flat partitions, and its update scales by statistics of the tensor it steps
    factored: bool = False
    step_key: str = "step"  # the group key of a step kept in the group (schedule-free's "k")
    #: zero tensors and step 0 are what a fresh optimizer holds (schedule-free's z starts at the weights instead)
    zero_reset: bool = True

    @property
    def has_step(self) -> bool:
        return self.step_in_state or self.step_in_group

    def read_step(self, group: Mapping[str, Any], state: Mapping[str, Any]) -> int | None:
        """The step this optimizer would use for a state entry, or None when it has none (yet)."""
        if not self.has_step:
            return None
        raw = state.get("step") if self.step_in_state else group.get(self.step_key)
        if raw is None:
            return None
        value = float(raw.item() if torch.is_tensor(raw) else raw)
        if value < 0 or value != int(value):
            raise InputError(f"optimizer step {value} is not a non-negative whole number")
        return int(value)

    def group_has_step(self, group: Mapping[str, Any]) -> bool:
        """Whether this optimizer counts steps for a group: DeepSpeed Muon's own groups
        (``use_muon``) keep only a momentum, its Adam groups a step."""
        return self.has_step and not (self.family == "muon" and group.get("use_muon") is True)

    def zero12_whole_keys(self, group: Mapping[str, Any], *, offload: bool) -> tuple[str, ...]:
        """State keys this optimizer keeps per *whole* parameter at ZeRO-1/2 rather than as the rank's
        flat partition (``ucp.model.partition.zero12_whole_slots``): DeepSpeed Muon's momentum on its
        own groups, unless the optimizer is offloaded to CPU, where it is a flat partition (0.19.8)."""
        if offload or self.family != "muon" or group.get("use_muon") is not True:
            return ()
        return ("momentum_buffer",)

    def make_state(
        self,
        tensors: Mapping[str, torch.Tensor | Pieces],
        step: int,
        scalars: Mapping[str, torch.Tensor] | None = None,
        *,
        with_step: bool = True,
    ) -> dict[str, Any]:
        """One flat tensor's optimizer state as this optimizer keeps it: its step where it reads it
        (``with_step`` False for a group without one, see :meth:`group_has_step`), its 0-dim scalars,
        then every state tensor by key, in order (torch's own order)."""
        state: dict[str, Any] = {}
        if self.step_in_state and with_step:
            state["step"] = torch.tensor(float(step), dtype=torch.float32) if self.float_step else int(step)
        state.update(scalars or {})
        state.update(tensors)
        return state

    def update_group(self, live: dict[str, Any], hyper: Hyper, step: int, raw: Mapping[str, Any]) -> dict[str, Any]:
        """A live optimizer's group with the checkpoint's hyperparameters; its own switches
        (foreach, fused, capturable, ...) stay as the new run set them."""
        if self.family != "adam":
            group = {k: v for k, v in live.items() if k != "params"}
            group.update({k: group_value(v) for k, v in raw.items() if k not in TORCH_KEYS | {"params", "step"}})
            if self.step_key != "step" and self.group_has_step(raw):
                group[self.step_key] = int(step)
            return group
        group = {k: v for k, v in live.items() if k != "params"}
        group.update(lr=hyper.lr, betas=tuple(hyper.betas), eps=hyper.eps, weight_decay=hyper.weight_decay)
        if "amsgrad" in group:
            group["amsgrad"] = hyper.amsgrad
        if "bias_correction" in group:
            group["bias_correction"] = hyper.bias_correction
        if self.step_in_group:
            current = group.get("step")
            group["step"] = torch.full_like(current, step) if torch.is_tensor(current) else int(step)
        group.update({k: v for k, v in hyper.extra.items() if k not in group or k == "initial_lr"})
        return group

    def make_group(self, hyper: Hyper, step: int, raw: Mapping[str, Any]) -> dict[str, Any]:
        """A param group (without ``params``) as this optimizer writes it in its state_dict.

        Beyond Adam, the source's own group is the group (ucp keeps it whole, ``raw``): a restore
        stays within a family, so its keys are the ones the optimizer reads."""
        if self.family != "adam":
            own = {k: group_value(v) for k, v in raw.items() if k not in ("params", "step")}
            if self.step_in_group and self.group_has_step(raw):
                own[self.step_key] = int(step)
            return own
        group: dict[str, Any] = {
            "lr": hyper.lr,
            "betas": tuple(hyper.betas),
            "eps": hyper.eps,
            "weight_decay": hyper.weight_decay,
        }
        if self.name == "torch-adam":
            group.update(
                amsgrad=hyper.amsgrad, maximize=False, foreach=None, capturable=False, differentiable=False, fused=None
            )
            # a torch source's own switches carry on, as DeepSpeed's native resume keeps them: fused and foreach
            # round differently, so dropping fused=True moved a same-size resume off the native one (1.2e-7)
            group.update({k: group_value(raw[k]) for k in _RUN_SWITCHES if k in raw})
            if hyper.adam_w_mode is not None:
                group["decoupled_weight_decay"] = hyper.adam_w_mode
        else:
            group["bias_correction"] = hyper.bias_correction
            if self.name == "ds-cpu-adam":
                group["amsgrad"] = hyper.amsgrad
        if self.step_in_group:
            # apex reads it; DeepSpeed FusedAdam only seeds new state from it, so the real count is safest
            group["step"] = int(step)
        group.update({k: v for k, v in hyper.extra.items() if k not in group})
        return group


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


#: torch's switches a native file carries from a torch source (decoupled_weight_decay is Hyper's adam_w_mode)
_RUN_SWITCHES = sorted(TORCH_KEYS - {"decoupled_weight_decay"})

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
            keys=_ADAM_KEYS | {"momentum_buffer"},
        ),
        Flavour(
            "ds-muon-torch-adam",
            True,
            False,
            True,
            "DeepSpeed MuonWithAuxAdam with torch_adam: Muon groups as ds-muon; torch AdamW's float step tensors",
            "muon",
            keys=_ADAM_KEYS | {"momentum_buffer"},
        ),
    )
}


def check_family(source: str | None, target: Flavour, groups_state: bool, *, whole: bool = False) -> None:
    """A restore may move between flavours of one family; across families the state would be read
    as something it is not, so it is refused (one line) unless no optimizer state is restored.
    ``whole``: the target's optimizer steps whole parameters (no ZeRO partition), where a factored
    optimizer keeps other state than the flat partitions' (refused too)."""
    if source is None or not groups_state or source not in FLAVOURS:
        return
    if FLAVOURS[source].family != target.family:
        raise InputError(
            f"the checkpoint holds {source} state ({FLAVOURS[source].family} family); {target.name} "
            f"({target.family} family) would read it as something it is not: restore into a "
            f"{FLAVOURS[source].family} optimizer, or reset the optimizer state"
        )
    if whole and FLAVOURS[source].factored:
        raise InputError(
            f"the checkpoint holds {source} state of ZeRO's flat partitions (a second moment per element); on whole "
            f"matrices {source} keeps it factored by rows and columns, which ucp does not derive: restore into a "
            "ZeRO-1/2/3 run, or export the weights"
        )


def check_reset(flavour: str | None) -> None:
    """Refuse (one line) to reset the state of an optimizer whose fresh state is not zeros."""
    kind = FLAVOURS.get(flavour or "")
    if kind is not None and not kind.zero_reset:
        raise InputError(
            f"{flavour}'s state cannot be reset to zeros: a fresh {flavour} starts z at the weights; start the new "
            "run's optimizer afresh instead (load_optimizer_states=False, or no optimizer state in the migration)"
        )


def check_keys(flavour: str | None, keys: Iterable[str], scalars: Iterable[str] = ()) -> None:
    """Refuse (one line) state a flavour does not keep: the optimizer is then one ucp does not know (or
    mistook for a known one), and a restore would drop that state or hand it to an optimizer that
    reads it as something else."""
    kind = FLAVOURS.get(flavour or "")
    if kind is None:
        return
    odd = sorted(set(keys) - kind.keys) + sorted(set(scalars) - set(kind.scalars) - set(kind.derived))
    if odd:
        raise InputError(
            f"the optimizer keeps {', '.join(odd)}, which {flavour} does not ({', '.join(sorted(kind.keys))}): "
            "it is an optimizer ucp does not know, and its state would be lost or misread"
        )


def get(name: str) -> Flavour:
    try:
        return FLAVOURS[name]
    except KeyError:
        raise InputError(f"unknown optimizer flavour {name!r}; choose one of {', '.join(FLAVOURS)}") from None


def muon_layout_note(decided: Decided) -> str | None:
    """DeepSpeed Muon keeps its ZeRO-1/2 momentum whole per parameter unless the optimizer is offloaded: which one
    the files hold, and that the new run must match it."""
    facts, options = decided.facts, decided.options
    muon = any(decided.flavour.zero12_whole_keys(g.raw, offload=False) for g in facts.groups)
    if options.stage not in (1, 2) or options.reset or not muon:
        return None
    return (
        "DeepSpeed Muon's momentum is laid out "
        + ("as each rank's flat partition" if decided.offload else "whole per parameter")
        + f", as a run {'with' if decided.offload else 'without'} optimizer offload reads it "
        "(DeepSpeed would start the other from zero: set offload to match the new run)"
    )


def factored_note(decided: Decided) -> str | None:
    """Adafactor scales each update by its partition's RMS: a new DP size or stage steps differently."""
    from ucp.model.options import zero_label

    facts, options = decided.facts, decided.options
    source = FLAVOURS.get(facts.flavour or "")
    moved = (options.dp, options.stage) != (facts.info.dp_world_size, facts.info.zero_stage)
    if source is None or not source.factored or not decided.has_state or not moved:
        return None
    return (
        f"{source.name} scales each update by the RMS of the tensor it steps, under ZeRO a rank's flat "
        f"partition: the state is carried exactly, but at dp={options.dp} {zero_label(options.stage)} the "
        "partitions differ, so the steps differ from the source run's as they would for any run of that size"
    )


def conversion_note(decided: Decided) -> str | None:
    source = decided.facts.flavour
    if source is None or decided.flavour.name == source:
        return None
    return f"optimizer state converted from {source} to {decided.flavour.name}"
