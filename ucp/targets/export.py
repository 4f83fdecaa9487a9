"""Consolidated weights: a checkpoint's parameters and buffers as safetensors or a torch state dict.

Call order: :func:`export` opens a reader, :func:`plan_shards` splits the tensors into shards from
the facts alone (sizes are known before any tensor is read), then each shard is filled by reading
its parameters, written, and dropped, so memory stays near one shard. Output follows the Hugging
Face layout: one ``model.safetensors`` / ``pytorch_model.bin``, or numbered shards plus an index
(``*.index.json`` with ``metadata.total_size`` and ``weight_map``).

Weights are the fp32 masters cast to the export dtype (default: each parameter's dtype in the
model), which is exactly what the engine computes with. Tied aliases: safetensors refuses shared
tensors, so only the owner is stored and the aliases are listed in the metadata (``ucp_tied``);
a torch export stores the same tensor object under both names, in the owner's shard.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ucp.errors import ConfigError, InputError, OutputExistsError, UcpError
from ucp.frameworks.hf import CONFIG_DTYPES, config_in_dtype, model_files
from ucp.frameworks.verl import config_files
from ucp.io.atomic import PARTIAL_MARK, publish_new, remove_tree
from ucp.io.guard import Inputs, OutputPolicy, guarded, guarded_output, weight_bytes
from ucp.io.pool import default_workers
from ucp.io.safetensors_file import Entry, Source, write_safetensors
from ucp.io.signals import raise_if_stopped
from ucp.io.small_files import read_small
from ucp.io.timing import phase
from ucp.io.torchzip import write_torch_file
from ucp.model.cast import narrowed
from ucp.model.names import WRAPPER_PATTERN, has_wrapper
from ucp.model.pieces import Cast, LazyTensor
from ucp.model.records import DTYPES, Facts, Reader, torch_dtype
from ucp.sources import opened
from ucp.sources.registry import run_folder
from ucp.targets.blocks.stream import refuse_fp16_overflow
from ucp.transforms import Rename, TransformedReader, plan_transforms
from ucp.transforms.megatron_llama import MegatronAsLlama

__all__ = ["export", "parse_size", "plan_shards", "FORMATS", "TIED_KEY"]

logger = logging.getLogger(__name__)

#: format -> (single file name, shard stem, suffix)
FORMATS = {
    "safetensors": ("model.safetensors", "model", ".safetensors"),
    "torch": ("pytorch_model.bin", "pytorch_model", ".bin"),
}
_FILE_SUFFIXES = {"safetensors": (".safetensors",), "torch": (".bin", ".pt", ".pth")}
#: suffixes that name a file of another kind: an OUT ending in one is a mistake, not a folder name
_OTHER_FILE_SUFFIXES = frozenset(
    {".txt", ".json", ".yaml", ".yml", ".ckpt", ".npz", ".npy", ".h5", ".gguf", ".onnx", ".zip", ".tar", ".gz", ".pkl"}
)
#: metadata key (safetensors header and index ``metadata``) listing tied aliases: alias -> owner
TIED_KEY = "ucp_tied"

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(size: int | str) -> int:
    """Bytes from ``500MB`` (decimal units, as Hugging Face reads them), ``1.5GiB`` (binary), or an int."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        match = _SIZE.match(str(size))
        unit = match.group(2).lower() if match else ""
        if not match or unit not in _UNITS:
            raise ConfigError(f"max shard size {size!r} is not a size like 500MB, 5GB or 1.5GiB")
        value = int(float(match.group(1)) * _UNITS[unit])
    if value < 1:
        raise ConfigError(f"max shard size {size!r} must be at least one byte")
    return value


def plan_shards(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Split (name, bytes) in order into shards of at most ``max_bytes``; a bigger tensor gets its own."""
    shards: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name, nbytes in sizes:
        if current and used + nbytes > max_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += nbytes
    if current or not shards:
        shards.append(current)
    return shards


@dataclass(frozen=True)
class _Item(Entry):
    """One stored tensor: a parameter (read when written) or a buffer (already in memory)."""

    buffer: torch.Tensor | None = None


def _items(reader: Reader, dtype: str | None) -> list[_Item]:
    """Parameters as the model held them (or cast to ``dtype``); floating buffers cast only when asked."""
    items = []
    for meta in reader.facts.params:
        name = dtype or meta.dtype
        if name not in DTYPES:
            raise InputError(f"{meta.name} has model dtype {name!r}; export it with --dtype fp32, bf16 or fp16")
        items.append(_Item(meta.name, meta.shape, torch_dtype(name)))
    for name, tensor in reader.buffers().items():
        cast = dtype is not None and tensor.is_floating_point()
        tensor = narrowed(name, tensor, torch_dtype(dtype)) if cast and dtype else tensor
        items.append(_Item(name, tuple(tensor.shape), tensor.dtype, tensor.contiguous()))
    return items


def _resolve_out(out: Path, fmt: str) -> tuple[Path, str | None]:
    """(folder to stage, file name) for a file OUT; (folder, None) for a folder OUT."""
    if out.suffix in _FILE_SUFFIXES[fmt]:
        return out, out.name
    other = [s for f, suffixes in _FILE_SUFFIXES.items() if f != fmt for s in suffixes]
    if out.suffix in other:
        raise ConfigError(f"{out} ends in {out.suffix}, which does not fit --format {fmt}")
    if out.suffix.lower() in _OTHER_FILE_SUFFIXES:
        raise ConfigError(
            f"{out} ends in {out.suffix}, a file name, but a {fmt} export writes a {' or '.join(_FILE_SUFFIXES[fmt])} "
            "file or a folder: name one of those"
        )
    return out, None


def _save_torch(
    reader: Reader,
    items: list[_Item],
    aliases_of: Mapping[str, list[str]],
    fetch: Callable[[_Item], contextlib.AbstractContextManager[Source]],
    path: Path,
) -> None:
    """One torch shard through ucp's torch-zip writer, each tensor streamed when the writer reaches it: a
    reader whose pieces stay valid hands them over up front, any other reads one tensor at a time
    (:class:`LazyTensor`). A tied alias follows its owner as the same object: pickled once, one storage."""
    tensors: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        for item in items:
            if item.buffer is not None or reader.streams:
                tensors[item.name] = stack.enter_context(fetch(item))
            else:
                tensors[item.name] = LazyTensor(item.shape, item.dtype, partial(_whole, fetch, item))
            for alias in aliases_of.get(item.name, []):
                tensors[alias] = tensors[item.name]
        write_torch_file(tensors, path)


def _whole(fetch: Callable[[_Item], contextlib.AbstractContextManager[Source]], item: _Item) -> torch.Tensor:
    with fetch(item) as source:
        if isinstance(source, torch.Tensor):
            return source.reshape(item.shape)
        whole = source.source.join(item.dtype) if isinstance(source, Cast) else source.join()
        return whole.reshape(item.shape)


def export(
    src: str | os.PathLike | Reader,
    out: str | os.PathLike,
    *,
    format: str = "safetensors",
    dtype: str | None = None,
    max_shard_size: int | str = "5GB",
    tag: str | None = None,
    overwrite: bool | OutputPolicy = False,
    workers: int | None = None,
    folder: str | os.PathLike | None = None,
) -> list[Path]:
    """Write consolidated weights of ``src`` to ``out``; returns the files written (index last).

    ``out`` ending in ``.safetensors`` / ``.bin`` names one file (refused if it needs shards);
    any other ``out`` is a folder that gets the single file or the shards and their index, and, when
    ``folder`` (by default ``src`` itself, when a path) is a Hugging Face Trainer folder, its model files.
    Names lose torch.compile's ``_orig_mod.`` wrapper (a model compiled before deepspeed.initialize).
    OUT never is, lies inside or holds the source or ``folder``; ``overwrite`` replaces an earlier export.
    """
    if format not in FORMATS:
        raise ConfigError(f"--format must be one of {', '.join(FORMATS)}, got {format!r}")
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    max_bytes = parse_size(max_shard_size)
    out = Path(out).absolute()
    target, file_name = _resolve_out(out, format)
    with opened(src, tag=tag) as source:
        run = source.facts.folder if folder is None else run_folder(folder)
        carried = [run.path / name for name in model_files(run)] if run is not None and file_name is None else []
        if source.format == "verl-fsdp" and not carried and file_name is None:  # its huggingface/ files
            carried = config_files(folder if folder is not None else source.inputs[0])
        inputs = [*source.inputs, *([folder] if folder is not None else [])]
        reader = _unwrapped(source)
        llama = MegatronAsLlama(reader) if reader.facts.megatron is not None else None
        reader = llama or reader
        with _staged(target, file_name, inputs, overwrite, weight_bytes(reader.facts, dtype)) as stage, phase("export"):
            files = _export(
                reader, stage, target, file_name, format, dtype, max_bytes, workers or default_workers(), carried
            )
            if llama is not None and file_name is None:  # a Megatron run's model, as the Llama config builds it
                config = {**llama.shape.hf_config(), "torch_dtype": CONFIG_DTYPES[dtype or reader.facts.info.dtype]}
                (stage / "config.json").write_text(json.dumps(config, indent=2) + "\n")
                files.insert(-1 if len(files) > 1 else len(files), target / "config.json")
            return files


UNWRAPPED_NOTE = (
    "names written without torch.compile's _orig_mod. wrapper, as an uncompiled model's state_dict has them"
)


def export_notes(reader: Reader) -> list[str]:
    """What an export of ``reader`` says besides its files: the source's own notes (a ZenFlow run's matrices read
    in the model's shape, a save without optimizer state, ...) and a name change it makes."""
    return list(reader.facts.warnings) + ([UNWRAPPED_NOTE] if _compiled(reader.facts) else [])


def _compiled(facts: Facts) -> bool:
    """Names under torch.compile's ``_orig_mod.`` wrapper."""
    return has_wrapper([m.name for m in facts.params] + list(facts.tied) + list(facts.buffer_names))


def _unwrapped(reader: Reader) -> Reader:
    """Names as a model's ``state_dict`` has them: without torch.compile's ``_orig_mod.`` wrapper, which a model
    compiled before deepspeed.initialize saves under (``from_pretrained`` and a plain model know no such names)."""
    facts = reader.facts
    if not _compiled(facts):
        return reader
    logger.info(UNWRAPPED_NOTE)
    return TransformedReader(reader, plan_transforms(facts, [Rename(WRAPPER_PATTERN, r"\1")]))


#: a config.json larger than this is copied as it is, not rewritten for --dtype
_CONFIG_LIMIT = 16 << 20


def _carry(path: Path, dest: Path, dtype: str | None) -> None:
    """Copy a model file beside the weights; ``config.json`` names ``dtype`` when the export casts to it."""
    if dtype is not None and path.name == "config.json" and path.stat().st_size <= _CONFIG_LIMIT:
        text = config_in_dtype(read_small(path, _CONFIG_LIMIT, "config.json"), dtype)
        if text is not None:
            dest.write_bytes(text)
            return
    shutil.copyfile(path, dest)


def _export(
    reader: Reader,
    stage: Path,
    out: Path,
    file_name: str | None,
    fmt: str,
    dtype: str | None,
    max_bytes: int,
    workers: int,
    carried: list[Path],
) -> list[Path]:
    """The export's files into the staging folder ``stage``; returns where they will lie once published."""
    facts = reader.facts
    for alias, owner in facts.tied.items():
        if owner not in {p.name for p in facts.params}:
            raise InputError(f"tied alias {alias!r} points at {owner!r}, which is not a parameter of the checkpoint")
    items = _items(reader, dtype)
    by_name = {item.name: item for item in items}
    shards = plan_shards([(item.name, item.nbytes) for item in items], max_bytes)
    if file_name is not None and len(shards) > 1:
        raise ConfigError(
            f"the export needs {len(shards)} shards of at most {max_bytes:,} bytes; give a folder as "
            f"OUT instead of the file {out.name}, or raise --max-shard-size"
        )
    single, stem, suffix = FORMATS[fmt]
    names = (
        [file_name or single]
        if len(shards) == 1
        else [f"{stem}-{i + 1:05d}-of-{len(shards):05d}{suffix}" for i in range(len(shards))]
    )
    aliases_of: dict[str, list[str]] = {}
    for alias, owner in facts.tied.items():
        aliases_of.setdefault(owner, []).append(alias)

    fp16 = [item.name for item in items if item.buffer is None and item.dtype == torch.float16]
    refuse_fp16_overflow(reader, fp16)  # before anything is written, a chunk at a time

    @contextlib.contextmanager
    def fetch(item: _Item) -> Iterator[Source]:
        """One tensor's bytes as the writer copies them: the master's pieces, cast chunk by chunk when the
        export's dtype differs (a weight is never whole in memory, unless its reader only reads whole)."""
        if item.buffer is not None:
            yield item.buffer
            return
        with reader.read_pieces(item.name, moments=False) as state:
            yield state.fp32 if state.fp32.dtype == item.dtype else Cast(state.fp32, item.dtype)

    weight_map: dict[str, str] = {}
    total = 0
    for shard, file in zip(shards, names):
        tied = {alias: name for name in shard for alias in aliases_of.get(name, [])}
        for name in shard:
            weight_map[name] = file
            total += by_name[name].nbytes
            if fmt == "torch":  # a torch file holds the alias too, right after its owner
                weight_map.update(dict.fromkeys(aliases_of.get(name, []), file))
        if fmt == "torch":
            _save_torch(reader, [by_name[n] for n in shard], aliases_of, fetch, stage / file)
        else:
            metadata = {"format": "pt", **({TIED_KEY: json.dumps(tied, sort_keys=True)} if tied else {})}
            write_safetensors(
                stage / file, [by_name[n] for n in shard], fetch, metadata, workers=workers, desc=f"export {file}"
            )
        logger.info("wrote %s (%d tensors, %d tied aliases)", file, len(shard), len(tied))
    written = [out / file for file in names] if file_name is None else [out]
    if len(shards) > 1:
        index: dict[str, Any] = {"metadata": {"total_size": total}, "weight_map": weight_map}
        if facts.tied:
            index["metadata"][TIED_KEY] = dict(facts.tied)
        index_name = f"{single}.index.json"
        (stage / index_name).write_text(json.dumps(index, indent=2, sort_keys=False) + "\n")
        written.append(out / index_name)
    for path in carried:
        _carry(path, stage / path.name, dtype)
        written.append(out / path.name)
    return written


@contextlib.contextmanager
def _staged(
    out: Path, file_name: str | None, inputs: Inputs, overwrite: bool | OutputPolicy, size: int
) -> Iterator[Path]:
    """Where the export's files are built, inside the guard (``ucp.io.guard``): a folder OUT is staged by
    :func:`~ucp.io.guard.guarded_output`; a file OUT is written beside itself under a temporary name and renamed
    into place, so a failure leaves no half file."""
    if file_name is None:
        with guarded_output(out, inputs, overwrite, size=size) as root:
            yield root
        return
    with guarded(out, inputs, overwrite, size=size) as policy:
        if out.is_dir():
            raise OutputExistsError(f"{out} is a folder; an export to a file does not replace it")
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise UcpError(f"cannot create {out.parent}: {err.strerror}") from None
        # the name ucp.io.atomic recognises as a leftover, so a later run for OUT clears it after a kill
        stage = out.parent / f".{out.name}{PARTIAL_MARK}{secrets.token_hex(4)}-{os.getpid()}"
        stage.mkdir()
        try:
            yield stage
            staged = stage / file_name
            with open(staged, "rb") as handle:
                os.fsync(handle.fileno())
            raise_if_stopped()  # a stop whose exception a library swallowed: never publish (as staged_output)
            if policy.overwrite:
                os.replace(staged, out)
            else:  # never over a file another run published meanwhile
                publish_new(staged, out)
        finally:
            remove_tree(stage)
