"""The full live state of a Megatron run, gathered over TP, PP and DP for the harness's records.

Every parameter by its Megatron name with the *global* layer number (a PP stage's layers restart at 0 in
memory), in the TP-invariant layout the checkpoint stores: TP shards concatenated on their partition dim, fused
QKV rows as on disk, SwiGLU fc1 as ``[gate_all; up_all]`` (each TP rank holds ``[gate_r; up_r]``). For each:
``fp32`` (the DistributedOptimizer's main param), ``exp_avg``, ``exp_avg_sq`` (absent before the first step),
and the Adam ``step``. Collective: every rank calls; rank 0 gets the merged record, the others None.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.support.megatron_model import Built

__all__ = ["global_names", "live_record"]

_MOMENTS = ("exp_avg", "exp_avg_sq")


def global_names(module: Any) -> dict[str, tuple[torch.nn.Parameter, int | None]]:
    """name -> (parameter, global layer index or None) for this rank's model chunk."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    offset = get_transformer_layer_offset(module.config)
    names: dict[str, tuple[torch.nn.Parameter, int | None]] = {}
    for name, param in module.named_parameters():
        parts = name.split(".")
        layer = None
        if parts[:2] == ["decoder", "layers"]:
            layer = int(parts[2]) + offset
            parts[2] = str(layer)
        names[".".join(parts)] = (param, layer)
    return names


def _tp_full(local: torch.Tensor, param: Any, glu_fc1: bool) -> torch.Tensor:
    """All-gather a TP shard into the checkpoint's global layout (collective over the TP group)."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return local.clone()
    parts = [torch.empty_like(local) for _ in range(tp)]
    torch.distributed.all_gather(parts, local.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    if glu_fc1:
        halves = [part.chunk(2, dim=0) for part in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(parts, dim=param.partition_dim)


def _dp_full(built: Built, param: Any) -> tuple[dict[str, torch.Tensor], float, int]:
    """The main param and moments of ``param`` (this TP shard), from the DP ranks that each own a flat range of
    it (an all-reduce of disjoint ranges over zeros: exact, but -0.0 comes back as 0.0); its Adam step and the
    index of its param group (known to the DP ranks that own part of it)."""
    from megatron.core import parallel_state

    optimizer = built.distributed
    flat = {key: torch.zeros(param.numel(), dtype=torch.float32) for key in ("fp32", *_MOMENTS)}
    # whether any DP rank holds each moment; the step; the group index + 1
    known = torch.zeros(len(_MOMENTS) + 2)
    if param in optimizer.model_param_group_index_map:
        span = optimizer._get_model_param_range_map(param)["param"]
        states = optimizer._get_main_param_and_optimizer_states(param)
        flat["fp32"][span.start : span.end] = states["param"].detach().float()
        for i, key in enumerate(_MOMENTS):
            if key in states:
                flat[key][span.start : span.end] = states[key].detach().float()
                known[i] = 1
        known[-2] = float(states["step"]) if "step" in states else 0.0
        known[-1] = optimizer.model_param_group_index_map[param][0] + 1
    group = parallel_state.get_data_parallel_group()
    for tensor in flat.values():
        torch.distributed.all_reduce(tensor, group=group)
    torch.distributed.all_reduce(known, op=torch.distributed.ReduceOp.MAX, group=group)
    tensors = {
        key: tensor.view_as(param) for key, tensor in flat.items() if key == "fp32" or known[_MOMENTS.index(key)]
    }
    return tensors, float(known[-2]), int(known[-1]) - 1


def _param_groups(built: Built) -> list[dict[str, Any]]:
    """The torch optimizer's param groups' hyperparameters: without their params, nor the ``step`` a loaded group
    carries (Megatron's checkpoint holds a group step, torch's Adam keeps one per param: ``steps``)."""
    groups = []
    for group in built.distributed.optimizer.param_groups:
        entry = {}
        for key, value in group.items():
            if key not in ("params", "step"):
                entry[key] = float(value) if torch.is_tensor(value) else value
        groups.append(entry)
    return groups


def _stage_record(built: Built, grads: bool) -> dict[str, Any]:
    """This rank's share: every parameter of its chunk, full over TP and DP (collective within the stage)."""
    state, steps, layers, group_of, grad = {}, {}, {}, {}, {}
    for name, (param, layer) in global_names(built.ddp.module).items():
        glu = name.endswith("mlp.linear_fc1.weight")
        tensors, steps[name], group_of[name] = _dp_full(built, param)
        state[name] = {key: _tp_full(value, param, glu) for key, value in tensors.items()}
        layers[name] = layer
        if grads:  # only whole at DP 1: the buffer is reduce-scattered over DP
            grad[name] = _tp_full(param.main_grad.detach().clone(), param, glu)
    return {"state": state, "steps": steps, "layer": layers, "group_of": group_of, "grads": grad}


def live_record(built: Built, grads: bool = False) -> dict[str, Any] | None:
    """The merged record on rank 0 (None elsewhere), every dict in the model's ``named_parameters()`` order
    (stage by stage): ``state`` (name -> fp32/exp_avg/exp_avg_sq), ``steps``
    (name -> Adam step), ``layer`` (name -> global layer or None), ``group`` (name -> index in
    ``param_groups``), ``param_groups`` (hyperparameters), ``scheduler``, and with ``grads`` the gradients of the
    last backward (name -> full gradient; DP 1 only)."""
    from megatron.core import parallel_state

    share = _stage_record(built, grads)
    first = parallel_state.get_tensor_model_parallel_rank() == 0 and parallel_state.get_data_parallel_rank() == 0
    rank0 = torch.distributed.get_rank() == 0
    shares: list[Any] | None = [None] * torch.distributed.get_world_size() if rank0 else None
    torch.distributed.gather_object(share if first else None, shares, dst=0)
    if shares is None:
        return None
    merged: dict[str, Any] = {"state": {}, "steps": {}, "layer": {}, "group": {}, "grads": {}}
    for part in filter(None, shares):
        merged["state"].update(part["state"])
        merged["steps"].update(part["steps"])
        merged["layer"].update(part["layer"])
        merged["group"].update(part["group_of"])
        merged["grads"].update(part["grads"])
    if not grads:
        del merged["grads"]
    merged["param_groups"] = _param_groups(built)
    merged["scheduler"] = built.scheduler.state_dict()
    return merged
