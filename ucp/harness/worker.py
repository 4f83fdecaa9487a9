"""One rank of a harness run: ``python -m ucp.harness.worker SPEC_JSON`` (started by run_ranks)."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from ucp.harness.engine_config import ds_config
from ucp.harness.launch import end_rank
from ucp.harness.model import TinyLM, build_param_groups, spec_batch
from ucp.harness.optimizers import make_optimizer
from ucp.harness.record import parallel_ranks, record, record_path
from ucp.harness.record import relink_optimizer_state as _relink_optimizer_state  # noqa: F401  # imported from here
from ucp.harness.record import stage0_state as _stage0_state  # noqa: F401  # by ucp.harness.moe and the tests
from ucp.harness.spec import RunSpec

__all__ = ["main", "lr_decay", "record_path", "train_step", "make_optimizer"]


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


def _partitioned_model(spec: RunSpec, deepspeed: Any) -> TinyLM:
    """The model built under ``deepspeed.zero.Init``: each parameter is cut to this rank's partition as its module is
    made. Checked, so that a run meant to show it cannot quietly build the whole model."""
    if spec.stage != 3:
        raise SystemExit(f"zero_init needs ZeRO-3; this run is stage {spec.stage}")
    with deepspeed.zero.Init(config_dict_or_path=ds_config(spec)):
        model = TinyLM(spec.model)
    whole = [name for name, p in model.named_parameters() if not hasattr(p, "ds_id") or p.numel() != 0]
    if whole:
        raise SystemExit(f"zero.Init left {len(whole)} parameters whole on this rank, {whole[0]} first")
    return model


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
    if spec.zero_init:
        model = _partitioned_model(spec, deepspeed)
    else:
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
        config=ds_config(spec),
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
    rank, _ = parallel_ranks(spec)
    losses = []
    for step in range(spec.first_step, spec.first_step + spec.steps):
        tokens = spec_batch(spec, step, rank=rank, dp=spec.dp)
        losses.append(train_step(engine, tokens.to(engine.device)))
    if spec.save_dir:
        engine.save_checkpoint(spec.save_dir, tag=spec.save_tag, exclude_frozen_parameters=spec.exclude_frozen)
    if spec.record:
        record(engine, model, spec, losses, refused)


if __name__ == "__main__":
    main(sys.argv[1:])
    end_rank()
