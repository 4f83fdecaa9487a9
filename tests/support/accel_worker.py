"""One rank of a real Accelerate run with DeepSpeed on CPU (``Accelerator.save_state`` / ``load_state``).

Started by :func:`tests.support.hf_runs.run_accelerate` once per rank; the spec (an
:class:`~tests.support.hf_worker.HfSpec`) arrives as JSON. The run trains the same tiny Llama as the
Trainer runs with torch AdamW in two param groups (decay and no decay) and a linear schedule; it
saves its state after ``save_steps`` optimizer steps into ``out/state``, or first loads ``resume`` (or
``live_from`` through ``ucp.integrations.hf.load_accelerate_state``, then saves ``out/state-again`` at the end).
Rank 0 records what the live engine holds right after the load and after training, like the Trainer worker.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from tests.support.hf_worker import HfSpec, _engine_state, _optimizer_steps, _Tokens, ds_config, tiny_llama
from ucp.harness.launch import end_rank

__all__ = ["main"]


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
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.0, 1.0 - step / 20))
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


def main(argv: list[str]) -> None:
    spec = HfSpec(**json.loads(argv[1]))
    Path(spec.record).mkdir(parents=True, exist_ok=True)
    _run(spec, int(os.environ["RANK"]))


if __name__ == "__main__":
    main(sys.argv)
    end_rank()
