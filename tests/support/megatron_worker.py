"""One rank of a real Megatron-Core run on CPU (gloo): the tiny Llama-like GPT with DDP + DistributedOptimizer.

Started by :func:`tests.support.megatron_runs.run_megatron` once per rank (RANK/WORLD_SIZE/MASTER_* set by
:func:`ucp.harness.launch.launch`); the :class:`MegatronSpec` arrives as JSON on the command line. The run
either starts fresh (or from ``weights``) or resumes ``resume`` the way Megatron-LM's ``load_checkpoint`` does
(tests/support/megatron_ckpt.py), optionally runs one forward/backward on a given batch (``probe``), trains
``steps`` steps and saves like Megatron-LM's ``save_checkpoint`` after each iteration in ``save_at``.

Records (rank 0, ``torch.save``, loadable with ``weights_only=True``), in ``record``:
  ``loaded.pt``      right after a resume: the live state (tests/support/megatron_record.py) + what was loaded
  ``probe.pt``       the probe's loss (and at DP 1 its gradients), taken before any training step
  ``saved_<it>.pt``  right after the save at iteration ``it``
  ``final.pt``       per-step losses and grad norms ({step index: value}), the last iteration, the final state
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ucp.harness.launch import end_rank

__all__ = ["MegatronSpec", "main", "model_of"]

SHARDINGS = ("dp_reshardable", "fully_reshardable")


@dataclass
class MegatronSpec:
    """One Megatron run; every field travels to the ranks as JSON. World size = tp * pp * dp."""

    tp: int = 1
    pp: int = 1
    dp: int = 2
    sharding: str = "dp_reshardable"  # the DistributedOptimizer's checkpoint format: one of SHARDINGS
    steps: int = 3  # optimizer steps this run takes (after the load when it resumes)
    save_at: list[int] | None = None  # iterations to save after (None: the last one, when ``out`` is set)
    resume: str | None = None  # a Megatron-LM checkpoint folder (holding latest_checkpointed_iteration.txt)
    weights: str | None = None  # a torch file {Megatron name: full tensor} to start from (no optimizer state)
    probe: str | None = None  # a torch file {"tokens", "labels"}: one forward/backward before training
    seed: int = 1234  # the data's seed, and the initialisation's of a fresh run
    init_seed: int | None = None  # the fresh model's seed (None: ``seed``; a resume's: ``seed + 1``, overwritten)
    odd: bool = False  # hidden 40, ffn 72, head dim 10, vocab 96: padding inside the optimizer's buffers
    model: dict[str, Any] = field(default_factory=dict)  # overrides of megatron_model.DEFAULT / ODD
    bucket_size: int | None = None  # DDP bucket size in elements (turns on overlap_grad_reduce: several buckets)
    global_batch: int = 4
    micro_batch: int = 2
    fully_parallel_save: bool = True  # Megatron-LM's --ckpt-fully-parallel-save default
    load_fixes: bool = True  # megatron_cpu.fix_load_path: 0.16.1's load-path bugs fixed
    guard: bool = True  # Megatron-LM's (TP, PP) refusal for dp_reshardable states
    use_checkpoint_args: bool = True  # a resume takes the model's sizes from the checkpoint's args
    out: str = ""  # the checkpoint folder saves go to
    record: str = ""  # the records' folder
    port: int = 0

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def to_json(self) -> str:
        return json.dumps(asdict(self))


#: model config key -> Megatron-LM args field that ``load_args_from_checkpoint`` sets from a checkpoint
_CHECKPOINT_ARGS = {
    "num_layers": "num_layers",
    "hidden_size": "hidden_size",
    "ffn_hidden_size": "ffn_hidden_size",
    "seq_length": "seq_length",
    "num_attention_heads": "num_attention_heads",
    "num_query_groups": "num_query_groups",
    "kv_channels": "kv_channels",
    "rotary_base": "rotary_base",
    "vocab_size": "padded_vocab_size",
}


def model_of(spec: MegatronSpec) -> dict[str, Any]:
    """The run's model config: DEFAULT (or ODD) with ``spec.model``'s overrides; a resume with
    ``use_checkpoint_args`` takes the sizes the checkpoint's args hold (Megatron-LM's --use-checkpoint-args)."""
    from tests.support.megatron_model import DEFAULT, ODD

    model = {**(ODD if spec.odd else DEFAULT), **spec.model}
    if spec.resume and spec.use_checkpoint_args:
        from megatron.core import dist_checkpointing

        from tests.support.megatron_ckpt import TRACKER, iteration_dir

        root = Path(spec.resume)
        folder = iteration_dir(root, int((root / TRACKER).read_text().strip()))
        args = dist_checkpointing.load_common_state_dict(str(folder)).get("args")
        for key, name in _CHECKPOINT_ARGS.items():
            if getattr(args, name, None) is not None:
                model[key] = getattr(args, name)
    return model


def _save(path: Path, record: dict[str, Any] | None) -> None:
    if record is not None:  # rank 0
        torch.save(record, path)


def _load_weights(built: Any, path: str) -> None:
    """Copy full tensors by Megatron name into this rank's TP shards (the fp32 main params are views of them)."""
    from megatron.core import parallel_state

    from tests.support.megatron_record import global_names

    full = torch.load(path, weights_only=True)
    tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, (param, _) in global_names(built.ddp.module).items():
            tensor = full[name]
            if tp > 1 and getattr(param, "tensor_model_parallel", False):
                if name.endswith("mlp.linear_fc1.weight"):
                    gate, up = tensor.chunk(2, dim=0)
                    tensor = torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]], dim=0)
                else:
                    tensor = tensor.chunk(tp, dim=param.partition_dim)[rank]
            param.copy_(tensor)


def _probe(spec: MegatronSpec, built: Any) -> None:
    from tests.support.megatron_model import forward_backward
    from tests.support.megatron_record import live_record

    batch = torch.load(spec.probe, weights_only=True)
    rows = batch["tokens"].shape[0]
    loss = forward_backward(built, batch["tokens"], batch["labels"], micro=rows // spec.dp)
    record = live_record(built, grads=spec.dp == 1)
    if record is not None:
        _save(Path(spec.record) / "probe.pt", {"loss": loss, **batch, **record})


def _start(spec: MegatronSpec, model: dict[str, Any], built: Any) -> int:
    """Load the checkpoint or weights the run starts from; the iteration it starts at."""
    from tests.support.megatron_ckpt import load_checkpoint
    from tests.support.megatron_record import live_record

    if spec.weights:
        _load_weights(built, spec.weights)
    if not spec.resume:
        return 0
    loaded = load_checkpoint(spec, model, built, guard=spec.guard)
    record = live_record(built)
    if record is not None:
        _save(Path(spec.record) / "loaded.pt", {**loaded, "layout": _layout(spec), **record})
    return loaded["iteration"]


def _layout(spec: MegatronSpec) -> dict[str, Any]:
    """This run's layout (a resume's ``loaded.pt`` says the checkpoint's in ``checkpoint_layout``)."""
    return {"tp": spec.tp, "pp": spec.pp, "dp": spec.dp}


def run(spec: MegatronSpec) -> None:
    from tests.support.megatron_cpu import fix_load_path, patch_for_cpu

    patch_for_cpu()
    fixed = fix_load_path() if spec.load_fixes else False
    from tests.support.megatron_ckpt import save_checkpoint
    from tests.support.megatron_model import build, init_parallel, train_step
    from tests.support.megatron_record import live_record

    assert spec.sharding in SHARDINGS, spec.sharding
    assert spec.global_batch % (spec.dp * spec.micro_batch) == 0, "the global batch must split into DP micro-batches"
    model = model_of(spec)
    init_seed = spec.init_seed if spec.init_seed is not None else spec.seed + (1 if spec.resume else 0)
    init_parallel(spec.tp, spec.pp, init_seed)
    built = build(model, spec.tp, spec.pp, init_seed, spec.bucket_size)
    start = _start(spec, model, built)
    if spec.probe:
        _probe(spec, built)
    end = start + spec.steps
    save_at = set(spec.save_at if spec.save_at is not None else ([end] if spec.out else []))
    losses, grad_norms = {}, {}
    for step in range(start, end):
        taken = train_step(built, step, spec.seed, spec.global_batch, spec.micro_batch, model)
        losses[step], grad_norms[step] = taken["loss"], taken["grad_norm"]
        if step + 1 in save_at:
            save_checkpoint(spec, model, built, step + 1)
            record = live_record(built)
            if record is not None:
                record.update(iteration=step + 1, layout=_layout(spec), sharding=spec.sharding, losses=dict(losses))
                _save(Path(spec.record) / f"saved_{step + 1}.pt", record)
    record = live_record(built)
    if record is not None:
        record.update(iteration=end, layout=_layout(spec), sharding=spec.sharding, load_fixes=fixed)
        record.update(losses=losses, grad_norms=grad_norms)
        _save(Path(spec.record) / "final.pt", record)


def main(argv: list[str]) -> None:
    spec = MegatronSpec(**json.loads(argv[1]))
    Path(spec.record).mkdir(parents=True, exist_ok=True)
    run(spec)


if __name__ == "__main__":
    main(sys.argv)
    end_rank()
