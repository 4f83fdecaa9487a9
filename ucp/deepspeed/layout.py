"""Finding a DeepSpeed checkpoint's files and checking that they form one whole checkpoint."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ucp.errors import CorruptFileError, InputError
from ucp.io.atomic import owner_mark
from ucp.io.small_files import read_small

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
]

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


_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
#: a mixture-of-experts save without ZeRO: each expert-parallel rank's optimizer state_dict (0.19.8)
_EXPERT_OPTIM = re.compile(r"^expp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_Z3_MODEL = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_MODEL = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
_PIPELINE_LAYER = re.compile(r"^layer_(\d+)(?:-model_(\d+))?-model_states\.pt$")
_EXPERT = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
#: a FastPersist part: NAME-R.N, part R of N writers
_FAST_PART = re.compile(r"^(.+\.pt)-(\d+)\.(\d+)$")
#: the names DeepSpeed before 0.6 wrote (no MoE layer index); 0.19.8 only reads them
_OLD_EXPERT = re.compile(r"^expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")


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


def _safe_tag(name: str) -> bool:
    return bool(name) and name not in (".", "..") and not any(c in name for c in "/\\\x00") and len(name) <= 255


def read_latest(latest: Path) -> str:
    try:
        raw = read_small(latest, 4096, "'latest' file (one tag name)")
    except CorruptFileError:
        raise InputError(f"{latest} is too large to name a tag folder; fix the file or pass --tag") from None
    try:
        name = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        name = ""
    if len(raw) > 4096 or not name.isprintable() or not _safe_tag(name):
        raise InputError(f"{latest} names {raw[:60]!r}, which is not a tag folder; fix the file or pass --tag")
    return name


def resolve_tag_dir(src: Path, tag: str | None) -> tuple[Path, str]:
    """SRC may be the folder holding ``latest`` or a tag folder inside it."""
    if "\x00" in str(src) or (tag is not None and "\x00" in tag):
        raise InputError(f"{str(src)!r} (tag {tag!r}) holds a NUL byte; not a path")
    try:
        if not src.exists():
            raise InputError(f"{src} does not exist")
        if not src.is_dir():
            raise InputError(
                f"{src} is not a folder; give the checkpoint folder (the one holding 'latest') or a tag folder"
            )
        if tag is not None:
            tag_dir = src / tag
            if not tag_dir.is_dir():
                if src.name == tag:
                    return src, tag
                raise InputError(f"tag {tag!r} not found in {src}")
            return tag_dir, tag
        latest = src / LATEST
        if latest.is_file():
            name = read_latest(latest)
            if not (src / name).is_dir():
                raise InputError(f"{latest} names tag {name!r} but {src / name} does not exist")
            return src / name, name
        if any(src.glob("*_optim_states.pt")) or any(src.glob("*_model_states.pt")):
            return src, src.name
        trainer = (src / "trainer_state.json").is_file()
    except OSError as err:
        raise InputError(f"cannot read {src}: {err.strerror}") from None
    if trainer:  # a Hugging Face Trainer folder whose run saved no DeepSpeed state
        raise InputError(
            f"{src} is a Trainer folder without DeepSpeed state (a run without DeepSpeed, or save_only_model=True): "
            "it holds no optimizer state to move; its weights load with from_pretrained"
        )
    raise InputError(f"{src} holds no DeepSpeed checkpoint: no 'latest' file and no *_optim_states.pt files")


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


#: where a ZeRO-3 run offloading its optimizer to NVMe (ZeRO-Infinity) copies its swap files when it saves
NVME_FOLDER = "offloaded_tensors"


def nvme_swap_file(tag_dir: Path, rank: int, ds_id: str, key: str | None = None) -> Path:
    """The swap file of a ZeRO-Infinity save holding one sub-group's fp32 masters (``key`` None) or one of its
    optimizer states, on one rank: ``offloaded_tensors/rank<NN>/[<key>-]<ds_id>.tensor.swp``, where ``ds_id``
    names the sub-group by its first and last parameters' ids (``3_5``), as its flat tensor's ``ds_id`` says."""
    return tag_dir / NVME_FOLDER / f"rank{rank:0>2d}" / f"{'' if key is None else key + '-'}{ds_id}.tensor.swp"


def _fast_persist_names(tag_dir: Path, paths: list[Path]) -> dict[Path, str]:
    """FastPersist (``checkpoint.writer`` type ``fast``) at ZeRO-0/1/2 names each file ``NAME-R.N``: part R of N
    data-parallel writers (DeepSpeed 0.19.8 ``CheckpointWriterFactory``). One writer's part is the whole torch
    file, read under NAME; parts of several writers are refused (each writer frames its own share, and DeepSpeed's
    own load looks for NAME only)."""
    names: dict[Path, str] = {}
    for path in paths:
        m = _FAST_PART.match(path.name)
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


#: the field of ucp's stamp (ucp.io.atomic.mark_owned) naming the flavour of an optimizer written reset
RESET_MARK = "optimizer_reset"


def _find_files(tag_dir: Path, tag: str) -> CheckpointFiles:
    """:func:`find_checkpoint` once the tag folder is known."""
    optim: dict[tuple[int, int], Path] = {}
    z3_model: dict[tuple[int, int], Path] = {}
    model: dict[tuple[int, int], Path] = {}
    prefixes: set[bool] = set()
    try:
        paths = sorted(tag_dir.iterdir())
    except OSError as err:
        raise InputError(f"cannot list {tag_dir}: {err.strerror}") from None
    layers: list[tuple[int, int | None, Path]] = []
    experts: list[tuple[int, int, int, Path]] = []
    names = _fast_persist_names(tag_dir, paths)
    for path in paths:
        name = names.get(path, path.name)
        if m := _PIPELINE_LAYER.match(name):
            layers.append((int(m.group(1)), None if m.group(2) is None else int(m.group(2)), path))
        elif m := _EXPERT.match(name):
            experts.append((int(m.group(1)), int(m.group(2)), int(m.group(3)), path))
        elif _OLD_EXPERT.match(name):
            raise InputError(
                f"{tag_dir} holds {name}: expert files of DeepSpeed before 0.6 (no MoE layer index); "
                "ucp reads the layer_L_expert_E files later versions write: load and save it once with DeepSpeed"
            )
        elif m := _OPTIM.match(name):
            key = (int(m.group(3)), int(m.group(2)))
            if key in optim:
                raise InputError(f"{tag_dir}: both bf16_ and plain optim files exist for dp rank {key[1]}")
            optim[key] = path
            prefixes.add(bool(m.group(1)))
        elif m := _Z3_MODEL.match(name):
            key = (int(m.group(2)), int(m.group(1)))
            if key in z3_model:
                raise InputError(
                    f"{tag_dir}: two model files for dp rank {key[1]} mp rank {key[0]} "
                    f"({z3_model[key].name}, {path.name})"
                )
            z3_model[key] = path
        elif m := _MODEL.match(name):
            key = (int(m.group(1)), 0)
            if key in model:
                raise InputError(f"{tag_dir}: two model files for mp rank {key[0]} ({model[key].name}, {path.name})")
            model[key] = path
    if not optim:
        if model and not z3_model and not layers and not experts:
            # stage 0: DeepSpeed 0.19.8 writes only mp_rank_XX_model_states.pt, optimizer state inside
            model_grid = _grid(model, "model", tag_dir)
            return CheckpointFiles(tag_dir, tag, False, False, tuple(() for _ in model_grid), model_grid, stage0=True)
        if model and experts and any(_EXPERT_OPTIM.match(p.name) for p in tag_dir.iterdir()):
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


def _layer_key(entry: tuple[int, int | None, Path]) -> tuple[int, int]:
    return entry[0], -1 if entry[1] is None else entry[1]


def is_ds_universal(path: Path) -> bool:
    """A folder ds_to_universal wrote (whole or not): ``zero/`` beside model states or optimizer_state.pt.

    A native tag folder never has a ``zero/`` folder, and ucp's own universal format has ucp.json.
    """
    zero = path / "zero"
    if (path / "ucp.json").exists() or not zero.is_dir():
        return False
    return (path / UNIVERSAL_OPTIM).is_file() or any(path.glob("*model_states.pt"))


def find_ds_universal(path: Path, tag: str | None = None) -> Path | None:
    """The ds_to_universal folder PATH means (itself, its TAG, or what ``latest_universal`` names), else None.

    A folder holding both ``latest`` and ``latest_universal`` is read as the native checkpoint
    (both hold the same state); pass the universal folder's name as TAG to read that one.
    """
    if "\x00" in str(path) or (tag is not None and "\x00" in tag):
        return None
    try:
        if tag is not None:
            if is_ds_universal(path / tag):
                return path / tag
            return path if path.name == tag and is_ds_universal(path) else None
        if is_ds_universal(path):
            return path
        latest = path / LATEST_UNIVERSAL
        if latest.is_file() and not (path / "latest").is_file():
            name = read_latest(latest)
            if not (path / name).is_dir():
                raise InputError(
                    f"{latest} names {name!r} but {path / name} does not exist: ds_to_universal did not "
                    "finish, or its output folder was moved; pass the folder itself"
                )
            return path / name
    except OSError:
        return None
    return None


def ds_universal_model_files(root: Path, stage: int, dp: int) -> dict[int, Path]:
    """The model-states files ds_to_universal copied into ROOT, by DP rank: ZeRO-3's one per rank, ZeRO-1/2's
    one (rank 0). Files of the other stage, ranks beyond ``dp``, a missing rank-0 file and tensor-parallel
    output (an mp rank other than 0) are refused in one line."""
    ranks: dict[int, Path] = {}
    plain: list[Path] = []
    for path in sorted(root.glob("*model_states.pt")):
        z3, one = _Z3_MODEL.match(path.name), _MODEL.match(path.name)
        mp = z3.group(2) if z3 else one.group(1) if one else None
        if mp is not None and int(mp) != 0:
            raise InputError(
                f"{path.name} in {root} belongs to model-parallel rank {mp}: "
                "tensor-parallel ds_to_universal output is not supported yet"
            )
        if z3:
            ranks[int(z3.group(1))] = path
        elif one:
            plain.append(path)
    if stage != 3:
        if not plain:
            found = f" (only {next(iter(ranks.values())).name}, a ZeRO-3 file)" if ranks else ""
            raise InputError(
                f"mp_rank_00_model_states.pt is missing from {root}{found}: ds_to_universal copies it last, so "
                "the run did not finish; rerun it or copy it from the source tag folder"
            )
        return {0: plain[0]}
    if plain and not ranks:
        raise InputError(
            f"{root} holds {plain[0].name}, a ZeRO-1/2 model file, but {UNIVERSAL_OPTIM} says zero_stage=3: "
            "files of different checkpoints are mixed"
        )
    extra = sorted(r for r in ranks if r >= dp)
    if extra:
        raise InputError(
            f"{ranks[extra[0]].name} in {root} is beyond partition_count={dp} in {UNIVERSAL_OPTIM}: files of "
            "different checkpoints are mixed"
        )
    if 0 not in ranks:
        raise InputError(
            f"zero_pp_rank_0_mp_rank_00_model_states.pt is missing from {root}: ds_to_universal copies every "
            "rank's model states there; copy them from the source tag folder"
        )
    return dict(sorted(ranks.items()))
