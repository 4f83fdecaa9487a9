"""The stage of a live PipelineEngine: the reader cut to what this rank's stage holds.

Call order: :func:`ucp.targets.engine.restore` calls :func:`live_stage_view` first, before the
tensor-parallel view, on every rank; the stage's ZeRO restore then sees an ordinary model of the
stage's parameters (a tied module on every stage that uses it), frozen parameters and buffers,
under the PipelineModule's names (``tied_modules.embed.weight``, ``3.fc1.weight``). An engine whose
module is no PipelineModule gets the reader unchanged.
"""

from __future__ import annotations

import logging
from typing import Any

from ucp.errors import InputError
from ucp.model.records import Reader
from ucp.targets.pipeline import StageView

__all__ = ["is_pipeline_module", "live_stage_view"]

logger = logging.getLogger(__name__)


def is_pipeline_module(module: Any) -> bool:
    """Whether ``module`` is a ``deepspeed.pipe.PipelineModule`` (or a subclass, as Megatron-DeepSpeed's
    GPTModelPipe), told by class name so that reading never imports deepspeed."""
    return any(cls.__name__ == "PipelineModule" for cls in type(module).__mro__)


def live_stage_view(engine: Any, reader: Reader, *, strict: bool) -> Reader:
    """``reader`` as this rank's pipeline stage sees it; with ``strict`` every parameter the stage's
    module holds must be in the checkpoint."""
    module: Any = getattr(engine, "module", None)
    if not is_pipeline_module(module):
        return reader
    params = [name for name, _ in module.named_parameters()]
    held = set(params) | {name for name, _ in module.named_buffers()}
    if strict:
        known = {p.name for p in reader.facts.params}
        missing = [name for name in params if name not in known]
        if missing:
            raise InputError(
                f"pipeline stage {getattr(engine, 'stage_id', '?')} holds {missing[0]!r}, which the checkpoint "
                f"lacks ({len(missing)} of the stage's {len(params)} parameters missing): the checkpoint is of "
                "another model; pass strict=False to restore the common ones"
            )
    return StageView(reader, held.__contains__)
