"""One rank of a real verl FSDP run on CPU (verl 0.9.1's own ``FSDPCheckpointManager`` and FSDP helpers).

Started by :func:`tests.support.verl_runs.run_verl` once per rank (RANK/WORLD_SIZE/... set, the spec as JSON on the
command line). The model is a tiny ``LlamaForCausalLM`` wrapped as verl's ``FSDPEngine`` wraps its actor
(``verl/workers/engine/fsdp/transformer_impl.py``: ``_build_module``, ``_build_fsdp_module``): a 1-D ``fsdp`` device
mesh, FSDP1 (``FullyShardedDataParallel`` with verl's transformer wrap policy, FULL_SHARD, ``use_orig_params=False``,
the mesh passed) or FSDP2 (verl's ``apply_fsdp2`` and ``fsdp2_load_full_state_dict``); AdamW over
``model.parameters()`` as ``build_optimizer`` makes it; verl's constant schedule with warmup; verl's gradient clipping.

``spec.load`` empty: train ``save_at`` steps, save with ``save_checkpoint`` to ``out/global_step_<save_at>/actor`` (and
``latest_checkpointed_iteration.txt``, as the PPO trainer writes it), record the live state (``saved.pt``), train
``after`` more steps. ``spec.load`` set: a fresh, differently seeded model loads it with ``load_checkpoint``, the
live state is recorded (``loaded.pt``), then ``after`` steps train. ``final.pt`` holds each step's loss.

CPU deviations from a GPU run (none changes what is written): verl's ``get_device_id`` returns the CPU (its platform
layer reports cuda without CUDA); FSDP1 builds the same seeded weights on every rank with ``sync_module_states=False``
(torch refuses the sync on CPU); the mixed precision keeps fp32 params (``param_dtype=float32``) so that losses at
other world sizes compare within fp32's summation order.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ucp.harness.launch import end_rank

__all__ = ["VerlSpec", "GLOBAL_BATCH", "main"]

#: samples per optimizer step over all ranks (1, 2 and 3 processes each take an equal share)
GLOBAL_BATCH = 6


@dataclass
class VerlSpec:
    """One verl run; every field travels to the ranks as JSON."""

    world: int = 2
    fsdp: int = 2  # 1: FSDP1 (flat params, device mesh), 2: FSDP2
    use_orig_params: bool = False  # FSDP1 only (verl's default False)
    mesh: bool = True  # FSDP1 only: pass the device mesh (verl does; without it the model files hold ShardedTensors)
    out: str = ""  # save runs: the folder that gets global_step_<save_at>/actor
    record: str = ""
    load: str = ""  # an actor folder to load (a resume run)
    save_at: int = 2
    after: int = 3
    seed: int = 1234
    port: int = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def tiny_llama(seed: int) -> torch.nn.Module:
    """Two Llama layers with uneven sizes (vocab 100, intermediate 40): shards at 3 processes are ragged."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, attention_dropout=0.0,
        architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = LlamaForCausalLM(config).to(torch.float32)
    model.config.name_or_path = ""  # no hub lookups on save
    return model


def _wrap(module: torch.nn.Module, spec: VerlSpec, mesh: Any) -> torch.nn.Module:
    """verl's FSDPEngine._build_fsdp_module with fp32 params (see the module docstring)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
    from verl.utils.fsdp_utils import apply_fsdp2, fsdp2_load_full_state_dict, get_fsdp_wrap_policy, init_fn

    if spec.fsdp == 1:
        return FSDP(
            module, param_init_fn=init_fn, auto_wrap_policy=get_fsdp_wrap_policy(module=module, config={}),
            device_id=torch.device("cpu"), sharding_strategy=ShardingStrategy.FULL_SHARD,
            mixed_precision=MixedPrecision(torch.float32, torch.float32, torch.float32), sync_module_states=False,
            device_mesh=mesh if spec.mesh else None, forward_prefetch=False, use_orig_params=spec.use_orig_params,
        )  # fmt: skip
    from torch.distributed.fsdp import MixedPrecisionPolicy

    full = module.state_dict()
    policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=True)
    kwargs = {"mesh": mesh, "mp_policy": policy, "offload_policy": None, "reshard_after_forward": True}
    apply_fsdp2(module, kwargs, {"wrap_policy": {}, "forward_prefetch": False})
    fsdp2_load_full_state_dict(module, full, mesh, None)
    return module


def _build(spec: VerlSpec, seed: int) -> tuple[Any, Any, Any, Any]:
    """The wrapped model, AdamW, scheduler and checkpoint manager of this rank (FSDP2 on non-zero ranks: meta)."""
    from torch.distributed.device_mesh import init_device_mesh
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
    from verl.utils.fsdp_utils import get_init_weight_context_manager
    from verl.utils.torch_functional import get_constant_schedule_with_warmup

    mesh = init_device_mesh("cpu", mesh_shape=(spec.world,), mesh_dim_names=["fsdp"])
    if spec.fsdp == 2:
        init = get_init_weight_context_manager(use_meta_tensor=True, mesh=mesh)
        with init():
            module = tiny_llama(seed)
    else:
        module = tiny_llama(seed)
    model = _wrap(module, spec, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, betas=(0.9, 0.999))
    scheduler = get_constant_schedule_with_warmup(optimizer, num_warmup_steps=3)
    contents = {"save_contents": ["model", "optimizer", "extra"], "load_contents": ["model", "optimizer", "extra"]}
    manager = FSDPCheckpointManager(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, processing_class=None, checkpoint_config=contents
    )
    return model, optimizer, scheduler, manager


def _full_state(model: Any, optimizer: Any, scheduler: Any) -> dict[str, Any] | None:
    """Every weight and optimizer state by clean FQN (torch's full state dicts; a collective), rank 0 only."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=False)  # offload segfaults FSDP1 on CPU
    weights = get_model_state_dict(model, options=options)
    optim = get_optimizer_state_dict(model, optimizer, options=options)
    if dist.get_rank() != 0:
        return None
    state = {
        n: {"fp32": w.detach().clone(), **{k: v.clone() for k, v in optim["state"][n].items()}}
        for n, w in weights.items()
    }
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optim["param_groups"]]
    return {"state": state, "groups": groups, "scheduler": scheduler.state_dict(), "rng": torch.get_rng_state()}


def _train_step(
    model: Any, optimizer: Any, scheduler: Any, step: int, rank: int, world: int, data: torch.Tensor
) -> float:
    """One optimizer step on this rank's share of the step's global batch; the global mean loss."""
    import torch.distributed as dist
    from verl.utils.fsdp_utils import fsdp2_clip_grad_norm_, fsdp_version

    share = GLOBAL_BATCH // world
    ids = data[step * GLOBAL_BATCH + rank * share : step * GLOBAL_BATCH + (rank + 1) * share]
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    if fsdp_version(model) == 1:
        model.clip_grad_norm_(1.0)
    else:
        fsdp2_clip_grad_norm_(model.parameters(), max_norm=1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    value = loss.detach().clone()
    dist.all_reduce(value)
    return (value / world).item()


def _run(spec: VerlSpec, rank: int) -> None:
    import torch.distributed as dist
    import verl.utils.fsdp_utils as fsdp_utils

    dist.init_process_group("gloo")
    fsdp_utils.get_device_id = lambda: torch.device("cpu")  # verl reports cuda without CUDA
    record = Path(spec.record)
    data = torch.randint(0, 100, (64, 16), generator=torch.Generator().manual_seed(0))
    model, optimizer, scheduler, manager = _build(spec, spec.seed if not spec.load else spec.seed + 1)
    losses: dict[int, float] = {}
    if spec.load:
        manager.load_checkpoint(local_path=spec.load)
        loaded = _full_state(model, optimizer, scheduler)
        if rank == 0:
            torch.save(loaded, record / "loaded.pt")
        first = spec.save_at
    else:
        for step in range(spec.save_at):
            losses[step + 1] = _train_step(model, optimizer, scheduler, step, rank, spec.world, data)
        step_dir = Path(spec.out) / f"global_step_{spec.save_at}"
        manager.save_checkpoint(local_path=str(step_dir / "actor"), global_step=spec.save_at)
        saved = _full_state(model, optimizer, scheduler)
        if rank == 0:
            torch.save(saved, record / "saved.pt")
            (Path(spec.out) / "latest_checkpointed_iteration.txt").write_text(str(spec.save_at))
        first = spec.save_at
    for step in range(first, first + spec.after):
        losses[step + 1] = _train_step(model, optimizer, scheduler, step, rank, spec.world, data)
    if rank == 0:
        torch.save({"losses": losses}, record / "final.pt")


def main(argv: list[str]) -> None:
    spec = VerlSpec(**json.loads(argv[1]))
    warnings.filterwarnings("ignore")
    Path(spec.record).mkdir(parents=True, exist_ok=True)
    _run(spec, int(os.environ["RANK"]))


if __name__ == "__main__":
    main(sys.argv)
    end_rank()
