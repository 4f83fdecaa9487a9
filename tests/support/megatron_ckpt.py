"""Save and load a Megatron-Core ``torch_dist`` checkpoint the way Megatron-LM 0.16.1 does.

Mirrors ``megatron/training/checkpointing.py`` (tag core_v0.16.1): ``save_checkpoint`` (``generate_state_dict``,
``_build_sharded_state_dict_metadata``, the fully parallel save wrapper, ``latest_checkpointed_iteration.txt``
written after the save) and ``load_checkpoint`` (common.pt first, content metadata, the (TP, PP) guard for
non-fully-reshardable optimizer states, RNG only at an unchanged (TP, PP), ``strict='assume_ok_unexpected'``,
then model, optimizer, scheduler and RNG restored). Rank-side only; megatron imported lazily.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.support.megatron_model import ADAM, Built

__all__ = ["TRACKER", "iteration_dir", "load_checkpoint", "megatron_args", "save_checkpoint"]

#: Megatron-LM's tracker file: the latest saved iteration, as text
TRACKER = "latest_checkpointed_iteration.txt"


def iteration_dir(root: str | os.PathLike, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def _plain(value: Any) -> bool:
    """A value Megatron-LM's ``args`` would hold for a TransformerConfig field (no callables or groups)."""
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str, torch.dtype, enum.Enum))


#: Megatron-LM arguments that are the same for every run of the harness (the ones it reads back, and the
#: flags that say what model and checkpoint this is)
_FIXED_ARGS: dict[str, Any] = dict(
    make_vocab_size_divisible_by=128,
    tokenizer_type="NullTokenizer",
    normalization="RMSNorm",
    swiglu=True,
    squared_relu=False,
    untie_embeddings_and_output_weights=True,
    position_embedding_type="rope",
    add_position_embedding=True,
    use_rotary_position_embeddings=False,
    rotary_percent=1.0,
    rotary_interleaved=False,
    transformer_impl="local",
    virtual_pipeline_model_parallel_size=None,
    expert_model_parallel_size=1,
    context_parallel_size=1,
    skipped_train_samples=0,
    consumed_valid_samples=0,
    data_parallel_random_init=False,
    **ADAM,
    lr=1e-2,
    min_lr=1e-2,
    lr_decay_style="constant",
    ckpt_format="torch_dist",
    use_dist_ckpt=True,
    distrib_optim_fully_reshardable_mem_efficient=False,
    ckpt_fully_parallel_load=False,
    dist_ckpt_strictness="assume_ok_unexpected",
    no_save_optim=None,
    no_save_rng=None,
    no_load_optim=None,
    no_load_rng=None,
    finetune=False,
)


def megatron_args(spec: Any, model: dict[str, Any], config: Any, iteration: int) -> argparse.Namespace:
    """The ``args`` Namespace Megatron-LM saves in common.pt, for this run: every TransformerConfig field of a
    plain value (Megatron-LM's parser is built from the dataclass, so its args carry them; enums such as
    ``attention_backend=AttnBackend.auto`` included, which is why Megatron registers safe globals), and the
    Megatron-LM-only arguments (network size, parallel sizes, data, optimizer, checkpoint flags) it reads back."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    args = {name: value for name, value in fields.items() if _plain(value)}
    args.update(_FIXED_ARGS)
    sizes = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups")
    args.update({name: model[name] for name in (*sizes, "kv_channels", "seq_length", "rotary_base")})
    args.update(
        group_query_attention=model["num_query_groups"] != model["num_attention_heads"],
        max_position_embeddings=model["seq_length"],
        vocab_size=model["vocab_size"],
        padded_vocab_size=model["vocab_size"],
        tensor_model_parallel_size=spec.tp,
        pipeline_model_parallel_size=spec.pp,
        data_parallel_size=spec.dp,
        world_size=spec.tp * spec.pp * spec.dp,
        iteration=iteration,
        consumed_train_samples=iteration * spec.global_batch,
        global_batch_size=spec.global_batch,
        micro_batch_size=spec.micro_batch,
        seed=spec.seed,
        overlap_grad_reduce=spec.bucket_size is not None,
        ddp_bucket_size=spec.bucket_size,
        dist_ckpt_optim_fully_reshardable=spec.sharding == "fully_reshardable",
        ckpt_fully_parallel_save=spec.fully_parallel_save,
        save=str(spec.out) if spec.out else None,
        load=spec.resume,
    )
    return argparse.Namespace(**dict(sorted(args.items())))


def _content_metadata(sharding: str) -> dict[str, Any]:
    """``_build_sharded_state_dict_metadata`` (torch_dist, distributed optimizer)."""
    from megatron.core import parallel_state

    metadata: dict[str, Any] = {"distrib_optim_sharding_type": sharding}
    if sharding == "fully_reshardable":
        metadata["distrib_optim_fully_reshardable_mem_efficient"] = False
    metadata["singleton_local_shards"] = False
    metadata["chained_optim_avoid_prefix"] = True
    metadata["dp_cp_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)
    return metadata


def _rng_state() -> Any:
    """``get_rng_state('torch_dist', ...)`` without expert parallelism: one ShardedObject per (PP, TP) rank."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state(),
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    return ShardedObject(
        "rng_state",
        [state],
        (
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_world_size(),
        ),
        (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()),
        replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True),
    )


def _generate_state_dict(
    args: argparse.Namespace, built: Built, rng: Any, metadata: dict[str, Any], iteration: int | None, **optim: Any
) -> dict[str, Any]:
    """``generate_state_dict`` for one model chunk: args, version, [iteration], model, optimizer, scheduler, rng."""
    state: dict[str, Any] = {"args": args, "checkpoint_version": 3.0}
    if iteration is not None:
        state["iteration"] = iteration
    state["model"] = built.ddp.module.sharded_state_dict(metadata=metadata)
    state["optimizer"] = built.optimizer.sharded_state_dict(state, metadata=metadata, **optim)
    state["opt_param_scheduler"] = built.scheduler.state_dict()
    if rng is not None:
        state["rng_state"] = rng
    return state


def save_checkpoint(spec: Any, model: dict[str, Any], built: Built, iteration: int) -> Path:
    """``save_checkpoint`` (ckpt_format torch_dist, synchronous): ``OUT/iter_NNNNNNN/`` then the tracker."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    from megatron.core.dist_checkpointing.utils import _clean_metadata_for_serialization

    folder = iteration_dir(spec.out, iteration)
    metadata = _content_metadata(spec.sharding)
    args = megatron_args(spec, model, built.config, iteration)
    state = _generate_state_dict(args, built, _rng_state(), metadata, iteration)
    state["num_floating_point_operations_so_far"] = 0
    if torch.distributed.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    strategy = get_default_save_sharded_strategy("torch_dist")
    if spec.fully_parallel_save:  # Megatron-LM's default: DP ranks share the writing of replicated shards
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        strategy = FullyParallelSaveStrategyWrapper(strategy, group, False)
    dist_checkpointing.save(
        state,
        str(folder),
        strategy,
        validate_access_integrity=True,
        content_metadata=_clean_metadata_for_serialization(metadata),
    )
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        (Path(spec.out) / TRACKER).write_text(str(iteration))
    torch.distributed.barrier()
    return folder


def _guard(ckpt_tp_pp: tuple[int, int], run_tp_pp: tuple[int, int], sharding: str) -> None:
    """Megatron-LM's refusal to change (TP, PP) under a DistributedOptimizer state that is not fully
    reshardable (checkpointing.py, load_checkpoint; the message verbatim, stale hint included)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if ckpt_tp_pp != run_tp_pp and sharding not in DistributedOptimizer.checkpoint_fully_reshardable_formats:
        mismatch = f"(TP, PP) mismatch after resume ({run_tp_pp} vs {ckpt_tp_pp} from checkpoint)"
        raise RuntimeError(
            f"{mismatch}: not supported for DistributedOptimizer with sharding type {sharding}."
            f" Please use `--ckpt-fully-parallel-save` flag during checkpoint saving."
        )


def _check_checkpoint_args(ckpt_args: Any, args: argparse.Namespace) -> None:
    """``check_checkpoint_args`` with no vocab file and a dist checkpoint: the fields it compares."""
    for name in ("num_layers", "hidden_size", "num_attention_heads"):
        assert getattr(ckpt_args, name) == getattr(args, name), f"{name} differs from the checkpoint's"
    assert getattr(ckpt_args, "add_position_embedding", True) == args.add_position_embedding


def _restore_rng(rng_state: list[dict[str, Any]]) -> None:
    from megatron.core import tensor_parallel

    state = rng_state[0]  # no data_parallel_random_init
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    torch.cuda.set_rng_state(state["cuda_rng_state"])
    tracker = tensor_parallel.get_cuda_rng_tracker()
    graph_safe = tensor_parallel.is_graph_safe_cuda_rng_tracker(tracker)
    tracker.set_states(
        {
            k: tensor_parallel.convert_cuda_rng_state(v, to_graphable=graph_safe)
            for k, v in state["rng_tracker_states"].items()
        }
    )


def load_checkpoint(spec: Any, model: dict[str, Any], built: Built, guard: bool = True) -> dict[str, Any]:
    """``load_checkpoint`` from ``spec.resume`` (a folder holding the tracker) into this run's layout.
    ``guard=False`` skips Megatron-LM's (TP, PP) refusal to see what megatron-core itself does. Returns the
    iteration and what was loaded (rng, consumed samples, sharding type, checkpoint layout)."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy

    root = Path(spec.resume)
    folder = iteration_dir(root, int((root / TRACKER).read_text().strip()))
    common = dist_checkpointing.load_common_state_dict(str(folder))  # _load_base_checkpoint(rank0=True)
    ckpt_args = common.get("args", argparse.Namespace())
    ckpt_tp_pp = (
        getattr(ckpt_args, "tensor_model_parallel_size", 1),
        getattr(ckpt_args, "pipeline_model_parallel_size", 1),
    )
    run_tp_pp = (spec.tp, spec.pp)
    rng_ok = ckpt_tp_pp == run_tp_pp and not getattr(ckpt_args, "no_save_rng", False)
    metadata = dist_checkpointing.load_content_metadata(preloaded_state_dict=common)
    if guard:
        _guard(ckpt_tp_pp, run_tp_pp, metadata["distrib_optim_sharding_type"])
    metadata = dict(metadata or {}, dp_cp_group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    args = megatron_args(spec, model, built.config, 0)
    sharded = _generate_state_dict(args, built, _rng_state() if rng_ok else None, metadata, None, is_loading=True)
    state = dist_checkpointing.load(
        sharded, str(folder), get_default_load_sharded_strategy(str(folder)), strict="assume_ok_unexpected"
    )
    iteration = state["iteration"]
    loaded_args = state.get("args")
    if loaded_args is not None:  # Megatron-LM: "could not find arguments in the checkpoint ..." otherwise
        _check_checkpoint_args(loaded_args, args)
    built.ddp.load_state_dict(state["model"], strict=True)
    built.optimizer.load_state_dict(state["optimizer"])
    built.scheduler.load_state_dict(state["opt_param_scheduler"])
    if rng_ok and "rng_state" in state:
        _restore_rng(state["rng_state"])
    torch.distributed.barrier()
    for group in built.optimizer.param_groups:  # what load_checkpoint patches in last
        group.setdefault("default_config", True)
    return {
        "iteration": iteration,
        "rng_loaded": bool(rng_ok and "rng_state" in state),
        "consumed_train_samples": getattr(loaded_args, "consumed_train_samples", 0),
        "sharding": metadata["distrib_optim_sharding_type"],
        "checkpoint_layout": {
            "tp": ckpt_tp_pp[0],
            "pp": ckpt_tp_pp[1],
            "dp": getattr(ckpt_args, "data_parallel_size", 0),
        },
    }
