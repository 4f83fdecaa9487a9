"""The description of one DeepSpeed run: plain dataclasses that travel to each rank as JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import TypeVar

__all__ = ["JsonSpec", "LoadSpec", "ModelSpec", "RunSpec", "OPTIMIZERS"]

#: Optimizers the harness can build, named as ucp's flavours name them (plus the AdamW variant).
OPTIMIZERS = (
    "torch-adamw",
    "torch-adam",
    "torch-adamw-fused",  # fused=True: CPU and CUDA
    "torch-adamw-capturable",  # capturable=True: CUDA only (step tensors on the device)
    "apex-fused-adam",  # CUDA and apex only
    "ds-fused-adam",
    "ds-cpu-adam",
    "torch-adamw-amsgrad",
    "torch-sgd",  # nesterov momentum
    "torch-rmsprop",  # centered, with momentum
    "torch-nadam",
    "torch-radam",
    "torch-adamax",
    "torch-adagrad",
    "ds-cpu-adagrad",  # needs offload
    "ds-cpu-lion",  # needs offload
    "ds-muon",  # MuonWithAuxAdam from the DeepSpeed config
    "torch-adadelta",
    "torch-rprop",
    "torch-asgd",  # 0-dim eta and mu per parameter
    "torch-adafactor",  # torch.optim.Adafactor: a flat partition is a vector, so its variance is unfactored
    "hf-adafactor",  # transformers.optimization.Adafactor (Trainer's optim="adafactor"), with beta1
    "sf-adamw",  # schedulefree.AdamWScheduleFree: its step k and weight sums in the group, z per parameter
    "sf-sgd",  # schedulefree.SGDScheduleFree
)


@dataclass
class ModelSpec:
    """A small language model with every feature a checkpoint can carry.

    Sizes are deliberately odd so that no parameter divides evenly by common DP sizes: every
    partition has padding. ``layers`` x ``hidden``^2 sets the bulk; the largest parameter is
    max(vocab x hidden, hidden x ffn).
    """

    vocab: int = 37
    hidden: int = 10
    ffn: int = 23
    layers: int = 2
    tied: bool = True  # lm head shares the embedding weight
    frozen: bool = True  # one frozen projection (requires_grad=False)
    buffers: bool = True  # a persistent buffer that training updates, and a non-persistent one
    glu: bool = False  # blocks are SwiGLU: one fused gate+up projection (two sub-parameters), then down


@dataclass
class LoadSpec:
    """How a run starts from an earlier state before training."""

    path: str
    kind: str = "native"  # native | ds-universal | ucp (ucp.restore into the live engine)
    tag: str | None = None
    load_optimizer_states: bool = True
    strict: bool = True  # load_module_strict / ucp.restore(strict=): False when frozen weights were excluded
    # ucp.restore is expected to refuse (a checkpoint of another model): the run records the UcpError's line and
    # goes on from the engine as it stands, so a test sees that the refusal changed nothing
    refused: bool = False


_S = TypeVar("_S", bound="JsonSpec")


class JsonSpec:
    """What every harness's run spec shares: the JSON its ranks get on their command line (a dataclass
    with a ``model`` ModelSpec and an optional ``load`` LoadSpec), and per-rank record files."""

    record: str | None

    def to_json(self) -> str:
        return json.dumps(asdict(self))  # type: ignore[call-overload]  # subclasses are dataclasses

    @classmethod
    def from_json(cls: type[_S], text: str) -> _S:
        raw = json.loads(text)
        raw["model"] = ModelSpec(**raw["model"])
        raw["load"] = LoadSpec(**raw["load"]) if raw.get("load") else None
        return cls(**raw)

    def rank_record(self, rank: int) -> str:
        """RECORD.rankR.pt: where rank ``rank`` writes its live state."""
        assert self.record is not None
        return self.record.removesuffix(".pt") + f".rank{rank}.pt"


@dataclass
class RunSpec(JsonSpec):
    """One distributed run: build an engine, maybe load, train, maybe save, maybe record."""

    dp: int = 2
    tp: int = 1  # DeepSpeed AutoTP degree (stage 0-2 only); the run uses dp x tp ranks
    stage: int = 3
    dtype: str = "bf16"  # fp32 | bf16 | fp16 (on a CPU the worker lifts DeepSpeed's fp16 gate: _allow_fp16_on_cpu)
    loss_scale_power: int = 16  # fp16: the dynamic loss scale starts at 2**this (20 makes the first steps overflow)
    device: str = "cpu"  # cpu (gloo ranks) | cuda (one GPU per rank, nccl)
    optimizer: str = "torch-adamw"
    offload: bool = False  # optimizer offload to CPU (needed by ds-cpu-adam)
    offload_param: bool = False  # ZeRO-3 parameter offload to CPU (ZeRO-Infinity's offload_param)
    # with offload (offload_param) at ZeRO-3: the optimizer state (the parameters) in NVMe swap files (ZeRO-Infinity;
    # DeepSpeed's async_io op, which needs libaio) under a temporary folder of the rank; 1 MiB or more per rank swaps
    nvme: bool = False
    # DeepSpeed's low-precision masters. bf16, ZeRO-1/2/3: "bf16": bf16_master_weights_and_grads (DeepSpeed
    # requires offload and ds-cpu-adam, whose moments stay fp32); "bf16-states": also bf16_optimizer_states.
    # fp16, ZeRO-2 with offload and ds-cpu-adam: "fp16": fp16_master_weights_and_grads
    master: str = "fp32"
    hpz: int = 0  # ZeRO++ hierarchical partitioning (zero_hpz_partition_size) at ZeRO-3: 0 = off
    # DeepSpeed ZenFlow (ZeRO-1/2, offload, ds-cpu-adam from the config): its select and update interval; 0 = off
    zenflow: int = 0
    mics: int = 0  # MiCS shard size (zero_optimization.mics_shard_size, ZeRO-3, DeepSpeed before 0.19.8): 0 = off
    # Ulysses sequence parallelism: DeepSpeed's parallel_state_sp groups, as ALST and Accelerate's sp_backend
    # "deepspeed" hand them to deepspeed.initialize; ZeRO then partitions over all dp ranks (sp x dp/sp)
    sp: int = 1
    # ZeRO-3 stage3_param_persistence_threshold: 0 partitions every parameter; DeepSpeed's default (100000) keeps
    # small ones whole on every rank between steps (a real run's biases and norms)
    persistence_threshold: int = 0
    # ZeRO-1/2 round_robin_gradients: each flat group holds its params in a DP-dependent order
    round_robin: bool = False
    grad_accum_dtype: str | None = None  # "fp32" with bf16 at stage 1: DeepSpeed picks BF16_Optimizer
    exclude_frozen: bool = False  # save_checkpoint(exclude_frozen_parameters=True), as PEFT/LoRA runs save
    # more DeepSpeed config: top-level blocks added as given (torch_autocast, ...)
    ds_config: dict | None = None
    # torch.compile(model) before deepspeed.initialize (backend "eager": the wrapper without a compiler): every
    # name DeepSpeed saves then starts with the wrapper's "_orig_mod."
    compiled: bool = False
    sub_group_size: int = 0  # 0 = DeepSpeed's default (one sub-group per param group)
    # ZeRO-3: build the model under deepspeed.zero.Init, so each rank only ever holds its partition (how a model
    # larger than one rank's memory is built; without it every rank first builds the whole model)
    zero_init: bool = False
    param_groups: int = 2  # 1: one group; 2: decay / no-decay with their own lr; 3: + a group for the head
    lr: float = 1e-2
    scheduler: bool = True
    model: ModelSpec = field(default_factory=ModelSpec)
    global_batch: int = 12  # divisible by every DP size the tests use
    seq: int = 8
    seed: int = 1234
    data_seed: int = 99
    steps: int = 3
    first_step: int = 0  # index of the first batch, so a resumed run sees the batches it would have seen
    load: LoadSpec | None = None
    save_dir: str | None = None
    save_tag: str | None = None
    record: str | None = None  # rank 0 writes what the live engine holds here (torch.save)
    port: int = 0
