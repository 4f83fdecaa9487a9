"""Hugging Face run folders as source formats: a Trainer ``checkpoint-N`` or an Accelerate ``save_state`` folder of a
DeepSpeed run or of an FSDP run (``ucp.frameworks.hf`` names their files).

A DeepSpeed run's folder wraps one DeepSpeed checkpoint: its reader is that checkpoint's, in whichever DeepSpeed
layout it has. An FSDP run's folder keeps the model and the optimizer in Accelerate's FSDP files: under
SHARDED_STATE_DICT two DCP folders (``pytorch_model_fsdp_0`` with ``{"model": ...}``, ``optimizer_0`` with
``{"optimizer": ...}``, every key a clean FQN), read as one DCP state dict; the scheduler from the folder's own file,
the global step from ``trainer_state.json``. Either way the folder itself is in the facts
(:attr:`~ucp.model.records.Facts.folder`), so that a target writes a whole folder of its kind.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ucp.frameworks.dcp import MODEL, OPTIM, DcpStore, StateStore
from ucp.frameworks.hf import ACCELERATE, SHARDED, TRAINER, scheduler_file
from ucp.frameworks.torch_state import TorchStateStore
from ucp.io.torchfile import load
from ucp.model.layouts import RunFolder
from ucp.model.records import Reader, ReaderView
from ucp.sources.format import How, Probe, SourceFormat

__all__ = ["TRAINER_FORMAT", "ACCELERATE_FORMAT", "TRAINER_FSDP_FORMAT", "ACCELERATE_FSDP_FORMAT"]

_DOCS = "format.md#7-hugging-face-trainer-and-accelerate-folders"


class _InFolder(ReaderView):
    """A run folder's checkpoint: the inner reader with the folder in its facts, the folder's scheduler state when
    the inner reader has none, and the folder's global step."""

    def __init__(self, inner: Reader, folder: RunFolder, scheduler: Any = None) -> None:
        facts, info = inner.facts, inner.facts.info
        if folder.fsdp:  # the global step is in trainer_state.json only, the world size in the RNG files only
            step, world = folder.global_step, folder.old_world
            info = dataclasses.replace(
                info,
                global_steps=info.global_steps if step is None else int(step),
                dp_world_size=world or info.dp_world_size,
            )
        super().__init__(inner, dataclasses.replace(facts, folder=folder, info=info), owns=True)
        self._scheduler = scheduler

    def extras(self) -> dict[str, Any]:
        extras = dict(self.inner.extras())
        if self._scheduler is not None and extras.get("lr_scheduler") is None:
            extras["lr_scheduler"] = self._scheduler
        return extras


def _open_deepspeed(probe: Probe, how: How) -> Reader:
    """The DeepSpeed checkpoint the folder wraps, at the folder's tag, in whichever DeepSpeed layout it has."""
    from ucp.sources.registry import open_probe

    folder = probe.hf
    assert folder is not None  # claimed
    inner = open_probe(probe.with_tag(folder.tag), how, family="deepspeed")
    return _InFolder(inner, folder)


def _store(folder: RunFolder) -> StateStore:
    """The folder's model and optimizer as one state dict (``model``, ``optim``): two DCP folders under
    SHARDED_STATE_DICT, two whole torch files under FULL_STATE_DICT."""
    model, optim = (folder.path / entry for entry in folder.state)
    if folder.backend == SHARDED:
        return DcpStore([(model, {}), (optim, {"optimizer": OPTIM})])
    return TorchStateStore([(model, MODEL), (optim, OPTIM)])


def _open_fsdp(probe: Probe, how: How) -> Reader:
    """An FSDP run's model and optimizer, read as one DCP-shaped state dict; the scheduler from its own file."""
    from ucp.sources.dcp import DcpSource

    folder = probe.hf
    assert folder is not None  # claimed
    store = _store(folder)
    try:
        names = {"frozen": list(how.frozen)} if how.frozen else None
        inner = DcpSource(folder.path, optimizer=how.optimizer, names=names, store=store)
        schedule = folder.path / scheduler_file(folder.kind)
        return _InFolder(inner, folder, load(schedule) if schedule.is_file() else None)
    except BaseException:
        store.close()
        raise


def _format(name: str, kind: str, fsdp: bool, label: str) -> SourceFormat:
    """A run folder of ``kind`` of a DeepSpeed run (it wins over the DeepSpeed layout it wraps: both claim the
    folder) or of an FSDP run."""
    return SourceFormat(
        name=name,
        label=label,
        docs=_DOCS,
        claims=lambda probe: probe.hf is not None and probe.hf.kind == kind and probe.hf.fsdp == fsdp,
        open=_open_fsdp if fsdp else _open_deepspeed,
        refines=() if fsdp else ("deepspeed",),
        takes=frozenset({"frozen"}),
    )


TRAINER_FORMAT = _format("hf-trainer", TRAINER, False, "Hugging Face Trainer checkpoint folder (DeepSpeed)")
ACCELERATE_FORMAT = _format("hf-accelerate", ACCELERATE, False, "Accelerate save_state folder (DeepSpeed)")
TRAINER_FSDP_FORMAT = _format("hf-trainer-fsdp", TRAINER, True, "Hugging Face Trainer checkpoint folder (FSDP)")
ACCELERATE_FSDP_FORMAT = _format("hf-accelerate-fsdp", ACCELERATE, True, "Accelerate save_state folder (FSDP)")
