"""A verl FSDP actor folder for a new number of processes: what verl's ``FSDPCheckpointManager.load_checkpoint`` loads
unchanged at that world size, from any source ucp reads (a verl checkpoint of another size, DeepSpeed, DCP, a Trainer
or Accelerate folder).

Per rank ``r`` of ``W`` (``--dp``): ``model_world_size_W_rank_r.pt`` (Shard(0) DTensors on the 1-D ``fsdp`` mesh,
``ucp.frameworks.verl_dtensor``), ``optim_world_size_W_rank_r.pt`` (FSDP2: per-parameter DTensor moments; FSDP1:
each FSDP unit's padded flat shard, units one per decoder layer and the root: ``ucp.targets.verl_ranks``) and
``extra_state_world_size_W_rank_r.pt`` (the lr scheduler; from a verl source, old rank ``r mod W_old``'s file with its
RNG state). Beside them ``fsdp_config.json`` and, when the source has one, ``huggingface/`` (a Trainer folder's model
files go there too). verl finds the folder as ``<dir>/global_step_N/actor``: OUT is that actor folder.

Call order: :func:`write_verl` opens the source, plans the state from the facts alone (``ucp.targets.dcp.prepare``),
checks what verl's one param group can hold, then inside one staged output writes each rank's files, every tensor read
when the writer reaches it (memory near one parameter, or one FSDP unit's shard under FSDP1), and places the files.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ucp.errors import ConfigError
from ucp.frameworks.hf import model_files
from ucp.frameworks.verl import EXTRA, FSDP_CONFIG, HF_DIR, MODEL, OPTIM, VerlFolder, find_verl, fsdp_config_text
from ucp.frameworks.verl import rank_file as verl_file
from ucp.frameworks.verl_dtensor import RankMesh
from ucp.frameworks.verl_store import mesh_device, read_extra
from ucp.io.guard import OutputPolicy, guarded_output, universal_bytes
from ucp.io.timing import phase
from ucp.io.torchzip import write_torch_file
from ucp.model.option_table import Option
from ucp.model.options import StepPolicy
from ucp.model.records import Reader
from ucp.sources import opened
from ucp.targets.dcp import prepare
from ucp.targets.dcp_save import Fetch
from ucp.targets.format import Request, TargetFormat, Written
from ucp.targets.run_folder import copy_entry, processes
from ucp.targets.verl_ranks import VerlLayout, model_file, optim_file, verl_layout

__all__ = ["FORMAT", "VerlResult", "write_verl", "MESH_DEVICES"]

logger = logging.getLogger(__name__)

#: the device types a verl run's mesh may have (its DTensors' mesh must equal the live ones on load)
MESH_DEVICES = ("cuda", "cpu", "npu")
_SOURCE_FORMAT = "verl-fsdp"


@dataclass
class VerlResult:
    """What was written, and what the user should know before resuming."""

    out: Path
    world: int
    version: int
    optimizer: str
    device: str
    notes: list[str] = field(default_factory=list)


def _source_folder(reader: Reader) -> VerlFolder | None:
    """The verl folder the reader reads, when it is one."""
    return find_verl(reader.inputs[0]) if reader.format == _SOURCE_FORMAT and reader.inputs else None


def _extra_states(root: Path, world: int, source: VerlFolder | None, extras: Mapping[str, Any]) -> list[str]:
    """Each rank's extra_state: a verl source's old rank ``r mod W_old`` file (its scheduler and RNG) when the
    scheduler is the one read; else the scheduler alone (verl then keeps the new run's RNG)."""
    scheduler = extras.get("lr_scheduler")
    same = source is not None and read_extra(source, 0).get("lr_scheduler") == scheduler
    for rank in range(world):
        name = verl_file(EXTRA, world, rank)
        if same:
            assert source is not None
            shutil.copyfile(source.paths(EXTRA)[rank % source.world], root / name)
        else:
            write_torch_file({"lr_scheduler": dict(scheduler) if isinstance(scheduler, Mapping) else None}, root / name)
    if same:
        assert source is not None
        if source.world == world:
            return []
        return [
            f"RNG states: new rank r takes old rank r mod {source.world}'s extra_state file; the old random streams "
            f"are not reproduced exactly at {processes(world)}"
        ]
    notes = ["no RNG state is written (the source has none verl reads): the resumed ranks keep their own seeds"]
    if scheduler is None:
        notes.append(
            "the source holds no lr scheduler state: extra_state's lr_scheduler is None (verl then keeps its own)"
        )
    return notes


def _place_files(root: Path, reader: Reader, source: VerlFolder | None) -> list[str]:
    """The actor folder's other entries of a verl source (``huggingface/``, ...), or a Trainer / Accelerate folder's
    model files as ``huggingface/``; a note when there is no ``huggingface/config.json`` (verl's merger reads it)."""
    if source is not None:
        for name in source.files:
            copy_entry(source.actor / name, root / name)
        if source.has_hf:
            return []
    else:
        folder = reader.facts.folder
        names = model_files(folder) if folder is not None else []
        if names:
            (root / HF_DIR).mkdir()
            for name in names:
                copy_entry(folder.path / name, root / HF_DIR / name)  # type: ignore[union-attr]  # names: a folder's
            return []
    return [f"no {HF_DIR}/ (the source has no model config): verl's load does not need it, its model merger does"]


def _write_ranks(
    root: Path, layout: VerlLayout, reader: Reader, lazy: Any, world: int, version: int, device: str
) -> None:
    """Every rank's model and optimizer files (each tensor read when written: a parameter is read once per rank)."""
    for rank in range(world):
        mesh = RankMesh(world, rank, device)
        model = model_file(layout, mesh, Fetch(reader, moments=False), lazy, plain=version == 1 and world == 1)
        write_torch_file(model, root / verl_file(MODEL, world, rank))
        write_torch_file(optim_file(layout, mesh, Fetch(reader), version), root / verl_file(OPTIM, world, rank))


def write_verl(
    src: str | os.PathLike[str] | Reader,
    out: str | os.PathLike[str],
    *,
    dp: int,
    fsdp_version: int | None = None,
    device: str | None = None,
    optimizer: str | None = None,
    step: StepPolicy = "keep",
    overwrite: bool | OutputPolicy = False,
    fsync: bool = False,
) -> VerlResult:
    """Write OUT: ``src`` (a path or a reader of any source) as a verl FSDP actor folder for ``dp`` processes, whole
    or not at all. ``fsdp_version`` 1 or 2 (default: a verl source's, else 2); ``device``: the new run's mesh device
    type (default: a verl source's, else cuda); ``optimizer``/``step`` as for a DCP output."""
    if dp < 1:
        raise ConfigError(f"--dp must be at least 1, got {dp}")
    if fsdp_version not in (None, 1, 2) or device not in (None, *MESH_DEVICES):
        raise ConfigError(f"--fsdp-version is 1 or 2 and --mesh-device one of {', '.join(MESH_DEVICES)}")
    with opened(src) as opened_reader:
        source = _source_folder(opened_reader)
        version = fsdp_version or (source.fsdp_version if source is not None and source.fsdp_version else 2)
        device = device or (mesh_device(source) if source is not None else None) or "cuda"
        reader, plan = prepare(opened_reader, optimizer, step)
        layout = verl_layout(reader.facts, plan.state, "optim")
        notes = list(plan.notes)
        with guarded_output(out, reader.inputs, overwrite, size=universal_bytes(reader.facts), durable=fsync) as root:
            with phase(f"write the verl FSDP{version} files for {processes(dp)}"):
                _write_ranks(root, layout, reader, plan.lazy, dp, version, device)
            notes += _extra_states(root, dp, source, reader.extras())
            (root / FSDP_CONFIG).write_text(fsdp_config_text(version, dp))
            notes += _place_files(root, reader, source)
    steps = reader.facts.info.global_steps
    notes.append(f"verl resumes from <dir>/global_step_{steps}/actor (with latest_checkpointed_iteration.txt: {steps})")
    if version == 1:
        notes.append("FSDP1 flat parameters laid out for verl's default wrap policy (one unit per decoder layer)")
    for note in notes:
        logger.debug("%s", note)
    return VerlResult(Path(out), dp, version, plan.flavour, device, notes)


def _write(reader: Reader, out: Path, request: Request) -> Written:
    if not request.has("dp"):
        raise ConfigError("--dp is the new run's number of processes: give it (verl names its files by it)")
    result = write_verl(
        reader, out, dp=int(request.get("dp")), fsdp_version=request.get("fsdp_version"),
        device=request.get("mesh_device"), optimizer=request.get("optimizer"), step=request.get("step"),
        overwrite=request.overwrite, fsync=request.fsync,
    )  # fmt: skip
    summary = (
        f"wrote a verl FSDP{result.version} actor folder for {processes(result.world)} ({result.optimizer}, "
        f"{result.device} mesh) to {out}"
    )
    fields = {"format": "verl-fsdp", "processes": result.world, "fsdp_version": result.version,
              "optimizer": result.optimizer, "mesh_device": result.device}  # fmt: skip
    return Written(summary, list(result.notes), fields)


def _refusal(options: list[Option], request: Request) -> str:
    flags = [o.flag for o in options]
    one = len(flags) == 1
    return (
        f"{', '.join(flags)} describe{'s' if one else ''} a DeepSpeed output; a verl actor folder holds fp32 masters "
        f"sharded by FSDP: drop {'it' if one else 'them'}"
    )


FORMAT = TargetFormat(
    name="verl-fsdp",
    label="a verl FSDP actor folder (FSDPCheckpointManager)",
    docs="format.md#10-verl-fsdp-checkpoints",
    write=_write,
    serves=lambda reader, request: False,  # only when asked for (--format verl-fsdp)
    refusal=_refusal,
)
