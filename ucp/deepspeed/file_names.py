"""The names of a DeepSpeed checkpoint's files: what each rank, layer and expert file is called, the patterns
that recognise them in a tag folder, and the fixed names beside them (``ucp.deepspeed.layout`` finds them)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

__all__ = [
    "LATEST",
    "LATEST_UNIVERSAL",
    "UNIVERSAL_OPTIM",
    "UNIVERSAL_MODEL_FILES",
    "NVME_FOLDER",
    "RESET_MARK",
    "optim_file",
    "zero3_model_file",
    "model_file",
    "layer_file",
    "expert_file",
    "nvme_swap_file",
    "OPTIM_PATTERN",
    "EXPERT_OPTIM_PATTERN",
    "Z3_MODEL_PATTERN",
    "MODEL_PATTERN",
    "PIPELINE_LAYER_PATTERN",
    "EXPERT_PATTERN",
    "FAST_PART_PATTERN",
    "OLD_EXPERT_PATTERN",
]

logger = logging.getLogger(__name__)

#: The file naming the tag folder a plain ``engine.load_checkpoint(dir)`` loads.
LATEST = "latest"
#: Its twin for ``load_universal``; "." names the folder itself.
LATEST_UNIVERSAL = "latest_universal"
#: What DeepSpeed's ``load_universal`` reads besides the per-parameter folders.
UNIVERSAL_OPTIM = "zero/optimizer_state.pt"
UNIVERSAL_MODEL_FILES = ("zero_pp_rank_0_mp_rank_00_model_states.pt", "mp_rank_00_model_states.pt")


def optim_file(dp_rank: int, mp_rank: int = 0, *, bf16: bool = False) -> str:
    """A rank's optim-states file (BF16_Optimizer and bf16 ZeRO write the ``bf16_`` prefix)."""
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def zero3_model_file(dp_rank: int, mp_rank: int = 0) -> str:
    """A ZeRO-3 rank's model-states file."""
    return f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_model_states.pt"


def model_file(mp_rank: int = 0) -> str:
    """The model-states file of a ZeRO-1/2 TP rank."""
    return f"mp_rank_{mp_rank:02d}_model_states.pt"


def layer_file(layer: int, tp_rank: int | None = None) -> str:
    """A pipeline layer's weights (``PipelineModule.ckpt_layer_path``): ``-model_YY`` only when the run's
    topology has a model (TP) axis, as Megatron-DeepSpeed's does; DeepSpeed's own PipeDataParallelTopology
    has none."""
    model = "" if tp_rank is None else f"-model_{tp_rank:02d}"
    return f"layer_{layer:02d}{model}-model_states.pt"


def expert_file(layer: int, expert: int, mp_rank: int = 0) -> str:
    """One expert's weights in a legacy ``deepspeed.moe.layer.MoE`` run (0.19.8 ``_get_expert_ckpt_name``):
    MoE layer ``layer`` (its order among the model's MoE modules), global expert index ``expert``."""
    return f"layer_{layer}_expert_{expert}_mp_rank_{mp_rank:02d}_model_states.pt"


OPTIM_PATTERN = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
#: a mixture-of-experts save without ZeRO: each expert-parallel rank's optimizer state_dict (0.19.8)
EXPERT_OPTIM_PATTERN = re.compile(r"^expp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
Z3_MODEL_PATTERN = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
MODEL_PATTERN = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
PIPELINE_LAYER_PATTERN = re.compile(r"^layer_(\d+)(?:-model_(\d+))?-model_states\.pt$")
EXPERT_PATTERN = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
#: a FastPersist part: NAME-R.N, part R of N writers
FAST_PART_PATTERN = re.compile(r"^(.+\.pt)-(\d+)\.(\d+)$")
#: the names DeepSpeed before 0.6 wrote (no MoE layer index); 0.19.8 only reads them
OLD_EXPERT_PATTERN = re.compile(r"^expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")


#: where a ZeRO-3 run offloading its optimizer to NVMe (ZeRO-Infinity) copies its swap files when it saves
NVME_FOLDER = "offloaded_tensors"


def nvme_swap_file(tag_dir: Path, rank: int, ds_id: str, key: str | None = None) -> Path:
    """The swap file of a ZeRO-Infinity save holding one sub-group's fp32 masters (``key`` None) or one of its
    optimizer states, on one rank: ``offloaded_tensors/rank<NN>/[<key>-]<ds_id>.tensor.swp``, where ``ds_id``
    names the sub-group by its first and last parameters' ids (``3_5``), as its flat tensor's ``ds_id`` says."""
    return tag_dir / NVME_FOLDER / f"rank{rank:0>2d}" / f"{'' if key is None else key + '-'}{ds_id}.tensor.swp"


#: the field of ucp's stamp (ucp.io.atomic.mark_owned) naming the flavour of an optimizer written reset
RESET_MARK = "optimizer_reset"
