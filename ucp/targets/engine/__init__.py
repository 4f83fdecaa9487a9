"""Universal -> a live DeepSpeed engine at any DP size, steps where its optimizer reads them.

Call order (every rank calls :func:`restore` together, like ``engine.load_checkpoint``): read the
engine's own flat layout (its sub-groups, partition sizes and parameter names), match its param
groups to the checkpoint's by member names, build this rank's ZeRO block from the universal state,
and hand it to DeepSpeed's own ``load_state_dict`` (the path a native resume takes, so the fp32
masters, moments, steps and refreshed low-precision weights land exactly as DeepSpeed puts them).
Frozen parameters, buffers, the lr scheduler and engine counters follow. A PipelineEngine's rank
restores its stage alone: the reader is first cut to the parameters and buffers its module holds.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ucp.errors import InputError
from ucp.io.pool import default_workers
from ucp.model.records import Reader
from ucp.model.steps import step_chooser
from ucp.sources import opened
from ucp.targets.blocks.stream import refuse_fp16_overflow
from ucp.targets.engine.common import as_live_names, check_engine, match_groups, restore_common
from ucp.targets.engine.pipeline import live_stage_view
from ucp.targets.engine.zero0 import restore_zero0
from ucp.targets.engine.zero3 import restore_zero3
from ucp.targets.engine.zero12 import restore_zero12
from ucp.targets.tensor_parallel import live_tp_view

__all__ = ["restore", "match_groups"]

logger = logging.getLogger(__name__)


def restore(
    engine: Any,
    universal_dir: str | os.PathLike | Reader,
    *,
    optimizer: str | None = None,
    load_optimizer_states: bool = True,
    strict: bool = True,
    step: int | str = "keep",
    workers: int | None = None,
) -> dict[str, Any]:
    """Restore a universal directory (or any checkpoint ucp reads) into a live DeepSpeed engine.

    ``optimizer`` names the engine's flavour when its class does not tell. With
    ``load_optimizer_states=False`` only weights (and frozen params and buffers) are restored.
    ``step`` is ``keep`` (each parameter's own), ``reset`` (0) or an integer for every parameter.
    Returns the checkpoint's client state, as ``engine.load_checkpoint`` does.
    """
    step_of = step_chooser(step)
    with opened(universal_dir) as source:
        # this rank's pipeline stage (a PipelineEngine), then its shards under tensor parallelism
        named = as_live_names(source, engine.module)  # across torch.compile's wrapper
        reader = live_tp_view(engine, live_stage_view(engine, named, strict=strict))
        stage = int(engine.zero_optimization_stage())
        if stage == 3 and getattr(engine.optimizer, "zenflow", False):
            raise InputError(
                "this engine runs ZenFlow at ZeRO-3, which keeps every matrix transposed: ucp.restore does not "
                "write into it yet; write its files with `ucp restore --zenflow` and load them with "
                "engine.load_checkpoint"
            )
        check_engine(engine, reader, strict=strict)
        if engine.fp16_enabled():
            refuse_fp16_overflow(reader, [m.name for m in reader.facts.params])
        # a bf16 PipelineEngine without ZeRO runs BF16_Optimizer, partitioned like ZeRO-1: restored as ZeRO-1
        if stage == 0 and not hasattr(engine.optimizer, "bf16_groups"):
            restore_zero0(
                engine,
                reader,
                optimizer=optimizer,
                load_optimizer_states=load_optimizer_states,
                strict=strict,
                step_of=step_of,
            )
        elif stage != 3:
            restore_zero12(
                engine,
                reader,
                optimizer=optimizer,
                load_optimizer_states=load_optimizer_states,
                strict=strict,
                workers=workers or default_workers(),
                step_of=step_of,
            )
        else:
            restore_zero3(
                engine,
                reader,
                optimizer=optimizer,
                load_optimizer_states=load_optimizer_states,
                strict=strict,
                workers=workers or default_workers(),
                step_of=step_of,
            )
        restore_common(engine, reader, strict=strict)
        return dict(reader.extras().get("client_state") or {})
