"""One rank of a harness run: ``python -m ucp.harness.worker SPEC_JSON`` (started by run_ranks)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch

from ucp.harness.launch import end_rank
from ucp.harness.model import TinyLM, build_param_groups, spec_batch, tp_layer_specs
from ucp.harness.spec import RunSpec

__all__ = ["main", "lr_decay", "record_path"]


def train_step(engine: Any, tokens: torch.Tensor) -> float:
    """One optimizer step of a DeepSpeed engine on this rank's tokens; the loss averaged over all ranks
    (what every harness records, so runs at different sizes compare step by step)."""
    loss = engine(tokens)
    engine.backward(loss)
    engine.step()
    mean = loss.detach().float().clone()
    torch.distributed.all_reduce(mean)
    return mean.item() / torch.distributed.get_world_size()


def lr_decay(step: int) -> float:
    """The harness's lr schedule: a module-level function so the scheduler state pickles cleanly."""
    return 1.0 / (1.0 + 0.05 * step)


def make_optimizer(spec: RunSpec, groups: list[dict]):
    """The optimizer ``spec`` names, over ``groups`` (None where DeepSpeed builds it from its config)."""
    betas = (0.9, 0.95)
    if spec.optimizer == "torch-adamw":
        return torch.optim.AdamW(groups, lr=spec.lr, betas=betas)
    if spec.optimizer == "torch-adam":
        return torch.optim.Adam(groups, lr=spec.lr, betas=betas, weight_decay=0.0)
    if spec.optimizer in ("torch-adamw-fused", "torch-adamw-capturable"):
        switch = spec.optimizer.removeprefix("torch-adamw-")
        return torch.optim.AdamW(groups, lr=spec.lr, betas=betas, **{switch: True})
    if spec.optimizer == "apex-fused-adam":
        from apex.optimizers import FusedAdam as ApexFusedAdam

        return ApexFusedAdam(groups, lr=spec.lr, betas=betas, adam_w_mode=True)
    if spec.optimizer == "ds-fused-adam":
        from deepspeed.ops.adam import FusedAdam

        return FusedAdam(groups, lr=spec.lr, betas=betas, adam_w_mode=True)
    if spec.optimizer == "ds-cpu-adam" and spec.zenflow:
        return None  # ZenFlow takes its CPU Adam from the config only
    if spec.optimizer == "ds-cpu-adam":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=spec.lr, betas=betas, adamw_mode=True)
    if spec.optimizer == "ds-muon":
        return None  # DeepSpeed builds it from the config (it must tag each parameter use_muon)
    return _other_optimizer(spec, groups, betas)


def _other_optimizer(spec: RunSpec, groups: list[dict], betas: tuple[float, float]):
    """The optimizers beyond Adam, each with the options that give it the most state to carry."""
    lr = spec.lr
    if spec.optimizer == "torch-adamw-amsgrad":
        return torch.optim.AdamW(groups, lr=lr, betas=betas, amsgrad=True)
    if spec.optimizer == "torch-sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=0.9, nesterov=True)
    if spec.optimizer == "torch-rmsprop":
        return torch.optim.RMSprop(groups, lr=lr * 0.1, momentum=0.5, centered=True)
    if spec.optimizer == "torch-nadam":
        return torch.optim.NAdam(groups, lr=lr, betas=betas)
    if spec.optimizer == "torch-radam":
        return torch.optim.RAdam(groups, lr=lr, betas=betas)
    if spec.optimizer == "torch-adamax":
        return torch.optim.Adamax(groups, lr=lr, betas=betas)
    if spec.optimizer == "torch-adagrad":
        return torch.optim.Adagrad(groups, lr=lr)
    if spec.optimizer == "ds-cpu-adagrad":
        from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad

        return DeepSpeedCPUAdagrad(groups, lr=lr)
    if spec.optimizer == "ds-cpu-lion":
        from deepspeed.ops.lion import DeepSpeedCPULion

        return DeepSpeedCPULion(groups, lr=lr * 0.1, betas=betas)
    if spec.optimizer == "torch-adadelta":
        return torch.optim.Adadelta(groups, lr=lr * 100)
    if spec.optimizer == "torch-rprop":
        return torch.optim.Rprop(groups, lr=lr)
    if spec.optimizer == "torch-asgd":
        return torch.optim.ASGD(groups, lr=lr, t0=1)  # mu leaves 1 after the first step
    if spec.optimizer == "torch-adafactor":
        return torch.optim.Adafactor(groups, lr=lr)
    if spec.optimizer in ("sf-adamw", "sf-sgd"):
        import schedulefree

        if spec.optimizer == "sf-sgd":
            return schedulefree.SGDScheduleFree(groups, lr=lr, momentum=0.9, warmup_steps=2)
        return schedulefree.AdamWScheduleFree(groups, lr=lr, betas=betas, warmup_steps=2)
    if spec.optimizer == "hf-adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(groups, lr=lr, beta1=0.9, relative_step=False, scale_parameter=False)
    raise SystemExit(f"unknown optimizer {spec.optimizer}")


def _or_none(full: Callable, param: torch.nn.Parameter, key: str) -> torch.Tensor | None:
    """DeepSpeed's full optimizer state of a parameter, or None where its optimizer holds none: ZeRO-Offload++ steps
    its GPU sub-groups with a second optimizer whose state DeepSpeed's own accessor cannot reach (KeyError)."""
    try:
        return full(param, key)
    except KeyError:
        return None


def _ds_config(spec: RunSpec) -> dict:
    zero: dict = {"stage": spec.stage}
    if spec.stage == 3:
        zero["stage3_param_persistence_threshold"] = spec.persistence_threshold
    if spec.sub_group_size:
        zero["sub_group_size"] = spec.sub_group_size
    if spec.hpz:
        zero["zero_hpz_partition_size"] = spec.hpz
    if spec.mics:
        zero["mics_shard_size"] = spec.mics
    if spec.round_robin:
        zero["round_robin_gradients"] = True
    if spec.offload:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": _swap_folder()} if spec.nvme else {"device": "cpu"}
    if spec.offload_param:
        zero["offload_param"] = {"device": "nvme", "nvme_path": _swap_folder()} if spec.nvme else {"device": "cpu"}
    if spec.zenflow:
        # the top quarter of each matrix's columns updated every step, the rest every `zenflow` steps;
        # overlap_step's optimizer process cannot start on CPU/gloo ranks (its second rendezvous fails)
        zero["zenflow"] = {
            "topk_ratio": 0.25,
            "select_strategy": "step",
            "select_interval": spec.zenflow,
            "update_interval": spec.zenflow,
            "full_warm_up_rounds": 0,
            "overlap_step": False,
        }
    force = spec.offload and spec.optimizer != "ds-cpu-adam"  # DeepSpeed's other CPU optimizers are client ones
    config: dict = {
        "train_micro_batch_size_per_gpu": spec.global_batch // spec.dp,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "bf16": {"enabled": spec.dtype == "bf16"},
        **({"fp16": _fp16_config(spec)} if spec.dtype == "fp16" else {}),
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        **({"zero_force_ds_cpu_optimizer": False} if force else {}),
    }
    if spec.optimizer == "ds-muon":
        # MuonWithAuxAdam: Muon on the matrices, Adam (DeepSpeed's FusedAdam) on the rest
        params = {"lr": spec.lr, "momentum": 0.95, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}
        config["optimizer"] = {"type": "Muon", "params": params}
        zero["reduce_scatter"] = False  # DeepSpeed 0.19.8 refuses Muon with reduce scatter
    if spec.zenflow:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": spec.lr, "betas": [0.9, 0.95], "weight_decay": 0.1}}
    if spec.master == "fp16":
        config["fp16"]["fp16_master_weights_and_grads"] = True
    elif spec.master != "fp32":
        config["bf16"]["bf16_master_weights_and_grads"] = True
        config["bf16"]["bf16_optimizer_states"] = spec.master == "bf16-states"
    if spec.grad_accum_dtype:
        config["data_types"] = {"grad_accum_dtype": spec.grad_accum_dtype}
    if spec.tp > 1:
        config["tensor_parallel"] = {
            "autotp_size": spec.tp,
            "partition_config": {"use_default_specs": False, "layer_specs": tp_layer_specs(spec.model)},
        }
    config.update(spec.ds_config or {})
    if spec.load is not None and spec.load.kind == "ds-universal":
        config["checkpoint"] = {"load_universal": True}
    return config


def _swap_folder() -> str:
    """A folder of this rank for ZeRO-Infinity's NVMe swap files, removed when the rank exits."""
    import atexit
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="ucp-nvme-")
    atexit.register(shutil.rmtree, folder, True)
    return folder


def _fp16_config(spec: RunSpec) -> dict:
    """Dynamic loss scaling that halves the scale on every overflow (hysteresis 1), from 2**loss_scale_power:
    a high power makes the first steps overflow and be skipped, as a real fp16 run's first steps do."""
    return {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": spec.loss_scale_power,
        "loss_scale_window": 1000,
        "hysteresis": 1,
        "min_loss_scale": 1,
    }


def _relink_optimizer_state(optimizer) -> None:
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


def _parallel_ranks(spec: RunSpec) -> tuple[int, int]:
    """(data-parallel rank, tensor-parallel rank) of this process."""
    if spec.tp == 1:  # DeepSpeed sets up its parallel groups only for AutoTP
        return torch.distributed.get_rank(), 0
    from deepspeed.utils import groups

    return groups.get_data_parallel_rank(), groups.get_tensor_model_parallel_rank()


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


def _stage0_state(engine: Any, param: torch.nn.Parameter, keys: list[str]) -> tuple[torch.Tensor, dict[str, Any]]:
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


def _record(engine, model, spec: RunSpec, losses: list[float], refused: str | None = None) -> None:
    """Gather what the live engine holds (collectives: every rank takes part) and let DP rank 0 save it.

    Under tensor parallelism each TP rank holds its own slices: each saves its own record.
    """
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    _relink_optimizer_state(engine.optimizer)
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
                fp32, states = _stage0_state(engine, param, _keys_of(param, keys))
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
    dp_rank, tp_rank = _parallel_ranks(spec)
    if dp_rank == 0 and spec.record:
        torch.save(out, record_path(spec.record, tp_rank))


def _plain(value: Any) -> bool:
    """A value a record keeps as it is (the loss scaler's numbers, not its dtype or tensors)."""
    return isinstance(value, (bool, int, float, str, type(None)))


def _allow_fp16_on_cpu() -> None:
    """DeepSpeed 0.19.8 refuses fp16 on a CPU without oneDNN fp16 kernels (AVX512-FP16 or AMX-FP16:
    ``is_fp16_supported``), though torch computes fp16 on any CPU, more slowly. The gate is all that is
    lifted: the engine, its FP16 optimizers and dynamic loss scaler are DeepSpeed's own."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    accelerator.is_fp16_supported = lambda: True  # type: ignore[method-assign]


def _mics_on_gloo() -> None:
    """MiCS (DeepSpeed before 0.19.8) gathers its shards with ``all_gather_coalesced``, run under torch's coalescing
    manager, which gloo lacks. Here the same gathers run one after the other, each finished before the
    call returns. Only the communication changes: partitions, optimizer and checkpoint files are MiCS's."""
    import deepspeed.comm as dist
    from deepspeed.comm.torch import TorchBackend

    class _Done:
        def wait(self, **_: Any) -> None:
            pass

    def gather_each(self, output_tensors, input_tensors, group=None, async_op=False):
        for output, tensor in zip(output_tensors, input_tensors):
            torch.distributed.all_gather_into_tensor(output, tensor, group=group)
        return _Done()

    TorchBackend.all_gather_coalesced = gather_each  # type: ignore[method-assign]
    dist.has_coalescing_manager = lambda: True


def main(argv: list[str]) -> None:
    spec = RunSpec.from_json(argv[0])
    os.environ.setdefault("DS_ACCELERATOR", spec.device)
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl" if spec.device == "cuda" else "gloo")
    if spec.dtype == "fp16" and spec.device == "cpu":
        _allow_fp16_on_cpu()
    if spec.mics and spec.device == "cpu":
        _mics_on_gloo()
    torch.manual_seed(spec.seed)
    model = TinyLM(spec.model)
    groups = build_param_groups(model, spec.param_groups, spec.lr)
    optimizer = make_optimizer(spec, groups)
    if spec.compiled:
        model = torch.compile(model, backend="eager")  # type: ignore[assignment]  # an OptimizedModule
    scheduler = (lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_decay)) if spec.scheduler else None
    mpu: Any = None
    if spec.sp > 1:
        from deepspeed.runtime.sequence_parallel import parallel_state_sp

        parallel_state_sp.initialize_sequence_parallel(spec.sp)
        mpu = parallel_state_sp
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        model_parameters=groups if optimizer is None else None,
        lr_scheduler=scheduler,
        config=_ds_config(spec),
        mpu=mpu,
    )
    refused: str | None = None
    if spec.load is not None:
        if spec.load.kind == "ucp":
            import ucp

            try:
                ucp.restore(
                    engine,
                    spec.load.path,
                    load_optimizer_states=spec.load.load_optimizer_states,
                    strict=spec.load.strict,
                )
            except ucp.UcpError as err:
                if not spec.load.refused:
                    raise
                refused = str(err)
            else:
                if spec.load.refused:
                    raise SystemExit(f"ucp.restore took {spec.load.path}, which the run expected it to refuse")
        else:
            path, _ = engine.load_checkpoint(
                spec.load.path,
                tag=spec.load.tag,
                load_optimizer_states=spec.load.load_optimizer_states,
                load_module_strict=spec.load.strict,
            )
            if path is None:
                raise SystemExit(f"DeepSpeed loaded nothing from {spec.load.path}")
    base = getattr(engine.optimizer, "optimizer", engine.optimizer)
    if callable(getattr(base, "train", None)):
        base.train()  # a schedule-free optimizer steps in train mode (axolotl and accelerate call it so)
    rank, _ = _parallel_ranks(spec)
    losses = []
    for step in range(spec.first_step, spec.first_step + spec.steps):
        tokens = spec_batch(spec, step, rank=rank, dp=spec.dp)
        losses.append(train_step(engine, tokens.to(engine.device)))
    if spec.save_dir:
        engine.save_checkpoint(spec.save_dir, tag=spec.save_tag, exclude_frozen_parameters=spec.exclude_frozen)
    if spec.record:
        _record(engine, model, spec, losses, refused)


if __name__ == "__main__":
    main(sys.argv[1:])
    end_rank()
