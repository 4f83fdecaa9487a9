"""A verl FSDP checkpoint (verl 0.9.1 ``FSDPCheckpointManager``) as a source format: the actor folder, its
``global_step_N`` folder, or the run folder whose ``latest_checkpointed_iteration.txt`` names one.

The per-rank model and optimizer files are read as one DCP-shaped state dict (``ucp.frameworks.verl_store``) by the
DCP source's reader, so weights, Adam moments, steps, the param group and the lr scheduler come out as they do from a
DCP folder; the global step is the folder's N, the world size the files'. What no output carries is said in the notes:
each rank's RNG state, the dataloader's ``data.pt`` and a critic beside the actor.
"""

from __future__ import annotations

import dataclasses

from ucp.errors import InputError
from ucp.frameworks.verl import VerlFolder, find_verl, looks_like_verl
from ucp.frameworks.verl_store import VerlStore
from ucp.model.records import Reader, ReaderView
from ucp.sources.format import How, Probe, SourceFormat

__all__ = ["FORMAT", "VerlView"]


class VerlView(ReaderView):
    """The DCP-shaped reader of a verl folder, with the folder's global step and world size and its notes."""

    def __init__(self, inner: Reader, folder: VerlFolder, layout: str) -> None:
        facts = inner.facts
        info = dataclasses.replace(
            facts.info,
            global_steps=facts.info.global_steps if folder.step is None else folder.step,
            dp_world_size=folder.world,
        )
        notes = [
            f"verl FSDP{2 if layout == 'fsdp2' else 1} checkpoint of {folder.world} process{'es' if folder.world > 1 else ''} "
            f"({layout} optimizer files)",
            f"not carried: each rank's RNG state (extra_state_world_size_{folder.world}_rank_*.pt 'rng'); a verl target "
            "copies old rank r mod W's file, any other target starts from the new run's seed",
        ]
        if folder.step is None:
            notes.append(
                f"{folder.actor} is not inside a global_step_N folder: the global step is not recorded (read as the "
                "optimizer's step, which under PPO counts mini-batch updates)"
            )
        if folder.around:
            notes.append(
                f"not carried: {', '.join(folder.around)} beside the actor folder (the dataloader's data.pt, a "
                "critic: none of it is the actor's state)"
            )
        super().__init__(inner, dataclasses.replace(facts, info=info, warnings=[*facts.warnings, *notes]), owns=True)


def _open(probe: Probe, how: How) -> Reader:
    from ucp.sources.dcp import DcpSource

    folder = find_verl(probe.path)
    if folder is None:
        raise InputError(f"{probe.path} is no verl checkpoint")  # claimed: not reached
    store = VerlStore(folder)
    try:
        inner = DcpSource(folder.actor, optimizer=how.optimizer, names=store.names, store=store)
        return VerlView(inner, folder, store.optim.layout)
    except BaseException:
        store.close()
        raise


FORMAT = SourceFormat(
    name="verl-fsdp",
    label="verl FSDP checkpoint (FSDPCheckpointManager actor folder)",
    docs="format.md#10-verl-fsdp-checkpoints",
    claims=lambda probe: probe.tag is None and looks_like_verl(probe.path),
    open=_open,
)
