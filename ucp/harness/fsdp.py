"""Real FSDP2 on local CPU ranks: the far side of ``ucp restore --format dcp`` and of the DCP source.

``python -m ucp.harness.fsdp SPEC_JSON`` is one rank (started by :func:`run_fsdp`): the harness
model (:mod:`ucp.harness.model`) with every block and the root wrapped by
``torch.distributed.fsdp.fully_shard`` on gloo, the same param groups, lr schedule and batches as a
DeepSpeed run of the same :class:`~ucp.harness.spec.RunSpec` (``dp`` is the world size), so the two
resume to the same numbers. It loads and saves with the standard DCP lines (``get_state_dict``,
``dcp.load``/``dcp.save``, ``set_state_dict``) and records what it holds in the layout of
:mod:`ucp.harness.worker`'s records, so the same assertions compare both.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from ucp.harness.launch import end_rank, run_ranks
from ucp.harness.model import TinyLM, build_param_groups, spec_batch
from ucp.harness.spec import RunSpec
from ucp.harness.worker import lr_decay, make_optimizer

__all__ = ["run_fsdp", "loaded_record_path", "main", "MODULE"]

#: what each rank runs (``python -m MODULE SPEC_JSON``)
MODULE = "ucp.harness.fsdp"

#: what the FSDP2 run keeps besides model and optimizer (the names ucp's DCP target writes)
_SCHEDULER, _TRAIN = "lr_scheduler", "train_state"


def loaded_record_path(record: str) -> str:
    """Where a run that loads a checkpoint records what it holds right after the load."""
    return record.removesuffix(".pt") + ".loaded.pt"


def run_fsdp(spec: RunSpec, *, timeout: float = 600.0, log_dir: str | os.PathLike | None = None) -> None:
    """Run ``spec`` on ``spec.dp`` local FSDP2 ranks (gloo) and wait; RankFailure names the first that failed."""
    if spec.tp != 1:
        raise ValueError("the FSDP2 harness shards over data parallelism only (tp=1)")
    run_ranks(spec, timeout=timeout, log_dir=log_dir, module=MODULE)


def _build(spec: RunSpec) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(spec.seed)
    model = TinyLM(spec.model)
    low = torch.bfloat16 if spec.dtype == "bf16" else torch.float32
    policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    groups = build_param_groups(model, spec.param_groups, spec.lr)
    if not spec.optimizer.startswith(("torch-", "sf-")):
        raise SystemExit(f"the FSDP2 harness runs torch's and schedule-free optimizers, not {spec.optimizer}")
    optimizer = make_optimizer(spec, groups)  # with the settings a DeepSpeed run of the spec has
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_decay) if spec.scheduler else None
    return model, optimizer, scheduler


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, counters: dict) -> dict:
    """What the run saves and loads: get_state_dict's two, the scheduler, the engine-style counters."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    train = {"step": counters["global_steps"], "global_samples": counters["global_samples"]}
    state = {"model": model_sd, "optim": optim_sd, _TRAIN: {**train, "skipped_steps": counters["skipped_steps"]}}
    if scheduler is not None:
        state[_SCHEDULER] = scheduler.state_dict()
    return state


def _load(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, counters: dict) -> None:
    """The standard four lines, plus the scheduler and the counters."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _state(model, optimizer, scheduler, counters)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if scheduler is not None:
        scheduler.load_state_dict(state[_SCHEDULER])
    train = state[_TRAIN]
    counters.update(global_steps=int(train["step"]), global_samples=int(train["global_samples"]))
    counters["skipped_steps"] = int(train["skipped_steps"])


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (a collective: every rank calls it in the same order)."""
    full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return full.detach().cpu().clone()


def _record(
    model: torch.nn.Module, optimizer: Any, scheduler: Any, spec: RunSpec, counters: dict, losses: list
) -> dict:
    """What the run holds, in the layout of :mod:`ucp.harness.worker`'s records."""
    low = torch.bfloat16 if spec.dtype == "bf16" else torch.float32
    out: dict[str, Any] = {"losses": losses, "params": {}, "exp_avg": {}, "exp_avg_sq": {}, "state": {}, "module": {}}
    seen: dict[int, str] = {}
    names = []
    for name, param in model.named_parameters(remove_duplicate=False):
        names.append(name)
        if id(param) in seen:
            continue
        seen[id(param)] = name
        full = _full(param)
        out["module"][name] = full.to(low)
        if not param.requires_grad:
            continue
        out["params"][name] = full.float()
        for key, value in optimizer.state.get(param, {}).items():
            if torch.is_tensor(value) and value.dim():
                out["state"].setdefault(key, {})[name] = _full(value)
        for key in ("exp_avg", "exp_avg_sq"):
            out[key][name] = out["state"].get(key, {}).get(name)
    states = list(optimizer.state.values())
    out["state_scalars"] = [{k: float(v) for k, v in s.items() if torch.is_tensor(v) and not v.dim()} for s in states]
    out["state_steps"] = [float(s["step"]) if "step" in s else None for s in states]  # as DeepSpeed's records
    out["state_step_types"] = [type(s.get("step")).__name__ for s in states]
    out["names"] = names
    out["tied"] = {n: seen[id(p)] for n, p in model.named_parameters(remove_duplicate=False) if seen[id(p)] != n}
    out["buffers"] = {n: b.detach().cpu().clone() for n, b in model.named_buffers()}
    out["group_hparams"] = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    out["counters"] = dict(counters)
    out["lr_scheduler"] = scheduler.state_dict() if scheduler is not None else None
    out["lrs"] = [g["lr"] for g in optimizer.param_groups]
    return out


def _save_record(out: dict, path: str) -> None:
    if torch.distributed.get_rank() == 0:
        torch.save(out, path)


def main(argv: list[str]) -> None:
    spec = RunSpec.from_json(argv[0])
    torch.distributed.init_process_group("gloo")
    model, optimizer, scheduler = _build(spec)
    for group in optimizer.param_groups:
        if "train_mode" in group:
            # schedule-free steps in train mode, and get_state_dict's state init steps it; its train() would also
            # leave an empty state entry per parameter, which torch 2.13's get_state_dict takes for initialised
            # state (so nothing loads): what train() does before there is any state, without those entries
            group["train_mode"] = True
    counters = {"global_steps": 0, "global_samples": 0, "skipped_steps": 0}
    if spec.load is not None:
        _load(spec.load.path, model, optimizer, scheduler, counters)
        if spec.record:
            _save_record(_record(model, optimizer, scheduler, spec, counters, []), loaded_record_path(spec.record))
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    losses = []
    for step in range(spec.first_step, spec.first_step + spec.steps):
        tokens = spec_batch(spec, step, rank=rank, dp=world)
        loss = model(tokens)
        loss.backward()
        # DeepSpeed clips the global gradient norm at 1.0 unless told otherwise (gradient_clipping, 0.19.8)
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
        counters["global_steps"] += 1
        counters["global_samples"] += spec.global_batch
        mean = loss.detach().float().clone()
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / world)
    if spec.save_dir:
        import torch.distributed.checkpoint as dcp

        dcp.save(_state(model, optimizer, scheduler, counters), checkpoint_id=spec.save_dir)
    if spec.record:
        _save_record(_record(model, optimizer, scheduler, spec, counters, losses), spec.record)


if __name__ == "__main__":
    main(sys.argv[1:])
    end_rank()
