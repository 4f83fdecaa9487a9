"""DeepSpeed's pipeline-parallel layout (``deepspeed.pipe.PipelineModule`` under PipelineEngine, 0.19.8).

What a PP x DP ZeRO-0/1 save holds, as verified on real runs (tests/test_pipeline.py):

- ``mp_rank_{s:02d}_model_states.pt``, one per stage ``s`` (the mp rank is the rank in the stage's
  "model" group, stage-major: ``stage * tp + tp_rank``): ``module`` is None; ``param_shapes`` (per
  param group, in flat order), ``buffer_names``, ``lr_scheduler`` and the counters are the stage's,
  named as the PipelineModule names them: ``{layer}.{name}`` for an ordinary layer, and
  ``tied_modules.{key}.{name}`` for a ``TiedLayerSpec`` module; ``checkpoint_parallel_dimensions``
  gives ``pp_degree`` and ``tp_degree``.
- ``[bf16_]zero_pp_rank_{d}_mp_rank_{s:02d}_optim_states.pt``: an ordinary ZeRO-1 (or BF16_Optimizer)
  optim file of stage ``s``'s own flat groups, partitioned over the stage's DP group.
- ``layer_{i:02d}[-model_{t:02d}]-model_states.pt``: the state dict of layer ``i`` (keys relative to
  the layer), written by DP rank 0 of the layer's stage for every layer that is an ``nn.Module``. A tied
  layer given a ``forward_fn`` is a partial and gets no file: its weights live only in the optimizer's
  fp32 masters (DeepSpeed restores them from there too). A tied module is an optimized parameter of
  every stage that uses it, each stage keeping its own, identical copy of its fp32 master and state.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ucp.deepspeed.fields import as_int, need_mapping
from ucp.errors import InputError

__all__ = ["TIED_PREFIX", "PARALLEL_DIMS", "pipeline_degrees", "layer_prefix"]

#: where PipelineModule registers TiedLayerSpec modules
TIED_PREFIX = "tied_modules."
#: the model-states key recording the run's PP and TP degrees
PARALLEL_DIMS = "checkpoint_parallel_dimensions"


def pipeline_degrees(model_states: Mapping[str, Any], mp: int, where: str) -> tuple[int, int]:
    """(pp, tp) of a pipeline save from its first model-states file; without the record, every mp rank
    is a stage. The product must be the number of mp ranks found."""
    dims = model_states.get(PARALLEL_DIMS)
    if dims is None:
        return mp, 1
    dims = need_mapping(dims, f"{where}: {PARALLEL_DIMS}")
    pp = as_int(dims.get("pp_degree", mp), f"{where}: pp_degree")
    tp = as_int(dims.get("tp_degree", 1), f"{where}: tp_degree")
    if pp < 1 or tp < 1 or pp * tp != mp:
        raise InputError(
            f"{where} says pp_degree={pp} x tp_degree={tp}, but the folder holds {mp} mp ranks: "
            "files of different runs are mixed"
        )
    return pp, tp


def layer_prefix(layer: int, keys: Iterable[str], known: set[str]) -> str:
    """The module-name prefix of layer ``layer``'s file: ``"{layer}."`` for an ordinary layer, or
    ``"tied_modules.{key}."`` when its keys are those of a tied module. ``known`` holds the names the
    model-states files give (optimized parameters and buffers of every stage). A layer none of whose
    keys is known (a layer of frozen parameters only) is taken as ordinary."""
    keys = list(keys)
    plain = f"{layer}."
    if any(plain + k in known for k in keys):
        return plain
    tied = sorted({n[len(TIED_PREFIX) :].split(".", 1)[0] for n in known if n.startswith(TIED_PREFIX)})
    matching = [t for t in tied if keys and any(f"{TIED_PREFIX}{t}.{k}" in known for k in keys)]
    if len(matching) > 1:
        raise InputError(
            f"layer {layer}'s weights fit the tied modules {matching} alike: ucp cannot tell which one it is"
        )
    return f"{TIED_PREFIX}{matching[0]}." if matching else plain
