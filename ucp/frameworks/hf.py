"""The one owner of Hugging Face run folders' layout: a Trainer ``checkpoint-N`` and an Accelerate ``save_state``
folder.

Both wrap one DeepSpeed checkpoint (a tag folder and ``latest``) in files of their own: a Trainer
folder holds ``trainer_state.json``, ``training_args.bin``, ``rng_state_<i>.pth`` (``rng_state.pth``
at one process), ``scheduler.pt``/``scaler.pt`` and the model's weights, config and tokenizer; an
Accelerate folder holds the ``pytorch_model`` tag, ``random_states_<i>.pkl``, ``scheduler.bin``,
``sampler.bin``, ``dl_state_dict.bin`` and custom objects. This module only names those files (it
never unpickles one); ``ucp.sources.hf`` reads such a folder and ``ucp.targets.hf`` writes one for a new world size.

RNG policy at a new world size: new process ``r`` takes old process ``r mod W_old``'s file. The
random streams of the old run are not reproduced exactly (ranks past ``W_old`` repeat a stream).
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from ucp.deepspeed.layout import LATEST, read_latest
from ucp.errors import InputError
from ucp.io.small_files import read_small
from ucp.model.batch import global_batch_advice
from ucp.model.layouts import FSDP_FULL, FSDP_SHARDED, RunFolder

__all__ = [
    "HfFolder",
    "find_hf_folder",
    "model_files",
    "config_in_dtype",
    "rng_plan",
    "rng_names",
    "batch_advice",
    "TRAINER",
    "ACCELERATE",
    "ACCELERATE_TAG",
    "FSDP_MODEL_DIR",
    "FSDP_OPTIM_DIR",
    "FSDP_MODEL_FILE",
    "FSDP_OPTIM_FILE",
    "SHARDED",
    "FULL",
    "scheduler_file",
    "CONFIG_DTYPES",
]

logger = logging.getLogger(__name__)

TRAINER = "trainer"
ACCELERATE = "accelerate"
#: files only Trainer writes into checkpoint-N (transformers 5.23)
_TRAINER_MARKS = ("trainer_state.json", "training_args.bin")
_TRAINER_RNG = re.compile(r"^rng_state(?:_(\d+))?\.pth$")
#: Accelerate's per-process RNG pickles (accelerate 1.15 ``RNG_STATE_NAME``)
_ACCEL_RNG = re.compile(r"^random_states_(\d+)\.pkl$")
#: the names of ucp's own marks in a folder it wrote (ucp.io.atomic: the owner mark, the staging and old folders)
UCP_MARKS = ".ucp-"
#: the tag Accelerate's DeepSpeed save gives its first model (the i-th: pytorch_model_i)
ACCELERATE_TAG = "pytorch_model"
#: Accelerate's tag for the i-th DeepSpeed model: pytorch_model, pytorch_model_1, ...
_ACCEL_TAG = re.compile(r"^pytorch_model(?:_\d+)?$")
_DS_FILE = re.compile(r"(model|optim)_states\.pt$")
#: where Accelerate's FSDP save (accelerate 1.15 fsdp_utils, Trainer's too) puts model 0 and optimizer 0: DCP folders
#: under SHARDED_STATE_DICT, whole torch files under FULL_STATE_DICT
FSDP_MODEL_DIR, FSDP_OPTIM_DIR = "pytorch_model_fsdp_0", "optimizer_0"
FSDP_MODEL_FILE, FSDP_OPTIM_FILE = "pytorch_model_fsdp.bin", "optimizer.bin"
SHARDED, FULL = FSDP_SHARDED, FSDP_FULL
#: a second model or optimizer of one Accelerate run (pytorch_model_fsdp_1, optimizer_1, ...)
_FSDP_MORE = re.compile(r"^(pytorch_model_fsdp|optimizer)_[1-9]\d*$")


#: the run folder's record (kept under its old name for the callers that know it so)
HfFolder = RunFolder


def _is_tag_dir(path: Path) -> bool:
    return path.is_dir() and any(_DS_FILE.search(p.name) for p in path.iterdir())


def _rng_files(names: list[str], pattern: re.Pattern[str], folder: Path) -> tuple[str, ...]:
    """The RNG files in process order; a gap (rank 1 missing of 0..2) is refused."""
    indexed = {}
    for name in names:
        match = pattern.match(name)
        if match:
            indexed[int(match.group(1)) if match.group(1) is not None else -1] = name
    if -1 in indexed:  # Trainer at one process: rng_state.pth
        if len(indexed) > 1:
            raise InputError(f"{folder} holds both rng_state.pth and rng_state_<i>.pth; keep the ones of one run")
        return (indexed[-1],)
    missing = [i for i in range(len(indexed)) if i not in indexed]
    if missing:
        raise InputError(
            f"{folder} has RNG files for processes {sorted(indexed)} but not {missing}: the folder is incomplete"
        )
    return tuple(indexed[i] for i in range(len(indexed)))


def _kind(names: set[str], tag: str) -> str | None:
    if any(m in names for m in _TRAINER_MARKS) or any(_TRAINER_RNG.match(n) for n in names):
        return TRAINER
    if _ACCEL_TAG.match(tag) or any(_ACCEL_RNG.match(n) for n in names):
        return ACCELERATE
    return None


#: Trainer writes a few kilobytes (its log history grows by a line per logging step)
_MAX_STATE_BYTES = 256 << 20


def _read_state(path: Path) -> dict[str, Any] | None:
    file = path / "trainer_state.json"
    if not file.is_file():
        return None
    try:
        state = json.loads(read_small(file, _MAX_STATE_BYTES, "trainer_state.json"))
    except (ValueError, RecursionError) as err:
        raise InputError(f"{file} is not readable JSON: {str(err) or type(err).__name__}") from None
    if not isinstance(state, dict):
        raise InputError(f"{file} is not a JSON object")
    return state


def _entries(path: Path) -> list[str]:
    """The folder's entries but ucp's own marks (``.ucp-output``: which write made it, and how; never carried)."""
    return sorted(n for n in os.listdir(path) if not n.startswith(UCP_MARKS))


def _fsdp_folder(path: Path, names: list[str]) -> HfFolder | None:
    """A Trainer or Accelerate folder of an FSDP run (its model and optimizer state in Accelerate's FSDP files), or
    None when ``path`` holds no FSDP state."""
    if (path / FSDP_MODEL_DIR / ".metadata").is_file():
        backend, state = SHARDED, (FSDP_MODEL_DIR, FSDP_OPTIM_DIR)
    elif (path / FSDP_MODEL_FILE).is_file():
        backend, state = FULL, (FSDP_MODEL_FILE, FSDP_OPTIM_FILE)
    else:
        return None
    kind = TRAINER if any(m in names for m in _TRAINER_MARKS) or any(_TRAINER_RNG.match(n) for n in names) else None
    kind = kind or (ACCELERATE if any(_ACCEL_RNG.match(n) for n in names) else None)
    if kind is None:
        return None
    more = [n for n in names if _FSDP_MORE.match(n)]
    if more:
        raise InputError(
            f"{path} holds several FSDP models or optimizers ({', '.join(more)}); ucp moves a folder with one"
        )
    if state[1] not in names:
        raise InputError(
            f"{path} holds the FSDP model ({state[0]}) but no optimizer state ({state[1]}): saved with "
            "save_only_model, it has nothing to move but weights (ucp export reads them)"
        )
    rng = _rng_files(names, _TRAINER_RNG if kind == TRAINER else _ACCEL_RNG, path)
    files = tuple(n for n in names if n not in state and n not in rng)
    return HfFolder(path, kind, "", rng, files, (), _read_state(path), backend, state)


def find_hf_folder(path: str | os.PathLike[str]) -> HfFolder | None:
    """The Hugging Face folder at ``path``, or None when it is not one (a bare DeepSpeed folder, ...): one of a
    DeepSpeed run (``latest`` and its tag folder), or of an FSDP run (Accelerate's FSDP files)."""
    path = Path(path)
    if not (path / LATEST).is_file():
        return _fsdp_folder(path, _entries(path)) if path.is_dir() else None
    names = _entries(path)
    tag = read_latest(path / LATEST)
    kind = _kind(set(names), tag)
    if kind is None:
        return None
    if not _is_tag_dir(path / tag):
        raise InputError(f"{path}/latest names {tag!r}, but {path / tag} holds no DeepSpeed files")
    if kind == ACCELERATE:
        models = [n for n in names if _ACCEL_TAG.match(n) and _is_tag_dir(path / n)]
        if len(models) > 1:
            raise InputError(
                f"{path} holds several DeepSpeed models ({', '.join(models)}); ucp restores a folder with one"
            )
    rng = _rng_files(names, _TRAINER_RNG if kind == TRAINER else _ACCEL_RNG, path)
    skipped = tuple(n for n in names if n != tag and _is_tag_dir(path / n))
    files = tuple(n for n in names if n not in (LATEST, tag) and n not in rng and n not in skipped)
    return HfFolder(path, kind, tag, rng, files, skipped, _read_state(path))


#: what a Trainer folder holds besides the model's own files: the run's state (transformers 5.23), DeepSpeed's
#: scripts, and the weights an export writes anew
_TRAINING_STATE = re.compile(
    r"^(trainer_state\.json|training_args\.bin|(scheduler|scaler|optimizer)\.pt|zero_to_(fp32|torch)\.py|"
    r"latest(_universal)?|(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?)$"
)


def model_files(folder: HfFolder) -> list[str]:
    """The files ``from_pretrained`` reads besides the weights (config, generation config, tokenizer, chat
    template, ...), which an export of the folder carries so that its output loads as a model: a Trainer
    folder's regular files that are not the run's state. None for a PEFT adapter folder (its weights are
    named for the wrapped model) or a folder without ``config.json``."""
    names = [n for n in folder.files if (folder.path / n).is_file() and not _TRAINING_STATE.match(n)]
    if "config.json" not in names or "adapter_config.json" in names:
        return []
    return names


#: ucp's dtype names -> the names transformers writes in config.json
CONFIG_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_DTYPE_KEYS = ("dtype", "torch_dtype")  # transformers >= 4.56 writes dtype; earlier ones torch_dtype


def config_in_dtype(text: bytes, dtype: str) -> bytes | None:
    """``config.json``'s text with the dtype it names (``dtype``/``torch_dtype``, at its top and in its sub-model
    configs) set to the one the weights are exported in, so that ``from_pretrained(dtype="auto")`` does not cast
    them back; None when the text names no other dtype (or is not a JSON object: then it is copied as it is)."""
    try:
        config = json.loads(text)
    except (ValueError, RecursionError):  # UnicodeDecodeError too; nesting past the interpreter's limit
        return None
    if not isinstance(config, dict):
        return None
    name = CONFIG_DTYPES[dtype]
    changed = False

    def visit(node: dict[str, Any]) -> None:
        nonlocal changed
        for key, value in node.items():
            if key in _DTYPE_KEYS and isinstance(value, str) and value in CONFIG_DTYPES.values() and value != name:
                node[key] = name
                changed = True
            elif isinstance(value, dict):
                visit(value)

    try:
        visit(config)
    except RecursionError:
        return None
    return (json.dumps(config, indent=2) + "\n").encode() if changed else None


def scheduler_file(kind: str) -> str:
    """Where the run keeps its lr scheduler's state_dict beside an FSDP checkpoint (a DeepSpeed run's is in its
    model states): Trainer's ``scheduler.pt``, Accelerate's ``scheduler.bin`` (both ``torch.save``)."""
    return "scheduler.pt" if kind == TRAINER else "scheduler.bin"


def rng_names(kind: str, world: int) -> list[str]:
    """The RNG file each of ``world`` processes looks for (Trainer at one process: ``rng_state.pth``)."""
    if kind == TRAINER:
        return ["rng_state.pth"] if world == 1 else [f"rng_state_{r}.pth" for r in range(world)]
    return [f"random_states_{r}.pkl" for r in range(world)]


def rng_plan(folder: HfFolder, world: int) -> list[tuple[str, str]]:
    """(old file, new file) per new process: new process r takes old process r mod W_old."""
    if not folder.rng_files:
        return []
    new = rng_names(folder.kind, world)
    return [(folder.rng_files[r % len(folder.rng_files)], name) for r, name in enumerate(new)]


def batch_advice(micro: int, accum: int, old_dp: int, new_dp: int) -> str | None:
    """What keeps the global batch at ``new_dp`` processes, in Trainer's flags; None when nothing changes.

    Trainer places the data from ``global_step`` alone, so a different global batch silently
    changes which samples the resumed run sees.
    """
    return global_batch_advice(
        micro,
        accum,
        old_dp,
        new_dp,
        spell=lambda b, a: f"--per_device_train_batch_size {b} --gradient_accumulation_steps {a}",
        verb="pass",
    )
