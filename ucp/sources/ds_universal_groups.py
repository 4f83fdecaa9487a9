"""How a ds_to_universal folder's param groups hold its parameters: ZeRO-3 sub-groups or one ZeRO-1/2 flat
group each, the flavour and each one's step, and the layouts whose folders DeepSpeed 0.19.8 writes wrong
(``ucp.sources.ds_universal``)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ucp.deepspeed.fields import as_int, need_list
from ucp.deepspeed.layout import UNIVERSAL_OPTIM
from ucp.deepspeed.optim_states import check_zero3_membership
from ucp.errors import InputError
from ucp.io import torchfile
from ucp.model.detect import Detection, detect, offloads_optimizer, round_robin_gradients

__all__ = [
    "OPTIM_NAME",
    "check_groups",
    "refuse_round_robin",
    "refuse_whole_state",
    "zero3_groups",
    "zero12_groups",
]

logger = logging.getLogger(__name__)

#: the optimizer state's file name in zero/, for messages
OPTIM_NAME = Path(UNIVERSAL_OPTIM).name


def check_groups(groups_raw: list[dict[str, Any]]) -> None:
    """Every param group has an lr and integer members (sub-group or group indices)."""
    for g, group in enumerate(groups_raw):
        if "lr" not in group:
            raise InputError(f"zero/{OPTIM_NAME}: param group {g} has no lr: not an optimizer's param group")
        for sub in need_list(group.get("params", []), f"zero/{OPTIM_NAME}: param group {g} params"):
            as_int(sub, f"zero/{OPTIM_NAME}: param group {g} params entry")


def zero3_groups(
    optim: Mapping[str, Any],
    shapes: list[Mapping[str, Any]],
    layout: list[list[int]],
    ds_config: Mapping[str, Any],
    optimizer: str | None,
    dp: int,
) -> tuple[list[list[int]], Detection, dict[int, int | None]]:
    """Sub-groups per param group, the flavour, and each sub-group's step (rank 0's copy)."""
    sub_of_group = check_zero3_membership(layout, shapes, optim.get("flat_numels"), dp)
    state = optim["state"]
    detection = detect({"param_groups": optim["param_groups"], "state": state}, ds_config, optimizer)
    steps: dict[int, int | None] = {}
    for sub in range(len(shapes)):
        group = optim["param_groups"][sub_of_group[sub]]
        steps[sub] = detection.flavour.read_step(group, state.get(sub, {})) if detection.flavour else None
    return layout, detection, steps


def zero12_groups(
    zero: Path,
    shapes: list[Mapping[str, Any]],
    groups_raw: list[dict[str, Any]],
    layout: list[list[int]],
    ds_config: Mapping[str, Any],
    optimizer: str | None,
) -> tuple[list[list[int]], Detection, dict[int, int | None]]:
    """One param_shapes entry per group; the flavour and group steps from each group's step.pt (under ``zero``,
    the folder's zero/)."""
    if len(groups_raw) != len(shapes):
        raise InputError(
            f"zero/{OPTIM_NAME} has {len(groups_raw)} param groups, but param_shapes has {len(shapes)}: "
            "files of different checkpoints are mixed"
        )
    for g, subs in enumerate(layout):
        if subs != [g]:
            raise InputError(
                f"zero/{OPTIM_NAME}: param group {g} holds flat tensors {subs}, expected [{g}]: not a "
                "ZeRO-1/2 optimizer (one flat partition per group)"
            )
    # ds_to_universal copies the group's step into each member's step.pt, and writes none when the
    # optimizer keeps its step in the param group (apex) rather than in the state
    state: dict[int, dict[str, Any]] = {}
    for g, members in enumerate(shapes):
        first = next(iter(members), None)
        if first is not None and (zero / first / "step.pt").is_file():
            state[g] = {"step": torchfile.load(zero / first / "step.pt")}
    detection = detect({"param_groups": groups_raw, "state": state}, ds_config, optimizer)
    steps: dict[int, int | None] = {}
    for g, group in enumerate(groups_raw):
        steps[g] = detection.flavour.read_step(group, state.get(g, {})) if detection.flavour else None
    return layout, detection, steps


def refuse_whole_state(
    detection: Detection, groups: list[Mapping[str, Any]], ds_config: Mapping[str, Any], stage: int
) -> None:
    """DeepSpeed Muon at ZeRO-1/2 keeps whole-parameter momentum per rank; ds_to_universal cuts it as
    if it were the rank's flat partition (0.19.8), so what it wrote is not the momentum: refused."""
    flavour = detection.flavour
    offload = offloads_optimizer(ds_config)
    if flavour is not None and any(flavour.zero12_whole_keys(g, offload=offload) for g in groups):
        raise InputError(
            f"this ds_to_universal folder comes from DeepSpeed Muon at ZeRO-{stage}, whose per-rank momentum "
            "holds whole parameters; ds_to_universal cuts it as a flat partition, so its momentum files are "
            "not the momentum: convert the original checkpoint with `ucp to-universal` instead"
        )


def refuse_round_robin(shapes: list[Mapping[str, Any]], ds_config: Mapping[str, Any], dp: int, stage: int) -> None:
    """A ``round_robin_gradients`` run flattens its groups in round-robin order, but DeepSpeed 0.19.8 maps the
    fragments ds_to_universal cuts walking the members in their original order: unless that order is the same
    (at most dp members per group), its parameter folders hold other parameters' bytes. Refused."""
    if round_robin_gradients(ds_config) and any(len(members) > dp > 1 for members in shapes):
        raise InputError(
            f"this ds_to_universal folder comes from a ZeRO-{stage} run with round_robin_gradients, whose flat "
            "buffers DeepSpeed 0.19.8 cuts at the wrong offsets (its parameter folders hold other parameters' "
            "bytes): convert the original checkpoint with `ucp to-universal` instead"
        )
