"""Which tag folder of a DeepSpeed checkpoint a path means: itself, the tag given, or what ``latest`` names."""

from __future__ import annotations

import logging
from pathlib import Path

from ucp.deepspeed.file_names import LATEST
from ucp.errors import CorruptFileError, InputError
from ucp.io.small_files import read_small

__all__ = ["read_latest", "resolve_tag_dir"]

logger = logging.getLogger(__name__)


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
