"""A Trainer or Accelerate folder of an FSDP run, for a new process count: what ``trainer.train(resume_from_checkpoint=
OUT)`` or ``accelerator.load_state(OUT)`` resumes from, from any source ucp reads inside such a folder (an FSDP run's,
or a DeepSpeed run's: one command across the backends).

The model and optimizer are what Accelerate's FSDP save writes (accelerate ``fsdp_utils``, Trainer's too), every key a
clean FQN, fp32 masters: under SHARDED_STATE_DICT two DCP folders (``pytorch_model_fsdp_0`` with ``{"model": ...}``,
``optimizer_0`` with ``{"optimizer": ...}``; DCP reshards them on load), under FULL_STATE_DICT two whole torch files
(``pytorch_model_fsdp.bin``, ``optimizer.bin``). Beside them: the scheduler's state where the framework reads it
(Trainer loads the optimizer only when ``scheduler.pt`` is there), one RNG file per new process, and every other file
of the source folder unchanged (``ucp.targets.run_folder``).

Call order: :func:`write_fsdp_folder` opens the source, lays out the state dicts from the facts alone
(:func:`ucp.targets.dcp.prepare`), then inside one staged output writes them, each parameter read when the writer
reaches it (memory near one parameter), and places the folder's files.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ucp.errors import ConfigError, InputError
from ucp.frameworks.dcp import MODEL, UCP_KEY
from ucp.frameworks.hf import (
    FSDP_MODEL_DIR,
    FSDP_MODEL_FILE,
    FSDP_OPTIM_DIR,
    FSDP_OPTIM_FILE,
    TRAINER,
    rng_plan,
    scheduler_file,
)
from ucp.io.guard import OutputPolicy, guarded_output, universal_bytes
from ucp.io.timing import phase
from ucp.io.torchzip import write_torch_file
from ucp.model.layouts import DEEPSPEED, FSDP_FULL, FSDP_SHARDED, RunFolder
from ucp.model.option_table import Option
from ucp.model.options import StepPolicy
from ucp.model.pieces import LazyTensor
from ucp.model.records import Reader
from ucp.sources import opened
from ucp.targets.dcp import DcpPlan, prepare
from ucp.targets.dcp_save import Fetch, save_state
from ucp.targets.format import Request, TargetFormat, Written
from ucp.targets.run_folder import folder_backend, folder_batch_note, folder_notes, place_files, processes

__all__ = ["FORMAT", "FsdpResult", "write_fsdp_folder"]

logger = logging.getLogger(__name__)

#: the optimizer's top-level key in Accelerate's FSDP save
_OPTIMIZER = "optimizer"
_NAMES = {FSDP_SHARDED: "SHARDED_STATE_DICT", FSDP_FULL: "FULL_STATE_DICT"}


@dataclass
class FsdpResult:
    """What was written, and what the user should know before resuming."""

    folder: RunFolder
    out: Path
    world: int
    backend: str
    optimizer: str
    rng: list[tuple[str, str]]
    notes: list[str] = field(default_factory=list)


def _lazy_tree(node: Any, lazy: Mapping[str, tuple[str, str]], fetch: Fetch, prefix: str, made: dict[int, Any]) -> Any:
    """The plan's nested state with each meta tensor a :class:`LazyTensor` made from ``fetch`` when the file writer
    reaches it (a tied alias shares its owner's)."""
    if isinstance(node, Mapping):
        return {k: _lazy_tree(v, lazy, fetch, f"{prefix}{k}.", made) for k, v in node.items()}
    if isinstance(node, list):
        return [_lazy_tree(v, lazy, fetch, f"{prefix}{i}.", made) for i, v in enumerate(node)]
    if not (torch.is_tensor(node) and node.is_meta):
        return node
    if id(node) not in made:
        name, key = lazy[prefix[:-1]]
        shape, dtype = tuple(node.shape), node.dtype
        made[id(node)] = LazyTensor(shape, dtype, lambda: fetch(name, key).to(dtype).reshape(shape))
    return made[id(node)]


def _write_full(plan: DcpPlan, root: Path, reader: Reader) -> None:
    """FULL_STATE_DICT: the model's and the optimizer's whole state dicts, each in one torch file."""
    model = _lazy_tree(plan.state[MODEL], plan.lazy, Fetch(reader, moments=False), f"{MODEL}.", {})
    write_torch_file(model, root / FSDP_MODEL_FILE)
    optim = _lazy_tree(plan.state[_OPTIMIZER], plan.lazy, Fetch(reader), f"{_OPTIMIZER}.", {})
    write_torch_file(optim, root / FSDP_OPTIM_FILE)


def _write_sharded(plan: DcpPlan, root: Path, reader: Reader, fsync: bool) -> None:
    """SHARDED_STATE_DICT: the two DCP folders Accelerate loads (one shard file each; DCP reshards on load); the
    model's folder keeps ucp's record too (tied aliases, buffers, dtype), which the framework's load ignores."""
    lazy = plan.lazy
    model = {MODEL: plan.state[MODEL], UCP_KEY: plan.state[UCP_KEY]}
    save_state(model, lazy, root / FSDP_MODEL_DIR, Fetch(reader, moments=False), fsync)
    save_state({_OPTIMIZER: plan.state[_OPTIMIZER]}, lazy, root / FSDP_OPTIM_DIR, Fetch(reader), fsync)


def _not_carried(reader: Reader) -> list[str]:
    """What a DeepSpeed source keeps that an FSDP run's folder has no place for (Trainer counts in
    trainer_state.json; its own GradScaler keeps an fp16 run's scale in scaler.pt)."""
    info = reader.facts.info
    kept = [f"global_samples {info.global_samples}"] if info.global_samples else []
    kept += [f"skipped_steps {info.skipped_steps}"] if info.skipped_steps else []
    kept += ["the fp16 loss scale"] if info.dtype == "fp16" and reader.extras().get("loss_scaler") is not None else []
    if not kept:
        return []
    return [f"not carried: DeepSpeed's {', '.join(kept)}, which an FSDP folder has no place for"]


def _scheduler(root: Path, folder: RunFolder, extras: Mapping[str, Any]) -> str | None:
    """The scheduler's state where the framework reads it, when the source folder has no such file; a note when
    there is none to write."""
    name = scheduler_file(folder.kind)
    if name in folder.files:
        return None  # copied with the folder's files
    state = extras.get("lr_scheduler")
    if isinstance(state, Mapping):
        write_torch_file(dict(state), root / name)
        return None
    if folder.kind == TRAINER:
        return (
            f"the source holds no lr scheduler state, so there is no {name}: Trainer then loads neither the "
            "scheduler nor the optimizer state (it needs both files)"
        )
    return f"the source holds no lr scheduler state, so there is no {name}"


def write_fsdp_folder(
    src: str | os.PathLike[str] | Reader,
    out: str | os.PathLike[str],
    *,
    dp: int,
    backend: str | None = None,
    optimizer: str | None = None,
    step: StepPolicy = "keep",
    overwrite: bool | OutputPolicy = False,
    fsync: bool = False,
) -> FsdpResult:
    """Write OUT: the Trainer or Accelerate folder ``src`` (a path, or a reader of one; an FSDP or a DeepSpeed run's)
    as an FSDP run's folder for ``dp`` processes, whole or not at all.

    ``backend``: ``fsdp-sharded`` or ``fsdp-full`` (default: the source folder's); ``optimizer``: the new run's
    torch optimizer (default: the source's, AdamW for Adam's); ``step``: keep, reset, or one step for all."""
    if backend not in (None, FSDP_SHARDED, FSDP_FULL):
        raise ConfigError(f"an FSDP folder is written as {FSDP_SHARDED} or {FSDP_FULL}, not {backend!r}")
    with opened(src) as source:
        folder = source.facts.folder
        if folder is None:
            raise InputError(
                f"{src} is a {source.format or 'checkpoint'}, not a Hugging Face Trainer or Accelerate folder"
            )
        chosen = backend or folder.backend
        if chosen == DEEPSPEED:
            raise ConfigError(
                f"{folder.path} is a DeepSpeed run's folder: name the FSDP backend (--backend {FSDP_SHARDED} or {FSDP_FULL})"
            )
        reader, plan = prepare(source, optimizer, step, optim_key=_OPTIMIZER)
        rng = rng_plan(folder, dp)
        notes = [n for n in plan.notes if "train_state" not in n] + _not_carried(reader)
        with guarded_output(
            out, [folder.path, *source.inputs], overwrite, size=universal_bytes(reader.facts), durable=fsync
        ) as root:
            with phase(f"write the FSDP {_NAMES[chosen]} state"):
                if chosen == FSDP_SHARDED:
                    _write_sharded(plan, root, reader, fsync)
                else:
                    _write_full(plan, root, reader)
            missing = _scheduler(root, folder, reader.extras())
            place_files(root, folder, rng)
    result = FsdpResult(folder, Path(out), dp, chosen, plan.flavour, rng, notes)
    result.notes += [n for n in (missing, folder_batch_note(folder, dp)) if n]
    result.notes += folder_notes(folder, dp, rng)
    for note in result.notes:
        logger.debug("%s", note)
    return result


def _write(reader: Reader, out: Path, request: Request) -> Written:
    if not request.has("dp"):
        raise ConfigError("--dp is the new run's number of processes: give it (it names the RNG files)")
    result = write_fsdp_folder(
        reader, out, dp=int(request.get("dp")), backend=request.get("backend"), optimizer=request.get("optimizer"),
        step=request.get("step"), overwrite=request.overwrite, fsync=request.fsync,
    )  # fmt: skip
    kind = "a Trainer" if result.folder.kind == TRAINER else "an Accelerate"
    summary = (
        f"wrote {kind} folder for {processes(result.world)} (FSDP {_NAMES[result.backend]}, {result.optimizer}, "
        f"{len(result.folder.files)} files copied, {len(result.rng)} RNG files) to {out}"
    )
    fields = {
        "format": result.folder.kind,
        "backend": result.backend,
        "processes": result.world,
        "optimizer": result.optimizer,
        "files_copied": list(result.folder.files),
        "rng_files": [new for _, new in result.rng],
    }
    return Written(summary, list(result.notes), fields)


def _refusal(options: list[Option], request: Request) -> str:
    flags = [o.flag for o in options]
    one = len(flags) == 1
    return (
        f"{', '.join(flags)} describe{'s' if one else ''} a DeepSpeed output; an FSDP run's folder holds fp32 masters "
        f"that FSDP loads at any process count: drop {'it' if one else 'them'}, or write --backend deepspeed"
    )


FORMAT = TargetFormat(
    name="hf-fsdp-folder",
    label="a Hugging Face Trainer or Accelerate folder of an FSDP run",
    docs="format.md#7-hugging-face-trainer-and-accelerate-folders",
    write=_write,
    serves=lambda reader, request: folder_backend(reader, request.get("backend")) in (FSDP_SHARDED, FSDP_FULL),
    refusal=_refusal,
)
