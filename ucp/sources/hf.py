"""Hugging Face run folders as source formats: a Trainer ``checkpoint-N`` and an Accelerate ``save_state`` folder
each wrap one DeepSpeed checkpoint (``ucp.frameworks.hf`` names their files); the reader is the wrapped checkpoint's,
in whichever DeepSpeed layout it has, with the folder in its facts (:attr:`~ucp.model.records.Facts.folder`).
"""

from __future__ import annotations

import dataclasses

from ucp.frameworks.hf import ACCELERATE, TRAINER
from ucp.model.records import Reader, ReaderView
from ucp.sources.format import How, Probe, SourceFormat

__all__ = ["TRAINER_FORMAT", "ACCELERATE_FORMAT"]


def _open_wrapped(probe: Probe, how: How) -> Reader:
    """The DeepSpeed checkpoint the folder wraps, at the folder's tag, in whichever DeepSpeed layout it has."""
    from ucp.sources.registry import open_probe

    folder = probe.hf
    assert folder is not None  # claimed
    inner = open_probe(probe.with_tag(folder.tag), how, family="deepspeed")
    return ReaderView(inner, dataclasses.replace(inner.facts, folder=folder), owns=True)


TRAINER_FORMAT = SourceFormat(
    name="hf-trainer",
    label="Hugging Face Trainer checkpoint folder (DeepSpeed)",
    docs="format.md#7-hugging-face-trainer-and-accelerate-folders",
    claims=lambda probe: probe.hf is not None and probe.hf.kind == TRAINER,
    open=_open_wrapped,
    refines=("deepspeed",),
    takes=frozenset({"frozen"}),
)
ACCELERATE_FORMAT = SourceFormat(
    name="hf-accelerate",
    label="Accelerate save_state folder (DeepSpeed)",
    docs="format.md#7-hugging-face-trainer-and-accelerate-folders",
    claims=lambda probe: probe.hf is not None and probe.hf.kind == ACCELERATE,
    open=_open_wrapped,
    refines=("deepspeed",),
    takes=frozenset({"frozen"}),
)
