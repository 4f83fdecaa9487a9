"""Finding a DeepSpeed checkpoint's files and checking that they form one whole checkpoint.

The files' names are :mod:`ucp.deepspeed.file_names`', which tag folder a path means :mod:`ucp.deepspeed.tag_folder`'s,
and ds_to_universal's folders :mod:`ucp.deepspeed.ds_universal_files`'; their names are importable from here too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ucp.deepspeed.ds_universal_files import ds_universal_model_files, find_ds_universal, is_ds_universal
from ucp.deepspeed.file_names import (
    EXPERT_OPTIM_PATTERN,
    EXPERT_PATTERN,
    FAST_PART_PATTERN,
    LATEST,
    LATEST_UNIVERSAL,
    MODEL_PATTERN,
    NVME_FOLDER,
    OLD_EXPERT_PATTERN,
    OPTIM_PATTERN,
    PIPELINE_LAYER_PATTERN,
    RESET_MARK,
    UNIVERSAL_MODEL_FILES,
    UNIVERSAL_OPTIM,
    Z3_MODEL_PATTERN,
    expert_file,
    layer_file,
    model_file,
    nvme_swap_file,
    optim_file,
    zero3_model_file,
)
from ucp.deepspeed.tag_folder import read_latest, resolve_tag_dir
from ucp.errors import InputError
from ucp.io.atomic import owner_mark

__all__ = [
    "NVME_FOLDER",
    "nvme_swap_file",
    "CheckpointFiles",
    "find_checkpoint",
    "resolve_tag_dir",
    "read_latest",
    "optim_file",
    "zero3_model_file",
    "model_file",
    "layer_file",
    "expert_file",
    "LATEST",
    "LATEST_UNIVERSAL",
    "UNIVERSAL_OPTIM",
    "UNIVERSAL_MODEL_FILES",
    "is_ds_universal",
    "find_ds_universal",
    "ds_universal_model_files",
    "RESET_MARK",
]


@dataclass(frozen=True)
class CheckpointFiles:
    """The rank files of one tag folder, indexed [mp rank][dp rank]."""

    tag_dir: Path
    tag: str
    stage3: bool  # per-rank model states (ZeRO-3) rather than one per mp rank
    bf16_prefix: bool
    optim: tuple[tuple[Path, ...], ...]
    model: tuple[tuple[Path, ...], ...]  # ZeRO-3: [mp][dp]; ZeRO-1/2: [mp][0]
    #: a pipeline run's per-layer weight files, (layer index, TP rank or None, path) in layer order;
    #: empty for any other run. Then the mp ranks are the (stage, TP rank) pairs, stage-major.
    layers: tuple[tuple[int, int | None, Path], ...] = ()
    #: a legacy MoE run's expert weight files, (MoE layer, global expert, mp rank, path) in that order;
    #: empty for any other run
    experts: tuple[tuple[int, int, int, Path], ...] = ()
    #: saved without ZeRO (stage 0, DeepSpeed's default): no optim files; each mp rank's model-states file
    #: holds the whole model and the optimizer's own state_dict (``optim`` is then one empty row per mp rank)
    stage0: bool = False
    #: ucp wrote this checkpoint with the optimizer reset (``ucp restore --step reset``): the flavour it was written
    #: for, from ucp's stamp beside ``latest`` (the files hold a fresh optimizer, which no state tells apart)
    reset_flavour: str | None = None

    @property
    def dp(self) -> int:
        return len(self.optim[0])

    @property
    def mp(self) -> int:
        return len(self.optim)


def _grid(
    found: dict[tuple[int, int], Path], what: str, tag_dir: Path, name_of: Callable[[int, int], str] | None = None
) -> tuple[tuple[Path, ...], ...]:
    mps = sorted({mp for mp, _ in found})
    if mps != list(range(len(mps))):
        shown = ", ".join(map(str, mps[:8])) + (", ..." if len(mps) > 8 else "")
        raise InputError(f"{tag_dir}: {what} files cover mp ranks {shown}; expected 0..{len(mps) - 1}")
    rows = []
    for mp in mps:
        dps = sorted(dp for m, dp in found if m == mp)
        if dps != list(range(len(dps))):
            # rank numbers come from file names: find the first gap without counting up to them
            first = next(i for i, dp in enumerate(dps) if dp != i)
            if name_of is not None:
                raise InputError(
                    f"rank file {name_of(mp, first)} (dp rank {first}) is missing from "
                    f"{tag_dir}: higher ranks are there; copy the whole tag folder"
                )
            raise InputError(f"{tag_dir}: {what} file for dp rank {first} (mp rank {mp}) is missing")
        rows.append(tuple(found[(mp, dp)] for dp in dps))
    if len({len(r) for r in rows}) != 1:
        raise InputError(f"{tag_dir}: mp ranks hold different numbers of {what} files")
    return tuple(rows)


def _fast_persist_names(tag_dir: Path, paths: list[Path]) -> dict[Path, str]:
    """FastPersist (``checkpoint.writer`` type ``fast``) at ZeRO-0/1/2 names each file ``NAME-R.N``: part R of N
    data-parallel writers (DeepSpeed 0.19.8 ``CheckpointWriterFactory``). One writer's part is the whole torch
    file, read under NAME; parts of several writers are refused (each writer frames its own share, and DeepSpeed's
    own load looks for NAME only)."""
    names: dict[Path, str] = {}
    for path in paths:
        m = FAST_PART_PATTERN.match(path.name)
        if m is None:
            continue
        if int(m.group(3)) != 1:
            raise InputError(
                f"{tag_dir} holds {path.name}: a FastPersist save split over {m.group(3)} data-parallel writers "
                "(checkpoint.writer type fast), which neither DeepSpeed 0.19.8's load nor ucp reads; save with "
                "checkpoint.writer.data_parallel unset or with the python writer to move the run"
            )
        names[path] = m.group(1)
    return names


def find_checkpoint(src: Path, tag: str | None = None) -> CheckpointFiles:
    """Index the rank files of a DeepSpeed checkpoint (ZeRO-1/2/3, or stage 0: model-states files only) and
    refuse incomplete or mixed sets."""
    tag_dir, tag = resolve_tag_dir(Path(src), tag)
    files = _find_files(tag_dir, tag)
    mark = owner_mark(tag_dir.parent)
    reset = mark.get(RESET_MARK) if mark is not None else None
    return dataclasses.replace(files, reset_flavour=reset) if isinstance(reset, str) else files


@dataclass
class _Found:
    """The rank files a tag folder holds, by kind, keyed (mp rank, dp rank) where ranked."""

    optim: dict[tuple[int, int], Path] = field(default_factory=dict)
    z3_model: dict[tuple[int, int], Path] = field(default_factory=dict)
    model: dict[tuple[int, int], Path] = field(default_factory=dict)
    prefixes: set[bool] = field(default_factory=set)
    layers: list[tuple[int, int | None, Path]] = field(default_factory=list)
    experts: list[tuple[int, int, int, Path]] = field(default_factory=list)


def _find_files(tag_dir: Path, tag: str) -> CheckpointFiles:
    """:func:`find_checkpoint` once the tag folder is known."""
    try:
        paths = sorted(tag_dir.iterdir())
    except OSError as err:
        raise InputError(f"cannot list {tag_dir}: {err.strerror}") from None
    found = _sort_files(tag_dir, paths)
    optim, z3_model, model, prefixes = found.optim, found.z3_model, found.model, found.prefixes
    layers, experts = found.layers, found.experts
    if not optim:
        return _without_optim(tag_dir, tag, found)
    if len(prefixes) > 1:
        raise InputError(f"{tag_dir} mixes bf16_ and plain optim files: two runs were saved into one tag")
    bf16 = prefixes.pop()
    if z3_model:
        for mp, dp in sorted(set(z3_model) - set(optim)):
            raise InputError(
                f"rank file {optim_file(dp, mp, bf16=bf16)} is missing from {tag_dir}: its model-states file is there; copy the whole tag folder"
            )
        for mp, dp in sorted(set(optim) - set(z3_model)):
            raise InputError(
                f"rank file {zero3_model_file(dp, mp)} is missing from "
                f"{tag_dir}: its optim-states file is there; copy the whole tag folder"
            )
    optim_grid = _grid(optim, "optim", tag_dir, lambda mp, dp: optim_file(dp, mp, bf16=bf16))
    if z3_model:
        model_grid = _grid(z3_model, "model", tag_dir, lambda mp, dp: zero3_model_file(dp, mp))
        if len(model_grid) != len(optim_grid) or len(model_grid[0]) != len(optim_grid[0]):
            raise InputError(
                f"{tag_dir}: {sum(map(len, model_grid))} model files but {sum(map(len, optim_grid))} optim files"
            )
        stage3 = True
    elif model:
        model_grid = _grid(model, "model", tag_dir)
        if len(model_grid) != len(optim_grid):
            raise InputError(f"{tag_dir}: model files for {len(model_grid)} mp ranks, optim for {len(optim_grid)}")
        stage3 = False
    else:
        raise InputError(f"{tag_dir} has optim files but no *_model_states.pt")
    if layers and stage3:
        raise InputError(
            f"{tag_dir} holds pipeline layer files and ZeRO-3 rank files: PipelineEngine runs ZeRO-0/1 only, "
            "so two runs were saved into one tag"
        )
    return CheckpointFiles(
        tag_dir,
        tag,
        stage3,
        bf16,
        optim_grid,
        model_grid,
        tuple(sorted(layers, key=_layer_key)),
        tuple(sorted(experts)),
    )


def _sort_files(tag_dir: Path, paths: list[Path]) -> _Found:
    """The tag folder's rank, layer and expert files by kind; two files for one rank, or expert files of
    DeepSpeed before 0.6, are refused."""
    found = _Found()
    optim, z3_model, model = found.optim, found.z3_model, found.model
    names = _fast_persist_names(tag_dir, paths)
    for path in paths:
        name = names.get(path, path.name)
        if m := PIPELINE_LAYER_PATTERN.match(name):
            found.layers.append((int(m.group(1)), None if m.group(2) is None else int(m.group(2)), path))
        elif m := EXPERT_PATTERN.match(name):
            found.experts.append((int(m.group(1)), int(m.group(2)), int(m.group(3)), path))
        elif OLD_EXPERT_PATTERN.match(name):
            raise InputError(
                f"{tag_dir} holds {name}: expert files of DeepSpeed before 0.6 (no MoE layer index); "
                "ucp reads the layer_L_expert_E files later versions write: load and save it once with DeepSpeed"
            )
        elif m := OPTIM_PATTERN.match(name):
            key = (int(m.group(3)), int(m.group(2)))
            if key in optim:
                raise InputError(f"{tag_dir}: both bf16_ and plain optim files exist for dp rank {key[1]}")
            optim[key] = path
            found.prefixes.add(bool(m.group(1)))
        elif m := Z3_MODEL_PATTERN.match(name):
            key = (int(m.group(2)), int(m.group(1)))
            if key in z3_model:
                raise InputError(
                    f"{tag_dir}: two model files for dp rank {key[1]} mp rank {key[0]} "
                    f"({z3_model[key].name}, {path.name})"
                )
            z3_model[key] = path
        elif m := MODEL_PATTERN.match(name):
            key = (int(m.group(1)), 0)
            if key in model:
                raise InputError(f"{tag_dir}: two model files for mp rank {key[0]} ({model[key].name}, {path.name})")
            model[key] = path
    return found


def _without_optim(tag_dir: Path, tag: str, found: _Found) -> CheckpointFiles:
    """A tag folder without optim files: a stage-0 save, else refused saying what it is."""
    model, z3_model, layers, experts = found.model, found.z3_model, found.layers, found.experts
    if model and not z3_model and not layers and not experts:
        # stage 0: DeepSpeed 0.19.8 writes only mp_rank_XX_model_states.pt, optimizer state inside
        model_grid = _grid(model, "model", tag_dir)
        return CheckpointFiles(tag_dir, tag, False, False, tuple(() for _ in model_grid), model_grid, stage0=True)
    if model and experts and any(EXPERT_OPTIM_PATTERN.match(p.name) for p in tag_dir.iterdir()):
        raise InputError(
            f"{tag_dir} is a mixture-of-experts save without ZeRO (expp_rank_*_optim_states.pt, each expert-parallel "
            "rank's optimizer state_dict): ucp does not read it yet; MoE saves at ZeRO-1/2 are read"
        )
    if model and layers and not z3_model:
        raise InputError(
            f"{tag_dir} is a pipeline save without ZeRO and without optim files (fp32: each stage's optimizer "
            "state in its model-states file, nothing naming its layers): ucp does not read it yet; bf16 ones "
            "(BF16_Optimizer) and ZeRO-1 pipelines are read"
        )
    raise InputError(
        f"{tag_dir} holds no *_optim_states.pt files: not a ZeRO checkpoint (or saved without optimizer state)"
    )


def _layer_key(entry: tuple[int, int | None, Path]) -> tuple[int, int]:
    return entry[0], -1 if entry[1] is None else entry[1]
