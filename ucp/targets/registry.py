"""The one list of formats ucp writes for a new run, and the one choice among them.

``ucp restore`` / ``ucp reshard`` and a migration's ``target`` both call :func:`choose` then :func:`write`; the
options each target takes are declared once in ``ucp.model.option_table``. Adding a target format is one module
that declares a :class:`~ucp.targets.format.TargetFormat` (its ``FORMAT``), its name in the option declarations
it takes, and one line in :data:`TARGET_FORMATS` (docs/design.md lists the steps).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ucp.errors import ConfigError
from ucp.frameworks.megatron_llama import LlamaShape
from ucp.io.small_files import read_small
from ucp.model.option_table import not_taken
from ucp.model.records import Reader
from ucp.targets import autoep, dcp, hf, hf_fsdp, megatron, moe, native, pipeline, verl
from ucp.targets.format import Request, TargetFormat, Written
from ucp.transforms.megatron_llama import LlamaAsMegatron, MegatronAsLlama

__all__ = ["TARGET_FORMATS", "target_format", "choose", "refuse_options", "write", "write_chosen", "across"]

#: every target, in the order their ``serves`` is asked when no format is named (the plain DeepSpeed checkpoint,
#: which serves any source, last; a DCP folder only when asked for)
TARGET_FORMATS: tuple[TargetFormat, ...] = (
    hf_fsdp.FORMAT,
    hf.FORMAT,
    autoep.FORMAT,
    moe.FORMAT,
    pipeline.FORMAT,
    dcp.FORMAT,
    megatron.FORMAT,
    verl.FORMAT,
    native.FORMAT,
)

_BY_NAME = {t.name: t for t in TARGET_FORMATS}


def target_format(name: str) -> TargetFormat:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ConfigError(f"no target format {name!r}; known: {', '.join(_BY_NAME)}") from None


def choose(reader: Reader, request: Request, asked: str | None = None) -> TargetFormat:
    """The target for ``reader`` under ``request``: the format ``asked`` for when it is one a user names (``dcp``),
    else the first that serves the source and the options (a Trainer folder gets a whole folder of its kind; a
    source with experts an expert target; ``pp`` a pipeline checkpoint; anything else a DeepSpeed checkpoint)."""
    if asked is not None and asked != native.FORMAT.name:
        return target_format(asked)
    return next(t for t in TARGET_FORMATS if t.serves(reader, request))


def refuse_options(target: TargetFormat, request: Request) -> None:
    """One line refusing every option given that ``target`` does not take, before anything is opened for writing."""
    extra = not_taken(target.name, dict(request.values))
    if extra:
        raise ConfigError(target.refuse(extra, request))


def write(reader: Reader, out: str | os.PathLike[str], request: Request, asked: str | None = None) -> Written:
    """Choose the target, refuse what it does not take, write OUT; what the write reports."""
    target = choose(reader, request, asked)
    refuse_options(target, request)
    return write_chosen(target, reader, out, request)


def write_chosen(target: TargetFormat, reader: Reader, out: str | os.PathLike[str], request: Request) -> Written:
    """``target`` writes OUT from ``reader`` as it needs to see it (:func:`across`)."""
    return target.write(across(reader, target, request), Path(out), request)


def across(reader: Reader, target: TargetFormat, request: Request) -> Reader:
    """``reader`` as ``target`` takes it across the Megatron border: a Megatron run as the Llama it is for any other
    target, a Llama run as Megatron-Core GPT for a Megatron one (its shape from ``--model-config`` or the source
    folder's ``config.json``)."""
    is_megatron = reader.facts.megatron is not None
    if target.name == megatron.FORMAT.name and not is_megatron:
        config = _model_config(reader, request)
        return LlamaAsMegatron(reader, LlamaShape.from_hf(config, int(request.get("pad_vocab"))))
    if target.name != megatron.FORMAT.name and is_megatron:
        return MegatronAsLlama(reader)
    return reader


def _model_config(reader: Reader, request: Request) -> dict[str, Any]:
    given = request.get("model_config")
    folder = reader.facts.folder
    if given:
        path = Path(given)
    elif folder is not None and "config.json" in folder.files:
        path = folder.path / "config.json"
    else:
        raise ConfigError(
            "a Llama-family run written as Megatron-Core needs its Hugging Face config.json: give --model-config FILE "
            "(the source is no Trainer folder holding one)"
        )
    try:
        config = json.loads(read_small(path, 1 << 20, "config.json"))
    except ValueError as err:
        raise ConfigError(f"{path} is not JSON: {err}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} holds no JSON object")
    return config
