"""The one owner of verl's FSDP checkpoint layout (verl 0.9.1 ``FSDPCheckpointManager``): what its files are called,
where the folder sits in a run, and which folder a path means.

An actor (or critic) folder holds, per rank ``r`` of the ``W`` that saved it, ``model_world_size_W_rank_r.pt``
(``model.state_dict()``: DTensors, or ShardedTensors under FSDP1 without a mesh), ``optim_world_size_W_rank_r.pt``
(the raw ``optimizer.state_dict()``) and ``extra_state_world_size_W_rank_r.pt`` (``{"lr_scheduler", "rng"}``); rank 0
adds ``fsdp_config.json`` (``{"FSDP_version", "world_size"}``) and ``huggingface/`` (the model's config, tokenizer;
with ``hf_model`` its weights). verl's trainer keeps it as ``<dir>/global_step_N/actor`` beside ``data.pt`` (the
dataloader) and writes ``<dir>/latest_checkpointed_iteration.txt`` (``N``). verl loads only the files of its own world
size: a folder is for one process count. This module names and finds files and never unpickles one; reading them is
``ucp.frameworks.verl_files`` and ``verl_store``'s.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ucp.errors import InputError
from ucp.io.small_files import read_small

__all__ = [
    "VerlFolder",
    "find_verl",
    "is_actor",
    "config_files",
    "looks_like_verl",
    "rank_file",
    "fsdp_config_text",
    "FSDP_CONFIG",
    "HF_DIR",
    "LATEST",
    "ACTOR",
    "DATA",
    "MODEL",
    "OPTIM",
    "EXTRA",
]

MODEL, OPTIM, EXTRA = "model", "optim", "extra_state"
FSDP_CONFIG = "fsdp_config.json"
HF_DIR = "huggingface"
#: what verl's PPO trainer writes around the actor folder (verl/trainer/ppo/ray_trainer.py)
LATEST = "latest_checkpointed_iteration.txt"
ACTOR = "actor"
DATA = "data.pt"
_RANK_FILE = re.compile(r"^(model|optim|extra_state)_world_size_(\d+)_rank_(\d+)\.pt$")
_STEP_DIR = re.compile(r"^global_step_(\d+)$")
#: weights verl's ``hf_model`` save puts in ``huggingface/`` (an export writes its own)
_WEIGHTS = re.compile(r"^(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?$")
#: fsdp_config.json and the step file are a few bytes; a larger one is not verl's
_SMALL = 1 << 16


def rank_file(kind: str, world: int, rank: int) -> str:
    """The name verl gives ``kind`` (model, optim, extra_state) of ``rank`` of ``world`` processes."""
    return f"{kind}_world_size_{world}_rank_{rank}.pt"


def fsdp_config_text(version: int, world: int) -> str:
    """``fsdp_config.json`` as verl 0.9.1 writes it (``json.dump(asdict(FSDPConfig), f, indent=4)``)."""
    return json.dumps({"FSDP_version": version, "world_size": world}, indent=4)


@dataclass(frozen=True)
class VerlFolder:
    """An actor folder of a verl FSDP checkpoint, by file name (nothing unpickled)."""

    actor: Path
    world: int
    #: fsdp_config.json's FSDP_version (None: the file is missing; the rank files then tell)
    fsdp_version: int | None
    #: the global step (the ``global_step_N`` folder's N), None when the actor folder sits elsewhere
    step: int | None
    #: the actor folder's other entries (``huggingface/``, ``lora_train_meta.json``, ...), copied by a verl target
    files: tuple[str, ...]
    #: entries beside the actor folder in ``global_step_N`` (``data.pt``, ``critic``), which no output carries
    around: tuple[str, ...]

    def paths(self, kind: str) -> list[Path]:
        return [self.actor / rank_file(kind, self.world, r) for r in range(self.world)]

    @property
    def has_hf(self) -> bool:
        return HF_DIR in self.files


def is_actor(path: Path) -> bool:
    """A folder holding verl's rank files (or its fsdp_config.json): what ``load_checkpoint`` is given."""
    if not path.is_dir():
        return False
    return (path / FSDP_CONFIG).is_file() or any(_RANK_FILE.match(n) for n in os.listdir(path))


def looks_like_verl(path: Path) -> bool:
    """What a source claim looks at (names only): an actor folder, a ``global_step_N`` folder holding one, or a run
    folder with ``latest_checkpointed_iteration.txt``."""
    if not path.is_dir():
        return False
    if is_actor(path) or bool(_STEP_DIR.match(path.name)) and is_actor(path / ACTOR):
        return True
    try:  # Megatron-LM names its tracker file alike: only one that names a global_step_N/actor folder is verl's
        return (path / LATEST).is_file() and is_actor(_latest(path) / ACTOR)
    except InputError:
        return False


def _latest(root: Path) -> Path:
    """The actor folder ``latest_checkpointed_iteration.txt`` points at."""
    text = read_small(root / LATEST, _SMALL, LATEST).decode("utf-8", "replace").strip()
    if not text.isdigit():
        raise InputError(f"{root / LATEST} holds {text[:40]!r}, not a step number")
    step_dir = root / f"global_step_{int(text)}"
    if not step_dir.is_dir():
        raise InputError(f"{root / LATEST} names step {int(text)}, but {step_dir} is missing")
    return step_dir


def _actor_of(path: Path) -> Path | None:
    """The actor folder ``path`` means: itself, a ``global_step_N`` folder's ``actor``, or the one the run folder's
    ``latest_checkpointed_iteration.txt`` names; None when ``path`` is none of those."""
    if is_actor(path):
        return path
    if (path / LATEST).is_file():
        path = _latest(path)
    if _STEP_DIR.match(path.name) and is_actor(path / ACTOR):
        return path / ACTOR
    return None


def _world(actor: Path, names: list[str], config: dict[str, Any]) -> int:
    worlds = {int(m.group(2)) for n in names if (m := _RANK_FILE.match(n))}
    recorded = config.get("world_size")
    if len(worlds) > 1:
        raise InputError(f"{actor} holds rank files of several world sizes {sorted(worlds)}; keep one save's files")
    if recorded is not None and (not isinstance(recorded, int) or worlds and recorded not in worlds):
        raise InputError(f"{actor}/{FSDP_CONFIG} says world_size {recorded!r}, the rank files {sorted(worlds)}")
    world = recorded if isinstance(recorded, int) else next(iter(worlds), 0)
    if world < 1:
        raise InputError(f"{actor} holds no model_world_size_W_rank_r.pt files: no verl checkpoint to read")
    expected = {rank_file(k, world, r) for k in (MODEL, OPTIM, EXTRA) for r in range(world)}
    missing = sorted(expected - set(names), key=lambda n: (len(n), n))
    if missing:
        raise InputError(
            f"rank file {missing[0]} is missing from {actor}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            + f": the checkpoint was saved by {world} processes"
        )
    return world


def _config(actor: Path) -> dict[str, Any]:
    file = actor / FSDP_CONFIG
    if not file.is_file():
        return {}
    try:
        config = json.loads(read_small(file, _SMALL, FSDP_CONFIG))
    except (ValueError, RecursionError) as err:
        raise InputError(f"{file} is not readable JSON: {str(err) or type(err).__name__}") from None
    if not isinstance(config, dict):
        raise InputError(f"{file} is not a JSON object")
    version = config.get("FSDP_version")
    if version not in (None, 1, 2):
        raise InputError(f"{file} says FSDP_version {version!r}; verl writes 1 or 2")
    return config


def find_verl(path: str | os.PathLike[str]) -> VerlFolder | None:
    """The verl actor folder at ``path`` (the actor folder, its ``global_step_N`` folder, or the run folder holding
    ``latest_checkpointed_iteration.txt``), checked for every rank file; None when ``path`` is no verl checkpoint."""
    actor = _actor_of(Path(path))
    if actor is None:
        return None
    names = sorted(os.listdir(actor))
    config = _config(actor)
    world = _world(actor, names, config)
    step_match = _STEP_DIR.match(actor.parent.name)
    others = tuple(n for n in names if not _RANK_FILE.match(n) and n != FSDP_CONFIG and not n.startswith(".ucp-"))
    around = tuple(sorted(n for n in os.listdir(actor.parent) if n != ACTOR)) if step_match else ()
    step = int(step_match.group(1)) if step_match else None
    return VerlFolder(actor, world, config.get("FSDP_version"), step, others, around)


def config_files(path: str | os.PathLike[str]) -> list[Path]:
    """The files of a verl checkpoint's ``huggingface/`` that ``from_pretrained`` reads besides the weights (config,
    generation config, tokenizer), which an export carries so that its output loads as a model."""
    folder = find_verl(path)
    if folder is None or not folder.has_hf:
        return []
    hf = folder.actor / HF_DIR
    names = sorted(n for n in os.listdir(hf) if (hf / n).is_file() and not _WEIGHTS.match(n))
    return [hf / n for n in names] if "config.json" in names else []
