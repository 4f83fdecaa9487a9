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


def _wrapper(name: str, kind: str, label: str) -> SourceFormat:
    """A run folder of ``kind`` wrapping any DeepSpeed layout, which it wins over (both claim the folder)."""
    return SourceFormat(
        name=name,
        label=label,
        docs="format.md#7-hugging-face-trainer-and-accelerate-folders",
        claims=lambda probe: probe.hf is not None and probe.hf.kind == kind,
        open=_open_wrapped,
        refines=("deepspeed",),
        takes=frozenset({"frozen"}),
    )


TRAINER_FORMAT = _wrapper("hf-trainer", TRAINER, "Hugging Face Trainer checkpoint folder (DeepSpeed)")
ACCELERATE_FORMAT = _wrapper("hf-accelerate", ACCELERATE, "Accelerate save_state folder (DeepSpeed)")
