"""The live route for Hugging Face runs: Trainer and Accelerate load a checkpoint of any world size
through :func:`ucp.targets.engine.restore`, with no folder prepared beforehand.

Trainer::

    from ucp.integrations.hf import resume_trainer
    resume_trainer(trainer, "out/checkpoint-500")          # instead of trainer.train(resume_from_checkpoint=...)

Accelerate (after ``accelerator.prepare``)::

    from ucp.integrations.hf import load_accelerate_state
    load_accelerate_state(accelerator, "out/state")        # instead of accelerator.load_state(...)

Nothing on disk changes and nothing is added to the DeepSpeed config, so the checkpoints the resumed run
saves are ordinary ones at its own world size, which the next plain resume loads. Trainer's other files
(``trainer_state.json``, ``scheduler.pt``, ...) are read by Trainer itself; a process beyond the old world
size finds no RNG file and keeps its own seed's stream (Trainer logs it). For a folder with an RNG file per
new process, write one with ``ucp restore CHECKPOINT NEW --dp N`` instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

from ucp.targets.engine import restore

__all__ = ["ucp_loading", "resume_trainer", "load_accelerate_state"]

logger = logging.getLogger(__name__)


def _restore_into(engine: Any, path: str | os.PathLike[str], tag: str | None, strict: bool) -> dict[str, Any]:
    """Every rank reads the checkpoint and takes its own share (what engine.load_checkpoint does)."""
    from ucp.sources import open_reader

    with open_reader(path, tag=tag) as reader:  # a Trainer folder is read at its own tag
        logger.info("loading %s into the live engine through ucp", path)
        return restore(engine, reader, strict=strict)


@contextlib.contextmanager
def ucp_loading(source: str | os.PathLike[str] | None = None) -> Iterator[None]:
    """Within the block, Trainer's DeepSpeed checkpoint load goes through ucp (any world size).

    Trainer (transformers 5.x) loads DeepSpeed state with the module-level
    ``transformers.trainer.deepspeed_load_checkpoint``; it is swapped for the block only. ``source``
    reads the weights and optimizer from elsewhere (a universal directory) instead of the folder given
    to ``resume_from_checkpoint``.
    """
    import transformers.trainer as trainer_module

    original = trainer_module.deepspeed_load_checkpoint

    def load(engine: Any, checkpoint_path: str, load_module_strict: bool = True) -> None:
        _restore_into(engine, source or checkpoint_path, None, load_module_strict)

    trainer_module.deepspeed_load_checkpoint = load
    try:
        yield
    finally:
        trainer_module.deepspeed_load_checkpoint = original


def resume_trainer(
    trainer: Any, checkpoint: str | os.PathLike[str], *, source: str | os.PathLike[str] | None = None, **kwargs: Any
) -> Any:
    """``trainer.train(resume_from_checkpoint=checkpoint)`` at any world size; returns its TrainOutput."""
    with ucp_loading(source):
        return trainer.train(resume_from_checkpoint=str(checkpoint), **kwargs)


def load_accelerate_state(accelerator: Any, path: str | os.PathLike[str], **kwargs: Any) -> None:
    """``accelerator.load_state(path)`` at any world size: each prepared DeepSpeed model loads its
    tag (``pytorch_model``, ``pytorch_model_1``, ...) through ucp; Accelerate itself reads the rest
    (schedulers, samplers, custom objects, the RNG file of this process when there is one)."""
    engines = [m for m in accelerator._models if hasattr(m, "load_checkpoint") and hasattr(m, "global_steps")]

    def through_ucp(engine: Any) -> Any:
        def load(load_dir: str, tag: str | None = None, load_module_strict: bool = True, **_: Any) -> Any:
            return load_dir, _restore_into(engine, load_dir, tag, load_module_strict)

        return load

    for engine in engines:  # an instance attribute shadows DeepSpeedEngine.load_checkpoint for this call only
        engine.load_checkpoint = through_ucp(engine)
    try:
        accelerator.load_state(str(path), **kwargs)
    finally:
        for engine in engines:
            del engine.load_checkpoint
