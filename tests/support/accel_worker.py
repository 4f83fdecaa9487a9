"""One rank of a real Accelerate run with DeepSpeed on CPU (``Accelerator.save_state`` / ``load_state``).

Started by :func:`tests.support.hf_runs.run_accelerate` once per rank; the spec (an
:class:`~tests.support.hf_worker.HfSpec`) arrives as JSON. The run trains the same tiny Llama as the
Trainer runs with torch AdamW in two param groups (decay and no decay) and a linear schedule; it
saves its state after ``save_steps`` optimizer steps into ``out/state``, or first loads ``resume`` (or
``live_from`` through ``ucp.integrations.hf.load_accelerate_state``, then saves ``out/state-again`` at the end).
Rank 0 records what the live engine holds right after the load and after training, like the Trainer worker.

With ``spec.extra["fsdp"]`` (see :mod:`tests.support.fsdp_worker`) the same run goes through Accelerate's
FSDP1/FSDP2 plugin in fp32 instead (:func:`_run_fsdp`), and rank 0 also writes ``saved_<step>.pt``, the live
state right after ``save_state``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from tests.support.fsdp_worker import (
    accelerate_plugin,
    assert_fsdp,
    enable_cpu_fsdp,
    fsdp_options,
    fsdp_record,
    fsdp_state,
    fsdp_steps,
)
from tests.support.hf_worker import HfSpec, _engine_state, _optimizer_steps, _Tokens, ds_config, tiny_llama
from ucp.harness.launch import end_rank

__all__ = ["main"]


def _lr(step: int) -> float:
    """The linear schedule of every Accelerate run (a LambdaLR factor)."""
    return max(0.0, 1.0 - step / 20)


def _groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Trainer's grouping: biases and norm weights without weight decay."""
    decay, plain = [], []
    for name, param in model.named_parameters():
        (plain if name.endswith("bias") or "norm" in name else decay).append(param)
    return [{"params": decay, "weight_decay": 0.1}, {"params": plain, "weight_decay": 0.0}]


def _config(spec: HfSpec) -> dict[str, Any]:
    """Accelerate fills no "auto" batch values without a prepared dataloader of its own: give them."""
    config = ds_config(spec)
    config.update(
        train_micro_batch_size_per_gpu=spec.per_device,
        gradient_accumulation_steps=spec.accum,
        gradient_clipping=1.0,
        bf16={"enabled": True},
    )
    config.pop("train_batch_size")
    return config


def _run(spec: HfSpec, rank: int) -> None:
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DeepSpeedPlugin, set_seed

    record = Path(spec.record)
    set_seed(spec.seed)
    # as Trainer sets up CPU runs: the process group first (gloo), then an Accelerator with the DeepSpeed
    # plugin and no cpu flag (Accelerator(cpu=True) would wrap the model in DDP and leave DeepSpeed out)
    PartialState(cpu=True, backend="gloo")
    plugin = DeepSpeedPlugin(hf_ds_config=_config(spec))
    accelerator = Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=spec.accum)
    model = tiny_llama()
    optimizer = torch.optim.AdamW(_groups(model), lr=1e-2)
    loader = torch.utils.data.DataLoader(_Tokens(spec.samples, 7), batch_size=spec.per_device, shuffle=False)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    if accelerator.num_processes != spec.world:
        raise SystemExit(f"Accelerate sees {accelerator.num_processes} processes, the run has {spec.world}")
    engine = model
    done = 0
    if spec.live_from:
        from ucp.integrations.hf import load_accelerate_state

        load_accelerate_state(accelerator, spec.live_from)
        done = engine.global_steps
    elif spec.resume:
        accelerator.load_state(spec.resume)
        done = engine.global_steps
        # the CPU RNG state this process took from its random_states_<rank>.pkl (Accelerate skips a missing one)
        torch.save({"cpu": torch.random.get_rng_state()}, record / f"rng_loaded_{rank}.pt")
    loaded = {"global_step": engine.global_steps, "state": _engine_state(engine), "steps": _optimizer_steps(engine)}
    if rank == 0:
        torch.save(loaded, record / "loaded.pt")
    losses: dict[int, float] = {}
    batches = iter(loader)
    for _ in range(done * spec.accum):  # the batches the saved run already took
        next(batches)
    total = torch.zeros(())  # this step's micro-batch losses: their mean over every process is the step's loss
    while engine.global_steps < spec.max_steps:
        with accelerator.accumulate(model):
            loss = model(**next(batches)).loss
            total += loss.detach().float() / spec.accum
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            losses[engine.global_steps] = float(accelerator.reduce(total, reduction="mean"))
            total = torch.zeros(())
            if engine.global_steps == spec.save_steps and not (spec.resume or spec.live_from):
                accelerator.save_state(str(Path(spec.out) / "state"))
    if spec.live_from:  # an ordinary save at this world size, for the next plain resume
        accelerator.save_state(str(Path(spec.out) / "state-again"))
    final = {
        "global_step": engine.global_steps,
        "steps": _optimizer_steps(engine),
        "losses": losses,
        "state": _engine_state(engine),
    }
    if rank == 0:
        torch.save(final, record / "final.pt")


def _run_fsdp(spec: HfSpec, rank: int, options: dict[str, Any]) -> None:
    """The run of :func:`_run` with Accelerate's FSDP plugin in fp32.

    The scheduler steps once per optimizer step at any world size (``step_scheduler_with_optimizer=False``
    and an explicit step; accelerate's default would step it once per process), like the DeepSpeed engine's,
    so its ``last_epoch`` after a load is the step the folder was saved at: the run's global step even
    when accelerate's FSDP1 SHARDED load drops the optimizer state. Gradients are clipped to norm 1 as in
    the DeepSpeed config."""
    enable_cpu_fsdp(options)  # before the Accelerator sets up the process state
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    record = Path(spec.record)
    set_seed(spec.seed)
    accelerator = Accelerator(
        fsdp_plugin=accelerate_plugin(options),
        gradient_accumulation_steps=spec.accum,
        step_scheduler_with_optimizer=False,
    )
    model = tiny_llama()
    loader = torch.utils.data.DataLoader(_Tokens(spec.samples, 7), batch_size=spec.per_device, shuffle=False)
    if options["version"] == 1:  # FSDP1: the optimizer takes the wrapped model's parameters
        model = accelerator.prepare(model)
        optimizer = torch.optim.AdamW(_groups(model), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr)
        optimizer, loader, scheduler = accelerator.prepare(optimizer, loader, scheduler)
    else:  # FSDP2: accelerate swaps the optimizer's parameters for the sharded ones
        optimizer = torch.optim.AdamW(_groups(model), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr)
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    assert_fsdp(model, options, accelerator)  # a silent DDP run fails here
    if accelerator.num_processes != spec.world:
        raise SystemExit(f"Accelerate sees {accelerator.num_processes} processes, the run has {spec.world}")
    if spec.live_from:
        from ucp.integrations.hf import load_accelerate_state

        load_accelerate_state(accelerator, spec.live_from)
    elif spec.resume:
        accelerator.load_state(spec.resume)
        # the CPU RNG state this process took from its random_states_<rank>.pkl (Accelerate skips a missing one)
        torch.save({"cpu": torch.random.get_rng_state()}, record / f"rng_loaded_{rank}.pt")
    done = scheduler.scheduler.last_epoch  # optimizer steps so far (0 for a fresh run)
    loaded = {"global_step": done, **fsdp_record(model, optimizer, options)}
    if rank == 0:
        torch.save(loaded, record / "loaded.pt")
    losses: dict[int, float] = {}
    batches = iter(loader)
    for _ in range(done * spec.accum):  # the batches the saved run already took
        next(batches)
    step = done
    total = torch.zeros(())  # this step's micro-batch losses: their mean over every process is the step's loss
    while step < spec.max_steps:
        with accelerator.accumulate(model):
            loss = model(**next(batches)).loss
            total += loss.detach().float() / spec.accum
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            if accelerator.sync_gradients:
                scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            step += 1
            losses[step] = float(accelerator.reduce(total, reduction="mean"))
            total = torch.zeros(())
            if step == spec.save_steps and not (spec.resume or spec.live_from):
                accelerator.save_state(str(Path(spec.out) / "state"))
                saved = {"global_step": step, **fsdp_record(model, optimizer, options)}
                if rank == 0:
                    torch.save(saved, record / f"saved_{step}.pt")
    if spec.live_from:  # an ordinary save at this world size, for the next plain resume
        accelerator.save_state(str(Path(spec.out) / "state-again"))
    final = {
        "global_step": step,
        "steps": fsdp_steps(optimizer),
        "losses": losses,
        "state": fsdp_state(model, optimizer),
        "backend": f"fsdp{options['version']}",
    }
    if rank == 0:
        torch.save(final, record / "final.pt")


def main(argv: list[str]) -> None:
    spec = HfSpec(**json.loads(argv[1]))
    Path(spec.record).mkdir(parents=True, exist_ok=True)
    options = fsdp_options(spec.extra)
    if options is not None:
        _run_fsdp(spec, int(os.environ["RANK"]), options)
    else:
        _run(spec, int(os.environ["RANK"]))


if __name__ == "__main__":
    main(sys.argv)
    end_rank()
