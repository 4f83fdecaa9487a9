"""One rank of a pipeline-parallel harness run: ``python -m ucp.harness.pipeline SPEC_JSON``.

The model is a ``deepspeed.pipe.PipelineModule`` of TinyLM's parts: a tied embedding
(``TiedLayerSpec`` on the first and the last stage, the last one using it as the LM head), residual
MLP blocks (one with a frozen projection and a persistent buffer), a LayerNorm. ``plain=True``
builds the same layers, under the same names, as an ordinary module for a non-pipeline engine, so
a checkpoint restored at PP=1 can be resumed without PipelineEngine.

With ``tp > 1`` the run is 3D (PP x DP x TP, DeepSpeed's ``PipeModelDataParallelTopology``) and each
block is Megatron-style: ``fc1`` cut by rows (column parallel), ``fc2``'s weight by columns (row
parallel, its output summed over the TP group, its bias added after), the rest replicated. Like
Megatron-DeepSpeed, the run saves a ``universal_checkpoint_info`` describing that split.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from ucp.harness.launch import end_rank, free_port, launch
from ucp.harness.model import build_param_groups, spec_batch
from ucp.harness.spec import JsonSpec, LoadSpec, ModelSpec
from ucp.harness.worker import _relink_optimizer_state, lr_decay
from ucp.model.tp import shard_widths

__all__ = ["PipeSpec", "PipeBlock", "TpGroup", "layer_specs", "PlainPipe", "run_pipeline", "tp_info", "MODULE"]

#: the module each rank of a pipeline run executes
MODULE = "ucp.harness.pipeline"
#: the key of the tied embedding (``tied_modules.embed.weight`` in the module's state dict)
TIED_KEY = "embed"


@dataclass
class PipeSpec(JsonSpec):
    """One pipeline run: PP x DP ranks (stage-major, DeepSpeed's PipeDataParallelTopology)."""

    pp: int = 2
    dp: int = 2
    tp: int = 1  # tensor-parallel ranks per stage (Megatron-style blocks)
    partition_method: str = "uniform"  # PipelineModule's: uniform | parameters
    stage: int = 1  # PipelineEngine takes ZeRO-0/1 only
    dtype: str = "fp32"
    micro_batches: int = 2  # gradient accumulation steps: the pipeline's micro-batches per step
    lr: float = 1e-2
    model: ModelSpec = field(default_factory=lambda: ModelSpec(layers=3, tied=True, frozen=True, buffers=True))
    global_batch: int = 12
    seq: int = 8
    seed: int = 1234
    data_seed: int = 99
    steps: int = 3
    first_step: int = 0
    plain: bool = False  # the same layers as an ordinary module (PP must be 1): a non-pipeline engine
    #: the first tied embedding is a plain module (no forward_fn, as Megatron-DeepSpeed's EmbeddingPipe), so it
    #: gets a layer file; by default both uses are forward_fn partials, whose weights only the optimizer holds
    embed_module: bool = False
    load: LoadSpec | None = None
    save_dir: str | None = None
    save_tag: str | None = None
    record: str | None = None  # DP rank 0 of each stage (and TP rank) writes its live state: record_path
    port: int = 0

    def record_path(self, stage: int, tp_rank: int = 0) -> str:
        """RECORD.stageS.pt (RECORD.stageS.tpT.pt under tensor parallelism)."""
        assert self.record is not None
        return self.record.removesuffix(".pt") + f".stage{stage}" + (f".tp{tp_rank}" if self.tp > 1 else "") + ".pt"


@dataclass
class TpGroup:
    """The stage's tensor-parallel group, shared by the blocks of one PipelineModule (its grid makes
    the group only once the module exists, after the blocks are built)."""

    size: int = 1
    rank: int = 0
    group: object = None


class _CopyToTp(torch.autograd.Function):
    """Identity forward; the input's gradient summed over the TP group (the column-parallel entry)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: object) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumOverTp(torch.autograd.Function):
    """The partial outputs summed over the TP group (the row-parallel exit); identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: object) -> torch.Tensor:
        x = x.contiguous().clone()
        torch.distributed.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class PipeBlock(nn.Module):
    """A residual MLP block; with ``extras`` also a frozen projection and a persistent buffer, which a
    pipeline checkpoint keeps only in its layer files. Under ``tp`` the MLP is split Megatron-style;
    the parameter names are the same at every TP size."""

    def __init__(self, hidden: int, ffn: int, extras: bool = False, tp: TpGroup | None = None) -> None:
        super().__init__()
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)
        if self.tp is not None:  # this rank's slices of the full layers: the same model at every TP size
            widths = shard_widths(ffn, self.tp.size)  # uneven when it must: the first ranks one row more
            start = sum(widths[: self.tp.rank])
            cut = slice(start, start + widths[self.tp.rank])
            with torch.no_grad():
                self.fc1.weight = nn.Parameter(self.fc1.weight[cut].clone())
                self.fc1.bias = nn.Parameter(self.fc1.bias[cut].clone())
                self.fc2.weight = nn.Parameter(self.fc2.weight[:, cut].clone())
            for param in (self.fc1.weight, self.fc1.bias, self.fc2.weight):
                # as Megatron marks them: DeepSpeed's gradient norm counts such a parameter on every TP
                # rank, a replicated one on TP rank 0 only
                param.tensor_model_parallel = True  # type: ignore[attr-defined]
        self.proj: nn.Linear | None = None
        if extras:
            self.proj = nn.Linear(hidden, hidden)
            self.proj.requires_grad_(False)
            self.register_buffer("calls", torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "calls"):
            with torch.no_grad():
                calls: torch.Tensor = self.calls  # type: ignore[assignment]  # a registered buffer
                calls += torch.tensor([1.0, 0.5], dtype=calls.dtype)
        x = x + self._mlp(x)
        return x if self.proj is None else x + 0.1 * self.proj(x)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self.fc2(nn.functional.gelu(self.fc1(x)))
        inner = nn.functional.gelu(self.fc1(_CopyToTp.apply(x, self.tp.group)))
        partial = nn.functional.linear(inner, self.fc2.weight)
        return _SumOverTp.apply(partial, self.tp.group) + self.fc2.bias


def _embed(module: nn.Embedding, tokens: torch.Tensor) -> torch.Tensor:
    return module(tokens)


def _head(module: nn.Embedding, x: torch.Tensor) -> torch.Tensor:
    return nn.functional.linear(x, module.weight)


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def layer_specs(spec: ModelSpec, tp: TpGroup | None = None, embed_module: bool = False) -> list:
    """embed (tied) | blocks | norm | head (tied to embed): ``layers + 3`` layers; ``embed_module``: the embed
    runs as the module itself (its own forward, the same computation) rather than through a forward_fn."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    blocks = [
        LayerSpec(PipeBlock, spec.hidden, spec.ffn, extras=(i == 0 and spec.frozen), tp=tp) for i in range(spec.layers)
    ]
    return [
        TiedLayerSpec(TIED_KEY, nn.Embedding, spec.vocab, spec.hidden, forward_fn=None if embed_module else _embed),
        *blocks,
        LayerSpec(nn.LayerNorm, spec.hidden),
        TiedLayerSpec(TIED_KEY, nn.Embedding, spec.vocab, spec.hidden, forward_fn=_head),
    ]


class PlainPipe(nn.Module):
    """The pipeline's layers as one ordinary module with the PipelineModule's parameter names
    (``tied_modules.embed.weight``, ``1.fc1.weight``, ...), built with the same per-layer seeds."""

    def __init__(self, spec: ModelSpec, seed: int) -> None:
        super().__init__()
        from deepspeed.pipe import TiedLayerSpec

        self.tied_modules = nn.ModuleDict()
        self.funcs: list = []
        for idx, layer in enumerate(layer_specs(spec)):
            torch.manual_seed(seed + idx)  # PipelineModule(seed_layers=True) seeds each layer so
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied_modules:
                    self.tied_modules[layer.key] = layer.build()
                self.funcs.append((layer.forward_fn, self.tied_modules[layer.key]))
            else:
                self.add_module(str(idx), layer.build())
                self.funcs.append((None, getattr(self, str(idx))))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = tokens[:, :-1]
        for fn, module in self.funcs:
            x = module(x) if fn is None else fn(module, x)
        return _loss(x, tokens[:, 1:])


def tp_info() -> dict:
    """The ``universal_checkpoint_info`` of a TP run, as Megatron-DeepSpeed saves one: what is
    replicated, what is cut along dim 1 (row parallel); everything else is cut along dim 0."""
    return {
        "universal_checkpoint_version": 0.2,
        "tp_replicated_parameter_patterns": [r"^tied_modules\.", r"^\d+\.(weight|bias)$", r"^\d+\.(fc2\.bias|proj\.)"],
        "parameter_with_row_parallelism_patterns": [r"^\d+\.fc2\.weight$"],
    }


def _seed_layer(seed: object) -> None:
    """DeepSpeed's per-layer seeding, given a plain int: with ``partition_method="parameters"`` DeepSpeed
    0.19.8 hands a numpy integer (its partition is a numpy array), which ``random.seed`` refuses on
    Python 3.11. Layer weights draw from torch only, so they are what DeepSpeed's own seeding gives."""
    from deepspeed.runtime.utils import set_random_seed

    set_random_seed(int(seed))  # type: ignore[call-overload]


def _pipe_module(spec: PipeSpec):
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    tp = TpGroup(spec.tp, rank=torch.distributed.get_rank() % spec.tp)  # the topology's innermost axis
    # without TP, DeepSpeed's default topology: no model axis, so no "-model_00" in the layer files' names
    topology = PipeModelDataParallelTopology(num_pp=spec.pp, num_mp=spec.tp, num_dp=spec.dp) if spec.tp > 1 else None
    module = PipelineModule(
        layers=layer_specs(spec.model, tp, spec.embed_module),
        num_stages=None if topology else spec.pp,
        topology=topology,
        loss_fn=_loss,
        partition_method=spec.partition_method,
        seed_layers=True,
        seed_fn=_seed_layer,
        base_seed=spec.seed,
    )
    tp.group = module._grid.get_slice_parallel_group()
    return module


def _config(spec: PipeSpec) -> dict:
    config: dict = {
        "train_batch_size": spec.global_batch,
        "train_micro_batch_size_per_gpu": spec.global_batch // (spec.dp * spec.micro_batches),
        "gradient_accumulation_steps": spec.micro_batches,
        "zero_optimization": {"stage": spec.stage},
        "bf16": {"enabled": spec.dtype == "bf16"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "pipeline": {"activation_checkpoint_interval": 0},
    }
    if spec.load is not None and spec.load.kind == "ds-universal":
        config["checkpoint"] = {"load_universal": True}
    return config


def _micro_batches(spec: PipeSpec, step: int, dp_rank: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This DP rank's share of the step's global batch (the same at every DP size), as (inputs, labels)."""
    tokens = spec_batch(spec, step, rank=dp_rank, dp=spec.dp)
    for chunk in tokens.chunk(spec.micro_batches):
        yield chunk[:, :-1], chunk[:, 1:]


def _state_keys(base) -> list[str]:
    return sorted({k for s in base.state.values() for k, v in s.items() if torch.is_tensor(v) and v.dim() == 1})


def _record(engine, spec: PipeSpec, losses: list[float], stage: int, dp_rank: int, tp_rank: int = 0) -> None:
    """What this stage's live engine holds, per parameter (every rank of the stage takes part in the
    gathers); DP rank 0 of each stage writes it."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    _relink_optimizer_state(engine.optimizer)  # DeepSpeed 0.19.8 links group 1 too early
    # ZeRO-1 and bf16 (BF16_Optimizer) wrap the client optimizer; fp32 without ZeRO steps it over the parameters
    wrapped = hasattr(engine.optimizer, "optimizer")
    base = engine.optimizer.optimizer if wrapped else engine.optimizer
    keys = _state_keys(base)
    out: dict = {"losses": losses, "params": {}, "state": {k: {} for k in keys}, "module": {}, "frozen": []}
    module = engine.module
    for name, param in module.named_parameters():
        out["module"][name] = param.detach().cpu().clone()
        if not param.requires_grad:
            out["frozen"].append(name)
            continue
        fp32 = safe_get_full_fp32_param(param) if wrapped else param
        out["params"][name] = fp32.detach().float().cpu().clone()
        for key in keys:
            value = safe_get_full_optimizer_state(param, key) if wrapped else base.state.get(param, {}).get(key)
            out["state"][key][name] = None if value is None else value.detach().cpu().clone()
    out["buffers"] = {n: b.detach().cpu().clone() for n, b in module.named_buffers()}
    out["parts"] = [int(x) for x in getattr(module, "parts", [])]  # the stage partition PipelineModule made
    out["group_hparams"] = [{k: v for k, v in g.items() if k != "params"} for g in base.param_groups]
    groups = getattr(engine.optimizer, "bit16_groups", None) if wrapped else [g["params"] for g in base.param_groups]
    out["group_params"] = [[engine.param_names[p] for p in group] for group in groups or []]
    out["state_steps"] = [
        float(s["step"]) if torch.is_tensor(s.get("step")) else s.get("step") for s in base.state.values()
    ]
    out["counters"] = {
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "skipped_steps": engine.skipped_steps,
    }
    out["lr_scheduler"] = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
    if dp_rank == 0:
        torch.save(out, spec.record_path(stage, tp_rank))


def _train_pipe(engine, spec: PipeSpec, dp_rank: int) -> list[float]:
    losses = []
    for step in range(spec.first_step, spec.first_step + spec.steps):
        loss = engine.train_batch(data_iter=_micro_batches(spec, step, dp_rank))
        # train_batch returns the mean over micro-batches, averaged over DP, on every stage
        losses.append(float(loss))
    return losses


def _train_plain(engine, spec: PipeSpec, dp_rank: int) -> list[float]:
    losses = []
    for step in range(spec.first_step, spec.first_step + spec.steps):
        total = 0.0
        for inputs, labels in _micro_batches(spec, step, dp_rank):
            loss = engine(torch.cat([inputs, labels[:, -1:]], dim=1))
            engine.backward(loss)
            engine.step()
            total += loss.detach().float().item()
        mean = torch.tensor(total / spec.micro_batches)
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / torch.distributed.get_world_size())
    return losses


def main(argv: list[str]) -> None:
    spec = PipeSpec.from_json(argv[0])
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(spec.seed)
    if spec.plain and (spec.pp != 1 or spec.tp != 1):
        raise SystemExit("plain=True runs at pp=1, tp=1")
    model = PlainPipe(spec.model, spec.seed) if spec.plain else _pipe_module(spec)
    groups = build_param_groups(model, 2, spec.lr)
    optimizer = torch.optim.AdamW(groups, lr=spec.lr, betas=(0.9, 0.95))
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_decay),
        config=_config(spec),
    )
    if spec.load is not None and spec.load.kind == "ucp":
        import ucp

        ucp.restore(engine, spec.load.path, load_optimizer_states=spec.load.load_optimizer_states)
    elif spec.load is not None:
        path, _ = engine.load_checkpoint(spec.load.path, tag=spec.load.tag)
        if path is None:
            raise SystemExit(f"DeepSpeed loaded nothing from {spec.load.path}")
    if spec.plain:
        stage, dp_rank, tp_rank = 0, torch.distributed.get_rank(), 0
        losses = _train_plain(engine, spec, dp_rank)
    else:
        stage, dp_rank = engine.stage_id, engine.grid.get_data_parallel_rank()
        tp_rank = engine.grid.get_slice_parallel_rank()
        losses = _train_pipe(engine, spec, dp_rank)
    if spec.save_dir:
        client = {"universal_checkpoint_info": tp_info()} if spec.tp > 1 else {}
        engine.save_checkpoint(spec.save_dir, tag=spec.save_tag, client_state=client)
    if spec.record:
        _record(engine, spec, losses, stage, dp_rank, tp_rank)


def run_pipeline(spec: PipeSpec, *, timeout: float = 900.0, log_dir: str | os.PathLike | None = None) -> None:
    """Run ``spec`` on ``pp x dp x tp`` local processes and wait for all of them."""
    if not spec.port:
        spec.port = free_port()
    launch(spec.pp * spec.dp * spec.tp, spec.to_json(), port=spec.port, module=MODULE, timeout=timeout, log_dir=log_dir)


if __name__ == "__main__":
    main(sys.argv[1:])
    end_rank()
