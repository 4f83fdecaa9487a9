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
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ucp.model.options import Decided

from ucp.errors import InputError
from ucp.model.flavour_table import FLAVOURS
from ucp.model.optimizer_flavour import Flavour

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
