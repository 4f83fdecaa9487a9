"""Recording what a live DeepSpeed engine holds, for the tests to compare a conversion with bit for bit: every
parameter's fp32 master and optimizer state gathered whole, the module, buffers, counters, loss scaler and
schedule (``ucp.harness.worker`` records at the end of a run)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ucp.harness.spec import RunSpec

__all__ = ["parallel_ranks", "record", "record_path", "relink_optimizer_state", "stage0_state"]

logger = logging.getLogger(__name__)


def relink_optimizer_state(optimizer) -> None:
    """Point every parameter's optimizer-state fragment at its group's state.

    DeepSpeed 0.19.8 ZeRO-1/2 links the fragments once, right after group 0's first step, when
    groups >= 1 have no state yet, and never again; safe_get_full_optimizer_state then finds no
    exp_avg for their parameters. BF16_Optimizer links after all groups step; relinking is harmless.
    """
    from deepspeed.utils.mixed_precision_linkage import lazy_init_hp_params_optimizer_state

    lp_groups = getattr(optimizer, "bit16_groups", None) or getattr(optimizer, "bf16_groups", None)
    hp_groups = getattr(optimizer, "single_partition_of_fp32_groups", None) or getattr(
        optimizer, "fp32_groups_flat_partition", None
    )
    if lp_groups is None or hp_groups is None:
        return  # ZeRO-3 links per sub-group as it steps
    for lp, hp in zip(lp_groups, hp_groups):
        if hp in optimizer.optimizer.state:
            lazy_init_hp_params_optimizer_state(lp, hp, optimizer.optimizer.state)


def parallel_ranks(spec: RunSpec) -> tuple[int, int]:
    """(data-parallel rank, tensor-parallel rank) of this process."""
    if spec.tp == 1:  # DeepSpeed sets up its parallel groups only for AutoTP
        return torch.distributed.get_rank(), 0
    from deepspeed.utils import groups

    return groups.get_data_parallel_rank(), groups.get_tensor_model_parallel_rank()


def _or_none(full: Callable, param: torch.nn.Parameter, key: str) -> torch.Tensor | None:
    """DeepSpeed's full optimizer state of a parameter, or None where its optimizer holds none: ZeRO-Offload++ steps
    its GPU sub-groups with a second optimizer whose state DeepSpeed's own accessor cannot reach (KeyError)."""
    try:
        return full(param, key)
    except KeyError:
        return None


def _keys_of(param: torch.nn.Parameter, keys: list[str]) -> list[str]:
    """The state keys a parameter's group keeps, decided alike on every rank (the gather is a collective):
    DeepSpeed tags Muon's parameters use_muon; their group keeps momentum_buffer, the others Adam's."""
    muon = getattr(param, "use_muon", None)
    if muon is None:
        return keys
    return [k for k in keys if (k == "momentum_buffer") == bool(muon)]


def _whole_momentum(engine) -> tuple[dict[str, torch.Tensor], list[tuple[str, bool]]]:
    """Muon's ZeRO-1/2 momentum per parameter, cut by DeepSpeed's own bookkeeping: each rank keeps the
    momentum of its ``params_in_partition`` whole, one after the other. Collective. Returns the first
    copy of each, and for every parameter held by several ranks whether their copies agree."""
    opt = engine.optimizer
    mine: dict[str, torch.Tensor] = {}
    for g, params in enumerate(opt.params_in_partition):
        buffer = opt.optimizer.state.get(opt.single_partition_of_fp32_groups[g], {}).get("momentum_buffer")
        if buffer is None:
            continue
        offset = 0
        for param in params:
            n = param.numel()
            mine[engine.param_names[param]] = buffer[offset : offset + n].view(param.shape).detach().cpu().clone()
            offset += n
    gathered: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, mine)
    first: dict[str, torch.Tensor] = {}
    copies: list[tuple[str, bool]] = []
    for held in gathered:
        for name, value in held.items():
            if name in first:
                copies.append((name, torch.equal(first[name], value)))
            else:
                first[name] = value
    return first, copies


def stage0_state(engine: Any, param: torch.nn.Parameter, keys: list[str]) -> tuple[torch.Tensor, dict[str, Any]]:
    """Without ZeRO, what the optimizer steps for ``param`` and its state by key: its fp32 copy under
    FP16_UnfusedOptimizer (bf16), its slice of the group's flat fp32 master and flat state under the fused
    FP16_Optimizer (bf16 with FusedAdam), else the parameter itself (fp32, the client optimizer)."""
    opt = engine.optimizer
    base = opt.optimizer if hasattr(opt, "optimizer") else opt
    for lp_group, hp_group in zip(getattr(opt, "fp16_groups", ()), getattr(opt, "fp32_groups", ())):
        for lp, hp in zip(lp_group, hp_group):
            if lp is param:
                return hp, {k: base.state.get(hp, {}).get(k) for k in keys}
    for lp_group, flat in zip(getattr(opt, "fp16_groups", ()), getattr(opt, "fp32_groups_flat", ())):
        at = 0
        for lp in lp_group:
            if lp is param:
                state = base.state.get(flat, {})
                start, end = at, at + lp.numel()
                return flat[start:end].view(lp.shape), {
                    k: None if state.get(k) is None else state[k][start:end].view(lp.shape) for k in keys
                }
            at += lp.numel()
    return param, {k: base.state.get(param, {}).get(k) for k in keys}


def _z3_full_state(param: torch.nn.Parameter, key: str) -> torch.Tensor:
    """A ZeRO-3 parameter's whole optimizer state in the dtype the optimizer keeps it: DeepSpeed 0.19.8's
    safe_get_full_optimizer_state gathers it in the masters' dtype, which cuts the fp32 moments CPU Adam keeps
    for bf16 masters to bf16."""
    import deepspeed.comm as dist

    opt = param._z3_optimizer  # type: ignore[attr-defined]
    part, _ = opt._get_fp32_opt_state_partition(param, release_swap_buffers=True, optim_state_key=key)
    group = opt._get_param_partition_group(param)
    whole = torch.empty(dist.get_world_size(group=group) * part.numel(), dtype=part.dtype, device=part.device)
    dist.all_gather_into_tensor(whole, part.contiguous(), group=group)
    return whole.narrow(0, 0, param.ds_numel).view(param.ds_shape)  # type: ignore[attr-defined]


def _round_robin_full(opt, param: torch.nn.Parameter, key: str | None) -> torch.Tensor:
    """A ZeRO-1/2 parameter's whole fp32 master (``key`` None) or optimizer state ``key``, cut from its
    group's gathered flat buffer where the buffer holds it.

    With ``round_robin_gradients`` the flat buffers hold each group's members in round-robin order, but
    DeepSpeed 0.19.8 links the fragment mappings (``_hp_mapping``) walking them in their original order, so
    safe_get_full_fp32_param and safe_get_full_optimizer_state return other parameters' bytes.
    """
    import deepspeed.comm as dist

    for g, members in enumerate(opt.round_robin_bit16_groups):
        index = next((j for j, p in enumerate(members) if p is param), None)
        if index is None:
            continue
        part = opt.single_partition_of_fp32_groups[g]
        if key is not None:
            part = opt.optimizer.state[part][key]
        group = opt.real_dp_process_group[g]
        part = part.detach().clone()
        whole = torch.empty(dist.get_world_size(group=group) * part.numel(), dtype=part.dtype, device=part.device)
        dist.all_gather_into_tensor(whole, part, group=group)
        return whole.narrow(0, opt.round_robin_bit16_offsets[g][index], param.numel()).view(param.shape)
    raise KeyError("the parameter is in no flat group")


def record_path(record: str, tp_rank: int) -> str:
    """Where a tensor-parallel rank's record goes: tp rank 0 writes ``record`` itself."""
    return record if tp_rank == 0 else record.removesuffix(".pt") + f".tp{tp_rank}.pt"


def record(engine, model, spec: RunSpec, losses: list[float], refused: str | None = None) -> None:
    """Gather what the live engine holds (collectives: every rank takes part) and let DP rank 0 save it.

    Under tensor parallelism each TP rank holds its own slices: each saves its own record.
    """
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    relink_optimizer_state(engine.optimizer)
    out: dict = {"losses": losses, "params": {}, "exp_avg": {}, "exp_avg_sq": {}, "state": {}, "module": {}}
    out["refused"] = refused
    base = engine.optimizer.optimizer if hasattr(engine.optimizer, "optimizer") else engine.optimizer
    # every elementwise state key the optimizer keeps (safe_get_full_optimizer_state gathers those),
    # and each flat tensor's 0-dim entries (NAdam's mu_product, the step) as they are
    keys = sorted({k for s in base.state.values() for k, v in s.items() if torch.is_tensor(v) and v.dim() == 1})
    whole = spec.optimizer == "ds-muon" and spec.stage < 3 and not spec.offload
    if whole:
        # ZeRO-1/2 keeps Muon's momentum whole per parameter, not as a partition fragment: DeepSpeed 0.19.8's
        # safe_get_full_optimizer_state cannot gather it (and fails on some ranks only, hanging the rest)
        keys = [k for k in keys if k != "momentum_buffer"]
        out["state"]["momentum_buffer"], out["whole_copies"] = _whole_momentum(engine)
    out["state_scalars"] = [
        {k: (v.item() if torch.is_tensor(v) else v) for k, v in s.items() if not (torch.is_tensor(v) and v.dim())}
        for s in base.state.values()
    ]
    names = []
    seen: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.append(name)
        if id(param) in seen:
            continue
        seen[id(param)] = name
        if param.requires_grad:
            if spec.stage == 0:  # no ZeRO: no fragment mapping
                fp32, states = stage0_state(engine, param, _keys_of(param, keys))
            elif getattr(engine.optimizer, "round_robin_gradients", False):
                fp32 = _round_robin_full(engine.optimizer, param, None)
                states = {key: _round_robin_full(engine.optimizer, param, key) for key in _keys_of(param, keys)}
                out.setdefault("deepspeed_fp32", {})[name] = safe_get_full_fp32_param(param).detach().float().cpu()
            else:
                fp32 = safe_get_full_fp32_param(param)
                full = _z3_full_state if spec.stage == 3 and spec.master != "fp32" else safe_get_full_optimizer_state
                states = {key: _or_none(full, param, key) for key in _keys_of(param, keys)}
            out["params"][name] = fp32.detach().float().cpu().clone()
            for key, state in states.items():
                out["state"].setdefault(key, {})[name] = None if state is None else state.detach().cpu().clone()
            for key in ("exp_avg", "exp_avg_sq"):  # Adam's, in the record's first layout
                state = out["state"].get(key, {}).get(name)
                out[key][name] = None if state is None else state.float()
        params = [param] if hasattr(param, "ds_id") else []
        with deepspeed.zero.GatheredParameters(params):
            out["module"][name] = param.detach().cpu().clone()
    out["names"] = names
    # ZeRO++ hpZ: how many groups hold a secondary copy of each weight (1 without hpZ)
    out["sequence_parallel"] = engine.sequence_parallel_size
    out["persistent"] = [n for n, p in model.named_parameters() if getattr(p, "ds_persist", False)]  # ZeRO-3
    out["hpz_groups"] = max((getattr(p, "ds_secondary_tensor_num_of_groups", 1) for p in model.parameters()), default=1)
    out["tied"] = {n: seen[id(p)] for n, p in model.named_parameters(remove_duplicate=False) if seen[id(p)] != n}
    out["buffers"] = {n: b.detach().cpu().clone() for n, b in model.named_buffers()}
    out["group_hparams"] = [{k: v for k, v in g.items() if k != "params"} for g in base.param_groups]
    out["state_steps"] = [
        (float(s["step"]) if torch.is_tensor(s.get("step")) else s.get("step")) for s in base.state.values()
    ]
    out["state_step_types"] = [type(s.get("step")).__name__ for s in base.state.values()]
    out["counters"] = {
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "skipped_steps": engine.skipped_steps,
    }
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    config = getattr(engine.optimizer, "loss_scale_config", None)
    if scaler is None and getattr(config, "use_grad_scaling", False):  # an fp16 wrapper without ZeRO keeps it here
        scaler = config
    out["loss_scaler"] = None if scaler is None else {k: v for k, v in vars(scaler).items() if _plain(v)}
    out["lr_scheduler"] = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
    out["lrs"] = [g["lr"] for g in base.param_groups]
    dp_rank, tp_rank = parallel_ranks(spec)
    if dp_rank == 0 and spec.record:
        torch.save(out, record_path(spec.record, tp_rank))


def _plain(value: Any) -> bool:
    """A value a record keeps as it is (the loss scaler's numbers, not its dtype or tensors)."""
    return isinstance(value, (bool, int, float, str, type(None)))
