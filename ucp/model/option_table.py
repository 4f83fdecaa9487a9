"""Every option of a restore, declared once: its flag, its YAML key, its help, its kind, and the targets that take it.

``ucp restore`` and ``ucp reshard`` build their flags from :data:`OPTIONS` (``ucp.cli.parser``), the migration
YAML's ``target`` takes the same options under their YAML keys (``ucp.migrate.schema``), and a value given for a
target that does not take it is refused in one line by whoever reads it (:func:`not_taken`). Target names are
those of ``ucp.targets.registry``. Pure data: importing it imports no torch (the CLI's start stays quick).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ucp.model.layouts import BACKENDS

__all__ = [
    "FLAVOUR_NAMES",
    "DCP_OPTIMIZER_NAMES",
    "DCP_LAYOUTS",
    "NATIVE",
    "FOLDERS",
    "FORMAT_NAMES",
    "Option",
    "OPTIONS",
    "option",
    "given",
    "not_taken",
]

#: every optimizer flavour (ucp.model.flavours.FLAVOURS; spelled here so that --help needs no torch, kept equal by a
#: test)
FLAVOUR_NAMES = (
    "torch-adam", "ds-fused-adam", "ds-cpu-adam", "apex-fused-adam", "torch-sgd", "torch-rmsprop", "torch-nadam",
    "torch-radam", "torch-adamax", "torch-adagrad", "torch-adadelta", "torch-rprop", "torch-asgd", "torch-adafactor",
    "hf-adafactor", "sf-adamw", "sf-radam", "sf-sgd", "ds-cpu-adagrad", "ds-lion", "ds-muon", "ds-muon-torch-adam",
)  # fmt: skip
#: optimizers a DCP output can be written for (ucp.targets.dcp.DCP_OPTIMIZERS)
DCP_OPTIMIZER_NAMES = (
    "torch-adamw", "torch-adam", "torch-sgd", "torch-rmsprop", "torch-nadam", "torch-radam", "torch-adamax",
    "torch-adagrad", "torch-adadelta", "torch-rprop", "torch-asgd", "torch-adafactor", "sf-adamw", "sf-radam", "sf-sgd",
)  # fmt: skip
#: ``torch``: get_state_dict's {"model", "optim", ...}; ``torchtitan``: what its CheckpointManager reads
DCP_LAYOUTS = ("torch", "torchtitan")

#: what ``ucp restore --format`` and a migration's ``target.format`` name: DeepSpeed's own files (whichever DeepSpeed
#: target the source and options call for), a torch.distributed.checkpoint folder, a Megatron-Core checkpoint
FORMAT_NAMES = ("deepspeed", "dcp", "megatron", "verl-fsdp")
#: the targets that write DeepSpeed's own files (a bare checkpoint, one inside a Trainer or Accelerate folder, a
#: pipeline one, a legacy MoE or AutoEP one)
NATIVE = frozenset({"deepspeed", "hf-folder", "deepspeed-pipeline", "deepspeed-moe", "deepspeed-autoep"})
_PIPELINE = frozenset({"deepspeed-pipeline"})
_EXPERTS = frozenset({"deepspeed-moe", "deepspeed-autoep"})
_DCP = frozenset({"dcp"})
#: a verl FSDP actor folder (ucp.targets.verl)
_VERL = frozenset({"verl-fsdp"})
#: a Trainer or Accelerate folder of an FSDP run, and both kinds of folder (which one a source gets, the registry
#: decides from the source and ``backend``)
_FSDP = frozenset({"hf-fsdp-folder"})
FOLDERS = frozenset({"hf-folder"}) | _FSDP


@dataclass(frozen=True)
class Option:
    """One option of a restore.

    ``kind`` says how a value is read and checked: ``positive`` (an integer >= 1), ``choice`` (one of ``choices``),
    ``tristate`` (true, false, or unset: as the source did), ``step`` (keep, reset or an integer >= 0), ``tag`` (a
    folder name), ``text``, ``list`` (the flag repeated), ``flag`` (present or not). ``unset`` is the value that
    means "not given". ``yaml`` is its key in a migration's ``target`` (None: a flag of the command only).
    """

    name: str
    flag: str
    help: str
    kind: str
    targets: frozenset[str]
    choices: tuple[Any, ...] = ()
    unset: Any = None
    yaml: str | None = None
    metavar: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def flags(self) -> list[str]:
        """How the command line spells it (a tristate's ``--no-`` form too)."""
        return [self.flag, f"--no-{self.flag[2:]}"] if self.kind == "tristate" else [self.flag]


OPTIONS: tuple[Option, ...] = (
    Option("dp", "--dp", "data-parallel size of the new run (restore needs it unless --format dcp); for an FSDP "
           "folder its number of processes", "positive", NATIVE | _FSDP | _VERL, yaml="dp"),
    Option("stage", "--stage", "ZeRO stage of the new run, 0 without ZeRO (default: the source's; 3 for an FSDP2 / "
           "DCP source)", "choice", NATIVE, choices=(0, 1, 2, 3), yaml="stage"),
    Option("tp", "--tp", "tensor-parallel degree of the new run (default 1; > 1 needs --stage 0, 1 or 2)", "positive",
           NATIVE - _EXPERTS, unset=1, yaml="tp"),
    Option("pp", "--pp", "pipeline stages of the new run: a PipelineEngine checkpoint (stage defaults to 1; needs "
           "--pp-parts or --pp-partition)", "positive", _PIPELINE),
    Option("pp_parts", "--pp-parts", "--pp: the new run's layer partition (PipelineModule.parts)", "text", _PIPELINE,
           metavar="0,3,6"),
    Option("pp_partition", "--pp-partition", "--pp: cut the layers as the new run's partition_method will (instead "
           "of --pp-parts; needs --pp-layers)", "choice", _PIPELINE, choices=("uniform", "parameters")),
    Option("pp_layers", "--pp-layers", "--pp-partition: the PipelineModule's layer count", "positive", _PIPELINE,
           metavar="N"),
    Option("pp_tied", "--pp-tied", "--pp: the layers using TiedLayerSpec KEY (repeat per key)", "list", _PIPELINE,
           metavar="KEY=0,5"),
    Option("ep", "--ep", "expert-parallel size of the new run: a legacy DeepSpeed MoE or AutoEP checkpoint (ZeRO-1/2; "
           "default for a source with experts: its own ep_size or autoep_size, and its stage)", "positive", _EXPERTS),
    Option("optimizer", "--optimizer", "optimizer of the new run (default: the source's; for --format dcp or an FSDP "
           "folder its torch optimizer, AdamW for Adam's)", "choice", NATIVE | _DCP | _FSDP | _VERL,
           choices=tuple(dict.fromkeys((*FLAVOUR_NAMES, *DCP_OPTIMIZER_NAMES))), yaml="optimizer"),
    Option("dtype", "--dtype", "model dtype of the new run (default: source's)", "choice", NATIVE,
           choices=("fp32", "bf16", "fp16"), yaml="dtype"),
    Option("tag", "--tag", "tag folder name (default: global_step<N>)", "tag", NATIVE, yaml="tag"),
    Option("sub_group_size", "--sub-group-size", "ZeRO-3 sub_group_size of the new run (default: source's)",
           "positive", NATIVE, yaml="sub_group_size"),
    Option("step", "--step", "keep (default), reset, or an integer", "step", NATIVE | _DCP | _FSDP | _VERL, unset="keep",
           yaml="step"),
    Option("offload", "--offload", "the new run offloads its optimizer (offload_optimizer): DeepSpeed Muon lays its "
           "ZeRO-1/2 momentum out by it (default: as the source did)", "tristate", NATIVE, yaml="offload"),
    Option("round_robin_gradients", "--round-robin-gradients", "the new run sets zero_optimization."
           "round_robin_gradients: ZeRO-1/2 files flatten each param group in round-robin order over the ranks "
           "(default: as the source did)", "tristate", NATIVE, yaml="round_robin_gradients"),
    Option("zenflow", "--zenflow", "the new run uses ZenFlow (zero_optimization.zenflow), which at ZeRO-3 keeps every "
           "matrix transposed (default: as the source did)", "tristate", NATIVE, yaml="zenflow"),
    Option("backend", "--backend", "a Trainer or Accelerate folder: what the new run checkpoints with: deepspeed, "
           "fsdp-sharded or fsdp-full (its fsdp_config state_dict_type: SHARDED_STATE_DICT, FULL_STATE_DICT); default: "
           "the source folder's", "choice", FOLDERS, choices=BACKENDS, yaml="backend"),
    Option("model_config", "--model-config", "--format megatron from another framework's Llama-family run: its "
           "Hugging Face config.json (default: the source folder's)", "text", frozenset({"megatron"}),
           yaml="model_config", metavar="FILE"),
    Option("pad_vocab", "--pad-vocab", "--format megatron from another framework's Llama-family run: pad the "
           "vocabulary to a multiple of N, as the new run's make_vocab_size_divisible_by x TP does (its rows start at "
           "zero, and they enter the softmax); default 1: no padding, the same model", "positive",
           frozenset({"megatron"}), unset=1, yaml="pad_vocab", metavar="N"),
    Option("dcp_layout", "--dcp-layout", "--format dcp: torch (default; get_state_dict's model/optim) or torchtitan "
           "(its CheckpointManager's keys)", "choice", _DCP, choices=DCP_LAYOUTS, yaml="layout"),
    Option("fsdp_version", "--fsdp-version", "--format verl-fsdp: the new run's FSDP, 1 or 2 (default: a verl "
           "source's, else 2)", "choice", _VERL, choices=(1, 2)),
    Option("mesh_device", "--mesh-device", "--format verl-fsdp: the device type of the new run's device mesh, which "
           "its DTensors record (default: a verl source's, else cuda)", "choice", _VERL, choices=("cuda", "cpu", "npu")),
    Option("distributed", "--distributed", "split the rank files across torch.distributed ranks (launch with "
           "torchrun; OUT on a shared file system)", "flag", frozenset({"deepspeed"}), unset=False),
)  # fmt: skip

_BY_NAME = {o.name: o for o in OPTIONS}


def option(name: str) -> Option:
    """The declared option ``name``."""
    return _BY_NAME[name]


def given(values: dict[str, Any]) -> list[Option]:
    """The declared options ``values`` (name -> value) sets to something other than "not given"."""
    return [o for o in OPTIONS if o.name in values and values[o.name] != o.unset and values[o.name] != []]


def not_taken(target: str, values: dict[str, Any]) -> list[Option]:
    """The options given in ``values`` that ``target`` does not take, in declaration order."""
    return [o for o in given(values) if target not in o.targets]
