"""Finding a folder ``ds_to_universal`` (DeepSpeed's own universal checkpoint) wrote, and the model-states files
it copied into it."""

from __future__ import annotations

import logging
from pathlib import Path

from ucp.deepspeed.file_names import LATEST_UNIVERSAL, MODEL_PATTERN, UNIVERSAL_OPTIM, Z3_MODEL_PATTERN
from ucp.deepspeed.tag_folder import read_latest
from ucp.errors import InputError

__all__ = ["is_ds_universal", "find_ds_universal", "ds_universal_model_files"]

logger = logging.getLogger(__name__)


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
        z3, one = Z3_MODEL_PATTERN.match(path.name), MODEL_PATTERN.match(path.name)
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
