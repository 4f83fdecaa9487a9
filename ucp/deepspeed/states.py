"""Building the dicts DeepSpeed saves and loads: model states, ZeRO optimizer blocks, universal extras.

Targets decide what goes where (DP size, stage, flavour, buffers); this module knows only how
DeepSpeed 0.19.8 spells it, so a DeepSpeed field change is one edit here. Call order for a native
target: :func:`model_states` per model-states file, :func:`zero_wrapper` once, then
:func:`zero3_optim_block` or :func:`zero12_optim_block` per rank; without ZeRO, :func:`client_state_dict`
(wrapped by :func:`unfused_wrapper` or :func:`fused_wrapper` in bf16) goes into the one model-states file.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ucp.deepspeed.clipping import CLIPPING_BY_DEFAULT_SINCE, clip_grad, default_clipping, unknown_clipping_note
from ucp.deepspeed.optim_states import FUSED_MASTERS, UNFUSED_INNER, UNFUSED_MASTERS
from ucp.deepspeed.stage_config import MICS_KEYS, config_for_stage, stage0_note
from ucp.io.standins import DynamicLossScaler, FragmentAddress, LossScaler, ZeroStageEnum
from ucp.io.torchpickle import UnsharedDict
from ucp.model.flavours import Flavour
from ucp.model.loss_scale import LossScale, fresh_fp16_scale
from ucp.model.partition import Zero12Group
from ucp.model.pieces import Pieces, Placeholder, Reserved
from ucp.model.records import Facts, torch_dtype

__all__ = [
    "stage0_note",
    "unknown_clipping_note",
    "WRITTEN_DS_VERSION",
    "scaler_object",
    "loss_scale_of",
    "lp_placeholder",
    "model_states",
    "zero_wrapper",
    "flat_state",
    "zero3_optim_block",
    "zero12_optim_block",
    "client_state_dict",
    "unfused_wrapper",
    "fused_wrapper",
    "optim_file_dict",
    "clip_grad",
    "config_for_stage",
    "frozen_fields",
    "universal_optimizer_state",
    "universal_model_states",
    "default_clipping",
    "CLIPPING_BY_DEFAULT_SINCE",
    "MICS_KEYS",
]


#: a flat tensor of a rank file: held, as pieces of files, or reserved for its writer to fill later
Flat = torch.Tensor | Pieces | Reserved


def lp_placeholder(dtype: str) -> Placeholder:
    """ZeRO-3 model-states files hold an empty tensor where each partitioned parameter goes (written as one, held as
    a :class:`Placeholder`: 10^5 tensor objects would cost 50 MB)."""
    return Placeholder(torch_dtype(dtype))


def model_states(
    facts: Facts,
    extras: Mapping[str, Any],
    buffers: Mapping[str, torch.Tensor],
    *,
    dtype: str,
    dp: int,
    tp: int,
    extra: Mapping[str, Any],
) -> dict[str, Any]:
    """The fields of a model-states file every stage shares (engine counters, scheduler, buffers);
    ``extra`` adds the stage's own (param shapes, frozen parameters, TP info) before the client state."""
    info = facts.info
    # a placeholder of its own for each name, tied ones too: written without the pickler's memo
    module: OrderedDict[str, torch.Tensor | Placeholder] = UnsharedDict()
    for meta in facts.params:
        module[meta.name] = lp_placeholder(dtype)
    for alias in facts.tied:
        module[alias] = lp_placeholder(dtype)
    module.update(buffers)
    states: dict[str, Any] = {
        "module": module,
        "buffer_names": list(facts.buffer_names),
        "optimizer": None,
        "lr_scheduler": extras.get("lr_scheduler"),
        "data_sampler": extras.get("data_sampler"),
        "random_ltd": extras.get("random_ltd"),
        "sparse_tensor_module_names": set(),
        "skipped_steps": info.skipped_steps,
        "global_steps": info.global_steps,
        "global_samples": info.global_samples if info.global_samples is not None else 0,
        "dp_world_size": dp,
        "mp_world_size": tp,
        "ds_config": info.ds_config,
        "ds_version": info.ds_version or WRITTEN_DS_VERSION,
    }
    states.update(extra)
    states.update(extras.get("client_state") or {})
    return states


def zero_wrapper(
    extras: Mapping[str, Any], *, source_dtype: str, dtype: str, stage: int, ds_config: Mapping[str, Any] | None
) -> dict[str, Any]:
    """The ZeRO wrapper fields shared by every rank's optim file. A loss scaler survives only at the same dtype;
    a run that becomes fp16 gets the scaler ``ds_config``'s fp16 block (or DeepSpeed's defaults) starts with,
    since DeepSpeed's load puts the saved scaler in place of the new run's own."""
    scaler = extras.get("loss_scaler")
    if dtype == "fp16" and (source_dtype != "fp16" or scaler is None):
        scaler = scaler_object(fresh_fp16_scale(ds_config))
    elif scaler is None or dtype != source_dtype:
        scaler = LossScaler(cur_scale=1.0, dynamic=False)
    return {
        "zero_stage": ZeroStageEnum(stage),
        "loss_scaler": scaler,
        "dynamic_loss_scale": getattr(scaler, "dynamic", False) is True and dtype == "fp16",
        "overflow": False,
    }


def scaler_object(scale: LossScale) -> LossScaler | DynamicLossScaler:
    """DeepSpeed's pickled scaler object holding ``scale`` (a dynamic one keeps its dtype, fp16)."""
    if not scale.dynamic:
        return LossScaler(**scale.scaler_fields())
    return DynamicLossScaler(**scale.scaler_fields(), dtype=torch.float16)


def loss_scale_of(scaler: Any) -> LossScale | None:
    """The numbers of a DeepSpeed scaler object (a checkpoint's, or ``scaler_object``'s); None for anything else."""
    if isinstance(scaler, DynamicLossScaler):
        return LossScale.from_fields({"dynamic": True, **vars(scaler)})
    if isinstance(scaler, LossScaler):
        return LossScale(dynamic=False, cur_scale=float(getattr(scaler, "cur_scale", 1.0)))
    return None


def flat_state(
    flavour: Flavour,
    optim: Sequence[Mapping[str, Flat]],
    steps: Sequence[int],
    moments: bool,
    scalars: Sequence[Mapping[str, torch.Tensor]] = (),
    groups: Sequence[Mapping[str, Any]] = (),
) -> dict[int, dict[str, Any]]:
    """The torch optimizer state of the tensors it steps (ZeRO's flat tensors, or the parameters themselves
    without ZeRO): one entry per tensor, as the flavour keeps it (no step for the tensors of a group that
    counts none: ``groups[*]["params"]`` are the tensors' indices)."""
    if not moments:
        return {}
    stepless = {i for g in groups if not flavour.group_has_step(g) for i in g["params"]}
    return {
        i: flavour.make_state(tensors, step, scalars[i] if i < len(scalars) else None, with_step=i not in stepless)
        for i, (tensors, step) in enumerate(zip(optim, steps))
    }


def zero3_optim_block(
    *,
    wrapper: Mapping[str, Any],
    flavour: Flavour,
    fp32: Sequence[Flat],
    optim: Sequence[Mapping[str, Flat]],
    steps: Sequence[int],
    groups: list[dict[str, Any]],
    dp: int,
    moments: bool,
    scalars: Sequence[Mapping[str, torch.Tensor]] = (),
) -> dict[str, Any]:
    """The dict DeepSpeed's ZeRO-3 optimizer saves for one rank (and loads back)."""
    inner = {"state": flat_state(flavour, optim, steps, moments, scalars, groups), "param_groups": groups}
    return {**wrapper, "partition_count": dp, "optimizer_state_dict": inner, "fp32_flat_groups": fp32}


def zero12_optim_block(
    *,
    wrapper: Mapping[str, Any],
    flavour: Flavour,
    fp32: Sequence[torch.Tensor | Pieces],
    optim: Sequence[Mapping[str, torch.Tensor | Pieces]],
    layouts: list[Zero12Group],
    names: list[list[str]],
    index: int,
    steps: Sequence[int],
    groups: list[dict[str, Any]],
    clip_grad: float,
    ds_version: str | None,
    moments: bool,
    alignment_paddings: list[list[int]] | None = None,
    scalars: Sequence[Mapping[str, torch.Tensor]] = (),
    partitions: Sequence[int] | None = None,
) -> dict[str, Any]:
    """The dict DeepSpeedZeroOptimizer saves for rank ``index`` (and its ``load_state_dict`` takes back);
    ``partitions[g]``: the rank's partition of group g when that is not ``index`` (an expert group,
    partitioned over the rank's expert-data-parallel group)."""
    parts = [index] * len(layouts) if partitions is None else list(partitions)
    paddings = [layout.padding(parts[g]) for g, layout in enumerate(layouts)]
    mappings = []
    for g, layout in enumerate(layouts):
        mapping = OrderedDict()
        for i, name in enumerate(names[g]):
            where = layout.rank_slice(i, parts[g])
            if where is not None:
                mapping[name] = FragmentAddress(numel=where[1], start=where[0])
        mappings.append(mapping)
    if alignment_paddings is None:
        alignment_paddings = [[0] * len(group) for group in names]
    return {
        "loss_scaler": wrapper["loss_scaler"],
        "dynamic_loss_scale": wrapper["dynamic_loss_scale"],
        "overflow": wrapper["overflow"],
        "clip_grad": clip_grad,
        "base_optimizer_state": {
            "state": flat_state(flavour, optim, steps, moments, scalars, groups),
            "param_groups": groups,
        },
        # DeepSpeedZeroOptimizer strips the end padding; its loader (and BF16_Optimizer's) pads it back
        "single_partition_of_fp32_groups": [
            _head(fp32[g], layout.partition_size - paddings[g]) for g, layout in enumerate(layouts)
        ],
        "zero_stage": wrapper["zero_stage"],
        "group_paddings": paddings,
        "param_alignment_paddings": alignment_paddings,
        "partition_count": [layout.dp for layout in layouts],
        "ds_version": ds_version or WRITTEN_DS_VERSION,
        "param_slice_mappings": mappings,
    }


def client_state_dict(
    *,
    flavour: Flavour,
    optim: Sequence[Mapping[str, torch.Tensor | Pieces]],
    steps: Sequence[int],
    groups: list[dict[str, Any]],
    moments: bool,
    scalars: Sequence[Mapping[str, torch.Tensor]] = (),
) -> dict[str, Any]:
    """A torch optimizer's own ``state_dict()`` over the tensors it steps: what a stage-0 fp32 engine saves as
    ``optimizer``, and what DeepSpeed's FP16 wrappers hold inside theirs."""
    return {"state": flat_state(flavour, optim, steps, moments, scalars, groups), "param_groups": groups}


def unfused_wrapper(
    inner: Mapping[str, Any], masters: Sequence[Sequence[torch.Tensor | Pieces]], *, scale: LossScale
) -> dict[str, Any]:
    """FP16_UnfusedOptimizer.state_dict() (bf16/fp16 without ZeRO): its loss scale's fields, the inner optimizer's
    state_dict over the fp32 copies and those copies per param group, which its ``load_state_dict`` copies into
    its own."""
    return {
        **scale.wrapper_fields(),
        UNFUSED_INNER: dict(inner),
        UNFUSED_MASTERS: [list(group) for group in masters],
    }


def fused_wrapper(
    inner: Mapping[str, Any],
    flats: Sequence[torch.Tensor | Pieces],
    *,
    clip_grad: float,
    scale: LossScale | None = None,
) -> dict[str, Any]:
    """FP16_Optimizer.state_dict() (DeepSpeed's fused wrapper, around DeepSpeed or Apex FusedAdam without ZeRO):
    in fp16 its loss scale's fields (``scale``; in bf16 it scales nothing and saves none), the inner optimizer's
    state_dict over one flat fp32 master per param group, those masters, and the gradient clipping its
    ``load_state_dict`` takes."""
    fields = scale.wrapper_fields() if scale is not None else {}
    return {**fields, UNFUSED_INNER: dict(inner), FUSED_MASTERS: list(flats), "clip_grad": clip_grad}


def _head(flat: torch.Tensor | Pieces, n: int) -> torch.Tensor | Pieces:
    """The first ``n`` elements of a flat tensor, or of the pieces a streaming writer copies it from."""
    return flat.slice(0, n) if isinstance(flat, Pieces) else flat[:n]


def frozen_fields(shapes: Mapping[str, torch.Size], fragments: Mapping[str, Any], *, excluded: bool) -> dict[str, Any]:
    """A ZeRO-2/3 model-states file's frozen parameters. None for both when the source ``excluded`` them, as
    DeepSpeed writes for ``exclude_frozen_parameters`` (PEFT/LoRA runs): its loader then keeps the new
    engine's own frozen weights (the base model) instead of looking each one up and failing."""
    if excluded and not shapes:
        return {"frozen_param_shapes": None, "frozen_param_fragments": None}
    return {"frozen_param_shapes": OrderedDict(shapes), "frozen_param_fragments": OrderedDict(fragments)}


def optim_file_dict(block: Mapping[str, Any], ds_config: Mapping[str, Any], ds_version: str | None) -> dict[str, Any]:
    """What one ``*_optim_states.pt`` file holds around its optimizer block."""
    return {"optimizer_state_dict": block, "ds_config": ds_config, "ds_version": ds_version or WRITTEN_DS_VERSION}


#: the DeepSpeed release whose layout ucp writes: stamped as ``ds_version`` on the files of a source that names
#: none (an FSDP2 run's DCP folder), since DeepSpeed's ZeRO-1/2 load asserts one
WRITTEN_DS_VERSION = "0.19.8"


def universal_optimizer_state(facts: Facts, extras: Mapping[str, Any]) -> dict[str, Any]:
    """``zero/optimizer_state.pt`` of a universal directory: what DeepSpeed's ``load_universal`` reads
    besides the per-parameter folders (param groups, loss scaler, the stage)."""
    info = facts.info
    group_dicts = []
    for g in facts.groups:
        raw = {k: (tuple(v) if k == "betas" else v) for k, v in g.raw.items()}
        raw.setdefault("lr", g.hyper.lr)
        raw["params"] = []
        group_dicts.append(raw)
    step = torch.tensor(float(facts.step or 0), dtype=torch.float32)
    inner = {"state": {0: {"step": step}}, "param_groups": group_dicts}
    return {
        "zero_stage": ZeroStageEnum(info.zero_stage),
        "loss_scaler": (
            extras["loss_scaler"] if extras.get("loss_scaler") is not None else LossScaler(cur_scale=1.0, dynamic=False)
        ),
        "dynamic_loss_scale": extras.get("dynamic_loss_scale") is True,
        "overflow": extras.get("overflow") is True,
        "partition_count": info.dp_world_size,
        "optimizer_state_dict": inner,
        "param_groups": group_dicts,
        "ds_version": info.ds_version or WRITTEN_DS_VERSION,  # DeepSpeed's ZeRO-1/2 universal loader asserts it
    }


def universal_model_states(
    facts: Facts, extras: Mapping[str, Any], buffers: Mapping[str, torch.Tensor]
) -> dict[str, Any]:
    """The model-states file of a universal directory (buffers, scheduler, counters) for ``load_universal``."""
    info = facts.info
    return {
        "module": dict(buffers),
        "buffer_names": list(facts.buffer_names),
        "optimizer": None,
        "param_shapes": None,
        "lr_scheduler": extras.get("lr_scheduler"),
        "data_sampler": extras.get("data_sampler"),
        "random_ltd": extras.get("random_ltd"),
        "global_steps": info.global_steps,
        "global_samples": info.global_samples if info.global_samples is not None else 0,
        "skipped_steps": info.skipped_steps,
        "dp_world_size": info.dp_world_size,
        "mp_world_size": info.mp_world_size,
        "ds_config": info.ds_config,
        "ds_version": info.ds_version or WRITTEN_DS_VERSION,
        **dict(extras.get("client_state") or {}),
    }
