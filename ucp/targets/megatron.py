"""A Megatron-Core ``torch_dist`` checkpoint that Megatron-LM's ``load_checkpoint`` resumes at any TP / PP / DP:
the distributed optimizer's state ``fully_reshardable`` (per model key, the model's own global layout), which
megatron-core reshards on load (``ucp.frameworks.megatron`` describes the files).

OUT is a Megatron-LM run folder: ``latest_checkpointed_iteration.txt`` and ``iter_NNNNNNN/`` with ``metadata.json``,
``common.pt`` (the source run's args with the new parallel sizes, the param groups with their step, its lr schedule)
and the DCP items, written by DCP's own writer one chunk per layer so that memory stays near one parameter:
every model key and ``optimizer.state.{param, exp_avg, ...}.<key>``, the layers' ``_extra_state`` objects and, when
TP and PP stay, the RNG state (copied byte for byte; Megatron-LM loads it only then).
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ucp.errors import ConfigError, InputError
from ucp.frameworks.megatron import (
    COMMON,
    FULLY,
    LATEST_ITERATION,
    METADATA_JSON,
    iteration_dir,
    split_layer,
    state_key,
)
from ucp.io.guard import OutputPolicy, guarded_output, universal_bytes
from ucp.io.standins import Namespace
from ucp.io.timing import phase
from ucp.io.torchzip import write_torch_file
from ucp.model.option_table import Option
from ucp.model.pieces import Cast, Pieces
from ucp.model.records import Facts, Reader
from ucp.sources import opened
from ucp.targets.dcp_save import Fetch, streaming_writer
from ucp.targets.format import Request, TargetFormat, Written

__all__ = ["FORMAT", "MegatronPlan", "plan_megatron", "write_megatron"]

logger = logging.getLogger(__name__)

_BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
            "common_backend_version": 1}  # fmt: skip
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Chunk:
    """One DCP item: ``key``'s box at ``offsets`` (the layer's, for a stacked key), filled from ``name``'s ``what``
    (``model``: its weight at the model dtype; ``param``: its fp32 master; else an optimizer state key)."""

    key: str
    size: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: torch.dtype
    name: str
    what: str


@dataclass
class MegatronPlan:
    """What OUT will hold: the tensor chunks, the byte items, ``common.pt``, and the parallel sizes it names."""

    chunks: list[Chunk]
    objects: dict[str, Any]
    common: dict[str, Any]
    iteration: int
    tp: int
    pp: int
    dp: int
    notes: list[str] = field(default_factory=list)


def _keys(facts: Facts) -> dict[str, tuple[tuple[int, ...], list[str]]]:
    """Every checkpoint key: its global shape and its parameters by layer (one for a key of its own)."""
    keys: dict[str, tuple[tuple[int, ...], list[str]]] = {}
    for meta in facts.params:
        key, layer = split_layer(meta.name)
        shape, names = keys.get(key, (meta.shape, []))
        if shape != meta.shape:
            raise InputError(f"{meta.name}: shape {meta.shape}, other layers' {shape}")
        if layer is not None and layer != len(names):
            raise InputError(f"{meta.name}: the layers of {key} are not numbered 0, 1, ... in order")
        keys[key] = (shape, [*names, meta.name])
    return {k: ((len(n), *s) if k.startswith("decoder.layers.") else s, n) for k, (s, n) in keys.items()}


def plan_megatron(facts: Facts) -> MegatronPlan:
    """The checkpoint's items from the facts alone. ``args`` keep the layout the source was saved at: Megatron-LM
    compares it with the resuming run's to decide whether the RNG state (copied as saved) applies."""
    run = facts.megatron
    if run is None:
        raise ConfigError(
            "a Megatron-Core checkpoint is written from a Megatron one (its model config and names); from another "
            "framework's Llama run see docs/format.md section 9"
        )
    chunks: list[Chunk] = []
    model_dtype = {m.name: _DTYPES.get(m.dtype, torch.float32) for m in facts.params}
    trained = {n for g in facts.groups for n in g.params}
    states = sorted({k for g in facts.groups for k in g.state_keys})
    for key, (size, names) in _keys(facts).items():
        stacked = key.startswith("decoder.layers.")
        for layer, name in enumerate(names):
            offsets = (layer, *([0] * (len(size) - 1))) if stacked else (0,) * len(size)
            sizes = (1, *size[1:]) if stacked else size
            chunks.append(Chunk(key, size, offsets, sizes, model_dtype[name], name, "model"))
            if name in trained:
                for what in ("param", *states):
                    chunks.append(Chunk(state_key(what, key), size, offsets, sizes, torch.float32, name, what))
    step = facts.step or 0
    groups = [{**g.raw, "step": float(g.step if g.step is not None else step)} for g in facts.groups]
    args = dict(run.args)
    iteration = int(facts.info.iteration or facts.info.global_steps)
    args["iteration"] = iteration
    content = {**dict(run.common.get("content_metadata") or {}), "distrib_optim_sharding_type": FULLY}
    common = {
        **{k: v for k, v in run.common.items() if k != "content_metadata"},
        "args": Namespace(**args),
        "iteration": iteration,
        "optimizer": {"optimizer": {"param_groups": groups}, "param_state_sharding_type": FULLY},
        "content_metadata": content,
    }
    common.setdefault("checkpoint_version", 3.0)
    objects = {**run.objects, **{key: io.BytesIO(blob) for key, blob in run.rng.items()}}
    plan = MegatronPlan(chunks, objects, common, iteration, run.tp, run.pp, run.dp)
    rng = (
        f"its RNG state (saved at tp={run.tp} pp={run.pp}) only at the same TP and PP"
        if run.rng
        else "the source has no Megatron RNG state, so the run starts its own (the args say no_save_rng)"
    )
    plan.notes.append(f"Megatron-LM loads it at any TP, PP and DP; {rng}")
    if run.sharding != FULLY:
        plan.notes.append(f"the optimizer state is written {FULLY} (the source's was {run.sharding}): Megatron loads it "
                          "at any TP, PP and DP")  # fmt: skip
    return plan


class _Fetch:
    """A chunk's tensor from :class:`~ucp.targets.dcp_save.Fetch` (one tensor read at a time), in its dtype and sizes."""

    def __init__(self, reader: Reader) -> None:
        self.fetch = Fetch(reader)

    def __call__(self, chunk: Chunk) -> torch.Tensor:
        tensor = self.fetch(chunk.name, self._key(chunk))
        return tensor.to(chunk.dtype).reshape(chunk.sizes).contiguous()

    def pieces(self, chunk: Chunk) -> Pieces | Cast | None:
        """The chunk as pieces of the source's files in its sizes, cast to its dtype as written; None where it is
        not a whole fp32 state (then :meth:`__call__`'s tensor is written)."""
        found = self.fetch.pieces(chunk.name, self._key(chunk))
        if found.dtype != torch.float32 or found.numel != math.prod(chunk.sizes):
            return None
        sized = Pieces(found.parts, tuple(chunk.sizes), found.dtype)
        return sized if chunk.dtype == torch.float32 else Cast(sized, chunk.dtype)

    @staticmethod
    def _key(chunk: Chunk) -> str:
        return "fp32" if chunk.what in ("model", "param") else chunk.what


def _save(plan: MegatronPlan, root: Path, fetch: _Fetch, fsync: bool) -> None:
    """DCP's own writer, with the plan's chunks as write items (one file, this process)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    by_index: dict[tuple[str, tuple[int, ...]], Chunk] = {}
    items: list[WriteItem] = []
    for chunk in plan.chunks:
        index = MetadataIndex(chunk.key, torch.Size(chunk.offsets))
        by_index[(chunk.key, chunk.offsets)] = chunk
        data = TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size(chunk.offsets), sizes=torch.Size(chunk.sizes)),
            properties=TensorProperties(dtype=chunk.dtype),
            size=torch.Size(chunk.size),
        )
        items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=data))
    items += [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO) for key in plan.objects]

    class Planner(DefaultSavePlanner):
        def create_local_plan(self) -> SavePlan:
            self.plan = SavePlan(items)
            return self.plan

        def resolve_data(self, write_item: Any) -> Any:
            if write_item.type == WriteItemType.BYTE_IO:
                value = plan.objects[write_item.index.fqn]
                if isinstance(value, io.BytesIO):
                    return value
                buffer = io.BytesIO()
                torch.save(value, buffer)
                return buffer
            return fetch(by_index[(write_item.index.fqn, tuple(write_item.index.offset))])

    def pieces_of(write_item: Any) -> Pieces | Cast | None:
        return fetch.pieces(by_index[(write_item.index.fqn, tuple(write_item.index.offset))])

    writer = streaming_writer(root, fsync, pieces_of)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({}, storage_writer=writer, planner=Planner(flatten_state_dict=False), no_dist=True)


def write_megatron(
    source: str | os.PathLike[str] | Reader,
    out: str | os.PathLike[str],
    *,
    overwrite: bool | OutputPolicy = False,
    fsync: bool = False,
) -> MegatronPlan:
    """Write ``source`` (a Megatron checkpoint) as a Megatron-LM run folder at ``out`` that Megatron-LM resumes at
    any TP, PP and DP, whole or not at all."""
    with opened(source) as reader:
        plan = plan_megatron(reader.facts)
        size = universal_bytes(reader.facts)
        with guarded_output(out, reader.inputs, overwrite, size=size, durable=fsync) as root:
            folder = iteration_dir(root, plan.iteration)
            folder.mkdir()
            with phase("write the torch_dist checkpoint"):
                _save(plan, folder, _Fetch(reader), fsync)
            (folder / METADATA_JSON).write_text(json.dumps(_BACKEND))
            write_torch_file(plan.common, folder / COMMON)
            (root / LATEST_ITERATION).write_text(str(plan.iteration))
    return plan


def _write(reader: Reader, out: Path, request: Request) -> Written:
    plan = write_megatron(reader, out, overwrite=request.overwrite, fsync=request.fsync)
    summary = (
        f"wrote a Megatron-Core torch_dist checkpoint (iteration {plan.iteration}, optimizer {FULLY}, for any TP, PP "
        f"and DP) to {out}"
    )
    fields = {"format": "megatron", "tp": plan.tp, "pp": plan.pp, "dp": plan.dp, "iteration": plan.iteration}
    return Written(summary, list(plan.notes), fields)


def _refusal(options: list[Option], request: Request) -> str:
    flags = [o.flag for o in options]
    one = len(flags) == 1
    return (
        f"{', '.join(flags)} {'does' if one else 'do'} not apply to --format megatron: its optimizer state is "
        f"written {FULLY}, which Megatron-LM loads at any TP, PP and DP; drop {'it' if one else 'them'}"
    )


FORMAT = TargetFormat(
    name="megatron",
    label="a Megatron-Core torch_dist checkpoint",
    docs="format.md#9-megatron-core-torch_dist",
    write=_write,
    serves=lambda reader, request: False,  # only when asked for (--format megatron)
    refusal=_refusal,
)
